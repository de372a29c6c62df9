"""Every statement the store runs, as SQLAlchemy Core constructs built once at import.

The tables carry no schema name, so each construct compiles once and the compiled cache
serves every cluster: the schema is applied at execution with ``schema_translate_map``.
Array parameters are typed (``ARRAY(BigInteger)`` renders ``$1::BIGINT[]``) because the
server cannot resolve ``unnest`` over an untyped array.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
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
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import DDL
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.selectable import Select, TableValuedAlias
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import TypeEngine

from .domain import EPOCH_MAX, QUEUED, TaskStatus
from .folding import LIVE_RANKS, TERMINAL_LEVEL
from .rows import (
    IDENTITY_COLUMNS,
    INSERT_COLUMNS,
    JSON_COLUMNS,
    LIVE_COLUMNS,
    RECORD_COLUMNS,
    RECURRING_COLUMNS,
)
from .schema import LEADER_ROW_ID, VERSION_TABLE, leader, recurring, tasks

__all__ = [
    "LOCK_NS_LEADER",
    "LOCK_SESSION_SETTINGS",
    "SEARCH_PATH",
    "accepts_writes",
    "advance_recurring",
    "borrowed_transaction",
    "bump_epoch",
    "checked_schema",
    "colliding_ids",
    "epoch_for_share",
    "epoch_held_for_share",
    "finished_page",
    "high_water",
    "insert_task_fenced",
    "insert_tasks",
    "insert_tasks_fenced",
    "key_holders",
    "leader_barrier",
    "live_tasks",
    "local_search_path",
    "lock_session_settings",
    "ping",
    "prune_batch",
    "quarantine",
    "recent_terminal",
    "recurring_schedules",
    "refuse_foreign_owner",
    "remove_recurring",
    "schema_oid",
    "server_encoding",
    "session_search_path",
    "set_local_search_path",
    "store_outputs",
    "takeover_begin",
    "takeover_commit",
    "task_by_id",
    "task_by_key",
    "task_output",
    "try_leader_lock",
    "update_status",
    "update_status_fenced",
    "upsert_recurring",
]

#: First key of the leader's session advisory lock ("croq"); the second is the schema's OID.
LOCK_NS_LEADER = 0x63726F71
#: Fencing epochs stay within 1..32767 so that epoch-prefixed task ids fit a signed BIGINT.

# --- leadership -----------------------------------------------------------------------------

#: ``pg_try_advisory_lock(k1, k2)``: true if this session now holds the leader lock.
try_leader_lock = select(
    func.pg_try_advisory_lock(bindparam("k1", type_=Integer), bindparam("k2", type_=Integer))
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


#: Taking the lock bumps the epoch, wrapping 32767 -> 1, and records the lock session that
#: did (pid, backend start, role): what tells the leader from a session that only holds the
#: lock (:data:`health_facts`). Returns the new epoch.
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

#: The lock session's liveness check.
ping = select(1)

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

# --- commit: epoch check --------------------------------------------------------------------

#: The epoch under a share lock: it waits for a takeover's uncommitted bump and then sees it,
#: and a takeover waits for this commit, so a commit lands entirely before or after one.
epoch_for_share = (
    select(leader.c.epoch).where(leader.c.id == LEADER_ROW_ID).with_for_update(read=True)
)

#: The epoch a commit expects.
_epoch = bindparam("epoch", type_=Integer)


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

#: The transaction of a takeover on the lock session, which is in autocommit.
takeover_begin = text("BEGIN")
takeover_commit = text("COMMIT")

#: The epoch check of a commit's transaction, sent with its ``BEGIN`` (its parameter is an
#: integer, rendered as a literal by the writer): one row, share-locked as by
#: :data:`epoch_for_share`, when the stored epoch is ``:epoch``; none otherwise. Commits
#: share the lock, so none waits for another; a takeover's bump waits for all of them.
epoch_held_for_share = (
    select(leader.c.epoch)
    .where(leader.c.id == LEADER_ROW_ID, leader.c.epoch == _epoch)
    .with_for_update(read=True)
)


def _unnest(name: str, *columns: tuple[str, TypeEngine[Any]]) -> TableValuedAlias:
    """``unnest($1::T1[], ...) AS name(c1, ...)``: one typed array parameter per column."""
    binds = [bindparam(col, type_=ARRAY(type_)) for col, type_ in columns]
    cols = [column(col, type_) for col, type_ in columns]
    return func.unnest(*binds).table_valued(*cols).render_derived(name=name)


# --- commit: one update per existing task ---------------------------------------------------

_transition = _unnest(
    "u",
    ("ids", BigInteger()),
    ("statuses", Text()),
    ("terminals", Boolean()),
    ("attempts", Integer()),
    ("updated", BigInteger()),
    ("levels", BigInteger()),
    ("messages", Text()),
    ("message_levels", BigInteger()),
    ("message_ats", BigInteger()),
)


def _level(terminal: ColumnElement[bool], attempt: Any, status: Any) -> ColumnElement[int]:
    """:func:`cronoq_store.folding.level` in SQL, for the stored row and the transition; the
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
        else_=cast(attempt, BigInteger) * constant(4) + rank,
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
#: :func:`cronoq_store.folding.level` of each transition, computed by the fold.
_forward = (
    tasks.c.id == _u.ids,
    ~tasks.c.terminal,
    tuple_(_u.levels, _u.updated) > _stored_position,
)

