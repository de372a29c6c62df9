"""The scheduler's domain model: tasks, schedules, ids and time, and their rules.

Kept free of SQLAlchemy so that the scheduler, the codecs and the tests can share these
types without a database. Values are validated once, when built: a bad value caught here
fails the one caller that made it, where the same value reaching the database would fail a
whole commit batch or leave a row that cannot be recovered.

Units: engine times are ``int`` nanoseconds of the scheduler's monotonic clock; durations
are ``datetime.timedelta``; only :class:`TimeBase` and the store see Unix nanoseconds.
Every validation error is a ``ValueError`` whose message starts with the field's name.
Integers are checked against the column that stores them (``BIGINT``, ``INTEGER``), and
text PostgreSQL cannot store follows one rule, :func:`clean_text`, defined here so that the
domain and the codecs share it. The mutations built from these values are
:mod:`cronoq_store._domain`; what the store hands back, :mod:`cronoq_store._results`.

The mutations: the state transitions the scheduler commits, in order, one batch at a time.

Validated when built, as every domain value (:mod:`cronoq_store._domain`): a bad mutation
fails the caller that made it, not the whole batch it would have joined. Each site that
dispatches on :data:`Mutation` is a ``match`` ending in :func:`unhandled`.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from enum import Enum, IntEnum
from typing import NewType, NoReturn, TypeAlias
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

#: A task's id: ``task_id(epoch, n)``, so ids of different leaders never collide.
TaskId = NewType("TaskId", int)

#: The fencing epoch's range: taking the lock after ``EPOCH_MAX`` wraps to ``EPOCH_MIN``.
EPOCH_MIN = 1
#: The largest fencing epoch (ids keep 48 bits for the counter in a signed BIGINT).
EPOCH_MAX = 32767
ID_COUNTER_BITS = 48

I64_MIN = -(1 << 63)
I64_MAX = (1 << 63) - 1
"""Bounds of PostgreSQL's BIGINT: ids, seqs, engine and Unix times, amounts."""
UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
"""Where stored Unix nanoseconds count from, as an aware ``datetime``."""

_COUNTER_MAX = (1 << ID_COUNTER_BITS) - 1
I32_MAX = (1 << 31) - 1
_ZERO = timedelta(0)
_SHOWN_CHARS = 60
_SHOWN_INT_BITS = 256
_ENGINE_TIME = "an engine time in integer nanoseconds in -2**63..2**63-1"
_AMOUNT = "an integer in 0..2**63-1"
# What PostgreSQL cannot store in text or jsonb: NUL, and lone surrogates (not UTF-8).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


INDEXED_TEXT_MAX_BYTES = 2048
"""Most bytes a task key (``TaskSpec.key``) or a schedule name (``RecurringSpec.name``) may
take as stored: UTF-8 after :func:`clean_text` (a NUL becomes U+FFFD, three bytes). These
columns are indexed, and a btree entry holds at most 2704 bytes (``(key, id)`` with its
headers); a value PostgreSQL cannot compress under that fails its whole commit, so one over
this bound is refused when built, with room to spare. Values that only look a key or a name
up (a dependency's target, ``RecurringNext``, ``RecurringRemove``, ``get_task``) are never
inserted in an index and are not bounded: they may name a longer value stored earlier."""
# Below this many characters no string can take more bytes than the bound (4 per character).
_INDEXED_FAST_CHARS = INDEXED_TEXT_MAX_BYTES // 4
_READING_STORED: ContextVar[bool] = ContextVar("cronoq_reading_stored", default=False)


@contextmanager
def reading_stored() -> Iterator[None]:
    """Build values from stored rows: :data:`INDEXED_TEXT_MAX_BYTES` is not applied.

    A row that was stored is storable (PostgreSQL compresses a long value before indexing
    it, and an earlier build had no bound): a tighter bound must never refuse, nor
    quarantine, a row that is already there.
    """
    token = _READING_STORED.set(True)
    try:
        yield
    finally:
        _READING_STORED.reset(token)


def _check_indexed(name: str, value: str) -> None:
    # Callers test ``len(value) > _INDEXED_FAST_CHARS`` inline: short values cost nothing.
    if _READING_STORED.get():
        return
    size = len(clean_text(value).encode("utf-8"))
    if size > INDEXED_TEXT_MAX_BYTES:
        raise ValueError(
            f"{name}: must take at most {INDEXED_TEXT_MAX_BYTES} bytes as stored (UTF-8, NUL "
            f"as U+FFFD), since it is indexed; got {size} bytes: {show(value)}"
        )


