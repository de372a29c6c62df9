"""The JSONB encodings: exact shapes, round trips, NUL cleaning, tolerance and strictness."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cronoq_store._codec import (
    DecodeError,
    clean_text,
    decode_deps,
    decode_miss_policy,
    decode_recurring,
    decode_resources,
    decode_retry,
    decode_strings,
    duration_to_ns,
    encode_deps,
    encode_miss_policy,
    encode_recurring,
    encode_resources,
    encode_retry,
    encode_strings,
    ns_to_duration,
    unix_converter,
)
from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringSpec,
    RetryPolicy,
    TaskId,
    TaskSpec,
    TimeBase,
    task_id,
)

from .support import FIXED_BASE, FULL_SPEC, I64_MAX, I64_MIN

# Strategies. Text may hold NUL, which the store writes as U+FFFD, so decoded values are
# compared against `cleaned(...)` of what was encoded.

any_text = st.text(st.characters(exclude_categories=["Cs"]) | st.just("\0"), max_size=12)
names = any_text.filter(bool)
durations = st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=100_000))
engine_times = st.integers(-(2**62), 2**62)
ids = st.integers(0, I64_MAX).map(TaskId)


@st.composite
def retry_policies(draw: st.DrawFn) -> RetryPolicy:
    backoff = draw(durations)
    extra = draw(st.none() | durations)
    return RetryPolicy(
        max_attempts=draw(st.integers(1, 10_000)),
        backoff=backoff,
        max_backoff=None if extra is None else max(backoff, extra),
        multiplier=draw(st.floats(1, 1e9, allow_nan=False, allow_infinity=False)),
    )


dependencies = st.builds(
    Dependency, target=ids | names, condition=st.sampled_from(DependencyCondition)
)
# Names that stay distinct once stored ("k\0" and "k\ufffd" are one name): TaskSpec refuses others.
resource_maps = st.dictionaries(names, st.integers(0, I64_MAX), max_size=4).filter(
    lambda resources: len({clean_text(name) for name in resources}) == len(resources)
)
string_tuples = st.lists(any_text, max_size=4).map(tuple)
fixed_starts = st.builds(
    FixedStart, at=engine_times, tolerance=durations, on_miss=st.sampled_from(MissPolicy)
)
task_specs = st.builds(
    TaskSpec,
    payload=st.binary(max_size=16),
    kind=any_text,
    pool=names,
    priority=st.sampled_from(Priority),
    key=st.none() | names,
    deadline=st.none() | engine_times,
    fixed_start=st.none() | fixed_starts,
    duration_hint=st.none() | durations,
    timeout=st.none() | durations,
    retry=st.none() | retry_policies(),
    deps=st.lists(dependencies, max_size=3),
    resources=resource_maps,
    tags=string_tuples,
    labels=string_tuples,
    tenant=st.none() | any_text,
)
cron_exprs = st.lists(
    st.sampled_from(["*", "0", "*/5", "1-5", "MON", "1,15"]), min_size=5, max_size=6
).map(" ".join)
schedules = st.builds(
    CronSchedule,
    expr=cron_exprs,
    timezone=st.sampled_from(["UTC", "Europe/Paris", "America/New_York", "Asia/Kolkata"]),
) | st.builds(IntervalSchedule, every=durations.filter(bool))
recurring_specs = st.builds(RecurringSpec, name=names, schedule=schedules, template=task_specs)
time_bases = st.builds(TimeBase, engine_ns=st.integers(0, 2**62), unix_ns=st.integers(0, 2**62))


def cleaned_opt(s: str | None) -> str | None:
    return None if s is None else clean_text(s)


def cleaned_deps(deps: Sequence[Dependency]) -> tuple[Dependency, ...]:
    return tuple(
        Dependency(clean_text(d.target), d.condition) if isinstance(d.target, str) else d
        for d in deps
    )


def cleaned_resources(resources: Mapping[str, int]) -> dict[str, int]:
    return {clean_text(k): v for k, v in resources.items()}


def cleaned_strings(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(clean_text(s) for s in values)


def cleaned_spec(spec: TaskSpec) -> TaskSpec:
    return dataclasses.replace(
        spec,
        kind=clean_text(spec.kind),
        pool=clean_text(spec.pool),
        key=cleaned_opt(spec.key),
        deps=cleaned_deps(spec.deps),
        resources=cleaned_resources(spec.resources),
        tags=cleaned_strings(spec.tags),
        labels=cleaned_strings(spec.labels),
        tenant=cleaned_opt(spec.tenant),
    )


def assert_storable(text: str) -> None:
    """Compact JSON that jsonb accepts: no NUL escape, no whitespace between tokens."""
    assert "\\u0000" not in text
    assert "\0" not in text
    assert json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":")) == text


# clean_text and durations


@pytest.mark.parametrize(
    ("raw", "stored"),
    [("", ""), ("plain", "plain"), ("\0", "\ufffd"), ("a\0b\0", "a\ufffdb\ufffd"), ("é😀", "é😀")],
)
def test_clean_text(raw: str, stored: str) -> None:
    assert clean_text(raw) == stored


@pytest.mark.parametrize(
    ("raw", "stored"),
    [
        ("\ud800", "\ufffd"),
        ("a\udfffb\0é", "a\ufffdb\ufffdé"),
        ("\ud83d\ude00", "\ufffd\ufffd"),  # a pair built by hand is two lone surrogates
        ("😀\ud800", "😀\ufffd"),
    ],
)
def test_clean_text_replaces_lone_surrogates(raw: str, stored: str) -> None:
    out = clean_text(raw)
    assert out == stored
    out.encode("utf-8")  # what the driver sends; a lone surrogate cannot be encoded


def test_clean_text_returns_clean_strings_as_they_are() -> None:
    for s in ["plain", "é😀", ""]:
        assert clean_text(s) is s


@given(any_text)
def test_clean_text_removes_only_nul(s: str) -> None:
    out = clean_text(s)
    assert "\0" not in out
    assert len(out) == len(s)
    assert out.replace("\ufffd", "") == s.replace("\0", "").replace("\ufffd", "")


@given(st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=106_000)))
def test_duration_round_trip(td: timedelta) -> None:
    ns = duration_to_ns(td)
    assert ns == (td.days * 86_400 + td.seconds) * 10**9 + td.microseconds * 1000
    assert ns_to_duration(ns) == td


def test_duration_saturates_at_bigint() -> None:
    assert duration_to_ns(timedelta.max) == I64_MAX
    assert duration_to_ns(timedelta(days=1)) == 86_400 * 10**9


def test_ns_to_duration_truncates_below_a_microsecond() -> None:
    assert ns_to_duration(1_999) == timedelta(microseconds=1)
    assert ns_to_duration(999) == timedelta(0)


@pytest.mark.parametrize("policy", list(MissPolicy))
def test_miss_policy_round_trip(policy: MissPolicy) -> None:
    assert decode_miss_policy(encode_miss_policy(policy)) is policy


def test_miss_policy_names_and_default() -> None:
    assert [encode_miss_policy(p) for p in MissPolicy] == ["skip", "run", "fail"]
    assert decode_miss_policy(None) is MissPolicy.SKIP


@pytest.mark.parametrize("name", ["later", "", "SKIP", "run "])
def test_unknown_miss_policy_reads_as_the_default(name: str) -> None:
    """A newer build's policy name is not corruption: it reads as the default, skip."""
    assert decode_miss_policy(name) is MissPolicy.SKIP
    spec = decode_template(f'{{"fixed_start":{{"at_unix_ns":0,"on_miss":"{name}"}}}}')
    assert spec.template.fixed_start == FixedStart(FIXED_BASE.from_unix(0), on_miss=MissPolicy.SKIP)


