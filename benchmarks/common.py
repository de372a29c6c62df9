"""What every benchmark shares: the profile, interleaved trials, statistics, the workload,
and the store's own statements compiled for raw asyncpg.

The baselines run *the store's statements*: :func:`compile_for_asyncpg` renders the Core
constructs of :mod:`cronoq_store._statements` for the asyncpg dialect, with the schema filled
in, so raw asyncpg sends byte-for-byte the SQL the store sends. They encode and decode rows
with the store's own :mod:`cronoq_store._schema` functions, so the difference is the store's
own overhead.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.sql import ClauseElement

from cronoq_store import (
    Dependency,
    PgStoreConfig,
    Priority,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store._codec import clean_text
from cronoq_store._domain import level
from cronoq_store._door import CompiledStatement
from cronoq_store._store import PgStore

#: Realistic durability for every measurement (the embedded server defaults to fsync=off):
#: WAL flushed at every commit. Checkpoints are spaced out so that one does not land in a
#: single trial; both sides of each comparison share the server anyway.
SERVER_SETTINGS = {
    "fsync": "on",
    "full_page_writes": "on",
    "synchronous_commit": "on",
    "shared_buffers": "512MB",
    "max_wal_size": "16GB",
    "checkpoint_timeout": "30min",
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "top",
}

#: Bytes of every task's payload (pgqueuer gets the same bytes).
PAYLOAD = bytes(range(128))


@dataclass(frozen=True)
class Profile:
    """Sizes and repetitions of one run."""

    name: str
    #: Measured rounds of every interleaved comparison (after one warm-up round).
    rounds: int
    commit_sizes: tuple[int, ...]
    #: Rows committed per trial (one batch at least): small batches repeat, at most
    #: ``commit_max_batches`` times.
    commit_rows: int
    commit_max_batches: int
    #: Batches of every trial of new tasks at least. A commit of 10,000 new tasks writes 5 MB
    #: of WAL, so every third one or so opens a new 16 MB WAL segment and takes 20-30%
    #: longer; a trial of one batch compares single commits, whose ratio spanned 0.5-1.8
    #: between builds sending the same statements. Three batches write about a segment per
    #: trial, so every variant pays alike. Transitions keep one batch: theirs would repeat
    #: the same tasks.
    commit_min_batches: int
    transition_sizes: tuple[int, ...]
    submitters: tuple[int, ...]
    #: Seconds each group-commit trial runs its submitters: the same in every profile (the
    #: committer's rate differs by 1.1-1.3x between 0.5 s and 2 s trials in one run).
    group_seconds: float
    #: Measured rounds of the group-commit comparison (three variants per submitter count).
    group_rounds: int
    recovery_sizes: tuple[int, ...]
    recovery_rounds: int
    prune_finished: int
    prune_live: int
    prune_rounds: int
    #: Also time one batch on a 200,000-task table (see ``benchmarks.prune``).
    prune_large: bool
    #: Finished tasks of the one-trial prune of a large table (0: not run).
    prune_large_finished: int
    kill_takeovers: int
    stall_takeovers: int
    #: Leadership timings of the takeover scenarios (keepalive, session_timeout, lock_poll).
    takeover_timing: tuple[float, float, float]
    #: Rows already in the table for ``benchmarks.scale`` (each against an empty table).
    scale_rows: tuple[int, ...]
    #: Rows of history in each index design's table, and the designs measured (names of
    #: ``benchmarks.indexes.DESIGNS``; the empty tuple: all of them).
    index_rows: int
    index_designs: tuple[str, ...]
    #: Task rows of the cluster whose console pages ``benchmarks.console`` times.
    console_rows: int
    #: ``benchmarks.fleet``: clusters, host processes serving them, and each process's pool.
    fleet_clusters: int
    fleet_processes: int
    fleet_pool: int
    #: Live and finished tasks seeded into every cluster.
    fleet_live: int
    fleet_finished: int
    #: Processes enrolling and seeding the clusters at once.
    fleet_seeders: int
    #: Seconds between one hosted cluster's commits while the fleet serves.
    fleet_commit_every: float
    #: One-mutation submitters through one process, seconds per trial, measured rounds.
    fleet_submitters: int
    fleet_commit_seconds: float
    fleet_commit_rounds: int
    #: The hosted clusters' keepalive, session_timeout and lock_poll.
    fleet_timing: tuple[float, float, float]
    #: Run only the fleet's commit phase (after seeding): the commit bus's figures alone.
    fleet_commit_only: bool = False


QUICK = Profile(
    name="quick",
    rounds=3,
    commit_sizes=(1, 10, 100, 1000, 10_000),
    commit_rows=1000,
    commit_max_batches=150,
    commit_min_batches=3,
    transition_sizes=(1, 100, 1000),
    submitters=(64, 256),
    group_seconds=1.0,
    group_rounds=5,
    recovery_sizes=(100_000,),
    recovery_rounds=2,
    prune_finished=100_000,
    prune_live=2_000,
    prune_rounds=3,
    prune_large=False,
    prune_large_finished=0,
    kill_takeovers=1,
    stall_takeovers=1,
    takeover_timing=(0.5, 2.0, 0.25),
    scale_rows=(1_000_000,),
    index_rows=100_000,
    index_designs=("current", "brin_finished_ff50", "stable_finished_key_ff70"),
    console_rows=200_000,
    fleet_clusters=1000,
    fleet_processes=4,
    fleet_pool=8,
    fleet_live=100,
    fleet_finished=1000,
    fleet_seeders=3,
    fleet_commit_every=2.0,
    fleet_submitters=4000,
    fleet_commit_seconds=2.0,
    fleet_commit_rounds=3,
    # The defaults of PgStoreConfig.
    fleet_timing=(1.0, 10.0, 0.5),
)

FULL = Profile(
    name="full",
    rounds=7,
    commit_sizes=(1, 10, 100, 1000, 10_000),
    commit_rows=4000,
    commit_max_batches=1000,
    commit_min_batches=3,
    transition_sizes=(1, 10, 100, 1000, 10_000),
    submitters=(1, 4, 16, 64, 256),
    group_seconds=1.0,
    group_rounds=7,
    recovery_sizes=(100_000, 1_000_000),
    recovery_rounds=3,
    prune_finished=100_000,
    prune_live=2_000,
    prune_rounds=3,
    prune_large=True,
    prune_large_finished=1_000_000,
    kill_takeovers=5,
    stall_takeovers=3,
    # The defaults of PgStoreConfig.
    takeover_timing=(1.0, 10.0, 0.5),
    scale_rows=(1_000_000, 10_000_000),
    index_rows=1_000_000,
    index_designs=(),
    console_rows=10_000_000,
    fleet_clusters=10_000,
    fleet_processes=4,
    fleet_pool=8,
    fleet_live=100,
    fleet_finished=1000,
    fleet_seeders=3,
    fleet_commit_every=5.0,
    fleet_submitters=4000,
    fleet_commit_seconds=2.0,
    fleet_commit_rounds=5,
    fleet_timing=(1.0, 10.0, 0.5),
)


def batches_per_trial(profile: Profile, size: int) -> int:
    return max(1, min(profile.commit_max_batches, profile.commit_rows // size))


# --- measurement ----------------------------------------------------------------------------

Trial = Callable[[], Awaitable[float]]


async def interleave(
    trials: Mapping[str, Trial], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every trial once per round, each round in its own order (a shuffle seeded by
    the round's number: the same orders every run); warm-up rounds are not recorded.

    Not a rotation (A B C, B C A, ...): a rotation keeps who follows whom, so one variant
    always ran right after the same other one (the commit section's store after
    procrastinate, whose garbage and whose server's work from its own trial it paid for)."""
    names = list(trials)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        for name in random.Random(r).sample(names, len(names)):
            value = await trials[name]()
            if r >= warmup:
                results[name].append(value)
    return results


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and quartiles of repeated measurements."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "n": len(ordered),
    }


