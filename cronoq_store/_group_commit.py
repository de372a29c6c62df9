"""Group commit: many concurrent submitters, few transactions, acknowledgement after durability.

A transaction costs about the same for one mutation as for a thousand (round trips, not rows,
dominate: see docs/performance.md), so the scheduler's submitters should share them.
:class:`GroupCommitter` queues their submissions, and one writer task commits them in
batches: while one commit is in flight the next batch accumulates, so batches grow with load
and no timer adds latency when the system is idle. Several batches are in flight at once,
each on a connection of its own (``max_batches_in_flight``): commits share the fence (a share
lock of the leader row, docs/reliability.md), so their WAL flushes overlap, and the next
batch is cut and folded while earlier ones commit. A batch ends before a submission whose
merged commit would answer otherwise than committing each alone, and a batch that must see
an earlier one's rows (the same task, a key, a schedule) waits for it
(:mod:`cronoq_store._batch_order`): every submission gets the answer of the submissions
committed one at a time, in order. A submitter's ``await`` returns only once the
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

This module is the committer's admission and public API; its writer loop is
:mod:`cronoq_store._commit_writer`, how its submissions settle :mod:`cronoq_store._settling`,
and what they are :mod:`cronoq_store._submissions`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

from ._commit_writer import CommitWriter
from ._committer_stats import CommitterStats, Tally
from ._domain import TaskId, TimeBase, check_seconds
from ._errors import CommitterClosedError
from ._mutations import Mutation
from ._retry import COMMIT_BACKOFF, Backoff
from ._submissions import State, Submission, SupportsCommit, fenced_error
from .telemetry import DISABLED, Telemetry

__all__ = ["DEFAULT_BATCHES_IN_FLIGHT", "GroupCommitter", "SupportsCommit"]

#: Batches in flight at once by default: measured on 2 cores with WAL flushed at every
#: commit (docs/performance.md, "Batches in flight: the default").
DEFAULT_BATCHES_IN_FLIGHT = 2

logger = logging.getLogger("cronoq_store")


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


class GroupCommitter(CommitWriter):
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
    transient failures of one batch on, the committer asks the store's ``ping()``, if it has
    one, whether the database answers; a batch that fails again between two answered pings
    is stuck: it is split in order (a single submission fails with its last error). A
    database that does not answer is an outage: the batch is retried as long as it lasts.

    Up to ``max_batches_in_flight`` batches commit at once, each on a connection of the
    store's pool (give the pool room for them); the next batch is cut when one settles,
    and waits for the earlier ones it must follow.

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
        self._ping = ping if callable(ping) else None
        if not isinstance(backoff, Backoff):
            raise ValueError(f"backoff must be a retry.Backoff, got {backoff!r}")
        self._backoff = backoff
        self._tally = Tally(_positive_int("latency_window", latency_window))
        # A PgStore's telemetry (cronoq_store.telemetry), as of now; any other store's: none.
        recorder = getattr(store, "telemetry", DISABLED)
        self._telemetry = recorder if isinstance(recorder, Telemetry) else DISABLED
        self._telemetry.watch_committer(self)

        self._queue = deque()
        self._flights = []
        self._known_keys = {}
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
        self._fenced = None
        self._failure = None  # the writer died of this

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
        sub = Submission(
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
            if sub.state is State.QUEUED:
                sub.state = State.DROPPED
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
            raise fenced_error(
                f"the group committer was fenced ({self._fenced})", self._fenced
            ) from self._fenced
        if self._failure is not None:
            raise CommitterClosedError(
                f"the group committer stopped after an internal failure: {self._failure!r}"
            ) from self._failure
        if self._closing:
            raise CommitterClosedError("the group committer is closed; submission refused")

    def _enqueue(self, sub: Submission) -> None:
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
