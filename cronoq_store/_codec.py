"""JSON encodings of the task columns, and the conversions every stored value needs.

The shapes written here are the storage format (docs/storage-format.md): rows outlive the
build that wrote them and may be written by hand, so decoding is strict about the members
it knows (a bad value raises :class:`DecodeError` naming the exact member), tolerant of
members it does not (a newer build may have added them), and fills in the domain default
for a member that is absent and for a name a newer build may have added (a miss policy or
a dependency condition). Encoders write every member, so stored rows are explicit. Any
JSON decodes or raises ``DecodeError``: nesting too deep for the parser included.

Pure functions without SQLAlchemy, so they can be tested and reused without a database.
Units in JSON: times are Unix nanoseconds (``*_unix_ns``), durations integer nanoseconds
(``*_ns``); the domain's engine times are converted through a :class:`TimeBase`.
The recurring spec's JSON, built from these helpers, is :mod:`cronoq_store._codec`.

The recurring schedule's codec: ``cronoq_recurring.spec`` as JSON.

The spec column holds the schedule and the task template without its payload, in the
storage format's shapes (docs/storage-format.md), decoded as strictly as the task columns
(:mod:`cronoq_store._codec`). The template's members are derived from
:data:`~cronoq_store._domain.SPEC_FIELDS`, each encoded and decoded by its field's kind, so
a ``TaskSpec`` field is in the template as soon as it is declared.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from enum import Enum
from functools import lru_cache
from typing import Any, TypeVar

from ._domain import (
    I64_MAX,
    I64_MIN,
    SPEC_FIELDS,
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringSpec,
    RetryPolicy,
    Schedule,
    SpecField,
    SpecKind,
    TaskId,
    TaskSpec,
    TimeBase,
    clean_text,
    show,
    unhandled,
)

__all__ = ["TEMPLATE_MEMBERS", "decode_recurring", "encode_recurring"]


_orjson_dumps: Callable[[object], bytes] | None
try:
    from orjson import dumps as _orjson_dumps
except ImportError:  # pragma: no cover - the optional "json" extra
    _orjson_dumps = None

__all__ = [
    "QUARANTINE_PREFIX",
    "QUARANTINE_REASON_CHARS",
    "DecodeError",
    "clean_text",
    "decode_deps",
    "decode_miss_policy",
    "decode_resources",
    "decode_retry",
    "decode_strings",
    "duration_to_ns",
    "encode_deps",
    "encode_miss_policy",
    "encode_resources",
    "encode_retry",
    "encode_strings",
    "ns_to_duration",
    "quarantine_reason",
    "unix_converter",
]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=Enum)

QUARANTINE_PREFIX = "corrupt task row:"
"""How the message of a task row that recovery quarantined begins (the CLI counts them)."""
QUARANTINE_REASON_CHARS = 500
"""Longest reason kept in a quarantined row's message (after :data:`QUARANTINE_PREFIX`)."""

_MICROSECOND = timedelta(microseconds=1)
_SHOWN_CHARS = 60
"""Longest rendering of a bad value in an error message, which may end up stored."""
_SHOWN_DEPTH = 3
"""Levels of a bad JSON value rendered in a message; deeper ones show as ``[…]``."""

_DEFAULT_RETRY = RetryPolicy()
_DEFAULT_CONDITION = Dependency(TaskId(0)).condition
_MISS_POLICIES = {p.value: p for p in MissPolicy}


class DecodeError(ValueError):
    """A stored value that this build cannot decode; the message names the member."""


def quarantine_reason(exc: Exception) -> str:
    """Why a task row could not be decoded, as storable text: at most
    :data:`QUARANTINE_REASON_CHARS` characters (a longer one cut, ending in "…"), cleaned.

    A ``ValueError`` (``DecodeError`` included) names the field; anything else is a failure
    of this build on an odd value and says what it was. Both stores quarantine with it.
    """
    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    if len(reason) > QUARANTINE_REASON_CHARS:
        reason = reason[: QUARANTINE_REASON_CHARS - 1] + "…"
    return clean_text(reason)


