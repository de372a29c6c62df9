"""Group commit: N concurrent submitters of one mutation each, through ``GroupCommitter``
against each calling ``PgStore.commit`` itself (one transaction per submission), and
against one caller committing the same kind of mutations in batches of N back to back
(``batched``: what the committer could reach without any per-submission cost).

Between the two, the floor: the same submitters through :class:`BareCommitter`, a future
per submission and one loop committing whatever is queued, nothing else (no admission
bound, no order between batches, no retries, no telemetry). What separates it from
``batched`` is asyncio's own cost per awaiting submitter (a future, a wake-up, a task
step); what separates the committer from it is the committer's.

Every side uses the same store (its pool of ``max_connections`` = 8, the default) and runs
for the same time; the figure is acknowledged mutations per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from sqlalchemy.engine import URL

from cronoq_store import Mutation
from cronoq_store._committer import GroupCommitter
from cronoq_store._store import PgStore

from .common import Profile, Trial, Workload, interleave, open_store, paired, summarize

Commit = Callable[[Sequence[Mutation]], Awaitable[None]]


async def drive(commit: Commit, workload: Workload, submitters: int, seconds: float) -> float:
    """``submitters`` loops, each committing one new task at a time until the deadline;
    returns mutations per second over the time until the last one returned."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def submitter() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await commit([workload.one()])
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(submitter() for _ in range(submitters)))
    return done / (time.perf_counter() - started)


async def drive_batched(commit: Commit, workload: Workload, size: int, seconds: float) -> float:
    """One caller committing batches of ``size`` new tasks back to back until the deadline;
    returns mutations per second."""
    deadline = time.perf_counter() + seconds
    done = 0
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        await commit([workload.one() for _ in range(size)])
        done += size
    return done / (time.perf_counter() - started)


class BareCommitter:
    """The floor of a group committer: each submission a future, one loop committing all
    that is queued as one batch and settling the futures. Nothing a real committer needs
    besides (bounds, failures, ordering, telemetry): a benchmark's baseline only."""

    def __init__(self, commit: Commit) -> None:
        self._commit = commit
        self._queue: list[tuple[Sequence[Mutation], asyncio.Future[None]]] = []
        self._wakeup = asyncio.Event()
        self._loop = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, mutations: Sequence[Mutation]) -> None:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((mutations, future))
        self._wakeup.set()
        await future

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._queue = self._queue, []
            await self._commit([m for mutations, _ in batch for m in mutations])
            for _, future in batch:
                future.set_result(None)

    async def close(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop


def _grouped(
    store: PgStore,
    epoch: int,
    workload: Workload,
    submitters: int,
    profile: Profile,
    batches: list[float],
    latencies: list[float],
) -> Trial:
    """A trial through a fresh ``GroupCommitter``; notes its mean batch and p99 latency."""

    async def trial() -> float:
        async with GroupCommitter(store, epoch, workload.base) as committer:
            rate = await drive(committer.submit, workload, submitters, profile.group_seconds)
        stats = committer.stats()
        batches.append(stats.mean_batch_mutations)
        if stats.latency_p99 is not None:
            latencies.append(stats.latency_p99)
        return rate

    return trial


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """For each submitter count: the summary of mutations/s of both sides and their ratio,
    with the committer's mean batch and latency percentiles."""
    async with AsyncExitStack() as stack:
        store, epoch = await open_store(url, "bench_group_commit")
        stack.push_async_callback(store.close)
        workload = Workload()
        base = workload.base
        results: dict[str, Any] = {}
        for submitters in profile.submitters:
            batches: list[float] = []
            latencies: list[float] = []

            grouped = _grouped(store, epoch, workload, submitters, profile, batches, latencies)

            async def single(submitters: int = submitters) -> float:
                return await drive(
                    lambda batch: store.commit(epoch, base, batch, ()),
                    workload,
                    submitters,
                    profile.group_seconds,
                )

            async def bare(submitters: int = submitters) -> float:
                committer = BareCommitter(lambda batch: store.commit(epoch, base, batch, ()))
                try:
                    return await drive(
                        committer.submit, workload, submitters, profile.group_seconds
                    )
                finally:
                    await committer.close()

            async def batched(submitters: int = submitters) -> float:
                return await drive_batched(
                    lambda batch: store.commit(epoch, base, batch, ()),
                    workload,
                    submitters,
                    profile.group_seconds,
                )

            measured = await interleave(
                {"group": grouped, "single": single, "bare": bare, "batched": batched},
                profile.group_rounds,
            )
            results[str(submitters)] = {
                "variants": {name: summarize(v) for name, v in measured.items()},
                "group_vs_single": paired(measured["group"], measured["single"]),
                "group_vs_batched": paired(measured["group"], measured["batched"]),
                # The floor: the committer over the bare one, the bare one over batched.
                "group_vs_bare": paired(measured["group"], measured["bare"]),
                "bare_vs_batched": paired(measured["bare"], measured["batched"]),
                # The first trial of each side is the warm-up round.
                "mean_batch_mutations": summarize(batches[1:]),
                "latency_p99_seconds": summarize(latencies[1:]),
            }
    return results
