"""Where the time goes, on both sides of the wire: ``python -m benchmarks.profile [--out DIR]``.

Client: cProfile of ``PgStore.commit`` (batches of 1 and of 1,000), of ``GroupCommitter``
with 64 submitters beside one caller committing batches of 64, and of ``PgStore.recover``
(100,000 tasks). Server: the plans that
``auto_explain`` (ANALYZE, BUFFERS, WAL) logs for the store's insert, status update and prune
batch, and for pgqueuer's enqueue, each with a batch of 1,000. Writes ``profile.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
from pgqueuer.queries import Queries
from sqlalchemy.engine import URL

from cronoq_store import PgStoreConfig, TimeBase
from cronoq_store import _statements as st
from cronoq_store._committer import GroupCommitter
from cronoq_store._queries import PRUNE_BATCH
from cronoq_store._schema import INSERT_COLUMNS
from cronoq_store._store import PgStore
from cronoq_store.testing import EmbeddedPostgres

from . import prune, recovery
from .commit import RawWriter
from .common import SERVER_SETTINGS, Workload, compile_for_asyncpg, dsn, open_store, transitions
from .group_commit import drive, drive_batched

_ROOT = Path(__file__).resolve().parent.parent
_TOP = 22
_EXPLAIN = {
    "auto_explain.log_min_duration": "0",
    "auto_explain.log_analyze": "on",
    "auto_explain.log_buffers": "on",
    "auto_explain.log_wal": "on",
    "auto_explain.log_timing": "on",
}


async def _client_profile(title: str, work: Callable[[], Awaitable[Any]]) -> str:
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    await work()
    profiler.disable()
    elapsed = time.perf_counter() - started
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(_TOP)
    return f"=== client: {title} ({elapsed:.3f} s under cProfile)\n{out.getvalue()}"


async def _explaining(url: URL) -> asyncpg.Connection:
    """A raw connection whose statements the server logs with their executed plans."""
    conn = await asyncpg.connect(dsn(url))
    await conn.execute("LOAD 'auto_explain'")
    for name, value in _EXPLAIN.items():
        await conn.execute(f"SET {name} = '{value}'")
    return conn


async def _server_plans(url: URL, pgqueuer_url: URL) -> None:
    """Run each statement with a batch of 1,000, five times (the last runs the generic plan
    the store settles on); their plans go to the server log."""
    workload = Workload()
    base = workload.base
    holder, epoch = await open_store(url, "profile_raw")
    conn = await _explaining(url)
    try:
        writer = RawWriter(conn, "profile_raw", epoch, holder.incarnation)
        batches = [workload.submissions(1000) for _ in range(6)]
        for batch in batches:
            await writer.insert(batch, base)
        ids = [m.id for m in batches[0]]
        for round_ in range(6):
            await writer.update(transitions(ids, round_, base), base)
    finally:
        await conn.close()
        await holder.close()

    pgq_conn = await _explaining(pgqueuer_url)
    try:
        queries = Queries.from_asyncpg_connection(pgq_conn)
        await queries.install()
        for batch in (workload.submissions(1000) for _ in range(6)):
            await queries.enqueue(
                [m.spec.kind for m in batch],
                [m.spec.payload for m in batch],
                [int(m.spec.priority) for m in batch],
            )
    finally:
        await pgq_conn.close()

    schema = "profile_prune"
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    await store.close()
    conn = await _explaining(url)
    try:
        rows = prune.make_rows(200_000, 20_000, TimeBase.now(), time.time_ns())
        await conn.copy_records_to_table(
            "cronoq_tasks", records=rows, columns=INSERT_COLUMNS, schema_name=schema
        )
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
        prune_batch = compile_for_asyncpg(st.prune_batch, schema)
        params = {"cutoff": time.time_ns() - 3600 * 10**9, "batch": PRUNE_BATCH}
        await conn.execute(prune_batch.sql, *prune_batch.args(params))
    finally:
        await conn.close()


def _plans_from_log(log: str) -> str:
    """The logged plans of the profiled statements, one per kind (the last of each)."""
    kinds = {
        "store insert (batch of 1,000)": "INSERT INTO profile_raw.cronoq_tasks",
        "store status update (batch of 1,000)": "UPDATE profile_raw.cronoq_tasks",
        "pgqueuer enqueue (batch of 1,000)": "WITH input AS MATERIALIZED",
        "store prune batch (200,000 finished, 20,000 live with deps)": "DELETE FROM profile_prune",
    }
    entries = re.split(r"\n(?=\S)", log)
    found = []
    for title, marker in kinds.items():
        matching = [e for e in entries if "duration:" in e and "plan:" in e and marker in e]
        if matching:
            found.append(f"=== server: {title}\n{matching[-1].strip()}\n")
    return "\n".join(found)


async def _client_profiles(url: URL) -> list[str]:
    sections = []
    store, epoch = await open_store(url, "profile_store")
    workload = Workload()
    base = workload.base
    try:
        for size, count in ((1, 500), (1000, 10)):
            for batch in [workload.submissions(size) for _ in range(5)]:
                await store.commit(epoch, base, batch, ())  # warm: statements prepared
            batches = [workload.submissions(size) for _ in range(count)]

            async def commit_all(batches: list[Any] = batches) -> None:
                for batch in batches:
                    await store.commit(epoch, base, batch, ())

            title = f"PgStore.commit, {count} batches of {size} submissions"
            sections.append(await _client_profile(title, commit_all))

        async def group() -> None:
            async with GroupCommitter(store, epoch, base) as committer:
                await drive(committer.submit, workload, 64, 2.0)

        sections.append(await _client_profile("GroupCommitter, 64 submitters, 2 s", group))

        async def batched() -> None:
            await drive_batched(lambda b: store.commit(epoch, base, b, ()), workload, 64, 2.0)

        # The same mutations without the committer: what its per-submission work costs.
        title = "PgStore.commit, one caller, batches of 64, 2 s"
        sections.append(await _client_profile(title, batched))
    finally:
        await store.close()

    await recovery.populate(url, "profile_recovery", 100_000)
    reader = await PgStore.connect(url, PgStoreConfig(schema="profile_recovery"))
    try:
        await reader.recover(TimeBase.now())  # warm
        title = "PgStore.recover, 100,000 live tasks"
        sections.append(await _client_profile(title, lambda: reader.recover(TimeBase.now())))
    finally:
        await reader.close()
    return sections


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    parser.add_argument("--out", type=Path, default=_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    with EmbeddedPostgres(settings=SERVER_SETTINGS) as server:
        url = server.url()

        async def everything() -> list[str]:
            conn = await asyncpg.connect(dsn(url))
            await conn.execute('CREATE DATABASE "profile_pgqueuer"')
            await conn.close()
            await _server_plans(url, url.set(database="profile_pgqueuer"))
            return await _client_profiles(url)

        sections = asyncio.run(everything())
        sections.append(_plans_from_log(server.log_file.read_text(errors="replace")))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.txt").write_text("\n".join(sections))
    print(f"wrote {args.out / 'profile.txt'}")


if __name__ == "__main__":
    main()
