"""Every value the domain accepts can be stored, and comes back intact.

Values at the very edge of their column's range are committed and recovered; one past the
edge is refused when built (tests/test_domain.py lists each); a value that only leaves its
column once converted through the commit's ``TimeBase`` fails its own submission, never the
rest of its batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta

import pytest
from sqlalchemy.engine import URL

from cronoq_store._committer import GroupCommitter
from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Mutation,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store._results import RecoveredRecurring, RecoveredTerminal
from cronoq_store._store import PgStore

from .pgharness import admin_execute
from .support import (
    I32_MAX,
    I64_MAX,
    I64_MIN,
    START_BASE,
    LeaderRowHold,
    app_name,
    bump_epoch,
    open_store,
    stored_ids,
    waiting_on_lock,
)
from .waits import bounded, until

# Engine time is Unix time here, so engine times at the edge are stored at the edge.
SAME = TimeBase(engine_ns=0, unix_ns=0)
# A real base: engine time 0 is now, so engine times near 2**63 leave BIGINT as Unix ns.
# The longest duration a BIGINT of ns holds, to the microsecond a timedelta keeps.
LONGEST = timedelta(microseconds=I64_MAX // 1000)


async def test_values_at_the_edge_of_their_columns_are_stored_and_recovered(
    store: PgStore,
) -> None:
    top, low = TaskId(I64_MAX), TaskId(task_id(1, 0))
    spec = TaskSpec(
        b"edge",
        key="k\ud800ey",  # a lone surrogate: stored, like NUL, as U+FFFD
        deadline=I64_MAX,
        fixed_start=FixedStart(I64_MIN, LONGEST, MissPolicy.FAIL),
        duration_hint=LONGEST,
        timeout=timedelta(0),
        retry=RetryPolicy(max_attempts=I32_MAX, backoff=LONGEST, multiplier=1e308),
        deps=[Dependency(low), Dependency("\udfff")],
        resources={"cpu": I64_MAX, "gpu": 0, "a\x00": 1, "a": 2},
        tags=["\ud83d"],
        labels=["x\x00"],
        tenant="\udc00",
    )
    template = dataclasses.replace(
        spec, key=None, deadline=I64_MIN, fixed_start=FixedStart(I64_MAX)
    )
    schedule = RecurringSpec("edge \ud800", IntervalSchedule(LONGEST), template)
    other = RecurringSpec("low", CronSchedule("* * * * *"), TaskSpec(b""))
    batch: list[Mutation] = [
        Submitted(low, 0, I64_MIN, TaskSpec(b"")),
        StatusChanged(low, TaskStatus.FAILED, I32_MAX, I64_MIN, "\ud800 bad \x00"),
        Submitted(top, I64_MAX, I64_MAX, spec),
        StatusChanged(top, TaskStatus.RUNNING, I32_MAX, I64_MAX, "m\udfff"),
        RecurringUpsert(schedule),
        RecurringUpsert(other),
        RecurringNext(schedule.name, I64_MAX, top),
        RecurringNext(other.name, I64_MIN, TaskId(0)),
    ]
    await store.commit(0, SAME, batch, [(top, b"out")])

    recovered = await store.recover(SAME)
    [task] = recovered.tasks
    stored = dataclasses.replace(
        spec,
        key="k\ufffdey",
        deps=(Dependency(low), Dependency("\ufffd")),
        resources={"cpu": I64_MAX, "gpu": 0, "a\ufffd": 1, "a": 2},
        tags=("\ufffd",),
        labels=("x\ufffd",),
        tenant="\ufffd",
    )
    assert (task.id, task.seq, task.arrival, task.attempt, task.spec) == (
        top,
        I64_MAX,
        I64_MAX,
        I32_MAX,
        stored,
    )
    assert recovered.next_id == 2**63
    # The failed task is kept: the live one depends on it.
    assert recovered.terminal == [RecoveredTerminal(low, None, TaskStatus.FAILED, I64_MIN)]
    stored_template = dataclasses.replace(
        stored, key=None, deadline=I64_MIN, fixed_start=FixedStart(I64_MAX)
    )
    assert recovered.recurring == [
        RecoveredRecurring(
            RecurringSpec("edge \ufffd", IntervalSchedule(LONGEST), stored_template), I64_MAX, top
        ),
        RecoveredRecurring(other, I64_MIN, TaskId(0)),
    ]
    record = await store.get_task(low)
    assert record is not None
    assert (record.attempt, record.message) == (I32_MAX, "\ufffd bad \ufffd")
    record = await store.get_task("k\ud800ey")  # looked up by the same rule
    assert record is not None
    assert (record.id, record.message) == (top, "m\ufffd")


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (Submitted(TaskId(1), 0, I64_MAX, TaskSpec(b"")), "arrival"),
        (Submitted(TaskId(1), 0, 0, TaskSpec(b"", deadline=I64_MAX)), "deadline"),
        (
            Submitted(TaskId(1), 0, 0, TaskSpec(b"", fixed_start=FixedStart(I64_MAX))),
            "fixed_start.at",
        ),
        (StatusChanged(TaskId(1), TaskStatus.RUNNING, 1, I64_MAX), "at"),
        (RecurringNext("r", I64_MAX, None), "next"),
        (
            RecurringUpsert(
                RecurringSpec("r", IntervalSchedule(LONGEST), TaskSpec(b"", deadline=I64_MAX))
            ),
            "template.deadline",
        ),
    ],
)
async def test_a_time_beyond_bigint_through_the_base_is_refused_before_writing(
    store: PgStore, bad: Mutation, field: str
) -> None:
    good = Submitted(TaskId(2), 0, 0, TaskSpec(b""))
    with pytest.raises(ValueError, match=f"^{field}: engine time 9223372036854775807 is "):
        await store.commit(0, START_BASE, [good, bad], [])
    assert (await store.recover(START_BASE)).tasks == []


async def test_a_value_beyond_bigint_fails_only_its_own_submission(
    pg_url: URL, schema: str
) -> None:
    """Each value fits 64 bits when built; only converted through the committer's base does
    it leave BIGINT. The batch is split until just those submissions fail."""
    name = app_name(schema)
    async with open_store(pg_url, schema, application_name=name) as store:
        epoch = await bump_epoch(pg_url, schema)

        def submission(n: int) -> list[Mutation]:
            tid = task_id(epoch, n)
            deadline = I64_MAX if n == 3 else None
            sub = Submitted(tid, n, 0, TaskSpec(b"%d" % n, deadline=deadline))
            at = I64_MAX if n == 7 else 0
            return [sub, StatusChanged(tid, TaskStatus.RUNNING, 1, at)]

        committer = GroupCommitter(store, epoch, START_BASE)
        async with LeaderRowHold(pg_url, schema) as hold:
            first = asyncio.create_task(committer.submit(submission(0)))
            await until(lambda: waiting_on_lock(pg_url, name), "in flight")
            queued = [asyncio.create_task(committer.submit(submission(n))) for n in range(1, 11)]
            await asyncio.sleep(0.05)
            assert committer.stats().pending_submissions == 11
            await hold.release()
            await bounded(first, "the first submission")
            results = await bounded(
                asyncio.gather(*queued, return_exceptions=True), "the queued submissions"
            )
        await committer.close()

        failures = {n: r for n, r in zip(range(1, 11), results, strict=True) if r is not None}
        assert sorted(failures) == [3, 7], results
        assert isinstance(failures[3], ValueError)
        assert str(failures[3]).startswith("deadline: engine time 9223372036854775807 is ")
        assert isinstance(failures[7], ValueError)
        assert str(failures[7]).startswith("at: engine time 9223372036854775807 is ")
        assert committer.stats().splits >= 1
        expected = {task_id(epoch, n) for n in range(11) if n not in (3, 7)}
        assert set(await stored_ids(pg_url, schema)) == expected
        rows = await admin_execute(pg_url, f'SELECT DISTINCT status FROM "{schema}".cronoq_tasks')
        assert [r["status"] for r in rows] == ["running"]