def clean_text(s: str) -> str:
    """``s`` as PostgreSQL can store it: NUL and lone surrogates become U+FFFD.

    The one rule for every stored string (text columns, JSON keys and values). Clean ASCII,
    by far the common case, is returned as it is without any regex work.
    """
    if s.isascii():
        return s.replace("\0", "\ufffd") if "\0" in s else s
    return _UNSTORABLE.sub("\ufffd", s)


def show(value: object) -> str:
    """A bounded rendering of ``value`` for error messages, which may end up stored.

    Never recurses into containers (a value nested a thousand deep must not fail the message
    about it) and never converts a huge integer to decimal (CPython refuses beyond 4300
    digits, and the text would be useless anyway).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _SHOWN_INT_BITS:
            return f"an integer of {value.bit_length()} bits"
        return repr(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)} items"
    if isinstance(value, (str, bytes)) and len(value) > _SHOWN_CHARS:
        return repr(value[:_SHOWN_CHARS])[:-1] + "…"
    shown = repr(value)
    return shown if len(shown) <= _SHOWN_CHARS else shown[: _SHOWN_CHARS - 1] + "…"


def invalid(name: str, requirement: str, value: object) -> ValueError:
    return ValueError(f"{name}: must be {requirement}, got {show(value)}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Values are built in bulk: callers test ``type(v) is int`` and the range inline, and call
# these (which also take int subclasses other than bool) only when that fast test fails.


def check_int(name: str, value: object, low: int, high: int, requirement: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(name, requirement, value)


def check_task_id(name: str, value: object) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int in BIGINT's range from 0."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= I64_MAX:
        raise invalid(name, "a task id in 0..2**63-1", value)


def check_engine_time(name: str, value: object) -> None:
    # The store converts it to Unix ns at commit, where the result is checked again.
    check_int(name, value, I64_MIN, I64_MAX, _ENGINE_TIME)


def check_seconds(name: str, value: object, *, most: int | None = None) -> float:
    """``value`` as float seconds, or a ``ValueError`` whose message begins with ``name``
    (a caller's own style: ``"older_than:"``, as the look-ups' arguments): a finite int or
    float (never a bool), above 0; with ``most``, in ``0..most`` instead (an age, where 0
    means now). The one rule for durations given as numbers (settings, timeouts, ages)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if most is None:
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    elif not math.isfinite(value) or not 0 <= value <= most:
        raise ValueError(f"{name} must be a number of seconds in 0..{most}, got {value!r}")
    return float(value)


def _check_duration(name: str, value: object) -> None:
    if not isinstance(value, timedelta) or value < _ZERO:
        raise invalid(name, "a non-negative timedelta", value)


def task_id(epoch: int, n: int) -> TaskId:
    """Id number ``n`` issued under fencing ``epoch``.

    The epoch prefix keeps ids issued by successive leaders apart without coordination, and
    the epoch range keeps every id within a signed BIGINT. The epoch wraps from 32767 to 1,
    after which ``task_id(1, 0)`` may name an old task: a leader issues ids from
    ``max(recovered.next_id, task_id(epoch, 0))`` upward (see :class:`Recovered`).
    """
    if not EPOCH_MIN <= epoch <= EPOCH_MAX:
        raise invalid("epoch", f"in {EPOCH_MIN}..{EPOCH_MAX}", epoch)
    if not 0 <= n <= _COUNTER_MAX:
        raise invalid("n", f"in 0..2**{ID_COUNTER_BITS}-1", n)
    return TaskId((epoch << ID_COUNTER_BITS) | n)


def epoch_of(task_id: TaskId) -> int:
    """The fencing epoch that issued ``task_id``."""
    return task_id >> ID_COUNTER_BITS


TaskRef: TypeAlias = TaskId | str
"""A task named by its id or by its key."""


