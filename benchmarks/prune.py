"""Pruning: ``PgStore.prune`` (batches of ``PRUNE_BATCH``, never a task a live task depends
on) against raw asyncpg deleting the same old finished tasks in the same batches without
that protection: what the protection costs.

Each trial starts from the same fresh table: ``prune_finished`` old finished tasks and
``prune_live`` live tasks, each depending on a different finished one (by id or by key).

The protection's plan changes with the number of live dependencies: past a few thousand,
the planner no longer hashes the ``NOT IN`` over keys and each batch scans every reference
for every candidate. The store now uses ``NOT EXISTS`` (hash anti-joins); the full profile
also times one batch of the store's statement on a large table (200,000 finished, 20,000
live with dependencies), bounded by a statement timeout, so a regression to the old plan
shows as a timeout.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import asyncpg
from sqlalchemy import (
    BigInteger,
    bindparam,
    delete,
    func,
    select,
)
from sqlalchemy.engine import URL

from cronoq_store import Dependency, PgStoreConfig, Submitted, TaskStatus, TimeBase, task_id
from cronoq_store import statements as st
from cronoq_store.codec import encode_deps, unix_converter
from cronoq_store.queries import PRUNE_BATCH
from cronoq_store.rows import INSERT_COLUMNS, INSERT_POSITION, insert_row
from cronoq_store.schema import tasks
from cronoq_store.store import PgStore

from .common import (
    Profile,
    compile_for_asyncpg,
    dsn,
    interleave,
    make_spec,
    summarize,
)

_COLUMN = INSERT_POSITION
_OLDER_THAN = 3600.0
_AGE_NS = 2 * 3600 * 10**9

_old = tasks.alias("t")
_victims = (
    select(_old.c.id)
    .where(_old.c.terminal, _old.c.updated_unix_ns < bindparam("cutoff", type_=BigInteger))
    .order_by(_old.c.updated_unix_ns, _old.c.id)
    .limit(bindparam("batch", type_=BigInteger))
    .cte("victims")
)
#: The store's prune statement without the dependency protection.
_unprotected = delete(tasks).where(tasks.c.id.in_(select(_victims.c.id)))
_finished_left = select(func.count()).select_from(tasks).where(tasks.c.terminal)


def make_rows(finished: int, live: int, base: TimeBase, now: int) -> list[tuple[Any, ...]]:
    """``finished`` finished tasks two hours old, then ``live`` live tasks that each depend
    on a different one of them, by id or (every other one) by key."""
    proto = insert_row(Submitted(task_id(1, 1), 1, 0, make_spec(1)), unix_converter(base), now)
    rows = []
    for n in range(1, finished + 1):
        row = proto.copy()
        row[_COLUMN["id"]] = task_id(1, n)
        row[_COLUMN["seq"]] = n
        row[_COLUMN["key"]] = f"done-{n}"
        row[_COLUMN["status"]] = TaskStatus.SUCCEEDED.value
        row[_COLUMN["terminal"]] = True
        row[_COLUMN["updated_unix_ns"]] = now - _AGE_NS + n
        rows.append(tuple(row))
    spacing = finished // live
    for j in range(live):
        n = finished + 1 + j
        target = 1 + j * spacing
        row = proto.copy()
        row[_COLUMN["id"]] = task_id(1, n)
        row[_COLUMN["seq"]] = n
        row[_COLUMN["deps"]] = encode_deps(
            [Dependency(task_id(1, target) if j % 2 == 0 else f"done-{target}")]
        )
        rows.append(tuple(row))
    return rows


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """Deleted rows per second of both sides, and the finished tasks the store kept."""
    schemas = {"store": "bench_prune_store", "raw": "bench_prune_raw"}
    store = await PgStore.connect(url, PgStoreConfig(schema=schemas["store"]))
    raw_store = await PgStore.connect(url, PgStoreConfig(schema=schemas["raw"]))
    await raw_store.close()
    conn = await asyncpg.connect(dsn(url))
    unprotected = compile_for_asyncpg(_unprotected, schemas["raw"])
    kept: list[int] = []

    async def fill(schema: str) -> None:
        await conn.execute(f'TRUNCATE "{schema}".cronoq_tasks')
        rows = make_rows(profile.prune_finished, profile.prune_live, TimeBase.now(), time.time_ns())
        await conn.copy_records_to_table(
            "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=schema
        )
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')

    async def protected() -> float:
        await fill(schemas["store"])
        started = time.perf_counter()
        deleted = await store.prune(_OLDER_THAN)
        rate = deleted / (time.perf_counter() - started)
        left = compile_for_asyncpg(_finished_left, schemas["store"])
        kept.append(await conn.fetchval(left.sql))
        return rate

    async def plain() -> float:
        await fill(schemas["raw"])
        params = {"cutoff": time.time_ns() - round(_OLDER_THAN * 1e9), "batch": PRUNE_BATCH}
        started = time.perf_counter()
        total = 0
        while True:
            async with conn.transaction():
                status = await conn.execute(unprotected.sql, *unprotected.args(params))
            deleted = int(status.split()[-1])
            total += deleted
            if deleted < PRUNE_BATCH:
                break
        return total / (time.perf_counter() - started)

    try:
        measured = await interleave(
            {"store": protected, "raw_unprotected": plain}, profile.prune_rounds, warmup=0
        )
    finally:
        await conn.close()
        await store.close()
    large = await _large_batch(url) if profile.prune_large else None
    if any(k != profile.prune_live for k in kept):
        raise RuntimeError(f"prune kept {kept} finished tasks, expected {profile.prune_live}")
    return {
        "finished": profile.prune_finished,
        "live_with_dependencies": profile.prune_live,
        "batch": PRUNE_BATCH,
        "variants": {name: summarize(v) for name, v in measured.items()},
        "protected_kept": kept,
        "large_batch": large,
    }


_LARGE_FINISHED = 200_000
_LARGE_LIVE = 20_000
_LARGE_TIMEOUT = 120.0


async def _large_batch(url: URL) -> dict[str, Any]:
    """Seconds for one batch of each statement on the large table (``None``: timed out),
    each run three times in a rolled-back transaction; the median is kept."""
    schema = "bench_prune_large"
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    await store.close()
    conn = await asyncpg.connect(dsn(url))
    try:
        rows = make_rows(_LARGE_FINISHED, _LARGE_LIVE, TimeBase.now(), time.time_ns())
        await conn.copy_records_to_table(
            "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=schema
        )
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
        await conn.execute(f"SET statement_timeout = '{round(_LARGE_TIMEOUT * 1000)}ms'")
        params = {"cutoff": time.time_ns() - round(_OLDER_THAN * 1e9), "batch": PRUNE_BATCH}
        seconds: dict[str, float | None] = {}
        for name, statement in (("store", st.prune_batch),):
            stmt = compile_for_asyncpg(statement, schema)
            times: list[float | None] = []
            for _ in range(3):
                tx = conn.transaction()
                await tx.start()
                started = time.perf_counter()
                try:
                    await conn.execute(stmt.sql, *stmt.args(params))
                except asyncpg.QueryCanceledError:
                    times.append(None)
                    break
                else:
                    times.append(time.perf_counter() - started)
                finally:
                    await tx.rollback()
            done = [t for t in times if t is not None]
            seconds[name] = statistics.median(done) if len(done) == len(times) else None
    finally:
        await conn.close()
    return {
        "finished": _LARGE_FINISHED,
        "live_with_dependencies": _LARGE_LIVE,
        "timeout_seconds": _LARGE_TIMEOUT,
        "seconds_per_batch": seconds,
    }
