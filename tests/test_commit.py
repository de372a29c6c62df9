"""Commits: idempotence, write order, outputs, recurring changes, NUL, fencing, timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._commit_path import COPY_MIN_ROWS, BatchWriter, fold
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Mutation,
    Priority,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store._errors import FencedError, KeyTakenError, UnavailableError
from cronoq_store._store import PgStore

from .pgharness import admin_execute, asyncpg_dsn, terminate_backend
from .support import (
    FULL_SPEC,
    NUL,
    NUL_CLEANED,
    NUL_SPEC,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    LeaderRowHold,
    changed,
    execute,
    submitted,
)
from .waits import bounded, until, until_value

#: Each test runs on a store on an application's engine and on one on its own pool.
STORE_OPENINGS = ("from_engine", "connect")


async def snapshot(store: PgStore) -> tuple[list[Any], ...]:
    return (
        await execute(store, "SELECT * FROM {s}.cronoq_tasks ORDER BY id"),
        await execute(store, "SELECT * FROM {s}.cronoq_recurring ORDER BY name"),
        await execute(store, "SELECT * FROM {s}.cronoq_leader"),
    )


def recurring(name: str, every: int = 60, **template: Any) -> RecurringSpec:
    return RecurringSpec(
        name, IntervalSchedule(timedelta(seconds=every)), TaskSpec(b"tpl", **template)
    )


async def test_a_landed_batch_committed_again_changes_nothing(store: PgStore) -> None:
    await store.commit(0, START_BASE, [submitted(1), submitted(2)], [])
    batch: list[Mutation] = [
        changed(1, RUNNING, 100, message="started"),
        changed(1, SUCCEEDED, 100),
        submitted(3),
        changed(3, RUNNING, 100, message="also started"),
        submitted(4),
        RecurringUpsert(recurring("r")),
        RecurringNext("r", 500, TaskId(3)),
    ]
    outputs = [(TaskId(1), b"out")]
    await store.commit(0, START_BASE, batch, outputs)
    landed = await snapshot(store)
    assert len(landed[0]) == 4
    assert len(landed[1]) == 1
    await store.commit(0, START_BASE, batch, outputs)
    assert await snapshot(store) == landed


async def test_updates_run_before_inserts_so_a_released_key_is_reused(store: PgStore) -> None:
    await store.commit(0, START_BASE, [submitted(1, key="k")], [])
    # One batch: the old holder of "k" finishes and a new task takes the key. Inserting
    # first would break the unique index on live keys and fail the whole batch.
    await store.commit(0, START_BASE, [changed(1, SUCCEEDED, 100), submitted(2, key="k")], [])
    rows = await execute(store, "SELECT id, key, status FROM {s}.cronoq_tasks ORDER BY id")
    assert [tuple(r) for r in rows] == [(1, "k", "succeeded"), (2, "k", "queued")]


async def test_outputs_are_stored_and_missing_tasks_are_logged(
    store: PgStore, caplog: pytest.LogCaptureFixture
) -> None:
    await store.commit(
        0, START_BASE, [submitted(1), changed(1, SUCCEEDED, 100)], [(TaskId(1), b"\0out")]
    )
    assert await store.load_output(TaskId(1)) == b"\0out"
    with caplog.at_level(logging.WARNING, logger="cronoq_store"):
        await store.commit(0, START_BASE, [changed(9, SUCCEEDED, 100)], [(TaskId(9), b"lost")])
    warnings = [r for r in caplog.records if r.name == "cronoq_store"]
    assert [(r.expected, r.matched) for r in warnings] == [(1, 0), (1, 0)]  # type: ignore[attr-defined]
    assert "status updates" in warnings[0].getMessage()
    assert "outputs" in warnings[1].getMessage()


async def test_nul_in_every_column_is_stored_as_replacement_character(store: PgStore) -> None:
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1, NUL_SPEC),
            submitted(2, b""),
            changed(2, RUNNING, 100, message=NUL),
            RecurringUpsert(RecurringSpec(NUL, CronSchedule("* * * * *"), NUL_SPEC)),
            RecurringNext(NUL, 9, TaskId(1)),
        ],
        [],
    )
    await store.commit(0, START_BASE, [changed(1, RUNNING, 100, message=NUL)], [])
    # What the store answers is the contract suite's (tests/contract/test_commits.py); here,
    # what the columns hold: text and JSON with no NUL and no escaped one.
    rows = await execute(
        store,
        "SELECT kind, pool, key, tenant, message, tags::text, labels::text, deps::text, "
        "resources::text FROM {s}.cronoq_tasks ORDER BY id",
    )
    assert rows[0].message == NUL_CLEANED
    assert rows[1].message == NUL_CLEANED
    assert all("\0" not in v and "\\u0000" not in v for v in rows[0])
    assert all(NUL_CLEANED in v for v in rows[0])
    [(name, spec_text)] = await execute(store, "SELECT name, spec::text FROM {s}.cronoq_recurring")
    # The template's kind, pool, key, tenant, tag, label, dependency key and resource name.
    assert name == NUL_CLEANED
    assert spec_text.count(NUL_CLEANED) == 8
    assert "\\u0000" not in spec_text


# Each kind of batch checks the epoch its own way: in a transaction (sent with its BEGIN)
# that also records the high-water mark, or that takes a share lock; or in the one statement
# of a batch that only inserts, or only updates.
FENCED_BATCHES: dict[str, tuple[list[Mutation], list[tuple[TaskId, bytes]]]] = {
    "transaction-record-max-id": (
        [changed(1, RUNNING, 100), RecurringUpsert(recurring("r")), submitted(2)],
        [(TaskId(1), b"o")],
    ),
    "transaction-for-share": (
        [changed(1, RUNNING, 100), RecurringUpsert(recurring("r"))],
        [(TaskId(1), b"o")],
    ),
    "one-statement-insert": ([submitted(2), submitted(3)], []),
    "one-statement-update": ([changed(1, RUNNING, 100)], []),
    "copy-insert": ([submitted(i) for i in range(2, 2 + COPY_MIN_ROWS)], []),
    "copy-transaction": (
        [changed(1, RUNNING, 100), *(submitted(i) for i in range(2, 2 + COPY_MIN_ROWS))],
        [(TaskId(1), b"o")],
    ),
}


@pytest.mark.parametrize("shape", FENCED_BATCHES)
async def test_a_changed_epoch_fences_the_commit_and_nothing_is_written(
    store: PgStore, shape: str, caplog: pytest.LogCaptureFixture
) -> None:
    await store.commit(0, START_BASE, [submitted(1)], [])
    async with store.engine.begin() as conn:
        await conn.execute(text(f'UPDATE "{store.config.schema}".cronoq_leader SET epoch = 7'))
    before = await snapshot(store)
    batch, outputs = FENCED_BATCHES[shape]
    with caplog.at_level(logging.ERROR, logger="cronoq_store"), pytest.raises(FencedError):
        await store.commit(0, START_BASE, batch, outputs)
    assert await snapshot(store) == before  # not even the high-water mark moved
    assert [getattr(r, "current_epoch", None) for r in caplog.records] == [7]
    # Once fenced, the store refuses at once, even an epoch the database would accept.
    with pytest.raises(FencedError, match="leadership was lost"):
        await store.commit(7, START_BASE, batch, [])
    assert await snapshot(store) == before


async def test_commits_after_leadership_is_lost_are_fenced_before_any_sql(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    epoch = await store.acquire_leadership()
    assert store.is_leader
    assert store.epoch == epoch
    await store.commit(epoch, START_BASE, [submitted(1)], [])

    # A takeover: another instance bumps the epoch; the next commit finds out.
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
    with pytest.raises(FencedError):
        await store.commit(epoch, START_BASE, [changed(1, RUNNING, 100)], [])
    await bounded(store.leadership_lost(), "leadership_lost() after the fenced commit")
    assert not store.is_leader
    assert store.epoch is None

    # From now on the store refuses without asking the database: the new leader's epoch
    # would pass the check, but this instance must never write again.
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = {epoch}')
    with pytest.raises(FencedError, match="leadership was lost"):
        await store.commit(epoch, START_BASE, [changed(1, RUNNING, 100)], [])
    rows = await execute(store, "SELECT status FROM {s}.cronoq_tasks")
    assert [r.status for r in rows] == ["queued"]


async def test_release_fences_later_commits(store: PgStore) -> None:
    epoch = await store.acquire_leadership()
    await store.commit(epoch, START_BASE, [submitted(1)], [])
    await store.release_leadership()
    await bounded(store.leadership_lost(), "leadership_lost() after the release")
    with pytest.raises(FencedError):
        await store.commit(epoch, START_BASE, [submitted(2)], [])
    assert [r.id for r in await execute(store, "SELECT id FROM {s}.cronoq_tasks")] == [1]


async def test_a_commit_slower_than_commit_timeout_is_unavailable(
    engine: AsyncEngine, migrated: str, pg_url: URL
) -> None:
    config = PgStoreConfig(schema=migrated, commit_timeout=0.3)
    async with await PgStore.from_engine(engine, config) as store:
        await store.commit(0, START_BASE, [submitted(1)], [])
        async with LeaderRowHold(pg_url, migrated):
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="commit_timeout"):
                # Refused while the row is still held, which it is for ever without the
                # timeout: the bound is how long the test takes to say so.
                await bounded(
                    store.commit(0, START_BASE, [submitted(2)], []), "the commit's timeout"
                )
            assert time.monotonic() - started >= config.commit_timeout * 0.9
        # Retrying is the caller's job, and works once the database answers again.
        await store.commit(0, START_BASE, [submitted(2)], [])
        rows = await execute(store, "SELECT id FROM {s}.cronoq_tasks ORDER BY id")
        assert [r.id for r in rows] == [1, 2]


async def test_a_read_only_server_drops_the_pool_so_the_next_commit_reconnects(
    pg_url: URL, migrated: str
) -> None:
    config = PgStoreConfig(schema=migrated, max_connections=1)
    async with await PgStore.connect(pg_url, config) as store:
        # The one pooled session now behaves like one on a demoted primary.
        async with store.engine.begin() as conn:
            await conn.execute(text("SET SESSION default_transaction_read_only = on"))
        with pytest.raises(UnavailableError) as caught:
            await store.commit(0, START_BASE, [submitted(1)], [])
        assert caught.value.reconnect
        assert "read-only" in str(caught.value)
        await store.commit(0, START_BASE, [submitted(1)], [])
        rows = await execute(store, "SELECT id FROM {s}.cronoq_tasks")
        assert [r.id for r in rows] == [1]


@pytest.mark.parametrize("shape", FENCED_BATCHES)
async def test_a_commit_waits_for_a_takeover_in_flight_and_is_fenced(
    store: PgStore, migrated: str, pg_url: URL, shape: str
) -> None:
    await store.commit(0, START_BASE, [submitted(1)], [])
    before = await snapshot(store)
    takeover = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        bump = takeover.transaction()
        await bump.start()
        await takeover.execute(f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
        batch, outputs = FENCED_BATCHES[shape]
        commit = asyncio.ensure_future(store.commit(0, START_BASE, batch, outputs))
        await until(
            lambda: commit.done() or blocked_by(pg_url, takeover.get_server_pid()),
            "the commit to wait on the leader row the takeover holds",
        )
        assert not commit.done()  # it waits on the leader row...
        await bump.commit()
        with pytest.raises(FencedError):  # ...and then sees the new epoch
            await commit
    finally:
        await takeover.close()
    tasks, schedules, [leader] = await snapshot(store)
    assert (tasks, schedules) == before[:2]
    assert (leader.epoch, leader.max_id) == (before[2][0].epoch + 1, before[2][0].max_id)


async def blocked_by(pg_url: URL, holder: int) -> bool:
    """Whether a session waits for a lock that the session ``holder`` holds."""
    rows = await admin_execute(
        pg_url,
        "SELECT count(*) AS n FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
        holder,
    )
    return bool(rows[0]["n"])


def pooled_closed(store: PgStore) -> bool:
    """Whether every connection in the store's pool has seen the server close it (asyncpg
    notices once the event loop reads the socket's end)."""
    pool: Any = store.engine.sync_engine.pool
    records = list(pool._pool._queue._queue)  # the pool's asyncio.Queue's entries
    return bool(records) and all(r.driver_connection.is_closed() for r in records)