def test_unknown_dependency_condition_reads_as_the_default() -> None:
    assert decode_deps('[{"id":1,"on":"done"},{"key":"k","on":"finished"}]') == (
        Dependency(TaskId(1), DependencyCondition.SUCCEEDED),
        Dependency("k", DependencyCondition.FINISHED),
    )
    spec = decode_template('{"deps":[{"key":"k","on":"someday"}]}')
    assert spec.template.deps == (Dependency("k", DependencyCondition.SUCCEEDED),)


# The exact stored shapes (docs/storage-format.md shows these same examples).


def test_retry_shape() -> None:
    retry = RetryPolicy(5, timedelta(milliseconds=500), timedelta(seconds=30), 1.5)
    assert encode_retry(retry) == (
        '{"max_attempts":5,"backoff_ns":500000000,"max_backoff_ns":30000000000,"multiplier":1.5}'
    )
    assert encode_retry(RetryPolicy()) == (
        '{"max_attempts":3,"backoff_ns":1000000000,"max_backoff_ns":null,"multiplier":2.0}'
    )
    assert encode_retry(None) is None


def test_deps_shape() -> None:
    deps = (
        Dependency(task_id(1, 42)),
        Dependency("nightly-report", DependencyCondition.FINISHED),
    )
    assert encode_deps(deps) == (
        '[{"id":281474976710698,"on":"succeeded"},{"key":"nightly-report","on":"finished"}]'
    )
    assert encode_deps(()) == "[]"


