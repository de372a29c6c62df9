"""What setting the search_path per transaction costs a borrowed engine (``from_engine``).

The store's own pool (``connect``) gets ``search_path = pg_catalog, pg_temp`` at connect;
on a borrowed session each commit is a transaction that sets it for itself first.
This times one-statement commits (one status change) back to back, the two kinds of store
alternating trial by trial on one embedded server, and prints the medians.

    PYTHONPATH=. python3 benchmarks/borrowed_search_path.py [commits_per_trial] [trials]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import PgStore, PgStoreConfig, StatusChanged, Submitted, TaskSpec, TimeBase
from cronoq_store._domain import TaskId, TaskStatus
from cronoq_store._urls import async_url
from cronoq_store.testing import EmbeddedPostgres

BASE = TimeBase.now()


async def per_commit_us(store: PgStore, commits: int) -> float:
    started = time.perf_counter()
    for n in range(commits):
        status = TaskStatus.RUNNING if n % 2 == 0 else TaskStatus.RETRYING
        await store.commit(0, BASE, [StatusChanged(TaskId(1), status, n, BASE.engine_ns)], [])
    return (time.perf_counter() - started) / commits * 1e6


async def main(commits: int, trials: int) -> None:
    with EmbeddedPostgres() as server:
        url = server.url()
        owned = await PgStore.connect(url, PgStoreConfig(schema="owned", max_connections=1))
        engine = create_async_engine(async_url(url), pool_size=1, max_overflow=0)
        borrowed = await PgStore.from_engine(engine, PgStoreConfig(schema="borrowed"))
        try:
            for store in (owned, borrowed):
                task = Submitted(TaskId(1), 1, BASE.engine_ns, TaskSpec(b"x"))
                await store.commit(0, BASE, [task], [])
                await per_commit_us(store, commits)  # warm up: plans, caches
            figures: dict[str, list[float]] = {"connect": [], "from_engine": []}
            for _ in range(trials):
                figures["connect"].append(await per_commit_us(owned, commits))
                figures["from_engine"].append(await per_commit_us(borrowed, commits))
        finally:
            await owned.close()
            await borrowed.close()
            await engine.dispose()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    for name, value in medians.items():
        print(f"{name:12} {value:7.1f} us per commit (median of {trials} x {commits})")
    extra = medians["from_engine"] - medians["connect"]
    ratio = medians["from_engine"] / medians["connect"]
    print(f"hand-over   {extra:+7.1f} us per commit ({ratio:.2f}x)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000,
                     int(sys.argv[2]) if len(sys.argv) > 2 else 7))  # fmt: skip
