"""The group committer: many concurrent submitters, few transactions, each acknowledged once
durable.

A transaction costs about the same for one mutation as for a thousand (round trips, not rows,
dominate: see docs/performance.md), so the scheduler's submitters should share them.
:class:`GroupCommitter` queues their submissions, and commits them in batches: while one
commit is in flight the next batch accumulates, so batches grow with load and no timer adds
latency when the system is idle. Several batches are in flight at once, each on a connection
of its own (``max_batches_in_flight``): commits share the fence (a share lock of the leader
row, docs/reliability.md), so their WAL flushes overlap, and the next batch is cut and folded
while earlier ones commit. A submitter's ``await`` returns only once the transaction holding
its mutations has committed.

The committer is four objects, each owning its own state:

* :class:`Admission`, the line in front of it: submissions accepted and not yet settled,
  the bound on them, first come first served;
* :class:`Flights`, the batches in flight: how many at once, and which earlier one a batch
  must wait for (:class:`Footprint`);
* :class:`Settling`, how submissions end: acknowledged, failed, or failed together when the
  committer is closed, fenced or broken; it owns that fate (closing, aborting, fenced);
* :class:`GroupCommitter`, the public API and the loop that cuts batches (:class:`Merge`),
  commits each through its retry policy (:class:`CommitRetry`) and bisects a failing one.

What it needs of a store is :class:`~cronoq_store._store.Committable`: ``commit``,
``ping``, ``telemetry`` and ``max_commit_bytes``; ``PgStore`` and ``InMemoryStore`` are one.

Failures are sorted by who they belong to:

* ``UnavailableError`` (transient) belongs to the database: the same batch is retried after
  the pauses of :class:`~cronoq_store._retry.Backoff`; commits are idempotent, so a retry of
  a batch that did land changes nothing. Unless the database answers while the batch keeps
  failing: then the batch is at fault (a server that closes the connection on it, a
  statement timeout it always hits) and is treated as if the error were not transient.
* ``FencedError`` belongs to this instance: another leader took over, so nothing may be
  written again. Every queued submitter fails with it and the committer closes; no batch
  is attempted again. Each other batch in flight settles by its attempt under way (each
  checks the epoch itself): one that landed before the takeover is acknowledged.
* Any other error belongs to some submission (a duplicate key aborts the whole transaction):
  the batch is bisected, halves committed in order, until only the guilty submissions fail.

Batches are bounded by rows and by bytes (:mod:`cronoq_store._commit_path`), far below what
PostgreSQL accepts in one message.

Where a batch ends, and which batches in flight it waits for
-------------------------------------------------------------

Every submitter gets the answer, and the rows end as, committing the same submissions one
at a time in the order accepted would give. One commit folds its batch by the rules of
:mod:`cronoq_store._commit_path`: updates before inserts, a new task inserted in its latest
state, outputs after both. So a batch may merge submissions only where no later one changes
how an earlier one is answered. :class:`Merge` ends a batch (cuts) before a submission that

* finishes a task (a terminal ``StatusChanged``) that may hold a key an earlier submission
  of the batch gives a task. Serially that key was still held when it was claimed, or the
  claiming task was live and checked; merged, the update frees the key first, and a task
  inserted finished is not checked. A task may hold such a key unless the committer
  committed its ``Submitted`` with another key or none (:func:`learn`): a task stored
  before it started (recovered from an earlier term), sent again, or still in flight
  may hold any key;
* submits a task an earlier submission moved: serially there was no row to move yet (when
  the task was not stored), merged the task is inserted in the state the transition gave;
* makes a task succeed after an earlier submission gave it an output: serially the output
  was dropped (only a succeeded task keeps one), merged it is stored.

Every other merge gives the serial outcome. A submission that fails alone fails the merged
batch too (an id or key another task holds, two tasks under one id, two live tasks under one
key, a value out of range): the batch is then bisected in order until only the failing
submissions fail, which is the serial answer. The rules hold between pairs of submissions,
on facts that stay true (a committed task keeps its key), so every run of a batch that a
bisection commits obeys them too.

Two batches commute when no row either writes can be seen by the other: then whichever
commits first, the rows are the same, and the later one may commit beside the earlier
(:class:`Footprint`). A batch must wait for an earlier one still in flight when they share

* a task: its mutations land in submission order (a ``StatusChanged`` whose ``Submitted``
  is in an earlier, uncommitted batch would find no row to move), and so do its outputs;
* a recurring schedule: its changes apply in order;
* anything, when it holds a barrier (an empty submission returns once everything
  submitted before it is settled);
* a key, as far as the committer can tell: a new task's key may be freed by a terminal
  transition of a task whose key the batch does not carry (a task of an earlier term), so
  a batch that gives a live task a key waits for every earlier batch that finishes a task
  or gives out a key it gives, and a batch that finishes a task waits for every earlier
  batch that gives out a key (serially, that batch met the key still held).

Keys and schedule names are compared as stored (:func:`~cronoq_store._domain.clean_text`):
two names that differ only where PostgreSQL cannot store a character are one row.
Both rules are conservative: they may cut or order submissions that would merge or
commute, never the reverse.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeAlias, TypeVar

from ._commit_path import mutation_size, output_size
from ._domain import (
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskStatus,
    TimeBase,
    check_seconds,
    clean_text,
    unhandled,
)
from ._errors import (
    ClusterReplacedError,
    CommitterClosedError,
    FencedError,
    IdCollisionError,
    KeyTakenError,
    SchemaGoneError,
    StoreError,
)
from ._results import CommitterStats, Tally
from ._retry import COMMIT_BACKOFF, Backoff, Retry, pause
from ._store import Committable
from .telemetry import Telemetry

__all__ = ["DEFAULT_BATCHES_IN_FLIGHT", "GroupCommitter"]

#: Batches in flight at once by default: measured on 2 cores with WAL flushed at every
#: commit (docs/performance.md, "Batches in flight: the default").
DEFAULT_BATCHES_IN_FLIGHT = 2

#: Refusals that are the submitter's own outcome (a key another live task holds, an id
#: another task has): the submitter gets the error and decides, so the log says it at
#: debug level. A failure of the database's, or a bug, stays a warning.
CALLERS_OWN = (KeyTakenError, IdCollisionError)

logger = logging.getLogger("cronoq_store")

Output: TypeAlias = tuple[TaskId, bytes]

_E = TypeVar("_E", bound=BaseException)


# --- where a batch ends, and which batches in flight it follows -----------------------------


_SUCCEEDED = TaskStatus.SUCCEEDED


def learn(known: dict[int, str | None], mutations: Iterable[Mutation]) -> None:
    """Record in ``known`` what the committed ``mutations`` tell of their tasks' keys.

    A task whose ``Submitted`` committed is stored with its key (or none) for good: ids are
    never issued twice, and a stored id refuses another task. A task committed finished is
    forgotten, so ``known`` holds no more tasks than are live: it holds no key any more, and
    forgetting it only makes a later cut more cautious."""
    for m in mutations:
        match m:
            case Submitted(id=id, spec=spec):
                known[id] = None if spec.key is None else clean_text(spec.key)
            case StatusChanged(id=id, status=status):
                if status.is_terminal:
                    known.pop(id, None)
            case RecurringUpsert() | RecurringRemove() | RecurringNext():
                pass  # schedules hold no task's key
            case _:
                unhandled(m)


class Merge:
    """The submissions of the batch being cut, as far as the answer of a later one merged
    with them depends on them; ``known``: the keys :func:`learn` recorded (read, not kept
    up to date by this batch)."""

    __slots__ = ("_claimed", "_known", "_moved", "_outputs")

    def __init__(self, known: Mapping[int, str | None]) -> None:
        self._known = known
        self._claimed: set[str] = set()  # keys given to tasks
        self._moved: set[int] = set()  # tasks with a transition
        self._outputs: set[int] = set()  # tasks given an output

    def take(self, mutations: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]]) -> bool:
        """Add a submission to the batch, or return ``False`` (and add nothing) where its
        merged outcome, or an earlier one's, could differ from committing them one at a
        time: the batch ends before it. The first submission is always taken."""
        claimed, moved, given = self._claimed, self._moved, self._outputs
        if claimed or moved or given:
            known = self._known
            for m in mutations:
                match m:
                    case Submitted(id=id):
                        if id in moved:
                            return False
                    case StatusChanged(id=id, status=status):
                        if not status.is_terminal:
                            continue
                        if claimed and (id not in known or known[id] in claimed):
                            return False
                        if status is _SUCCEEDED and id in given:
                            return False
                    case RecurringUpsert() | RecurringRemove() | RecurringNext():
                        pass  # schedule changes are folded in submission order
                    case _:
                        unhandled(m)
        for m in mutations:
            match m:
                case Submitted(spec=spec):
                    if spec.key is not None:
                        claimed.add(clean_text(spec.key))
                case StatusChanged(id=id):
                    moved.add(id)
                case RecurringUpsert() | RecurringRemove() | RecurringNext():
                    pass
                case _:
                    unhandled(m)
        if outputs:
            given.update(id for id, _ in outputs)
        return True


@dataclass(slots=True)
class Footprint:
    """What a batch touches that orders it against other batches."""

    #: Tasks it submits, moves or gives an output.
    ids: set[int] = field(default_factory=set)
    #: Keys it gives to new live tasks.
    keys: set[str] = field(default_factory=set)
    #: Whether it finishes a task (and so may free a key it does not name).
    finishes: bool = False
    #: Recurring schedules it changes.
    schedules: set[str] = field(default_factory=set)
    #: Whether it holds a barrier (an empty submission): it follows every earlier batch.
    barrier: bool = False

    def follows(self, earlier: Footprint) -> bool:
        """Whether this batch must wait for ``earlier``, submitted before it, to settle."""
        if self.barrier:
            return True
        if not self.ids.isdisjoint(earlier.ids):
            return True
        if not self.schedules.isdisjoint(earlier.schedules):
            return True
        if self.keys and (earlier.finishes or not self.keys.isdisjoint(earlier.keys)):
            return True
        return self.finishes and bool(earlier.keys)


def footprint(
    mutations: Iterable[Mutation],
    outputs: Sequence[tuple[TaskId, bytes]] = (),
    *,
    barrier: bool = False,
) -> Footprint:
    """The footprint of a batch of ``mutations`` and ``outputs`` (``barrier``: it holds an
    empty submission)."""
    found = Footprint(barrier=barrier)
    ids = found.ids
    for mutation in mutations:
        match mutation:
            case Submitted(id=id, spec=spec):
                ids.add(id)
                if spec.key is not None:
                    found.keys.add(clean_text(spec.key))
            case StatusChanged(id=id, status=status):
                ids.add(id)
                if status.is_terminal:
                    found.finishes = True
            case RecurringUpsert(spec=spec):
                found.schedules.add(clean_text(spec.name))
            case RecurringRemove(name=name) | RecurringNext(name=name):
                found.schedules.add(clean_text(name))
            case _:
                # A type with no footprint here would order itself against no other batch.
                unhandled(mutation)
    ids.update(id for id, _ in outputs)
    return found


# --- a submission, a batch in flight ---------------------------------------------------------


class State(enum.Enum):
    QUEUED = "queued"  # accepted, waiting for a batch
    TAKEN = "taken"  # in a batch: committed or failed as a whole, even if cancelled
    DROPPED = "dropped"  # cancelled while queued: skipped when batches are cut
    SETTLED = "settled"  # acknowledged or failed


class Submission:
    """One ``submit`` call: what it commits, the future its submitter awaits, its state."""

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

    __slots__ = ("_footprint", "subs", "task")

    def __init__(self, subs: list[Submission]) -> None:
        self.subs = subs
        self._footprint: Footprint | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def footprint(self) -> Footprint:
        """What orders this batch against the others in flight, worked out the first time
        another batch is: a batch that flies alone (every batch, when the submitters all
        wait on the one before) never pays for it."""
        if self._footprint is None:
            subs = self.subs
            self._footprint = footprint(
                (m for sub in subs for m in sub.mutations),
                [o for sub in subs for o in sub.outputs],
                barrier=any(not sub.mutations and not sub.outputs for sub in subs),
            )
        return self._footprint


class Stuck(Exception):
    """A batch kept failing transiently although the database answered."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


