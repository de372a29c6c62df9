"""The statements compile once: every later call, with any batch size and in any schema,
runs SQL that was compiled before.

Reads go through SQLAlchemy, detected the documented way: with INFO logging on
``sqlalchemy.engine.Engine``, each execution logs ``[generated in ...]`` when it compiled
the statement and ``[cached since ...]`` when the compiled cache served it ("Estimating
Cache Performance Using Logging" in SQLAlchemy's docs). Commits run SQL compiled when the
store was built, on the driver connection: SQLAlchemy executes nothing for them, and the
texts asyncpg sees (its query logger) are a fixed set per schema, whatever the batch size,
so asyncpg's prepared-statement cache serves every later batch; only a transaction's
opening, sent unprepared with its integers rendered in, varies.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import ClauseElement, Table, event
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.sql.compiler import SQLCompiler

from cronoq_store import _catalog as catalog
from cronoq_store import _listing_statements as listing
from cronoq_store import _statements as st
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store._door import CompiledStatement
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import PROCESS_BASE, RUNNING, SUCCEEDED, changed, submitted

SQL_LOGGER = "sqlalchemy.engine.Engine"
SCHEDULE = RecurringSpec("r", IntervalSchedule(timedelta(seconds=5)), TaskSpec(b"t"))


async def exercise(store: PgStore, first: int, size: int) -> int:
    """Run every statement of the store with ``size`` rows in each array; ids from
    ``first`` on are new, the one before exists. Returns the next free id."""
    mutations: list[Mutation] = [submitted(i, key=f"k{i}") for i in range(first, first + size)]
    old = [TaskId(max(1, first - size + i)) for i in range(size)]  # repeats are folded
    mutations += [changed(id, SUCCEEDED, 1, message="ok") for id in old]
    mutations += [
        RecurringUpsert(SCHEDULE),
        RecurringNext("r", first, TaskId(first)),
        RecurringRemove("r"),
    ]
    await store.commit(0, PROCESS_BASE, mutations, [(id, b"out") for id in old])
    # No new ids: the epoch check takes the FOR SHARE path.
    await store.commit(0, PROCESS_BASE, [changed(first, RUNNING, 2)], [])
    await store.recover(PROCESS_BASE)
    await store.get_task(TaskId(first))
    await store.get_task(f"k{first}")
    await store.list_finished(pools=["default"], statuses=[TaskStatus.SUCCEEDED], limit=size)
    await store.load_output(TaskId(first))
    await store.prune(3600)
    return first + size


@pytest.fixture
async def second_schema(pg_url: URL) -> AsyncIterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def cache_stats(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The cache verdict of every statement executed since the last ``caplog.clear()``."""
    return [
        r.getMessage().split("]")[0] + "]"
        for r in caplog.records
        if r.name == SQL_LOGGER and r.getMessage().startswith("[")
    ]


