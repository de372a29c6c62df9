"""A batch of new tasks too small for COPY travels as one statement whose rows are a
``VALUES`` list (``statements.insert_tasks_fenced``): only its first row's parameters carry
their types, every value is bound by position, and its size is bounded."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import _statements as st
from cronoq_store._commit_path import COPY_MIN_ROWS, BatchWriter, fold
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    Dependency,
    FixedStart,
    MissPolicy,
    Mutation,
    Priority,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store._door import CompiledStatement, RowsStatement
from cronoq_store._errors import FencedError, IdCollisionError
from cronoq_store._migrations import upgrade
from cronoq_store._schema import INSERT_COLUMNS
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import (
    I32_MAX,
    I64_MAX,
    I64_MIN,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    execute,
    submitted,
)
from .test_commit import varied_spec

#: Each test runs on a store on an application's engine and on one on its own pool.
STORE_OPENINGS = ("from_engine", "connect")

#: The dialect the store compiles its statements for.
DIALECT = asyncpg_dialect()  # type: ignore[no-untyped-call]

#: Every column but the commit's own clock.
_COMPARED = ", ".join(c for c in INSERT_COLUMNS if c != "updated_unix_ns")


def batch_of(count: int, first_id: int) -> list[Mutation]:
    """``count`` new tasks: the first with no option at all (its typed parameters are
    NULL), the others with options, NUL and non-ASCII text across them."""
    return [
        submitted(first_id, TaskSpec(b"")),
        *(submitted(first_id + i, varied_spec(first_id + i)) for i in range(1, count)),
    ]


@pytest.fixture
async def copied(engine: AsyncEngine, pg_url: URL) -> AsyncIterator[PgStore]:
    """A store on a schema of its own that sends every new task by COPY."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    await upgrade(engine, schema)
    try:
        async with await PgStore.from_engine(engine, PgStoreConfig(schema=schema)) as store:
            store._commits.writer = BatchWriter(store.engine.dialect, schema, copy_min_rows=1)
            yield store
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def stored(store: PgStore) -> list[tuple[Any, ...]]:
    rows = await execute(store, f"SELECT {_COMPARED} FROM {{s}}.cronoq_tasks ORDER BY id")
    return [tuple(r) for r in rows]


async def test_every_row_count_stores_each_column_as_copy_does(
    store: PgStore, copied: PgStore
) -> None:
    for count in range(1, COPY_MIN_ROWS):
        batch = batch_of(count, 100 * count)
        assert store._commits.writer.path(fold(batch, START_BASE, 0)) == "insert"
        await store.commit(0, START_BASE, batch, [])
        await copied.commit(0, START_BASE, batch, [])
    written = await stored(store)
    assert len(written) == sum(range(1, COPY_MIN_ROWS))
    assert written == await stored(copied)
    # What COPY stores is what was submitted: the tasks recover as they were (NUL cleaned).
    recovered = {t.id: t.spec for t in (await store.recover(START_BASE)).tasks}
    assert recovered[TaskId(3100)] == TaskSpec(b"")
    assert recovered[TaskId(3130)] == varied_spec(3130, "\ufffd")