class Abandoned(Exception):
    """The committer was closed while a batch was still being retried."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


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


def fenced_submission(exc: FencedError) -> FencedError:
    """The error of a submission not confirmed durable when ``exc`` fenced the committer."""
    return chained(
        fenced_error(f"fenced before this submission was confirmed durable: {exc}", exc),
        exc,
    )


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


# --- the collaborators: admission, batches in flight, settling --------------------------------


class Admission:
    """The line in front of the committer: submissions accepted and not yet settled (queued
    or in flight), bounded by ``max_pending`` rows, first come first served.

    A submitter waiting for room keeps its place in line, and none passes it while anyone
    waits; with nobody waiting and room, no lock is taken (the common case costs nothing).
    A submission larger than the bound is admitted once nothing else is pending.
    """

    __slots__ = (
        "_line",
        "_max_pending",
        "_tally",
        "_waiting",
        "pending",
        "queue",
        "room",
        "rows",
        "wakeup",
    )

    def __init__(self, max_pending: int, tally: Tally) -> None:
        self._max_pending = max_pending
        self._tally = tally
        #: Accepted and not yet taken into a batch, in order (dropped ones skipped later).
        self.queue: deque[Submission] = deque()
        #: Submissions pending (queued or in flight), and their rows.
        self.pending = 0
        self.rows = 0
        #: Set when room was made (or the committer refuses submissions from now on).
        self.room = asyncio.Event()
        #: Set when a submission was queued (or the committer is closing): the loop looks.
        self.wakeup = asyncio.Event()
        self._line = asyncio.Lock()
        self._waiting = 0

    def has_room(self, weight: int) -> bool:
        return self.pending == 0 or self.rows + weight <= self._max_pending

    def admit_now(self, sub: Submission) -> bool:
        """Queue ``sub`` at once if nobody waits for room and there is room for it: the
        common case, without the cost of a coroutine per submission."""
        if self._waiting or not self.has_room(sub.weight):
            return False
        self._enqueue(sub)
        return True

    async def admit(self, sub: Submission, settling: Settling) -> None:
        """Queue ``sub`` once there is room; raises as :meth:`Settling.refuse_if_closed`
        does if the committer stops taking submissions first."""
        if self.admit_now(sub):
            return
        self._waiting += 1
        try:
            async with self._line:
                while True:
                    settling.refuse_if_closed()
                    if self.has_room(sub.weight):
                        break
                    self.room.clear()
                    await self.room.wait()
                self._enqueue(sub)
        finally:
            self._waiting -= 1

    def _enqueue(self, sub: Submission) -> None:
        self.queue.append(sub)
        self.pending += 1
        self.rows += sub.weight
        self._tally.submissions += 1
        self.wakeup.set()

    def drop(self, sub: Submission) -> None:
        """``sub``'s submitter cancelled before a batch took it: it will never be sent."""
        sub.state = State.DROPPED
        self.release(sub)
        self._tally.dropped += 1

    def release(self, sub: Submission) -> None:
        """``sub`` settled (or was dropped): its room goes to the line."""
        self.pending -= 1
        self.rows -= sub.weight
        self.room.set()

    def release_many(self, count: int, rows: int) -> None:
        """``count`` submissions of ``rows`` rows in all settled at once."""
        self.pending -= count
        self.rows -= rows
        self.room.set()