def test_resources_and_strings_shape() -> None:
    assert encode_resources({"cpu": 2, "gpu": 1}) == '{"cpu":2,"gpu":1}'
    assert encode_resources({}) == "{}"
    assert encode_strings(("etl", "nightly")) == '["etl","nightly"]'
    assert encode_strings(()) == "[]"
    assert encode_strings(("a\0b", "é")) == '["a\ufffdb","é"]'
    assert encode_resources({"c\0": 1}) == '{"c\ufffd":1}'


def test_recurring_shapes() -> None:
    template = TaskSpec(
        b"payload",
        kind="report",
        pool="batch",
        priority=Priority.HIGH,
        key="daily-report",
        deadline=3_600_000_000_000,
        fixed_start=FixedStart(5_000_000_000, timedelta(seconds=2), MissPolicy.RUN),
        duration_hint=timedelta(minutes=5),
        timeout=timedelta(minutes=10),
        retry=RetryPolicy(2, timedelta(seconds=1)),
        deps=[Dependency("warmup", DependencyCondition.FINISHED)],
        resources={"cpu": 2},
        tags=["reports"],
        labels=["ssd"],
        tenant="acme",
    )
    cron = RecurringSpec("daily", CronSchedule("0 6 * * MON-FRI", "Europe/Paris"), template)
    assert json.loads(encode_recurring(FIXED_BASE, cron)) == {
        "schedule": {"type": "cron", "expr": "0 6 * * MON-FRI", "timezone": "Europe/Paris"},
        "template": {
            "kind": "report",
            "pool": "batch",
            "priority": 2,
            "key": "daily-report",
            "deadline_unix_ns": 1_700_003_600_000_000_000,
            "fixed_start": {
                "at_unix_ns": 1_700_000_005_000_000_000,
                "tolerance_ns": 2_000_000_000,
                "on_miss": "run",
            },
            "duration_hint_ns": 300_000_000_000,
            "timeout_ns": 600_000_000_000,
            "retry": {
                "max_attempts": 2,
                "backoff_ns": 1_000_000_000,
                "max_backoff_ns": None,
                "multiplier": 2.0,
            },
            "deps": [{"key": "warmup", "on": "finished"}],
            "resources": {"cpu": 2},
            "tags": ["reports"],
            "labels": ["ssd"],
            "tenant": "acme",
        },
    }
    interval = RecurringSpec("tick", IntervalSchedule(timedelta(seconds=30)), TaskSpec(b""))
    assert encode_recurring(FIXED_BASE, interval) == (
        '{"schedule":{"type":"interval","every_ns":30000000000},'
        '"template":{"kind":"","pool":"default","priority":1,"key":null,'
        '"deadline_unix_ns":null,"fixed_start":null,"duration_hint_ns":null,'
        '"timeout_ns":null,"retry":null,"deps":[],"resources":{},"tags":[],'
        '"labels":[],"tenant":null}}'
    )


# Round trips


@settings(max_examples=200)
@given(st.none() | retry_policies())
def test_retry_round_trip(retry: RetryPolicy | None) -> None:
    text = encode_retry(retry)
    if text is not None:
        assert_storable(text)
    assert decode_retry(text) == retry