#: Engine time is Unix time: engine times at the edge are stored at the edge.
_SAME = TimeBase(engine_ns=0, unix_ns=0)
#: The longest duration a BIGINT of ns holds, to the microsecond a timedelta keeps.
_LONGEST = timedelta(microseconds=I64_MAX // 1000)


def edge_row(n: int) -> list[Mutation]:
    """Task ``n`` with each column at one edge of its range or the other (by ``n``'s
    parity; columns of one type at opposite edges, so that values bound to each other's
    places show), JSON that needs escapes, and every other one moved to running."""
    low = n % 2 == 0
    spec = TaskSpec(
        bytes(range(256)) * (n % 3) + b"\x00",
        kind="\u00e9\x00\U0001f600" * n,
        pool="\ud800" if low else "p",
        priority=Priority.LOW if low else Priority.CRITICAL,
        key=None if low else f'k"\\u0000{n}\U0001f600',
        deadline=I64_MIN if low else I64_MAX,
        fixed_start=FixedStart(I64_MAX, _LONGEST, MissPolicy.FAIL) if low else FixedStart(I64_MIN),
        duration_hint=_LONGEST if low else timedelta(0),
        timeout=timedelta(0) if low else _LONGEST,
        retry=RetryPolicy(max_attempts=I32_MAX, backoff=_LONGEST, multiplier=1e308),
        deps=[Dependency(TaskId(I64_MAX)), Dependency(f"\udfff\\u0041{n}")],
        resources={"cpu": I64_MAX, "gpu": 0, "a\x00": 1, "\\u00e9": 2},
        tags=["\ud83d", "", "\\"],
        labels=["x\x00", '"'],
        tenant="" if low else "\udc00",
    )
    tid = TaskId(n)
    sent = Submitted(tid, 0 if low else I64_MAX, I64_MIN if low else I64_MAX, spec)
    if low:
        return [sent]
    return [sent, StatusChanged(tid, TaskStatus.RUNNING, I32_MAX, I64_MAX, "m\udfff\x00")]


async def test_edge_values_in_the_untyped_rows_are_stored_as_copy_stores_them(
    store: PgStore, copied: PgStore
) -> None:
    """The first row typed and empty (NULL where it may be); the later rows, whose types
    the server infers from the first row's, at the edges of their columns: a type inferred
    narrower, or a value bound to another column, stores another row than COPY does."""
    batch = [
        Submitted(TaskId(1), 0, 0, TaskSpec(b"")),
        *(m for n in range(2, 32) for m in edge_row(n)),
    ]
    assert store._commits.writer.path(fold(batch, _SAME, 0)) == "insert"
    await store.commit(0, _SAME, batch, [])
    await copied.commit(0, _SAME, batch, [])
    written = await stored(store)
    assert len(written) == st.FENCED_INSERT_MAX_ROWS
    assert written == await stored(copied)
    running = await execute(
        store, "SELECT count(*) FROM {s}.cronoq_tasks WHERE updated_unix_ns = :top", top=I64_MAX
    )
    assert running[0][0] == 15


async def test_new_tasks_beside_other_writes_store_each_column_as_copy_does(
    store: PgStore, copied: PgStore
) -> None:
    """A batch that also moves stored tasks and gives outputs is a transaction; its new
    tasks, too few for COPY, travel as the fenced insert's ``VALUES`` list inside it (on
    the store's own pool and on an application's engine): stored as COPY stores them, the
    other writes beside them, at every row count."""
    for count in range(1, COPY_MIN_ROWS):
        first = 100 * count
        earlier = [submitted(first - 1), submitted(first - 2)]
        await store.commit(0, START_BASE, earlier, [])
        await copied.commit(0, START_BASE, earlier, [])
        batch = [
            *batch_of(count, first),
            changed(first - 1, RUNNING, 5),
            changed(first - 2, SUCCEEDED, 6),
        ]
        outputs = [(TaskId(first - 2), b"out %d" % count)]
        assert store._commits.writer.path(fold(batch, START_BASE, 0, outputs)) == "transaction"
        await store.commit(0, START_BASE, batch, outputs)
        await copied.commit(0, START_BASE, batch, outputs)
    written = await stored(store)
    assert len(written) == sum(range(1, COPY_MIN_ROWS)) + 2 * (COPY_MIN_ROWS - 1)
    assert written == await stored(copied)
    finished = await execute(
        store,
        "SELECT count(*) FROM {s}.cronoq_tasks WHERE status = 'succeeded' AND output IS NOT NULL",
    )
    assert finished[0][0] == COPY_MIN_ROWS - 1


async def test_new_tasks_in_a_transaction_travel_as_values_not_arrays(pg_url: URL) -> None:
    """The driver checks each element of an array parameter in Python: the new tasks of a
    mixed batch too few for COPY are sent as the fenced insert's scalar parameters, the
    statement batches of new tasks alone use, and never as the insert of 25 arrays."""
    engine = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        await upgrade(engine, schema)
        async with await PgStore.from_engine(engine, PgStoreConfig(schema=schema)) as store:
            await store.commit(0, START_BASE, [submitted(1)], [])
            for count in (1, 5, 31):
                batch = [*batch_of(count, 100 * count), changed(1, RUNNING, count)]
                await store.commit(0, START_BASE, batch, [])
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text(
                        "SELECT strpos(statement, 'FROM (VALUES') > 0 "
                        "FROM pg_prepared_statements WHERE strpos(statement, 'INSERT INTO') > 0 "
                        "AND strpos(statement, 'pg_') = 0"
                    )
                )
                inserts = [r[0] for r in rows]
        assert inserts == [True] * 3  # the fenced inserts of 1, 8 and 31 rows, no other
    finally:
        await engine.dispose()
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def test_a_mixed_batch_sent_again_with_its_tasks_moved_on_lands_once(
    store: PgStore,
) -> None:
    """A mixed batch that landed, retried with a transition of one of its new tasks: the
    fenced insert refuses the stored row that is behind, and the batch is written again
    with that transition in the update; an id held by another task is still named."""
    batch: list[Mutation] = [*(submitted(n) for n in range(1, 6)), submitted(50)]
    await store.commit(0, START_BASE, batch, [])
    again = [*batch, changed(3, RUNNING, 100), changed(50, SUCCEEDED, 100), submitted(6)]
    await store.commit(0, START_BASE, again, [(TaskId(50), b"done")])
    rows = await execute(
        store, "SELECT id, status, output FROM {s}.cronoq_tasks WHERE id IN (3, 6, 50) ORDER BY id"
    )
    assert [tuple(r) for r in rows] == [
        (3, "running", None),
        (6, "queued", None),
        (50, "succeeded", b"done"),
    ]
    with pytest.raises(IdCollisionError) as raised:
        await store.commit(0, START_BASE, [submitted(4, b"other"), changed(1, RUNNING, 200)], [])
    assert raised.value.ids == [4]
    status = await execute(store, "SELECT status FROM {s}.cronoq_tasks WHERE id = 1")
    assert status[0][0] == "queued"  # nothing of the refused batch was written


