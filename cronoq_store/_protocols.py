"""What the store is to its callers, as ``typing.Protocol``s.

The scheduler's engine needs :class:`Store` (leadership, write-ahead commits, recovery);
tools that only look at tasks need :class:`StoreQueries`. Keeping them apart lets such tools
run against any instance, leader or not. The group committer needs :class:`Committable`.
``commit`` is declared once, in :class:`SupportsCommit`, which both extend.
:class:`~cronoq_store._store.PgStore` implements all three; so does
:class:`cronoq_store.testing.InMemoryStore`, for applications' unit tests, and
tests/contract runs one suite against the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ._domain import Mutation, TaskId, TaskRef, TaskStatus, TimeBase
from ._results import Recovered, TaskRecord
from .telemetry import Telemetry

__all__ = ["Committable", "Store", "StoreQueries", "SupportsCommit"]


@runtime_checkable
class StoreQueries(Protocol):
    """Look-ups and housekeeping over stored tasks; safe on any instance."""

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref``, or the newest task with key ``ref``."""
        ...

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks in id order, above ``after``; empty filters match everything."""
        ...

    async def prune(self, older_than: float) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago that no
        live task depends on; returns how many were deleted."""
        ...

    @property
    def is_leader(self) -> bool:
        """Whether this instance currently holds leadership."""
        ...

    async def leadership_lost(self) -> None:
        """Return once leadership held by this instance is lost."""
        ...


class SupportsCommit(Protocol):
    """Write-ahead commits: the one declaration of ``commit``, which the scheduler's engine
    calls through :class:`Store` and the group committer through :class:`Committable`."""

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        """Write ``batch`` and ``outputs`` in one transaction; return only once committed.

        Idempotent. Raises ``FencedError`` when ``epoch`` is no longer current (only a
        fence of this instance's current epoch ends its term: a late commit of an earlier
        term is refused, and the term goes on) and ``UnavailableError`` when the database
        cannot be reached in time.
        """
        ...


class Committable(SupportsCommit, Protocol):
    """What the group committer needs of a store (``PgStore`` and ``InMemoryStore`` both
    are one): its commits, the largest batch it accepts, where it records, and whether the
    database answers.

    ``max_commit_bytes`` is read for every batch, so a limit lowered at run time holds for
    the next one. ``ping`` tells an outage (it fails) from a batch at fault (it answers
    while the batch keeps failing transiently)."""

    @property
    def max_commit_bytes(self) -> int:
        """The largest batch ``commit`` accepts, in bytes as ``_commit_path.batch_size``
        estimates them; a larger one fails with ``BatchTooLargeError`` before anything is
        sent."""
        ...

    @property
    def telemetry(self) -> Telemetry:
        """Where the committer records its batches, retries and queue depth."""
        ...

    async def ping(self) -> None:
        """Return once the database answers; raise ``StoreError`` if it does not."""
        ...


@runtime_checkable
class Store(SupportsCommit, Protocol):
    """The scheduler engine's persistence: one leader writes, every commit is fenced."""

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch."""
        ...

    async def release_leadership(self) -> None:
        """Give leadership up, so a standby can take over at once."""
        ...

    async def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume, engine times through ``base``."""
        ...

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded; ``None`` otherwise."""
        ...
