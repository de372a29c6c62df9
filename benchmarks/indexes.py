"""What index designs that allow HOT updates, or fewer indexes, would save and cost.

Every status transition rewrites every index of ``cronoq_tasks`` today: ``updated_unix_ns``
is in ``ix_cronoq_tasks_finished_updated``, so no update is HOT (heap-only: no index entry
written). A live-to-live transition (queued to running, running to retrying) changes no
other indexed column (``terminal`` stays false, and PostgreSQL compares the values), so
without a B-tree on ``updated_unix_ns``, and with room on the page, it can be HOT. A
transition to a finished state changes ``terminal`` and can never be. A batch moves tasks
inserted together, so every row of a page is updated by the same statement: HOT for all of
them needs about half of each page free (fillfactor 50).

Each design is a throwaway schema built by the store's migrations, its indexes then changed,
holding ``index_rows`` rows of history (``benchmarks.history``). A trial commits fresh tasks
(not timed), then times their lives through ``PgStore.commit``: queued to running, then
running to succeeded, in batches of 100; WAL bytes per transition come from the WAL
position around the timed part, the HOT fraction from ``pg_stat_user_tables``. What the
designs cost the queries that used the indexes: ``EXPLAIN ANALYZE`` execution time of the
store's own statements on the same tables (best of three).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
from sqlalchemy.engine import URL

from cronoq_store import StatusChanged, Submitted, TaskStatus, task_id
from cronoq_store import _statements as st
from cronoq_store._store import PgStore

from .commit import SharedBatches
from .common import (
    Profile,
    Trial,
    Workload,
    compile_for_asyncpg,
    dsn,
    interleave,
    open_store,
    paired,
    summarize,
)
from .history import HISTORY_EPOCH, seed

_BATCH = 100
_BATCHES = 30
_FINISHED = "ix_cronoq_tasks_finished_updated"
_LIVE_DEPS = "ix_cronoq_tasks_live_deps"
_BRIN = "CREATE INDEX {name} ON {table} USING brin (updated_unix_ns) WHERE terminal"

#: A B-tree like today's finished index, on a column no live transition changes: the write
#: cost of a ``finished_unix_ns`` column set once, by the transition to a finished state (its
#: queries cost what today's index costs: the same shape).
_STABLE = "CREATE INDEX {name} ON {table} (arrival_unix_ns, id) WHERE terminal"
_PROXY_NOTE = (
    "write cost of a finished_unix_ns column; its queries cost what current's do (the "
    "queries_ms shown ran without an index on updated_unix_ns)"
)

#: Each design: the indexes it drops, the DDL it adds ({table} and {name} filled in), and the
#: table's fillfactor (free room on each page for HOT updates). ``current`` is the schema.
DESIGNS: dict[str, dict[str, Any]] = {
    "current": {"drop": (), "add": (), "fillfactor": 100},
    "current_ff50": {"drop": (), "add": (), "fillfactor": 50},
    "no_live_deps": {"drop": (_LIVE_DEPS,), "add": (), "fillfactor": 100},
    "no_finished_index_ff50": {"drop": (_FINISHED,), "add": (), "fillfactor": 50},
    "brin_finished_ff50": {"drop": (_FINISHED,), "add": (_BRIN,), "fillfactor": 50},
    "stable_finished_key_ff70": {"drop": (_FINISHED,), "add": (_STABLE,), "fillfactor": 70},
    "stable_finished_key_ff50": {"drop": (_FINISHED,), "add": (_STABLE,), "fillfactor": 50},
}

_INDEXES = """
SELECT pg_get_indexdef(i.indexrelid)
FROM pg_index i
WHERE i.indrelid = to_regclass(quote_ident($1) || '.cronoq_tasks')
ORDER BY i.indexrelid::regclass::text
"""
_STATS = """
SELECT n_tup_upd, n_tup_hot_upd, pg_table_size(relid) FROM pg_stat_user_tables
WHERE schemaname = $1 AND relname = 'cronoq_tasks'
"""


def _schema(design: str) -> str:
    return f"bench_ix_{design}"


async def _build(conn: asyncpg.Connection, design: str, rows: int) -> list[str]:
    """The design's indexes and fillfactor on a migrated schema, then the history."""
    spec, schema = DESIGNS[design], _schema(design)
    table = f'"{schema}".cronoq_tasks'
    await conn.execute(f"ALTER TABLE {table} SET (fillfactor = {spec['fillfactor']})")
    for name in spec["drop"]:
        await conn.execute(f'DROP INDEX "{schema}".{name}')
    for n, ddl in enumerate(spec["add"]):
        await conn.execute(ddl.format(table=table, name=f"ix_cronoq_tasks_design_{n}"))
    await seed(conn, schema, rows, epoch=HISTORY_EPOCH, key_prefix="hist-")
    return [r[0] for r in await conn.fetch(_INDEXES, schema)]