@settings(max_examples=200)
@given(st.lists(dependencies, max_size=5).map(tuple))
def test_deps_round_trip(deps: tuple[Dependency, ...]) -> None:
    text = encode_deps(deps)
    assert_storable(text)
    assert decode_deps(text) == cleaned_deps(deps)


@settings(max_examples=200)
@given(resource_maps)
def test_resources_round_trip(resources: dict[str, int]) -> None:
    text = encode_resources(resources)
    assert_storable(text)
    assert decode_resources(text) == cleaned_resources(resources)


@settings(max_examples=200)
@given(string_tuples)
def test_strings_round_trip(values: tuple[str, ...]) -> None:
    text = encode_strings(values)
    assert_storable(text)
    assert decode_strings(text, "tags") == cleaned_strings(values)


@settings(max_examples=200)
@given(recurring_specs, time_bases)
def test_recurring_round_trip(spec: RecurringSpec, base: TimeBase) -> None:
    text = encode_recurring(base, spec)
    assert_storable(text)
    payload = spec.template.payload
    decoded = decode_recurring(base, spec.name, text, payload)
    assert decoded == dataclasses.replace(spec, template=cleaned_spec(spec.template))


def test_a_template_keeps_every_field_of_its_task_spec() -> None:
    """A TaskSpec field the template's JSON left out would be lost by every occurrence."""
    template = FULL_SPEC  # every field set, each to a value of its own
    default = TaskSpec(b"")
    fields = dataclasses.fields(TaskSpec)
    assert [f.name for f in fields if getattr(template, f.name) == getattr(default, f.name)] == []
    spec = RecurringSpec("r", IntervalSchedule(timedelta(minutes=1)), template)
    assert decode_recurring(FIXED_BASE, "r", encode_recurring(FIXED_BASE, spec), b"payload") == spec


@settings(max_examples=50)
@given(task_specs, time_bases, time_bases)
def test_recurring_keeps_wall_clock_times_across_bases(
    template: TaskSpec, written: TimeBase, read: TimeBase
) -> None:
    spec = RecurringSpec("r", IntervalSchedule(timedelta(seconds=1)), template)
    decoded = decode_recurring(read, "r", encode_recurring(written, spec), template.payload)

    def same_moment(decoded_ns: int | None, written_ns: int | None) -> None:
        # The same wall-clock time where the reader's engine time can hold it; beyond the
        # BIGINT range through the reader's base, the bound on that side (a time centuries
        # away either way).
        assert decoded_ns is not None
        assert written_ns is not None
        wall = written.to_unix(written_ns)
        if I64_MIN <= read.from_unix(wall) <= I64_MAX:
            assert read.to_unix(decoded_ns) == wall
        else:
            assert decoded_ns == (I64_MAX if read.from_unix(wall) > 0 else I64_MIN)

    if template.deadline is not None:
        same_moment(decoded.template.deadline, template.deadline)
    if template.fixed_start is not None:
        assert decoded.template.fixed_start is not None
        same_moment(decoded.template.fixed_start.at, template.fixed_start.at)


# Tolerance: members this build does not know are ignored, absent ones take defaults.


def test_unknown_members_are_ignored() -> None:
    assert decode_retry('{"max_attempts":4,"jitter":0.1}') == RetryPolicy(max_attempts=4)
    assert decode_deps('[{"id":7,"on":"finished","weight":3}]') == (
        Dependency(TaskId(7), DependencyCondition.FINISHED),
    )
    text = (
        '{"schedule":{"type":"interval","every_ns":1000,"anchor":0},"owner":"ops",'
        '"template":{"pool":"p","fixed_start":{"at_unix_ns":0,"grace":1},"new":[1]}}'
    )
    decoded = decode_recurring(FIXED_BASE, "r", text, b"x")
    assert decoded == RecurringSpec(
        "r",
        IntervalSchedule(timedelta(microseconds=1)),
        TaskSpec(b"x", pool="p", fixed_start=FixedStart(FIXED_BASE.from_unix(0))),
    )


