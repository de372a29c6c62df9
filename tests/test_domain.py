"""The domain model: id layout, stored-name decoding, time conversion and validation."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cronoq_store._domain import (
    EPOCH_MAX,
    EPOCH_MIN,
    ID_COUNTER_BITS,
    LIVE_STATUS_NAMES,
    QUEUED,
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    epoch_of,
    task_id,
)

from .support import I32_MAX, I64_MAX, I64_MIN

COUNTER_MAX = 2**48 - 1


@pytest.mark.parametrize(
    ("epoch", "n", "expected"),
    [
        (EPOCH_MIN, 0, 1 << 48),
        (EPOCH_MIN, COUNTER_MAX, (1 << 49) - 1),
        (7, 12345, 7 * 2**48 + 12345),
        (EPOCH_MAX, 0, 32767 << 48),
        (EPOCH_MAX, COUNTER_MAX, 2**63 - 1),
    ],
)
def test_task_id_layout(epoch: int, n: int, expected: int) -> None:
    tid = task_id(epoch, n)
    assert tid == expected
    assert epoch_of(tid) == epoch
    assert tid & COUNTER_MAX == n


def test_id_constants() -> None:
    assert (EPOCH_MIN, EPOCH_MAX, ID_COUNTER_BITS) == (1, 32767, 48)
    # The largest id still fits a signed BIGINT.
    assert task_id(EPOCH_MAX, COUNTER_MAX) == 2**63 - 1


@pytest.mark.parametrize(
    ("epoch", "n", "message"),
    [
        (0, 0, "epoch: must be in 1..32767, got 0"),
        (-1, 0, "epoch: must be in 1..32767, got -1"),
        (EPOCH_MAX + 1, 0, "epoch: must be in 1..32767, got 32768"),
        (1, -1, "n: must be in 0..2**48-1, got -1"),
        (1, COUNTER_MAX + 1, f"n: must be in 0..2**48-1, got {2**48}"),
    ],
)
def test_task_id_rejects_out_of_range(epoch: int, n: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        task_id(epoch, n)


@given(st.integers(EPOCH_MIN, EPOCH_MAX), st.integers(0, COUNTER_MAX))
def test_epoch_of_inverts_task_id(epoch: int, n: int) -> None:
    tid = task_id(epoch, n)
    assert epoch_of(tid) == epoch
    assert 0 < tid < 2**63


@pytest.mark.parametrize("priority", list(Priority))
def test_priority_from_stored_known(priority: Priority) -> None:
    assert Priority.from_stored(priority.value) is priority


@pytest.mark.parametrize("value", [-1, 4, 99, 32767])
def test_priority_from_stored_unknown_is_normal(value: int) -> None:
    assert Priority.from_stored(value) is Priority.NORMAL


def test_priority_values_are_stored_values() -> None:
    assert [(p.name, p.value) for p in Priority] == [
        ("LOW", 0),
        ("NORMAL", 1),
        ("HIGH", 2),
        ("CRITICAL", 3),
    ]


@pytest.mark.parametrize("status", list(TaskStatus))
def test_task_status_from_stored_known(status: TaskStatus) -> None:
    assert TaskStatus.from_stored(status.value) is status


@pytest.mark.parametrize("name", [QUEUED, "", "RUNNING", "done", "succeeded "])
def test_task_status_from_stored_unknown_is_none(name: str) -> None:
    assert TaskStatus.from_stored(name) is None


def test_terminal_statuses() -> None:
    terminal = {s.value for s in TaskStatus if s.is_terminal}
    assert terminal == {"succeeded", "failed", "cancelled", "skipped", "expired"}


def test_live_status_names_are_queued_and_non_terminal() -> None:
    assert QUEUED == "queued"
    assert {s.value for s in TaskStatus if not s.is_terminal} | {QUEUED} == LIVE_STATUS_NAMES
    assert {"queued", "running", "retrying"} == LIVE_STATUS_NAMES


@given(st.integers(-(2**64), 2**64), st.integers(-(2**64), 2**64), st.integers(-(2**64), 2**64))
def test_time_base_round_trip(engine: int, unix: int, t: int) -> None:
    base = TimeBase(engine, unix)
    assert base.from_unix(base.to_unix(t)) == t
    assert base.to_unix(base.from_unix(t)) == t
    assert base.to_unix(engine) == unix
    assert base.to_unix(t + 5) - base.to_unix(t) == 5


def test_time_base_now_pairs_monotonic_and_wall_clock() -> None:
    before_wall, before_mono = time.time_ns(), time.monotonic_ns()
    base = TimeBase.now()
    after_wall, after_mono = time.time_ns(), time.monotonic_ns()
    assert before_mono <= base.engine_ns <= after_mono
    assert before_wall <= base.unix_ns <= after_wall


def test_task_spec_defaults() -> None:
    spec = TaskSpec(b"p")
    assert spec.payload == b"p"
    assert (spec.kind, spec.pool, spec.priority) == ("", "default", Priority.NORMAL)
    optional = [spec.key, spec.deadline, spec.fixed_start, spec.retry, spec.tenant]
    assert optional == [None] * 5
    assert spec.duration_hint is None
    assert spec.timeout is None
    assert (spec.deps, spec.tags, spec.labels, spec.resources) == ((), (), (), {})


def test_task_spec_payload_is_the_only_positional_field() -> None:
    with pytest.raises(TypeError):
        TaskSpec(b"", "kind")  # type: ignore[call-arg]


def test_task_spec_normalises_collections() -> None:
    source = {"cpu": 2}
    spec = TaskSpec(
        bytearray(b"ab"),  # type: ignore[arg-type]
        deps=[Dependency(TaskId(1)), Dependency("k")],
        tags=["a", "b"],
        labels=(x for x in ["gpu"]),  # type: ignore[arg-type]
        resources=source,
        priority=3,  # type: ignore[arg-type]
    )
    assert type(spec.payload) is bytes
    assert spec.payload == b"ab"
    assert spec.deps == (Dependency(TaskId(1)), Dependency("k"))
    assert spec.tags == ("a", "b")
    assert spec.labels == ("gpu",)
    assert spec.priority is Priority.CRITICAL
    source["cpu"] = 5  # the spec holds its own copy
    assert spec.resources == {"cpu": 2}
    assert TaskSpec(memoryview(b"xy")).payload == b"xy"  # type: ignore[arg-type]


def test_task_spec_is_frozen_and_hashable() -> None:
    spec = TaskSpec(b"", resources={"cpu": 1}, deps=[Dependency(TaskId(3))])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.pool = "other"  # type: ignore[misc]
    same = TaskSpec(b"", resources={"cpu": 1}, deps=(Dependency(TaskId(3)),))
    assert spec == same
    assert hash(spec) == hash(same)
    assert spec != TaskSpec(b"", resources={"cpu": 2}, deps=[Dependency(TaskId(3))])


def test_retry_policy_defaults_and_float_multiplier() -> None:
    retry = RetryPolicy()
    assert retry == RetryPolicy(3, timedelta(seconds=1), None, 2.0)
    coerced = RetryPolicy(multiplier=3)
    assert type(coerced.multiplier) is float
    assert coerced.multiplier == 3.0


def test_fixed_start_and_dependency_defaults() -> None:
    fixed = FixedStart(10)
    assert (fixed.tolerance, fixed.on_miss) == (timedelta(seconds=1), MissPolicy.SKIP)
    assert Dependency(TaskId(5)).condition is DependencyCondition.SUCCEEDED
    assert CronSchedule("* * * * *").timezone == "UTC"


@pytest.mark.parametrize("expr", ["* * * * *", "0 */5 * * * MON-FRI", "  1 2\t3 4 5 "])
def test_cron_schedule_accepts_five_or_six_fields(expr: str) -> None:
    assert CronSchedule(expr, "Europe/Paris").expr == expr


_NEG = timedelta(microseconds=-1)
_TEMPLATE = TaskSpec(b"")

# (what to build, the field the message must start with, a fragment of the bad value)
INVALID: list[tuple[str, Callable[[], object], str, str]] = [
    ("fixed at bool", lambda: FixedStart(True), "at", "True"),
    ("fixed tolerance", lambda: FixedStart(0, tolerance=_NEG), "tolerance", "days=-1"),
    ("fixed on_miss", lambda: FixedStart(0, on_miss="skip"), "on_miss", "'skip'"),  # type: ignore[arg-type]
    ("retry attempts 0", lambda: RetryPolicy(max_attempts=0), "max_attempts", "0"),
    ("retry attempts bool", lambda: RetryPolicy(max_attempts=True), "max_attempts", "True"),
    ("retry backoff", lambda: RetryPolicy(backoff=_NEG), "backoff", "days=-1"),
    (
        "retry max_backoff below backoff",
        lambda: RetryPolicy(backoff=timedelta(seconds=2), max_backoff=timedelta(seconds=1)),
        "max_backoff",
        "seconds=1",
    ),
    (
        "retry max_backoff negative",
        lambda: RetryPolicy(backoff=timedelta(0), max_backoff=_NEG),
        "max_backoff",
        "days=-1",
    ),
    ("retry multiplier < 1", lambda: RetryPolicy(multiplier=0.5), "multiplier", "0.5"),
    ("retry multiplier nan", lambda: RetryPolicy(multiplier=float("nan")), "multiplier", "nan"),
    ("retry multiplier inf", lambda: RetryPolicy(multiplier=float("inf")), "multiplier", "inf"),
    ("retry multiplier str", lambda: RetryPolicy(multiplier="2"), "multiplier", "'2'"),  # type: ignore[arg-type]
    ("dep negative id", lambda: Dependency(TaskId(-1)), "target", "-1"),
    ("dep id too large", lambda: Dependency(TaskId(2**63)), "target", str(2**63)),
    ("dep bool id", lambda: Dependency(True), "target", "True"),  # type: ignore[arg-type]
    ("dep empty key", lambda: Dependency(""), "target", "''"),
    ("dep float", lambda: Dependency(1.0), "target", "1.0"),  # type: ignore[arg-type]
    ("dep condition", lambda: Dependency(1, "succeeded"), "condition", "'succeeded'"),  # type: ignore[arg-type]
    ("spec payload str", lambda: TaskSpec("x"), "payload", "str"),  # type: ignore[arg-type]
    ("spec kind None", lambda: TaskSpec(b"", kind=None), "kind", "None"),  # type: ignore[arg-type]
    ("spec pool empty", lambda: TaskSpec(b"", pool=""), "pool", "''"),
    ("spec priority unknown", lambda: TaskSpec(b"", priority=7), "priority", "7"),  # type: ignore[arg-type]
    ("spec key empty", lambda: TaskSpec(b"", key=""), "key", "''"),
    ("spec deadline float", lambda: TaskSpec(b"", deadline=1.5), "deadline", "1.5"),  # type: ignore[arg-type]
    ("spec fixed_start", lambda: TaskSpec(b"", fixed_start=5), "fixed_start", "5"),  # type: ignore[arg-type]
    ("spec duration_hint", lambda: TaskSpec(b"", duration_hint=_NEG), "duration_hint", "days=-1"),
    ("spec timeout", lambda: TaskSpec(b"", timeout=_NEG), "timeout", "days=-1"),
    ("spec timeout seconds", lambda: TaskSpec(b"", timeout=5), "timeout", "5"),  # type: ignore[arg-type]
    ("spec retry", lambda: TaskSpec(b"", retry=3), "retry", "3"),  # type: ignore[arg-type]
    (
        "spec deps element",
        lambda: TaskSpec(b"", deps=[Dependency(TaskId(1)), 2]),  # type: ignore[list-item]
        r"deps\[1\]",
        "2",
    ),
    ("spec resource name", lambda: TaskSpec(b"", resources={"": 1}), "resources", "''"),
    (
        "spec resource negative",
        lambda: TaskSpec(b"", resources={"cpu": -1}),
        r"resources\['cpu'\]",
        "-1",
    ),
    (
        "spec resource bool",
        lambda: TaskSpec(b"", resources={"cpu": True}),
        r"resources\['cpu'\]",
        "True",
    ),
    (
        "spec resource float",
        lambda: TaskSpec(b"", resources={"cpu": 1.0}),  # type: ignore[dict-item]
        r"resources\['cpu'\]",
        "1.0",
    ),
    ("spec tags str", lambda: TaskSpec(b"", tags="abc"), "tags", "'abc'"),
    ("spec tags element", lambda: TaskSpec(b"", tags=["a", 1]), r"tags\[1\]", "1"),  # type: ignore[list-item]
    ("spec labels element", lambda: TaskSpec(b"", labels=[None]), r"labels\[0\]", "None"),  # type: ignore[list-item]
    ("spec tenant", lambda: TaskSpec(b"", tenant=5), "tenant", "5"),  # type: ignore[arg-type]
    ("cron 4 fields", lambda: CronSchedule("* * * *"), "expr", "'* * * *'"),
    ("cron 7 fields", lambda: CronSchedule("* * * * * * *"), "expr", "'* * * * * * *'"),
    ("cron empty", lambda: CronSchedule(""), "expr", "''"),
    (
        "cron zone unknown",
        lambda: CronSchedule("* * * * *", "Mars/Olympus"),
        "timezone",
        "'Mars/Olympus'",
    ),
    ("cron zone path", lambda: CronSchedule("* * * * *", "../etc/passwd"), "timezone", "passwd"),
    ("cron zone empty", lambda: CronSchedule("* * * * *", ""), "timezone", "''"),
    ("cron zone lowercase", lambda: CronSchedule("* * * * *", "utc"), "timezone", "'utc'"),
    ("interval zero", lambda: IntervalSchedule(timedelta(0)), "every", "timedelta(0)"),
    ("interval negative", lambda: IntervalSchedule(_NEG), "every", "days=-1"),
    (
        "recurring name",
        lambda: RecurringSpec("", IntervalSchedule(timedelta(1)), _TEMPLATE),
        "name",
        "''",
    ),
    ("submitted id", lambda: Submitted(TaskId(-5), 0, 0, _TEMPLATE), "id", "-5"),
    ("submitted seq", lambda: Submitted(TaskId(1), -1, 0, _TEMPLATE), "seq", "-1"),
    ("status id", lambda: StatusChanged(TaskId(2**63), TaskStatus.FAILED, 0, 0), "id", str(2**63)),
    ("status attempt", lambda: StatusChanged(TaskId(1), TaskStatus.FAILED, -1, 0), "attempt", "-1"),
    ("status name", lambda: StatusChanged(TaskId(1), "failed", 0, 0), "status", "'failed'"),  # type: ignore[arg-type]
    ("next last", lambda: RecurringNext("r", None, TaskId(-1)), "last", "-1"),
    # Every integer against the column (or JSON member) that stores it.
    ("submitted seq beyond BIGINT", lambda: Submitted(TaskId(1), 2**63, 0, _TEMPLATE), "seq",
     f"0..2**63-1, got {2**63}"),
    ("submitted arrival beyond BIGINT", lambda: Submitted(TaskId(1), 0, 2**63, _TEMPLATE),
     "arrival", f"-2**63..2**63-1, got {2**63}"),
    ("submitted arrival below BIGINT", lambda: Submitted(TaskId(1), 0, I64_MIN - 1, _TEMPLATE),
     "arrival", str(I64_MIN - 1)),
    ("submitted arrival float", lambda: Submitted(TaskId(1), 0, 1.0, _TEMPLATE), "arrival", "1.0"),  # type: ignore[arg-type]
    ("submitted spec", lambda: Submitted(TaskId(1), 0, 0, b""), "spec", "b''"),  # type: ignore[arg-type]
    ("status attempt beyond INTEGER", lambda: StatusChanged(TaskId(1), TaskStatus.FAILED, 2**31, 0),
     "attempt", f"0..2**31-1, got {2**31}"),
    ("status at beyond BIGINT", lambda: StatusChanged(TaskId(1), TaskStatus.FAILED, 0, 2**63),
     "at", f"-2**63..2**63-1, got {2**63}"),
    ("status at None", lambda: StatusChanged(TaskId(1), TaskStatus.FAILED, 0, None), "at", "None"),  # type: ignore[arg-type]
    ("status message", lambda: StatusChanged(TaskId(1), TaskStatus.FAILED, 0, 0, b"x"),  # type: ignore[arg-type]
     "message", "b'x'"),
    ("spec deadline beyond BIGINT", lambda: TaskSpec(b"", deadline=2**63), "deadline",
     f"-2**63..2**63-1, got {2**63}"),
    ("fixed at below BIGINT", lambda: FixedStart(I64_MIN - 1), "at", str(I64_MIN - 1)),
    ("retry attempts beyond INTEGER", lambda: RetryPolicy(max_attempts=2**31), "max_attempts",
     f"1..2**31-1, got {2**31}"),
    ("retry multiplier beyond floats", lambda: RetryPolicy(multiplier=10**400), "multiplier",
     "an integer of 1329 bits"),
    ("spec resource beyond BIGINT", lambda: TaskSpec(b"", resources={"cpu": 2**63}),
     r"resources\['cpu'\]", f"0..2**63-1, got {2**63}"),
    ("spec resources merged by cleaning",
     lambda: TaskSpec(b"", resources={"a\x00": 1, "a\ufffd": 2}), "resources",
     "keyed by names that stay distinct once stored"),
    ("spec resources merged by surrogates",
     lambda: TaskSpec(b"", resources={chr(0xD800): 1, chr(0xDC00): 2}), "resources",
     "stay distinct"),
    ("next beyond BIGINT", lambda: RecurringNext("r", 2**63, None), "next", str(2**63)),
    ("next name", lambda: RecurringNext("", None, None), "name", "''"),
    ("remove name", lambda: RecurringRemove(5), "name", "5"),  # type: ignore[arg-type]
    ("recurring schedule", lambda: RecurringSpec("r", "* * * * *", _TEMPLATE), "schedule",  # type: ignore[arg-type]
     "'* * * * *'"),
    ("recurring template", lambda: RecurringSpec("r", IntervalSchedule(timedelta(1)), None),  # type: ignore[arg-type]
     "template", "None"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("build", "field", "bad"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID]
)
def test_invalid_values_are_rejected_naming_the_field(
    build: Callable[[], object], field: str, bad: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: must be ") as info:
        build()
    assert bad in str(info.value)


def test_values_at_the_edge_of_their_columns_are_accepted() -> None:
    spec = TaskSpec(
        b"",
        deadline=I64_MAX,
        fixed_start=FixedStart(I64_MIN),
        retry=RetryPolicy(max_attempts=I32_MAX),
        resources={"cpu": I64_MAX, "a\x00": 1, "a": 2},  # distinct once stored
    )
    assert Submitted(TaskId(I64_MAX), I64_MAX, I64_MIN, spec).spec is spec
    assert StatusChanged(TaskId(0), TaskStatus.FAILED, I32_MAX, I64_MAX).attempt == I32_MAX
    assert RecurringNext("r", I64_MIN, TaskId(I64_MAX)).next == I64_MIN


def test_messages_about_huge_or_deep_values_are_bounded() -> None:
    deep: list[object] = []
    inner = deep
    for _ in range(100_000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: TaskSpec(b"", resources={"cpu": -(10**5000)}), "an integer of 16610 bits"),
        (lambda: TaskSpec(b"", deps=[deep]), "a list of 1 items"),  # type: ignore[list-item]
        (lambda: TaskSpec(b"", pool=deep), "a list of 1 items"),  # type: ignore[arg-type]
        (lambda: TaskSpec(b"", key=b"k" * 10**6), "b'kkk"),  # type: ignore[arg-type]
        (lambda: Dependency(10**400), "an integer of 1329 bits"),  # type: ignore[arg-type]
    ]
    for build, shown in cases:
        with pytest.raises(ValueError, match=r"^\w+(\[[^]]+\])?: must be ") as info:
            build()
        assert shown in str(info.value)
        assert len(str(info.value)) < 200


def test_rejected_target_message_is_specific() -> None:
    message = "target: must be a task id in 0..2**63-1, got -1"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Dependency(TaskId(-1))
