"""What the scheduler programs against: the store as two ``typing.Protocol``s.

The scheduler's engine needs :class:`Store` (leadership, write-ahead commits, recovery);
tools that only look at tasks need :class:`StoreQueries`. Keeping them apart lets such tools
run against any instance, leader or not. :class:`~cronoq_store._store.PgStore` implements
both; so does :class:`cronoq_store.testing.InMemoryStore`, for applications' unit tests,
and tests/contract runs one suite against the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ._domain import TaskId, TaskRef, TaskStatus, TimeBase
from ._mutations import Mutation
from ._stored_values import Recovered, TaskRecord

__all__ = ["Store", "StoreQueries"]


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


@runtime_checkable
class Store(Protocol):
    """The scheduler engine's persistence: one leader writes, every commit is fenced."""

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch."""
        ...

    async def release_leadership(self) -> None:
        """Give leadership up, so a standby can take over at once."""
        ...

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

    async def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume, engine times through ``base``."""
        ...

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded; ``None`` otherwise."""
        ...
