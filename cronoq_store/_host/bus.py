"""The commit bus: the commits of every cluster a host leads, written several clusters to a
transaction.

A standalone store commits each batch in a transaction of its own, and each waits for its
own WAL flush. A host leading hundreds of clusters commits small batches for each, so the
flushes, not the rows, bound it. The bus queues each hosted store's commit (already folded,
its term checked) on a *lane*, one pooled connection each; a lane writes up to
``group_size`` queued commits in one transaction (:func:`~cronoq_store._commit_path.write_group`),
each fenced by its own cluster's epoch, and acknowledges each once that transaction's
``COMMIT`` returned. Every commit gets the answer it would get alone: a fence that moved is
that cluster's alone, and a commit the server refuses is written alone, the others again
together.

A cluster keeps the two lanes it was first given, those with the fewest clusters then, and
each of its commits takes the one of the two with less work waiting: each lane's session
prepares the statements and caches the tables of about twice its share of the clusters,
not of all of them, and a few busy clusters that met on one lane spread over two.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import deque
from dataclasses import dataclass, field

from sqlalchemy.ext.asyncio import AsyncEngine

from .. import _door as door
from .._commit_path import GroupMember, Outcome, Written, write_group
from .._errors import UnavailableError
from .._retry import TimeLimit

__all__ = ["CommitBus"]

_ACTION = "committing a batch"


@dataclass(slots=True)
class _Queued:
    member: GroupMember
    future: asyncio.Future[Written]


@dataclass(slots=True)
class _Lane:
    """A connection, and the commits waiting for it."""

    connections: door.HeldConnection
    clusters: int = 0
    #: Commits queued or being written.
    load: int = 0
    queue: deque[_Queued] = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class CommitBus:
    """Writes hosted stores' commits ``group_size`` at a time on ``lanes`` connections of
    ``engine``'s pool, each kept checked out between groups with ``hold``; a group's work
    is bounded by ``timeout`` (``commit_timeout``). A
    :class:`~cronoq_store._commit_path.Carrier`."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lanes: int,
        hold: bool,
        group_size: int,
        timeout: float,
        prepared: int = 0,
    ) -> None:
        self._lanes = [_Lane(door.HeldConnection(engine, hold=hold)) for _ in range(lanes)]
        self._group_size = group_size
        self._prepared = prepared
        self._timeout = timeout
        self._limit = TimeLimit(timeout)  # each group's commit
        self._lanes_of: dict[str, tuple[_Lane, _Lane]] = {}
        self._closed = False

    async def carry(self, member: GroupMember) -> Written:
        """Queue ``member`` on its cluster's lane; what it found, once its transaction
        committed (or the error it raises alone, or its group's failure)."""
        if self._closed:
            raise UnavailableError(f"{_ACTION} failed: the host is closed")
        lane = self._lane(member.writer.schema)
        queued = _Queued(member, asyncio.get_running_loop().create_future())
        lane.queue.append(queued)
        lane.load += 1
        lane.wakeup.set()
        if lane.task is None:
            lane.task = asyncio.ensure_future(self._serve(lane))
        return await queued.future

    def _lane(self, schema: str) -> _Lane:
        pair = self._lanes_of.get(schema)
        if pair is None:
            first = min(self._lanes, key=_clusters)
            second = min(
                [lane for lane in self._lanes if lane is not first] or [first], key=_clusters
            )
            for lane in {id(first): first, id(second): second}.values():
                lane.clusters += 1
            pair = self._lanes_of[schema] = (first, second)
        return min(pair, key=_load)

    async def close(self) -> None:
        """Stop every lane, fail what is queued, and give the lanes' connections back."""
        self._closed = True
        for lane in self._lanes:
            if lane.task is not None:
                lane.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await lane.task
                lane.task = None
            while lane.queue:
                queued = lane.queue.popleft()
                if not queued.future.done():
                    queued.future.set_exception(
                        UnavailableError(f"{_ACTION} failed: the host closed")
                    )
            await lane.connections.release()

    async def _serve(self, lane: _Lane) -> None:
        """The lane's loop: the next group of queued commits, whose waiters are still
        there (one that gave up, cancelled or timed out, is dropped before it is sent)."""
        while True:
            while not lane.queue:
                lane.wakeup.clear()
                await lane.wakeup.wait()
            group: list[_Queued] = []
            while lane.queue and len(group) < self._group_size:
                queued = lane.queue.popleft()
                if queued.future.done():
                    lane.load -= 1
                else:
                    group.append(queued)
            try:
                if group:
                    await self._write(lane, group)
            finally:
                lane.load -= len(group)

    async def _write(self, lane: _Lane, group: list[_Queued]) -> None:
        """Write ``group`` and settle each waiter: with its outcome, or with the
        transaction's failure for those it left undecided."""
        members = [queued.member for queued in group]
        outcomes: list[Outcome] = [None] * len(group)
        failure: Exception | None = None
        try:
            await self._limit.run(
                lane.connections.run(
                    lambda conn: write_group(conn, members, outcomes, prepared=self._prepared)
                )
            )
        except asyncio.TimeoutError as exc:
            failure = UnavailableError(
                f"{_ACTION} failed: not done within commit_timeout ({self._timeout} s)"
            )
            failure.__cause__ = exc
        except asyncio.CancelledError:
            failure = UnavailableError(f"{_ACTION} failed: the host closed")
            raise
        except Exception as exc:
            failure = exc
        finally:
            for queued, outcome in zip(group, outcomes, strict=True):
                if queued.future.done():
                    continue
                if isinstance(outcome, Written):
                    queued.future.set_result(outcome)
                elif outcome is not None:
                    queued.future.set_exception(outcome)
                else:
                    queued.future.set_exception(_failed(failure))


def _clusters(lane: _Lane) -> int:
    return lane.clusters


def _load(lane: _Lane) -> int:
    return lane.load


def _failed(failure: Exception | None) -> Exception:
    """A waiter's own error for its transaction's ``failure``, raised ``from`` it: a new
    one for each waiter, since each raises it and its traceback grows."""
    if failure is None:
        return UnavailableError(f"{_ACTION} failed: the host closed")
    error = door.translate_error(failure, _ACTION)
    if error is failure:
        error = copy.copy(failure)
    error.__cause__ = failure
    return error