class Flights:
    """The batches in flight: at most ``max_flights`` at once, each committed by a task of
    its own, each sent only once no earlier one it follows (:meth:`Footprint.follows`) is
    still in flight."""

    __slots__ = ("_max_flights", "flying", "settled")

    def __init__(self, max_flights: int) -> None:
        self._max_flights = max_flights
        #: In the order they were cut.
        self.flying: list[Flight] = []
        #: Set when a batch in flight settled (or an abort began): waiters look again.
        self.settled = asyncio.Event()

    async def room(self, settling: Settling) -> bool:
        """Wait until fewer than ``max_flights`` batches are in flight; ``False`` once the
        committer aborts."""
        while len(self.flying) >= self._max_flights and not settling.aborting:
            self.settled.clear()
            await self.settled.wait()
        return not settling.aborting

    async def until_followed(self, flight: Flight, settling: Settling) -> None:
        """Wait until no batch in flight is one ``flight`` must follow (or an abort)."""
        while not settling.aborting and any(
            flight.footprint.follows(earlier.footprint) for earlier in self.flying
        ):
            self.settled.clear()
            await self.settled.wait()

    def land(self, flight: Flight) -> None:
        """``flight`` settled: it no longer holds back any later batch."""
        self.flying.remove(flight)
        self.settled.set()

    async def landed(self) -> None:
        """Wait for every batch in flight to settle."""
        tasks = [flight.task for flight in self.flying if flight.task is not None]
        if tasks:
            await asyncio.wait(tasks)


