"""Task and recurring rows to and from domain values, by column name.

The one module that knows what each column of ``cronoq_tasks`` and ``cronoq_recurring``
holds: the column lists come from :mod:`cronoq_store._schema`, the statements select and
insert by them (:mod:`cronoq_store._statements`), the fold encodes with
:func:`insert_row`, recovery and the look-ups decode with :class:`LiveTasks`,
:func:`recurring_schedule` and :func:`task_record`.

Decoders take one parameter per column, named after it, and are called with the row
unpacked (``LiveTasks(base).decode(*row)``): the statement selects the columns in the order of
those parameters (:data:`LIVE_COLUMNS` is read from the signature), so every value is
matched by name, for the cost of one call. A look-up by attribute per column cost about 30%
of recovery at a million rows. The encoder builds one list literal in :data:`INSERT_COLUMNS`
order, each value commented with its column (the fold's hot path): the names of that order
are checked at import, the values column by column in ``tests/test_rows.py``.
:func:`_check_columns` refuses, at import, a column list that the schema and these
functions do not agree on, so a column added to the schema fails here until it is mapped.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Boolean, Integer, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeEngine

from ._codec import (
    clean_text,
    decode_deps,
    decode_miss_policy,
    decode_resources,
    decode_retry,
    decode_strings,
    duration_to_ns,
    encode_deps,
    encode_miss_policy,
    encode_resources,
    encode_retry,
    encode_strings,
    engine_time,
    ns_to_duration,
)
from ._domain import (
    LIVE_STATUS_NAMES,
    QUEUED,
    UNIX_EPOCH,
    FixedStart,
    Priority,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from ._mutations import Submitted
from ._results import RecoveredRecurring, RecoveredTask, TaskRecord
from ._schema import recurring, tasks
from ._template_codec import decode_recurring

__all__ = [
    "IDENTITY_COLUMNS",
    "INSERT_COLUMNS",
    "INSERT_POSITION",
    "JSON_COLUMNS",
    "LIVE_COLUMNS",
    "RECORD_COLUMNS",
    "RECURRING_COLUMNS",
    "SHARED_VALUES",
    "STATE_COLUMNS",
    "UPDATE_PARAMS",
    "LiveTasks",
    "StatusUpdates",
    "insert_row",
    "recurring_schedule",
    "same_task",
    "set_state",
    "task_record",
    "transposed",
]

#: Columns written by later commits, never by the insert of a new task.
_LATER_COLUMNS = frozenset({"output"})
#: The columns a new task is inserted with, in table order; each names its parameter.
INSERT_COLUMNS: tuple[str, ...] = tuple(c.name for c in tasks.c if c.name not in _LATER_COLUMNS)
#: Where each insert column sits in an insert row (what COPY takes).
INSERT_POSITION: dict[str, int] = {name: i for i, name in enumerate(INSERT_COLUMNS)}
#: Task and recurring columns of type jsonb: sent as JSON text and cast in SQL, and read as
#: text (the dialect would ``json.loads`` every value, several times slower than decoding
#: once where the values are used).
JSON_COLUMNS = frozenset(
    c.name for table in (tasks, recurring) for c in table.c if isinstance(c.type, JSONB)
)
#: A task's state, the columns its transitions write.
STATE_COLUMNS: tuple[str, ...] = ("status", "terminal", "attempt", "updated_unix_ns", "message")
#: The columns that make a task what it is: equal in a retried ``Submitted``, so a stored row
#: that differs in any of them under the same id is another task (the rest is its state).
IDENTITY_COLUMNS: tuple[str, ...] = tuple(
    name for name in INSERT_COLUMNS if name != "id" and name not in STATE_COLUMNS
)
_IDENTITY = tuple(INSERT_POSITION[name] for name in IDENTITY_COLUMNS)
_JSON_IDENTITY = frozenset(INSERT_POSITION[n] for n in IDENTITY_COLUMNS if n in JSON_COLUMNS)
_STATUS, _TERMINAL, _ATTEMPT, _UPDATED, _MESSAGE = (INSERT_POSITION[n] for n in STATE_COLUMNS)

#: ``FixedStart``'s own default, for rows written without a tolerance.
_DEFAULT_TOLERANCE = FixedStart(0).tolerance
#: The columns of a live row that recovery does not need: ``terminal`` is false, and the
#: latest transition's time and message are not part of a ``RecoveredTask``.
_NOT_RECOVERED = frozenset({"terminal", "updated_unix_ns", "message"})


# --- new tasks ------------------------------------------------------------------------------


def insert_row(m: Submitted, to_unix: Callable[[int, str], int], now_unix_ns: int) -> list[Any]:
    """``m`` as an insert row (:data:`INSERT_COLUMNS` order), queued at ``now_unix_ns``.

    Engine times go through ``to_unix`` (:func:`~cronoq_store._codec.unix_converter`), every
    string through ``clean_text``. One list literal: assigning 25 positions by name costs
    the fold 12% (measured); the order is checked against :data:`INSERT_COLUMNS` at import
    and by ``tests/test_rows.py`` value by value.
    """
    s = m.spec
    fixed, key, tenant = s.fixed_start, s.key, s.tenant
    deadline, hint, timeout = s.deadline, s.duration_hint, s.timeout
    return [
        m.id,  # id
        m.seq,  # seq
        to_unix(m.arrival, "arrival"),  # arrival_unix_ns
        clean_text(s.pool),  # pool
        clean_text(s.kind),  # kind
        int(s.priority),  # priority
        None if key is None else clean_text(key),  # key
        s.payload,  # payload
        None if deadline is None else to_unix(deadline, "deadline"),  # deadline_unix_ns
        None if fixed is None else to_unix(fixed.at, "fixed_start.at"),  # fixed_at_unix_ns
        None if fixed is None else duration_to_ns(fixed.tolerance),  # fixed_tolerance_ns
        None if fixed is None else encode_miss_policy(fixed.on_miss),  # fixed_on_miss
        None if hint is None else duration_to_ns(hint),  # duration_hint_ns
        None if timeout is None else duration_to_ns(timeout),  # timeout_ns
        encode_retry(s.retry),  # retry
        encode_deps(s.deps),  # deps
        encode_resources(s.resources),  # resources
        encode_strings(s.tags),  # tags
        QUEUED,  # status
        False,  # terminal
        0,  # attempt
        now_unix_ns,  # updated_unix_ns
        None,  # message
        encode_strings(s.labels),  # labels
        None if tenant is None else clean_text(tenant),  # tenant
    ]


#: The column of each value :func:`insert_row` writes, in its order (checked at import).
_INSERT_ROW_ORDER = (
    "id", "seq", "arrival_unix_ns", "pool", "kind", "priority", "key", "payload",
    "deadline_unix_ns", "fixed_at_unix_ns", "fixed_tolerance_ns", "fixed_on_miss",
    "duration_hint_ns", "timeout_ns", "retry", "deps", "resources", "tags", "status",
    "terminal", "attempt", "updated_unix_ns", "message", "labels", "tenant",
)  # fmt: skip


def set_state(
    row: list[Any], status: str, terminal: bool, attempt: int, at: int, message: str | None
) -> None:
    """Give an insert row a task's latest state (a task born and moved in one batch)."""
    row[_STATUS], row[_TERMINAL], row[_ATTEMPT] = status, terminal, attempt
    row[_UPDATED], row[_MESSAGE] = at, message


