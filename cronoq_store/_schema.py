"""The cluster's tables as one SQLAlchemy ``MetaData``, without a schema name, and their rows
to and from domain values.

Every scheduler cluster lives in its own PostgreSQL schema. The tables here carry no schema,
so one compiled statement serves every cluster: the schema is applied at execution time with
``schema_translate_map`` (see :func:`schema_options`), never pasted into SQL text.

Index design is a throughput lever: every status transition rewrites every index of
``cronoq_tasks`` (``updated_unix_ns`` is indexed, so no update is HOT). Each index below
serves a query the store runs; none is speculative.

Rows, by column name: this is the one module that knows what each column of
``cronoq_tasks`` and ``cronoq_recurring`` holds: the column lists come from the tables, the
statements select and
insert by them (:mod:`cronoq_store._statements`), the fold encodes with
:func:`insert_row`, recovery and the look-ups decode with :class:`LiveTasks`,
:func:`recurring_schedule` and :func:`task_record`.

Decoders take one parameter per column, named after it, and are called with the row
unpacked (``LiveTasks(base).decode(*row)``): the statement selects the columns in the order of
those parameters (:data:`LIVE_COLUMNS`: the task's own, read from the signature, then the
:data:`SPEC_COLUMNS`), so every value is matched by name, for the cost of one call. A
look-up by attribute per column cost about 30% of recovery at a million rows. The spec's
part of both directions is derived from :data:`~cronoq_store._domain.SPEC_FIELDS`, each
field by its kind, and compiled once at import: the encoder is one list literal in
:data:`INSERT_COLUMNS` order (the fold's hot path), the spec decoder one ``TaskSpec`` call.
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

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, OID
from sqlalchemy.sql.expression import ColumnClause
from sqlalchemy.types import TypeEngine

from ._codec import (
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
    encode_resources,
    encode_retry,
    encode_strings,
    engine_time,
    ns_to_duration,
)
from ._config import validate_schema_name
from ._domain import (
    LIVE_STATUS_NAMES,
    QUEUED,
    SPEC_FIELDS,
    UNIX_EPOCH,
    FixedStart,
    Priority,
    SpecField,
    SpecKind,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    unhandled,
)
from ._results import RecoveredRecurring, RecoveredTask, TaskRecord

__all__ = [
    "IDENTITY_COLUMNS",
    "INSERT_COLUMNS",
    "INSERT_POSITION",
    "JSON_COLUMNS",
    "LEADER_ROW_ID",
    "LEGACY_VERSION_TABLE",
    "LIVE_COLUMNS",
    "RECORD_COLUMNS",
    "RECURRING_COLUMNS",
    "SHARED_VALUES",
    "STATE_COLUMNS",
    "UPDATE_PARAMS",
    "VERSION_TABLE",
    "LiveTasks",
    "StatusUpdates",
    "insert_row",
    "leader",
    "leader_history",
    "leader_tableoid",
    "metadata",
    "recurring",
    "recurring_schedule",
    "same_task",
    "schema_options",
    "set_state",
    "task_record",
    "tasks",
    "transposed",
]


#: Alembic's version table, per schema, named so it never collides with an application's own.
VERSION_TABLE = "cronoq_alembic_version"
#: The version table of builds before Alembic (versions 1 to 5), adopted and then dropped
#: by revision 0006.
LEGACY_VERSION_TABLE = "cronoq_schema_version"
#: ``cronoq_leader`` holds exactly one row, with this id.
LEADER_ROW_ID = 1


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

leader = Table(
    "cronoq_leader",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    # Fencing epoch: bumped by every new leader, checked by every commit.
    Column("epoch", Integer, nullable=False, server_default=text("0")),
    # High-water mark of issued task ids, so pruning can never cause id reuse.
    Column("max_id", BigInteger, nullable=False, server_default=text("0")),
    # The lock session that took the current epoch (its pid, backend start and role), so
    # that anyone can tell the leader from a session that only holds the lock: only a role
    # that may write this row can record itself (docs/reliability.md, "Who holds the lock").
    Column("holder_pid", Integer),
    Column("holder_backend_start", DateTime(timezone=True)),
    Column("holder_role", OID),
    # The epoch that session took: an epoch that moved without it (a build before this
    # column, mid rolling upgrade) leaves the record stale, and the holder unknown.
    Column("holder_epoch", Integer),
    # The host group the cluster is enrolled in (revision 0009): NULL for a standalone
    # cluster, led by a ``PgStore`` that holds the leader lock; else only a host of that
    # group takes its epochs, and a standalone's bump is refused.
    Column("host_group", Text),
    CheckConstraint("id = 1", name="single_row"),
)

#: A row for each epoch taken (the last ``TERMS_KEPT``, pruned by the takeover that writes
#: one): when it began and the lock session that took it, its role, application name and
#: address as text (a role or address may be gone when the row is read).
#: ``lock_seen_held_at``: the taker's last poll that found the lock still held, when it
#: waited for it; the lock was free for at most the time from then to ``began_at``.
leader_history = Table(
    "cronoq_leader_history",
    metadata,
    Column("epoch", Integer, primary_key=True, autoincrement=False),
    Column("began_at", DateTime(timezone=True), nullable=False),
    Column("lock_seen_held_at", DateTime(timezone=True)),
    Column("pid", Integer, nullable=False),
    Column("role", Text),
    Column("application_name", Text),
    Column("client_addr", Text),
    # The newest terms first, and the prune's cut.
    Index("ix_cronoq_leader_history_began_at", "began_at"),
)

#: The leader table's OID, read through the system column ``tableoid`` of its row: the
#: cluster's incarnation (docs/reliability.md, "The cluster's incarnation"). A physical copy
#: of the server (a replica, a point-in-time restore) and ``pg_upgrade`` keep it; a table
#: made again (the schema dropped and migrated, renamed into another's place, restored
#: from a logical dump) has another. Not a ``Column`` of the table: the migrations and
#: their drift check must never see it.
leader_tableoid = ColumnClause("tableoid", OID(), _selectable=leader)

tasks = Table(
    "cronoq_tasks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("arrival_unix_ns", BigInteger, nullable=False),
    Column("pool", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("key", Text),
    Column("payload", LargeBinary, nullable=False),
    Column("deadline_unix_ns", BigInteger),
    Column("fixed_at_unix_ns", BigInteger),
    Column("fixed_tolerance_ns", BigInteger),
    Column("fixed_on_miss", Text),
    Column("duration_hint_ns", BigInteger),
    Column("timeout_ns", BigInteger),
    Column("retry", JSONB),
    Column("deps", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("resources", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("tags", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    # 'queued' for a live task with no attempt yet, else a TaskStatus value.
    Column("status", Text, nullable=False),
    Column("terminal", Boolean, nullable=False),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("updated_unix_ns", BigInteger, nullable=False),
    Column("message", Text),
    Column("output", LargeBinary),
    Column("labels", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("tenant", Text),
    # Recovery reads live tasks in id order.
    Index("ix_cronoq_tasks_live", "id", postgresql_where=text("NOT terminal")),
    # A key names at most one live task; finished tasks release it.
    Index(
        "uq_cronoq_tasks_live_key",
        "key",
        unique=True,
        postgresql_where=text("NOT terminal AND key IS NOT NULL"),
    ),
    # Recovery's retention window and prune's oldest-first victims.
    Index(
        "ix_cronoq_tasks_finished_updated",
        "updated_unix_ns",
        "id",
        postgresql_where=text("terminal"),
    ),
    # The newest task with a key (get_task), and finished tasks depended on by key.
    Index("ix_cronoq_tasks_key_id", "key", "id", postgresql_where=text("key IS NOT NULL")),
    # Prune's scan of live tasks that have dependencies.
    Index(
        "ix_cronoq_tasks_live_deps",
        "id",
        postgresql_where=text("NOT terminal AND deps <> '[]'::jsonb"),
    ),
)

recurring = Table(
    "cronoq_recurring",
    metadata,
    Column("name", Text, primary_key=True),
    Column("spec", JSONB, nullable=False),
    Column("template_payload", LargeBinary, nullable=False),
    Column("next_unix_ns", BigInteger),
    # The occurrence a queued recurring schedule chains to.
    Column("last_task_id", BigInteger),
)


def schema_options(schema: str) -> dict[str, Any]:
    """Execution options that point the schema-less tables at the cluster's ``schema``."""
    return {"schema_translate_map": {None: validate_schema_name(schema)}}


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


