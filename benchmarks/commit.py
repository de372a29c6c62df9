"""Commit throughput: ``PgStore.commit`` against the same SQL on raw asyncpg, against COPY,
and against the peers' batch enqueue, batch size by batch size, interleaved.

Submissions: every variant writes the very same ``Submitted`` objects, each into a table of
its own of the same shape (the store's migrations built every schema), so the tables grow
alike. Status transitions: the store against raw asyncpg, on tasks inserted beforehand.
A variant's figure is mutations per second over one trial: ``batches_per_trial`` batches
(of new tasks, ``commit_min_batches`` at least).

The disk's flush rate, measured after the trials as PostgreSQL's ``pg_test_fsync`` measures
its ``fdatasync`` of one 8 kB write (:func:`~benchmarks.common.flush_rate`), bounds a commit
of one mutation: one WAL flush each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any, Generic, TypeVar

import asyncpg
import procrastinate
from pgqueuer.queries import Queries
from procrastinate.types import JSONDict
from sqlalchemy import BigInteger, bindparam, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import StatusChanged, Submitted, TaskId, TaskSpec, TimeBase, task_id
from cronoq_store import _statements as st
from cronoq_store._codec import unix_converter
from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._door import Opening, RowsStatement
from cronoq_store._schema import INSERT_COLUMNS, insert_row, tasks
from cronoq_store._urls import async_url

from .common import (
    Profile,
    Trial,
    Workload,
    batches_per_trial,
    compile_for_asyncpg,
    dsn,
    flush_rate,
    interleave,
    make_spec,
    open_store,
    paired,
    summarize,
    transition_columns,
    transitions,
)

#: Columns compared between the variants' tables (the update time is each commit's clock).
M = TypeVar("M", Submitted, StatusChanged)

_COMPARED = [tasks.c[name] for name in INSERT_COLUMNS if name != "updated_unix_ns"]
_ROWS_BY_ID = (
    select(*_COMPARED)
    .where(tasks.c.id == bindparam("ids", type_=ARRAY(BigInteger)).any_())
    .order_by(tasks.c.id)
)


class SharedBatches(Generic[M]):
    """Each round's batches, made once and handed to every variant in turn, then dropped."""

    def __init__(self, make: Callable[[], list[list[M]]], consumers: int) -> None:
        self._make: Callable[[], list[list[M]]] = make
        self._consumers = consumers
        self._rounds: dict[int, list[list[M]]] = {}
        self._taken: dict[int, int] = {}
        self._position: dict[str, int] = {}

    def next(self, consumer: str) -> list[list[M]]:
        r = self._position.get(consumer, 0)
        self._position[consumer] = r + 1
        if r not in self._rounds:
            self._rounds[r] = self._make()
        batches = self._rounds[r]
        self._taken[r] = self._taken.get(r, 0) + 1
        if self._taken[r] == self._consumers:
            del self._rounds[r], self._taken[r]
        return batches


class RawWriter:
    """The baselines: one asyncpg connection running the store's own SQL for ``schema``
    with the same epoch check, as the store sends it: a batch of new tasks, or of
    transitions, is one statement whose CTE checks the epoch (``insert_tasks_fenced`` of the
    size that holds the batch, ``update_status_fenced``); from ``COPY_MIN_ROWS``
    new tasks on, ``BEGIN`` and the epoch check (``epoch_held_for_share``) travel in one message,
    then COPY straight into the table, then the check that the schema still holds the
    cluster (``incarnation_kept``) with ``COMMIT``. The COPY baseline does the latter at
    every size: the bound (it cannot skip rows that exist)."""

    def __init__(self, conn: asyncpg.Connection, schema: str, epoch: int, incarnation: int) -> None:
        self.conn = conn
        self.schema = schema
        self.epoch = epoch
        # The fence's values, as the store sends them: its epoch and the cluster's incarnation.
        self._fence = {"epoch": epoch, "incarnation": incarnation}
        self._opening = Opening.of(compile_for_asyncpg(st.epoch_held_for_share, schema))
        self._closing = Opening.closing(compile_for_asyncpg(st.incarnation_kept, schema))
        self._inserts: dict[int, RowsStatement] = {}
        self._update = compile_for_asyncpg(st.update_status_fenced, schema)

    def _check(self, current: int) -> None:
        if current != self.epoch:
            raise RuntimeError(f"fenced: epoch {current}, expected {self.epoch}")

    async def insert(self, batch: Sequence[Submitted], base: TimeBase) -> None:
        now, to_unix = time.time_ns(), unix_converter(base)
        if len(batch) >= COPY_MIN_ROWS:
            await self.copy(batch, base)
            return
        rows = [insert_row(m, to_unix, now) for m in batch]
        size = st.fenced_insert_size(len(rows))
        stmt = self._inserts.get(size)
        if stmt is None:
            compiled = compile_for_asyncpg(st.insert_tasks_fenced(size), self.schema)
            stmt = RowsStatement.of(compiled, st.fenced_row_names(size), size, st.NO_TASK_ROW)
            self._inserts[size] = stmt
        self._check(await self.conn.fetchval(stmt.compiled.sql, *stmt.args(rows, self._fence)))

    async def copy(self, batch: Sequence[Submitted], base: TimeBase) -> None:
        now, to_unix = time.time_ns(), unix_converter(base)
        rows = [insert_row(m, to_unix, now) for m in batch]
        checked = await self.conn.execute(self._opening.sql(self._fence))
        try:
            if checked != "SELECT 1":
                raise RuntimeError(f"fenced: the epoch is not {self.epoch}")
            await self.conn.copy_records_to_table(
                "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=self.schema
            )
            # The check that the schema still holds the cluster, with COMMIT.
            await self.conn.execute(self._closing.sql(self._fence))
        except BaseException:
            await self.conn.execute("ROLLBACK")
            raise

    async def update(self, batch: Sequence[StatusChanged], base: TimeBase) -> None:
        params = {**transition_columns(batch, base), **self._fence}
        current, *_ = await self.conn.fetchrow(self._update.sql, *self._update.args(params))
        self._check(current)