class Priority(IntEnum):
    """Scheduling priority; stored as a SMALLINT holding the value."""

    LOW = 0
    """Runs after every other priority."""
    NORMAL = 1
    """The default."""
    HIGH = 2
    """Runs before normal and low."""
    CRITICAL = 3
    """Runs first."""

    @classmethod
    def from_stored(cls, value: int) -> Priority:
        """Decode a stored value; unknown ones (a newer build's) fall back to NORMAL."""
        try:
            return cls(value)
        except ValueError:
            return cls.NORMAL


class TaskStatus(Enum):
    """Outcome of a task's latest transition; the value is the name stored in ``status``."""

    RUNNING = "running"
    """An attempt has started (live)."""
    RETRYING = "retrying"
    """An attempt failed and another one follows after the backoff (live)."""
    SUCCEEDED = "succeeded"
    """Finished: an attempt succeeded; only such a task keeps an output."""
    FAILED = "failed"
    """Finished: its last attempt failed, or the scheduler failed it (a dependency that did
    not succeed, a missed fixed start under :attr:`MissPolicy.FAIL`)."""
    CANCELLED = "cancelled"
    """Finished: cancelled before it succeeded."""
    SKIPPED = "skipped"
    """Finished without running (a missed fixed start under :attr:`MissPolicy.SKIP`)."""
    EXPIRED = "expired"
    """Finished without succeeding: its deadline passed."""

    @property
    def is_terminal(self) -> bool:
        """Whether the task is finished: no transition follows."""
        return self is not TaskStatus.RUNNING and self is not TaskStatus.RETRYING

    @classmethod
    def from_stored(cls, name: str) -> TaskStatus | None:
        """Decode a stored name; ``None`` for names that are not a status (such as ``queued``)."""
        try:
            return cls(name)
        except ValueError:
            return None


QUEUED = "queued"
"""Stored status of a live task that has not started an attempt; not a :class:`TaskStatus`."""

LIVE_STATUS_NAMES = frozenset({QUEUED, TaskStatus.RUNNING.value, TaskStatus.RETRYING.value})
"""Stored status names of tasks that are not finished."""

#: Rank of each live status within an attempt (other stored names rank as queued).
LIVE_RANKS: dict[str, int] = {QUEUED: 0, TaskStatus.RUNNING.value: 1, TaskStatus.RETRYING.value: 2}
#: Levels each attempt spans: more than the live ranks, so attempts never overlap.
RANKS_PER_ATTEMPT = 4
#: Level of every terminal state: above any live one, whatever the attempt (2**31 attempts
#: times :data:`RANKS_PER_ATTEMPT` ranks stay below it).
TERMINAL_LEVEL = 1 << 62


def level(status: str, terminal: bool, attempt: int) -> int:
    """Where a state stands in a task's life: ``attempt * RANKS_PER_ATTEMPT + rank`` while
    live, then :data:`TERMINAL_LEVEL`. A transition moves a task forward when its ``(level,
    at)`` is greater than the stored one and the stored state is not terminal (a terminal
    state is final: no tie-break by time). ``statements.update_status_fenced`` builds the same in
    SQL from these three constants."""
    return TERMINAL_LEVEL if terminal else attempt * RANKS_PER_ATTEMPT + LIVE_RANKS.get(status, 0)


class MissPolicy(Enum):
    """What to do with a fixed-start task whose start window has passed."""

    SKIP = "skip"
    """Do not run it: it finishes as :attr:`TaskStatus.SKIPPED`."""
    RUN = "run"
    """Run it anyway, late."""
    FAIL = "fail"
    """Do not run it: it finishes as :attr:`TaskStatus.FAILED`."""