#: The insert row's columns that are not a spec field's, each with its value in
#: :func:`insert_row`: what the task is besides its spec, and its first state.
_TASK_VALUES: dict[str, str] = {
    "id": "m.id",
    "seq": "m.seq",
    "arrival_unix_ns": 'to_unix(m.arrival, "arrival")',
    "status": "QUEUED",
    "terminal": "False",
    "attempt": "0",
    "updated_unix_ns": "now_unix_ns",
    "message": "None",
}


def _encoded(f: SpecField, v: str) -> tuple[str, ...]:
    """The expressions that encode ``f``, the value of expression ``v``, into its columns."""
    name = f.name
    match f.kind:
        case SpecKind.BYTES:
            return (v,)
        case SpecKind.TEXT:
            return (f"clean_text({v})",)
        case SpecKind.OPTIONAL_TEXT:
            return (f"None if {v} is None else clean_text({v})",)
        case SpecKind.PRIORITY:
            return (f"int({v})",)
        case SpecKind.ENGINE_TIME:
            return (f"None if {v} is None else to_unix({v}, {name!r})",)
        case SpecKind.DURATION:
            return (f"None if {v} is None else duration_to_ns({v})",)
        case SpecKind.FIXED_START:
            return (
                f"None if {v} is None else to_unix({v}.at, {name + '.at'!r})",
                f"None if {v} is None else duration_to_ns({v}.tolerance)",
                f"None if {v} is None else encode_miss_policy({v}.on_miss)",
            )
        case SpecKind.RETRY:
            return (f"encode_retry({v})",)
        case SpecKind.DEPS:
            return (f"encode_deps({v})",)
        case SpecKind.RESOURCES:
            return (f"encode_resources({v})",)
        case SpecKind.STRINGS:
            return (f"encode_strings({v})",)
        case _:
            unhandled(f.kind, "spec kind")