def _job_args(m: Submitted) -> JSONDict:
    """procrastinate's job arguments for a task: JSON, so the payload travels as hex."""
    return {"seq": m.seq, "payload": m.spec.payload.hex()}


def trial_of(
    shared: SharedBatches[M], name: str, rows: int, write: Callable[[list[M]], Awaitable[object]]
) -> Trial:
    """A trial that writes the round's batches one after another; returns rows per second."""

    async def trial() -> float:
        batches = shared.next(name)
        started = time.perf_counter()
        for batch in batches:
            await write(batch)
        return rows / (time.perf_counter() - started)

    return trial


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """Both comparisons; returns per size and variant the summary of mutations/s, and the
    paired ratios against raw asyncpg and against pgqueuer."""
    async with AsyncExitStack() as stack:
        submissions = await _submissions(stack, url, peers, profile)
        status = await _transitions(stack, url, profile)
    return {
        "submissions": submissions,
        "transitions": status,
        "fdatasync_per_s": await asyncio.to_thread(flush_rate),
    }


async def _submissions(
    stack: AsyncExitStack, url: URL, peers: dict[str, URL], profile: Profile
) -> dict[str, Any]:
    store, epoch = await open_store(url, "bench_commit_store")
    stack.push_async_callback(store.close)
    raw_store, raw_epoch = await open_store(url, "bench_commit_raw")
    stack.push_async_callback(raw_store.close)
    copy_store, copy_epoch = await open_store(url, "bench_commit_copy")
    stack.push_async_callback(copy_store.close)
    raw_conn = await asyncpg.connect(dsn(url))
    stack.push_async_callback(raw_conn.close)
    copy_conn = await asyncpg.connect(dsn(url))
    stack.push_async_callback(copy_conn.close)
    raw = RawWriter(raw_conn, "bench_commit_raw", raw_epoch, raw_store.incarnation)
    copy = RawWriter(copy_conn, "bench_commit_copy", copy_epoch, copy_store.incarnation)
    # The floor of the store's COPY path: the raw baseline on a connection SQLAlchemy's
    # asyncpg dialect set up, as every connection of the store's engine is. Its jsonb codec
    # encodes in Python (a call per value: COPY sends jsonb through it); asyncpg's own, on
    # the raw connections, in compiled code.
    engine_store, engine_epoch = await open_store(url, "bench_commit_engine")
    stack.push_async_callback(engine_store.close)
    engine = create_async_engine(async_url(url), pool_size=1)
    stack.push_async_callback(engine.dispose)
    engine_conn = await engine.connect()
    stack.push_async_callback(engine_conn.close)
    engine_driver = (await engine_conn.get_raw_connection()).driver_connection
    on_engine = RawWriter(
        engine_driver, "bench_commit_engine", engine_epoch, engine_store.incarnation
    )

    pgq_conn = await asyncpg.connect(dsn(peers["pgqueuer"]))
    stack.push_async_callback(pgq_conn.close)
    pgq = Queries.from_asyncpg_connection(pgq_conn)
    if not await pgq.schema_is_installed():
        await pgq.install()

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=dsn(peers["procrastinate"]))
    )

    @app.task(name="bench_job", queue="bench")
    def bench_job(**kwargs: Any) -> None:  # never run: only deferred
        raise NotImplementedError

    await stack.enter_async_context(app.open_async())
    await app.schema_manager.apply_schema_async()

    workload = Workload()
    base = workload.base
    results: dict[str, Any] = {}
    for size in profile.commit_sizes:
        count = max(profile.commit_min_batches, batches_per_trial(profile, size))
        # Below COPY the engine's connection sends what the raw one does: no floor to take.
        floored = size >= COPY_MIN_ROWS
        shared = SharedBatches(partial(workload.batches, size, count), consumers=5 + floored)

        rows = count * size
        trials: dict[str, Trial] = {
            "store": trial_of(shared, "store", rows, lambda b: store.commit(epoch, base, b, ())),
            "raw": trial_of(shared, "raw", rows, lambda b: raw.insert(b, base)),
            "copy": trial_of(shared, "copy", rows, lambda b: copy.copy(b, base)),
            "pgqueuer": trial_of(
                shared,
                "pgqueuer",
                rows,
                lambda b: pgq.enqueue(
                    [m.spec.kind for m in b],
                    [m.spec.payload for m in b],
                    [int(m.spec.priority) for m in b],
                ),
            ),
            "procrastinate": trial_of(
                shared,
                "procrastinate",
                rows,
                lambda b: bench_job.batch_defer_async(*map(_job_args, b)),
            ),
        }
        if floored:
            trials["raw_engine"] = trial_of(
                shared, "raw_engine", rows, lambda b: on_engine.insert(b, base)
            )
        measured = await interleave(trials, profile.rounds)
        results[str(size)] = {
            "rows_per_trial": rows,
            "variants": {name: summarize(v) for name, v in measured.items()},
            "store_vs_raw": paired(measured["store"], measured["raw"]),
            "store_vs_copy": paired(measured["store"], measured["copy"]),
            "store_vs_pgqueuer": paired(measured["store"], measured["pgqueuer"]),
            # The floor against the peer: the store's SQL sent by raw asyncpg.
            "raw_vs_pgqueuer": paired(measured["raw"], measured["pgqueuer"]),
            "store_vs_procrastinate": paired(measured["store"], measured["procrastinate"]),
        }
        if floored:
            # The floor against raw: its SQL on the engine's connection.
            results[str(size)]["raw_engine_vs_raw"] = paired(
                measured["raw_engine"], measured["raw"]
            )
    variants = ["bench_commit_store", "bench_commit_raw", "bench_commit_copy"]
    await check_identical(raw_conn, variants, [task_id(1, n) for n in range(1, 201)])
    # The engine's connection wrote the batches of COPY's sizes only: the last ones made.
    last = range(workload.issued - 199, workload.issued + 1)
    await check_identical(
        raw_conn, [*variants, "bench_commit_engine"], [task_id(1, n) for n in last]
    )
    return results


