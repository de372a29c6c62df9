"""What the group committer holds: a submission and its states, a batch in flight, and the
internal errors and helpers its writer and settling share (:mod:`cronoq_store._group_commit`)."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from typing import Protocol, TypeAlias, TypeVar

from ._batch_order import Footprint
from ._domain import TaskId, TimeBase
from ._errors import ClusterReplacedError, FencedError, SchemaGoneError, StoreError
from ._mutations import Mutation
from ._sizing import mutation_size, output_size

__all__ = [
    "Abandoned",
    "Flight",
    "Output",
    "State",
    "Stuck",
    "Submission",
    "SupportsCommit",
    "chained",
    "fenced_error",
    "outputs_of",
    "store_error",
]

Output: TypeAlias = tuple[TaskId, bytes]

_E = TypeVar("_E", bound=BaseException)


class SupportsCommit(Protocol):
    """All the committer needs of a store: ``PgStore`` and any ``Store`` qualify."""

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        """Write ``batch`` and ``outputs`` in one idempotent transaction; return once it
        committed. ``FencedError``: stop writing; transient ``StoreError``: retry."""
        ...


class State(enum.Enum):
    QUEUED = "queued"  # accepted, waiting for a batch
    TAKEN = "taken"  # in a batch: committed or failed as a whole, even if cancelled
    DROPPED = "dropped"  # cancelled while queued: skipped by the writer
    SETTLED = "settled"  # acknowledged or failed


class Submission:
    __slots__ = ("future", "mutations", "outputs", "size", "started", "state", "weight")

    def __init__(
        self,
        mutations: tuple[Mutation, ...],
        outputs: tuple[Output, ...],
        future: asyncio.Future[None],
        started: float,
    ) -> None:
        self.mutations = mutations
        self.outputs = outputs
        self.future = future
        self.started = started
        # Each mutation and output is a row to write; an empty submission (a barrier) still
        # takes a place in the queue.
        self.weight = max(1, len(mutations) + len(outputs))
        # Bytes on the wire, from above: the estimate PgStore.commit checks too.
        self.size = sum(map(mutation_size, mutations)) + sum(map(output_size, outputs))
        self.state = State.QUEUED


class Flight:
    """A batch in flight: its submissions, its footprint, the task committing it."""

    __slots__ = ("footprint", "subs", "task")

    def __init__(self, subs: list[Submission], footprint: Footprint) -> None:
        self.subs = subs
        self.footprint = footprint
        self.task: asyncio.Task[None] | None = None


class Stuck(Exception):
    """Internal: a batch kept failing transiently although the database answered."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


class Abandoned(Exception):
    """Internal: the committer was closed while a batch was still being retried."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


def store_error(exc: Exception) -> StoreError | None:
    """What the committer retries: a store's transient errors; any other error is raised."""
    return exc if isinstance(exc, StoreError) else None


def fenced_error(what: str, cause: FencedError) -> FencedError:
    """The error of a submitter after ``cause`` fenced the committer, of the same kind: a
    :class:`ClusterReplacedError` or a :class:`SchemaGoneError` stays one (no other
    instance leads this store's cluster then; its tables are gone)."""
    if isinstance(cause, ClusterReplacedError):
        # Its message names what the cause found; `what` is the committer's story, which
        # the cause chained to each submitter's error tells.
        return ClusterReplacedError(
            cause.schema, cause.incarnation, cause.found, "committing this submission"
        )
    if isinstance(cause, SchemaGoneError):
        return SchemaGoneError(f"{what}; this instance must not write any more")
    return FencedError(f"{what}; another instance leads, so this instance must not write any more")


def chained(error: _E, cause: BaseException | None) -> _E:
    """``error`` with ``cause`` attached as if raised ``from cause``; each submitter gets an
    instance of its own, so concurrent raises do not share one traceback."""
    error.__cause__ = cause
    return error


def outputs_of(batch: list[Submission]) -> list[Output]:
    """The outputs of ``batch``'s submissions, in order."""
    return [o for sub in batch for o in sub.outputs]