def test_absent_members_take_domain_defaults() -> None:
    assert decode_retry("{}") == RetryPolicy()
    assert decode_retry("null") is None
    assert decode_retry(None) is None
    assert decode_deps('[{"key":"k"}]') == (Dependency("k"),)
    decoded = decode_recurring(
        FIXED_BASE, "r", '{"schedule":{"type":"cron","expr":"* * * * *"},"template":{}}', b""
    )
    assert decoded == RecurringSpec("r", CronSchedule("* * * * *"), TaskSpec(b""))


def test_unknown_stored_priority_decodes_as_normal() -> None:
    text = '{"schedule":{"type":"interval","every_ns":1000},"template":{"priority":9}}'
    assert decode_recurring(FIXED_BASE, "r", text, b"").template.priority is Priority.NORMAL


# Strictness: malformed values raise DecodeError naming the member.


def recurring(schedule: str = '{"type":"interval","every_ns":1000}', template: str = "{}") -> str:
    return f'{{"schedule":{schedule},"template":{template}}}'


def decode_template(template: str) -> RecurringSpec:
    return decode_recurring(FIXED_BASE, "r", recurring(template=template), b"")


def decode_schedule(schedule: str) -> object:
    return decode_recurring(FIXED_BASE, "r", recurring(schedule=schedule), b"")


