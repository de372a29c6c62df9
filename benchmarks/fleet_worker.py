"""One process of the fleet benchmark (``benchmarks.fleet``), in a process of its own.

``python -m benchmarks.fleet_worker MODE`` reads a JSON object on stdin: the mode's
arguments, the URL among them (with this process's ``application_name``). Every mode
prints one JSON object a line on stdout, each with ``t``, the machine's
``time.monotonic()`` (one clock for every process of the run), so the section times
events across processes.

- ``seed``: enroll its share of the clusters (each migrated by the store's own migrations,
  then marked), and COPY the template's task rows into each (the column list of
  ``cronoq_store._schema.INSERT_COLUMNS``).
- ``serve``: one ``PgHost`` serving the group. For each cluster gained it recovers (says
  ``led`` with what recovery read), then commits one new task every ``commit_every``
  seconds and appends each acknowledged id to its journal *after* the acknowledgement, so
  the journal never claims more than the store acknowledged. ``SIGTERM`` closes the host
  (hands every cluster over) and exits 0.
- ``commit``: a ``PgHost`` alone in the group leads every cluster, then times the same
  number of one-mutation submitters spread over many clusters and over few, each cluster
  with its own ``GroupCommitter``, rounds interleaved.

With ``$BENCH_FLEET_PROFILE`` set to a path, the process runs under ``cProfile`` and writes
its statistics there on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import logging
import os
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from cronoq_store import FencedError, PgStoreConfig, StoreError, TaskSpec, TimeBase, task_id
from cronoq_store import _statements as st
from cronoq_store._commit_path import COPY_MIN_ROWS, fold
from cronoq_store._committer import GroupCommitter
from cronoq_store._domain import Submitted, TaskId
from cronoq_store._door import Opening
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig, pool_split
from cronoq_store._schema import INSERT_COLUMNS, LEADER_ROW_ID

from .common import compile_for_asyncpg, dsn
from .loops import run_loop

PROFILE_ENV = "BENCH_FLEET_PROFILE"
_SPEC = TaskSpec(b"fleet", kind="bench.fleet")


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"e": event, "t": time.monotonic(), **fields}), flush=True)


def host_config(args: dict[str, Any]) -> PgHostConfig:
    keepalive, session_timeout, lock_poll = args["timing"]
    return PgHostConfig(
        store=PgStoreConfig(
            keepalive=keepalive,
            session_timeout=session_timeout,
            lock_poll=lock_poll,
            retention=86_400.0,
        ),
        control_schema=args["control"],
        group=args["group"],
        max_connections=args["pool"],
        join_settle=args.get("settle"),
    )


# --- seed -------------------------------------------------------------------------------------


async def seed(args: dict[str, Any]) -> None:
    """Enroll and fill ``args["schemas"]``; says ``seeded`` with the seconds of each step."""
    url = make_url(args["url"])
    conn = await asyncpg.connect(dsn(url))
    columns = list(INSERT_COLUMNS)
    names = ", ".join(f'"{c}"' for c in columns)
    template = args["template"]
    select = f'SELECT {names} FROM "{template}".cronoq_tasks'  # noqa: S608 (the section's names)
    rows = [tuple(r) for r in await conn.fetch(select)]
    host = await PgHost.connect(url, host_config(args))
    enroll_s = copy_s = 0.0
    try:
        for schema in args["schemas"]:
            started = time.perf_counter()
            await host.enroll(schema)
            enrolled = time.perf_counter()
            await conn.copy_records_to_table(
                "cronoq_tasks", schema_name=schema, columns=columns, records=rows
            )
            enroll_s += enrolled - started
            copy_s += time.perf_counter() - enrolled
    finally:
        await host.close()
        await conn.close()
    say("seeded", clusters=len(args["schemas"]), enroll_s=enroll_s, copy_s=copy_s)


# --- serve ------------------------------------------------------------------------------------


class _Journal:
    """Acknowledged ids, one ``schema id`` line each, written after the acknowledgement."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", buffering=1)

    def ack(self, schema: str, id: int) -> None:
        self._file.write(f"{schema} {id}\n")

    def close(self) -> None:
        self._file.close()


async def _lead(store: HostedStore, journal: _Journal, every: float) -> None:
    base = TimeBase.now()
    recovered = await store.recover(base)
    epoch = store.epoch
    if epoch is None:
        return
    schema = store.config.schema
    say(
        "led",
        schema=schema,
        epoch=epoch,
        live=len(recovered.tasks),
        finished=len(recovered.terminal),
    )
    next_id = max(recovered.next_id, task_id(epoch, 0) + 1)
    seq = max((t.seq for t in recovered.tasks), default=0) + 1
    lost = asyncio.ensure_future(store.leadership_lost())
    try:
        await asyncio.wait({lost}, timeout=random.uniform(0, every))
        while not lost.done():
            id = next_id
            next_id += 1
            seq += 1
            try:
                await store.commit(
                    epoch, base, [Submitted(TaskId(id), seq, base.engine_ns, _SPEC)], []
                )
            except FencedError:
                return
            except StoreError:
                await asyncio.wait({lost}, timeout=0.1)
                continue
            journal.ack(schema, id)
            await asyncio.wait({lost}, timeout=every)
    finally:
        lost.cancel()