@dataclass(frozen=True, slots=True)
class FixedStart:
    """Start a task at an exact moment rather than as soon as it is runnable.

    ``at`` is engine time (ns); ``tolerance`` (timedelta) is how late a start still counts
    as on time; ``on_miss`` applies when that window has passed.
    """

    at: int
    tolerance: timedelta = timedelta(seconds=1)
    on_miss: MissPolicy = MissPolicy.SKIP

    def __post_init__(self) -> None:
        check_engine_time("at", self.at)
        _check_duration("tolerance", self.tolerance)
        if not isinstance(self.on_miss, MissPolicy):
            raise invalid("on_miss", "a MissPolicy", self.on_miss)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failed task is tried again and how long to wait in between.

    ``max_attempts`` counts the first try, at most 2**31-1 (attempts are stored as an
    INTEGER). The wait starts at ``backoff`` (timedelta) and is
    multiplied by ``multiplier`` after each failure, up to ``max_backoff`` (timedelta) when set.
    """

    max_attempts: int = 3
    backoff: timedelta = timedelta(seconds=1)
    max_backoff: timedelta | None = None
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        check_int("max_attempts", self.max_attempts, 1, I32_MAX, "an integer in 1..2**31-1")
        _check_duration("backoff", self.backoff)
        if self.max_backoff is not None:
            _check_duration("max_backoff", self.max_backoff)
            if self.max_backoff < self.backoff:
                raise invalid(
                    "max_backoff", f"at least backoff ({self.backoff!r})", self.max_backoff
                )
        m = self.multiplier
        try:
            f = float(m) if _is_int(m) or isinstance(m, float) else math.nan
        except OverflowError:  # an int beyond every float
            f = math.inf
        if not math.isfinite(f) or f < 1:
            raise invalid("multiplier", "a finite number >= 1", m)
        # A float always, so that equal policies compare and encode the same way.
        object.__setattr__(self, "multiplier", f)


class DependencyCondition(Enum):
    """What a dependency waits for."""

    SUCCEEDED = "succeeded"
    """The target must succeed; any other outcome fails the dependent task."""
    FINISHED = "finished"
    """Any terminal status of the target will do."""


@dataclass(frozen=True, slots=True)
class Dependency:
    """A task that must reach ``condition`` before the dependent task may start."""

    target: TaskRef
    condition: DependencyCondition = DependencyCondition.SUCCEEDED

    def __post_init__(self) -> None:
        t = self.target
        if isinstance(t, str):
            if not t:
                raise invalid("target", "a task id or a non-empty key", t)
        else:
            check_task_id("target", t)
        if not isinstance(self.condition, DependencyCondition):
            raise invalid("condition", "a DependencyCondition", self.condition)


def _string_tuple(name: str, values: Iterable[str]) -> tuple[str, ...]:
    if isinstance(values, str):  # a str is an iterable of strings, never what was meant
        raise invalid(name, "a sequence of strings", values)
    result = values if type(values) is tuple else tuple(values)
    for i, s in enumerate(result):
        if not isinstance(s, str):
            raise invalid(f"{name}[{i}]", "a string", s)
    return result


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSpec:
    """Everything needed to run a task, as submitted.

    ``payload`` is positional, every other field keyword-only. Times: ``deadline`` is engine
    time (ns). Durations: ``duration_hint`` (expected run time) and ``timeout`` (limit per
    attempt) are timedeltas. ``deps``, ``tags`` and ``labels`` take any iterable and are kept
    as tuples, ``resources`` as a private dict, so a spec cannot change after it was built;
    ``resources`` is left out of the hash (a dict has none) but not out of equality.
    Amounts are in 0..2**63-1, and no two resource names may be stored as the same name
    (a NUL is stored as U+FFFD, so ``"a\\0"`` and ``"a\\ufffd"`` are one name).
    """

    payload: bytes = field(kw_only=False)
    kind: str = ""
    pool: str = "default"
    priority: Priority = Priority.NORMAL
    key: str | None = None
    """Deduplication key: at most one live task holds a given key."""
    deadline: int | None = None
    fixed_start: FixedStart | None = None
    duration_hint: timedelta | None = None
    timeout: timedelta | None = None
    retry: RetryPolicy | None = None
    deps: Sequence[Dependency] = ()
    resources: Mapping[str, int] = field(default_factory=dict, hash=False)
    """Amount of each named resource one attempt holds while it runs."""
    tags: Sequence[str] = ()
    labels: Sequence[str] = ()
    """Worker labels a worker must carry to run this task."""
    tenant: str | None = None
    """Owner, for fair sharing between tenants."""

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        payload = self.payload
        if type(payload) is not bytes:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise ValueError(f"payload: must be bytes, got {type(payload).__name__}")
            setattr_(self, "payload", bytes(payload))
        if not isinstance(self.kind, str):
            raise invalid("kind", "a string", self.kind)
        if not isinstance(self.pool, str) or not self.pool:
            raise invalid("pool", "a non-empty string", self.pool)
        if type(self.priority) is not Priority:
            try:
                setattr_(self, "priority", Priority(self.priority))
            except ValueError:
                raise invalid("priority", "a Priority", self.priority) from None
        key = self.key
        if key is not None:
            if not isinstance(key, str) or not key:
                raise invalid("key", "None or a non-empty string", key)
            if len(key) > _INDEXED_FAST_CHARS:
                _check_indexed("key", key)
        if self.deadline is not None:
            check_engine_time("deadline", self.deadline)
        if self.fixed_start is not None and not isinstance(self.fixed_start, FixedStart):
            raise invalid("fixed_start", "None or a FixedStart", self.fixed_start)
        if self.duration_hint is not None:
            _check_duration("duration_hint", self.duration_hint)
        if self.timeout is not None:
            _check_duration("timeout", self.timeout)
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise invalid("retry", "None or a RetryPolicy", self.retry)
        deps = self.deps
        if type(deps) is not tuple:
            deps = tuple(deps)
            setattr_(self, "deps", deps)
        for i, d in enumerate(deps):
            if not isinstance(d, Dependency):
                raise invalid(f"deps[{i}]", "a Dependency", d)
        resources = dict(self.resources)  # a private copy: the caller's may change
        merged = False
        for name, amount in resources.items():
            if not isinstance(name, str) or not name:
                raise invalid("resources", "keyed by non-empty strings", name)
            if type(amount) is not int or not 0 <= amount <= I64_MAX:
                check_int(f"resources[{show(name)}]", amount, 0, I64_MAX, _AMOUNT)
            merged = merged or clean_text(name) is not name
        if merged and len({clean_text(name) for name in resources}) < len(resources):
            raise invalid(
                "resources", "keyed by names that stay distinct once stored", list(resources)
            )
        setattr_(self, "resources", resources)
        if self.tags != ():  # the common case needs no work
            setattr_(self, "tags", _string_tuple("tags", self.tags))
        if self.labels != ():
            setattr_(self, "labels", _string_tuple("labels", self.labels))
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise invalid("tenant", "None or a string", self.tenant)


class SpecKind(Enum):
    """How a :class:`TaskSpec` field is stored, encoded in the recurring template and shown:
    every layer that maps fields handles each kind once (``match`` with ``assert_never``),
    so a field of a kind that exists needs nothing beyond its :data:`SPEC_FIELDS` row."""

    BYTES = "bytes"
    """``bytes`` in a BYTEA column, shown as its size; not in the template's JSON."""
    TEXT = "text"
    """``str`` in a TEXT column, cleaned (:func:`clean_text`)."""
    OPTIONAL_TEXT = "optional text"
    """``str | None`` in a nullable TEXT column, cleaned."""
    PRIORITY = "priority"
    """A :class:`Priority` as its value (SMALLINT, a JSON integer)."""
    ENGINE_TIME = "engine time"
    """``int | None`` engine ns, stored as Unix ns (BIGINT ``*_unix_ns``)."""
    DURATION = "duration"
    """``timedelta | None``, stored as integer ns (BIGINT ``*_ns``)."""
    FIXED_START = "fixed start"
    """``FixedStart | None`` in three columns (at, tolerance, miss policy), an object in
    the template."""
    RETRY = "retry"
    """``RetryPolicy | None`` as a JSON object."""
    DEPS = "deps"
    """A tuple of :class:`Dependency` as a JSON array."""
    RESOURCES = "resources"
    """Amounts by resource name as a JSON object."""
    STRINGS = "strings"
    """A tuple of ``str`` as a JSON array."""


