"""Recovery: what a new leader loads, total whatever the rows hold.

Live tasks are read through a server-side cursor on the driver connection and decoded by
:class:`cronoq_store._schema.LiveTasks` a partition at a time; an undecodable live row is
quarantined (marked failed with the reason, once: it is an ordinary failed task
afterwards) and reported as finished; an undecodable schedule is logged, skipped and left
in the table. ``PgStore.recover`` runs :func:`recover` in one transaction and translates
its failures. That transaction takes no lock that a commit or a takeover waits for until
its last statement (the quarantine), so its idle limit is the store's own
(:data:`~cronoq_store._statements.IDLE_LIMIT_MS`), not ``session_timeout``: how
long a partition takes to decode depends on the rows and the machine, not on the lock
session's timeout.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy.ext.asyncio import AsyncConnection

from . import _door as door
from . import _statements as st
from ._codec import QUARANTINE_PREFIX, engine_time, quarantine_reason
from ._domain import TaskId, TaskStatus, TimeBase, reading_stored
from ._errors import ClusterReplacedError
from ._results import Recovered, RecoveredTerminal
from ._schema import LiveTasks, recurring_schedule

__all__ = ["RECOVERY_PARTITION", "collector_paused", "next_id", "recover"]

logger = logging.getLogger("cronoq_store")

#: Live task rows read and decoded at a time by :func:`recover`.
RECOVERY_PARTITION = 10_000


async def recover(
    conn: AsyncConnection,
    schema: str,
    base: TimeBase,
    retention: float,
    quarantined: Callable[[int], None] | None = None,
    *,
    incarnation: int,
) -> Recovered:
    """Live tasks, finished ones updated within ``retention`` seconds or depended on by a
    live task, recurring schedules, and the next id to issue, read in ``conn``'s
    transaction on the cluster in ``schema`` (which quarantines undecodable live rows;
    ``quarantined``, if given, is told how many, for the store's telemetry). The caller
    runs the transaction under :func:`collector_paused`. ``ClusterReplacedError`` before
    anything else is read where ``schema`` holds another cluster than ``incarnation``."""
    recorded_max, stored_max, found = (await conn.execute(st.high_water)).one()
    if found != incarnation:
        raise ClusterReplacedError(schema, incarnation, found, "recovering")
    recovered = Recovered(next_id=next_id(recorded_max, stored_max))
    now = time.time_ns()
    with reading_stored():  # what was stored is storable: no bound of this build refuses it
        corrupt = await _recover_tasks(conn, schema, base, now, retention, recovered)
        await _recover_recurring(conn, base, recovered)
    # Last: its row locks are then held only until the commit that follows.
    await _quarantine(conn, corrupt, incarnation, base, now, recovered)
    if quarantined is not None:
        quarantined(len(corrupt))
    return recovered


def next_id(recorded_max: int, stored_max: int | None) -> int:
    """One more than the largest id ever stored: ``recorded_max`` is the largest id prune
    deleted (``cronoq_leader.max_id``, which prune records with each deletion; earlier
    builds recorded there every id they issued), ``stored_max`` the largest stored id
    (``None`` without tasks). A deletion and its record commit together, so the two, read
    in one statement, cover every id ever stored.

    The mark starts at 0, the column's default, which is also what pruning only id 0
    records: the two cannot be told apart, so 0 counts as issued and ``next_id`` is at
    least 1. Reading 0 as "none" reissued a hand-issued id 0 once its task was pruned.
    """
    return max(recorded_max + 1, 0 if stored_max is None else stored_max + 1)


class _Corrupt:
    """The live rows that could not be decoded: their ids, keys and quarantine messages."""

    __slots__ = ("ids", "keys", "messages")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.keys: list[str | None] = []
        self.messages: list[str] = []

    def __len__(self) -> int:
        return len(self.ids)


async def _recover_tasks(
    conn: AsyncConnection,
    schema: str,
    base: TimeBase,
    now: int,
    retention: float,
    recovered: Recovered,
) -> _Corrupt:
    """Fills ``recovered``'s tasks and finished tasks; returns the rows to quarantine.

    Long for a reason: the cursor loop and the collection of corrupt rows stay in one
    frame, on recovery's per-row path."""
    corrupt = _Corrupt()
    decode = LiveTasks(base).decode
    tasks = recovered.tasks
    # A server-side cursor, read and decoded a partition at a time: rows are dropped as
    # they are decoded, and the transaction is never idle for longer than it takes to
    # decode one partition (IDLE_LIMIT_MS bounds that). The door reads it on the driver
    # connection, in the session's transaction: SQLAlchemy's result rows cost more per row
    # than the decoding they feed (1.4x faster without them, at 100,000 tasks).
    live = door.partitions(conn, st.live_tasks, schema, RECOVERY_PARTITION)
    async for rows in live:
        for row in rows:
            try:
                tasks.append(decode(*row))
            except Exception as exc:  # whatever the row holds; free when nothing raises
                reason = quarantine_reason(exc)
                logger.error(
                    "quarantining undecodable task row",
                    extra={"task_id": row["id"], "error": reason},
                )
                corrupt.ids.append(row["id"])
                corrupt.keys.append(row["key"])
                corrupt.messages.append(f"{QUARANTINE_PREFIX} {reason}")
    dep_ids: set[int] = set()
    dep_keys: set[str] = set()
    for task in recovered.tasks:
        for dep in task.spec.deps:
            if isinstance(dep.target, str):
                dep_keys.add(dep.target)
            else:
                dep_ids.add(dep.target)
    # Rows to quarantine are still live here: _quarantine reports them.
    cutoff = now - round(retention * 1e9)
    finished = await conn.execute(
        st.recent_terminal,
        {"cutoff": cutoff, "dep_ids": list(dep_ids), "dep_keys": list(dep_keys)},
    )
    for done in finished:
        status = TaskStatus.from_stored(done.status)
        if status is None or not status.is_terminal:
            logger.warning(
                "skipping finished task with an unknown status",
                extra={"task_id": done.id, "status": done.status},
            )
            continue
        recovered.terminal.append(
            RecoveredTerminal(
                id=TaskId(done.id),
                key=done.key,
                status=status,
                at=engine_time(base, done.updated_unix_ns),
            )
        )
    return corrupt


async def _quarantine(
    conn: AsyncConnection,
    corrupt: _Corrupt,
    incarnation: int,
    base: TimeBase,
    now: int,
    recovered: Recovered,
) -> None:
    """Mark the undecodable live rows failed, updated ``now``, in the cluster of
    ``incarnation`` only, and report them as finished (after the others: nothing finished
    later)."""
    if not corrupt:
        return
    await conn.execute(
        st.quarantine,
        {
            "ids": corrupt.ids,
            "messages": corrupt.messages,
            "failed": TaskStatus.FAILED.value,
            "now": now,
            "incarnation": incarnation,
        },
    )
    at = engine_time(base, now)
    recovered.terminal.extend(
        RecoveredTerminal(id=TaskId(id), key=key, status=TaskStatus.FAILED, at=at)
        for id, key in zip(corrupt.ids, corrupt.keys, strict=True)
    )


async def _recover_recurring(conn: AsyncConnection, base: TimeBase, recovered: Recovered) -> None:
    for row in await conn.execute(st.recurring_schedules):
        try:
            recovered.recurring.append(recurring_schedule(base, *row))
        except Exception as exc:  # whatever the row holds
            # Left in place, so it can be repaired, but not scheduled.
            logger.error(
                "skipping undecodable recurring schedule",
                extra={"schedule": row.name, "error": quarantine_reason(exc)},
            )


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a recovery's transaction, on again after it.

    Decoding builds millions of objects that all stay alive: with the collector on, it
    walked the growing heap again and again (11 full collections while a million tasks were
    read: 7 s of 25, most of them in the fetches between partitions). And a collection
    inside the transaction leaves it idle, for as long as the heap takes to walk. So the
    pause spans the whole transaction, awaits included: other tasks of the
    process run meanwhile, and only their cyclic garbage waits for the collector (reference
    counting frees the rest). A collector that was off stays off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
