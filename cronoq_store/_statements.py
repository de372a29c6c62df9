"""The store's own statements (commits, recovery, look-ups, pruning), as SQLAlchemy Core
constructs built once at import. The others live beside their users: the leader lock
session's in :mod:`cronoq_store._statements`, the sessions' settings in
:mod:`cronoq_store._statements`, the operators' catalog queries in
:mod:`cronoq_store._catalog`, the migrations' in :mod:`cronoq_store._statements`.

The tables carry no schema name, so each construct compiles once and the compiled cache
serves every cluster: the schema is applied at execution with ``schema_translate_map``.
Array parameters are typed (``ARRAY(BigInteger)`` renders ``$1::BIGINT[]``) because the
server cannot resolve ``unnest`` over an untyped array.

The leader lock session's statements: the advisory lock, the epoch bump, the session's
own settings, the keeper's check of the leader row, and the schema's OID that keys the lock.

Run by :class:`~cronoq_store._leadership.Leadership` on its dedicated session, never on a
commit's connection.

What the store's transactions set on a session: the one ``search_path``, the opening of
a transaction on a session the store does not own (an application's engine, a
transaction-pooling PgBouncer), which sets the store's settings for that transaction alone,
and how long a transaction may sit idle.

The migrations' own statements: what an offline (``--sql``) script checks before its DDL,
what a downgrade runs under the leader lock (:mod:`cronoq_store._migrations`), and the
bounded waits for a lock (:mod:`cronoq_store._door`): the migration lock tried, the
tables locked an attempt at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    Numeric,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    exists,
    false,
    func,
    literal,
    literal_column,
    not_,
    null,
    or_,
    select,
    table,
    text,
    true,
    tuple_,
    union_all,
    update,
    values,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, OID
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import DDL, CreateTable
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement, ColumnClause
from sqlalchemy.sql.selectable import Select, TableValuedAlias
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import NullType, TypeEngine

from ._config import validate_schema_name
from ._domain import EPOCH_MAX, LIVE_RANKS, QUEUED, RANKS_PER_ATTEMPT, TERMINAL_LEVEL, TaskStatus
from ._schema import (
    IDENTITY_COLUMNS,
    INSERT_COLUMNS,
    JSON_COLUMNS,
    LEADER_ROW_ID,
    LIVE_COLUMNS,
    RECORD_COLUMNS,
    RECURRING_COLUMNS,
    leader,
    leader_history,
    leader_tableoid,
    recurring,
    tasks,
    update_param_types,
)

__all__ = [
    "FENCED_INSERT_MAX_ROWS",
    "FENCED_INSERT_SIZES",
    "IDLE_LIMIT_MS",
    "LOCK_NS_LEADER",
    "LOCK_NS_MIGRATE",
    "LOCK_SESSION_SETTINGS",
    "NO_TASK_ROW",
    "SEARCH_PATH",
    "TERMS_KEPT",
    "HostedClaims",
    "accepts_writes",
    "advance_recurring",
    "borrowed_transaction",
    "bump_epoch",
    "bump_epoch_only",
    "checked_schema",
    "cluster_issued_ids",
    "colliding_ids",
    "create_staging",
    "current_database",
    "current_user",
    "enroll_cluster",
    "epoch_for_share",
    "epoch_held_for_share",
    "epoch_kept_for_share",
    "fenced_insert_size",
    "fenced_row_names",
    "finished_page",
    "generic_plans",
    "high_water",
    "hosted_claims",
    "incarnation",
    "incarnation_kept",
    "insert_staged",
    "insert_tasks",
    "insert_tasks_fenced",
    "keeper_lock_timeout",
    "key_holders",
    "leader_barrier",
    "leader_enrolment",
    "leader_now",
    "live_tasks",
    "local_search_path",
    "lock_cluster_tables",
    "lock_session_settings",
    "pause",
    "prune_batch",
    "prune_terms",
    "prune_victims",
    "quarantine",
    "recent_terminal",
    "record_term",
    "recurring_schedules",
    "refuse_enrolled",
    "refuse_foreign_owner",
    "refuse_live_leader",
    "release_savepoint",
    "remove_recurring",
    "rollback_to_savepoint",
    "savepoint",
    "schema_oid",
    "server_encoding",
    "session_search_path",
    "session_setting",
    "set_local_lock_timeout",
    "set_local_search_path",
    "staged_tasks",
    "store_outputs",
    "store_transaction",
    "take_epoch",
    "take_hosted_epoch",
    "task_by_id",
    "task_by_key",
    "task_output",
    "tasks_by_ids",
    "try_leader_lock",
    "try_leader_lock_for_transaction",
    "try_migration_lock",
    "unenroll_cluster",
    "update_status_fenced",
    "upsert_recurring",
    "wait_migration_lock",
]


#: The epoch and the cluster's incarnation (the leader table's OID, ``tableoid``) under a
#: share lock: it waits for a takeover's uncommitted bump and then sees it, and a takeover
#: waits for this commit, so a commit lands entirely before or after one.
epoch_for_share = (
    select(leader.c.epoch, leader_tableoid)
    .where(leader.c.id == LEADER_ROW_ID)
    .with_for_update(read=True)
)

#: The epoch a commit expects.
_epoch = bindparam("epoch", type_=Integer)
#: The incarnation every write of a store expects: the leader table's OID when it opened.
_incarnation = bindparam("incarnation", type_=OID)


class _LockExclusive(Executable, ClauseElement):
    """``LOCK TABLE ONLY <table> IN EXCLUSIVE MODE``, compiled once and cached as any Core
    statement (SQLAlchemy's ``DDL`` is compiled again at every execution)."""

    _traverse_internals = [("table", InternalTraversal.dp_clauseelement)]  # noqa: RUF012
    inherit_cache = True

    def __init__(self, table: Table) -> None:
        self.table = table


@compiles(_LockExclusive)
def _lock_exclusive(element: _LockExclusive, compiler: SQLCompiler, **kw: Any) -> str:
    return f"LOCK TABLE ONLY {compiler.preparer.format_table(element.table)} IN EXCLUSIVE MODE"


#: What waits for every commit in flight and holds back the later ones, in a transaction
#: (a takeover's bump, a prune batch): the leader table ``EXCLUSIVE``, which conflicts with
#: the ``ROW SHARE`` that each commit's ``FOR SHARE`` takes on it. A row lock would not do:
#: a ``FOR SHARE`` request passes a waiting ``UPDATE`` or ``FOR NO KEY UPDATE`` whenever
#: another commit still holds the row (PostgreSQL lets share lockers join without queueing),
#: so overlapping commits could starve it for ever; the table lock's queue is first come,
#: first served.
leader_barrier = _LockExclusive(leader)

#: The epoch check of a commit's transaction, sent with its ``BEGIN`` (its parameters are
#: integers, rendered as literals by the writer): one row, share-locked as by
#: :data:`epoch_for_share`, when the stored epoch is ``:epoch`` and the leader table is
#: ``:incarnation``; none otherwise. Commits share the lock, so none waits for another; a
#: takeover's bump waits for all of them.
epoch_held_for_share = (
    select(leader.c.epoch)
    .where(leader.c.id == LEADER_ROW_ID, leader.c.epoch == _epoch, leader_tableoid == _incarnation)
    .with_for_update(read=True)
)

#: The cluster's incarnation: the OID of the leader table the schema's name leads to now
#: (no row without a leader row).
incarnation = select(leader_tableoid).where(leader.c.id == LEADER_ROW_ID)
_leader_now = incarnation.scalar_subquery()

#: Sent with a commit transaction's ``COMMIT``, after its writes (its parameter rendered as
#: a literal, as the opening's): it fails the transaction, with SQLSTATE 22P02 (a text that
#: is no integer, so nothing is committed), unless the leader table the schema's name
#: leads to now is still ``:incarnation``. The opening's check holds the leader row, so the
#: epoch cannot move under a transaction; the name can (``ALTER SCHEMA ... RENAME`` takes no
#: lock on the tables), and each later statement looks its tables up again. The cast is of
#: a value read, not of a constant, so the planner cannot fold it (and fail) ahead of the
#: ``WHERE``.
incarnation_kept = select(
    cast(
        literal_column("'cronoq_store: the cluster was replaced, its leader table is now '")
        + func.coalesce(cast(_leader_now, Text), literal_column("'missing'")),
        Integer,
    )
).where(_leader_now.is_distinct_from(_incarnation))


def _unnest(name: str, *columns: tuple[str, TypeEngine[Any]]) -> TableValuedAlias:
    """``unnest($1::T1[], ...) AS name(c1, ...)``: one typed array parameter per column."""
    binds = [bindparam(col, type_=ARRAY(type_)) for col, type_ in columns]
    cols = [column(col, type_) for col, type_ in columns]
    return func.unnest(*binds).table_valued(*cols).render_derived(name=name)


# --- commit: one update per existing task ---------------------------------------------------

_transition = _unnest("u", *update_param_types())


def _level(terminal: ColumnElement[bool], attempt: Any, status: Any) -> ColumnElement[int]:
    """:func:`cronoq_store._domain.level` in SQL, for the stored row and the transition; the
    constants are literals (ours, not input), so the statement has no parameters of its own."""

    def constant(value: int) -> ColumnElement[int]:
        return literal_column(str(value), BigInteger)

    rank = case(
        *(
            (status == literal_column(f"'{name}'", Text), constant(r))
            for name, r in LIVE_RANKS.items()
            if r
        ),
        else_=constant(0),
    )
    return case(
        (terminal, constant(TERMINAL_LEVEL)),
        else_=cast(attempt, BigInteger) * constant(RANKS_PER_ATTEMPT) + rank,
    )


_stored_position = tuple_(
    _level(tasks.c.terminal, tasks.c.attempt, tasks.c.status), tasks.c.updated_unix_ns
)

_u = _transition.c
_transition_values = {
    "status": _u.statuses,
    "terminal": _u.terminals,
    "attempt": _u.attempts,
    "updated_unix_ns": _u.updated,
    # Cheapest first: no message keeps the stored one; the moving transition's own message
    # comes with it; an earlier one's only if that transition is ahead of the stored state.
    "message": case(
        (_u.message_levels.is_(None), tasks.c.message),
        (and_(_u.message_levels == _u.levels, _u.message_ats == _u.updated), _u.messages),
        (tuple_(_u.message_levels, _u.message_ats) > _stored_position, _u.messages),
        else_=tasks.c.message,
    ),
}

#: Only forward, decided on the stored row in the statement itself, so a duplicate or late
#: delivery (even one running concurrently) changes nothing: a terminal row is final, a live
#: one moves when the transition's (level, at) is greater than its own. ``levels`` is
#: :func:`cronoq_store._domain.level` of each transition, computed by the fold.
_forward = (
    tasks.c.id == _u.ids,
    ~tasks.c.terminal,
    tuple_(_u.levels, _u.updated) > _stored_position,
)

_sharing = epoch_for_share.cte("e")
#: What a one-statement commit checks: the stored epoch and the cluster's incarnation.
_fence_holds = and_(_sharing.c.epoch == _epoch, _sharing.c.tableoid == _incarnation)
_transitioned = (
    update(tasks)
    .where(*_forward, _fence_holds)
    .values(_transition_values)
    .returning(tasks.c.id)
    .cte("upd")
)

#: Status transitions, one per task, each applied only if it moves the task forward (the
#: message is the transition's if the one that brought it is ahead of the stored state,
#: else the stored one stays: a message carries forward until a later transition replaces
#: it), as one statement with its fence: the epoch and incarnation under a share lock (as
#: :data:`epoch_for_share`) and the updates, which change nothing unless the stored epoch
#: is ``:epoch`` and the leader table ``:incarnation``. Returns the stored epoch, the
#: incarnation and the number of rows moved forward. A batch of transitions alone is this
#: statement; a commit transaction runs it too, its fence the one its opening checked.
update_status_fenced = select(
    _sharing.c.epoch,
    _sharing.c.tableoid,
    select(func.count()).select_from(_transitioned).scalar_subquery(),
)

# --- commit: new tasks ----------------------------------------------------------------------

_new = _unnest(
    "u",
    # JSON travels as text and is cast in SQL: binding ARRAY(JSONB) double-encodes strings.
    *((name, Text() if name in JSON_COLUMNS else tasks.c[name].type) for name in INSERT_COLUMNS),
)

_new_rows = select(
    *(
        (cast(_new.c[name], JSONB) if name in JSON_COLUMNS else _new.c[name]).label(name)
        for name in INSERT_COLUMNS
    )
)


def _other_task(stored: Any, incoming: Any) -> ColumnElement[bool]:
    """Whether the incoming row is a different task than the stored one with its id."""
    return or_(*(stored[name].is_distinct_from(incoming[name]) for name in IDENTITY_COLUMNS))


def _insert_from(rows: Select[Any]) -> postgresql.Insert:
    """``rows`` into the tasks table. A row whose id is stored changes nothing when it is
    the same submission sent again and its state is not ahead of the stored one. Else the
    statement fails with a NOT NULL violation on ``seq`` (SQLSTATE 23502), rolling back
    the batch: for a different task, the writer reports an id collision; for the same task
    with transitions ahead of the stored row, the writer writes the batch again with those
    transitions in the update. Decided on the locked stored row, so it holds against
    concurrent commits; it costs nothing when no id is stored. (The partial unique index
    on live keys is not covered: a duplicate live key aborts the batch, and the writer
    tries again with the transitions in the update when the batch sends tasks again.)"""
    insert = postgresql.insert(tasks).from_select(list(INSERT_COLUMNS), rows)
    new = insert.excluded
    return insert.on_conflict_do_update(
        index_elements=[tasks.c.id],
        set_={"seq": null()},
        where=or_(
            _other_task(tasks.c, new),
            and_(
                new.status != literal_column(f"'{QUEUED}'", Text),
                ~tasks.c.terminal,
                tuple_(_level(new.terminal, new.attempt, new.status), new.updated_unix_ns)
                > _stored_position,
            ),
        ),
    )


#: New tasks in one statement, inside a transaction that checked the epoch.
insert_tasks = _insert_from(_new_rows)

#: The row counts :func:`insert_tasks_fenced` is built for; a batch takes the smallest that
#: holds it (:func:`fenced_insert_size`), the rows it leaves empty given as
#: :data:`NO_TASK_ROW`, which the statement skips. Each count is a statement prepared on
#: every session that commits such a batch (the server keeps 200-400 kB of a prepared
#: statement), and asyncpg keeps 100 per connection by default, evicting the oldest: one
#: statement per count up to 31 made four stores sharing one session prepare at every
#: commit (measured). The largest is the most new tasks one statement takes: the writer
#: sends more by COPY (``_commit_path.COPY_MIN_ROWS``). Its SQL grows by a row's
#: parameters per task (9 kB at 31), and asyncpg prepares again, at every execution, a
#: statement over its ``max_cacheable_statement_size`` (15 kB by default).
FENCED_INSERT_SIZES = (1, 2, 4, 8, 16, 31)
FENCED_INSERT_MAX_ROWS = FENCED_INSERT_SIZES[-1]

#: A row of :func:`insert_tasks_fenced` that inserts nothing: every value NULL.
NO_TASK_ROW = (None,) * len(INSERT_COLUMNS)


def fenced_insert_size(count: int) -> int:
    """The row count of the :func:`insert_tasks_fenced` that takes ``count`` new tasks:
    the smallest of :data:`FENCED_INSERT_SIZES` that holds them."""
    for size in FENCED_INSERT_SIZES:
        if count <= size:
            return size
    raise ValueError(f"a fenced insert takes 1 to {FENCED_INSERT_MAX_ROWS} tasks, not {count}")


def fenced_row_names(count: int) -> list[str]:
    """The names of :func:`insert_tasks_fenced`'s row parameters, row after row, each row's
    in ``INSERT_COLUMNS`` order: its leading positional parameters."""
    return [f"row{i}_{name}" for i in range(count) for name in INSERT_COLUMNS]


@functools.lru_cache(maxsize=len(FENCED_INSERT_SIZES))
def insert_tasks_fenced(size: int) -> Select[Any]:
    """Up to ``size`` new tasks (one of :data:`FENCED_INSERT_SIZES`) as one statement, so
    one round trip without BEGIN and COMMIT: the epoch and incarnation under a share lock (as
    :data:`epoch_for_share`) and the insert, which writes nothing unless the stored epoch is
    ``:epoch`` and the leader table ``:incarnation``. Returns the stored epoch and
    incarnation, for the caller to raise ``FencedError`` or ``ClusterReplacedError``. Rows
    whose id is NULL (:data:`NO_TASK_ROW`) are skipped: a batch fills the statement's rows
    with them.

    The rows travel as a ``VALUES`` list, one scalar parameter per value (named by
    :func:`fenced_row_names`), not as one array per column: asyncpg checks each element of
    an array parameter against abstract base classes, in Python, one or two checks of about
    0.1 us per value. Raw asyncpg sending both forms of a batch of 10 new tasks (measured):
    19.3 against 11.2 us of client CPU per task, 15.9k against 19.0k tasks/s. Only the first
    row's parameters carry their types: PostgreSQL gives each later row's the type of its
    column, so the statement stays short. The first row is always a task's."""
    if size not in FENCED_INSERT_SIZES:
        raise ValueError(f"a fenced insert is built for {FENCED_INSERT_SIZES} rows, not {size}")
    names = iter(fenced_row_names(size))
    types = [Text() if name in JSON_COLUMNS else tasks.c[name].type for name in INSERT_COLUMNS]
    rows = [
        tuple(bindparam(next(names), type_=t if i == 0 else NullType()) for t in types)
        for i in range(size)
    ]
    new = values(
        *(column(name, t) for name, t in zip(INSERT_COLUMNS, types, strict=True)), name="u"
    ).data(rows)
    # JSON travels as text and is cast in SQL, as in every insert of new tasks.
    incoming = select(
        *(
            (cast(new.c[name], JSONB) if name in JSON_COLUMNS else new.c[name]).label(name)
            for name in INSERT_COLUMNS
        )
    ).where(_fence_holds)
    if size > 1:
        incoming = incoming.where(new.c.id.is_not(None))
    return select(_sharing.c.epoch, _sharing.c.tableoid).add_cte(_insert_from(incoming).cte("ins"))


_incoming = _new_rows.subquery("n")

#: The ids of ``insert_tasks``' rows (same parameters) that another task holds: run after
#: an insert failed on an id collision, to name them.
colliding_ids = (
    select(_incoming.c.id)
    .join(tasks, tasks.c.id == _incoming.c.id)
    .where(_other_task(tasks.c, _incoming.c))
    .order_by(_incoming.c.id)
)

#: What decides which keys of a batch refused on the unique index of live keys are taken
#: (``folding.taken_keys``): the stored ids among ``:id`` and the live holders of ``:key``
#: (``insert_tasks``' columns of those names). Run on that refusal only.
key_holders = select(tasks.c.id, tasks.c.key, tasks.c.terminal).where(
    or_(
        tasks.c.id == any_(bindparam("id", type_=ARRAY(BigInteger))),
        and_(~tasks.c.terminal, tasks.c.key == any_(bindparam("key", type_=ARRAY(Text)))),
    )
)

# --- opening a store: the database's encoding ---------------------------------------------------

#: The database's encoding: text the store accepts is stored only where it is UTF8 (any other
#: encoding refuses characters it lacks, and such a value would fail its whole batch).
server_encoding = select(func.pg_catalog.current_setting(literal_column("'server_encoding'")))

# --- commit: outputs ------------------------------------------------------------------------

_output = _unnest("u", ("ids", BigInteger()), ("outputs", LargeBinary()))

#: Outputs of tasks that succeeded, stored beside their final transition. Run after the
#: batch's updates and inserts, so the row's status is final: an output given for a task that
#: did not succeed (it was cancelled first, say) is not stored, as ``TaskRecord`` promises.
store_outputs = (
    update(tasks)
    .where(
        tasks.c.id == _output.c.ids,
        tasks.c.status == literal_column(f"'{TaskStatus.SUCCEEDED.value}'", Text),
    )
    .values(output=_output.c.outputs)
)

# --- commit: recurring schedules, one change at a time, in batch order ----------------------

# Bind names differ from column names: SQLAlchemy reserves those in VALUES and SET.
_upsert = postgresql.insert(recurring).values(
    name=bindparam("schedule", type_=Text),
    spec=cast(bindparam("spec_json", type_=Text), JSONB),
    template_payload=bindparam("payload", type_=LargeBinary),
)

#: Create or replace a schedule; its next occurrence and last task are left as they were.
upsert_recurring = _upsert.on_conflict_do_update(
    index_elements=[recurring.c.name],
    set_={
        "spec": _upsert.excluded.spec,
        "template_payload": _upsert.excluded.template_payload,
    },
)

#: Delete a schedule (nothing happens if it is already gone).
remove_recurring = delete(recurring).where(recurring.c.name == bindparam("schedule", type_=Text))

#: Record a schedule's next occurrence and the task it last submitted.
advance_recurring = (
    update(recurring)
    .where(recurring.c.name == bindparam("schedule", type_=Text))
    .values(
        next_unix_ns=bindparam("next", type_=BigInteger),
        last_task_id=bindparam("last", type_=BigInteger),
    )
)

# --- recovery -------------------------------------------------------------------------------

#: The id high-water marks, read in one statement (one snapshot, so a prune batch counts
#: either in both or in neither): the largest id prune deleted (0, the column's default,
#: until one does; earlier builds recorded every id issued there) and the largest stored id
#: (NULL for none: a stored id 0 counts); and the cluster's incarnation, which recovery
#: checks before it reads anything else. The caller adds one in Python: the largest id may
#: be 2**63-1.
high_water = select(
    select(leader.c.max_id).where(leader.c.id == LEADER_ROW_ID).scalar_subquery(),
    select(func.max(tasks.c.id)).scalar_subquery(),
    _leader_now,
)


def _columns(table: Table, names: tuple[str, ...]) -> list[ColumnElement[Any]]:
    """``names`` of ``table`` in that order, jsonb columns as their text: the dialect would
    otherwise ``json.loads`` every value, several times slower than decoding once where the
    values are used (:mod:`cronoq_store._schema`)."""
    return [
        cast(table.c[name], Text).label(name) if name in JSON_COLUMNS else table.c[name]
        for name in names
    ]


#: Live tasks in id order, as ``rows.LiveTasks.decode`` takes them.
live_tasks = select(*_columns(tasks, LIVE_COLUMNS)).where(~tasks.c.terminal).order_by(tasks.c.id)

_corrupt = _unnest("u", ("ids", BigInteger()), ("messages", Text()))

#: Mark undecodable live rows failed, each with the reason, so they never block recovery;
#: only in the cluster ``:incarnation`` (the leader table is looked up after the tasks
#: table, so both are the same cluster's, even if the schema's name moved meanwhile).
quarantine = (
    update(tasks)
    .where(tasks.c.id == _corrupt.c.ids, _leader_now == _incarnation)
    .values(
        status=bindparam("failed", type_=Text),
        terminal=true(),
        updated_unix_ns=bindparam("now", type_=BigInteger),
        message=_corrupt.c.messages,
    )
)

#: Finished tasks updated since ``cutoff``, or depended on by a live task (by id or key)
#: whatever their age; oldest first.
recent_terminal = (
    select(tasks.c.id, tasks.c.key, tasks.c.status, tasks.c.updated_unix_ns)
    .where(
        tasks.c.terminal,
        or_(
            tasks.c.updated_unix_ns >= bindparam("cutoff", type_=BigInteger),
            tasks.c.id == any_(bindparam("dep_ids", type_=ARRAY(BigInteger))),
            tasks.c.key == any_(bindparam("dep_keys", type_=ARRAY(Text))),
        ),
    )
    .order_by(tasks.c.updated_unix_ns, tasks.c.id)
)

#: Recurring schedules by name, as ``rows.recurring_schedule`` takes them.
recurring_schedules = select(*_columns(recurring, RECURRING_COLUMNS)).order_by(recurring.c.name)

# --- queries --------------------------------------------------------------------------------

#: Tasks as ``rows.task_record`` takes them.
_record = select(*_columns(tasks, RECORD_COLUMNS))

#: One task by id.
task_by_id = _record.where(tasks.c.id == bindparam("id", type_=BigInteger))

#: The tasks among the ``ids`` (their order), ``limit`` of them: the tasks a short id may
#: name, one primary-key probe each.
tasks_by_ids = (
    _record.where(tasks.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
    .order_by(tasks.c.id)
    .limit(bindparam("limit", type_=BigInteger))
)

#: The newest task with a key (a key names at most one live task, but many finished ones).
task_by_key = (
    _record.where(tasks.c.key == bindparam("key", type_=Text)).order_by(tasks.c.id.desc()).limit(1)
)

_pools = bindparam("pools", type_=ARRAY(Text))
_statuses = bindparam("statuses", type_=ARRAY(Text))

#: A keyset page of finished tasks in id order; an empty ``pools`` or ``statuses`` array
#: means any. The arrays keep one statement (and one cache entry) for every filter.
finished_page = (
    _record.where(
        tasks.c.terminal,
        tasks.c.id > bindparam("after", type_=BigInteger),
        or_(func.cardinality(_pools) == 0, tasks.c.pool == any_(_pools)),
        or_(func.cardinality(_statuses) == 0, tasks.c.status == any_(_statuses)),
    )
    .order_by(tasks.c.id)
    .limit(bindparam("limit", type_=BigInteger))
)

#: The output of a task, if it succeeded.
task_output = select(tasks.c.output).where(
    tasks.c.id == bindparam("id", type_=BigInteger),
    tasks.c.status == TaskStatus.SUCCEEDED.value,
)

# --- pruning --------------------------------------------------------------------------------

_live = tasks.alias("l")
_EMPTY_DEPS: ColumnElement[Any] = literal_column("'[]'::jsonb")
# A row written by hand may hold anything: deps that are not an array, ids that are not
# integers or leave BIGINT. Such a row must not fail every prune (recovery quarantines it):
# what cannot be an id protects nothing, and the casts run only on values that fit.
_dep = (
    func.jsonb_array_elements(
        case(
            (func.jsonb_typeof(_live.c.deps) == literal_column("'array'"), _live.c.deps),
            else_=_EMPTY_DEPS,
        )
    )
    .table_valued(column("value", JSONB))
    .render_derived(name="d")
)
_dep_id = _dep.c.value["id"]
_dep_id_number = cast(_dep_id, Numeric)
_dep_id_bigint = case(
    (
        and_(
            func.jsonb_typeof(_dep_id) == literal_column("'number'"),
            _dep_id_number.between(literal_column(str(-(2**63))), literal_column(str(2**63 - 1))),
        ),
        cast(_dep_id_number, BigInteger),
    ),
    else_=null(),
)
# The literal '[]' (not a parameter) lets the planner use the partial index on live deps.
_refs = (
    select(
        _dep_id_bigint.label("id"),
        _dep.c.value["key"].astext.label("key"),
    )
    .select_from(_live.join(_dep, true()))
    .where(~_live.c.terminal, _live.c.deps != _EMPTY_DEPS)
    .cte("refs")
)
_old = tasks.alias("t")
#: The finished tasks a prune may delete, oldest first, ``batch`` at most: what
#: :data:`prune_batch` deletes, and what an operator's dry run counts.
prune_victims = (
    select(_old.c.id)
    .where(
        _old.c.terminal,
        _old.c.updated_unix_ns < bindparam("cutoff", type_=BigInteger),
        # NOT IN over DISTINCT: a hashed subplan probed while the candidates are read in
        # order, which stops after `batch` rows. The planner guesses 100 rows per
        # jsonb_array_elements call; DISTINCT brings its estimate down (no statistics: 200
        # groups), so the set stays hashed with 20,000 dependencies too (without it, the
        # key check was rescanned per candidate: 1.7 s per batch). NOT EXISTS avoided that
        # but anti-joins every finished task on each batch: 9x slower with 2,000.
        _old.c.id.not_in(select(_refs.c.id).where(_refs.c.id.is_not(None)).distinct()),
        or_(
            _old.c.key.is_(None),
            _old.c.key.not_in(select(_refs.c.key).where(_refs.c.key.is_not(None)).distinct()),
        ),
    )
    .order_by(_old.c.updated_unix_ns, _old.c.id)
    .limit(bindparam("batch", type_=BigInteger))
    .cte("victims")
)

# The deletion of a prune batch, without its record (see :data:`prune_batch`). By an array
# of the victims' ids: key lookups, which PostgreSQL cannot turn into a scan of the whole
# table. ``id IN (victims)`` was planned as a hash join over a sequential scan of every task
# for large batches (64,000 victims, on tables of 100,000 and of a million tasks), so each
# batch cost as much as the table was large (105 ms of such a batch's 420 on a million).
_prune_delete = delete(tasks).where(
    tasks.c.id
    == any_(cast(select(func.array_agg(prune_victims.c.id)).scalar_subquery(), ARRAY(BigInteger)))
)
_pruned = _prune_delete.where(_leader_now == _incarnation).returning(tasks.c.id).cte("pruned")
# How many were deleted and the largest id, in one pass over what the deletion returned.
_pruned_summary = select(func.count().label("deleted"), func.max(_pruned.c.id).label("top")).cte(
    "pruned_summary"
)

#: Delete up to ``batch`` of the oldest finished tasks updated before ``cutoff`` that no
#: live task depends on, by id or by key, and record the largest id deleted in the leader
#: row's ``max_id`` (``GREATEST`` skips the NULL of an empty batch), in the same statement:
#: the deletion and its record commit together or not at all, on the primary and on every
#: replica, so :func:`cronoq_store._recovery.next_id` never goes below an id once stored.
#: Only in the cluster ``:incarnation``: the deletion checks it after looking up the tasks
#: table, the record on its own row. Returns how many tasks were deleted; no row when the
#: leader row is not that cluster's.
prune_batch = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID, leader_tableoid == _incarnation)
    .values(max_id=func.greatest(leader.c.max_id, select(_pruned_summary.c.top).scalar_subquery()))
    .returning(select(_pruned_summary.c.deleted).scalar_subquery())
)