def _queries(prune_cutoff: int, recent_cutoff: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The store's statements that read through the indexes the designs change."""
    return {
        "recovery_live_scan": (st.live_tasks, {}),
        "recovery_recent_terminal": (
            st.recent_terminal,
            {"cutoff": recent_cutoff, "dep_ids": [], "dep_keys": []},
        ),
        "prune_batch": (st.prune_batch, {"cutoff": prune_cutoff, "batch": 1000}),
        "finished_page": (
            st.finished_page,
            {"after": 0, "pools": [], "statuses": [], "limit": 100},
        ),
        "task_by_key": (st.task_by_key, {"key": "hist-1000"}),
        "task_by_id": (st.task_by_id, {"id": task_id(HISTORY_EPOCH, 1001)}),
    }


_UPDATED = "SELECT updated_unix_ns FROM {table} WHERE id = $1"


async def _timings(conn: asyncpg.Connection, schema: str, rows: int) -> dict[str, float]:
    """Execution time (ms, best of three) of each query, in a transaction rolled back:
    prune's candidates are the older half of the history, recovery's window its last 10%."""
    updated = _UPDATED.format(table=f'"{schema}".cronoq_tasks')
    prune_cutoff = await conn.fetchval(updated, task_id(HISTORY_EPOCH, rows // 2))
    recent_cutoff = await conn.fetchval(updated, task_id(HISTORY_EPOCH, rows - rows // 10))
    timings = {}
    for name, (statement, params) in _queries(prune_cutoff, recent_cutoff).items():
        compiled = compile_for_asyncpg(statement, schema)
        best = float("inf")
        for _ in range(3):
            tx = conn.transaction()
            await tx.start()
            try:
                plan = await conn.fetchval(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) {compiled.sql}", *compiled.args(params)
                )
            finally:
                await tx.rollback()
            best = min(best, json.loads(plan)[0]["Execution Time"])
        timings[name] = round(best, 2)
    return timings


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """The profile's designs against ``current``, interleaved; the schemas are dropped
    afterwards."""
    names = ("current", *(d for d in profile.index_designs or DESIGNS if d != "current"))
    print(f"   indexes: {', '.join(names)} on {profile.index_rows:,} rows", flush=True)
    conn = await asyncpg.connect(dsn(url))
    try:
        async with AsyncExitStack() as stack:
            designs = await _measure(stack, conn, url, profile, names)
        # The stores' sessions have ended, so their statistics are flushed.
        await asyncio.sleep(0.5)
        for name, design in designs.items():
            upd, hot, size = await conn.fetchrow(_STATS, _schema(name))
            design["table_mib"] = round(size / 2**20)
            design["hot_fraction"] = round(hot / upd, 3) if upd else 0.0
            design["queries_ms"] = await _timings(conn, _schema(name), profile.index_rows)
    finally:
        for name in names:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{_schema(name)}" CASCADE')
        await conn.close()
    return {"rows": profile.index_rows, "batch": _BATCH, "designs": designs}


async def _measure(
    stack: AsyncExitStack,
    conn: asyncpg.Connection,
    url: URL,
    profile: Profile,
    names: tuple[str, ...],
) -> dict[str, dict[str, Any]]:
    stores: dict[str, tuple[PgStore, int]] = {}
    indexes: dict[str, list[str]] = {}
    for design in names:
        store, epoch = await open_store(url, _schema(design))
        stack.push_async_callback(store.close)
        stores[design] = store, epoch
        indexes[design] = await _build(conn, design, profile.index_rows)
    await conn.execute("CHECKPOINT")

    workload = Workload()
    base = workload.base
    shared: SharedBatches[Submitted] = SharedBatches(
        lambda: workload.batches(_BATCH, _BATCHES), consumers=len(names)
    )
    wal: dict[str, list[float]] = {design: [] for design in names}

    def trial(design: str) -> Trial:
        store, epoch = stores[design]

        async def run_trial() -> float:
            batches = shared.next(design)
            for batch in batches:
                await store.commit(epoch, base, batch, ())
            at = base.from_unix(time.time_ns())
            lives = [
                [StatusChanged(m.id, status, 1, at) for m in batch]
                for status in (TaskStatus.RUNNING, TaskStatus.SUCCEEDED)
                for batch in batches
            ]
            before = await conn.fetchval("SELECT pg_current_wal_lsn()")
            started = time.perf_counter()
            for moves in lives:
                await store.commit(epoch, base, moves, ())
            took = time.perf_counter() - started
            after = await conn.fetchval("SELECT pg_current_wal_lsn()")
            count = sum(map(len, lives))
            written = await conn.fetchval("SELECT $1::pg_lsn - $2::pg_lsn", after, before)
            wal[design].append(float(written) / count)
            return count / took

        return run_trial

    measured = await interleave({design: trial(design) for design in names}, profile.rounds)
    return {
        design: {
            "indexes": indexes[design],
            "transitions": summarize(values),
            "vs_current": paired(values, measured["current"]),
            "wal_bytes_per_update": round(summarize(wal[design][-len(values) :])["median"]),
            **({"note": _PROXY_NOTE} if _STABLE in DESIGNS[design]["add"] else {}),
        }
        for design, values in measured.items()
    }