async def test_a_batch_of_the_largest_size_is_fenced_and_writes_nothing(store: PgStore) -> None:
    batch = batch_of(st.FENCED_INSERT_MAX_ROWS, 1)
    with pytest.raises(FencedError):
        await store.commit(7, START_BASE, batch, [])
    assert await stored(store) == []


async def test_an_id_held_by_another_task_is_named_from_a_one_statement_batch(
    store: PgStore,
) -> None:
    await store.commit(0, START_BASE, [submitted(5, b"first")], [])
    batch = [submitted(n, b"second") for n in range(1, 11)]
    with pytest.raises(IdCollisionError) as raised:
        await store.commit(0, START_BASE, batch, [])
    assert raised.value.ids == [5]
    assert [r[0] for r in await execute(store, "SELECT id FROM {s}.cronoq_tasks")] == [5]


async def test_a_large_batch_refused_by_copy_is_written_again_in_a_transaction(
    store: PgStore,
) -> None:
    """Its COPY finds its tasks stored (a retry of a batch that landed, with a transition
    ahead): it is written again, but never as one fenced statement, whose rows are
    bounded."""
    count = st.FENCED_INSERT_MAX_ROWS + 9
    batch: list[Mutation] = [submitted(n) for n in range(1, count + 1)]
    await store.commit(0, START_BASE, batch, [])
    await store.commit(0, START_BASE, [*batch, changed(count, RUNNING, 100)], [])
    rows = await execute(store, "SELECT count(*), max(status) FROM {s}.cronoq_tasks")
    assert tuple(rows[0]) == (count, "running")


