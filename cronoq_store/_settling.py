"""How the group committer's submissions settle: the pending count, acknowledgement, failure,
an abort, a fence, the writer's death (:class:`Settling`, the base of
:class:`~cronoq_store._group_commit.GroupCommitter`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

from ._committer_stats import Tally
from ._errors import CommitterClosedError, FencedError
from ._submissions import Flight, State, Submission, chained, fenced_error

__all__ = ["Settling"]

logger = logging.getLogger("cronoq_store")


class Settling:
    """The committer's state, and every way a submission settles; the attributes are set by
    ``GroupCommitter.__init__``."""

    _epoch: int
    _tally: Tally
    _queue: deque[Submission]
    _flights: list[Flight]
    _settled: asyncio.Event  # a batch in flight settled (or an abort began)
    _pending_count: int
    _pending_weight: int
    _room: asyncio.Event
    _wakeup: asyncio.Event
    _abort_event: asyncio.Event
    _closing: bool  # no new submissions
    _aborting: bool  # stop committing: fail what is left
    _fenced: FencedError | None
    _failure: BaseException | None  # the writer died of this

    def _release(self, sub: Submission) -> None:
        self._pending_count -= 1
        self._pending_weight -= sub.weight
        self._room.set()

    def _acknowledge_all(self, subs: list[Submission], now: float) -> None:
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
        self._pending_count -= len(latencies)
        self._pending_weight -= weight
        self._tally.acknowledge(mutations, latencies)
        self._room.set()

    def _fail(self, sub: Submission, error: BaseException) -> None:
        if sub.state is State.SETTLED or sub.state is State.DROPPED:
            return
        sub.state = State.SETTLED
        self._release(sub)
        self._tally.failed += 1
        if not sub.future.done():
            sub.future.set_exception(error)

    def _fail_queued(self, make_error: Callable[[], BaseException]) -> None:
        while self._queue:
            sub = self._queue.popleft()
            if sub.state is State.QUEUED:
                self._fail(sub, make_error())

    def _fail_in_flight(
        self, make_error: Callable[[], BaseException], flights: Sequence[Flight] | None = None
    ) -> None:
        for flight in self._flights if flights is None else flights:
            for sub in flight.subs:
                if sub.state is State.TAKEN:
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

    def _fail_unsent(self, subs: list[Submission]) -> None:
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
        return chained(
            fenced_error(f"fenced before this submission was confirmed durable: {exc}", exc),
            exc,
        )

    def _on_writer_death(self, exc: BaseException, message: str) -> None:
        if self._failure is None:
            self._failure = exc
        self._aborting = True
        self._abort_event.set()
        self._settled.set()

        def closed() -> CommitterClosedError:
            return chained(
                CommitterClosedError(f"{message}; this submission may not have been committed"),
                exc,
            )

        self._fail_in_flight(closed)
        self._fail_queued(closed)