MALFORMED: list[tuple[str, Callable[[], object], str]] = [
    ("deps invalid json", lambda: decode_deps("[{"), "deps: invalid JSON ("),
    (
        "deps not an array",
        lambda: decode_deps('{"id":1}'),
        'deps: expected an array, got {"id": 1}',
    ),
    (
        "deps element not an object",
        lambda: decode_deps("[5]"),
        "deps[0]: expected an object, got 5",
    ),
    (
        "deps neither id nor key",
        lambda: decode_deps('[{"on":"finished"}]'),
        'deps[0]: expected exactly one of "id" and "key", got neither',
    ),
    (
        "deps both id and key",
        lambda: decode_deps('[{"id":1,"key":"k"}]'),
        'deps[0]: expected exactly one of "id" and "key", got both',
    ),
    (
        "deps id not an integer",
        lambda: decode_deps('[{"id":1},{"id":2},{"id":"x"}]'),
        'deps[2].id: expected a task id (an integer in 0..2**63-1), got "x"',
    ),
    ("deps id bool", lambda: decode_deps('[{"id":true}]'), "deps[0].id: expected a task id"),
    ("deps id float", lambda: decode_deps('[{"id":1.0}]'), "deps[0].id: expected a task id"),
    ("deps id negative", lambda: decode_deps('[{"id":-1}]'), "deps[0].id: expected a task id"),
    (
        "deps id too big",
        lambda: decode_deps(f'[{{"id":{2**63}}}]'),
        "deps[0].id: expected a task id",
    ),
    (
        "deps key empty",
        lambda: decode_deps('[{"key":""}]'),
        'deps[0].key: expected a non-empty string, got ""',
    ),
    (
        "deps key null",
        lambda: decode_deps('[{"key":null}]'),
        "deps[0].key: expected a non-empty string, got null",
    ),
    (
        "deps condition not a string",
        lambda: decode_deps('[{"id":1,"on":2}]'),
        "deps[0].on: expected a string, got 2",
    ),
    ("resources invalid json", lambda: decode_resources("{cpu:1}"), "resources: invalid JSON ("),
    (
        "resources not an object",
        lambda: decode_resources("[1]"),
        "resources: expected an object, got [1]",
    ),
    (
        "resources negative amount",
        lambda: decode_resources('{"cpu":-1}'),
        'resources["cpu"]: expected an integer in 0..2**63-1, got -1',
    ),
    (
        "resources bool amount",
        lambda: decode_resources('{"cpu":true}'),
        'resources["cpu"]: expected an integer in 0..2**63-1, got true',
    ),
    (
        "resources float amount",
        lambda: decode_resources('{"cpu":1.5}'),
        'resources["cpu"]: expected an integer in 0..2**63-1, got 1.5',
    ),
    (
        "resources empty name",
        lambda: decode_resources('{"":1}'),
        'resources: expected non-empty resource names, got ""',
    ),
    (
        "tags not an array",
        lambda: decode_strings('"a"', "tags"),
        'tags: expected an array, got "a"',
    ),
    (
        "labels element",
        lambda: decode_strings('["a",1]', "labels"),
        "labels[1]: expected a string, got 1",
    ),
    ("tags invalid json", lambda: decode_strings("[", "tags"), "tags: invalid JSON ("),
    ("retry invalid json", lambda: decode_retry("{"), "retry: invalid JSON ("),
    ("retry not an object", lambda: decode_retry("[]"), "retry: expected an object, got []"),
    (
        "retry attempts bool",
        lambda: decode_retry('{"max_attempts":true}'),
        "retry.max_attempts: expected an integer, got true",
    ),
    (
        "retry attempts zero",
        lambda: decode_retry('{"max_attempts":0}'),
        "retry.max_attempts: must be an integer in 1..2**31-1, got 0",
    ),
    (
        "retry negative backoff",
        lambda: decode_retry('{"backoff_ns":-1}'),
        "retry.backoff_ns: expected a non-negative integer of nanoseconds below 2**63, got -1",
    ),
    (
        "retry huge backoff",
        lambda: decode_retry(f'{{"backoff_ns":{2**63}}}'),
        "retry.backoff_ns: expected a non-negative integer of nanoseconds",
    ),
    (
        "retry null backoff",
        lambda: decode_retry('{"backoff_ns":null}'),
        "retry.backoff_ns: expected a non-negative integer of nanoseconds below 2**63, got null",
    ),
    (
        "retry max below backoff",
        lambda: decode_retry('{"backoff_ns":2000,"max_backoff_ns":1000}'),
        "retry.max_backoff: must be at least backoff",
    ),
    (
        "retry multiplier string",
        lambda: decode_retry('{"multiplier":"2"}'),
        'retry.multiplier: expected a number, got "2"',
    ),
    (
        "retry multiplier below one",
        lambda: decode_retry('{"multiplier":0.5}'),
        "retry.multiplier: must be a finite number >= 1, got 0.5",
    ),
    (
        "retry attempts beyond INTEGER",
        lambda: decode_retry(f'{{"max_attempts":{2**31}}}'),
        f"retry.max_attempts: must be an integer in 1..2**31-1, got {2**31}",
    ),
    (
        "retry multiplier beyond every float",
        lambda: decode_retry('{"multiplier":' + "9" * 400 + "}"),
        "retry.multiplier: must be a finite number >= 1, got an integer of 1329 bits",
    ),
    (
        "recurring invalid json",
        lambda: decode_recurring(FIXED_BASE, "r", "nope", b""),
        "spec: invalid JSON (",
    ),
    (
        "recurring not an object",
        lambda: decode_recurring(FIXED_BASE, "r", "[]", b""),
        "spec: expected an object, got []",
    ),
    (
        "recurring no schedule",
        lambda: decode_recurring(FIXED_BASE, "r", '{"template":{}}', b""),
        "spec.schedule: required member is missing",
    ),
    (
        "recurring no template",
        lambda: decode_recurring(
            FIXED_BASE, "r", '{"schedule":{"type":"interval","every_ns":1000}}', b""
        ),
        "spec.template: required member is missing",
    ),
    (
        "recurring empty name",
        lambda: decode_recurring(FIXED_BASE, "", recurring(), b""),
        "name: must be a non-empty string, got ''",
    ),
    (
        "schedule unknown type",
        lambda: decode_schedule('{"type":"once"}'),
        'spec.schedule.type: expected one of "cron", "interval", got "once"',
    ),
    (
        "schedule no type",
        lambda: decode_schedule('{"every_ns":1}'),
        "spec.schedule.type: required member is missing",
    ),
    (
        "schedule bad cron",
        lambda: decode_schedule('{"type":"cron","expr":"* * *"}'),
        "spec.schedule.expr: must be a cron expression of 5 or 6 fields, got '* * *'",
    ),
    (
        "schedule cron not a string",
        lambda: decode_schedule('{"type":"cron","expr":5}'),
        "spec.schedule.expr: expected a string, got 5",
    ),
    (
        "schedule no cron",
        lambda: decode_schedule('{"type":"cron"}'),
        "spec.schedule.expr: required member is missing",
    ),
    (
        "schedule bad timezone",
        lambda: decode_schedule('{"type":"cron","expr":"* * * * *","timezone":"Mars/Olympus"}'),
        "spec.schedule.timezone: must be an IANA time zone name, got 'Mars/Olympus'",
    ),
    (
        "schedule negative interval",
        lambda: decode_schedule('{"type":"interval","every_ns":-5}'),
        "spec.schedule.every_ns: expected a non-negative integer of nanoseconds below 2**63, "
        "got -5",
    ),
    (
        "schedule zero interval",
        lambda: decode_schedule('{"type":"interval","every_ns":0}'),
        "spec.schedule.every: must be a positive timedelta, got datetime.timedelta(0)",
    ),
    (
        "template not an object",
        lambda: decode_template("[]"),
        "spec.template: expected an object, got []",
    ),
    (
        "template empty pool",
        lambda: decode_template('{"pool":""}'),
        "spec.template.pool: must be a non-empty string, got ''",
    ),
    (
        "template null pool",
        lambda: decode_template('{"pool":null}'),
        "spec.template.pool: expected a string, got null",
    ),
    (
        "template empty key",
        lambda: decode_template('{"key":""}'),
        "spec.template.key: must be None or a non-empty string, got ''",
    ),
    (
        "template priority string",
        lambda: decode_template('{"priority":"high"}'),
        'spec.template.priority: expected an integer, got "high"',
    ),
    (
        "template negative timeout",
        lambda: decode_template('{"timeout_ns":-1}'),
        "spec.template.timeout_ns: expected a non-negative integer of nanoseconds",
    ),
    (
        "template deadline float",
        lambda: decode_template('{"deadline_unix_ns":1.5}'),
        "spec.template.deadline_unix_ns: expected an integer in -2**63..2**63-1, got 1.5",
    ),
    (
        "template fixed start without at",
        lambda: decode_template('{"fixed_start":{}}'),
        "spec.template.fixed_start.at_unix_ns: required member is missing",
    ),
    (
        "template negative tolerance",
        lambda: decode_template('{"fixed_start":{"at_unix_ns":0,"tolerance_ns":-1}}'),
        "spec.template.fixed_start.tolerance_ns: expected a non-negative integer",
    ),
    (
        "template deadline beyond BIGINT",
        lambda: decode_template(f'{{"deadline_unix_ns":{2**63}}}'),
        "spec.template.deadline_unix_ns: expected an integer in -2**63..2**63-1, got 92233",
    ),
    (
        "template fixed start beyond BIGINT",
        lambda: decode_template(f'{{"fixed_start":{{"at_unix_ns":{-(2**63) - 1}}}}}'),
        "spec.template.fixed_start.at_unix_ns: expected an integer in -2**63..2**63-1",
    ),
    (
        "template miss policy not a string",
        lambda: decode_template('{"fixed_start":{"at_unix_ns":0,"on_miss":null}}'),
        "spec.template.fixed_start.on_miss: expected a string, got null",
    ),
    (
        "template retry",
        lambda: decode_template('{"retry":{"max_attempts":-2}}'),
        "spec.template.retry.max_attempts: must be an integer in 1..2**31-1, got -2",
    ),
    (
        "template dependency",
        lambda: decode_template('{"deps":[{"id":"x"}]}'),
        'spec.template.deps[0].id: expected a task id (an integer in 0..2**63-1), got "x"',
    ),
    (
        "template resources",
        lambda: decode_template('{"resources":{"cpu":-1}}'),
        'spec.template.resources["cpu"]: expected an integer in 0..2**63-1, got -1',
    ),
    (
        "template tags",
        lambda: decode_template('{"tags":[null]}'),
        "spec.template.tags[0]: expected a string, got null",
    ),
    (
        "template labels",
        lambda: decode_template('{"labels":{}}'),
        "spec.template.labels: expected an array, got {}",
    ),
    (
        "template tenant",
        lambda: decode_template('{"tenant":5}'),
        "spec.template.tenant: expected a string, got 5",
    ),
]


