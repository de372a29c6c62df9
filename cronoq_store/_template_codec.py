"""The recurring schedule's codec: ``cronoq_recurring.spec`` as JSON.

The spec column holds the schedule and the task template without its payload, in the
storage format's shapes (docs/storage-format.md), decoded as strictly as the task columns
(:mod:`cronoq_store._codec`). The template's members are derived from
:data:`~cronoq_store._domain.SPEC_FIELDS`, each encoded and decoded by its field's kind, so
a ``TaskSpec`` field is in the template as soon as it is declared.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    SPEC_FIELDS,
    CronSchedule,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringSpec,
    Schedule,
    SpecField,
    SpecKind,
    TaskSpec,
    TimeBase,
    clean_text,
    unhandled,
)

__all__ = [
    "TEMPLATE_MEMBERS",
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


#: The template's JSON member of each ``TaskSpec`` field that has one (the payload has a
#: column of its own), in declaration order.
TEMPLATE_MEMBERS: dict[str, str] = {f.name: f.member for f in SPEC_FIELDS if f.member is not None}
_IN_TEMPLATE = tuple(
    (f, TEMPLATE_MEMBERS[f.name]) for f in SPEC_FIELDS if f.name in TEMPLATE_MEMBERS
)


def _template_to_json(to_unix: Callable[[int, str], int], spec: TaskSpec) -> dict[str, object]:
    return {name: _to_json(f, getattr(spec, f.name), to_unix) for f, name in _IN_TEMPLATE}


def _to_json(f: SpecField, value: Any, to_unix: Callable[[int, str], int]) -> object:
    """One field's member, by its kind (every string cleaned)."""
    match f.kind:
        case SpecKind.TEXT:
            return clean_text(value)
        case SpecKind.OPTIONAL_TEXT:
            return None if value is None else clean_text(value)
        case SpecKind.PRIORITY:
            return int(value)
        case SpecKind.ENGINE_TIME:
            return None if value is None else to_unix(value, f"template.{f.name}")
        case SpecKind.DURATION:
            return optional_ns(value)
        case SpecKind.FIXED_START:
            return None if value is None else _fixed_start_to_json(f.name, value, to_unix)
        case SpecKind.RETRY:
            return None if value is None else retry_to_json(value)
        case SpecKind.DEPS:
            return [dep_to_json(d) for d in value]
        case SpecKind.RESOURCES:
            return resources_to_json(value)
        case SpecKind.STRINGS:
            return [clean_text(s) for s in value]
        case SpecKind.BYTES:
            raise TypeError(f"template.{f.name}: bytes have no JSON member")
        case _:
            unhandled(f.kind, "spec kind")


def _fixed_start_to_json(
    name: str, fixed: FixedStart, to_unix: Callable[[int, str], int]
) -> dict[str, object]:
    return {
        "at_unix_ns": to_unix(fixed.at, f"template.{name}.at"),
        "tolerance_ns": duration_to_ns(fixed.tolerance),
        "on_miss": encode_miss_policy(fixed.on_miss),
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
    try:
        members = {f.name: _from_json(base, f, obj, name, path) for f, name in _IN_TEMPLATE}
        return TaskSpec(payload, **members)  # type: ignore[arg-type]
    except DecodeError:
        raise
    except ValueError as exc:
        raise rejected(path, exc) from exc


def _from_json(
    base: TimeBase, f: SpecField, obj: dict[str, object], name: str, path: str
) -> object:
    """One field from its member, by its kind: an absent member is the domain default; a
    ``null`` one is ``None`` where the field may be ``None``, else refused."""
    default = getattr(_DEFAULT_SPEC, f.name)
    match f.kind:
        case SpecKind.TEXT:
            return member(obj, name, path, as_str, default)
        case SpecKind.OPTIONAL_TEXT:
            return nullable(obj, name, path, as_str)
        case SpecKind.PRIORITY:
            return member(obj, name, path, _priority_from_json, default)
        case SpecKind.ENGINE_TIME:
            at = nullable(obj, name, path, as_bigint)
            return None if at is None else engine_time(base, at)
        case SpecKind.DURATION:
            return nullable(obj, name, path, as_ns)
        case SpecKind.FIXED_START:
            return nullable(obj, name, path, lambda v, p: _fixed_start_from_json(base, v, p))
        case SpecKind.RETRY:
            return nullable(obj, name, path, retry_from_json)
        case SpecKind.DEPS:
            return member(obj, name, path, deps_from_json, default)
        case SpecKind.RESOURCES:
            return member(obj, name, path, resources_from_json, default)
        case SpecKind.STRINGS:
            return member(obj, name, path, strings_from_json, default)
        case SpecKind.BYTES:
            raise TypeError(f"{path}.{name}: bytes have no JSON member")
        case _:
            unhandled(f.kind, "spec kind")
