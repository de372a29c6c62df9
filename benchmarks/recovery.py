"""Recovery: ``PgStore.recover`` against raw asyncpg running the same queries and decoding the
rows with the same :mod:`cronoq_store._schema` functions; time and peak RSS.

Each measurement runs in a fresh child process (``python -m benchmarks.recovery MODE SCHEMA``,
the server's URL in ``$BENCH_DSN``), so peak RSS (``ru_maxrss``) is that recovery's alone;
the child reports it, with its RSS before recovering, as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import URL, make_url

from cronoq_store import (
    PgStoreConfig,
    Recovered,
    RecoveredTerminal,
    TaskId,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store import _statements as st
from cronoq_store._codec import encode_deps, unix_converter
from cronoq_store._domain import Dependency, Submitted
from cronoq_store._recovery import next_id
from cronoq_store._schema import (
    INSERT_COLUMNS,
    INSERT_POSITION,
    LiveTasks,
    insert_row,
)
from cronoq_store._store import PgStore

from .common import Profile, compile_for_asyncpg, dsn, make_spec, paired, summarize

_ROOT = Path(__file__).resolve().parent.parent
_DSN_ENV = "BENCH_DSN"
_RETENTION = 3600.0
_CHUNK = 50_000
_PROTOTYPES = 20
_COLUMN = INSERT_POSITION


# --- the data ---------------------------------------------------------------------------------


def _schema(first: int, count: int, base: TimeBase, now: int) -> list[tuple[Any, ...]]:
    """Task rows made from a few encoded prototypes (building a million ``TaskSpec`` would
    take longer than the recovery): unique ids and keys, one dependency on every tenth task,
    a tenth running, and one finished task (within the retention) for every ten live ones."""
    to_unix = unix_converter(base)
    protos = [
        insert_row(Submitted(task_id(1, n), n, 0, make_spec(n)), to_unix, now)
        for n in range(1, _PROTOTYPES + 1)
    ]
    rows = []
    for n in range(first, first + count):
        row = protos[n % _PROTOTYPES].copy()
        row[_COLUMN["id"]] = task_id(1, n)
        row[_COLUMN["seq"]] = n
        if row[_COLUMN["key"]] is not None:
            row[_COLUMN["key"]] = f"job-{n}"
        if n % 10 == 0:
            row[_COLUMN["deps"]] = encode_deps([Dependency(task_id(1, n - 1))])
        if n % 10 == 1:
            row[_COLUMN["status"]] = TaskStatus.SUCCEEDED.value
            row[_COLUMN["terminal"]] = True
            row[_COLUMN["key"]] = None  # finished keys are many: keep the live index unique
        elif n % 10 == 2:
            row[_COLUMN["status"]] = TaskStatus.RUNNING.value
            row[_COLUMN["attempt"]] = 1
        rows.append(tuple(row))
    return rows


async def populate(url: URL, schema: str, live: int) -> None:
    """A migrated schema with ``live`` live tasks (and a tenth as many finished ones)."""
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    await store.close()
    conn = await asyncpg.connect(dsn(url))
    try:
        base, now = TimeBase.now(), time.time_ns()
        total = live * 10 // 9
        for first in range(1, total + 1, _CHUNK):
            await conn.copy_records_to_table(
                "cronoq_tasks",
                records=_schema(first, min(_CHUNK, total + 1 - first), base, now),
                columns=INSERT_COLUMNS,
                schema_name=schema,
            )
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
    finally:
        await conn.close()


# --- the child: one recovery ------------------------------------------------------------------


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


async def raw_recover(
    conn: asyncpg.Connection, schema: str, base: TimeBase, retention: float = _RETENTION
) -> Recovered:
    """The store's queries on raw asyncpg, in one transaction, decoded the same way."""
    high_water = compile_for_asyncpg(st.high_water, schema)
    live = compile_for_asyncpg(st.live_tasks, schema)
    terminal = compile_for_asyncpg(st.recent_terminal, schema)
    recurring = compile_for_asyncpg(st.recurring_schedules, schema)
    async with conn.transaction():
        marks = await conn.fetchrow(high_water.sql, *high_water.args({}))
        recovered = Recovered(next_id=next_id(marks[0], marks[1]))  # and the incarnation
        now = time.time_ns()
        decode = LiveTasks(base).decode
        recovered.tasks = [decode(*row) for row in await conn.fetch(live.sql)]
        dep_ids: set[int] = set()
        dep_keys: set[str] = set()
        for task in recovered.tasks:
            for dep in task.spec.deps:
                if isinstance(dep.target, str):
                    dep_keys.add(dep.target)
                else:
                    dep_ids.add(dep.target)
        params = {
            "cutoff": now - round(retention * 1e9),
            "dep_ids": list(dep_ids),
            "dep_keys": list(dep_keys),
        }
        for row in await conn.fetch(terminal.sql, *terminal.args(params)):
            status = TaskStatus.from_stored(row["status"])
            if status is not None and status.is_terminal:
                recovered.terminal.append(
                    RecoveredTerminal(
                        id=TaskId(row["id"]),
                        key=row["key"],
                        status=status,
                        at=base.from_unix(row["updated_unix_ns"]),
                    )
                )
        if await conn.fetch(recurring.sql):
            raise RuntimeError("the benchmark's schemas have no recurring schedules")
    return recovered