# --- health ---------------------------------------------------------------------------------

#: Whether the server takes writes (a standby, or a demoted primary, answers false): what the
#: group committer asks before giving up on a batch that keeps failing. Schema-qualified: it
#: also runs outside a store transaction on a borrowed session, under the application's
#: ``search_path`` (a ``pg_is_in_recovery`` planted before ``pg_catalog`` must not answer).
accepts_writes = select(not_(func.pg_catalog.pg_is_in_recovery(type_=Boolean)))


#: First key of the leader's session advisory lock ("croq"); the second is the schema's OID.
LOCK_NS_LEADER = 0x63726F71
#: First key of the advisory lock that serializes migrations of one schema ("crom"); the
#: second is ``hashtext(schema)``.
LOCK_NS_MIGRATE = 0x63726F6D
#: Fencing epochs stay within 1..32767 so that epoch-prefixed task ids fit a signed BIGINT.

# --- leadership -----------------------------------------------------------------------------

#: ``pg_try_advisory_lock(k1, k2)``: true if this session now holds the leader lock; and
#: the server's time of the attempt, which the history records of the last attempt that
#: found the lock held (the server's clock, like the time the takeover records).
try_leader_lock = select(
    func.pg_try_advisory_lock(bindparam("k1", type_=Integer), bindparam("k2", type_=Integer)),
    func.clock_timestamp(),
)