@dataclass(frozen=True, slots=True)
class SpecField:
    """Where one :class:`TaskSpec` field lives outside the domain: the one declaration the
    row mapping (``_schema``), the recurring template's JSON (``_codec``), the
    operators' read of a task (``_listing_statements``) and its display (``tasks show``,
    the console's task page) are derived from."""

    name: str
    """The ``TaskSpec`` attribute."""
    kind: SpecKind
    columns: tuple[str, ...]
    """Its columns of ``cronoq_tasks``, one per value the kind stores."""
    member: str | None
    """Its member in the recurring template's JSON; ``None``: a column of its own there."""
    label: str | None
    """What a task's page calls it among the spec's facts; ``None`` for the fields the
    task's record shows (``TaskRecord``: what listings show and filter on)."""
    repeats: bool = True
    """Whether values repeat from task to task, so recovery decodes each stored value once
    and shares it; ``False`` for a value unique to its task, which a cache would only slow."""


#: Every :class:`TaskSpec` field in declaration order, with where it lives (checked at
#: import). Adding a field: the field and its row here, its column (``_schema``), an
#: Alembic revision and docs/storage-format.md.
SPEC_FIELDS: tuple[SpecField, ...] = (
    SpecField("payload", SpecKind.BYTES, ("payload",), None, "payload"),
    SpecField("kind", SpecKind.TEXT, ("kind",), "kind", None),
    SpecField("pool", SpecKind.TEXT, ("pool",), "pool", None),
    SpecField("priority", SpecKind.PRIORITY, ("priority",), "priority", None),
    SpecField("key", SpecKind.OPTIONAL_TEXT, ("key",), "key", None, repeats=False),
    SpecField(
        "deadline", SpecKind.ENGINE_TIME, ("deadline_unix_ns",), "deadline_unix_ns", "deadline"
    ),
    SpecField(
        "fixed_start",
        SpecKind.FIXED_START,
        ("fixed_at_unix_ns", "fixed_tolerance_ns", "fixed_on_miss"),
        "fixed_start",
        "fixed start",
    ),
    SpecField(
        "duration_hint",
        SpecKind.DURATION,
        ("duration_hint_ns",),
        "duration_hint_ns",
        "duration hint",
    ),
    SpecField("timeout", SpecKind.DURATION, ("timeout_ns",), "timeout_ns", "timeout"),
    SpecField("retry", SpecKind.RETRY, ("retry",), "retry", "retry"),
    SpecField("deps", SpecKind.DEPS, ("deps",), "deps", "deps"),
    SpecField("resources", SpecKind.RESOURCES, ("resources",), "resources", "resources"),
    SpecField("tags", SpecKind.STRINGS, ("tags",), "tags", "tags"),
    SpecField("labels", SpecKind.STRINGS, ("labels",), "labels", "labels"),
    SpecField("tenant", SpecKind.OPTIONAL_TEXT, ("tenant",), "tenant", None),
)

