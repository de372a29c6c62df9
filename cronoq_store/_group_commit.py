"""Group commit: many concurrent submitters, few transactions, acknowledgement after durability.

A transaction costs about the same for one mutation as for a thousand (round trips, not rows,
dominate: see docs/performance.md), so the scheduler's submitters should share them.
:class:`GroupCommitter` queues their submissions, and one writer task commits them in
batches: while one commit is in flight the next batch accumulates, so batches grow with load
and no timer adds latency when the system is idle. Several batches are in flight at once,
each on a connection of its own (``max_batches_in_flight``): commits share the fence (a share
lock of the leader row, docs/reliability.md), so their WAL flushes overlap, and the next
batch is cut and folded while earlier ones commit. A batch that must see an earlier one's
rows (the same task, a key, a schedule: :mod:`cronoq_store._batch_order`) waits for it, so
the rows are those of one batch at a time. A submitter's ``await`` returns only once the
transaction holding its mutations has committed.

Failures are sorted by who they belong to:

* ``UnavailableError`` (transient) belongs to the database: the same batch is retried after
  the pauses of the one retry policy (:mod:`cronoq_store._retry`); commits are idempotent, so
  a retry of a batch that did land changes nothing. Unless the database answers while the
  batch keeps failing: then the batch is at fault (a server that closes the connection on
  it, a statement timeout it always hits) and is treated as if the error were not transient.
* ``FencedError`` belongs to this instance: another leader took over, so nothing may be
  written again. Every queued submitter fails with it and the committer closes; no batch
  is attempted again. Each other batch in flight settles by its attempt under way (each
  checks the epoch itself): one that landed before the takeover is acknowledged.
* Any other error belongs to some submission (a duplicate key aborts the whole transaction):
  the batch is bisected, halves committed in order, until only the guilty submissions fail.

Batches are bounded by rows and by bytes (:mod:`cronoq_store._sizing`), far below what
PostgreSQL accepts in one message.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Protocol, TypeAlias, TypeVar

from ._batch_order import Footprint, footprint
from ._committer_stats import CommitterStats, Tally
from ._domain import TaskId, TimeBase, check_seconds
from ._errors import (
    CommitterClosedError,
    FencedError,
    SchemaGoneError,
    StoreError,
)
from ._mutations import Mutation
from ._retry import COMMIT_BACKOFF, Backoff, pause, retry
from ._sizing import mutation_size, output_size
from .telemetry import DISABLED, Telemetry

__all__ = ["DEFAULT_BATCHES_IN_FLIGHT", "GroupCommitter", "SupportsCommit"]

#: Batches in flight at once by default: measured on 2 cores with WAL flushed at every
#: commit (docs/performance.md, "Batches in flight: the default").
DEFAULT_BATCHES_IN_FLIGHT = 2

logger = logging.getLogger("cronoq_store")

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


class _State(enum.Enum):
    QUEUED = "queued"  # accepted, waiting for a batch
    TAKEN = "taken"  # in a batch: committed or failed as a whole, even if cancelled
    DROPPED = "dropped"  # cancelled while queued: skipped by the writer
    SETTLED = "settled"  # acknowledged or failed


class _Submission:
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
        self.state = _State.QUEUED


class _Flight:
    """A batch in flight: its submissions, its footprint, the task committing it."""

    __slots__ = ("footprint", "subs", "task")

    def __init__(self, subs: list[_Submission], footprint: Footprint) -> None:
        self.subs = subs
        self.footprint = footprint
        self.task: asyncio.Task[None] | None = None


class _Stuck(Exception):
    """Internal: a batch kept failing transiently although the database answered."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


class _Abandoned(Exception):
    """Internal: the committer was closed while a batch was still being retried."""

    def __init__(self, last_error: StoreError) -> None:
        super().__init__(str(last_error))
        self.last_error = last_error


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _store_error(exc: Exception) -> StoreError | None:
    """What the committer retries: a store's transient errors; any other error is raised."""
    return exc if isinstance(exc, StoreError) else None


def _fenced_error(what: str, cause: FencedError) -> FencedError:
    """The error of a submitter after ``cause`` fenced the committer, of the same kind: a
    :class:`SchemaGoneError` stays one (no other instance leads then; the tables are gone)."""
    if isinstance(cause, SchemaGoneError):
        return SchemaGoneError(f"{what}; this instance must not write any more")
    return FencedError(f"{what}; another instance leads, so this instance must not write any more")


def _chained(error: _E, cause: BaseException | None) -> _E:
    """``error`` with ``cause`` attached as if raised ``from cause``; each submitter gets an
    instance of its own, so concurrent raises do not share one traceback."""
    error.__cause__ = cause
    return error