def same_task(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two insert rows are the same task, as the insert's conflict check decides:
    JSON by value, as jsonb compares (an object's key order does not count)."""
    return all(
        a[c] == b[c]
        or (
            c in _JSON_IDENTITY
            and a[c] is not None
            and b[c] is not None
            and json.loads(a[c]) == json.loads(b[c])
        )
        for c in _IDENTITY
    )


def transposed(rows: Sequence[Sequence[Any]]) -> dict[str, list[Any]]:
    """Insert rows as one list per column, by column name (the insert's array parameters)."""
    if not rows:
        return {name: [] for name in INSERT_COLUMNS}
    return dict(zip(INSERT_COLUMNS, map(list, zip(*rows, strict=True)), strict=True))


# --- transitions of stored tasks ------------------------------------------------------------


@dataclass(slots=True)
class StatusUpdates:
    """The parameters of ``statements.update_status``, one element per task: the one
    declaration of them. Each field is a bind name of the statement, an array with its
    element's SQL type (``metadata["sql"]``); the statement's arrays
    (:func:`update_param_types`), the fold's columns and the in-memory store's rule all
    derive from it. ``levels`` is
    :func:`~cronoq_store._domain.level` of each transition; ``message_levels`` and
    ``message_ats`` the position of the transition that brought ``messages`` (``None``:
    no message, the stored one stays)."""

    ids: list[int] = field(default_factory=list, metadata={"sql": BigInteger()})
    statuses: list[str] = field(default_factory=list, metadata={"sql": Text()})
    terminals: list[bool] = field(default_factory=list, metadata={"sql": Boolean()})
    attempts: list[int] = field(default_factory=list, metadata={"sql": Integer()})
    updated: list[int] = field(default_factory=list, metadata={"sql": BigInteger()})
    levels: list[int] = field(default_factory=list, metadata={"sql": BigInteger()})
    messages: list[str | None] = field(default_factory=list, metadata={"sql": Text()})
    message_levels: list[int | None] = field(default_factory=list, metadata={"sql": BigInteger()})
    message_ats: list[int | None] = field(default_factory=list, metadata={"sql": BigInteger()})

    def params(self) -> dict[str, list[Any]]:
        """The statement's parameters, by bind name."""
        return {name: getattr(self, name) for name in UPDATE_PARAMS}

    @classmethod
    def of(cls, params: Mapping[str, list[Any]]) -> StatusUpdates:
        """The parameters :meth:`params` gave."""
        return cls(*(params[name] for name in UPDATE_PARAMS))


#: The bind names of ``update_status``, in :class:`StatusUpdates` order.
UPDATE_PARAMS: tuple[str, ...] = tuple(f.name for f in fields(StatusUpdates))


def update_param_types() -> list[tuple[str, TypeEngine[Any]]]:
    """Each ``update_status`` parameter with its elements' SQL type."""
    return [(f.name, f.metadata["sql"]) for f in fields(StatusUpdates)]


# --- recovery -------------------------------------------------------------------------------


#: Distinct values each cache of a :class:`LiveTasks` keeps: pools, kinds, tenants, retry
#: policies and tag lists repeat from task to task, a few hundred of each at most; beyond
#: the limit values are decoded as they come, so unique values cost no cache memory.
SHARED_VALUES = 4096


class _Shared(dict[Any, Any]):
    """Values by the stored value they decode from: each decoded once and then shared by
    every task that stores it. The hit is a plain dict look-up (``__missing__`` runs only
    on a miss); what ``decode`` raises propagates and caches nothing."""

    __slots__ = ("_decode",)

    def __init__(self, decode: Callable[[Any], Any]) -> None:
        super().__init__()
        self._decode = decode

    def __missing__(self, stored: Any) -> Any:
        value = self._decode(stored)
        if len(self) < SHARED_VALUES:
            self[stored] = value
        return value


def _same(value: Any) -> Any:
    return value


class LiveTasks:
    """Decodes the live task rows of one recovery: ``LiveTasks(base).decode(*row)``.

    A million recovered tasks stay in memory together, and most of what they hold repeats:
    equal strings (pool, kind, tenant) are kept once instead of once per row, and equal
    stored values of immutable fields (durations, retry policies, tag and label lists,
    dependencies, priorities) are decoded once and the value shared: 1.6x faster decoding,
    and 740 MiB instead of 1,050 for a million tasks (docs/performance.md). ``resources``
    is decoded once per stored value too, and ``TaskSpec`` keeps a private copy of it.
    Every row is checked as before, by the codec and the domain: an undecodable value
    raises ``ValueError`` naming its column for every row that stores it (a failed decode
    is never cached).
    """

    __slots__ = (
        "_base",
        "_deps",
        "_durations",
        "_labels",
        "_priorities",
        "_resources",
        "_retries",
        "_strings",
        "_tags",
    )

    def __init__(self, base: TimeBase) -> None:
        self._base = base
        self._strings = _Shared(_same)
        self._durations = _Shared(ns_to_duration)
        self._priorities = _Shared(Priority.from_stored)
        self._retries = _Shared(decode_retry)
        self._deps = _Shared(decode_deps)
        self._resources = _Shared(decode_resources)
        self._tags = _Shared(lambda text: decode_strings(text, "tags"))
        self._labels = _Shared(lambda text: decode_strings(text, "labels"))

    def decode(
        self,
        id: int,
        seq: int,
        arrival_unix_ns: int,
        pool: str,
        kind: str,
        priority: int,
        key: str | None,
        payload: bytes,
        deadline_unix_ns: int | None,
        fixed_at_unix_ns: int | None,
        fixed_tolerance_ns: int | None,
        fixed_on_miss: str | None,
        duration_hint_ns: int | None,
        timeout_ns: int | None,
        retry: str | None,
        deps: str,
        resources: str,
        tags: str,
        status: str,
        attempt: int,
        labels: str,
        tenant: str | None,
    ) -> RecoveredTask:
        """A live task row (:data:`LIVE_COLUMNS`) as the scheduler's value; ``ValueError``
        names what is wrong. A row the domain would refuse as a submission (an empty pool,
        a negative seq or id) is refused here too.

        Long for a reason: recovery's per-row decoder, one frame with no call per column."""
        if status not in LIVE_STATUS_NAMES and TaskStatus.from_stored(status) is not None:
            # A finished status on a row marked live: which of the two is wrong cannot be
            # told. A name this build does not know is a newer build's live status: the task
            # stays live.
            raise ValueError(f"status: {status!r} is the status of a finished task, on a live row")
        base, strings, durations = self._base, self._strings, self._durations
        fixed = None
        if fixed_at_unix_ns is not None:
            fixed = FixedStart(
                at=engine_time(base, fixed_at_unix_ns),
                tolerance=(
                    _DEFAULT_TOLERANCE
                    if fixed_tolerance_ns is None
                    else durations[fixed_tolerance_ns]
                ),
                on_miss=decode_miss_policy(fixed_on_miss),
            )
        spec = TaskSpec(
            payload,
            kind=strings[kind],
            pool=strings[pool],
            priority=self._priorities[priority],
            key=key,
            deadline=(None if deadline_unix_ns is None else engine_time(base, deadline_unix_ns)),
            fixed_start=fixed,
            duration_hint=None if duration_hint_ns is None else durations[duration_hint_ns],
            timeout=None if timeout_ns is None else durations[timeout_ns],
            retry=None if retry is None else self._retries[retry],
            deps=self._deps[deps],
            resources=self._resources[resources],
            tags=self._tags[tags],
            labels=self._labels[labels],
            tenant=None if tenant is None else strings[tenant],
        )
        if seq < 0:
            raise ValueError(f"seq: must be an integer in 0..2**63-1, got {seq}")
        if id < 0:
            raise ValueError(f"id: must be a task id in 0..2**63-1, got {id}")
        return RecoveredTask(
            id=TaskId(id),
            seq=seq,
            arrival=engine_time(base, arrival_unix_ns),
            spec=spec,
            attempt=max(attempt, 0),
        )


def recurring_schedule(
    base: TimeBase,
    name: str,
    spec: str,
    template_payload: bytes,
    next_unix_ns: int | None,
    last_task_id: int | None,
) -> RecoveredRecurring:
    """A schedule row (:data:`RECURRING_COLUMNS`) as the scheduler's value; ``ValueError``
    names what is wrong."""
    if last_task_id is not None and last_task_id < 0:
        raise ValueError(f"last_task_id: must be a task id in 0..2**63-1, got {last_task_id}")
    return RecoveredRecurring(
        spec=decode_recurring(base, name, spec, template_payload),
        next=None if next_unix_ns is None else engine_time(base, next_unix_ns),
        last=None if last_task_id is None else TaskId(last_task_id),
    )


# --- look-ups -------------------------------------------------------------------------------


def task_record(
    id: int,
    key: str | None,
    pool: str,
    kind: str,
    priority: int,
    tenant: str | None,
    status: str,
    attempt: int,
    message: str | None,
    output: bytes | None,
    updated_unix_ns: int,
) -> TaskRecord:
    """A task row (:data:`RECORD_COLUMNS`, e.g. ``task_record(*row)``) as a ``TaskRecord``:
    what ``get_task`` and ``list_finished`` return, and what an operator's listing shows."""
    return TaskRecord(
        id=TaskId(id),
        key=key,
        pool=pool,
        kind=kind,
        priority=Priority.from_stored(priority),
        tenant=tenant,
        status=TaskStatus.from_stored(status),
        attempt=max(attempt, 0),
        message=message,
        output=output,
        updated=UNIX_EPOCH + timedelta(microseconds=max(updated_unix_ns, 0) // 1000),
    )


# --- the column lists the decoders read, checked against the schema --------------------------


def _parameters(decoder: Callable[..., object], skip: int = 0) -> tuple[str, ...]:
    """The column names a decoder takes, in order (after ``skip`` leading arguments)."""
    return tuple(inspect.signature(decoder).parameters)[skip:]


def _check_columns(
    what: str, mapped: Sequence[str], expected: Iterable[str], *, ordered: bool = False
) -> None:
    """Refuse, at import, columns that this module and the schema do not agree on: the same
    names, in the same order too where ``ordered`` (a positional row)."""
    expected = tuple(expected)
    if tuple(mapped) == expected if ordered else set(mapped) == set(expected):
        return
    missing = sorted(set(expected) - set(mapped))
    unknown = sorted(set(mapped) - set(expected))
    raise RuntimeError(
        f"cronoq_store._rows: {what} maps columns {list(mapped)}, the schema has "
        f"{list(expected)} (not mapped: {missing}, not in the schema: {unknown})"
    )


#: What recovery reads of a live task, in the order :meth:`LiveTasks.decode` takes it.
LIVE_COLUMNS: tuple[str, ...] = _parameters(LiveTasks.decode, skip=1)
#: What a ``TaskRecord`` is made of, in the order :func:`task_record` takes it.
RECORD_COLUMNS: tuple[str, ...] = _parameters(task_record)
#: A recurring schedule row, in the order :func:`recurring_schedule` takes it.
RECURRING_COLUMNS: tuple[str, ...] = _parameters(recurring_schedule, skip=1)

_check_columns("insert_row", _INSERT_ROW_ORDER, INSERT_COLUMNS, ordered=True)
_check_columns(
    "LiveTasks.decode", LIVE_COLUMNS, (n for n in INSERT_COLUMNS if n not in _NOT_RECOVERED)
)
_check_columns("recurring_schedule", RECURRING_COLUMNS, (c.name for c in recurring.c))
_check_columns(
    "task_record",
    ["updated" if n == "updated_unix_ns" else n for n in RECORD_COLUMNS],
    (f.name for f in fields(TaskRecord)),
)