#: Status transitions, one per task, each applied only if it moves the task forward. The
#: message is the transition's if the one that brought it is ahead of the stored state, else
#: the stored one stays: a message carries forward until a later transition replaces it.
update_status = update(tasks).where(*_forward).values(_transition_values)

_sharing = epoch_for_share.cte("e")
_transitioned = (
    update(tasks)
    .where(*_forward, _sharing.c.epoch == _epoch)
    .values(_transition_values)
    .returning(tasks.c.id)
    .cte("upd")
)

#: A batch of status transitions only, as one statement: the epoch under a share lock (as
#: :data:`epoch_for_share`) and the updates, which change nothing unless the stored epoch is
#: ``:epoch``. Returns the stored epoch and the number of rows moved forward.
update_status_fenced = select(
    _sharing.c.epoch,
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

#: A batch of new tasks only, as one statement, so one round trip without BEGIN and COMMIT:
#: the epoch under a share lock (as :data:`epoch_for_share`) and the insert, which writes
#: nothing unless the stored epoch is ``:epoch``. Returns the stored epoch, for the caller
#: to raise ``FencedError``.
insert_tasks_fenced = select(_sharing.c.epoch).add_cte(
    _insert_from(_new_rows.where(_sharing.c.epoch == _epoch)).cte("ins")
)

#: One new task: the same as :data:`insert_tasks_fenced` with one scalar parameter per
#: column. A batch of one is the commonest, and 25 one-element arrays cost the client (each
#: encoded and checked) and the server (``unnest``) more than 25 values.
insert_task_fenced = select(_sharing.c.epoch).add_cte(
    _insert_from(
        select(
            *(
                (
                    cast(bindparam(name, type_=Text), JSONB)
                    if name in JSON_COLUMNS
                    else bindparam(name, type_=tasks.c[name].type)
                ).label(name)
                for name in INSERT_COLUMNS
            )
        ).where(_sharing.c.epoch == _epoch)
    ).cte("ins")
)

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
#: (NULL for none: a stored id 0 counts). The caller adds one in Python: the largest id may
#: be 2**63-1.
high_water = select(
    select(leader.c.max_id).where(leader.c.id == LEADER_ROW_ID).scalar_subquery(),
    select(func.max(tasks.c.id)).scalar_subquery(),
)


def _columns(table: Table, names: tuple[str, ...]) -> list[ColumnElement[Any]]:
    """``names`` of ``table`` in that order, jsonb columns as their text: the dialect would
    otherwise ``json.loads`` every value, several times slower than decoding once where the
    values are used (:mod:`cronoq_store.rows`)."""
    return [
        cast(table.c[name], Text).label(name) if name in JSON_COLUMNS else table.c[name]
        for name in names
    ]


#: Live tasks in id order, as ``rows.LiveTasks.decode`` takes them.
live_tasks = select(*_columns(tasks, LIVE_COLUMNS)).where(~tasks.c.terminal).order_by(tasks.c.id)

_corrupt = _unnest("u", ("ids", BigInteger()), ("messages", Text()))

#: Mark undecodable live rows failed, each with the reason, so they never block recovery.
quarantine = (
    update(tasks)
    .where(tasks.c.id == _corrupt.c.ids)
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
_victims = (
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

_prune_delete = delete(tasks).where(tasks.c.id.in_(select(_victims.c.id)))
_pruned = _prune_delete.returning(tasks.c.id).cte("pruned")

#: Delete up to ``batch`` of the oldest finished tasks updated before ``cutoff`` that no
#: live task depends on, by id or by key, and record the largest id deleted in the leader
#: row's ``max_id`` (``GREATEST`` skips the NULL of an empty batch), in the same statement:
#: the deletion and its record commit together or not at all, on the primary and on every
#: replica, so :func:`cronoq_store.recovery.next_id` never goes below an id once stored.
#: Returns how many tasks were deleted.
prune_batch = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID)
    .values(max_id=func.greatest(leader.c.max_id, select(func.max(_pruned.c.id)).scalar_subquery()))
    .returning(select(func.count()).select_from(_pruned).scalar_subquery())
)


# --- search path ----------------------------------------------------------------------------

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
    # First: each statement of the opening message is analysed after the one before ran,
    # so no name below resolves through a path another client left on the session.
    text(f"SET LOCAL search_path = {SEARCH_PATH}"),
    text("SET LOCAL SESSION AUTHORIZATION DEFAULT"),
    text("SET LOCAL role TO DEFAULT"),
    text("SET LOCAL synchronous_commit TO DEFAULT"),
    text("SET LOCAL statement_timeout TO DEFAULT"),
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


def borrowed_transaction(idle_in_transaction_ms: int) -> tuple[Any, ...]:
    """The statements that open a transaction of the store on a borrowed session, in order.

    ``idle_in_transaction_ms`` is the store's own bound on a transaction left idle (its
    pool's ``idle_in_transaction_session_timeout``), rendered as a literal: an integer only.
    """
    if type(idle_in_transaction_ms) is not int or idle_in_transaction_ms < 0:
        raise ValueError(f"not a timeout in milliseconds: {idle_in_transaction_ms!r}")
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


# --- offline migration script -------------------------------------------------------------


#: Where the script's owner check finds the schema's name: a setting, so that the check
#: itself is constant text (a ``DO`` block takes no parameters).
_CHECKED_SCHEMA: ColumnElement[str] = literal_column("'cronoq_store.schema'")


def checked_schema(schema: str) -> Select[tuple[str]]:
    """Name ``schema`` to :data:`refuse_foreign_owner` until the end of the transaction (the
    offline script renders the name as a literal)."""
    return select(func.pg_catalog.set_config(_CHECKED_SCHEMA, literal(schema, Text), true()))


#: What an offline (``--sql``) script runs right after ``CREATE SCHEMA IF NOT EXISTS``: stop,
#: before any DDL, if a role other than the one running it, and not a superuser, owns the
#: schema named by :func:`checked_schema` (it could have planted code the script would run
#: as us). Only the owner: the online run's full check (``migrations.refuse_untrusted``)
#: needs its answers in Python.
refuse_foreign_owner = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store.schema');
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


# --- health ---------------------------------------------------------------------------------

#: Whether the server takes writes (a standby, or a demoted primary, answers false): what the
#: group committer asks before giving up on a batch that keeps failing. Schema-qualified: it
#: also runs outside a store transaction on a borrowed session, under the application's
#: ``search_path`` (a ``pg_is_in_recovery`` planted before ``pg_catalog`` must not answer).
accepts_writes = select(not_(func.pg_catalog.pg_is_in_recovery(type_=Boolean)))


# --- catalogs and counts: what the operator's tool shows and migrations ask ---------------
# Commits, recovery and look-ups never run these. Their names are added to __all__ here.

__all__ += [
    "finished_before_count",
    "leader_lock_holder",
    "leader_state",
    "prunable_count",
    "quarantined_count",
    "relation_exists",
    "schedule_summaries",
    "server_now",
    "server_version",
    "task_counts",
    "task_statuses",
    "tasks_with_kind_or_message",
]

# Catalog tables carry their schema: ``schema_translate_map`` renames only schema-less ones.
_catalog = MetaData(schema="pg_catalog")
_pg_locks = Table(
    "pg_locks",
    _catalog,
    Column("locktype", Text),
    Column("database", postgresql.OID),
    Column("classid", postgresql.OID),
    Column("objid", postgresql.OID),
    Column("objsubid", Integer),
    Column("pid", Integer),
    Column("granted", Boolean),
    Column("relation", postgresql.OID),
    Column("mode", Text),
)
_pg_stat_activity = Table(
    "pg_stat_activity",
    _catalog,
    Column("pid", Integer),
    Column("usesysid", postgresql.OID),
    Column("usename", Text),
    Column("application_name", Text),
    Column("client_addr", postgresql.INET),
    Column("backend_start", postgresql.TIMESTAMP(timezone=True)),
)
_pg_database = Table(
    "pg_database", _catalog, Column("oid", postgresql.OID), Column("datname", Text)
)

#: Whether ``schema.name`` names a table (or any relation); ``format('%I')`` quotes on the
#: server. What migrations ask of a schema made before Alembic's version table.
relation_exists = select(
    func.to_regclass(
        func.format(
            literal("%I.%I", Text), bindparam("schema", type_=Text), bindparam("name", type_=Text)
        )
    ).is_not(None)
)

#: The clock every operator's run agrees on: the server's, not the client machine's.
server_now = select(func.now())
#: The server's version, as ``SHOW server_version`` prints it.
server_version = select(func.current_setting(literal("server_version", Text)))

#: The leader row's fencing epoch and the largest id ever stored: the largest stored id or
#: the largest prune deleted (``max_id``), whichever is greater.
leader_state = select(
    leader.c.epoch,
    func.greatest(leader.c.max_id, select(func.max(tasks.c.id)).scalar_subquery()).label("max_id"),
).where(leader.c.id == LEADER_ROW_ID)

#: The session holding the leader's advisory lock (keys ``k1``, ``k2``) in this database,
#: with what ``pg_stat_activity`` shows of it. A two-int key shows as ``classid = k1,
#: objid = k2, objsubid = 2``; those columns are ``oid`` (unsigned), so they are compared as
#: BIGINT. Advisory locks are per database, and so are schema OIDs.
leader_lock_holder = (
    select(
        _pg_stat_activity.c.pid,
        _pg_stat_activity.c.usesysid,
        _pg_stat_activity.c.usename,
        _pg_stat_activity.c.application_name,
        func.host(_pg_stat_activity.c.client_addr).label("client_addr"),
        _pg_stat_activity.c.backend_start,
    )
    .select_from(_pg_locks.join(_pg_stat_activity, _pg_locks.c.pid == _pg_stat_activity.c.pid))
    .where(
        _pg_locks.c.locktype == "advisory",
        _pg_locks.c.database
        == select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery(),
        cast(_pg_locks.c.classid, BigInteger) == bindparam("k1", type_=BigInteger),
        cast(_pg_locks.c.objid, BigInteger) == bindparam("k2", type_=BigInteger),
        _pg_locks.c.objsubid == 2,
        _pg_locks.c.granted,
    )
)

#: Tasks by pool, live or finished, and status. A full scan: an operator's occasional look,
#: not a probe.
task_counts = (
    select(tasks.c.pool, tasks.c.terminal, tasks.c.status, func.count().label("n"))
    .group_by(tasks.c.pool, tasks.c.terminal, tasks.c.status)
    .order_by(tasks.c.pool, tasks.c.terminal, tasks.c.status)
)

#: How many rows recovery quarantined: failed, with a message starting with ``prefix``
#: (``codec.QUARANTINE_PREFIX``).
quarantined_count = select(func.count()).where(
    tasks.c.terminal,
    tasks.c.status == TaskStatus.FAILED.value,
    func.starts_with(tasks.c.message, bindparam("prefix", type_=Text)),
)

#: Every recurring schedule's name, schedule (its JSON as text: the dialect's ``json.loads``
#: recurses on a hand-written value nested too deep), next run and last task.
schedule_summaries = select(
    recurring.c.name,
    cast(recurring.c.spec["schedule"], Text).label("schedule"),
    recurring.c.next_unix_ns,
    recurring.c.last_task_id,
).order_by(recurring.c.name)

#: Finished tasks last updated before ``cutoff``, whether prunable or protected.
finished_before_count = select(func.count()).where(
    tasks.c.terminal, tasks.c.updated_unix_ns < bindparam("cutoff", type_=BigInteger)
)

_prune_where = _prune_delete.whereclause
assert _prune_where is not None, "the prune statement names its victims"
#: What :data:`prune_batch` would delete with ``batch`` as large as the table: its own
#: ``DELETE``'s WHERE clause (not the leader row's update around it), so a dry run never
#: disagrees with it about what a live task depends on.
prunable_count = select(func.count()).select_from(tasks).where(_prune_where)

# --- the HA demo (``cronoq_store.demo``) reads back what it wrote ----------------------------

#: Every task's id and status.
task_statuses = select(tasks.c.id, tasks.c.status)

#: How many tasks carry ``kind`` or ``message``: the marks of the demo zombie's writes.
tasks_with_kind_or_message = select(func.count()).where(
    or_(
        tasks.c.kind == bindparam("kind", type_=Text),
        tasks.c.message == bindparam("message", type_=Text),
    )
)

# --- health (``PgStore.health``, ``cronoq-store health``) ----------------------------------

__all__ += ["health_facts", "leader_holder_facts"]

# Alembic's version table, schema-less like the store's tables so the cluster's schema is
# applied at execution; only its one column is read.
_versions = Table(VERSION_TABLE, MetaData(), Column("version_num", Text))
_holder = leader_lock_holder.subquery("h")
# The leader table's own OID (its ``tableoid``), to find locks on it in ``pg_locks``.
_leader_oid = Table(leader.name, MetaData(), Column("tableoid", postgresql.OID))

#: Whether the holder is the lock session the leader row records: the same pid and role,
#: and the same backend start where the reader may see it (pg_read_all_stats). A holder
#: that never moved the epoch (any role that can connect can take the lock) is not.
_recorded = and_(
    _holder.c.pid == leader.c.holder_pid,
    _holder.c.usesysid == leader.c.holder_role,
    or_(
        _holder.c.backend_start.is_(None),
        _holder.c.backend_start == leader.c.holder_backend_start,
    ),
)
#: Whether the current epoch was taken by a build that does not record its holder (before
#: revision 0007, mid rolling upgrade): the holder is then unknown, and not called foreign.
#: Epoch 0 was never taken: a holder there is foreign. Only a writer of the row can move it.
_unrecorded_epoch = and_(leader.c.epoch > 0, leader.c.holder_epoch.is_distinct_from(leader.c.epoch))
#: Whether the holder is moving the epoch now: it holds the row-exclusive lock of the leader
#: table, which its ``UPDATE`` takes before waiting for the row (a takeover waits there for
#: the old leader's commits) and keeps until it commits, and its role may update the table.
#: ``pg_locks`` shows every session's locks to every role.
_leader_table = select(_leader_oid.c.tableoid).limit(1).scalar_subquery()
_bumping = and_(
    select(_pg_locks.c.pid)
    .where(
        _pg_locks.c.pid == _holder.c.pid,
        _pg_locks.c.locktype == "relation",
        _pg_locks.c.relation == _leader_table,
        _pg_locks.c.mode == "RowExclusiveLock",
        _pg_locks.c.granted,
    )
    .exists(),
    # A statement takes that lock when parsed, its privileges are checked when it runs:
    # `PREPARE ... AS UPDATE` in an open transaction holds it for any role with USAGE on
    # the schema.
    func.pg_catalog.has_table_privilege(
        _holder.c.usesysid, _leader_table, literal("UPDATE", Text), type_=Boolean
    ),
)

#: The stored epoch, the leader lock's holder (keys ``k1``, ``k2``; NULL columns when none
#: holds it) and whether it is a store instance (the session the leader row records, or one
#: bumping the epoch now): what a waiting standby's lock session reads, with no more
#: privilege than it has (``SELECT`` on the leader row).
leader_holder_facts = (
    select(
        leader.c.epoch,
        _holder.c.pid,
        _holder.c.usename,
        _holder.c.application_name,
        _holder.c.client_addr,
        _holder.c.backend_start,
        or_(func.coalesce(_recorded, false()), _bumping, _unrecorded_epoch).label("store_instance"),
    )
    .select_from(leader.outerjoin(_holder, true()))
    .where(leader.c.id == LEADER_ROW_ID)
)

#: In one round trip: :data:`leader_holder_facts` and the revisions the version table
#: records.
health_facts = leader_holder_facts.add_columns(
    select(func.array_agg(_versions.c.version_num, type_=ARRAY(Text)))
    .scalar_subquery()
    .label("revisions")
)

#: Whether every role may connect to this database (``CONNECT`` granted to ``PUBLIC``),
#: which stores refuse to lead in: what ``cronoq-store health`` can tell from any role.
public_may_connect = select(
    func.pg_catalog.has_database_privilege(
        literal("public", Text), func.current_database(), literal("CONNECT", Text), type_=Boolean
    )
)

__all__ += ["public_may_connect"]

#: Drops this transaction's cached view of ``pg_stat_activity``, so that a second look at
#: the lock holder in the same transaction sees sessions as they are now.
clear_stats_snapshot = select(func.pg_catalog.pg_stat_clear_snapshot())

__all__ += ["clear_stats_snapshot"]

# --- a forced handover (``cronoq-store handover``) ------------------------------------------

__all__ += ["terminate_backend"]

#: Ends the session ``pid`` (its transaction rolls back, its session locks are released);
#: needs the ``pg_signal_backend`` role (or superuser, or the same role as that session).
terminate_backend = select(
    func.pg_catalog.pg_terminate_backend(bindparam("pid", type_=Integer), type_=Boolean)
)

# --- the CLI: where the clusters are ----------------------------------------------------------

_pg_class = table(
    "pg_class", column("relname"), column("relnamespace"), column("relkind"), schema="pg_catalog"
)
_pg_namespace = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")

#: The schemas holding a cluster (its Alembic version table), by name: what the CLI lists
#: when no schema was named and ``public`` holds none. Catalogs only, schema-qualified: no
#: cluster's schema is ever on ``search_path``.
cluster_schemas = (
    select(_pg_namespace.c.nspname)
    .join_from(_pg_class, _pg_namespace, _pg_class.c.relnamespace == _pg_namespace.c.oid)
    .where(_pg_class.c.relname == literal(VERSION_TABLE, Text), _pg_class.c.relkind == "r")
    .order_by(_pg_namespace.c.nspname)
)

__all__ += ["cluster_schemas"]

# --- a downgrade, under the leader lock (``cronoq_store.downgrade_guard``) --------------------

__all__ += [
    "cluster_issued_ids",
    "lock_cluster_tables",
    "refuse_live_leader",
    "try_leader_lock_for_transaction",
]

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


def lock_cluster_tables(schema: str, dialect: Any) -> DDL:
    """``LOCK TABLE`` of the cluster's tables in ``schema``, all in one statement before the
    downgrade touches any: it waits for commits in flight, and later ones wait for it, in one
    order (leader row first, as every commit takes it), so none can deadlock with its DDL."""
    quote = dialect.identifier_preparer.quote
    names = ", ".join(f"{quote(schema)}.{quote(t.name)}" for t in (leader, tasks, recurring))
    return DDL(f"LOCK TABLE ONLY {names} IN ACCESS EXCLUSIVE MODE")  # type: ignore[no-untyped-call]


#: What an offline (``--sql``) downgrade script runs before its first revision: stop if a
#: session holds the leader lock of the schema named by :func:`checked_schema`, else hold it
#: until the script's COMMIT, as the online run does (``-x force=true`` leaves this out).
#: The key is :data:`LOCK_NS_LEADER`, written out: the block is constant text.
refuse_live_leader = DDL(  # type: ignore[no-untyped-call]  # SQLAlchemy leaves DDL untyped
    """DO $cronoq$
DECLARE
    schema_ pg_catalog.text := pg_catalog.current_setting('cronoq_store.schema');
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