class GroupCommitter:
    """Turns many concurrent submitters into few transactions, each acked once durable.

    One committer serves one leadership term: ``epoch`` and ``base`` are passed to every
    commit. Submissions are committed in the order they were accepted; a batch takes whole
    submissions up to ``max_batch_mutations`` rows and ``max_batch_bytes`` bytes (as
    :func:`~cronoq_store._sizing.mutation_size` estimates them; a larger single submission
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
    transient failures of one batch on, the committer asks the store's ``ping()``, if it has
    one, whether the database answers; a batch that fails again between two answered pings
    is stuck: it is split in order (a single submission fails with its last error). A
    database that does not answer is an outage: the batch is retried as long as it lasts.

    Up to ``max_batches_in_flight`` batches commit at once, each on a connection of the
    store's pool (give the pool room for them); the next batch is cut when one settles,
    and waits for the earlier ones it must follow (:mod:`cronoq_store._batch_order`).

    Use it as an async context manager, or call :meth:`close`; the writer task starts with
    the first submission.
    """

    def __init__(
        self,
        store: SupportsCommit,
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
        self._max_pending = _positive_int("max_pending_mutations", max_pending_mutations)
        self._max_bytes = _positive_int("max_batch_bytes", max_batch_bytes)
        self._stuck_after = _positive_int("stuck_after", stuck_after)
        self._max_flights = _positive_int("max_batches_in_flight", max_batches_in_flight)
        ping = getattr(store, "ping", None)
        self._ping: Callable[[], Awaitable[object]] | None = ping if callable(ping) else None
        if not isinstance(backoff, Backoff):
            raise ValueError(f"backoff must be a retry.Backoff, got {backoff!r}")
        self._backoff = backoff
        self._tally = Tally(_positive_int("latency_window", latency_window))
        # A PgStore's telemetry (cronoq_store.telemetry), as of now; any other store's: none.
        recorder = getattr(store, "telemetry", DISABLED)
        self._telemetry: Telemetry = recorder if isinstance(recorder, Telemetry) else DISABLED
        self._telemetry.watch_committer(self)

        self._queue: deque[_Submission] = deque()
        self._flights: list[_Flight] = []
        self._settled = asyncio.Event()  # a batch in flight settled (or an abort began)
        self._pending_count = 0
        self._pending_weight = 0
        # FIFO admission: a submitter waiting for room keeps its place in line, and none
        # passes it while anyone waits (`_waiting`).
        self._admission = asyncio.Lock()
        self._waiting = 0
        self._room = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._abort_event = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None

        self._closing = False  # no new submissions
        self._aborting = False  # stop committing: fail what is left
        self._fenced: FencedError | None = None
        self._failure: BaseException | None = None  # the writer died of this

    # --- public API -------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The fencing epoch every commit carries."""
        return self._epoch

    @property
    def closed(self) -> bool:
        """Whether new submissions are refused (closed, closing, or fenced)."""
        return self._closing

    @property
    def fenced(self) -> bool:
        """Whether a commit was fenced: another instance leads, nothing more is written."""
        return self._fenced is not None

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
        self._refuse_if_closed()
        sub = _Submission(
            tuple(mutations),
            tuple(outputs),
            asyncio.get_running_loop().create_future(),
            started,
        )
        if self._waiting or not self._has_room(sub.weight):
            # Wait for room in line; with nobody waiting and room, no lock is needed.
            self._waiting += 1
            try:
                async with self._admission:
                    while True:
                        self._refuse_if_closed()
                        if self._has_room(sub.weight):
                            break
                        self._room.clear()
                        await self._room.wait()
                    self._enqueue(sub)
            finally:
                self._waiting -= 1
        else:
            self._enqueue(sub)
        try:
            await sub.future
        except asyncio.CancelledError:
            if sub.state is _State.QUEUED:
                sub.state = _State.DROPPED
                self._release(sub)
                self._tally.dropped += 1
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
        if not self._closing:
            logger.info(
                "closing the group committer",
                extra={
                    "drain": drain,
                    "pending_submissions": self._pending_count,
                    "pending_mutations": self._pending_weight,
                },
            )
        self._closing = True
        self._room.set()  # submitters waiting for room: refused
        self._wakeup.set()
        if not drain:
            self._abort("closed without draining")
        writer = self._writer
        if writer is None:
            return
        # asyncio.wait neither raises the writer's exception nor cancels it if we are.
        _, still_running = await asyncio.wait({writer}, timeout=timeout)
        if still_running:
            logger.warning(
                "draining the group committer timed out; failing what is left",
                extra={"timeout": timeout, "pending_submissions": self._pending_count},
            )
            self._abort(f"drain did not finish within {timeout} s")
            await asyncio.wait({writer})

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
        return self._tally.snapshot(self._pending_count, self._pending_weight)

    def __repr__(self) -> str:
        state = "fenced" if self._fenced else "closed" if self._closing else "open"
        return (
            f"GroupCommitter(epoch={self._epoch}, {state}, "
            f"pending={self._pending_count}/{self._pending_weight} rows)"
        )

    # --- admission --------------------------------------------------------------------------

    def _refuse_if_closed(self) -> None:
        if self._fenced is not None:
            raise _fenced_error(
                f"the group committer was fenced ({self._fenced})", self._fenced
            ) from self._fenced
        if self._failure is not None:
            raise CommitterClosedError(
                f"the group committer stopped after an internal failure: {self._failure!r}"
            ) from self._failure
        if self._closing:
            raise CommitterClosedError("the group committer is closed; submission refused")

    def _enqueue(self, sub: _Submission) -> None:
        self._queue.append(sub)
        self._pending_count += 1
        self._pending_weight += sub.weight
        self._tally.submissions += 1
        self._wakeup.set()
        if self._writer is None:
            self._start_writer()

    def _has_room(self, weight: int) -> bool:
        return self._pending_count == 0 or self._pending_weight + weight <= self._max_pending

    def _start_writer(self) -> None:
        self._writer = asyncio.get_running_loop().create_task(
            self._run(), name=f"cronoq-group-commit-epoch-{self._epoch}"
        )

    def _release(self, sub: _Submission) -> None:
        self._pending_count -= 1
        self._pending_weight -= sub.weight
        self._room.set()

    # --- settling ---------------------------------------------------------------------------

    def _acknowledge_all(self, subs: list[_Submission], now: float) -> None:
        """Settle a committed batch's submissions, the counters updated once for all."""
        weight = mutations = 0
        latencies: list[float] = []
        for sub in subs:
            if sub.state is _State.SETTLED:
                continue
            sub.state = _State.SETTLED
            weight += sub.weight
            mutations += len(sub.mutations)
            latencies.append(now - sub.started)
            if not sub.future.done():  # a submitter cancelled in flight is not waiting
                sub.future.set_result(None)
        self._pending_count -= len(latencies)
        self._pending_weight -= weight
        self._tally.acknowledge(mutations, latencies)
        self._room.set()

    def _fail(self, sub: _Submission, error: BaseException) -> None:
        if sub.state is _State.SETTLED or sub.state is _State.DROPPED:
            return
        sub.state = _State.SETTLED
        self._release(sub)
        self._tally.failed += 1
        if not sub.future.done():
            sub.future.set_exception(error)

    def _fail_queued(self, make_error: Callable[[], BaseException]) -> None:
        while self._queue:
            sub = self._queue.popleft()
            if sub.state is _State.QUEUED:
                self._fail(sub, make_error())

    def _fail_in_flight(
        self, make_error: Callable[[], BaseException], flights: Sequence[_Flight] | None = None
    ) -> None:
        for flight in self._flights if flights is None else flights:
            for sub in flight.subs:
                if sub.state is _State.TAKEN:
                    self._fail(sub, make_error())

    def _abort(self, reason: str) -> None:
        """Stop committing: queued submissions fail now (they were never sent); the writer
        fails the batch in flight unless its current attempt commits."""
        self._aborting = True
        self._abort_event.set()
        self._wakeup.set()
        self._settled.set()
        self._fail_queued(
            lambda: CommitterClosedError(
                f"the group committer was closed ({reason}); this submission was not committed"
            )
        )

    # --- the writer -------------------------------------------------------------------------

    async def _run(self) -> None:
        """The writer: batches in submission order until closed, fenced or aborted, up to
        ``max_batches_in_flight`` at once, each after the earlier ones it must follow."""
        try:
            while await self._room_in_flight() and (batch := await self._next_batch()) is not None:
                flight = _Flight(
                    batch,
                    footprint(
                        (m for sub in batch for m in sub.mutations),
                        _outputs(batch),
                        barrier=any(not sub.mutations and not sub.outputs for sub in batch),
                    ),
                )
                try:
                    await self._until_followed(flight)
                except asyncio.CancelledError:
                    self._fail_unsent(batch)  # in no queue and in no flight: only here
                    raise
                if self._aborting:
                    self._fail_unsent(batch)
                    break
                self._flights.append(flight)
                flight.task = asyncio.get_running_loop().create_task(
                    self._fly(flight), name=f"cronoq-group-commit-epoch-{self._epoch}-batch"
                )
            await self._landed()
        except asyncio.CancelledError as exc:
            self._on_writer_death(exc, "the group committer's writer task was cancelled")
            for flight in self._flights:
                if flight.task is not None:
                    flight.task.cancel()
            await self._landed()
            raise
        except Exception as exc:  # a bug: never leave a submitter waiting forever
            logger.exception("the group committer's writer failed", extra={"error": repr(exc)})
            self._on_writer_death(exc, f"the group committer's writer failed: {exc!r}")
            await self._landed()
        finally:
            self._closing = True
            self._aborting = True
            self._room.set()
            self._fail_queued(
                lambda: CommitterClosedError(
                    "the group committer stopped; this submission was not committed"
                )
            )

    async def _room_in_flight(self) -> bool:
        """Wait until fewer than ``max_batches_in_flight`` batches are in flight; ``False``
        once the committer aborts."""
        while len(self._flights) >= self._max_flights and not self._aborting:
            self._settled.clear()
            await self._settled.wait()
        return not self._aborting

    async def _until_followed(self, flight: _Flight) -> None:
        """Wait until no batch in flight is one ``flight`` must follow (or an abort)."""
        while not self._aborting and any(
            flight.footprint.follows(earlier.footprint) for earlier in self._flights
        ):
            self._settled.clear()
            await self._settled.wait()

    def _fail_unsent(self, subs: list[_Submission]) -> None:
        """Fail a batch that was cut but never sent: the committer aborted meanwhile."""
        fenced = self._fenced
        for sub in subs:
            self._fail(
                sub,
                self._fenced_submission(fenced)
                if fenced is not None
                else CommitterClosedError(
                    "the group committer stopped before this submission's batch was sent; "
                    "it was not committed"
                ),
            )

    async def _landed(self) -> None:
        """Wait for every batch in flight to settle."""
        tasks = [flight.task for flight in self._flights if flight.task is not None]
        if tasks:
            await asyncio.wait(tasks)

    async def _fly(self, flight: _Flight) -> None:
        """Commit one batch in flight and settle its submissions, whatever happens."""
        try:
            await self._commit_group(flight.subs)
        except FencedError as exc:
            if self._fenced is None:
                self._on_fenced(exc)
            fenced_by = exc
            self._fail_in_flight(lambda: self._fenced_submission(fenced_by), [flight])
        except _Abandoned as exc:
            cause = exc.last_error
            fenced = self._fenced
            if fenced is not None:  # another batch was fenced while this one was retried
                self._fail_in_flight(lambda: self._fenced_submission(fenced), [flight])
            self._fail_in_flight(
                lambda: _chained(
                    CommitterClosedError(
                        "the group committer was closed while this submission's batch was "
                        f"being retried (last error: {cause}); it may or may not have been "
                        "committed"
                    ),
                    cause,
                ),
                [flight],
            )
        except asyncio.CancelledError as exc:
            self._on_writer_death(exc, "the group committer's batch was cancelled")
            raise
        except Exception as exc:  # a bug: never leave a submitter waiting forever
            logger.exception("the group committer's writer failed", extra={"error": repr(exc)})
            self._on_writer_death(exc, f"the group committer's writer failed: {exc!r}")
        finally:
            self._flights.remove(flight)
            self._settled.set()

    async def _next_batch(self) -> list[_Submission] | None:
        """Whole submissions in order, up to the cap; ``None`` once there is nothing left
        to commit (closed and drained, or aborted)."""
        queue = self._queue
        while True:
            if self._aborting:
                return None
            while queue and queue[0].state is not _State.QUEUED:
                queue.popleft()  # dropped by a cancelled submitter
            if queue:
                break
            if self._closing:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
        batch: list[_Submission] = []
        rows = size = 0
        max_bytes = self._batch_bytes()
        while queue:
            sub = queue[0]
            if sub.state is not _State.QUEUED:
                queue.popleft()
                continue
            if batch and (rows + sub.weight > self._max_batch or size + sub.size > max_bytes):
                break
            queue.popleft()
            sub.state = _State.TAKEN
            batch.append(sub)
            rows += sub.weight
            size += sub.size
        return batch

    def _batch_bytes(self) -> int:
        """The byte bound of the next batch: ``max_batch_bytes``, or the store's
        ``max_commit_bytes`` where that is lower (read now: the store's is the one truth)."""
        store_limit = getattr(self._store, "max_commit_bytes", None)
        if isinstance(store_limit, int) and not isinstance(store_limit, bool):
            return min(self._max_bytes, store_limit)
        return self._max_bytes

    async def _commit_group(self, subs: list[_Submission]) -> None:
        """Commit ``subs`` in one transaction; on a non-transient error, bisect so that only
        the submissions that cause it fail (halves are committed in order)."""
        mutations = [m for sub in subs for m in sub.mutations]
        outputs = [o for sub in subs for o in sub.outputs]
        started = time.monotonic()
        try:
            await self._commit_with_retry(mutations, outputs)
        except (FencedError, _Abandoned):
            raise
        except Exception as caught:  # not transient, a bad mutation, or a stuck batch
            exc: BaseException = caught
            if isinstance(caught, _Stuck):
                self._tally.stuck += 1
                exc = caught.last_error
            if len(subs) == 1:
                logger.warning(
                    "a submission failed to commit",
                    extra={"error": str(exc), "batch_mutations": len(mutations)},
                )
                self._fail(subs[0], exc)
                return
            self._tally.splits += 1
            if self._telemetry.enabled:
                self._telemetry.split()
            logger.warning(
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
        self._acknowledge_all(subs, now)

    async def _commit_with_retry(self, mutations: list[Mutation], outputs: list[Output]) -> None:
        """One batch until it commits; transient failures are retried (:func:`retry`) until
        an abort (``_Abandoned``), or until the batch is stuck (``_Stuck``)."""
        answered = False  # the database answered a ping since the last failed attempt

        async def attempt() -> None:
            if self._fenced is not None:  # another batch was fenced: no attempt again
                raise self._fenced
            await self._store.commit(self._epoch, self._base, mutations, outputs)

        async def check(last: StoreError, failures: int) -> None:
            nonlocal answered
            if self._aborting:
                raise _Abandoned(last)
            ping = self._ping
            if failures >= self._stuck_after and ping is not None:
                # Answered before and after the attempt that just failed: the batch's fault.
                answered, before = await self._answers(ping), answered
                if answered and before:
                    raise _Stuck(last)

        def pausing(last: StoreError, failures: int, delay: float) -> None:
            self._tally.retries += 1
            if self._telemetry.enabled:
                self._telemetry.retried()
            logger.warning(
                "commit failed transiently; retrying the same batch",
                extra={
                    "error": str(last),
                    "attempt": failures,
                    "delay": delay,
                    "batch_mutations": len(mutations),
                },
            )

        await retry(
            attempt,
            self._backoff,
            classify=_store_error,
            check=check,
            pausing=pausing,
            wait=self._sleep_unless_aborted,
            stopped=_Abandoned,
        )

    async def _answers(self, ping: Callable[[], Awaitable[object]]) -> bool:
        """Whether the store's ``ping()`` says the database answers."""
        try:
            await ping()
        except StoreError as exc:
            self._tally.unanswered_pings += 1
            logger.warning(
                "the database does not answer; retrying the batch until it does",
                extra={"error": str(exc)},
            )
            return False
        return True

    async def _sleep_unless_aborted(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; ``True`` if an abort cut the sleep short."""
        if self._aborting:
            return True
        return await pause(delay, self._abort_event)

    def _on_fenced(self, exc: FencedError) -> None:
        self._fenced = exc
        self._closing = True
        self._aborting = True
        logger.error(
            "the group committer was fenced; failing every pending submission",
            extra={
                "epoch": self._epoch,
                "error": str(exc),
                "pending_submissions": self._pending_count,
            },
        )

        self._abort_event.set()  # batches being retried stop at once
        self._wakeup.set()
        self._settled.set()
        # The other batches in flight settle by their own attempt: one that passed its
        # check before the takeover has landed (the bump waited for it) and is acknowledged;
        # any other is fenced by its own check, or abandoned as fenced.
        self._fail_queued(lambda: self._fenced_submission(exc))

    @staticmethod
    def _fenced_submission(exc: FencedError) -> FencedError:
        """The error of a submission not confirmed durable when ``exc`` fenced the committer."""
        return _chained(
            _fenced_error(f"fenced before this submission was confirmed durable: {exc}", exc),
            exc,
        )

    def _on_writer_death(self, exc: BaseException, message: str) -> None:
        if self._failure is None:
            self._failure = exc
        self._aborting = True
        self._abort_event.set()
        self._settled.set()

        def closed() -> CommitterClosedError:
            return _chained(
                CommitterClosedError(f"{message}; this submission may not have been committed"),
                exc,
            )

        self._fail_in_flight(closed)
        self._fail_queued(closed)


def _outputs(batch: list[_Submission]) -> list[Output]:
    return [o for sub in batch for o in sub.outputs]