_own_session = table(
    "pg_stat_activity",
    column("pid", Integer),
    column("backend_start", postgresql.TIMESTAMP(timezone=True)),
    column("usesysid", postgresql.OID),
    schema="pg_catalog",
)


def _own(name: str) -> Any:
    """A column of this session's own ``pg_stat_activity`` row (always visible to it)."""
    return (
        select(_own_session.c[name])
        .where(_own_session.c.pid == func.pg_backend_pid())
        .scalar_subquery()
    )


#: Bumps the epoch, wrapping 32767 -> 1, and records the session that did (pid, backend
#: start, role): what tells the leader from a session that only holds the lock
#: (:data:`health_facts`). Returns the new epoch. What a forced downgrade runs, in whatever
#: cluster the schema holds.
_next_epoch = case((leader.c.epoch >= EPOCH_MAX, 1), else_=leader.c.epoch + 1)
bump_epoch = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID)
    .values(
        epoch=_next_epoch,
        holder_epoch=_next_epoch,
        holder_pid=func.pg_backend_pid(),
        holder_backend_start=_own("backend_start"),
        holder_role=_own("usesysid"),
    )
    .returning(leader.c.epoch)
)

#: The epoch bump alone, for a leader table without the holder columns (a schema before
#: revision 0007): what a forced downgrade of such a schema fences its leader with.
bump_epoch_only = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID)
    .values(epoch=_next_epoch)
    .returning(leader.c.epoch)
)