if [f.name for f in SPEC_FIELDS] != list(TaskSpec.__dataclass_fields__):
    raise RuntimeError(
        "cronoq_store._domain: SPEC_FIELDS must name every TaskSpec field, in order: "
        f"{[f.name for f in SPEC_FIELDS]} != {list(TaskSpec.__dataclass_fields__)}"
    )


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """Fire at the times a cron expression names, read in ``timezone`` (an IANA name).

    Five fields (minute to weekday) or six (with seconds first). Only the field count is
    checked here; the scheduler parses the fields.
    """

    expr: str
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if not isinstance(self.expr, str) or len(self.expr.split()) not in (5, 6):
            raise invalid("expr", "a cron expression of 5 or 6 fields", self.expr)
        if not isinstance(self.timezone, str):
            raise invalid("timezone", "an IANA time zone name", self.timezone)
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise invalid("timezone", "an IANA time zone name", self.timezone) from None


@dataclass(frozen=True, slots=True)
class IntervalSchedule:
    """Fire every ``every`` (timedelta), counted from the previous occurrence."""

    every: timedelta

    def __post_init__(self) -> None:
        if not isinstance(self.every, timedelta) or self.every <= _ZERO:
            raise invalid("every", "a positive timedelta", self.every)


#: When a recurring task runs: a cron expression or a fixed interval.
Schedule: TypeAlias = CronSchedule | IntervalSchedule


@dataclass(frozen=True, slots=True)
class RecurringSpec:
    """A named schedule that submits a copy of ``template`` at each occurrence."""

    name: str
    schedule: Schedule
    template: TaskSpec

    def __post_init__(self) -> None:
        check_name(self.name)
        if len(self.name) > _INDEXED_FAST_CHARS:  # the primary key: only an upsert inserts it
            _check_indexed("name", self.name)
        if not isinstance(self.schedule, Schedule):  # every type of the alias
            raise invalid("schedule", "a CronSchedule or an IntervalSchedule", self.schedule)
        if not isinstance(self.template, TaskSpec):
            raise invalid("template", "a TaskSpec", self.template)


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise invalid("name", "a non-empty string", name)


