"""What the recommended changes to the store would gain, measured before they are made:
``python -m benchmarks.whatif [--out DIR]``.

Each variant is a prototype of one recommendation in ``docs/performance.md``, run
interleaved with the store as it is and with raw asyncpg on the same server:

- ``store_no_preping``: the store on an engine without ``pool_pre_ping`` (``from_engine``);
- ``store_fast_fold``: that, plus :func:`fast_fold` swapped in for ``folding.fold``;
- ``raw_one_statement``: the epoch check and the insert as one autocommit statement
  (:data:`one_statement_insert`), one round trip instead of four;
- ``raw_copy_staged``: the rows of :func:`fast_rows` sent by binary COPY into a temporary
  table, then ``INSERT ... SELECT ... ON CONFLICT (id) DO NOTHING`` from it
  (:data:`insert_from_stage`): COPY's encoding without asyncpg's per-element array checks,
  and still idempotent;
- ``pgqueuer``: its batch enqueue, as in ``benchmarks.commit``, for direct comparison;
- ``store_positional``: recovery with rows unpacked by position, not by attribute;
- ``store_positional_nogc``: that, with the cyclic garbage collector paused while decoding
  (the decoded objects hold no reference cycles, but their sheer number triggers full
  collections again and again).

The prototypes are checked to write and load exactly what the store does.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import asyncpg
from pgqueuer.queries import Queries
from sqlalchemy import (
    Column,
    MetaData,
    Row,
    Table,
    bindparam,
    cast,
    column,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

import cronoq_store.store as store_module
from cronoq_store import (
    FixedStart,
    Mutation,
    PgStoreConfig,
    Priority,
    RecoveredTask,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
)
from cronoq_store.codec import (
    clean_text,
    decode_deps,
    decode_miss_policy,
    decode_resources,
    decode_retry,
    decode_strings,
    duration_to_ns,
    encode_deps,
    encode_miss_policy,
    encode_resources,
    encode_retry,
    encode_strings,
    ns_to_duration,
)
from cronoq_store.domain import LIVE_STATUS_NAMES
from cronoq_store.embedded import EmbeddedPostgres
from cronoq_store.folding import INSERT_COLUMNS, JSON_COLUMNS, FoldedBatch, fold
from cronoq_store.schema import LEADER_ROW_ID, leader, tasks
from cronoq_store.store import PgStore
from cronoq_store.urls import async_url

from .commit import RawWriter, SharedBatches, check_identical, trial_of
from .common import (
    FULL,
    SERVER_SETTINGS,
    Trial,
    Workload,
    batches_per_trial,
    compile_for_asyncpg,
    dsn,
    interleave,
    open_store,
    paired,
    submission_row,
    summarize,
)
from .recovery import populate

_ROOT = Path(__file__).resolve().parent.parent

# --- one statement: the epoch check and the insert ------------------------------------------

_new = (
    func.unnest(
        *(
            bindparam(
                name, type_=ARRAY(postgresql.TEXT() if name in JSON_COLUMNS else tasks.c[name].type)
            )
            for name in INSERT_COLUMNS
        )
    )
    .table_valued(*(column(name) for name in INSERT_COLUMNS))
    .render_derived(name="u")
)
_epoch = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID)
    .values(max_id=func.greatest(leader.c.max_id, bindparam("issued", type_=postgresql.BIGINT)))
    .returning(leader.c.epoch)
    .cte("e")
)
_insert = (
    postgresql.insert(tasks)
    .from_select(
        list(INSERT_COLUMNS),
        select(
            *(cast(_new.c[n], JSONB) if n in JSON_COLUMNS else _new.c[n] for n in INSERT_COLUMNS)
        )
        .select_from(_new)
        .where(_epoch.c.epoch == bindparam("epoch", type_=postgresql.INTEGER)),
    )
    .on_conflict_do_nothing(index_elements=[tasks.c.id])
    .returning(literal(1))
    .cte("ins")
)
#: ``WITH e AS (UPDATE leader ... RETURNING epoch), ins AS (INSERT ... WHERE e.epoch = :epoch)
#: SELECT epoch FROM e``: the row lock, the high-water mark and the insert in one statement,
#: so an insert-only batch needs no BEGIN/COMMIT round trips. Nothing is inserted when the
#: epoch differs, and the caller sees the stored epoch to raise ``FencedError``.
one_statement_insert = select(_epoch.c.epoch).add_cte(_insert)


# --- COPY into a staging table, then insert from it -----------------------------------------

_stage = Table(
    "cronoq_stage",
    MetaData(),
    *(Column(name, tasks.c[name].type) for name in INSERT_COLUMNS),
    schema="pg_temp",
)
#: The staged rows into the cluster's table; a retried batch that landed changes nothing.
insert_from_stage = (
    postgresql.insert(tasks)
    .from_select(list(INSERT_COLUMNS), select(*_stage.c))
    .on_conflict_do_nothing(index_elements=[tasks.c.id])
)


class PrototypeWriter(RawWriter):
    """The baselines' writer with the prototypes of the recommended statements."""

    def __init__(self, conn: asyncpg.Connection, schema: str, epoch: int) -> None:
        super().__init__(conn, schema, epoch)
        self._one_statement = compile_for_asyncpg(one_statement_insert, schema)
        self._from_stage = compile_for_asyncpg(insert_from_stage, schema)
        self._staging = False

    async def insert_staged(self, batch: Sequence[Submitted], base: TimeBase) -> None:
        if not self._staging:
            # Per session, emptied by every commit; never WAL-logged.
            await self.conn.execute(
                f"CREATE TEMP TABLE cronoq_stage (LIKE {self.schema}.cronoq_tasks) "
                "ON COMMIT DELETE ROWS"
            )
            self._staging = True
        rows = fast_rows(batch, base, time.time_ns())
        async with self.conn.transaction():
            await self._lock_epoch(max(m.id for m in batch))
            await self.conn.copy_records_to_table(
                "cronoq_stage", records=rows, columns=INSERT_COLUMNS, schema_name="pg_temp"
            )
            await self.conn.execute(self._from_stage.sql)

    async def insert_one_statement(self, batch: Sequence[Submitted], base: TimeBase) -> None:
        now = time.time_ns()
        columns = list(zip(*(submission_row(m, base, now) for m in batch), strict=True))
        params: dict[str, Any] = dict(zip(INSERT_COLUMNS, columns, strict=True))
        params.update(issued=max(columns[0]), epoch=self.epoch)
        stmt = self._one_statement
        self._check(await self.conn.fetchval(stmt.sql, *stmt.args(params)))