def paired(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """Summary of per-round ratios ``ours / theirs``: each pair ran back to back."""
    return summarize([a / b for a, b in zip(ours, theirs, strict=True)])


def dsn(url: URL) -> str:
    """A libpq-style URL with the password, for asyncpg and psycopg."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


# --- the store's statements for raw asyncpg -------------------------------------------------

_DIALECT = PGDialect_asyncpg()  # type: ignore[no-untyped-call]


def compile_for_asyncpg(statement: ClauseElement, schema: str) -> CompiledStatement:
    """``statement`` rendered as the store renders it for ``schema``: the store's own
    compiler (``cronoq_store._door.CompiledStatement``), so the SQL is byte for byte the
    same."""
    return CompiledStatement.of(statement, _DIALECT, schema)


async def open_store(url: URL, schema: str, **config: Any) -> tuple[PgStore, int]:
    """A migrated store for ``schema`` that leads; returns it and its epoch."""
    store = await PgStore.connect(url, PgStoreConfig(schema=schema, **config))
    return store, await store.acquire_leadership()


# --- the workload ---------------------------------------------------------------------------

_RETRY = RetryPolicy(max_attempts=5, backoff=timedelta(seconds=2), max_backoff=timedelta(minutes=1))
_POOLS = ("default", "email", "reports")


def make_spec(n: int, *, keyed: bool = True) -> TaskSpec:
    """A task as a scheduler sees them: varied options, half with a key, some with a
    dependency, a retry policy, tags, resources or a tenant. Keys are unique per ``n``."""
    return TaskSpec(
        PAYLOAD,
        kind="bench.job",
        pool=_POOLS[n % 3],
        priority=Priority.HIGH if n % 7 == 0 else Priority.NORMAL,
        key=f"job-{n}" if keyed and n % 2 == 0 else None,
        timeout=timedelta(seconds=30) if n % 2 else None,
        retry=_RETRY if n % 4 == 0 else None,
        deps=(Dependency(task_id(1, n - 1)),) if n % 10 == 0 and n > 1 else (),
        resources={"cpu": 1} if n % 5 == 0 else {},
        tags=("bench", "nightly") if n % 3 == 0 else (),
        tenant=f"tenant-{n % 10}" if n % 2 else None,
    )


class Workload:
    """Fresh tasks for every trial; each variant commits the very same mutation objects
    (into its own schema), so every side writes identical rows."""

    def __init__(self) -> None:
        self.base = TimeBase.now()
        self._next = 1
        self._unkeyed = [make_spec(n, keyed=False) for n in range(1, 257)]

    def batches(self, size: int, count: int) -> list[list[Submitted]]:
        """``count`` batches of ``size`` new tasks."""
        return [self.submissions(size) for _ in range(count)]

    def one(self) -> Submitted:
        """A new task without a key, cheap enough to make inside a timed loop (its spec is
        one of a few shared ones; keys would have to stay unique among live tasks)."""
        n = self._next
        self._next += 1
        return Submitted(task_id(1, n), n, time.monotonic_ns(), self._unkeyed[n % 256])

    @property
    def issued(self) -> int:
        """How many tasks were made: the last task's number."""
        return self._next - 1

    def submissions(self, count: int, *, keyed: bool = True) -> list[Submitted]:
        first, self._next = self._next, self._next + count
        now = time.monotonic_ns()
        return [
            Submitted(task_id(1, n), n, now, make_spec(n, keyed=keyed))
            for n in range(first, first + count)
        ]


def transitions(ids: Sequence[TaskId], round_: int, base: TimeBase) -> list[StatusChanged]:
    """One live-to-live transition per id: running and retrying alternate, so the table keeps
    its shape however many rounds run; every fourth carries a message."""
    status = TaskStatus.RUNNING if round_ % 2 == 0 else TaskStatus.RETRYING
    at = base.from_unix(time.time_ns())
    return [
        StatusChanged(i, status, round_, at, "worker lost" if i % 4 == 0 else None) for i in ids
    ]


# --- the hand-written encoding of the baselines ---------------------------------------------


def transition_columns(batch: Sequence[StatusChanged], base: TimeBase) -> dict[str, list[Any]]:
    """The status update's array parameters for transitions of distinct stored tasks."""
    return {
        "ids": [m.id for m in batch],
        "statuses": [m.status.value for m in batch],
        "terminals": [m.status.is_terminal for m in batch],
        "attempts": [m.attempt for m in batch],
        "updated": [base.to_unix(m.at) for m in batch],
        "messages": [None if m.message is None else clean_text(m.message) for m in batch],
        "levels": [level(m.status.value, m.status.is_terminal, m.attempt) for m in batch],
        # Where each message came from: its own transition (one per task here).
        "message_levels": [
            None if m.message is None else level(m.status.value, m.status.is_terminal, m.attempt)
            for m in batch
        ],
        "message_ats": [None if m.message is None else base.to_unix(m.at) for m in batch],
    }


#: The block a WAL flush writes, as ``pg_test_fsync``'s "one 8kB write" test does.
_FLUSH_BLOCK = b"\0" * 8192


def flush_rate(seconds: float = 1.0) -> float:
    """The disk's flushes a second, as ``pg_test_fsync``'s ``fdatasync`` of one 8 kB write
    measures them (the block rewritten at offset 0, then ``fdatasync``, over and over), on
    a file of the temporary directory: where the benchmark's server keeps its data. Its
    other tests take a minute, and this one is all a commit of one mutation needs."""
    with tempfile.TemporaryDirectory() as scratch:
        fd = os.open(os.path.join(scratch, "flush"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.write(fd, _FLUSH_BLOCK * 2048)  # 16 MiB, allocated before the timing
            os.fsync(fd)
            flushes, started = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - started) < seconds:
                os.pwrite(fd, _FLUSH_BLOCK, 0)
                os.fdatasync(fd)
                flushes += 1
        finally:
            os.close(fd)
    return flushes / elapsed