#: How many takeovers ``cronoq_leader_history`` keeps: each takeover prunes past it.
TERMS_KEPT = 1_000

_history = leader_history
_recorded = {
    "began_at": func.clock_timestamp(),
    "lock_seen_held_at": bindparam("lock_seen_held_at", type_=DateTime(timezone=True)),
    "pid": func.pg_backend_pid(),
    "role": func.session_user(),
    "application_name": func.current_setting("application_name"),
    "client_addr": cast(func.host(func.inet_client_addr()), Text),
}

#: The takeover's row in the leadership history, in the transaction of its bump: the new
#: epoch, when, and the lock session that took it. An epoch met again (the counter wraps
#: at 32767, far beyond what is kept) replaces its row.
record_term = (
    postgresql.insert(_history)
    .values(epoch=bindparam("epoch", type_=Integer), **_recorded)
    .on_conflict_do_update(
        index_elements=[_history.c.epoch],
        set_={name: postgresql.insert(_history).excluded[name] for name in _recorded},
    )
)

_kept_from = (
    select(_history.c.began_at)
    .order_by(_history.c.began_at.desc())
    .offset(TERMS_KEPT - 1)
    .limit(1)
    .scalar_subquery()
)
#: The takeover's prune of the history past the newest :data:`TERMS_KEPT` rows: one
#: index range, whatever the table holds.
prune_terms = delete(_history).where(_history.c.began_at < _kept_from)