async def test_every_call_after_the_first_runs_compiled_sql(
    pg_url: URL, migrated: str, second_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    driver_sql: list[str] = []
    engine = create_async_engine(async_url(pg_url))

    @event.listens_for(engine.sync_engine, "connect")
    def log_queries(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.driver_connection.add_query_logger(
            lambda logged: driver_sql.append(logged.query)
        )

    caplog.set_level(logging.INFO, logger=SQL_LOGGER)
    store_a = await PgStore.from_engine(engine, PgStoreConfig(schema=migrated))
    store_b = await PgStore.from_engine(engine, PgStoreConfig(schema=second_schema))
    try:
        caplog.clear()
        await store_a.commit(0, PROCESS_BASE, [submitted(1, key="k1")], [])
        next_a = await exercise(store_a, 2, 1)
        warm_up = cache_stats(caplog)
        # The detection works: the first batches compiled the statements they ran.
        assert any(s.startswith("[generated in") for s in warm_up), warm_up

        caplog.clear()
        await store_b.commit(0, PROCESS_BASE, [submitted(1, key="k1")], [])
        next_b = 2
        for size in (1, 7, 120):
            next_a = await exercise(store_a, next_a, size)
            next_b = await exercise(store_b, next_b, size)
        stats = cache_stats(caplog)
        sqlalchemy_sql = [r.getMessage() for r in caplog.records if r.name == SQL_LOGGER]
        seen = set(driver_sql)
        driver_sql.clear()
        # 5 new tasks take the fenced insert of 8 rows (its sizes: 1, 2, 4, 8, 16, 31),
        # prepared by the batches of 7 above.
        for size in (5, 50):
            next_a = await exercise(store_a, next_a, size)
            next_b = await exercise(store_b, next_b, size)
        later = set(driver_sql)
    finally:
        await store_a.close()
        await store_b.close()
        await engine.dispose()
    # Reads: every one served by SQLAlchemy's compiled cache.
    assert len(stats) >= 2 * 3 * 7
    missed = [s for s in stats if not s.startswith("[cached since")]
    assert missed == []
    # Commits: nothing through SQLAlchemy, and no SQL text asyncpg had not prepared before.
    # (Prune's own statement updates the leader row: only commits are meant here.)
    assert not any("INSERT INTO" in m or "UPDATE cronoq_tasks" in m for m in sqlalchemy_sql)
    assert any("INSERT INTO" in q for q in later)
    # A transaction's opening (BEGIN, the store's settings on these borrowed sessions, and
    # for a commit the epoch check, its integers as literals) goes unprepared, by the simple
    # protocol: the one text that varies from batch to batch.
    openings = {q for q in later if q.startswith("BEGIN ")}
    assert openings
    assert not any("$" in q for q in openings)
    assert later - openings <= seen, later - openings - seen


# --- a commit path's statements, rendered per schema ----------------------------------------

DIALECT = PGDialect_asyncpg()  # type: ignore[no-untyped-call]
# Names that need quoting (upper case, a reserved word) and names that do not.
SCHEMAS = ["cluster_a", "Tenant_42", "select", "user", "_x9", "a" * 63]


def every_statement() -> list[tuple[str, ClauseElement]]:
    """Every statement the package's statement modules define, by name."""
    return [
        (f"{module.__name__}.{name}", value)
        for module in (st, catalog, listing)
        for name, value in vars(module).items()
        if isinstance(value, ClauseElement) and not isinstance(value, Table)
    ]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_statement_rendered_for_a_schema_is_the_one_compiled_for_it(schema: str) -> None:
    checked = 0
    for name, statement in every_statement():
        try:
            direct = statement.compile(
                dialect=DIALECT, schema_translate_map={None: schema}, render_schema_translate=True
            )
        except CompileError:
            continue  # a fragment that compiles only inside another statement
        rendered = CompiledStatement.of(statement, DIALECT, schema)
        assert rendered.sql == direct.string, name
        assert rendered.names == tuple(getattr(direct, "positiontup", None) or ()), name
        assert dict(rendered.defaults) == dict(getattr(direct, "params", None) or {}), name
        checked += 1
    assert checked > 50


def test_a_statement_compiles_once_for_every_schema() -> None:
    compiles: list[object] = []
    original = SQLCompiler.__init__

    def counting(self: SQLCompiler, *args: Any, **kwargs: Any) -> None:
        compiles.append(self)
        original(self, *args, **kwargs)

    statement = st.insert_tasks_fenced(8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SQLCompiler, "__init__", counting)
        first = CompiledStatement.of(statement, DIALECT, "tenant_1")
        compiled_first = len(compiles)
        others = [CompiledStatement.of(statement, DIALECT, f"tenant_{i}") for i in range(2, 200)]
    assert len(compiles) == compiled_first  # no compile after the first schema's
    assert "tenant_1.cronoq_tasks" in first.sql
    assert all(f"tenant_{i}.cronoq_tasks" in o.sql for i, o in enumerate(others, start=2))
    assert all("__[SCHEMA" not in o.sql for o in others)