@dataclass(frozen=True, slots=True)
class TimeBase:
    """Pairs one engine time (ns) with the Unix time (ns) at that same moment.

    Engine time is monotonic and means nothing outside one process, so the store persists
    only Unix nanoseconds and converts at its boundary with the base of the running engine.
    """

    engine_ns: int
    unix_ns: int

    @classmethod
    def now(cls) -> TimeBase:
        """The base for this process: its monotonic clock against the wall clock."""
        return cls(time.monotonic_ns(), time.time_ns())

    def to_unix(self, engine_ns: int) -> int:
        """Unix time (ns) of an engine time (ns)."""
        return engine_ns - self.engine_ns + self.unix_ns

    def from_unix(self, unix_ns: int) -> int:
        """Engine time (ns) of a Unix time (ns); the exact inverse of :meth:`to_unix`."""
        return unix_ns - self.unix_ns + self.engine_ns


@dataclass(frozen=True, slots=True)
class Submitted:
    """A task was accepted. ``seq`` orders submissions; ``arrival`` is engine time (ns)."""

    id: TaskId
    seq: int
    arrival: int
    spec: TaskSpec

    def __post_init__(self) -> None:
        id_, seq, arrival = self.id, self.seq, self.arrival
        if type(id_) is not int or not 0 <= id_ <= I64_MAX:
            check_task_id("id", id_)
        if type(seq) is not int or not 0 <= seq <= I64_MAX:
            check_int("seq", seq, 0, I64_MAX, "an integer in 0..2**63-1")
        if type(arrival) is not int or not I64_MIN <= arrival <= I64_MAX:
            check_engine_time("arrival", arrival)
        if type(self.spec) is not TaskSpec and not isinstance(self.spec, TaskSpec):
            raise invalid("spec", "a TaskSpec", self.spec)


@dataclass(frozen=True, slots=True)
class StatusChanged:
    """A task moved to ``status`` at engine time ``at`` (ns), in attempt ``attempt``.

    ``message`` explains the transition (an error, a reason to skip); without one the
    task keeps the message of its previous transition.
    """

    id: TaskId
    status: TaskStatus
    attempt: int
    at: int
    message: str | None = None

    def __post_init__(self) -> None:
        id_, attempt, at, message = self.id, self.attempt, self.at, self.message
        if type(id_) is not int or not 0 <= id_ <= I64_MAX:
            check_task_id("id", id_)
        if not isinstance(self.status, TaskStatus):
            raise invalid("status", "a TaskStatus", self.status)
        if type(attempt) is not int or not 0 <= attempt <= I32_MAX:
            check_int("attempt", attempt, 0, I32_MAX, "an integer in 0..2**31-1")
        if type(at) is not int or not I64_MIN <= at <= I64_MAX:
            check_engine_time("at", at)
        if message is not None and not isinstance(message, str):
            raise invalid("message", "None or a string", message)


@dataclass(frozen=True, slots=True)
class RecurringUpsert:
    """A recurring schedule was created or replaced."""

    spec: RecurringSpec


@dataclass(frozen=True, slots=True)
class RecurringRemove:
    """A recurring schedule was deleted."""

    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class RecurringNext:
    """A schedule advanced: its next occurrence (engine time, ns) and the task it last
    submitted, which the next occurrence chains to."""

    name: str
    next: int | None
    last: TaskId | None

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.next is not None:
            check_engine_time("next", self.next)
        if self.last is not None:
            check_task_id("last", self.last)


#: One change a batch commits: a submission, a transition or a schedule change.
Mutation: TypeAlias = Submitted | StatusChanged | RecurringUpsert | RecurringRemove | RecurringNext
"""Every mutation type. Dispatch on it with a ``match`` ending in ``typing.assert_never``:
then ``mypy --strict`` names every site a new type must be handled in."""


def unhandled(value: NoReturn, kind: str = "mutation") -> NoReturn:
    """The last case of every ``match`` on a mutation's (or a schedule's, an action's) type.

    As ``typing.assert_never``: ``mypy --strict`` refuses the call where a type is left
    unhandled ("Argument 1 to "unhandled" has incompatible type ...; expected "NoReturn""),
    so adding a type to :data:`Mutation` lists every site it needs. At run time a value of
    no known type is a ``TypeError`` naming its type (never its contents, which may be
    a payload), as it was before the dispatch was a ``match``.
    """
    raise TypeError(f"not a {kind}: {type(value).__name__}")