#: The host group a statement names (a bind apart from the column's name: SQLAlchemy
#: reserves that in ``SET``).
_group = bindparam("group", type_=Text)

#: Taking the lock takes the next epoch (:data:`bump_epoch`), only in the cluster
#: ``:incarnation`` (the leader table's OID) that the store was opened on, and only while no
#: host group leads it (``host_group`` NULL): no row in another, nor in an enrolled one.
#: An enrolled cluster's host takes its epochs without the lock, so the lock alone would
#: not keep a standalone from leading beside it.
take_epoch = bump_epoch.where(
    leader_tableoid == bindparam("incarnation", type_=postgresql.OID),
    leader.c.host_group.is_(None),
)

#: A host's takeover of a cluster enrolled in its group: the same bump as :data:`take_epoch`
#: (the holder recorded, the new epoch returned), only in the cluster ``:incarnation`` and
#: only while it is enrolled in host group ``:group``: no row otherwise. A standalone that
#: holds the lock keeps the cluster out of every group (:data:`enroll_cluster` tries the
#: lock first), so the two bumps never both succeed for long; the epoch fences whichever
#: bumped first.
take_hosted_epoch = bump_epoch.where(
    leader_tableoid == bindparam("incarnation", type_=postgresql.OID),
    leader.c.host_group == _group,
)


#: The schema the ``i``-th cluster of a claim batch's statements names
#: (:func:`hosted_claims`), mapped to that cluster's schema at execution.
def _claim_slot(i: int) -> str:
    return f"cronoq_claim_{i}"


@dataclass(frozen=True, slots=True)
class HostedClaims:
    """A host's claim of several clusters in one transaction, one statement for each step
    over all of them (a round trip each, whatever their number), the clusters sorted by
    schema name. Every statement names the ``i``-th cluster's tables in a placeholder
    schema: run each with :attr:`options` (from :func:`hosted_claims`, which makes both
    together), which maps every placeholder to its cluster."""

    #: Each cluster's leader table ``EXCLUSIVE``, in schema order, as :data:`leader_barrier`
    #: takes one: commits in flight land first, later ones wait.
    barrier: Executable
    #: Each cluster's :data:`take_hosted_epoch` (parameters :meth:`terms_params`) and, in
    #: the same statement, its :data:`record_term` of the new epoch: rows (``slot``, the
    #: cluster's place in the batch, ``epoch``) for the clusters bumped; none for one whose
    #: leader row is another cluster's or another group's.
    terms: Executable
    #: :data:`prune_terms` of each cluster, after its term was recorded.
    prune: Executable
    #: The execution options that point each placeholder schema at its cluster's.
    options: Mapping[str, Any]

    @staticmethod
    def terms_params(group: str, incarnations: Sequence[int]) -> dict[str, Any]:
        """:attr:`terms`'s parameters: the group, each cluster's incarnation in order."""
        return {"group": group, **{f"incarnation_{i}": n for i, n in enumerate(incarnations)}}


class _LockExclusiveAll(Executable, ClauseElement):
    """``LOCK TABLE ONLY <t1>, ONLY <t2>, ... IN EXCLUSIVE MODE``: the server locks them in
    the order given, one statement."""

    _traverse_internals = [("tables", InternalTraversal.dp_clauseelement_tuple)]  # noqa: RUF012
    inherit_cache = True

    def __init__(self, tables: Sequence[Table]) -> None:
        self.tables = tuple(tables)


@compiles(_LockExclusiveAll)
def _lock_exclusive_all(element: _LockExclusiveAll, compiler: SQLCompiler, **kw: Any) -> str:
    names = ", ".join(f"ONLY {compiler.preparer.format_table(t)}" for t in element.tables)
    return f"LOCK TABLE {names} IN EXCLUSIVE MODE"