# --- a faster fold ----------------------------------------------------------------------------

_retry_json = lru_cache(maxsize=1024)(encode_retry)
_strings_json = lru_cache(maxsize=4096)(encode_strings)


def fast_rows(
    batch: Sequence[Submitted], base: TimeBase, now_unix_ns: int
) -> list[tuple[Any, ...]]:
    """The insert's rows for new tasks (the first of duplicate ids wins, as in ``fold``): one
    tuple per row instead of 25 dictionary look-ups and appends, and the JSON of retry
    policies and string lists memoized (they repeat from task to task)."""
    to_unix = base.to_unix
    rows = []
    seen: set[int] = set()
    for m in batch:
        if m.id in seen:
            continue
        seen.add(m.id)
        s = m.spec
        fixed = s.fixed_start
        key, tenant = s.key, s.tenant
        rows.append(
            (
                m.id,
                m.seq,
                to_unix(m.arrival),
                clean_text(s.pool),
                clean_text(s.kind),
                int(s.priority),
                None if key is None else clean_text(key),
                s.payload,
                None if s.deadline is None else to_unix(s.deadline),
                None if fixed is None else to_unix(fixed.at),
                None if fixed is None else duration_to_ns(fixed.tolerance),
                None if fixed is None else encode_miss_policy(fixed.on_miss),
                None if s.duration_hint is None else duration_to_ns(s.duration_hint),
                None if s.timeout is None else duration_to_ns(s.timeout),
                None if s.retry is None else _retry_json(s.retry),
                encode_deps(s.deps) if s.deps else "[]",
                encode_resources(s.resources) if s.resources else "{}",
                _strings_json(s.tags) if s.tags else "[]",
                "queued",
                False,
                0,
                now_unix_ns,
                None,
                _strings_json(s.labels) if s.labels else "[]",
                None if tenant is None else clean_text(tenant),
            )
        )
    return rows


def fast_fold(
    batch: Sequence[Mutation],
    base: TimeBase,
    now_unix_ns: int,
    outputs: Sequence[tuple[TaskId, bytes]] = (),
) -> FoldedBatch:
    """``fold`` for batches of new tasks only (anything else goes to ``fold``), built from
    :func:`fast_rows` transposed once by ``zip``."""
    submitted = [m for m in batch if type(m) is Submitted]
    if outputs or len(submitted) != len(batch):
        return fold(batch, base, now_unix_ns, outputs)
    columns = [list(c) for c in zip(*fast_rows(submitted, base, now_unix_ns), strict=True)]
    return FoldedBatch(
        max_id=max(columns[0]),
        updates={
            k: [] for k in ("ids", "statuses", "terminals", "attempts", "updated", "messages")
        },
        inserts=dict(zip(INSERT_COLUMNS, columns, strict=True)),
        outputs={"ids": [], "outputs": []},
    )


