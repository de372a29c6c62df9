"""The recurring schedule's codec: ``cronoq_recurring.spec`` as JSON, and its import check.

The spec column holds the schedule and the task template without its payload, in the
storage format's shapes (docs/storage-format.md), decoded as strictly as the task columns
(:mod:`cronoq_store._codec`). :func:`check_template` holds ``TaskSpec``'s fields, the
encoder and the decoder to :data:`TEMPLATE_MEMBERS` at import, so a ``TaskSpec`` field
forgotten here is an import error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import fields

from ._codec import (
    DecodeError,
    as_bigint,
    as_int,
    as_name,
    as_ns,
    as_object,
    as_str,
    dep_to_json,
    deps_from_json,
    dumps,
    duration_to_ns,
    encode_miss_policy,
    engine_time,
    loads,
    member,
    mismatch,
    nullable,
    optional_ns,
    rejected,
    required,
    resources_from_json,
    resources_to_json,
    retry_from_json,
    retry_to_json,
    strings_from_json,
    unix_converter,
)
from ._domain import (
    CronSchedule,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringSpec,
    Schedule,
    TaskSpec,
    TimeBase,
    clean_text,
)
from ._mutations import unhandled

__all__ = [
    "TEMPLATE_MEMBERS",
    "check_template",
    "decode_recurring",
    "encode_recurring",
]

_DEFAULT_SPEC = TaskSpec(b"")
_DEFAULT_FIXED = FixedStart(0)


def encode_recurring(base: TimeBase, spec: RecurringSpec) -> str:
    """JSON for ``cronoq_recurring.spec``: the schedule and the template without its payload.

    The name and the template's payload have columns of their own. Engine times in the
    template are stored as Unix ns through ``base`` (``ValueError`` if one leaves BIGINT).
    """
    return dumps(
        {
            "schedule": _schedule_to_json(spec.schedule),
            "template": _template_to_json(unix_converter(base), spec.template),
        }
    )


def decode_recurring(base: TimeBase, name: str, text: str, payload: bytes) -> RecurringSpec:
    """Rebuild a recurring spec from its ``name``, ``spec`` and ``template_payload`` columns.

    Unix times in the template become engine times (ns) through ``base``. Also raises
    ``DecodeError`` for a name that is not a valid schedule name.
    """
    obj = as_object(loads(text, "spec"), "spec")
    schedule = _schedule_from_json(required(obj, "schedule", "spec"), "spec.schedule")
    template = _template_from_json(
        base, required(obj, "template", "spec"), payload, "spec.template"
    )
    try:
        return RecurringSpec(name, schedule, template)
    except ValueError as exc:  # the name, which is a column of its own
        raise DecodeError(str(exc)) from exc


def _schedule_to_json(schedule: Schedule) -> dict[str, object]:
    match schedule:
        case CronSchedule(expr=expr, timezone=zone):
            return {"type": "cron", "expr": clean_text(expr), "timezone": clean_text(zone)}
        case IntervalSchedule(every=every):
            return {"type": "interval", "every_ns": duration_to_ns(every)}
        case _:
            unhandled(schedule, "schedule")


def _template_to_json(to_unix: Callable[[int, str], int], spec: TaskSpec) -> dict[str, object]:
    fixed = spec.fixed_start
    return {
        "kind": clean_text(spec.kind),
        "pool": clean_text(spec.pool),
        "priority": int(spec.priority),
        "key": None if spec.key is None else clean_text(spec.key),
        "deadline_unix_ns": None
        if spec.deadline is None
        else to_unix(spec.deadline, "template.deadline"),
        "fixed_start": None
        if fixed is None
        else {
            "at_unix_ns": to_unix(fixed.at, "template.fixed_start.at"),
            "tolerance_ns": duration_to_ns(fixed.tolerance),
            "on_miss": encode_miss_policy(fixed.on_miss),
        },
        "duration_hint_ns": optional_ns(spec.duration_hint),
        "timeout_ns": optional_ns(spec.timeout),
        "retry": None if spec.retry is None else retry_to_json(spec.retry),
        "deps": [dep_to_json(d) for d in spec.deps],
        "resources": resources_to_json(spec.resources),
        "tags": [clean_text(s) for s in spec.tags],
        "labels": [clean_text(s) for s in spec.labels],
        "tenant": None if spec.tenant is None else clean_text(spec.tenant),
    }


def _schedule_from_json(value: object, path: str) -> Schedule:
    obj = as_object(value, path)
    kind = required(obj, "type", path)
    try:
        if kind == "cron":
            expr = as_str(required(obj, "expr", path), f"{path}.expr")
            if "timezone" not in obj:
                return CronSchedule(expr)
            return CronSchedule(expr, as_str(obj["timezone"], f"{path}.timezone"))
        if kind == "interval":
            return IntervalSchedule(as_ns(required(obj, "every_ns", path), f"{path}.every_ns"))
    except DecodeError:
        raise
    except ValueError as exc:
        raise rejected(path, exc) from exc
    raise mismatch(f"{path}.type", 'one of "cron", "interval"', kind)


def _fixed_start_from_json(base: TimeBase, value: object, path: str) -> FixedStart:
    obj = as_object(value, path)
    at = as_bigint(required(obj, "at_unix_ns", path), f"{path}.at_unix_ns")
    d = _DEFAULT_FIXED
    return FixedStart(
        at=engine_time(base, at),
        tolerance=member(obj, "tolerance_ns", path, as_ns, d.tolerance),
        on_miss=member(obj, "on_miss", path, _miss_policy_from_json, d.on_miss),
    )


def _miss_policy_from_json(value: object, path: str) -> MissPolicy:
    return as_name(MissPolicy, value, path, _DEFAULT_FIXED.on_miss)


def _priority_from_json(value: object, path: str) -> Priority:
    return Priority.from_stored(as_int(value, path))


def _template_from_json(base: TimeBase, value: object, payload: bytes, path: str) -> TaskSpec:
    obj = as_object(value, path)
    d = _DEFAULT_SPEC
    deadline = nullable(obj, "deadline_unix_ns", path, as_bigint)
    try:
        return TaskSpec(
            payload,
            kind=member(obj, "kind", path, as_str, d.kind),
            pool=member(obj, "pool", path, as_str, d.pool),
            priority=member(obj, "priority", path, _priority_from_json, d.priority),
            key=nullable(obj, "key", path, as_str),
            deadline=None if deadline is None else engine_time(base, deadline),
            fixed_start=nullable(
                obj, "fixed_start", path, lambda v, p: _fixed_start_from_json(base, v, p)
            ),
            duration_hint=nullable(obj, "duration_hint_ns", path, as_ns),
            timeout=nullable(obj, "timeout_ns", path, as_ns),
            retry=nullable(obj, "retry", path, retry_from_json),
            deps=member(obj, "deps", path, deps_from_json, ()),
            resources=member(obj, "resources", path, resources_from_json, {}),
            tags=member(obj, "tags", path, strings_from_json, ()),
            labels=member(obj, "labels", path, strings_from_json, ()),
            tenant=nullable(obj, "tenant", path, as_str),
        )
    except DecodeError:
        raise
    except ValueError as exc:
        raise rejected(path, exc) from exc


#: The template's JSON member of each ``TaskSpec`` field (``None``: not in the JSON; the
#: payload has a column of its own). :func:`check_template` holds TaskSpec's fields, what
#: the encoder writes and what the decoder reads to it at import, as ``_rows`` holds the
#: columns: a field added to ``TaskSpec`` fails the import until it is mapped here and in
#: both directions.
TEMPLATE_MEMBERS: dict[str, str | None] = {
    "payload": None,
    "kind": "kind",
    "pool": "pool",
    "priority": "priority",
    "key": "key",
    "deadline": "deadline_unix_ns",
    "fixed_start": "fixed_start",
    "duration_hint": "duration_hint_ns",
    "timeout": "timeout_ns",
    "retry": "retry",
    "deps": "deps",
    "resources": "resources",
    "tags": "tags",
    "labels": "labels",
    "tenant": "tenant",
}


class _ReadMembers(dict[str, object]):
    """A JSON object that records which members a decoder looks at."""

    def __init__(self, members: dict[str, object]) -> None:
        super().__init__(members)
        self.read: set[str] = set()

    def __contains__(self, name: object) -> bool:
        self.read.add(str(name))
        return super().__contains__(name)

    def __getitem__(self, name: str) -> object:
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name: str, default: object = None) -> object:
        self.read.add(name)
        return super().get(name, default)


def check_template(
    spec_type: type[TaskSpec] = TaskSpec,
    encode: Callable[[Callable[[int, str], int], TaskSpec], dict[str, object]] = _template_to_json,
    decode: Callable[[TimeBase, object, bytes, str], TaskSpec] = _template_from_json,
) -> None:
    """``RuntimeError`` unless :data:`TEMPLATE_MEMBERS` maps every field of ``spec_type``
    and only those, ``encode`` writes every mapped member and only those, and ``decode``
    reads each of them: run at import, so a forgotten codec entry is an import error."""
    names = [f.name for f in fields(spec_type)]
    members = {m for m in TEMPLATE_MEMBERS.values() if m is not None}
    problems = []
    if set(names) != set(TEMPLATE_MEMBERS):
        problems.append(
            f"TaskSpec fields not mapped: {sorted(set(names) - set(TEMPLATE_MEMBERS))}, "
            f"mapped but not fields: {sorted(set(TEMPLATE_MEMBERS) - set(names))}"
        )
    written = json.loads(json.dumps(encode(lambda t, _: t, spec_type(b""))))
    if set(written) != members:
        problems.append(
            f"the encoder does not write {sorted(members - set(written))} and writes "
            f"unmapped {sorted(set(written) - members)}"
        )
    read = _ReadMembers(written)
    decode(TimeBase(0, 0), read, b"", "template")
    if not members <= read.read:
        problems.append(f"the decoder does not read {sorted(members - read.read)}")
    if problems:
        raise RuntimeError(
            "cronoq_store._template_codec: the recurring template's JSON and TaskSpec disagree: "
            + "; ".join(problems)
        )


check_template()