class _OneLine(logging.Formatter):
    """A record on one line of stderr: the process's name, the level, the message and the
    record's extra fields (the store logs its details there)."""

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in self._STANDARD}
        return f"{self._name}: {record.levelname} {record.getMessage()} {extra}"


async def serve(args: dict[str, Any]) -> None:
    # What the host says of lost sessions and failed rounds is the run's evidence.
    said = logging.StreamHandler()
    said.setLevel(logging.WARNING)
    said.setFormatter(_OneLine(args["name"]))
    logging.getLogger("cronoq_store").addHandler(said)
    journal = _Journal(Path(args["journal"]))
    started = time.monotonic()
    host = await PgHost.connect(args["url"], host_config(args))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    say("connected", started=started)

    async def lead(store: HostedStore) -> None:
        await _lead(store, journal, args["commit_every"])

    serving = asyncio.ensure_future(host.serve(lead))
    await asyncio.sleep(0)
    # The host signals no registration: look until its process id shows.
    while host.process_id is None and not serving.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    say("registered", process_id=host.process_id)
    await stop.wait()
    await host.close()
    await serving
    journal.close()
    say("closed")


# --- commit -----------------------------------------------------------------------------------


async def _drive(
    stores: Sequence[tuple[HostedStore, int, TimeBase]],
    next_ids: dict[str, int],
    submitters: int,
    seconds: float,
) -> float:
    """``submitters`` loops spread over ``stores`` (submitter ``i`` on store ``i % n``),
    each committing one new task at a time through its cluster's ``GroupCommitter`` until
    the deadline; returns mutations per second."""
    done = 0
    async with contextlib.AsyncExitStack() as stack:
        committers = [
            await stack.enter_async_context(GroupCommitter(store, epoch, base))
            for store, epoch, base in stores
        ]
        deadline = time.perf_counter() + seconds

        async def submitter(i: int) -> None:
            nonlocal done
            k = i % len(stores)
            schema = stores[k][0].config.schema
            committer, base = committers[k], stores[k][2]
            while time.perf_counter() < deadline:
                id = next_ids[schema]
                next_ids[schema] = id + 1
                await committer.submit([Submitted(TaskId(id), id, base.engine_ns, _SPEC)])
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(submitter(i) for i in range(submitters)))
        took = time.perf_counter() - started
    return done / took


async def commit(args: dict[str, Any]) -> None:
    """Lead every cluster of the group, then interleave the wide and narrow trials."""
    logging.getLogger("cronoq_store").addHandler(logging.NullHandler())
    started = time.monotonic()
    host = await PgHost.connect(args["url"], host_config(args))
    led: dict[str, tuple[HostedStore, int, TimeBase]] = {}
    next_ids: dict[str, int] = {}
    everyone = asyncio.Event()
    done = asyncio.Event()

    async def lead(store: HostedStore) -> None:
        base = TimeBase.now()
        recovered = await store.recover(base)
        epoch = store.epoch
        if epoch is None:
            return
        schema = store.config.schema
        next_ids[schema] = max(recovered.next_id, task_id(epoch, 0) + 1)
        led[schema] = (store, epoch, base)
        if len(led) == args["clusters"]:
            everyone.set()
        await done.wait()

    serving = asyncio.ensure_future(host.serve(lead))
    await asyncio.wait_for(everyone.wait(), args["open_cap"])
    say("all_led", seconds=time.monotonic() - started)
    ordered = [led[s] for s in sorted(led)]
    variants = {"wide": ordered[: args["wide"]], "narrow": ordered[: args["narrow"]]}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(1 + args["rounds"]):
        for name in names[r % 2 :] + names[: r % 2]:
            rate = await _drive(variants[name], next_ids, args["submitters"], args["seconds"])
            if r:
                rates[name].append(rate)
    say("rates", **rates)
    floor = await _floors(args, variants, next_ids)
    say("floor", **floor)
    done.set()
    await host.close()
    await serving


# --- the floor: the same commits, the store taken out ---------------------------------------


async def _floors(
    args: dict[str, Any],
    variants: dict[str, list[tuple[HostedStore, int, TimeBase]]],
    next_ids: dict[str, int],
) -> dict[str, list[float]]:
    """The trials again, rounds interleaved, on raw asyncpg sessions (:func:`_floor`)."""
    lanes, _ = pool_split(args["pool"])
    conns = [await asyncpg.connect(args["url"], statement_cache_size=0) for _ in range(lanes)]
    try:
        for conn in conns:
            await conn.execute(compile_for_asyncpg(st.create_staging, "").sql)
        rates: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        prepared: list[dict[str, tuple[str, str, Opening]]] = [{} for _ in conns]
        # Each cluster has a session of its own (the bus gives each two), and that session
        # its statements, prepared before the clock runs.
        for k, (store, _, _) in enumerate(variants["wide"]):
            schema = store.config.schema
            prepared[k % lanes][schema] = await _prepare(conns[k % lanes], schema, k)
        for r in range(1 + args["rounds"]):
            for name in names[r % 2 :] + names[: r % 2]:
                rate = await _floor(
                    conns, prepared, variants[name], next_ids, args["submitters"], args["seconds"]
                )
                if r:
                    rates[name].append(rate)
        return rates
    finally:
        for conn in conns:
            await conn.close()