class Settling:
    """How the committer's submissions end, and the committer's fate that decides it:
    closing (no new submissions), aborting (stop committing, fail what is left), fenced
    (another instance leads), or dead of a bug (``failure``).

    Every submission ends here exactly once: acknowledged, or failed with its own error or
    with the committer's; none is left waiting.
    """

    __slots__ = (
        "_admission",
        "_epoch",
        "_flights",
        "_tally",
        "abort_event",
        "aborting",
        "closing",
        "failure",
        "fenced",
    )

    def __init__(self, epoch: int, admission: Admission, flights: Flights, tally: Tally) -> None:
        self._epoch = epoch
        self._admission = admission
        self._flights = flights
        self._tally = tally
        self.closing = False
        self.aborting = False
        #: Set with ``aborting``: pauses between retries end at once.
        self.abort_event = asyncio.Event()
        self.fenced: FencedError | None = None
        self.failure: BaseException | None = None

    def refuse_if_closed(self) -> None:
        """Raise what a new submission gets from a committer that takes no more."""
        if self.fenced is not None:
            raise fenced_error(
                f"the group committer was fenced ({self.fenced})", self.fenced
            ) from self.fenced
        if self.failure is not None:
            raise CommitterClosedError(
                f"the group committer stopped after an internal failure: {self.failure!r}"
            ) from self.failure
        if self.closing:
            raise CommitterClosedError("the group committer is closed; submission refused")

    def close(self) -> None:
        """Take no more submissions; those waiting for room are refused."""
        self.closing = True
        self._admission.room.set()
        self._admission.wakeup.set()

    def acknowledge_all(self, subs: list[Submission], now: float) -> None:
        """Settle a committed batch's submissions, the counters updated once for all."""
        weight = mutations = 0
        latencies: list[float] = []
        for sub in subs:
            if sub.state is State.SETTLED:
                continue
            sub.state = State.SETTLED
            weight += sub.weight
            mutations += len(sub.mutations)
            latencies.append(now - sub.started)
            if not sub.future.done():  # a submitter cancelled in flight is not waiting
                sub.future.set_result(None)
        self._admission.release_many(len(latencies), weight)
        self._tally.acknowledge(mutations, latencies)

    def fail(self, sub: Submission, error: BaseException) -> None:
        if sub.state is State.SETTLED or sub.state is State.DROPPED:
            return
        sub.state = State.SETTLED
        self._admission.release(sub)
        self._tally.failed += 1
        if not sub.future.done():
            sub.future.set_exception(error)

    def fail_queued(self, make_error: Callable[[], BaseException]) -> None:
        queue = self._admission.queue
        while queue:
            sub = queue.popleft()
            if sub.state is State.QUEUED:
                self.fail(sub, make_error())

    def fail_in_flight(
        self, make_error: Callable[[], BaseException], flights: Sequence[Flight] | None = None
    ) -> None:
        for flight in self._flights.flying if flights is None else flights:
            for sub in flight.subs:
                if sub.state is State.TAKEN:
                    self.fail(sub, make_error())

    def fail_unsent(self, subs: list[Submission]) -> None:
        """Fail a batch that was cut but never sent: the committer aborted meanwhile."""
        fenced = self.fenced
        for sub in subs:
            self.fail(
                sub,
                fenced_submission(fenced)
                if fenced is not None
                else CommitterClosedError(
                    "the group committer stopped before this submission's batch was sent; "
                    "it was not committed"
                ),
            )

    def abandoned(self, flight: Flight, cause: StoreError) -> None:
        """Fail ``flight``, whose retries stopped because the committer stopped."""
        fenced = self.fenced
        if fenced is not None:  # another batch was fenced while this one was retried
            self.fail_in_flight(lambda: fenced_submission(fenced), [flight])
        self.fail_in_flight(
            lambda: chained(
                CommitterClosedError(
                    "the group committer was closed while this submission's batch was "
                    f"being retried (last error: {cause}); it may or may not have been "
                    "committed"
                ),
                cause,
            ),
            [flight],
        )

    def abort(self, reason: str) -> None:
        """Stop committing: queued submissions fail now (they were never sent); each batch
        in flight fails unless its current attempt commits."""
        self.aborting = True
        self.abort_event.set()
        self._admission.wakeup.set()
        self._flights.settled.set()
        self.fail_queued(
            lambda: CommitterClosedError(
                f"the group committer was closed ({reason}); this submission was not committed"
            )
        )

    def on_fenced(self, exc: FencedError) -> None:
        """A commit was fenced: nothing may be written again, by any batch."""
        self.fenced = exc
        self.closing = True
        self.aborting = True
        logger.error(
            "the group committer was fenced; failing every pending submission",
            extra={
                "epoch": self._epoch,
                "error": str(exc),
                "pending_submissions": self._admission.pending,
            },
        )
        self.abort_event.set()  # batches being retried stop at once
        self._admission.wakeup.set()
        self._flights.settled.set()
        # The other batches in flight settle by their own attempt: one that passed its
        # check before the takeover has landed (the bump waited for it) and is acknowledged;
        # any other is fenced by its own check, or abandoned as fenced.
        self.fail_queued(lambda: fenced_submission(exc))

    def on_death(self, exc: BaseException, message: str) -> None:
        """The committer's loop or a batch's task died (cancelled, or a bug): fail every
        pending submission, since nothing will settle them now."""
        if self.failure is None:
            self.failure = exc
        self.aborting = True
        self.abort_event.set()
        self._flights.settled.set()

        def closed() -> CommitterClosedError:
            return chained(
                CommitterClosedError(f"{message}; this submission may not have been committed"),
                exc,
            )

        self.fail_in_flight(closed)
        self.fail_queued(closed)

    def stopped(self) -> None:
        """The committer's loop ended: whatever is still queued was never sent."""
        self.closing = True
        self.aborting = True
        self._admission.room.set()
        self.fail_queued(
            lambda: CommitterClosedError(
                "the group committer stopped; this submission was not committed"
            )
        )