def unix_converter(base: TimeBase) -> Callable[[int, str], int]:
    """``base.to_unix`` for values bound for a ``*_unix_ns`` BIGINT: a result outside
    -2**63..2**63-1 raises ``ValueError`` naming ``field`` (the caller's name for it).

    An engine time that fits 64 bits may still leave them once converted, and a value the
    database refuses would fail every mutation of its batch, not just its own.
    """
    offset = base.unix_ns - base.engine_ns

    def to_unix(engine_ns: int, field: str) -> int:
        unix_ns = engine_ns + offset
        if I64_MIN <= unix_ns <= I64_MAX:
            return unix_ns
        raise ValueError(
            f"{field}: engine time {engine_ns} is {show(unix_ns)} Unix ns through {base!r}, "
            "outside the BIGINT range -2**63..2**63-1"
        )

    return to_unix


def engine_time(base: TimeBase, unix_ns: int) -> int:
    """The engine time (ns) of a stored Unix time (ns), saturated to -2**63..2**63-1.

    A stored BIGINT time is valid whatever the reader's clock; only the reader's base can push
    it out of the 64 bits the domain takes (a wall clock still near 1970, as on a machine
    without a real-time clock before NTP, puts ``2**63-1`` beyond them). Such a time is
    centuries away through that base, so its bound means the same, and a valid row is never
    refused, nor quarantined, for the reader's own time base.
    """
    engine_ns = base.from_unix(unix_ns)
    if engine_ns > I64_MAX:
        return I64_MAX
    return max(engine_ns, I64_MIN)