@pytest.mark.parametrize(
    ("decode", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_values_are_rejected(decode: Callable[[], object], message: str) -> None:
    with pytest.raises(DecodeError, match=f"^{re.escape(message)}"):
        decode()


def test_decode_error_is_a_value_error_and_shortens_long_values() -> None:
    assert issubclass(DecodeError, ValueError)
    with pytest.raises(DecodeError) as info:
        decode_strings(json.dumps([["x" * 10_000]]), "tags")
    message = str(info.value)
    assert message.startswith('tags[0]: expected a string, got ["xxx')
    assert message.endswith("…")
    assert len(message) < 120


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


DEEP = 100_000


@pytest.mark.parametrize(
    ("decode", "path"),
    [
        (lambda: decode_deps(nested(DEEP)), "deps"),
        (lambda: decode_deps(f'[{{"id":{nested(DEEP)}}}]'), "deps"),
        (lambda: decode_resources(f'{{"a":{nested(DEEP)}}}'), "resources"),
        (lambda: decode_strings(nested(DEEP), "tags"), "tags"),
        (lambda: decode_retry(f'{{"max_attempts":{nested(DEEP)}}}'), "retry"),
        (lambda: decode_recurring(FIXED_BASE, "r", nested(DEEP), b""), "spec"),
    ],
)
def test_json_nested_too_deep_to_parse_is_a_decode_error(
    decode: Callable[[], object], path: str
) -> None:
    with pytest.raises(DecodeError, match=f"^{path}: JSON nested too deeply to decode$"):
        decode()


@pytest.mark.parametrize("depth", [50, 500, 900])
def test_deep_values_the_parser_takes_make_bounded_messages(depth: int) -> None:
    """Nesting the parser still takes must not break the message that shows it."""
    decoders: list[Callable[[], object]] = [
        lambda: decode_deps(f'[{{"id":{nested(depth)}}}]'),
        lambda: decode_strings(f"[{nested(depth)}]", "tags"),
        lambda: decode_resources(f'{{"a":{nested(depth)}}}'),
        lambda: decode_template(f'{{"kind":{nested(depth)}}}'),
    ]
    for decode in decoders:
        with pytest.raises(DecodeError, match=r"got \[\[\[\[…\]\]\]\]$") as info:
            decode()
        assert len(str(info.value)) < 200


def test_huge_integers_make_bounded_messages() -> None:
    huge = "9" * 4000  # within what json.loads takes
    with pytest.raises(DecodeError, match=r"got an integer of 13288 bits$"):
        decode_deps(f'[{{"id":{huge}}}]')
    with pytest.raises(DecodeError, match=r"got an integer of 13288 bits$"):
        decode_resources(f'{{"a":{huge}}}')


def test_unix_converter_names_the_field_beyond_bigint() -> None:
    to_unix = unix_converter(TimeBase(engine_ns=10, unix_ns=20))
    assert to_unix(I64_MAX - 10, "at") == I64_MAX
    assert to_unix(-(2**63) - 10, "at") == -(2**63)
    with pytest.raises(ValueError, match=r"^deadline: engine time 9223372036854775798 is "):
        to_unix(I64_MAX - 9, "deadline")
    with pytest.raises(ValueError, match="outside the BIGINT range"):
        to_unix(-(2**63) - 11, "at")


def test_recurring_times_beyond_bigint_fail_encoding_naming_the_field() -> None:
    base = TimeBase(engine_ns=0, unix_ns=1)
    spec = RecurringSpec("r", IntervalSchedule(timedelta(1)), TaskSpec(b"", deadline=I64_MAX))
    with pytest.raises(ValueError, match=r"^template\.deadline: engine time"):
        encode_recurring(base, spec)
    fixed = TaskSpec(b"", fixed_start=FixedStart(I64_MAX))
    with pytest.raises(ValueError, match=r"^template\.fixed_start\.at: engine time"):
        encode_recurring(base, RecurringSpec("r", IntervalSchedule(timedelta(1)), fixed))


def test_too_long_number_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match=r"^resources: invalid JSON \("):
        decode_resources('{"cpu":' + "9" * 5000 + "}")