@contextmanager
def patched(name: str, replacement: Any) -> Iterator[None]:
    """``cronoq_store.store.<name>`` replaced for the duration of one trial."""
    original = getattr(store_module, name)
    setattr(store_module, name, replacement)
    try:
        yield
    finally:
        setattr(store_module, name, original)


# --- recovery by position ---------------------------------------------------------------------


def decode_by_position(base: TimeBase, row: Row[Any]) -> RecoveredTask:
    """``store._decode_task`` with the row unpacked once, by position (``live_tasks`` order):
    attribute access on a SQLAlchemy ``Row`` costs a mapping look-up per column."""
    (
        id_, seq, arrival, pool, kind, priority, key, payload, deadline, fixed_at, tolerance,
        on_miss, hint, timeout, retry, deps, resources, tags, labels, tenant, status, attempt,
    ) = tuple(row)  # fmt: skip
    if status not in LIVE_STATUS_NAMES:
        raise ValueError(f"status: {status!r} is not the status of a live task")
    fixed = None
    if fixed_at is not None:
        fixed = FixedStart(
            at=base.from_unix(fixed_at),
            tolerance=ns_to_duration(1_000_000_000 if tolerance is None else tolerance),
            on_miss=decode_miss_policy(on_miss),
        )
    spec = TaskSpec(
        payload,
        kind=kind,
        pool=pool,
        priority=Priority.from_stored(priority),
        key=key,
        deadline=None if deadline is None else base.from_unix(deadline),
        fixed_start=fixed,
        duration_hint=None if hint is None else ns_to_duration(hint),
        timeout=None if timeout is None else ns_to_duration(timeout),
        retry=decode_retry(retry),
        deps=decode_deps(deps),
        resources=decode_resources(resources),
        tags=decode_strings(tags, "tags"),
        labels=decode_strings(labels, "labels"),
        tenant=tenant,
    )
    return RecoveredTask(TaskId(id_), seq, base.from_unix(arrival), spec, max(attempt, 0))


# --- the run ----------------------------------------------------------------------------------


def _trials(
    shared: SharedBatches[Submitted],
    rows: int,
    stores: dict[str, tuple[PgStore, int]],
    raws: dict[str, PrototypeWriter],
    pgq: Queries,
    base: TimeBase,
) -> dict[str, Trial]:
    store, epoch = stores["store"]
    plain, plain_epoch = stores["store_no_preping"]
    fast, fast_epoch = stores["store_fast_fold"]
    fast_inner = trial_of(
        shared, "store_fast_fold", rows, lambda b: fast.commit(fast_epoch, base, b, ())
    )

    async def fast_trial() -> float:
        with patched("fold", fast_fold):
            return await fast_inner()

    return {
        "store": trial_of(shared, "store", rows, lambda b: store.commit(epoch, base, b, ())),
        "store_no_preping": trial_of(
            shared, "store_no_preping", rows, lambda b: plain.commit(plain_epoch, base, b, ())
        ),
        "store_fast_fold": fast_trial,
        "raw": trial_of(shared, "raw", rows, lambda b: raws["raw"].insert(b, base)),
        "raw_one_statement": trial_of(
            shared,
            "raw_one_statement",
            rows,
            lambda b: raws["raw_one_statement"].insert_one_statement(b, base),
        ),
        "raw_copy_staged": trial_of(
            shared,
            "raw_copy_staged",
            rows,
            lambda b: raws["raw_copy_staged"].insert_staged(b, base),
        ),
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
    }


