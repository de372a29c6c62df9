"""Concurrent callers of ``PgStore.commit``, one new task per transaction: 64 callers
against one, and against raw asyncpg on 64 connections running the same insert without
the epoch check (PostgreSQL's own group commit: the bound a fenced commit can approach).
The floor of the store on its own pool is raw asyncpg on 64 connections sending the store's
own fenced insert (``insert_tasks_fenced(1)``: the epoch check under a share lock of the leader
row, the conflict rule). The floor of the store on an application's engine is that
engine's own cost: the same
plain insert through SQLAlchemy on the same engine, a transaction per insert (a pool
checkout, ``BEGIN``, the insert, ``COMMIT``), the store taken out.

Commits share the fence (a share lock of the leader row), so concurrent callers overlap
their WAL flushes instead of queueing on the row. The store's pool has room for every
caller (``max_connections`` = callers); the store on an application's engine
(``from_engine``: every commit a transaction) is measured beside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
from sqlalchemy import Text, bindparam, cast, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import Submitted
from cronoq_store import _statements as st
from cronoq_store._codec import unix_converter
from cronoq_store._config import PgStoreConfig
from cronoq_store._door import RowsStatement
from cronoq_store._schema import INSERT_COLUMNS, JSON_COLUMNS, insert_row, tasks
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .common import (
    Profile,
    Workload,
    compile_for_asyncpg,
    dsn,
    interleave,
    open_store,
    paired,
    summarize,
)

#: Concurrent callers of the comparison.
CALLERS = 64

#: One new task, as the store's one-task insert sends it, without the epoch check or the
#: conflict rule: the plain insert PostgreSQL groups the commits of.
_plain_insert = postgresql.insert(tasks).from_select(
    list(INSERT_COLUMNS),
    select(
        *(
            (
                cast(bindparam(name, type_=Text), JSONB)
                if name in JSON_COLUMNS
                else bindparam(name, type_=tasks.c[name].type)
            ).label(name)
            for name in INSERT_COLUMNS
        )
    ),
)


async def _drive(
    commit: Callable[[Submitted], Awaitable[None]],
    workload: Workload,
    callers: int,
    seconds: float,
) -> float:
    """``callers`` loops, each committing one new task at a time until the deadline;
    mutations per second."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await commit(workload.one())
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return done / (time.perf_counter() - started)


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """One caller, ``CALLERS`` callers on the store's own pool and on an application's
    engine, and raw asyncpg on ``CALLERS`` connections, interleaved."""
    async with AsyncExitStack() as stack:
        schema = "bench_callers"
        store, epoch = await open_store(url, schema, max_connections=CALLERS)
        stack.push_async_callback(store.close)
        engine = create_async_engine(async_url(url), pool_size=CALLERS, max_overflow=0)
        stack.push_async_callback(engine.dispose)
        borrowed = await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
        stack.push_async_callback(borrowed.close)
        raw_schema = "bench_callers_raw"
        raw_store, raw_epoch = await open_store(url, raw_schema)  # migrates the raw side
        fence = {"epoch": raw_epoch, "incarnation": raw_store.incarnation}
        await raw_store.close()  # its epoch stays stored: the fenced statement passes
        pool = await asyncpg.create_pool(dsn(url), min_size=CALLERS, max_size=CALLERS)
        stack.push_async_callback(pool.close)
        insert = compile_for_asyncpg(_plain_insert, raw_schema)
        fenced = RowsStatement.of(
            compile_for_asyncpg(st.insert_tasks_fenced(1), raw_schema), st.fenced_row_names(1), 1
        )
        workload = Workload()
        base = workload.base
        to_unix = unix_converter(base)
        seconds = profile.group_seconds

        async def raw(m: Submitted) -> None:
            row = dict(zip(INSERT_COLUMNS, insert_row(m, to_unix, time.time_ns()), strict=True))
            async with pool.acquire() as conn:
                await conn.execute(insert.sql, *insert.args(row))

        async def raw_store_sql(m: Submitted) -> None:
            row = insert_row(m, to_unix, time.time_ns())
            async with pool.acquire() as conn:
                current = await conn.fetchval(fenced.compiled.sql, *fenced.args([row], fence))
            if current != raw_epoch:
                raise RuntimeError(f"fenced: epoch {current}, expected {raw_epoch}")

        on_raw_schema = _plain_insert.execution_options(schema_translate_map={None: raw_schema})

        async def engine_floor(m: Submitted) -> None:
            row = dict(zip(INSERT_COLUMNS, insert_row(m, to_unix, time.time_ns()), strict=True))
            async with engine.begin() as conn:
                await conn.execute(on_raw_schema, row)

        def on(s: PgStore) -> Callable[[Submitted], Awaitable[None]]:
            return lambda m: s.commit(epoch, base, [m], ())

        measured = await interleave(
            {
                "one": lambda: _drive(on(store), workload, 1, seconds),
                "callers": lambda: _drive(on(store), workload, CALLERS, seconds),
                "engine": lambda: _drive(on(borrowed), workload, CALLERS, seconds),
                "raw": lambda: _drive(raw, workload, CALLERS, seconds),
                "engine_floor": lambda: _drive(engine_floor, workload, CALLERS, seconds),
                "raw_store_sql": lambda: _drive(raw_store_sql, workload, CALLERS, seconds),
            },
            profile.group_rounds,
        )
    return {
        "callers": CALLERS,
        "variants": {name: summarize(v) for name, v in measured.items()},
        "callers_vs_one": paired(measured["callers"], measured["one"]),
        "engine_vs_one": paired(measured["engine"], measured["one"]),
        "callers_vs_raw": paired(measured["callers"], measured["raw"]),
        "engine_vs_raw": paired(measured["engine"], measured["raw"]),
        # The floor: the application's engine alone, over raw; the store on it over that.
        "engine_floor_vs_raw": paired(measured["engine_floor"], measured["raw"]),
        "engine_vs_engine_floor": paired(measured["engine"], measured["engine_floor"]),
        # The floor of the store's own pool: raw asyncpg sending the store's fenced insert.
        "store_sql_vs_raw": paired(measured["raw_store_sql"], measured["raw"]),
    }