def test_the_largest_statement_is_cached_by_asyncpg_for_the_longest_schema_name() -> None:
    """asyncpg prepares again, at every execution, a statement longer than its
    ``max_cacheable_statement_size``: the largest fenced insert stays well under its
    default, whatever the schema's name."""
    limit = inspect.signature(asyncpg.connect).parameters["max_cacheable_statement_size"]
    longest = "s" * 63
    compiled = CompiledStatement.of(
        st.insert_tasks_fenced(st.FENCED_INSERT_MAX_ROWS), DIALECT, longest
    )
    assert longest in compiled.sql
    assert len(compiled.sql.encode()) < 0.8 * limit.default


def test_a_statement_whose_parameters_do_not_lead_with_its_rows_is_refused() -> None:
    compiled = CompiledStatement.of(st.insert_tasks_fenced(2), DIALECT, "s")
    names = st.fenced_row_names(2)
    statement = RowsStatement.of(compiled, names, 2)
    assert statement.named == ("id_1", "epoch", "incarnation")
    with pytest.raises(ValueError, match="rows' values"):
        RowsStatement.of(compiled, [*names[1:], names[0]], 2)
    row = list(range(len(INSERT_COLUMNS)))
    fence = {"epoch": 1, "incarnation": 2}
    with pytest.raises(ValueError, match="takes 2 rows, not 1"):
        statement.args([row], fence)  # no filler: every row is the caller's
    filled = RowsStatement.of(compiled, names, 2, st.NO_TASK_ROW)
    assert filled.args([row], fence) == [*row, *st.NO_TASK_ROW, 1, 1, 2]
    with pytest.raises(ValueError, match="takes 2 rows, not 3"):
        filled.args([row, row, row], fence)
    with pytest.raises(ValueError, match="filler row of 2 values"):
        RowsStatement.of(compiled, names, 2, (None, None))
    with pytest.raises(ValueError, match="not 3"):
        st.insert_tasks_fenced(3)
    with pytest.raises(ValueError, match="1 to 31 tasks, not 32"):
        st.fenced_insert_size(st.FENCED_INSERT_MAX_ROWS + 1)
    assert [st.fenced_insert_size(n) for n in (1, 2, 3, 5, 16, 17, 31)] == [1, 2, 4, 8, 16, 31, 31]
    with pytest.raises(ValueError, match="copy_min_rows"):
        BatchWriter(DIALECT, "s", copy_min_rows=COPY_MIN_ROWS + 1)


async def test_stores_sharing_one_session_keep_their_inserts_prepared(
    pg_url: URL,
) -> None:
    """Each row count a statement of its own (31 per cluster) made four stores sharing one
    session (an application's engine of one connection) overflow asyncpg's 100 prepared
    statements: every commit prepared its insert again (measured, about 1.6x slower). The
    sizes bound them: after a round of every row count, another round prepares nothing."""
    engine = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    schemas = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(4)]
    try:
        stores = []
        for schema in schemas:
            await upgrade(engine, schema)
            stores.append(await PgStore.from_engine(engine, PgStoreConfig(schema=schema)))
        first_id = 1

        async def one_round() -> None:
            nonlocal first_id
            for count in range(1, COPY_MIN_ROWS):
                for store in stores:
                    await store.commit(0, START_BASE, batch_of(count, first_id), [])
                    first_id += count

        async def prepared() -> set[tuple[str, Any]]:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text(
                        "SELECT name, prepare_time FROM pg_prepared_statements WHERE "
                        "strpos(statement, 'FROM (VALUES') > 0 AND strpos(statement, 'pg_') = 0"
                    )
                )
                return {(r.name, r.prepare_time) for r in rows}

        await one_round()
        before = await prepared()
        assert len(before) == len(schemas) * len(st.FENCED_INSERT_SIZES)
        await one_round()
        assert await prepared() == before
        for store in stores:
            await store.close()
    finally:
        await engine.dispose()
        for schema in schemas:
            await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