async def session_states(pg_url: URL, application_name: str) -> list[tuple[int, str]]:
    rows = await admin_execute(
        pg_url,
        "SELECT pid, state FROM pg_stat_activity WHERE application_name = $1",
        application_name,
    )
    return [(r["pid"], r["state"]) for r in rows]


async def test_a_failed_commit_leaves_its_pooled_connection_clean_and_in_use(
    pg_url: URL, migrated: str
) -> None:
    name = f"cronoq-test-{migrated}"
    config = PgStoreConfig(schema=migrated, max_connections=1, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        await store.commit(0, START_BASE, [submitted(1, key="k")], [])
        [(pid, _)] = await session_states(pg_url, name)
        # A second live task with key "k": in a transaction, as one statement, by COPY.
        batches: list[list[Mutation]] = [
            [changed(1, RUNNING, 100), submitted(2, key="k")],
            [submitted(3, key="k")],
            # By COPY, which fails, rolls back and is written again by the insert.
            [submitted(n, key="k" if n == 3 else None) for n in range(3, 3 + COPY_MIN_ROWS)],
        ]
        for batch in batches:
            with pytest.raises(KeyTakenError, match="nothing of the batch") as caught:
                await store.commit(0, START_BASE, batch, [])
            assert caught.value.keys == ["k"]
            assert not caught.value.is_transient
            # The server's error left the session usable: it stays in the pool, idle.
            assert await session_states(pg_url, name) == [(pid, "idle")]
        await store.commit(0, START_BASE, [changed(1, SUCCEEDED, 100), submitted(2, key="k")], [])
    rows = await fetch_all(pg_url, migrated)
    assert [(r["id"], r["status"]) for r in rows] == [(1, "succeeded"), (2, "queued")]


async def test_a_pooled_connection_the_server_closed_is_replaced_at_checkout(
    pg_url: URL, migrated: str
) -> None:
    name = f"cronoq-test-{migrated}"
    config = PgStoreConfig(schema=migrated, max_connections=1, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        await store.commit(0, START_BASE, [submitted(1)], [])
        [(pid, _)] = await session_states(pg_url, name)
        assert await terminate_backend(pg_url, pid)
        await until(lambda: pooled_closed(store), "the event loop to read the closed socket")
        # No error: the dead connection is swapped for a new one before the commit runs.
        await store.commit(0, START_BASE, [submitted(2)], [])
        [(new_pid, _)] = await session_states(pg_url, name)
        assert new_pid != pid
    assert [r["id"] for r in await fetch_all(pg_url, migrated)] == [1, 2]


async def fetch_all(pg_url: URL, schema: str) -> list[asyncpg.Record]:
    return await admin_execute(
        pg_url, f'SELECT id, status FROM "{schema}".cronoq_tasks ORDER BY id'
    )


def varied_spec(n: int, nul: str = "\0") -> TaskSpec:
    """Every column in use, with NUL (stored as ``varied_spec(n, "\ufffd")``) and
    non-ASCII text, across a batch."""
    return TaskSpec(
        bytes([n % 256]) * (n % 7),
        kind=f"kind{nul}{n % 3}",
        pool=("io", "cpu")[n % 2],
        priority=Priority.HIGH if n % 5 == 0 else Priority.NORMAL,
        key=f"key-{n}-é" if n % 2 else None,
        deadline=n * 10 if n % 3 == 0 else None,
        fixed_start=FixedStart(n, timedelta(seconds=2), MissPolicy.RUN) if n % 11 == 0 else None,
        duration_hint=timedelta(milliseconds=n) if n % 4 == 0 else None,
        timeout=timedelta(seconds=n % 60 + 1) if n % 2 == 0 else None,
        retry=RetryPolicy(max_attempts=n % 4 + 1) if n % 3 == 1 else None,
        deps=(Dependency(TaskId(n - 1)), Dependency(f"key-{n - 2}")) if n % 10 == 0 else (),
        resources={f"gpu{nul}": n % 3 + 1} if n % 6 == 0 else {},
        tags=(f"t{nul}", f"n{n % 4}") if n % 2 == 0 else (),
        labels=("linux",) if n % 3 == 0 else (),
        tenant=f"tenant-{n % 5}" if n % 2 else None,
    )


async def test_a_large_batch_is_copied_and_stores_what_small_batches_store(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    count = COPY_MIN_ROWS + 20
    specs = {TaskId(n): varied_spec(n) for n in range(1, count + 1)}
    small: list[Mutation] = [submitted(i, s, arrival=i * 3) for i, s in specs.items() if i <= 10]
    large: list[Mutation] = [submitted(i, s, arrival=i * 3) for i, s in specs.items() if i > 10]
    large.append(changed(count, RUNNING, 100, message="patched in the copied row"))
    await store.commit(0, START_BASE, small, [])  # one statement, arrays
    assert store._commits.writer.path(fold(large, START_BASE, 0)) == "copy"
    await store.commit(0, START_BASE, large, [])  # a transaction, COPY into the table
    landed = await snapshot(store)
    await store.commit(0, START_BASE, large, [])  # a retry that already landed changes nothing
    assert await snapshot(store) == landed

    recovered = await store.recover(START_BASE)
    assert {t.id: t.spec for t in recovered.tasks} == {i: varied_spec(i, "\ufffd") for i in specs}
    assert recovered.next_id == count + 1  # the high-water mark was recorded
    [row] = await execute(
        store, "SELECT status, message FROM {s}.cronoq_tasks WHERE id = :id", id=count
    )
    assert tuple(row) == ("running", "patched in the copied row")


async def test_a_backend_terminated_mid_transaction_is_unavailable_and_retry_works(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    await store.commit(0, START_BASE, [submitted(1)], [])
    blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        hold = blocker.transaction()
        await hold.start()
        await blocker.execute(f'SELECT 1 FROM "{migrated}".cronoq_tasks WHERE id = 1 FOR UPDATE')
        batch: list[Mutation] = [changed(1, RUNNING, 100), submitted(2)]  # a transaction
        commit = asyncio.ensure_future(store.commit(0, START_BASE, batch, []))
        waiting: list[Any] = await until_value(
            lambda: admin_execute(
                pg_url,
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%UPDATE %cronoq_tasks%'",
            ),
            lambda rows: len(rows) == 1 or commit.done(),
            "the commit's update to wait for the row lock",
        )
        assert not commit.done(), commit
        [[pid]] = waiting
        assert await terminate_backend(pg_url, pid)
        with pytest.raises(UnavailableError):  # transient: the rollback's failure is not it
            await commit
        await hold.rollback()
    finally:
        await blocker.close()
    await store.commit(0, START_BASE, batch, [])
    rows = await execute(store, "SELECT id, status FROM {s}.cronoq_tasks ORDER BY id")
    assert [tuple(r) for r in rows] == [(1, "running"), (2, "queued")]


# --- commits commute: only forward, whatever the batching and however late a retry -----------


def copying_everything(store: PgStore) -> None:
    """Make ``store`` send every insert by COPY first, as it does from ``COPY_MIN_ROWS``
    rows."""
    store._commits.writer = BatchWriter(store.engine.dialect, store.config.schema, copy_min_rows=1)


async def states(store: PgStore) -> list[tuple[Any, ...]]:
    rows = await execute(
        store,
        "SELECT id, status, attempt, updated_unix_ns, message FROM {s}.cronoq_tasks ORDER BY id",
    )
    return [tuple(r) for r in rows]


async def test_a_submission_sent_again_with_a_later_transition_stores_it_through_copy(
    store: PgStore,
) -> None:
    """The contract suite's rule (tests/contract/test_commits.py), on the COPY path."""
    copying_everything(store)
    await store.commit(0, START_BASE, [submitted(1)], [])
    # [[S1], [S1, Succeeded1]] must end where [[S1], [S1], [Succeeded1]] ends.
    await store.commit(
        0, START_BASE, [submitted(1), changed(1, SUCCEEDED, 100, message="done")], []
    )
    assert await states(store) == [(1, "succeeded", 1, START_BASE.to_unix(100), "done")]


async def test_batches_delivered_again_late_never_move_a_task_backwards(store: PgStore) -> None:
    first: list[Mutation] = [submitted(1), submitted(2)]  # one statement: inserts only
    second = [changed(1, RUNNING, 10, message="started"), changed(2, RUNNING, 10)]  # updates only
    mixed = [*first, *second]  # a transaction: updates, then inserts
    third = [
        changed(1, SUCCEEDED, 20),
        changed(2, TaskStatus.RETRYING, 20, message="lost"),
        changed(2, RUNNING, 30, attempt=2),
    ]
    for batch in (first, second, third):
        await store.commit(0, START_BASE, batch, [])
    landed = await states(store)
    assert landed == [
        (1, "succeeded", 1, START_BASE.to_unix(20), "started"),
        (2, "running", 2, START_BASE.to_unix(30), "lost"),
    ]
    for late in (second, first, mixed, third, [changed(2, TaskStatus.RETRYING, 20, message="x")]):
        await store.commit(0, START_BASE, late, [])
        assert await states(store) == landed


async def test_a_copied_batch_sent_again_applies_forward_only_at_volume(store: PgStore) -> None:
    count = COPY_MIN_ROWS + 22
    ids = range(1, count + 1)
    await store.commit(0, START_BASE, [submitted(i) for i in ids], [])
    again: list[Mutation] = [submitted(i) for i in ids]
    again += [
        changed(i, SUCCEEDED if i % 2 else TaskStatus.FAILED, 50, message=f"m{i}") for i in ids
    ]
    await store.commit(0, START_BASE, again, [])  # COPY fails: every id is stored already
    landed = await states(store)
    assert landed == [
        (i, "succeeded" if i % 2 else "failed", 1, START_BASE.to_unix(50), f"m{i}") for i in ids
    ]
    late: list[Mutation] = [submitted(i) for i in ids]
    late += [changed(i, RUNNING, 40, message="late") for i in ids]
    await store.commit(0, START_BASE, late, [])
    assert await states(store) == landed


async def test_a_key_released_by_a_task_sent_again_is_reused_in_the_same_batch(
    store: PgStore,
) -> None:
    await store.commit(0, START_BASE, [submitted(1, key="k")], [])
    await store.commit(
        0,
        START_BASE,
        [submitted(1, key="k"), changed(1, SUCCEEDED, 100), submitted(2, key="k")],
        [],
    )
    rows = await execute(store, "SELECT id, key, status FROM {s}.cronoq_tasks ORDER BY id")
    assert [tuple(r) for r in rows] == [(1, "k", "succeeded"), (2, "k", "queued")]


@pytest.mark.parametrize("path", ["one-statement", "arrays", "copy"])
async def test_a_key_released_by_a_task_sent_again_after_its_new_holder_is_reused(
    store: PgStore, path: str
) -> None:
    if path == "copy":
        copying_everything(store)
    await store.commit(0, START_BASE, [submitted(1, key="a"), submitted(3)], [])
    # S1 is sent again after S2 takes its key: S1's transition rides in S1's insert row, so
    # S2's row reaches the live key index while S1 still holds the key in the store.
    batch: list[Mutation] = [
        changed(1, SUCCEEDED, 50),
        submitted(2, key="a"),
        submitted(1, key="a"),
    ]
    if path != "one-statement":
        batch.append(changed(3, RUNNING, 50))  # a stored task's update: a transaction
    await store.commit(0, START_BASE, batch, [])
    rows = await execute(store, "SELECT id, key, status FROM {s}.cronoq_tasks ORDER BY id")
    third = "queued" if path == "one-statement" else "running"
    assert [tuple(r) for r in rows] == [(1, "a", "succeeded"), (2, "a", "queued"), (3, None, third)]
    # Writing such a batch again does not hide a key really held: 2 holds "a", live.
    landed = await snapshot(store)
    with pytest.raises(KeyTakenError) as caught:
        await store.commit(0, START_BASE, [*batch, submitted(4, key="a")], [])
    assert caught.value.keys == ["a"]
    assert await snapshot(store) == landed


async def test_an_output_is_stored_only_for_a_task_that_ends_succeeded_through_copy(
    store: PgStore,
) -> None:
    """The contract suite's rule (tests/contract/test_commits.py), on the COPY path."""
    copying_everything(store)
    cancelled, failed = TaskStatus.CANCELLED, TaskStatus.FAILED
    await store.commit(0, START_BASE, [submitted(1), submitted(5)], [])
    batch: list[Mutation] = [
        changed(1, cancelled, 10),  # stored: an update, cancelled first, so final
        changed(1, SUCCEEDED, 20),
        submitted(2),  # new: an insert
        changed(2, failed, 20),
        submitted(3),
        changed(3, RUNNING, 20),
        submitted(4),
        changed(4, SUCCEEDED, 20),
        submitted(5),  # stored and sent again: the batch is written a second time
        changed(5, cancelled, 10),
        changed(5, SUCCEEDED, 20),
    ]
    await store.commit(0, START_BASE, batch, [(TaskId(i), b"OUT") for i in range(1, 6)])
    records = [await store.get_task(TaskId(i)) for i in range(1, 6)]
    assert [None if r is None else (r.status, r.output) for r in records] == [
        (cancelled, None),
        (failed, None),
        (RUNNING, None),
        (SUCCEEDED, b"OUT"),
        (cancelled, None),
    ]


async def test_an_audit_trigger_sees_each_copied_row_once_and_nothing_of_a_failed_copy(
    pg_url: URL, migrated: str
) -> None:
    """COPY fires the table's triggers, like the torture test's audit (a statement trigger
    with a transition table): a COPY that meets a stored id rolls back with what its
    trigger wrote, and the insert that writes the batch again records only new rows."""
    audit = f"{migrated}_audit"
    await admin_execute(pg_url, f"CREATE SCHEMA {audit}")
    try:
        await admin_execute(pg_url, f"CREATE TABLE {audit}.seen (id bigint, op text)")
        await admin_execute(
            pg_url,
            f"CREATE FUNCTION {audit}.record() RETURNS trigger LANGUAGE plpgsql "
            f"SET search_path = pg_catalog AS $$ BEGIN "
            f"INSERT INTO {audit}.seen SELECT n.id, TG_OP FROM new_rows n; RETURN NULL; END $$",
        )
        for op in ("INSERT", "UPDATE"):
            await admin_execute(
                pg_url,
                f'CREATE TRIGGER audit_{op.lower()} AFTER {op} ON "{migrated}".cronoq_tasks '
                f"REFERENCING NEW TABLE AS new_rows "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {audit}.record()",
            )
        config = PgStoreConfig(
            schema=migrated, trusted_triggers=frozenset({"audit_insert", "audit_update"})
        )
        first = [submitted(n) for n in range(1, 1 + COPY_MIN_ROWS)]
        second = [submitted(n) for n in range(1000, 1000 + COPY_MIN_ROWS)] + first[-1:]
        async with await PgStore.connect(pg_url, config) as store:
            await store.commit(0, START_BASE, first, [])  # by COPY
            await store.commit(0, START_BASE, first, [])  # COPY fails at once; nothing new
            await store.commit(0, START_BASE, second, [])  # COPY fails after the new rows
        seen = await admin_execute(pg_url, f"SELECT id, op FROM {audit}.seen ORDER BY id")
        assert [tuple(r) for r in seen] == [(m.id, "INSERT") for m in first + second[:-1]]
    finally:
        await admin_execute(pg_url, f"DROP SCHEMA {audit} CASCADE")


async def test_a_task_committed_alone_is_stored_as_in_a_batch(store: PgStore) -> None:
    """A batch of one task goes as scalar parameters, a larger one as arrays or COPY: every
    column is written the same way (a column missed or swapped would differ)."""
    full = dataclasses.replace(
        FULL_SPEC,
        payload=b"\x00payload",
        retry=RetryPolicy(max_attempts=3),
        deps=[Dependency(TaskId(5)), Dependency("other")],
    )
    batches = {
        1: [submitted(1, full, seq=7, arrival=8)],
        2: [submitted(2, full, seq=7, arrival=8, key="k2"), submitted(3)],
        100: [
            submitted(100, full, seq=7, arrival=8, key="k100"),
            *(submitted(n) for n in range(101, 100 + COPY_MIN_ROWS)),
        ],
    }
    for batch in batches.values():
        await store.commit(0, START_BASE, batch, [])
    rows = {
        r.id: r._mapping
        for r in await execute(store, "SELECT * FROM {s}.cronoq_tasks WHERE id IN (1, 2, 100)")
    }
    assert rows[1]["key"] == "key"
    same = {"id", "key", "updated_unix_ns"}
    for i in (2, 100):
        assert rows[i]["key"] == f"k{i}"
        assert {k: v for k, v in rows[i].items() if k not in same} == {
            k: v for k, v in rows[1].items() if k not in same
        }