@functools.lru_cache(maxsize=64)
def _claim_statements(count: int) -> tuple[Executable, Executable, Executable]:
    """The barrier, terms and prune of :class:`HostedClaims` for ``count`` clusters, built
    once per count: the compiled cache then serves every batch of that size."""
    leaders, bumps, prunes = [], [], []
    for i in range(count):
        names = MetaData()
        own = leader.to_metadata(names, schema=_claim_slot(i))
        history = leader_history.to_metadata(names, schema=_claim_slot(i))
        leaders.append(own)
        following = case((own.c.epoch >= EPOCH_MAX, 1), else_=own.c.epoch + 1)
        bumped = (
            update(own)
            .where(
                own.c.id == LEADER_ROW_ID,
                ColumnClause("tableoid", OID(), _selectable=own)
                == bindparam(f"incarnation_{i}", type_=OID),
                own.c.host_group == _group,
            )
            .values(
                epoch=following,
                holder_epoch=following,
                holder_pid=func.pg_backend_pid(),
                holder_backend_start=_own("backend_start"),
                holder_role=_own("usesysid"),
            )
            .returning(own.c.epoch)
            .cte(f"bumped_{i}")
        )
        recorded = {**_recorded, "lock_seen_held_at": null()}
        insert = postgresql.insert(history).from_select(
            ["epoch", *recorded], select(bumped.c.epoch, *recorded.values())
        )
        record = insert.on_conflict_do_update(
            index_elements=[history.c.epoch],
            set_={name: insert.excluded[name] for name in recorded},
        ).cte(f"recorded_{i}")
        bumps.append(select(literal(i, Integer).label("slot"), bumped.c.epoch).add_cte(record))
        kept_from = (
            select(history.c.began_at)
            .order_by(history.c.began_at.desc())
            .offset(TERMS_KEPT - 1)
            .limit(1)
            .scalar_subquery()
        )
        prunes.append(delete(history).where(history.c.began_at < kept_from).cte(f"pruned_{i}"))
    return (
        _LockExclusiveAll(leaders),
        union_all(*bumps),
        select(literal(count, Integer).label("pruned")).add_cte(*prunes),
    )


def hosted_claims(schemas: Sequence[str]) -> HostedClaims:
    """The statements claiming ``schemas`` (sorted by name, as every lock is taken in
    schema order) in one transaction, with the execution options that point them at
    ``schemas``: made together, so that no placeholder is ever left unmapped."""
    if list(schemas) != sorted(schemas) or len(set(schemas)) != len(schemas) or not schemas:
        raise ValueError("hosted_claims: distinct schemas, sorted by name, at least one")
    barrier, terms, prune = _claim_statements(len(schemas))
    translate = {_claim_slot(i): validate_schema_name(s) for i, s in enumerate(schemas)}
    return HostedClaims(barrier, terms, prune, {"schema_translate_map": translate})


#: Enrol the cluster ``:incarnation`` in host group ``:group`` (again: enrolling twice in
#: one group changes nothing). Run in a transaction that first took the leader lock with
#: :data:`try_leader_lock_for_transaction` (keys :data:`LOCK_NS_LEADER` and the schema's
#: OID, :data:`schema_oid`): the try fails while a standalone leads the cluster, or a
#: downgrade runs, and then nothing is enrolled. Returns the stored epoch; no row when the
#: schema holds another cluster, or another group holds this one.
enroll_cluster = (
    update(leader)
    .where(
        leader.c.id == LEADER_ROW_ID,
        leader_tableoid == bindparam("incarnation", type_=postgresql.OID),
        or_(leader.c.host_group.is_(None), leader.c.host_group == _group),
    )
    .values(host_group=_group)
    .returning(leader.c.epoch)
)

#: Take the cluster out of host group ``:group``: a standalone ``PgStore`` may lead it
#: again. Returns the stored epoch; no row when the cluster is not in that group.
unenroll_cluster = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID, leader.c.host_group == _group)
    .values(host_group=null())
    .returning(leader.c.epoch)
)

#: The leader row with the host group the cluster is enrolled in (NULL: none): why a bump
#: found no row to move, and what a downgrade refuses.
leader_enrolment = select(leader.c.epoch, leader_tableoid, leader.c.host_group).where(
    leader.c.id == LEADER_ROW_ID
)

#: The keeper's check of the lock session, one round trip: the stored epoch and the
#: cluster's incarnation (the leader table's OID) under the schema's name now. An answer is
#: a live session; another epoch or incarnation, or none, ends the term.
leader_now = select(leader.c.epoch, leader_tableoid).where(leader.c.id == LEADER_ROW_ID)

#: How long the keeper's check may wait for a lock on the leader table (a migration or a
#: ``DROP`` holds it exclusively) before the server gives up with 55P03: the session has
#: answered then, so the wait never reads as a silent session. Set once the epoch is
#: taken: the takeover's own wait for commits in flight must not be bounded by it.
keeper_lock_timeout = select(
    func.pg_catalog.set_config(
        literal("lock_timeout", Text), bindparam("lock_timeout", type_=Text), false()
    )
)

#: What the lock session sets for itself once connected, when the connection comes from an
#: application's pool creator (which ignores our connect arguments); each is a bind of the
#: same name. ``set_config`` is schema-qualified: the creator may have set any search_path.
LOCK_SESSION_SETTINGS = (
    "search_path",
    "application_name",
    "tcp_keepalives_idle",
    "tcp_keepalives_interval",
    "tcp_keepalives_count",
    "idle_session_timeout",
    "idle_in_transaction_session_timeout",
    "synchronous_commit",
    "default_transaction_read_only",
)
lock_session_settings = select(
    *(
        func.pg_catalog.set_config(literal(name, Text), bindparam(name, type_=Text), false())
        for name in LOCK_SESSION_SETTINGS
    )
)

#: The schema's OID, the second key of the leader lock (``pg_namespace`` is not translated).
#: ``to_regnamespace`` parses an identifier, so the name is quoted first: ``Prod`` stays
#: ``Prod`` instead of being folded to ``prod``.
schema_oid = select(
    func.to_regnamespace(func.quote_ident(bindparam("schema", type_=Text))).cast(Integer)
)


#: The only ``search_path`` the store's statements run under. PostgreSQL resolves a function
#: or operator whose argument types match exactly from any schema on the path, even one after
#: ``pg_catalog`` (CVE-2018-1058), so no schema another role can write is ever on it; our own
#: objects are always schema-qualified, and ``pg_temp`` (private to the session) comes last.
SEARCH_PATH = "pg_catalog, pg_temp"
_SEARCH_PATH_NAME: ColumnElement[str] = literal_column("'search_path'")

#: :data:`SEARCH_PATH` until the end of the current transaction, which then restores the
#: session's own: how reads and migrations on a borrowed connection get it.
local_search_path = select(
    func.pg_catalog.set_config(_SEARCH_PATH_NAME, literal_column(f"'{SEARCH_PATH}'"), true())
)

#: The session's own ``search_path``: without prepared statements (behind PgBouncer) the
#: store cannot set it per session and checks that PgBouncer or the role did.
session_search_path = select(func.pg_catalog.current_setting(_SEARCH_PATH_NAME))

#: The role the session runs as: who a trust check ran as, the role a pool connects as.
current_user = select(func.current_user())

#: The database the session is in, for a refusal that names it.
current_database = select(func.current_database())

#: One of the session's settings (``:name``) as the session sees it.
session_setting = select(func.pg_catalog.current_setting(bindparam("name", type_=Text), type_=Text))

#: A given ``search_path`` until the end of the current transaction.
set_local_search_path = select(
    func.pg_catalog.set_config(_SEARCH_PATH_NAME, bindparam("path", type_=Text), true())
)

# --- transactions on sessions the store does not own ---------------------------------------
# An application's pooled session, or whatever server connection a transaction-pooling
# PgBouncer hands out, carries settings someone else chose (``SET synchronous_commit = off``,
# ``SET ROLE``, ...). Every transaction of the store there starts with what its guarantees
# need, for that transaction alone (docs/reliability.md, "Borrowed sessions"). All of it
# travels in the message that opens the transaction: no round trip of its own.

#: Read committed (the fencing argument: each statement sees the epoch committed before it),
#: read-write whatever ``default_transaction_read_only`` says, never deferrable.
_BORROWED_BEGIN = text("BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE, NOT DEFERRABLE")