async def _child(mode: str, schema: str) -> dict[str, Any]:
    url = make_url(os.environ[_DSN_ENV])
    base = TimeBase.now()
    if mode == "store":
        store = await PgStore.connect(url, PgStoreConfig(schema=schema, retention=_RETENTION))
        try:
            before = _peak_rss_mib()
            started = time.perf_counter()
            recovered = await store.recover(base)
            seconds = time.perf_counter() - started
        finally:
            await store.close()
    else:
        conn = await asyncpg.connect(dsn(url))
        try:
            before = _peak_rss_mib()
            started = time.perf_counter()
            recovered = await raw_recover(conn, schema, base)
            seconds = time.perf_counter() - started
        finally:
            await conn.close()
    return {
        "seconds": seconds,
        "tasks": len(recovered.tasks),
        "terminal": len(recovered.terminal),
        "rss_before_mib": before,
        "peak_rss_mib": _peak_rss_mib(),
    }


async def _measure(url: URL, mode: str, schema: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.recovery",
        mode,
        schema,
        cwd=_ROOT,
        env={**os.environ, _DSN_ENV: dsn(url)},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the {mode} recovery of {schema} failed ({process.returncode})")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


# --- the parent -------------------------------------------------------------------------------


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """Per size: seconds and peak RSS of both sides and the paired ratio of their rates
    (raw seconds / store seconds); every size and side runs once per round, in an order
    that alternates, so the per-task rate of each larger size is paired with the smallest
    one's of the same round (``per_task_vs_<smallest>``: 1.0 when recovery is linear)."""
    sizes = profile.recovery_sizes
    populated: dict[int, float] = {}
    for live in sizes:
        started = time.monotonic()
        await populate(url, f"bench_recovery_{live}", live)
        populated[live] = time.monotonic() - started
    runs: dict[int, dict[str, list[dict[str, Any]]]] = {n: {"store": [], "raw": []} for n in sizes}
    for r in range(profile.recovery_rounds):
        for live in sizes if r % 2 == 0 else sizes[::-1]:
            for mode in ("store", "raw") if r % 2 == 0 else ("raw", "store"):
                runs[live][mode].append(await _measure(url, mode, f"bench_recovery_{live}"))
    results: dict[str, Any] = {}
    smallest = sizes[0]
    for live in sizes:
        measured = runs[live]
        counts = {(m["tasks"], m["terminal"]) for ms in measured.values() for m in ms}
        if len(counts) != 1:
            raise RuntimeError(f"the recoveries disagree on what they loaded: {counts}")
        result: dict[str, Any] = {
            "populate_seconds": round(populated[live], 1),
            "loaded": dict(zip(("tasks", "terminal"), counts.pop(), strict=True)),
            "variants": {
                mode: {
                    "seconds": summarize([m["seconds"] for m in ms]),
                    "tasks_per_second": summarize([m["tasks"] / m["seconds"] for m in ms]),
                    "peak_rss_mib": summarize([m["peak_rss_mib"] for m in ms]),
                    "rss_before_mib": summarize([m["rss_before_mib"] for m in ms]),
                }
                for mode, ms in measured.items()
            },
            "store_vs_raw": paired(
                [m["seconds"] for m in measured["raw"]], [m["seconds"] for m in measured["store"]]
            ),
        }
        if live != smallest:
            for mode, key in (("store", "per_task_vs_"), ("raw", "raw_per_task_vs_")):
                result[f"{key}{smallest}"] = paired(
                    [m["tasks"] / m["seconds"] for m in measured[mode]],
                    [m["tasks"] / m["seconds"] for m in runs[smallest][mode]],
                )
        results[str(live)] = result
    return results


if __name__ == "__main__":
    from .loops import run_loop  # only the child process runs a loop of its own

    print(json.dumps(run_loop(_child(sys.argv[1], sys.argv[2]))))