async def check_identical(
    conn: asyncpg.Connection, schemas: Sequence[str], ids: Sequence[int]
) -> None:
    """Every variant wrote identical rows, so the baselines did the same work."""
    written = []
    for schema in schemas:
        stmt = compile_for_asyncpg(_ROWS_BY_ID, schema)
        written.append([tuple(r) for r in await conn.fetch(stmt.sql, *stmt.args({"ids": ids}))])
    if len(written[0]) != len(ids) or any(rows != written[0] for rows in written[1:]):
        raise RuntimeError(f"the variants wrote different rows into {', '.join(schemas)}")


async def _seed(
    conn: asyncpg.Connection, schema: str, specs: Sequence[tuple[TaskId, TaskSpec]], base: TimeBase
) -> None:
    """Insert live tasks (COPY) for the transitions to move."""
    now = time.time_ns()
    arrival = base.from_unix(now)
    to_unix = unix_converter(base)
    rows = [insert_row(Submitted(i, i, arrival, spec), to_unix, now) for i, spec in specs]
    await conn.copy_records_to_table(
        "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=schema
    )


async def _transitions(stack: AsyncExitStack, url: URL, profile: Profile) -> dict[str, Any]:
    store, epoch = await open_store(url, "bench_transition_store")
    stack.push_async_callback(store.close)
    raw_store, raw_epoch = await open_store(url, "bench_transition_raw")
    stack.push_async_callback(raw_store.close)
    conn = await asyncpg.connect(dsn(url))
    stack.push_async_callback(conn.close)
    raw = RawWriter(conn, "bench_transition_raw", raw_epoch, raw_store.incarnation)

    base = TimeBase.now()
    pool_size = max(profile.transition_sizes)
    specs = [(task_id(2, n), make_spec(n)) for n in range(1, pool_size + 1)]
    for schema in ("bench_transition_store", "bench_transition_raw"):
        await _seed(conn, schema, specs, base)
    ids = [i for i, _ in specs]

    results: dict[str, Any] = {}
    generation = 0
    for size in profile.transition_sizes:
        count = batches_per_trial(profile, size)

        def make(size: int = size, count: int = count) -> list[list[StatusChanged]]:
            nonlocal generation
            generation += 1
            return [
                transitions(
                    [ids[(j * size + k) % pool_size] for k in range(size)], generation, base
                )
                for j in range(count)
            ]

        shared = SharedBatches(make, consumers=2)

        rows = count * size
        trials = {
            "store": trial_of(shared, "store", rows, lambda b: store.commit(epoch, base, b, ())),
            "raw": trial_of(shared, "raw", rows, lambda b: raw.update(b, base)),
        }
        measured = await interleave(trials, profile.rounds)
        results[str(size)] = {
            "rows_per_trial": rows,
            "variants": {name: summarize(v) for name, v in measured.items()},
            "store_vs_raw": paired(measured["store"], measured["raw"]),
        }
    return results