#: The identity, durability and timeouts configured for the sessions (role, database,
#: server, connect arguments), as the store's own pool would have them, not a ``SET`` of the
#: session's: ``SET LOCAL ... TO DEFAULT`` takes the reset value, which no ``SET`` changes.
#: ``SET ROLE`` and ``SET SESSION AUTHORIZATION`` would make the store act as another role;
#: an application's short ``statement_timeout`` would fail every commit.
_BORROWED_DEFAULTS = (
    # First, as each statement of the message runs under the limit the one before left: an
    # application's limit of a millisecond would otherwise cancel the opening itself on a
    # busy server. It names no object, so no path another client left can capture it.
    text("SET LOCAL statement_timeout TO DEFAULT"),
    # Then, before any statement that names an object: each statement of the opening
    # message is analysed after the one before ran, so no name below resolves through a
    # path another client left on the session.
    text(f"SET LOCAL search_path = {SEARCH_PATH}"),
    text("SET LOCAL SESSION AUTHORIZATION DEFAULT"),
    text("SET LOCAL role TO DEFAULT"),
    text("SET LOCAL synchronous_commit TO DEFAULT"),
    text("SET LOCAL lock_timeout TO DEFAULT"),
)


def _constant(value: str) -> ColumnElement[str]:
    """A constant of this module as an SQL literal (no parameter: the opening message of a
    transaction travels by the simple protocol)."""
    if "'" in value or "\\" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return literal_column(f"'{value}'", Text)


def _setting(name: str) -> ColumnElement[str]:
    """The setting ``name`` now, NULL if the server has no such setting."""
    return func.pg_catalog.current_setting(_constant(name), true(), type_=Text)


def _equal(left: ColumnElement[str], right: ColumnElement[str]) -> ColumnElement[bool]:
    """``left = right`` with pg_catalog's operator, whatever the session's search_path."""
    return left.op("OPERATOR(pg_catalog.=)", is_comparison=True)(right)


def _set_local(name: str, value: ColumnElement[str] | str) -> ColumnElement[str]:
    """``name`` set to ``value`` until the end of the transaction."""
    if isinstance(value, str):
        value = _constant(value)
    return func.pg_catalog.set_config(_constant(name), value, true(), type_=Text)


def _check_milliseconds(value: int) -> None:
    """Refuse what is not a timeout in milliseconds (it is rendered as a literal)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"not a timeout in milliseconds: {value!r}")


def borrowed_transaction(idle_in_transaction_ms: int) -> tuple[Any, ...]:
    """The statements that open a transaction of the store on a borrowed session, in order.

    ``idle_in_transaction_ms`` is the store's own bound on a transaction left idle (its
    pool's ``idle_in_transaction_session_timeout``), rendered as a literal: an integer only.
    """
    _check_milliseconds(idle_in_transaction_ms)
    settings = select(
        # At least "on" (flushed, and confirmed by the synchronous standbys): a configured
        # remote_apply, stronger, is kept; local, remote_write and off are not enough.
        _set_local(
            "synchronous_commit",
            case(
                (
                    _equal(_setting("synchronous_commit"), _constant("remote_apply")),
                    _constant("remote_apply"),
                ),
                else_=_constant("on"),
            ),
        ),
        _set_local("idle_in_transaction_session_timeout", str(idle_in_transaction_ms)),
        # asyncpg encodes and decodes text in the session's client_encoding.
        _set_local("client_encoding", "UTF8"),
        # "replica" skips triggers and foreign keys; only a superuser may set it, so only
        # when it differs (a session that could set it can set it back).
        case(
            (
                not_(_equal(_setting("session_replication_role"), _constant("origin"))),
                _set_local("session_replication_role", "origin"),
            )
        ),
    )
    return (_BORROWED_BEGIN, *_BORROWED_DEFAULTS, settings)


# --- idle transactions ---------------------------------------------------------------------

#: How long the server lets a store transaction that takes no lock on the leader row sit
#: idle (reads, recovery, migrations), in milliseconds. Their idle gaps are the client's own
#: work: decoding a partition of recovery's cursor or a page of rows, Alembic loading its
#: revisions, a health check's second look. That work grows with the rows and the machine's
#: load, and must not fail because ``session_timeout`` is short. The leader row's lock
#: (commits, prune batches) is what a takeover waits for: those transactions keep
#: ``session_timeout`` (``_door.idle_in_transaction_ms``). This bound is for a client that
#: froze mid-transaction, whose snapshot and table locks would otherwise stay for ever.
IDLE_LIMIT_MS = 60_000


def store_transaction(idle_in_transaction_ms: int, *, borrowed: bool) -> tuple[Any, ...]:
    """The statements that open a store transaction, ``BEGIN`` first: on a borrowed session
    :func:`borrowed_transaction`, on the store's own only the idle limit (the session's
    other settings are the store's)."""
    if borrowed:
        return borrowed_transaction(idle_in_transaction_ms)
    _check_milliseconds(idle_in_transaction_ms)
    idle = select(_set_local("idle_in_transaction_session_timeout", str(idle_in_transaction_ms)))
    return (text("BEGIN"), idle)


#: Where the script's owner check finds the schema's name: a setting, so that the check
#: itself is constant text (a ``DO`` block takes no parameters).
_CHECKED_SCHEMA: ColumnElement[str] = literal_column("'cronoq_store._schema'")


def checked_schema(schema: str) -> Select[tuple[str]]:
    """Name ``schema`` to :data:`refuse_foreign_owner` until the end of the transaction (the
    offline script renders the name as a literal)."""
    return select(func.pg_catalog.set_config(_CHECKED_SCHEMA, literal(schema, Text), true()))


#: What an offline (``--sql``) script runs right after ``CREATE SCHEMA IF NOT EXISTS``: stop,
#: before any DDL, if a role other than the one running it, and not a superuser, owns the
#: schema named by :func:`checked_schema` (it could have planted code the script would run
#: as us). Only the owner: the online run's full check (``trust.refuse_untrusted``)
#: needs its answers in Python.
refuse_foreign_owner = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store._schema');
    owner_ pg_catalog.name;
BEGIN
    SELECT r.rolname INTO owner_
    FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid = n.nspowner
    WHERE n.nspname = schema_ AND r.rolname <> current_user AND NOT r.rolsuper;
    IF FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'insufficient_privilege',
            MESSAGE = 'cronoq-store: schema ' || pg_catalog.quote_ident(schema_)
                || ' is owned by ' || pg_catalog.quote_ident(owner_) || ', neither '
                || pg_catalog.quote_ident(current_user) || ' nor a superuser: refusing to '
                || 'migrate it (its owner could have planted code that would run as '
                || pg_catalog.quote_ident(current_user) || '); run the script as its owner';
    END IF;
END
$cronoq$"""
)


# --- a downgrade, under the leader lock (``cronoq_store._migrations``) --------------------

#: ``pg_try_advisory_xact_lock(k1, k2)``: true if this transaction now holds the leader lock,
#: until it ends; a standby's ``pg_try_advisory_lock`` fails meanwhile.
try_leader_lock_for_transaction = select(
    func.pg_try_advisory_xact_lock(bindparam("k1", type_=Integer), bindparam("k2", type_=Integer))
)

#: Whether the cluster ever issued a task id: someone led (the epoch moved) or a task is stored.
#: A cluster made again after a downgrade to base starts at epoch 0 and issues them again.
cluster_issued_ids = select(
    or_(
        select(leader.c.id).where(leader.c.epoch > 0).exists(),
        select(tasks.c.id).exists(),
    )
)


#: The cluster's tables in the order a migration locks them: the leader row first, as every
#: commit takes it, so no commit can deadlock with the migration's DDL.
CLUSTER_TABLES = tuple(t.name for t in (leader, tasks, recurring))


def lock_cluster_tables(schema: str, dialect: Any, names: tuple[str, ...] = CLUSTER_TABLES) -> DDL:
    """``LOCK TABLE`` of the cluster's tables ``names`` in ``schema``, all in one statement
    before a migration touches any: it waits for commits in flight, and later ones wait for
    it, in :data:`CLUSTER_TABLES`' order, so none can deadlock with its DDL."""
    quote = dialect.identifier_preparer.quote
    ordered = [name for name in CLUSTER_TABLES if name in names]
    listed = ", ".join(f"{quote(schema)}.{quote(name)}" for name in ordered)
    return DDL(f"LOCK TABLE ONLY {listed} IN ACCESS EXCLUSIVE MODE")  # type: ignore[no-untyped-call]