def _spec_columns() -> tuple[list[str], dict[str, str]]:
    """What :func:`insert_row` does with the spec ``s``: the statements that bind a field
    used more than once to a local, and each spec column with its expression. Refuses a
    field whose kind stores another number of values than it declares columns."""
    bound: list[str] = []
    by_column: dict[str, str] = {}
    for f in SPEC_FIELDS:
        expressions = _encoded(f, f"s.{f.name}")
        if sum(e.count(f"s.{f.name}") for e in expressions) > 1:
            bound.append(f"{f.name}_ = s.{f.name}")
            expressions = _encoded(f, f"{f.name}_")
        if len(expressions) != len(f.columns):
            raise RuntimeError(
                f"cronoq_store._schema: TaskSpec.{f.name} ({f.kind.value}) is stored in "
                f"{len(expressions)} columns, SPEC_FIELDS declares {list(f.columns)}"
            )
        by_column.update(zip(f.columns, expressions, strict=True))
    return bound, by_column


def _compiled(source: str, name: str, **namespace: Any) -> Any:
    """The function ``name`` that ``source`` defines with the names of ``namespace``,
    compiled once at import (as ``dataclasses`` builds ``__init__``): the row mapping is
    derived from :data:`~cronoq_store._domain.SPEC_FIELDS` at no cost per row, with no
    loop over the fields nor a look-up by name for each value."""
    defined: dict[str, Any] = {}
    exec(compile(source, f"<cronoq_store._schema.{name}>", "exec"), namespace, defined)
    return defined[name]