class CommitRetry(Retry):
    """The retry policy of one batch's commit: transient failures retried after the
    committer's backoff until the batch commits, until the committer aborts (``Abandoned``)
    or until the batch is stuck (``Stuck``).

    From ``stuck_after`` consecutive failures on, it asks the store's ``ping()`` whether the
    database answers: a batch that fails again between two answered pings is stuck. A
    database that does not answer is an outage, retried as long as it lasts.
    """

    __slots__ = ("_answered", "_ping", "_rows", "_settling", "_stuck_after", "_tally", "_telemetry")

    def __init__(
        self,
        backoff: Backoff,
        *,
        settling: Settling,
        ping: Callable[[], Awaitable[object]],
        stuck_after: int,
        tally: Tally,
        telemetry: Telemetry,
        rows: int,
    ) -> None:
        super().__init__(backoff)
        self._settling = settling
        self._ping = ping
        self._stuck_after = stuck_after
        self._tally = tally
        self._telemetry = telemetry
        self._rows = rows
        #: The database answered a ping since the last failed attempt.
        self._answered = False

    async def next_pause(self, error: StoreError, failures: int) -> float:
        if self._settling.aborting:
            raise Abandoned(error)
        if failures >= self._stuck_after:
            # Answered before and after the attempt that just failed: the batch's fault.
            before = self._answered
            self._answered = await self._answers()
            if self._answered and before:
                raise Stuck(error)
        delay = await super().next_pause(error, failures)
        self._tally.retries += 1
        if self._telemetry.enabled:
            self._telemetry.retried()
        logger.warning(
            "commit failed transiently; retrying the same batch",
            extra={
                "error": str(error),
                "attempt": failures,
                "delay": delay,
                "batch_mutations": self._rows,
            },
        )
        return delay

    async def wait(self, seconds: float, error: StoreError) -> None:
        settling = self._settling
        if settling.aborting or await pause(seconds, settling.abort_event):
            raise Abandoned(error)

    async def _answers(self) -> bool:
        """Whether the store's ``ping()`` says the database answers."""
        try:
            await self._ping()
        except StoreError as exc:
            self._tally.unanswered_pings += 1
            logger.warning(
                "the database does not answer; retrying the batch until it does",
                extra={"error": str(exc)},
            )
            return False
        return True