# --- bounded lock waits (``cronoq_store._door``) ---------------------------------------

#: ``pg_try_advisory_xact_lock`` of the migration lock of the schema named ``schema``: true
#: if this transaction now holds it, until it ends. Tried, never waited on: the waiter
#: looks at who holds it between tries, says so, and gives up after its bound.
try_migration_lock = select(
    func.pg_try_advisory_xact_lock(
        literal(LOCK_NS_MIGRATE, Integer), func.hashtext(bindparam("schema", type_=Text))
    )
)

#: ``pg_advisory_xact_lock`` of the same lock, waited on: the offline script's (``alembic
#: upgrade --sql``), which cannot look at the holder between tries; the script's
#: ``lock_timeout`` bounds the wait.
wait_migration_lock = select(
    func.pg_advisory_xact_lock(
        literal(LOCK_NS_MIGRATE, Integer), func.hashtext(bindparam("schema", type_=Text))
    )
)

#: ``lock_timeout`` (``ms``, an integer as text) until the end of the transaction, or of
#: the savepoint it is set in: how long the next lock wait may take before it fails with
#: 55P03 instead of waiting on.
set_local_lock_timeout = select(
    func.pg_catalog.set_config(
        literal("lock_timeout", Text), bindparam("ms", type_=Text), true(), type_=Text
    )
)

#: A pause of ``seconds`` on the server: the same round trip on a greenlet's connection as on
#: a plain one, where a client's sleep would block an event loop.
pause = select(func.pg_catalog.pg_sleep(bindparam("seconds", type_=Float)))

#: One attempt at a lock, inside the caller's transaction, that can fail without ending it.
savepoint = text("SAVEPOINT cronoq_lock_wait")
rollback_to_savepoint = text("ROLLBACK TO SAVEPOINT cronoq_lock_wait")
release_savepoint = text("RELEASE SAVEPOINT cronoq_lock_wait")


#: What an offline (``--sql``) downgrade script runs before its first revision: stop if a
#: session holds the leader lock of the schema named by :func:`checked_schema`, else hold it
#: until the script's COMMIT, as the online run does (``-x force=true`` leaves this out).
#: The key is :data:`LOCK_NS_LEADER`, written out: the block is constant text.
refuse_live_leader = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store._schema');
    holder_ pg_catalog.text;
BEGIN
    IF NOT pg_catalog.pg_try_advisory_xact_lock(1668444017, pg_catalog.to_regnamespace(
            pg_catalog.quote_ident(schema_))::pg_catalog.oid::pg_catalog.int4) THEN
        SELECT 'pid ' || l.pid || ', role ' || pg_catalog.quote_nullable(a.usename)
                || ', application ' || pg_catalog.quote_nullable(a.application_name)
                || ', since ' || COALESCE(a.backend_start::pg_catalog.text, 'unknown')
            INTO holder_
        FROM pg_catalog.pg_locks l LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
            AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d
                WHERE d.datname = pg_catalog.current_database())
            AND l.classid = 1668444017 AND l.objid = pg_catalog.to_regnamespace(
                pg_catalog.quote_ident(schema_))::pg_catalog.oid;
        RAISE EXCEPTION USING
            ERRCODE = 'object_in_use',
            MESSAGE = 'cronoq-store: an instance leads schema ' || pg_catalog.quote_ident(schema_)
                || ' (it holds the leader lock: ' || COALESCE(holder_, 'let go since')
                || '): refusing to downgrade under a live leader; stop every instance, or '
                || 'generate the script with -x force=true';
    END IF;
END
$cronoq$"""
)

#: What an offline (``--sql``) downgrade script of a schema from revision 0009 on runs after
#: :data:`refuse_live_leader`: stop if the cluster in the schema named by
#: :func:`checked_schema` is enrolled in a host group, whose host leads it without the
#: leader lock (``-x force=true`` leaves this out). No ``format``: the printed script would
#: double its ``%``.
refuse_enrolled = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store._schema');
    group_ pg_catalog.text;
BEGIN
    EXECUTE 'SELECT host_group FROM ' || pg_catalog.quote_ident(schema_)
        || '.cronoq_leader WHERE id = 1' INTO group_;
    IF group_ IS NOT NULL THEN
        RAISE EXCEPTION USING
            ERRCODE = 'object_in_use',
            MESSAGE = 'cronoq-store: schema ' || pg_catalog.quote_ident(schema_)
                || ' is enrolled in host group ' || pg_catalog.quote_literal(group_)
                || ': a host leads it without holding its leader lock; refusing to '
                || 'downgrade it; remove it from the host group first, or generate the '
                || 'script with -x force=true';
    END IF;
END
$cronoq$"""
)

# --- the host's commit bus: commits staged in a session's own table -----------------------

#: Where a group of the host's commit bus puts the new tasks of its commits, all in one COPY,
#: before each is inserted into its own cluster by a statement prepared once per session
#: (:data:`insert_staged`): a commit then costs one short ``EXECUTE`` in a message shared
#: with the group's others, where a statement of its own cost a round trip and the client's
#: encoding of two dozen parameters. A temporary table: the session's alone, named through
#: its own ``pg_temp`` (no schema another role can write), and emptied at every commit.
#: ``member`` is the commit's position in its group.
staged_tasks = Table(
    "cronoq_staging",
    MetaData(),
    Column("member", Integer, nullable=False),
    *(Column(name, tasks.c[name].type) for name in INSERT_COLUMNS),
    schema="pg_temp",
    prefixes=["TEMPORARY"],
    postgresql_on_commit="DELETE ROWS",
)

#: Makes :data:`staged_tasks` in a session that lacks it (outside any transaction: it
#: stays for the session).
create_staging = CreateTable(staged_tasks, if_not_exists=True)

#: One commit's staged tasks (``member``) into its cluster, with the conflict rule of
#: :data:`insert_tasks`, inside a transaction that checked the epoch
#: (:data:`epoch_kept_for_share`).
insert_staged = _insert_from(
    select(*(staged_tasks.c[name] for name in INSERT_COLUMNS)).where(
        staged_tasks.c.member == bindparam("member", type_=Integer)
    )
)

_epoch_now = select(cast(leader.c.epoch, Text)).where(leader.c.id == LEADER_ROW_ID)

#: The epoch check of a commit in a group of the host's commit bus, run with the others'
#: in one message, where no row can be returned: it share-locks the leader row as
#: :data:`epoch_held_for_share` does and fails the transaction, with SQLSTATE 22P02 as
#: :data:`incarnation_kept` (a text that is no integer, naming the epoch found), unless the
#: stored epoch is ``:epoch`` and the leader table ``:incarnation``. The row is locked by the
#: ``EXISTS``, which the planner keeps a subplan since it locks; the cast is of a value read,
#: so it cannot be folded (and fail) ahead of the ``WHERE``.
epoch_kept_for_share = select(
    cast(
        literal_column("'cronoq_store: the fence moved, the epoch is now '")
        + func.coalesce(_epoch_now.scalar_subquery(), literal_column("'missing'")),
        Integer,
    )
).where(
    ~exists(
        select(leader.c.id)
        .where(
            leader.c.id == LEADER_ROW_ID,
            leader.c.epoch == _epoch,
            leader_tableoid == _incarnation,
        )
        .with_for_update(read=True)
    )
)

#: Opens a group's transaction on the bus's own sessions when every statement in it is the
#: bus's: plans made for the values at hand (the first five runs of a prepared statement)
#: would cost each cluster's staged insert a planning of its own, for the same plan.
generic_plans = text("SET LOCAL plan_cache_mode = force_generic_plan")