async def _floor(
    conns: list[asyncpg.Connection],
    prepared: list[dict[str, tuple[str, str, Opening]]],
    stores: Sequence[tuple[HostedStore, int, TimeBase]],
    next_ids: dict[str, int],
    submitters: int,
    seconds: float,
) -> float:
    """The statements the commit bus sends, without the store: each cluster has two commits
    in flight (as a committer's two batches), of the new tasks its submitters would give
    them (``submitters / clusters / 2``), on the session of its own (cluster ``k`` on
    ``k % sessions``); each session writes up to 16 at a time in one
    transaction: the epochs checked by prepared statements sent with ``BEGIN``, a few rows
    staged by one COPY and inserted by a prepared statement each, many COPYed straight into
    their table, the closing checks and ``COMMIT``. Returns mutations per second."""
    rows = max(1, submitters // len(stores) // 2)
    lanes = len(conns)
    queues = [
        deque([k for k in range(i, len(stores), lanes) for _ in range(2)]) for i in range(lanes)
    ]
    template = fold([Submitted(TaskId(1), 1, 0, _SPEC)], stores[0][2], time.time_ns()).insert_rows[
        0
    ]
    columns = ("member", *INSERT_COLUMNS)
    done = 0
    deadline = time.perf_counter() + seconds

    async def lane(i: int) -> None:
        nonlocal done
        conn, named, ready = conns[i], prepared[i], queues[i]
        while time.perf_counter() < deadline:
            group = sorted(
                (ready.popleft() for _ in range(min(16, len(ready)))),
                key=lambda k: stores[k][0].config.schema,
            )
            if not group:
                return  # more sessions than clusters
            opening = ["BEGIN", st.generic_plans.text]
            staged: list[tuple[Any, ...]] = []
            copies: list[tuple[str, list[list[Any]]]] = []
            closing: list[str] = []
            for m, k in enumerate(group):
                store, epoch, _ = stores[k]
                schema = store.config.schema
                check, insert, kept = named[schema]
                fenced = {"epoch": epoch, "incarnation": store.incarnation}
                opening.append(check.format(epoch, store.incarnation))
                ids = range(next_ids[schema], next_ids[schema] + rows)
                next_ids[schema] += rows
                made = [[id, id, *template[2:]] for id in ids]
                if rows < COPY_MIN_ROWS:
                    staged.extend((m, *row) for row in made)
                    closing.append(insert.format(m))
                else:
                    copies.append((schema, made))
                closing.append(kept.sql(fenced))
            await conn.execute("; ".join(opening))
            if staged:
                await conn.copy_records_to_table(
                    st.staged_tasks.name, records=staged, columns=columns, schema_name="pg_temp"
                )
            for schema, made in copies:
                await conn.copy_records_to_table(
                    "cronoq_tasks", records=made, columns=INSERT_COLUMNS, schema_name=schema
                )
            await conn.execute("; ".join([*closing, "COMMIT"]))
            done += rows * len(group)
            ready.extend(group)

    started = time.perf_counter()
    await asyncio.gather(*(lane(i) for i in range(len(conns))))
    return done / (time.perf_counter() - started)


async def _prepare(conn: asyncpg.Connection, schema: str, k: int) -> tuple[str, str, Opening]:
    """The bus's statements for ``schema``, prepared on ``conn``: the epoch check's and the
    staged insert's ``EXECUTE`` (format fields: epoch and incarnation; member), and the
    closing check."""
    check = compile_for_asyncpg(st.epoch_kept_for_share, schema)
    insert = compile_for_asyncpg(st.insert_staged, schema)
    await conn.execute(f"PREPARE floor_c_{k} AS {check.sql}; PREPARE floor_i_{k} AS {insert.sql}")
    row = LEADER_ROW_ID
    return (
        f"EXECUTE floor_c_{k}({row}, {row}, {{}}, {{}})",
        f"EXECUTE floor_i_{k}({{}})",
        Opening.checking(compile_for_asyncpg(st.incarnation_kept, schema)),
    )


MODES = {"seed": seed, "serve": serve, "commit": commit}


def main(mode: str) -> None:
    args = json.loads(sys.stdin.read())
    profile_path = os.environ.get(PROFILE_ENV)
    if not profile_path:
        run_loop(MODES[mode](args))
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run_loop(MODES[mode](args))
    finally:
        profiler.disable()
        profiler.dump_stats(profile_path)


if __name__ == "__main__":
    main(sys.argv[1])