# --- the committer ---------------------------------------------------------------------------


class GroupCommitter:
    """Turns many concurrent submitters into few transactions, each acked once durable.

    One committer serves one leadership term: ``epoch`` and ``base`` are passed to every
    commit.

    The promise: each submission gets the answer, and the rows end as, committing the same
    submissions one at a time, each alone with ``store.commit``, in the order they were
    accepted (less those whose submitter cancelled before a batch took them). A submission
    is acknowledged where that commit would return, and fails with the error it would
    raise (``KeyTakenError``, ``IdCollisionError``, ...). So a key is free for a new task
    only once a submission accepted before it finishes its holder. The rule of one
    ``commit`` call (updates before inserts, so a batch may reuse a key it frees) applies
    within a submission, never across two. To keep it, a batch merges only submissions
    whose merged commit answers as the serial commits, and ends before any other; a
    failing batch is bisected until only the
    submissions that fail alone fail. Outside the promise: transient failures, fencing and
    closing, which end submissions with their own errors (below).

    Submissions are committed in the order they were accepted; a batch takes whole
    submissions up to ``max_batch_mutations`` rows and ``max_batch_bytes`` bytes (as the
    store estimates them before sending; a larger single submission
    goes alone, and fails at its first attempt if the store refuses its size), and never
    more bytes than the store's ``max_commit_bytes`` (``PgStore``, ``InMemoryStore``) as it
    is when the batch is built: a store's limit lowered at run time is the committer's at
    once, so no batch is sent to be refused and bisected.
    ``max_pending_mutations`` bounds the rows accepted but not yet settled (queued or in
    flight); ``submit`` waits for room, first come first served, and a submission larger
    than the bound is admitted once nothing else is pending. Outputs count as rows for both
    bounds. Transient failures are retried after the pauses of ``backoff`` (by default
    :data:`~cronoq_store._retry.COMMIT_BACKOFF`), each run of failures of one batch starting
    from its initial pause. From ``stuck_after`` consecutive
    transient failures of one batch on, the committer asks the store's ``ping()`` whether
    the database answers; a batch that fails again between two answered pings
    is stuck: it is split in order (a single submission fails with its last error). A
    database that does not answer is an outage: the batch is retried as long as it lasts.

    Up to ``max_batches_in_flight`` batches commit at once, each on a connection of the
    store's pool (give the pool room for them); the next batch is cut when one settles,
    and waits for the earlier ones it must follow.

    Use it as an async context manager, or call :meth:`close`; the committer's loop starts
    with the first submission.
    """

    def __init__(
        self,
        store: Committable,
        epoch: int,
        base: TimeBase,
        *,
        max_batch_mutations: int = 5000,
        max_pending_mutations: int = 20_000,
        max_batch_bytes: int = 64 * 2**20,
        stuck_after: int = 3,
        backoff: Backoff = COMMIT_BACKOFF,
        latency_window: int = 10_000,
        max_batches_in_flight: int = DEFAULT_BATCHES_IN_FLIGHT,
    ) -> None:
        self._store = store
        self._epoch = epoch
        self._base = base
        self._max_batch = _positive_int("max_batch_mutations", max_batch_mutations)
        max_pending = _positive_int("max_pending_mutations", max_pending_mutations)
        self._max_bytes = _positive_int("max_batch_bytes", max_batch_bytes)
        self._stuck_after = _positive_int("stuck_after", stuck_after)
        max_flights = _positive_int("max_batches_in_flight", max_batches_in_flight)
        if not isinstance(backoff, Backoff):
            raise ValueError(f"backoff must be a retry.Backoff, got {backoff!r}")
        self._backoff = backoff
        self._tally = Tally(_positive_int("latency_window", latency_window))
        #: The store's telemetry as it is now (``instrument`` later does not reach this one).
        self._telemetry: Telemetry = store.telemetry
        self._admission = Admission(max_pending, self._tally)
        self._flights = Flights(max_flights)
        self._settling = Settling(epoch, self._admission, self._flights, self._tally)
        #: The key of each task whose submission this committer committed (:func:`learn`).
        self._known_keys: dict[int, str | None] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._telemetry.watch_committer(self)

    # --- public API -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The fencing epoch every commit carries."""
        return self._epoch

    @property
    def closed(self) -> bool:
        """Whether new submissions are refused (closed, closing, or fenced)."""
        return self._settling.closing

    @property
    def fenced(self) -> bool:
        """Whether a commit was fenced: another instance leads, nothing more is written."""
        return self._settling.fenced is not None

    async def submit(
        self, mutations: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]] = ()
    ) -> None:
        """Return once ``mutations`` and ``outputs`` are durable (their batch committed).

        Waits for room when the queue is full. Raises ``FencedError`` if this instance was
        fenced, :class:`CommitterClosedError` if the committer is (or gets) closed first,
        or the error that failed this submission's own commit. An empty submission is a
        barrier: it returns once everything submitted before it is settled.

        Cancelling the call drops the submission if no batch has taken it yet; once it is
        in flight the commit goes ahead (it cannot be undone) and may still land.
        """
        started = time.monotonic()
        self._settling.refuse_if_closed()
        sub = Submission(
            tuple(mutations),
            tuple(outputs),
            asyncio.get_running_loop().create_future(),
            started,
        )
        if not self._admission.admit_now(sub):
            await self._admission.admit(sub, self._settling)
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name=f"cronoq-group-commit-epoch-{self._epoch}"
            )
        try:
            await sub.future
        except asyncio.CancelledError:
            if sub.state is State.QUEUED:
                self._admission.drop(sub)
            raise

    async def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting submissions and settle every pending one; never drops any silently.

        ``drain=True`` commits everything pending first (retrying through outages); after
        ``timeout`` seconds, if given, it gives up as ``drain=False`` does. ``drain=False``
        fails queued submissions with :class:`CommitterClosedError` at once, lets an attempt
        already in progress finish, and fails its batch too if that attempt did not commit.
        Idempotent; a later call may escalate a drain to an abort.
        """
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)
        settling = self._settling
        if not settling.closing:
            logger.info(
                "closing the group committer",
                extra={
                    "drain": drain,
                    "pending_submissions": self._admission.pending,
                    "pending_mutations": self._admission.rows,
                },
            )
        settling.close()
        if not drain:
            settling.abort("closed without draining")
        loop_task = self._loop_task
        if loop_task is None:
            return
        # asyncio.wait neither raises the loop's exception nor cancels it if we are.
        _, still_running = await asyncio.wait({loop_task}, timeout=timeout)
        if still_running:
            logger.warning(
                "draining the group committer timed out; failing what is left",
                extra={"timeout": timeout, "pending_submissions": self._admission.pending},
            )
            settling.abort(f"drain did not finish within {timeout} s")
            await asyncio.wait({loop_task})

    async def __aenter__(self) -> GroupCommitter:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Drain on a normal exit; when the block raised, fail pending work instead of
        waiting on a database that may never come back."""
        await self.close(drain=exc_type is None)

    def stats(self) -> CommitterStats:
        """Counters and latency percentiles, as of now."""
        return self._tally.snapshot(self._admission.pending, self._admission.rows)

    def __repr__(self) -> str:
        settling = self._settling
        state = "fenced" if settling.fenced else "closed" if settling.closing else "open"
        return (
            f"GroupCommitter(epoch={self._epoch}, {state}, "
            f"pending={self._admission.pending}/{self._admission.rows} rows)"
        )

    # --- the loop: batches cut in order, sent, settled ----------------------------------------

    async def _run(self) -> None:
        """Batches in submission order until closed, fenced or aborted, up to
        ``max_batches_in_flight`` at once, each after the earlier ones it must follow."""
        settling, flights = self._settling, self._flights
        try:
            while await flights.room(settling) and (batch := await self._next_batch()) is not None:
                flight = Flight(batch)
                try:
                    await flights.until_followed(flight, settling)
                except asyncio.CancelledError:
                    settling.fail_unsent(batch)  # in no queue and in no flight: only here
                    raise
                if settling.aborting:
                    settling.fail_unsent(batch)
                    break
                flights.flying.append(flight)
                flight.task = asyncio.get_running_loop().create_task(
                    self._fly(flight), name=f"cronoq-group-commit-epoch-{self._epoch}-batch"
                )
            await flights.landed()
        except asyncio.CancelledError as exc:
            settling.on_death(exc, "the group committer's loop was cancelled")
            for flight in flights.flying:
                if flight.task is not None:
                    flight.task.cancel()
            await flights.landed()
            raise
        except Exception as exc:  # a bug: never leave a submitter waiting forever
            logger.exception("the group committer's loop failed", extra={"error": repr(exc)})
            settling.on_death(exc, f"the group committer's loop failed: {exc!r}")
            await flights.landed()
        finally:
            settling.stopped()

    async def _next_batch(self) -> list[Submission] | None:
        """Whole submissions in order, up to the cap and up to the first one that, merged
        with them, would not get the answer of committing them one at a time (``Merge``);
        ``None`` once there is nothing left to commit (closed and drained, or aborted)."""
        settling = self._settling
        queue = self._admission.queue
        wakeup = self._admission.wakeup
        while True:
            if settling.aborting:
                return None
            while queue and queue[0].state is not State.QUEUED:
                queue.popleft()  # dropped by a cancelled submitter
            if queue:
                break
            if settling.closing:
                return None
            wakeup.clear()
            await wakeup.wait()
        batch: list[Submission] = []
        rows = size = 0
        max_bytes = self._batch_bytes()
        merge = Merge(self._known_keys)
        while queue:
            sub = queue[0]
            if sub.state is not State.QUEUED:
                queue.popleft()
                continue
            if batch and (rows + sub.weight > self._max_batch or size + sub.size > max_bytes):
                break
            if not merge.take(sub.mutations, sub.outputs):
                break  # it starts the next batch, which follows this one
            queue.popleft()
            sub.state = State.TAKEN
            batch.append(sub)
            rows += sub.weight
            size += sub.size
        return batch

    def _batch_bytes(self) -> int:
        """The byte bound of the next batch: ``max_batch_bytes``, or the store's
        ``max_commit_bytes`` where that is lower (read now: the store's is the one truth)."""
        return min(self._max_bytes, self._store.max_commit_bytes)

    async def _fly(self, flight: Flight) -> None:
        """Commit one batch in flight and settle its submissions, whatever happens."""
        settling = self._settling
        try:
            await self._commit_group(flight.subs)
        except FencedError as exc:
            if settling.fenced is None:
                settling.on_fenced(exc)
            fenced_by = exc
            settling.fail_in_flight(lambda: fenced_submission(fenced_by), [flight])
        except Abandoned as exc:
            settling.abandoned(flight, exc.last_error)
        except asyncio.CancelledError as exc:
            settling.on_death(exc, "the group committer's batch was cancelled")
            raise
        except Exception as exc:  # a bug: never leave a submitter waiting forever
            logger.exception("the group committer's loop failed", extra={"error": repr(exc)})
            settling.on_death(exc, f"the group committer's loop failed: {exc!r}")
        finally:
            self._flights.land(flight)

    async def _commit_group(self, subs: list[Submission]) -> None:
        """Commit ``subs`` in one transaction; on a non-transient error, bisect so that only
        the submissions that cause it fail (halves are committed in order)."""
        if self._settling.fenced is not None:
            raise self._settling.fenced  # another batch was: nothing is written any more
        mutations = [m for sub in subs for m in sub.mutations]
        outputs = [o for sub in subs for o in sub.outputs]
        size = sum(sub.size for sub in subs)
        started = time.monotonic()
        try:
            retry = CommitRetry(
                self._backoff,
                settling=self._settling,
                ping=self._store.ping,
                stuck_after=self._stuck_after,
                tally=self._tally,
                telemetry=self._telemetry,
                rows=len(mutations),
            )
            await retry.run(
                lambda: self._store._commit_measured(
                    self._epoch, self._base, mutations, outputs, size
                )
            )
        except (FencedError, Abandoned):
            raise
        except Exception as caught:  # not transient, a bad mutation, or a stuck batch
            exc: BaseException = caught
            if isinstance(caught, Stuck):
                self._tally.stuck += 1
                exc = caught.last_error
            level = logging.DEBUG if isinstance(exc, CALLERS_OWN) else logging.WARNING
            if len(subs) == 1:
                logger.log(
                    level,
                    "a submission failed to commit",
                    extra={"error": str(exc), "batch_mutations": len(mutations)},
                )
                self._settling.fail(subs[0], exc)
                return
            self._tally.splits += 1
            if self._telemetry.enabled:
                self._telemetry.split()
            logger.log(
                level,
                "a batch failed to commit; committing its halves separately",
                extra={
                    "error": str(exc),
                    "batch_submissions": len(subs),
                    "batch_mutations": len(mutations),
                },
            )
            middle = len(subs) // 2
            await self._commit_group(subs[:middle])
            await self._commit_group(subs[middle:])
            return
        now = time.monotonic()
        learn(self._known_keys, mutations)
        self._tally.commit(len(subs))
        if self._telemetry.enabled:
            self._telemetry.batch_committed(len(mutations), [now - sub.started for sub in subs])
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "batch committed",
                extra={
                    "batch_submissions": len(subs),
                    "batch_mutations": len(mutations),
                    "elapsed": now - started,
                },
            )
        self._settling.acknowledge_all(subs, now)
