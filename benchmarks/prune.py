"""Pruning: ``PgStore.prune`` (batches of ``PRUNE_BATCH`` first, then sized by time; never
a task a live task depends on) against raw asyncpg deleting the same old finished tasks in
batches sized the same way, without that protection: what the protection costs.

Each trial starts from the same fresh table: ``prune_finished`` old finished tasks and
``prune_live`` live tasks, each depending on a different finished one (by id or by key).

The protection's plan changes with the number of live dependencies: past a few thousand,
a plain ``NOT IN`` stopped being hashed and each batch scanned every reference for every
candidate; the store's ``NOT IN`` over ``DISTINCT`` sets stays hashed. The full profile
also times one batch of the store's statement on a large table (200,000 finished, 20,000
live with dependencies), bounded by a statement timeout, so a regression to the old plan
shows as a timeout; and prunes ``prune_large_finished`` (1,000,000) finished tasks, one in
50 of them depended on, to the end, once per side, with the time of every batch, on a
table seeded server-side (one ``INSERT ... SELECT`` over ``generate_series``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    any_,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import URL
from sqlalchemy.sql.dml import Insert

from cronoq_store import Dependency, PgStoreConfig, Submitted, TaskStatus, TimeBase, task_id
from cronoq_store import _statements as st
from cronoq_store._codec import encode_deps, unix_converter
from cronoq_store._queries import PRUNE_BATCH, next_prune_batch
from cronoq_store._schema import (
    INSERT_COLUMNS,
    INSERT_POSITION,
    JSON_COLUMNS,
    insert_row,
    tasks,
)
from cronoq_store._store import PgStore

from .common import (
    Profile,
    compile_for_asyncpg,
    dsn,
    interleave,
    make_spec,
    paired,
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
#: The store's prune statement without the dependency protection: the same deletion by an
#: array of the victims' ids (key lookups; ``id IN (victims)`` scans the whole table).
_unprotected = delete(tasks).where(
    tasks.c.id
    == any_(cast(select(func.array_agg(_victims.c.id)).scalar_subquery(), ARRAY(BigInteger)))
)
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


async def _in_batches(
    delete_batch: Callable[[dict[str, int]], Awaitable[int]],
    lap: Callable[[], None] = lambda: None,
) -> int:
    """Old finished tasks deleted in batches sized as the store's are
    (:func:`~cronoq_store._queries.next_prune_batch`, by each batch's own time), one
    ``delete_batch(params)`` each, until one deletes fewer than asked; ``lap`` runs after
    each batch."""
    params = {"cutoff": time.time_ns() - round(_OLDER_THAN * 1e9), "batch": PRUNE_BATCH}
    total = 0
    while True:
        started = time.monotonic()
        deleted = await delete_batch(params)
        total += deleted
        lap()
        if deleted < params["batch"]:
            return total
        params["batch"] = next_prune_batch(deleted, time.monotonic() - started)


def _unprotected_batches(
    conn: asyncpg.Connection, schema: str
) -> Callable[[dict[str, int]], Awaitable[int]]:
    """The baseline: one transaction per batch deleting the oldest finished tasks without
    the protection."""
    unprotected = compile_for_asyncpg(_unprotected, schema)

    async def delete_batch(params: dict[str, int]) -> int:
        async with conn.transaction():
            status = await conn.execute(unprotected.sql, *unprotected.args(params))
        return int(status.split()[-1])

    return delete_batch


async def _store_sql_batches(
    conn: asyncpg.Connection, schema: str
) -> Callable[[dict[str, int]], Awaitable[int]]:
    """The floor: raw asyncpg sending the store's own statements for each batch (the
    barrier, then the protected deletion with its record), the store taken out."""
    barrier = compile_for_asyncpg(st.leader_barrier, schema)
    batch = compile_for_asyncpg(st.prune_batch, schema)
    found = compile_for_asyncpg(st.incarnation, schema)
    incarnation = await conn.fetchval(found.sql, *found.args({}))

    async def delete_batch(params: dict[str, int]) -> int:
        async with conn.transaction():
            await conn.execute(barrier.sql)
            deleted = await conn.fetchval(
                batch.sql, *batch.args({**params, "incarnation": incarnation})
            )
        return int(deleted)

    return delete_batch


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """Deleted rows per second of both sides, and the finished tasks the store kept."""
    schemas = {"store": "bench_prune_store", "raw": "bench_prune_raw"}
    store = await PgStore.connect(url, PgStoreConfig(schema=schemas["store"]))
    raw_store = await PgStore.connect(url, PgStoreConfig(schema=schemas["raw"]))
    await raw_store.close()
    conn = await asyncpg.connect(dsn(url))
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
        started = time.perf_counter()
        total = await _in_batches(_unprotected_batches(conn, schemas["raw"]))
        return total / (time.perf_counter() - started)

    async def floor() -> float:
        await fill(schemas["store"])
        started = time.perf_counter()
        total = await _in_batches(await _store_sql_batches(conn, schemas["store"]))
        rate = total / (time.perf_counter() - started)
        kept.append(await conn.fetchval(compile_for_asyncpg(_finished_left, schemas["store"]).sql))
        return rate

    try:
        measured = await interleave(
            {"store": protected, "raw_unprotected": plain, "raw_store_sql": floor},
            profile.prune_rounds,
            warmup=0,
        )
    finally:
        await conn.close()
        await store.close()
    large = await _large_batch(url) if profile.prune_large else None
    if any(k != profile.prune_live for k in kept):
        raise RuntimeError(f"prune kept {kept} finished tasks, expected {profile.prune_live}")
    many = None
    if profile.prune_large_finished:
        many = await _many_finished(url, profile.prune_large_finished)
    return {
        "finished": profile.prune_finished,
        "live_with_dependencies": profile.prune_live,
        "batch": PRUNE_BATCH,
        "variants": {name: summarize(v) for name, v in measured.items()},
        # Each round's store rate over the raw delete's in that round.
        "store_vs_raw": paired(measured["store"], measured["raw_unprotected"]),
        # The floor: the store's own statements sent by raw asyncpg, over the raw delete;
        # and the store over them (what the store adds to its SQL).
        "store_sql_vs_raw": paired(measured["raw_store_sql"], measured["raw_unprotected"]),
        "store_vs_store_sql": paired(measured["store"], measured["raw_store_sql"]),
        "protected_kept": kept,
        "large_batch": large,
        "large_finished": many,
    }


_LARGE_FINISHED = 200_000
_LARGE_LIVE = 20_000
_LARGE_TIMEOUT = 120.0


async def _large_batch(
    url: URL,
    *,
    finished: int = _LARGE_FINISHED,
    live: int = _LARGE_LIVE,
    schema: str = "bench_prune_large",
) -> dict[str, Any]:
    """Seconds for one batch of each statement on the large table (``None``: timed out),
    each run three times in a rolled-back transaction; the median is kept. Each run must
    delete a whole batch: the statement is sent with the cluster's incarnation, without
    which it is planned to delete nothing (and times nothing)."""
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    await store.close()
    conn = await asyncpg.connect(dsn(url))
    try:
        rows = make_rows(finished, live, TimeBase.now(), time.time_ns())
        await conn.copy_records_to_table(
            "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=schema
        )
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
        found = compile_for_asyncpg(st.incarnation, schema)
        params = {
            "cutoff": time.time_ns() - round(_OLDER_THAN * 1e9),
            "batch": PRUNE_BATCH,
            "incarnation": await conn.fetchval(found.sql, *found.args({})),
        }
        await conn.execute(f"SET statement_timeout = '{round(_LARGE_TIMEOUT * 1000)}ms'")
        seconds: dict[str, float | None] = {}
        deleted: set[int] = set()
        for name, statement in (("store", st.prune_batch),):
            stmt = compile_for_asyncpg(statement, schema)
            times: list[float | None] = []
            for _ in range(3):
                tx = conn.transaction()
                await tx.start()
                started = time.perf_counter()
                try:
                    deleted.add(int(await conn.fetchval(stmt.sql, *stmt.args(params))))
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
    if deleted - {PRUNE_BATCH}:
        raise RuntimeError(f"a large batch deleted {sorted(deleted)} rows, not {PRUNE_BATCH}")
    return {
        "finished": finished,
        "live_with_dependencies": live,
        "timeout_seconds": _LARGE_TIMEOUT,
        "seconds_per_batch": seconds,
        "deleted_per_batch": min(deleted, default=None),
    }


#: Live tasks with a dependency in the table of :func:`_many_finished`, one for every 50
#: finished tasks: the protection's sets are ten times larger than where its plan once
#: collapsed (see the module's docstring).
_MANY_LIVE_EVERY = 50

Trial = dict[str, Any]


def _seed_statement(finished: int, live: int, now: int) -> Insert:
    """One ``INSERT ... SELECT`` over ``generate_series`` that writes what
    :func:`make_rows` would, server-side: ``finished`` finished tasks two hours old, then
    ``live`` live tasks, each depending on a different one of them by id or (every other
    one) by key. The values every row shares come from the same encoded prototype."""
    proto = insert_row(
        Submitted(task_id(1, 1), 1, 0, make_spec(1)), unix_converter(TimeBase.now()), now
    )
    n = func.generate_series(1, finished + live).table_valued("n").render_derived(name="g").c.n
    is_live = n > finished
    target = n - finished - 1  # the j of make_rows, for live tasks
    target_n = 1 + target * (finished // live)
    id_base = task_id(1, 0)
    deps = case(
        (
            is_live,
            func.jsonb_build_array(
                case(
                    (
                        target % 2 == 0,
                        func.jsonb_build_object(
                            "id", literal(id_base, BigInteger) + target_n, "on", "succeeded"
                        ),
                    ),
                    else_=func.jsonb_build_object(
                        "key", func.concat("done-", target_n), "on", "succeeded"
                    ),
                )
            ),
        ),
        else_=cast(literal("[]"), JSONB),
    )
    computed: dict[str, ColumnElement[Any]] = {
        "id": literal(id_base, BigInteger) + n,
        "seq": cast(n, BigInteger),
        "key": case((is_live, literal(proto[_COLUMN["key"]])), else_=func.concat("done-", n)),
        "status": case((is_live, literal(proto[_COLUMN["status"]])), else_=literal("succeeded")),
        "terminal": ~is_live,
        "updated_unix_ns": case(
            (is_live, literal(now, BigInteger)), else_=literal(now - _AGE_NS, BigInteger) + n
        ),
        "deps": deps,
    }

    def shared(name: str) -> ColumnElement[Any]:
        value, column = proto[_COLUMN[name]], tasks.c[name]
        if name in JSON_COLUMNS:
            return cast(literal(value), JSONB) if value is not None else cast(None, JSONB)
        return cast(literal(value, column.type), column.type)

    values = [computed[c] if c in computed else shared(c) for c in INSERT_COLUMNS]
    return insert(tasks).from_select(list(INSERT_COLUMNS), select(*values))


async def _many_finished(url: URL, finished: int) -> dict[str, Any]:
    """``PgStore.prune`` of ``finished`` old finished tasks, one in 50 depended on by a live
    task, against the unprotected delete of the same batches on the same table: rows/s,
    batches and the spread of the seconds per batch (a plan that degrades as the table
    empties, or collapses, shows there). One trial each: the table is seeded server-side
    (``generate_series``) before each, which takes longer than the prune."""
    live = finished // _MANY_LIVE_EVERY
    schemas = {"store": "bench_prune_many_store", "raw": "bench_prune_many_raw"}
    store = await PgStore.connect(url, PgStoreConfig(schema=schemas["store"]))
    raw_store = await PgStore.connect(url, PgStoreConfig(schema=schemas["raw"]))
    await raw_store.close()
    conn = await asyncpg.connect(dsn(url))
    seed_seconds: dict[str, float] = {}

    async def seed(side: str) -> None:
        schema = schemas[side]
        started = time.perf_counter()
        stmt = compile_for_asyncpg(_seed_statement(finished, live, time.time_ns()), schema)
        await conn.execute(f'TRUNCATE "{schema}".cronoq_tasks')
        await conn.execute(stmt.sql, *stmt.args({}))
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
        seed_seconds[side] = round(time.perf_counter() - started, 1)

    async def timed(side: str, batches: Callable[[Callable[[], None]], Awaitable[int]]) -> Trial:
        await seed(side)
        times: list[float] = []
        mark = started = time.perf_counter()

        def lap() -> None:  # after each batch
            nonlocal mark
            now = time.perf_counter()
            times.append(now - mark)
            mark = now

        deleted = await batches(lap)
        seconds = time.perf_counter() - started
        left = await conn.fetchval(compile_for_asyncpg(_finished_left, schemas[side]).sql)
        return {
            "deleted": deleted,
            "kept": left,
            "seconds": round(seconds, 2),
            "rows_per_second": deleted / seconds,
            "batches": len(times),
            "seconds_per_batch": summarize(times),
        }

    async def protected(lap: Callable[[], None]) -> int:
        return await store.prune(_OLDER_THAN, progress=lambda _: lap())

    async def plain(lap: Callable[[], None]) -> int:
        return await _in_batches(_unprotected_batches(conn, schemas["raw"]), lap)

    async def floor(lap: Callable[[], None]) -> int:
        return await _in_batches(await _store_sql_batches(conn, schemas["store"]), lap)

    try:
        variants = {
            "store": await timed("store", protected),
            "raw_unprotected": await timed("raw", plain),
            "raw_store_sql": await timed("store", floor),
        }
    finally:
        await conn.close()
        await store.close()
    if {variants[k]["kept"] for k in ("store", "raw_store_sql")} != {live} or variants[
        "raw_unprotected"
    ]["kept"] != 0:
        raise RuntimeError(f"prune of {finished:,} kept {variants}, expected {live} and 0")
    return {
        "finished": finished,
        "live_with_dependencies": live,
        "batch": PRUNE_BATCH,
        "seed_seconds": seed_seconds,
        "variants": variants,
        "store_vs_raw": variants["store"]["rows_per_second"]
        / variants["raw_unprotected"]["rows_per_second"],
        "store_sql_vs_raw": variants["raw_store_sql"]["rows_per_second"]
        / variants["raw_unprotected"]["rows_per_second"],
    }