async def _commit(url: URL, rounds: int) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        stores: dict[str, tuple[PgStore, int]] = {}
        for name in ("store", "store_no_preping", "store_fast_fold"):
            schema = f"whatif_{name}"
            if name == "store":
                store, epoch = await open_store(url, schema)
            else:
                engine = create_async_engine(
                    async_url(url), pool_size=8, max_overflow=0, hide_parameters=True
                )
                stack.push_async_callback(engine.dispose)
                store = await PgStore.from_engine(engine, PgStoreConfig(schema=schema))
                epoch = await store.acquire_leadership()
            stack.push_async_callback(store.close)
            stores[name] = (store, epoch)
        raws = {}
        for name in ("raw", "raw_one_statement", "raw_copy_staged"):
            holder, epoch = await open_store(url, f"whatif_{name}")
            stack.push_async_callback(holder.close)
            conn = await asyncpg.connect(dsn(url))
            stack.push_async_callback(conn.close)
            raws[name] = PrototypeWriter(conn, f"whatif_{name}", epoch)
        admin = await asyncpg.connect(dsn(url))
        await admin.execute('CREATE DATABASE "whatif_pgqueuer"')
        await admin.close()
        pgq_conn = await asyncpg.connect(dsn(url.set(database="whatif_pgqueuer")))
        stack.push_async_callback(pgq_conn.close)
        pgq = Queries.from_asyncpg_connection(pgq_conn)
        await pgq.install()
        workload = Workload()
        base = workload.base
        results: dict[str, Any] = {}
        for size in (1, 10, 100, 1000, 10_000):
            count = batches_per_trial(FULL, size)
            shared = SharedBatches(partial(workload.batches, size, count), consumers=7)
            trials = _trials(shared, count * size, stores, raws, pgq, base)
            measured = await interleave(trials, rounds)
            results[str(size)] = {
                "variants": {name: summarize(v) for name, v in measured.items()},
                **{
                    f"{name}_vs_raw": paired(measured[name], measured["raw"])
                    for name in measured
                    if name not in ("raw", "pgqueuer")
                },
                **{
                    f"{name}_vs_pgqueuer": paired(measured[name], measured["pgqueuer"])
                    for name in ("store", "store_fast_fold", "raw_copy_staged")
                },
            }
            print(
                size,
                {
                    k: round(v["median"], 2)
                    for k, v in results[str(size)].items()
                    if k.endswith(("_raw", "_pgqueuer"))
                },
                flush=True,
            )
        first = Workload()  # the ids of the first batches: every variant wrote them
        ids = [m.id for m in first.submissions(200)]
        await check_identical(raws["raw"].conn, [f"whatif_{n}" for n in (*stores, *raws)], ids)
    return results


async def _recovery(url: URL, rounds: int) -> dict[str, Any]:
    schema = "whatif_recovery"
    await populate(url, schema, 100_000)
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    conn = await asyncpg.connect(dsn(url))
    from .recovery import _raw_recover

    loaded: list[int] = []

    async def as_is() -> float:
        started = time.perf_counter()
        recovered = await store.recover(TimeBase.now())
        loaded.append(len(recovered.tasks))
        return time.perf_counter() - started

    async def positional() -> float:
        with patched("_decode_task", decode_by_position):
            return await as_is()

    async def positional_nogc() -> float:
        gc.disable()
        try:
            return await positional()
        finally:
            gc.enable()

    async def raw() -> float:
        started = time.perf_counter()
        recovered = await _raw_recover(conn, schema, TimeBase.now())
        loaded.append(len(recovered.tasks))
        return time.perf_counter() - started

    try:
        measured = await interleave(
            {
                "store": as_is,
                "store_positional": positional,
                "store_positional_nogc": positional_nogc,
                "raw": raw,
            },
            rounds,
        )
    finally:
        await conn.close()
        await store.close()
    if len(set(loaded)) != 1:
        raise RuntimeError(f"the recoveries loaded different numbers of tasks: {set(loaded)}")
    speed = {name: [1 / s for s in v] for name, v in measured.items()}
    return {
        "seconds": {name: summarize(v) for name, v in measured.items()},
        "store_vs_raw": paired(speed["store"], speed["raw"]),
        "store_positional_vs_raw": paired(speed["store_positional"], speed["raw"]),
        "store_positional_nogc_vs_raw": paired(speed["store_positional_nogc"], speed["raw"]),
    }


async def _run(url: URL, rounds: int, only: list[str]) -> dict[str, Any]:
    results = {}
    if "commit" in only:
        results["commit"] = await _commit(url, rounds)
    if "recovery" in only:
        results["recovery_100k"] = await _recovery(url, rounds)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.whatif", description=__doc__)
    parser.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default="commit,recovery", help="commit and/or recovery")
    args = parser.parse_args(argv)
    only = args.only.split(",")
    started = time.monotonic()
    with EmbeddedPostgres(settings=SERVER_SETTINGS) as server:
        results = asyncio.run(_run(server.url(), args.rounds, only))
    results["elapsed_seconds"] = round(time.monotonic() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"whatif-{'-'.join(only)}.json").write_text(json.dumps(results, indent=2) + "\n")
    figures = {
        f"b{size}_{name}": r[name]["median"]
        for size, r in results.get("commit", {}).items()
        for name in r
        if name.endswith(("_vs_raw", "_vs_pgqueuer"))
    }
    recovery = results.get("recovery_100k", {})
    figures.update(
        (f"recovery_100k_{name}", r["median"])
        for name, r in recovery.items()
        if name.endswith("_vs_raw")
    )
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
