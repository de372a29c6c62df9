"""The group committer's writer: batches cut in order, up to ``max_batches_in_flight`` at
once, each committed with retries and bisected down to the guilty submissions
(:class:`CommitWriter`, the base of :class:`~cronoq_store._group_commit.GroupCommitter`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ._batch_order import Merge, footprint, learn
from ._domain import TimeBase
from ._errors import (
    CommitterClosedError,
    FencedError,
    IdCollisionError,
    KeyTakenError,
    StoreError,
)
from ._mutations import Mutation
from ._retry import Backoff, pause, retry
from ._settling import Settling
from ._submissions import (
    Abandoned,
    Flight,
    Output,
    State,
    Stuck,
    Submission,
    SupportsCommit,
    chained,
    outputs_of,
    store_error,
)
from .telemetry import Telemetry

__all__ = ["CommitWriter"]

logger = logging.getLogger("cronoq_store")

#: Refusals that are the submitter's own outcome (a key another live task holds, an id
#: another task has): the submitter gets the error and decides, so the log says it at
#: debug level. A failure of the database's, or a bug, stays a warning.
CALLERS_OWN = (KeyTakenError, IdCollisionError)


class CommitWriter(Settling):
    """The writer task's loop and each batch's commit; the attributes are set by
    ``GroupCommitter.__init__``."""

    _store: SupportsCommit
    _base: TimeBase
    _max_batch: int
    _max_bytes: int
    _stuck_after: int
    _max_flights: int
    _ping: Callable[[], Awaitable[object]] | None
    _backoff: Backoff
    _telemetry: Telemetry
    #: The key of each task whose submission this committer committed (``learn``).
    _known_keys: dict[int, str | None]

    async def _run(self) -> None:
        """The writer: batches in submission order until closed, fenced or aborted, up to
        ``max_batches_in_flight`` at once, each after the earlier ones it must follow."""
        try:
            while await self._room_in_flight() and (batch := await self._next_batch()) is not None:
                flight = Flight(
                    batch,
                    footprint(
                        (m for sub in batch for m in sub.mutations),
                        outputs_of(batch),
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

    async def _until_followed(self, flight: Flight) -> None:
        """Wait until no batch in flight is one ``flight`` must follow (or an abort)."""
        while not self._aborting and any(
            flight.footprint.follows(earlier.footprint) for earlier in self._flights
        ):
            self._settled.clear()
            await self._settled.wait()

    async def _landed(self) -> None:
        """Wait for every batch in flight to settle."""
        tasks = [flight.task for flight in self._flights if flight.task is not None]
        if tasks:
            await asyncio.wait(tasks)

    async def _fly(self, flight: Flight) -> None:
        """Commit one batch in flight and settle its submissions, whatever happens."""
        try:
            await self._commit_group(flight.subs)
        except FencedError as exc:
            if self._fenced is None:
                self._on_fenced(exc)
            fenced_by = exc
            self._fail_in_flight(lambda: self._fenced_submission(fenced_by), [flight])
        except Abandoned as exc:
            cause = exc.last_error
            fenced = self._fenced
            if fenced is not None:  # another batch was fenced while this one was retried
                self._fail_in_flight(lambda: self._fenced_submission(fenced), [flight])
            self._fail_in_flight(
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
        except asyncio.CancelledError as exc:
            self._on_writer_death(exc, "the group committer's batch was cancelled")
            raise
        except Exception as exc:  # a bug: never leave a submitter waiting forever
            logger.exception("the group committer's writer failed", extra={"error": repr(exc)})
            self._on_writer_death(exc, f"the group committer's writer failed: {exc!r}")
        finally:
            self._flights.remove(flight)
            self._settled.set()

    async def _next_batch(self) -> list[Submission] | None:
        """Whole submissions in order, up to the cap and up to the first one that, merged
        with them, would not get the answer of committing them one at a time (``Merge``);
        ``None`` once there is nothing left to commit (closed and drained, or aborted)."""
        queue = self._queue
        while True:
            if self._aborting:
                return None
            while queue and queue[0].state is not State.QUEUED:
                queue.popleft()  # dropped by a cancelled submitter
            if queue:
                break
            if self._closing:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()
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
        store_limit = getattr(self._store, "max_commit_bytes", None)
        if isinstance(store_limit, int) and not isinstance(store_limit, bool):
            return min(self._max_bytes, store_limit)
        return self._max_bytes

    async def _commit_group(self, subs: list[Submission]) -> None:
        """Commit ``subs`` in one transaction; on a non-transient error, bisect so that only
        the submissions that cause it fail (halves are committed in order)."""
        mutations = [m for sub in subs for m in sub.mutations]
        outputs = [o for sub in subs for o in sub.outputs]
        started = time.monotonic()
        try:
            await self._commit_with_retry(mutations, outputs)
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
                self._fail(subs[0], exc)
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
        self._acknowledge_all(subs, now)

    async def _commit_with_retry(self, mutations: list[Mutation], outputs: list[Output]) -> None:
        """One batch until it commits; transient failures are retried (:func:`retry`) until
        an abort (``Abandoned``), or until the batch is stuck (``Stuck``)."""
        answered = False  # the database answered a ping since the last failed attempt

        async def attempt() -> None:
            if self._fenced is not None:  # another batch was fenced: no attempt again
                raise self._fenced
            await self._store.commit(self._epoch, self._base, mutations, outputs)

        async def check(last: StoreError, failures: int) -> None:
            nonlocal answered
            if self._aborting:
                raise Abandoned(last)
            ping = self._ping
            if failures >= self._stuck_after and ping is not None:
                # Answered before and after the attempt that just failed: the batch's fault.
                answered, before = await self._answers(ping), answered
                if answered and before:
                    raise Stuck(last)

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
            classify=store_error,
            check=check,
            pausing=pausing,
            wait=self._sleep_unless_aborted,
            stopped=Abandoned,
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
