"""Recovery: what a new leader loads, and how it survives rows it cannot read."""

from __future__ import annotations

import gc
import logging
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import _recovery as recovery
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    MissPolicy,
    Priority,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    TaskId,
    TaskSpec,
    TimeBase,
)
from cronoq_store._errors import StoreError
from cronoq_store._schema import LiveTasks
from cronoq_store._store import PgStore

from .support import FAILED, RUNNING, START_BASE, changed, execute, submitted

CORRUPTIONS = {
    # task id: (column assignment, what the quarantine message must say)
    2: ('deps = \'[{"id": "seven"}]\'', "deps[0].id: expected a task id"),
    3: ('deps = \'{"not": "an array"}\'', "deps: expected an array"),
    4: ("status = 'succeeded'", "status: 'succeeded' is the status of a finished task"),
    5: ("fixed_at_unix_ns = 1, fixed_tolerance_ns = -5", "tolerance: must be a non-negative"),
    6: ("retry = '{\"max_attempts\": 0}'", "retry.max_attempts"),
    7: ("tags = '[1]'", "tags[0]: expected a string"),
    8: ("pool = ''", "pool: must be a non-empty string"),
}


async def test_corrupt_rows_are_quarantined_and_the_rest_recovers(
    store: PgStore, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [1, *CORRUPTIONS, 9]
    await store.commit(
        0, START_BASE, [submitted(i, key=f"k{i}", deps=[Dependency("k99")]) for i in ids], []
    )
    for id, (assignment, _) in CORRUPTIONS.items():
        await execute(store, f"UPDATE {{s}}.cronoq_tasks SET {assignment} WHERE id = {id}")

    with caplog.at_level(logging.ERROR, logger="cronoq_store"):
        recovered = await store.recover(START_BASE)

    assert [t.id for t in recovered.tasks] == [1, 9]
    quarantined = [t for t in recovered.terminal if t.status is FAILED]
    assert [(t.id, t.key) for t in quarantined] == [(i, f"k{i}") for i in CORRUPTIONS]
    logged = sorted(getattr(r, "task_id", -1) for r in caplog.records)
    assert logged == list(CORRUPTIONS)

    rows = await execute(
        store, "SELECT id, status, terminal, message FROM {s}.cronoq_tasks ORDER BY id"
    )
    for row in rows:
        if row.id in CORRUPTIONS:
            assert (row.status, row.terminal) == ("failed", True)
            assert row.message.startswith("corrupt task row: ")
            assert CORRUPTIONS[row.id][1] in row.message, row.message
        else:
            assert (row.status, row.terminal, row.message) == ("queued", False, None)

    # The quarantined rows are ordinary failed tasks now: the next recovery is clean.
    caplog.clear()
    again = await store.recover(START_BASE)
    assert [t.id for t in again.tasks] == [1, 9]
    assert [r for r in caplog.records if r.name == "cronoq_store"] == []


async def test_names_from_a_newer_build_read_as_defaults_not_corruption(
    store: PgStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The original's forward compatibility: an enum-like value this build does not know
    decodes to its documented default, and the task keeps running."""
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1, fixed_start=FixedStart(5, on_miss=MissPolicy.FAIL)),
            submitted(2, deps=[Dependency(TaskId(1), DependencyCondition.FINISHED)]),
            submitted(3, priority=Priority.HIGH),
            submitted(4),
            changed(4, RUNNING, attempt=3),
        ],
        [],
    )
    # A live status this build does not know: the task stays live, with its attempt.
    await execute(store, "UPDATE {s}.cronoq_tasks SET status = 'paused' WHERE id = 4")
    await execute(store, "UPDATE {s}.cronoq_tasks SET fixed_on_miss = 'defer' WHERE id = 1")
    await execute(
        store,
        'UPDATE {s}.cronoq_tasks SET deps = \'[{"id": 1, "on": "started"}]\' WHERE id = 2',
    )
    await execute(store, "UPDATE {s}.cronoq_tasks SET priority = 9 WHERE id = 3")
    with caplog.at_level(logging.WARNING, logger="cronoq_store"):
        recovered = await store.recover(START_BASE)
    assert [r for r in caplog.records if r.name == "cronoq_store"] == []
    specs = {t.id: t.spec for t in recovered.tasks}
    assert specs[TaskId(1)].fixed_start == FixedStart(5, on_miss=MissPolicy.SKIP)
    assert specs[TaskId(2)].deps == (Dependency(TaskId(1), DependencyCondition.SUCCEEDED),)
    assert specs[TaskId(3)].priority is Priority.NORMAL
    assert [(t.id, t.attempt) for t in recovered.tasks if t.id == 4] == [(4, 3)]
    assert recovered.terminal == []


async def test_undecodable_schedule_is_skipped_and_left_in_place(
    store: PgStore, caplog: pytest.LogCaptureFixture
) -> None:
    good = RecurringSpec("good", CronSchedule("0 * * * *", "Europe/Paris"), TaskSpec(b"t"))
    bad = RecurringSpec("bad", CronSchedule("0 * * * *"), TaskSpec(b"t"))
    await store.commit(
        0,
        START_BASE,
        [RecurringUpsert(good), RecurringUpsert(bad), RecurringNext("good", 77, TaskId(5))],
        [],
    )
    await execute(
        store,
        "UPDATE {s}.cronoq_recurring SET spec = jsonb_set(spec, '{schedule,type}', '\"lunar\"')"
        " WHERE name = 'bad'",
    )
    with caplog.at_level(logging.ERROR, logger="cronoq_store"):
        recovered = await store.recover(START_BASE)
    assert [(r.spec, r.next, r.last) for r in recovered.recurring] == [(good, 77, 5)]
    [record] = caplog.records
    assert getattr(record, "schedule", None) == "bad"
    assert "lunar" in getattr(record, "error", "")
    rows = await execute(store, "SELECT name FROM {s}.cronoq_recurring ORDER BY name")
    assert [r.name for r in rows] == ["bad", "good"]


async def test_values_that_repeat_are_one_object_shared_by_the_recovered_tasks(
    store: PgStore,
) -> None:
    """A million recovered tasks stay in memory together: equal strings and equal immutable
    options are kept once, not once per task; each spec keeps its own resources dict."""
    options: dict[str, Any] = {
        "kind": "mail",
        "pool": "email",
        "tenant": "acme",
        "timeout": timedelta(seconds=30),
        "retry": RetryPolicy(max_attempts=4),
        "tags": ("a", "b"),
        "resources": {"cpu": 1},
    }
    await store.commit(0, START_BASE, [submitted(i, **options) for i in (1, 2)], [])
    a, b = (await store.recover(START_BASE)).tasks
    for name, value in options.items():
        assert getattr(a.spec, name) == getattr(b.spec, name) == value, name
        if name != "resources":
            assert getattr(a.spec, name) is getattr(b.spec, name), name
    assert a.spec.resources is not b.spec.resources


async def test_a_corrupt_value_stored_by_several_rows_quarantines_each_of_them(
    store: PgStore,
) -> None:
    await store.commit(0, START_BASE, [submitted(i, retry=RetryPolicy()) for i in (1, 2, 3)], [])
    await execute(
        store, "UPDATE {s}.cronoq_tasks SET retry = '{\"max_attempts\": 0}' WHERE id <> 2"
    )
    recovered = await store.recover(START_BASE)
    assert [t.id for t in recovered.tasks] == [2]
    assert [t.id for t in recovered.terminal if t.status is FAILED] == [1, 3]


async def test_live_tasks_are_read_partition_by_partition_in_id_order(
    store: PgStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recovery, "RECOVERY_PARTITION", 2)
    await store.commit(0, START_BASE, [submitted(i) for i in range(1, 8)], [])
    await execute(store, "UPDATE {s}.cronoq_tasks SET pool = '' WHERE id = 4")
    recovered = await store.recover(START_BASE)
    assert [t.id for t in recovered.tasks] == [1, 2, 3, 5, 6, 7]
    assert [t.id for t in recovered.terminal] == [4]


async def test_a_recovery_that_fails_midway_turns_the_collector_back_on(
    store: PgStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.commit(0, START_BASE, [submitted(1)], [])
    assert gc.isenabled()
    monkeypatch.setattr(recovery, "RECOVERY_PARTITION", -1)  # the driver refuses to fetch
    with pytest.raises(StoreError):
        await store.recover(START_BASE)
    assert gc.isenabled()
    monkeypatch.undo()
    assert [t.id for t in (await store.recover(START_BASE)).tasks] == [1]
    assert gc.isenabled()


@pytest.mark.parametrize(
    "column", ["deadline_unix_ns", "fixed_at_unix_ns", "arrival_unix_ns", "next_unix_ns"]
)
@pytest.mark.parametrize("stored", [2**63 - 1, -(2**63)])
async def test_a_reader_whose_wall_clock_is_near_1970_quarantines_no_valid_row(
    store: PgStore, column: str, stored: int
) -> None:
    """A machine without a real-time clock boots near 1970: engine time (its uptime) is then
    larger than Unix time, and a stored BIGINT time at its bound is beyond the engine's 64
    bits. The row is valid whatever the reader's clock: it is read with that bound, never
    quarantined (which would rewrite it as failed, permanently)."""
    schedule = RecurringSpec("s", CronSchedule("* * * * *"), TaskSpec(b"t"))
    await store.commit(
        0,
        START_BASE,
        [submitted(1, deadline=1, fixed_start=FixedStart(at=1)), RecurringUpsert(schedule)],
        [],
    )
    await store.commit(0, START_BASE, [RecurringNext("s", 1, None)], [])
    table = "cronoq_recurring" if column == "next_unix_ns" else "cronoq_tasks"
    await execute(store, f"UPDATE {{s}}.{table} SET {column} = {stored}")
    uptime = 10 * 86400 * 10**9
    for behind in (
        TimeBase(engine_ns=uptime, unix_ns=10**9),
        TimeBase(engine_ns=-uptime, unix_ns=START_BASE.unix_ns),
    ):
        recovered = await store.recover(behind)
        [task] = recovered.tasks
        [recurring] = recovered.recurring
        bound = 2**63 - 1 if stored > 0 else -(2**63)
        read = {
            "deadline_unix_ns": task.spec.deadline,
            "fixed_at_unix_ns": task.spec.fixed_start and task.spec.fixed_start.at,
            "arrival_unix_ns": task.arrival,
            "next_unix_ns": recurring.next,
        }[column]
        assert read in (bound, behind.from_unix(stored))
        assert -(2**63) <= read <= 2**63 - 1
    record = await store.get_task(TaskId(1))
    assert record is not None
    assert (record.status, record.message) == (None, None)  # still queued, not quarantined


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_recovery_outlasts_session_timeout_between_two_partitions(
    pg_url: URL, engine: AsyncEngine, migrated: str, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """Decoding a partition may take longer than ``session_timeout`` (a loaded machine, wide
    rows, 200,000 tasks): the cursor's transaction then sits idle that long. It takes no
    lock a takeover waits for, so its idle limit is the store's own."""
    config = PgStoreConfig(schema=migrated, session_timeout=0.3, keepalive=0.1, lock_poll=0.05)
    monkeypatch.setattr(recovery, "RECOVERY_PARTITION", 100)
    busy = [3 * config.session_timeout]

    def slow(base: TimeBase) -> SimpleNamespace:
        decode = LiveTasks(base).decode

        def decoding(*row: Any) -> Any:
            if busy and row[0] == 101:  # the first row of the second partition
                time.sleep(busy.pop())  # the client's own work, between two fetches
            return decode(*row)

        return SimpleNamespace(decode=decoding)

    monkeypatch.setattr(recovery, "LiveTasks", slow)
    opened = PgStore.from_engine(engine, config) if shared else PgStore.connect(pg_url, config)
    async with await opened as store:
        await store.commit(0, START_BASE, [submitted(i) for i in range(1, 351)], [])
        recovered = await store.recover(START_BASE)
    assert busy == []
    assert [t.id for t in recovered.tasks] == list(range(1, 351))