def duration_to_ns(td: timedelta) -> int:
    """Integer nanoseconds of a timedelta, for the ``*_ns`` BIGINT columns and members.

    Exact for every duration below 2**63 ns (about 292 years); longer ones are stored as
    2**63 - 1, which no real timeout or backoff reaches.
    """
    return min(td // _MICROSECOND * 1000, I64_MAX)


def ns_to_duration(ns: int) -> timedelta:
    """The timedelta of a stored integer nanosecond count (truncated to microseconds)."""
    return timedelta(microseconds=ns // 1000)


def encode_miss_policy(policy: MissPolicy) -> str:
    """The name stored in ``fixed_on_miss``."""
    return policy.value


def decode_miss_policy(name: str | None) -> MissPolicy:
    """Decode ``fixed_on_miss``; NULL and names this build does not know (a newer build's)
    mean the default, :attr:`MissPolicy.SKIP`, as in the original store."""
    return MissPolicy.SKIP if name is None else _MISS_POLICIES.get(name, MissPolicy.SKIP)


def encode_retry(retry: RetryPolicy | None) -> str | None:
    """JSON for the ``retry`` column; ``None`` (SQL NULL) when there is no policy."""
    return None if retry is None else _retry_json(retry)


# Policies and tag lists repeat from task to task, and are immutable and hashable: their
# JSON is made once (equal policies encode alike: the multiplier is always a float).
@lru_cache(maxsize=1024)
def _retry_json(retry: RetryPolicy) -> str:
    return dumps(retry_to_json(retry))


def decode_retry(text: str | None) -> RetryPolicy | None:
    """Decode the ``retry`` column; SQL NULL and JSON ``null`` both mean no policy."""
    if text is None:
        return None
    value = loads(text, "retry")
    return None if value is None else retry_from_json(value, "retry")


def encode_deps(deps: Iterable[Dependency]) -> str:
    """JSON for the ``deps`` column: an array of ``{"id"|"key": ..., "on": ...}``."""
    items = [dep_to_json(d) for d in deps]
    return _dumps_plain(items) if items else "[]"


def decode_deps(text: str) -> tuple[Dependency, ...]:
    """Decode the ``deps`` column."""
    if text == "[]":  # by far the most common value
        return ()
    return deps_from_json(loads(text, "deps"), "deps")


def encode_resources(resources: Mapping[str, int]) -> str:
    """JSON for the ``resources`` column: an object of name -> amount."""
    return _dumps_plain(resources_to_json(resources)) if resources else "{}"


def decode_resources(text: str) -> dict[str, int]:
    """Decode the ``resources`` column."""
    if text == "{}":
        return {}
    return resources_from_json(loads(text, "resources"), "resources")


def encode_strings(values: Iterable[str]) -> str:
    """JSON for the ``tags`` and ``labels`` columns: an array of strings."""
    if values == ():
        return "[]"
    if isinstance(values, tuple):  # what a TaskSpec holds
        return _strings_json(values)
    items = [clean_text(s) for s in values]
    return dumps(items) if items else "[]"


@lru_cache(maxsize=4096)
def _strings_json(values: tuple[str, ...]) -> str:
    return dumps([clean_text(s) for s in values])


def decode_strings(text: str, field: str) -> tuple[str, ...]:
    """Decode the ``tags`` or ``labels`` column; ``field`` names it in errors."""
    if text == "[]":
        return ()
    return strings_from_json(loads(text, field), field)


# Encoding helpers. Every string is cleaned: a NUL would reach jsonb as "\u0000", and a
# lone surrogate cannot be sent as UTF-8 at all.


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _dumps_plain(value: object) -> str:
    """:func:`dumps` of strings, integers, lists and dicts (no floats: orjson writes NaN
    as null), with orjson when installed (the ``json`` extra): the same text, 5 to 20
    times faster for the small values of each row. An integer beyond 64 bits, which orjson
    refuses, goes through ``json`` as before."""
    if _orjson_dumps is not None:
        try:
            return _orjson_dumps(value).decode()
        except TypeError:
            pass
    return dumps(value)


def optional_ns(td: timedelta | None) -> int | None:
    return None if td is None else duration_to_ns(td)


def retry_to_json(retry: RetryPolicy) -> dict[str, object]:
    return {
        "max_attempts": retry.max_attempts,
        "backoff_ns": duration_to_ns(retry.backoff),
        "max_backoff_ns": optional_ns(retry.max_backoff),
        "multiplier": retry.multiplier,
    }


def dep_to_json(dep: Dependency) -> dict[str, object]:
    target = dep.target
    if isinstance(target, str):
        return {"key": clean_text(target), "on": dep.condition.value}
    return {"id": target, "on": dep.condition.value}


def resources_to_json(resources: Mapping[str, int]) -> dict[str, int]:
    return {clean_text(name): amount for name, amount in resources.items()}


# Decoding helpers. Each takes the value and its path (such as "deps[2].id") for messages.


def _show(value: object) -> str:
    """A decoded JSON value for a message, bounded: rendered at most a few levels deep (it
    may be nested too deep for any recursive encoder) and no huge integer in decimal."""
    shown = _render(value, _SHOWN_DEPTH)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 1] + "…"


def _render(value: object, depth: int) -> str:
    if isinstance(value, (list, dict)):
        if not value:
            return "[]" if isinstance(value, list) else "{}"
        if depth == 0:
            return "[…]" if isinstance(value, list) else "{…}"
        parts: list[str] = []
        used = 0
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for name, item in items:
            if used > _SHOWN_CHARS:
                parts.append("…")
                break
            part = _render(item, depth - 1)
            if isinstance(value, dict):
                part = f"{_render(name, 0)}: {part}"
            parts.append(part)
            used += len(part) + 2
        inner = ", ".join(parts)
        return f"[{inner}]" if isinstance(value, list) else f"{{{inner}}}"
    if isinstance(value, str):
        return json.dumps(value[: _SHOWN_CHARS + 1], ensure_ascii=False)
    if type(value) is int:
        return show(value)
    return json.dumps(value)  # null, true, false or a float


def mismatch(path: str, expected: str, value: object) -> DecodeError:
    return DecodeError(f"{path}: expected {expected}, got {_show(value)}")


def rejected(path: str, exc: ValueError) -> DecodeError:
    # Domain messages start with the field name, so the path is the enclosing object's.
    return DecodeError(f"{path}.{exc}")


def loads(text: str, path: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:  # also integers of more than 4300 digits
        raise DecodeError(f"{path}: invalid JSON ({exc})") from None
    except RecursionError:  # any jsonb may be nested deeper than the parser goes
        raise DecodeError(f"{path}: JSON nested too deeply to decode") from None


def as_object(value: object, path: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise mismatch(path, "an object", value)
    return value


def _as_array(value: object, path: str) -> list[object]:
    if not isinstance(value, list):
        raise mismatch(path, "an array", value)
    return value


def as_int(value: object, path: str) -> int:
    if type(value) is not int:  # JSON decoding makes exact ints; this also rejects bool
        raise mismatch(path, "an integer", value)
    return value


def as_bigint(value: object, path: str) -> int:
    if type(value) is not int or not I64_MIN <= value <= I64_MAX:
        raise mismatch(path, "an integer in -2**63..2**63-1", value)
    return value


def as_ns(value: object, path: str) -> timedelta:
    if type(value) is not int or not 0 <= value <= I64_MAX:
        raise mismatch(path, "a non-negative integer of nanoseconds below 2**63", value)
    return ns_to_duration(value)


def _as_task_id(value: object, path: str) -> TaskId:
    if type(value) is not int or not 0 <= value <= I64_MAX:
        raise mismatch(path, "a task id (an integer in 0..2**63-1)", value)
    return TaskId(value)


def _as_number(value: object, path: str) -> float:
    if type(value) is not int and type(value) is not float:
        raise mismatch(path, "a number", value)
    return value


def as_str(value: object, path: str) -> str:
    if not isinstance(value, str):
        raise mismatch(path, "a string", value)
    return value


def _as_nonempty_str(value: object, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise mismatch(path, "a non-empty string", value)
    return value


def as_name(enum: type[_E], value: object, path: str, default: _E) -> _E:
    """A member of ``enum`` by its name; a name this build does not know is ``default``."""
    if not isinstance(value, str):
        raise mismatch(path, "a string", value)
    try:
        return enum(value)  # a dict lookup in the enum, not a walk over its members
    except ValueError:
        return default


def required(obj: dict[str, object], name: str, path: str) -> object:
    if name not in obj:
        raise DecodeError(f"{path}.{name}: required member is missing")
    return obj[name]


def member(
    obj: dict[str, object],
    name: str,
    path: str,
    decode: Callable[[object, str], _T],
    default: _T,
) -> _T:
    """A member that may be absent (then ``default``) but not null."""
    return decode(obj[name], f"{path}.{name}") if name in obj else default


def nullable(
    obj: dict[str, object], name: str, path: str, decode: Callable[[object, str], _T]
) -> _T | None:
    """An optional value: absent and null both mean ``None``."""
    value = obj.get(name)
    return None if value is None else decode(value, f"{path}.{name}")


def retry_from_json(value: object, path: str) -> RetryPolicy:
    obj = as_object(value, path)
    d = _DEFAULT_RETRY
    try:
        return RetryPolicy(
            max_attempts=member(obj, "max_attempts", path, as_int, d.max_attempts),
            backoff=member(obj, "backoff_ns", path, as_ns, d.backoff),
            max_backoff=nullable(obj, "max_backoff_ns", path, as_ns),
            multiplier=member(obj, "multiplier", path, _as_number, d.multiplier),
        )
    except DecodeError:
        raise
    except ValueError as exc:
        raise rejected(path, exc) from exc


def _dep_from_json(value: object, path: str) -> Dependency:
    obj = as_object(value, path)
    has_id, has_key = "id" in obj, "key" in obj
    if has_id == has_key:
        which = "both" if has_id else "neither"
        raise DecodeError(f'{path}: expected exactly one of "id" and "key", got {which}')
    condition = member(obj, "on", path, _condition_from_json, _DEFAULT_CONDITION)
    if has_id:
        return Dependency(_as_task_id(obj["id"], f"{path}.id"), condition)
    return Dependency(_as_nonempty_str(obj["key"], f"{path}.key"), condition)


def _condition_from_json(value: object, path: str) -> DependencyCondition:
    return as_name(DependencyCondition, value, path, _DEFAULT_CONDITION)


def deps_from_json(value: object, path: str) -> tuple[Dependency, ...]:
    items = _as_array(value, path)
    return tuple(_dep_from_json(item, f"{path}[{i}]") for i, item in enumerate(items))


def resources_from_json(value: object, path: str) -> dict[str, int]:
    obj = as_object(value, path)
    result: dict[str, int] = {}
    for name, amount in obj.items():
        if not name:
            raise DecodeError(f'{path}: expected non-empty resource names, got ""')
        if type(amount) is not int or not 0 <= amount <= I64_MAX:
            raise mismatch(f"{path}[{_show(name)}]", "an integer in 0..2**63-1", amount)
        result[name] = amount
    return result


def strings_from_json(value: object, path: str) -> tuple[str, ...]:
    items = _as_array(value, path)
    return tuple(as_str(item, f"{path}[{i}]") for i, item in enumerate(items))


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