_BOUND, _SPEC_VALUES = _spec_columns()
_INSERT_VALUES = {**_TASK_VALUES, **_SPEC_VALUES}
_INSERT_SOURCE = (
    "def insert_row(m, to_unix, now_unix_ns):\n"
    "    s = m.spec\n"
    + "".join(f"    {statement}\n" for statement in _BOUND)
    + "    return [\n"
    + "".join(f"        {_INSERT_VALUES.get(name)},  # {name}\n" for name in INSERT_COLUMNS)
    + "    ]\n"
)
#: ``insert_row(m, to_unix, now_unix_ns)``: ``m`` as an insert row (:data:`INSERT_COLUMNS`
#: order), queued at ``now_unix_ns``. Engine times go through ``to_unix``
#: (:func:`~cronoq_store._codec.unix_converter`), every string through ``clean_text``. One
#: list literal (``_INSERT_SOURCE``), each value from :data:`_TASK_VALUES` or its spec
#: field's kind: assigning 25 positions by name costs the fold 12% (measured), a call per
#: column as much.
insert_row: Callable[[Submitted, Callable[[int, str], int], int], list[Any]] = _compiled(
    _INSERT_SOURCE,
    "insert_row",
    QUEUED=QUEUED,
    clean_text=clean_text,
    duration_to_ns=duration_to_ns,
    encode_deps=encode_deps,
    encode_miss_policy=encode_miss_policy,
    encode_resources=encode_resources,
    encode_retry=encode_retry,
    encode_strings=encode_strings,
)


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
    """The parameters of ``statements.update_status_fenced``, one element per task: the one
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


#: The bind names of ``update_status_fenced``, in :class:`StatusUpdates` order.
UPDATE_PARAMS: tuple[str, ...] = tuple(f.name for f in fields(StatusUpdates))


def update_param_types() -> list[tuple[str, TypeEngine[Any]]]:
    """Each ``update_status_fenced`` parameter with its elements' SQL type."""
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


def _decoded(f: SpecField) -> str:
    """The expression that decodes ``f`` from its columns (parameters named after them), with
    the caches of :data:`_CACHES` for values that repeat."""
    c = f.columns[0]
    match f.kind:
        case SpecKind.BYTES:
            return c
        case SpecKind.TEXT:
            return f"shared_text[{c}]" if f.repeats else c
        case SpecKind.OPTIONAL_TEXT:
            return f"None if {c} is None else shared_text[{c}]" if f.repeats else c
        case SpecKind.PRIORITY:
            return f"shared_priorities[{c}]"
        case SpecKind.ENGINE_TIME:
            return f"None if {c} is None else engine_time(base, {c})"
        case SpecKind.DURATION:
            return f"None if {c} is None else shared_durations[{c}]"
        case SpecKind.FIXED_START:
            at, tolerance, on_miss = f.columns
            tolerance = (
                f"shared_durations[{tolerance}] if {tolerance} is not None else _DEFAULT_TOLERANCE"
            )
            return (
                f"None if {at} is None else FixedStart(at=engine_time(base, {at}), "
                f"tolerance={tolerance}, on_miss=decode_miss_policy({on_miss}))"
            )
        case SpecKind.RETRY:
            return f"None if {c} is None else shared_retries[{c}]"
        case SpecKind.DEPS:
            return f"shared_deps[{c}]"
        case SpecKind.RESOURCES:
            return f"shared_resources[{c}]"
        case SpecKind.STRINGS:
            return f"shared_{f.name}[{c}]"
        case _:
            unhandled(f.kind, "spec kind")


def _strings_of(name: str) -> Callable[[str], tuple[str, ...]]:
    return lambda text: decode_strings(text, name)


