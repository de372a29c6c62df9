"""Recovery is total: whatever the rows hold, ``recover()`` completes.

Random valid tasks and schedules are committed through ``PgStore.commit``; raw SQL then
corrupts random columns of random rows (any JSONB, nested thousands deep included, any
in-range integer, odd text); recovery runs twice. Row by row: an untouched row comes back
exactly as submitted, a row that cannot be interpreted is quarantined once (or, for a
schedule, skipped and left as it is), a row whose odd values this build can still read
(a newer build's names, any priority) is recovered, and the second recovery changes
nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Mutation,
    Priority,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store._store import PgStore

from .support import I32_MAX, I32_MIN, I64_MAX, I64_MIN, START_BASE, execute

MAX_MESSAGE = 600

# Text the store keeps as it is (cleaning is tested elsewhere), so rows compare equal.
plain = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), max_size=8)
names = plain.filter(bool)
engine_times = st.integers(-(2**61), 2**61)
durations = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=10_000))
retries = st.builds(
    RetryPolicy,
    max_attempts=st.integers(1, I32_MAX),
    backoff=st.just(timedelta(seconds=1)),
    multiplier=st.floats(1, 1e6),
)
deps = st.builds(
    Dependency,
    target=st.integers(0, I64_MAX).map(TaskId) | names,
    condition=st.sampled_from(DependencyCondition),
)


def specs(key: str | None) -> st.SearchStrategy[TaskSpec]:
    return st.builds(
        TaskSpec,
        payload=st.binary(max_size=8),
        kind=plain,
        pool=names,
        priority=st.sampled_from(Priority),
        key=st.just(key),
        deadline=st.none() | engine_times,
        fixed_start=st.none()
        | st.builds(FixedStart, engine_times, durations, st.sampled_from(MissPolicy)),
        duration_hint=st.none() | durations,
        timeout=st.none() | durations,
        retry=st.none() | retries,
        deps=st.lists(deps, max_size=2),
        resources=st.dictionaries(names, st.integers(0, I64_MAX), max_size=2),
        tags=st.lists(plain, max_size=2),
        labels=st.lists(plain, max_size=2),
        tenant=st.none() | plain,
    )


class Effect(Enum):
    """What a corruption must lead to."""

    FATAL = "the row cannot be interpreted"
    BENIGN = "the row still decodes"
    EITHER = "depends on the value"


@dataclass(frozen=True)
class Corruption:
    column: str
    value: object  # bound as the column's type; JSON columns take text cast to jsonb
    effect: Effect

    def __repr__(self) -> str:
        shown = repr(self.value)
        shown = shown if len(shown) < 80 else f"{shown[:60]}... ({len(shown)} chars)"
        return f"Corruption({self.column}={shown}, {self.effect.name})"


def deep_json(depth: int, shape: str) -> str:
    if shape == "array":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


deep = st.builds(deep_json, st.integers(1000, 4000), st.sampled_from(["array", "object"]))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | plain,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(plain, inner, max_size=3),
    max_leaves=8,
).map(json.dumps)
odd_json = st.sampled_from(
    [
        "1e400",
        "[1e400]",
        '{"cpu": 1e400}',
        '[{"id": 1e400}]',
        f'[{{"id": {2**63}}}]',
        f'{{"max_attempts": {2**40}}}',
        '{"multiplier": 1e400}',
        '[{"key": "k", "on": "someday"}]',
        "-0",
        '""',
        "null",
    ]
)


@st.composite
def task_corruptions(draw: st.DrawFn, id: int) -> Corruption:
    column = draw(
        st.sampled_from(
            [
                "retry", "deps", "resources", "tags", "labels", "seq", "arrival_unix_ns",
                "priority", "deadline_unix_ns", "fixed_at_unix_ns", "fixed_tolerance_ns",
                "duration_hint_ns", "timeout_ns", "attempt", "pool", "kind", "key",
                "fixed_on_miss", "status", "tenant", "message", "payload",
            ]
        )
    )  # fmt: skip
    bigint = st.integers(I64_MIN, I64_MAX)
    if column in ("retry", "deps", "resources", "tags", "labels"):
        value = draw(deep)
        if draw(st.booleans()):  # deep inside a shape that is right at the top
            value = {
                "retry": f'{{"max_attempts": {value}}}',
                "deps": f'[{{"id": {value}}}]',
                "resources": f'{{"cpu": {value}}}',
                "tags": f"[{value}]",
                "labels": f'["x", {value}]',
            }[column]
        if draw(st.booleans()):
            return Corruption(column, draw(json_values | odd_json), Effect.EITHER)
        if column == "retry" and value.startswith('{"a"'):
            # A policy whose members are all unknown (and deep) is the default policy, if
            # the parser gets through it (how deep it goes depends on the free stack).
            return Corruption(column, value, Effect.EITHER)
        return Corruption(column, value, Effect.FATAL)
    if column == "seq":
        seq = draw(bigint)
        return Corruption(column, seq, Effect.FATAL if seq < 0 else Effect.BENIGN)
    if column in ("arrival_unix_ns", "deadline_unix_ns"):
        at = draw(bigint if column == "arrival_unix_ns" else st.none() | bigint)
        return Corruption(column, at, Effect.BENIGN)  # saturated: no stored time is refused
    if column == "fixed_at_unix_ns":  # only read with a fixed start, which may be absent
        return Corruption(column, draw(st.none() | bigint), Effect.EITHER)
    if column in ("fixed_tolerance_ns", "duration_hint_ns", "timeout_ns"):
        ns = draw(st.none() | bigint)
        if column == "fixed_tolerance_ns":
            return Corruption(column, ns, Effect.EITHER)
        return Corruption(column, ns, Effect.FATAL if ns is not None and ns < 0 else Effect.BENIGN)
    if column == "priority":
        return Corruption(column, draw(st.integers(-(2**15), 2**15 - 1)), Effect.BENIGN)
    if column == "attempt":
        return Corruption(column, draw(st.integers(I32_MIN, I32_MAX)), Effect.BENIGN)
    if column == "pool":
        pool = draw(plain | st.just("x" * 10_000))
        return Corruption(column, pool, Effect.BENIGN if pool else Effect.FATAL)
    if column == "key":  # unique per row: live keys are unique, so one row may hold ""
        key = draw(st.sampled_from([None, f"odd key {id} \ufffd", *([""] if id == 1 else [])]))
        return Corruption(column, key, Effect.FATAL if key == "" else Effect.BENIGN)
    if column == "fixed_on_miss":  # a newer build's name reads as the default
        return Corruption(column, draw(st.none() | plain), Effect.BENIGN)
    if column == "status":
        status = draw(st.sampled_from(["queued", "running", "retrying", "succeeded", "paused"]))
        # A name this build does not know is a newer build's live status; a finished one on
        # a live row cannot be interpreted.
        live = status != "succeeded"
        return Corruption(column, status, Effect.BENIGN if live else Effect.FATAL)
    if column == "payload":
        return Corruption(column, draw(st.binary(max_size=16)), Effect.BENIGN)
    # kind, tenant, message: any text will do (kind is NOT NULL)
    values = plain if column == "kind" else st.none() | plain
    return Corruption(column, draw(values), Effect.BENIGN)


@st.composite
def schedule_corruptions(draw: st.DrawFn, name: str) -> Corruption:
    column = draw(st.sampled_from(["spec", "next_unix_ns", "last_task_id", "template_payload"]))
    if column == "spec":
        if draw(st.booleans()):
            return Corruption(column, draw(deep), Effect.FATAL)
        wrapped = draw(deep)
        if draw(st.booleans()):
            return Corruption(column, f'{{"schedule": {wrapped}, "template": {{}}}}', Effect.FATAL)
        return Corruption(column, draw(json_values | odd_json), Effect.EITHER)
    if column == "next_unix_ns":
        at = draw(st.none() | st.integers(I64_MIN, I64_MAX))
        return Corruption(column, at, Effect.BENIGN)  # saturated: no stored time is refused
    if column == "last_task_id":
        last = draw(st.none() | st.integers(I64_MIN, I64_MAX))
        return Corruption(
            column, last, Effect.FATAL if last is not None and last < 0 else Effect.BENIGN
        )
    return Corruption(column, draw(st.binary(max_size=16)), Effect.BENIGN)


@dataclass(frozen=True)
class Task:
    submitted: Submitted
    transition: StatusChanged | None

    @property
    def live(self) -> bool:
        return self.transition is None or not self.transition.status.is_terminal


@st.composite
def tasks(draw: st.DrawFn, id: int) -> Task:
    key = f"key {id}" if draw(st.booleans()) else None
    sub = Submitted(TaskId(id), draw(st.integers(0, I64_MAX)), draw(engine_times), draw(specs(key)))
    status = draw(st.none() | st.sampled_from(TaskStatus))
    if status is None:
        return Task(sub, None)
    # Finished tasks changed within the last minute: inside the retention window.
    at = draw(st.integers(-(60 * 10**9), 0))
    return Task(sub, StatusChanged(TaskId(id), status, draw(st.integers(0, I32_MAX)), at, None))


schedule_specs = st.builds(
    RecurringSpec,
    name=st.just("r"),
    schedule=st.builds(CronSchedule, st.just("0 * * * *"), st.sampled_from(["UTC", "Asia/Tokyo"]))
    | st.builds(IntervalSchedule, durations.filter(bool)),
    template=specs(None),
)


async def corrupt(store: PgStore, table: str, where: str, key: object, c: Corruption) -> None:
    value = "CAST(:v AS jsonb)" if c.column in JSON_COLUMNS else ":v"
    await execute(
        store, f"UPDATE {{s}}.{table} SET {c.column} = {value} WHERE {where} = :k", v=c.value, k=key
    )


JSON_COLUMNS = frozenset({"retry", "deps", "resources", "tags", "labels", "spec"})


async def snapshot(store: PgStore, table: str, order: str) -> list[str]:
    """Every row as PostgreSQL prints it (jsonb as text: the driver's decoder would recurse)."""
    rows = await execute(store, f"SELECT r::text FROM {{s}}.{table} r ORDER BY {order}")
    return [r[0] for r in rows]


async def rows_by_id(store: PgStore) -> dict[int, Any]:
    rows = await execute(
        store, "SELECT id, status, terminal, message, key, r::text AS whole FROM {s}.cronoq_tasks r"
    )
    return {r.id: r for r in rows}


def verdict(corruptions: list[Corruption]) -> Effect | None:
    """None for an untouched row, else what its corruptions together must lead to."""
    if not corruptions:
        return None
    last = {c.column: c for c in corruptions}  # a later update of a column wins
    effects = {c.effect for c in last.values()}
    for effect in (Effect.FATAL, Effect.EITHER):
        if effect in effects:
            return effect
    return Effect.BENIGN


@settings(
    max_examples=80,  # about 10 s
    # No shrinking: each example is a few commits and recoveries against the server, and
    # the failing example is reported as drawn (every draw is labelled).
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(data=st.data())
async def test_recovery_is_total_whatever_the_rows_hold(
    store: PgStore, caplog: pytest.LogCaptureFixture, data: st.DataObject
) -> None:
    await execute(store, "TRUNCATE {s}.cronoq_tasks, {s}.cronoq_recurring")
    count = data.draw(st.integers(1, 6), "tasks")
    all_tasks = [data.draw(tasks(id), f"task {id}") for id in range(1, count + 1)]
    schedules = [
        RecurringSpec(f"r{i}", spec.schedule, spec.template)
        for i, spec in enumerate(data.draw(st.lists(schedule_specs, max_size=3), "schedules"))
    ]
    batch: list[Mutation] = [t.submitted for t in all_tasks]
    batch += [t.transition for t in all_tasks if t.transition is not None]
    batch += [RecurringUpsert(s) for s in schedules]
    batch += [RecurringNext(s.name, 1000 * i, TaskId(i)) for i, s in enumerate(schedules)]
    await store.commit(0, START_BASE, batch, [])

    live = [t for t in all_tasks if t.live]
    task_damage: dict[int, list[Corruption]] = {}
    for t in live:
        if data.draw(st.booleans(), f"corrupt task {t.submitted.id}?"):
            task_damage[t.submitted.id] = data.draw(
                st.lists(task_corruptions(t.submitted.id), min_size=1, max_size=3),
                f"corruptions of task {t.submitted.id}",
            )
    schedule_damage: dict[str, list[Corruption]] = {}
    for s in schedules:
        if data.draw(st.booleans(), f"corrupt schedule {s.name}?"):
            schedule_damage[s.name] = data.draw(
                st.lists(schedule_corruptions(s.name), min_size=1, max_size=2),
                f"corruptions of schedule {s.name}",
            )
    for id, corruptions in task_damage.items():
        for c in corruptions:
            await corrupt(store, "cronoq_tasks", "id", id, c)
    for name, corruptions in schedule_damage.items():
        for c in corruptions:
            await corrupt(store, "cronoq_recurring", "name", name, c)
    before = await rows_by_id(store)
    schedules_before = await snapshot(store, "cronoq_recurring", "name")

    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="cronoq_store"):
        first = await store.recover(START_BASE)
    quarantine_logs = [r.task_id for r in caplog.records if hasattr(r, "task_id")]

    recovered = {t.id: t for t in first.tasks}
    terminal = {t.id: t for t in first.terminal}
    assert len(terminal) == len(first.terminal)  # each finished task once
    after = await rows_by_id(store)
    quarantined: set[int] = set()
    for t in all_tasks:
        id = t.submitted.id
        row = after[id]
        effect = verdict(task_damage.get(id, []))
        if not t.live:  # finished and never touched: as committed, reported as finished
            assert row.whole == before[id].whole
            assert id in terminal
            assert id not in recovered
            continue
        if effect is None:
            task = recovered[id]
            assert (task.seq, task.arrival, task.spec) == (
                t.submitted.seq,
                t.submitted.arrival,
                t.submitted.spec,
            )
            assert task.attempt == (0 if t.transition is None else t.transition.attempt)
            assert row.whole == before[id].whole
            continue
        if effect is Effect.BENIGN:
            assert id in recovered, (task_damage[id], row.message)
        if effect is Effect.FATAL:
            assert id not in recovered, task_damage[id]
        if id in recovered:
            assert row.whole == before[id].whole
            continue
        quarantined.add(id)
        assert (row.status, row.terminal) == ("failed", True)
        assert row.message.startswith("corrupt task row: "), row.message
        assert len(row.message) <= MAX_MESSAGE
        assert terminal[id].status is TaskStatus.FAILED
        assert terminal[id].key == row.key
    assert sorted(quarantine_logs) == sorted(quarantined)  # logged once per quarantined row

    by_name = {r.spec.name: r for r in first.recurring}
    for i, s in enumerate(schedules):
        effect = verdict(schedule_damage.get(s.name, []))
        if effect is None:
            assert (by_name[s.name].spec, by_name[s.name].next, by_name[s.name].last) == (
                s,
                1000 * i,
                i,
            )
        elif effect is Effect.BENIGN:
            assert s.name in by_name, schedule_damage[s.name]
        elif effect is Effect.FATAL:
            assert s.name not in by_name, schedule_damage[s.name]
    # Skipped schedules are left as they were: recovery writes nothing there.
    assert await snapshot(store, "cronoq_recurring", "name") == schedules_before

    # A second recovery is stable: the same live tasks, no new quarantine, nothing written.
    tasks_after_first = await snapshot(store, "cronoq_tasks", "id")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="cronoq_store"):
        second = await store.recover(START_BASE)
    assert [r for r in caplog.records if r.name == "cronoq_store" and hasattr(r, "task_id")] == []
    assert second.tasks == first.tasks
    assert second.recurring == first.recurring
    assert {t.id: t for t in second.terminal} == terminal
    assert await snapshot(store, "cronoq_tasks", "id") == tasks_after_first