#: The decoder of each cache a :class:`LiveTasks` keeps, by the name :func:`_decoded` uses
#: (``shared_``, apart from every column name): one per kind, and one per list of strings
#: (its errors name the field).
_CACHES: dict[str, Callable[[Any], Any]] = {
    "shared_text": _same,
    "shared_priorities": Priority.from_stored,
    "shared_durations": ns_to_duration,
    "shared_retries": decode_retry,
    "shared_deps": decode_deps,
    "shared_resources": decode_resources,
    **{f"shared_{f.name}": _strings_of(f.name) for f in SPEC_FIELDS if f.kind is SpecKind.STRINGS},
}
#: The spec's columns, in the order the spec decoder takes them (declaration order).
SPEC_COLUMNS: tuple[str, ...] = tuple(c for f in SPEC_FIELDS for c in f.columns)
_SPEC_SOURCE = (
    f"def spec_decoder(base, {', '.join(_CACHES)}):\n"
    f"    def spec({', '.join(SPEC_COLUMNS)}):\n"
    "        return TaskSpec(\n"
    + "".join(f"            {f.name}={_decoded(f)},\n" for f in SPEC_FIELDS)
    + "        )\n"
    "    return spec\n"
)
#: ``spec_decoder(base, **caches)``: a function that takes a row's :data:`SPEC_COLUMNS`
#: and returns its ``TaskSpec`` (``_SPEC_SOURCE``): one frame, one expression per field.
_spec_decoder: Callable[..., Callable[..., TaskSpec]] = _compiled(
    _SPEC_SOURCE,
    "spec_decoder",
    FixedStart=FixedStart,
    TaskSpec=TaskSpec,
    _DEFAULT_TOLERANCE=_DEFAULT_TOLERANCE,
    decode_miss_policy=decode_miss_policy,
    engine_time=engine_time,
)


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

    __slots__ = ("_base", "_spec")

    def __init__(self, base: TimeBase) -> None:
        self._base = base
        self._spec = _spec_decoder(
            base, **{name: _Shared(decode) for name, decode in _CACHES.items()}
        )

    def decode(
        self, id: int, seq: int, arrival_unix_ns: int, status: str, attempt: int, *spec: Any
    ) -> RecoveredTask:
        """A live task row (:data:`LIVE_COLUMNS`: these, then the :data:`SPEC_COLUMNS`) as
        the scheduler's value; ``ValueError`` names what is wrong. A row the domain would
        refuse as a submission (an empty pool, a negative seq or id) is refused here too."""
        if status not in LIVE_STATUS_NAMES and TaskStatus.from_stored(status) is not None:
            # A finished status on a row marked live: which of the two is wrong cannot be
            # told. A name this build does not know is a newer build's live status: the task
            # stays live.
            raise ValueError(f"status: {status!r} is the status of a finished task, on a live row")
        spec_ = self._spec(*spec)
        if seq < 0:
            raise ValueError(f"seq: must be an integer in 0..2**63-1, got {seq}")
        if id < 0:
            raise ValueError(f"id: must be a task id in 0..2**63-1, got {id}")
        return RecoveredTask(
            id=TaskId(id),
            seq=seq,
            arrival=engine_time(self._base, arrival_unix_ns),
            spec=spec_,
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
    """The column names a decoder takes by name, in order (after ``skip`` leading
    arguments; a ``*spec`` is :data:`SPEC_COLUMNS`, named by the spec decoder)."""
    named = inspect.signature(decoder).parameters.values()
    return tuple(p.name for p in named if p.kind is not p.VAR_POSITIONAL)[skip:]


def _check_columns(what: str, mapped: Sequence[str], expected: Iterable[str]) -> None:
    """Refuse, at import, columns that this module and the schema do not agree on."""
    expected = tuple(expected)
    if set(mapped) == set(expected):
        return
    missing = sorted(set(expected) - set(mapped))
    unknown = sorted(set(mapped) - set(expected))
    raise RuntimeError(
        f"cronoq_store._schema: {what} maps columns {list(mapped)}, the schema has "
        f"{list(expected)} (not mapped: {missing}, not in the schema: {unknown})"
    )


#: What recovery reads of a live task, in the order :meth:`LiveTasks.decode` takes it.
LIVE_COLUMNS: tuple[str, ...] = _parameters(LiveTasks.decode, skip=1) + SPEC_COLUMNS
#: What a ``TaskRecord`` is made of, in the order :func:`task_record` takes it.
RECORD_COLUMNS: tuple[str, ...] = _parameters(task_record)
#: A recurring schedule row, in the order :func:`recurring_schedule` takes it.
RECURRING_COLUMNS: tuple[str, ...] = _parameters(recurring_schedule, skip=1)

_check_columns("insert_row", tuple(_INSERT_VALUES), INSERT_COLUMNS)
_check_columns(
    "LiveTasks.decode", LIVE_COLUMNS, (n for n in INSERT_COLUMNS if n not in _NOT_RECOVERED)
)
_check_columns("recurring_schedule", RECURRING_COLUMNS, (c.name for c in recurring.c))
_check_columns(
    "task_record",
    ["updated" if n == "updated_unix_ns" else n for n in RECORD_COLUMNS],
    (f.name for f in fields(TaskRecord)),
)
