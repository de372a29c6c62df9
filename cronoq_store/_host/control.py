"""The host's control schema: its tables, its migrations, and every statement the host runs
on it (issue 31, docs/storage-format.md "Control schema").

One control schema per database (``cronoq_host`` unless configured), shared by every host
process of every group in that database: ``processes`` records each process that joined
(ids from the ``process_ids`` sequence, never reused), ``clusters`` each enrolled cluster and
who owns it. A process is alive while its session holds the advisory lock
``(LOCK_NS_HOST, process_id)``; liveness is the server's, never a clock's.

The tables carry no schema, as a cluster's do (:mod:`cronoq_store._schema`): statements
name it at execution with :func:`control_options`, so every name in the SQL is
schema-qualified and ``search_path`` stays ``pg_catalog, pg_temp``.

Migrations are Alembic's, from their own script directory (``alembic/host/``, beside the
cluster's ``versions/``, which Alembic never reads into) and with their own version table,
``cronoq_host_alembic_version`` inside the control schema. :func:`prepare_control` migrates
in one transaction under the schema's migration lock, the one a cluster schema of that name
would take, ``(LOCK_NS_MIGRATE, hashtext(schema))``: one lock per schema name, whatever the
schema holds, so its holders are named by the same code, and a cluster mistakenly given the
control schema's name waits its turn instead of interleaving DDL. The trust check
(:func:`~cronoq_store._trust.refuse_untrusted`, on this schema's tables) refuses what a
role we cannot trust controls before anything is used, and again after migrating.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Connection,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    any_,
    bindparam,
    cast,
    column,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    table,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, OID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.schema import CreateSchema
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import CompoundSelect

from .. import _door as door
from .. import _migrations as migrations
from .. import _statements as st
from .._config import MIGRATION_LOCK_TIMEOUT, validate_schema_name
from .._domain import check_seconds
from .._door import LockWait
from .._errors import MigrationError
from .._schema import LEADER_ROW_ID, schema_options
from .._trust import refuse_untrusted

__all__ = [
    "CONTROL_TABLES",
    "DEFAULT_CONTROL_SCHEMA",
    "HOST_VERSION_TABLE",
    "LOCK_NS_HOST",
    "PROCESS_ID_MAX",
    "claim_many",
    "claim_one",
    "claimable",
    "cluster_host",
    "cluster_hosts",
    "cluster_list",
    "clusters",
    "control_head",
    "control_options",
    "control_revision",
    "control_schema",
    "end_stuck_holders",
    "end_stuck_sessions",
    "enroll",
    "enrolled",
    "insert_process",
    "leader_rows",
    "live_members",
    "mark_active",
    "mark_left",
    "mark_refused",
    "metadata",
    "missing_leaders",
    "next_process_id",
    "orphan_clusters",
    "orphan_left",
    "owned_by",
    "owned_digest",
    "owner_counts",
    "prepare_control",
    "probe_dead",
    "process_ids",
    "process_list",
    "processes",
    "reenroll",
    "release_cluster",
    "remove",
    "run_environment",
    "script_location",
    "set_owner",
    "set_owners",
    "take_process_lock",
    "try_leader_locks",
]

#: First key of a host process's lock, ``(LOCK_NS_HOST, process_id)`` ('croh'), held by its
#: host session as a session advisory lock for as long as the process is a member.
LOCK_NS_HOST = 0x63726F68
#: The control schema's name unless configured.
DEFAULT_CONTROL_SCHEMA = "cronoq_host"
#: Alembic's version table of the control schema, inside it.
HOST_VERSION_TABLE = "cronoq_host_alembic_version"
#: The largest process id: the two-key advisory lock functions take int4 keys.
PROCESS_ID_MAX = 2_147_483_647

metadata = MetaData()

#: Process ids: int4 for the lock's second key, never reused (no CYCLE), so a process seen
#: dead stays dead.
process_ids = Sequence(
    "process_ids",
    metadata=metadata,
    data_type=Integer,
    start=1,
    minvalue=1,
    maxvalue=PROCESS_ID_MAX,
    cycle=False,
)

#: Every host process that joined a group in this database; ``left`` rows are history.
processes = Table(
    "processes",
    metadata,
    Column("process_id", Integer, nullable=False, autoincrement=False),
    Column("host_group", Text, nullable=False),
    Column("instance", Text, nullable=False),
    Column("backend_pid", Integer, nullable=False),
    Column("role", Text, nullable=False),
    Column("application_name", Text, nullable=False),
    Column("joined_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("state", Text, nullable=False),
    Column("left_at", DateTime(timezone=True), nullable=True),
    PrimaryKeyConstraint("process_id", name="pk_processes"),
    CheckConstraint("state IN ('member', 'draining', 'left')", name="ck_processes_state"),
)
# The probe's read of a group's members: ids never reused, so left rows pile up over time.
Index(
    "ix_processes_live",
    processes.c.host_group,
    processes.c.process_id,
    postgresql_where=text("state <> 'left'"),
)

#: Every enrolled cluster and who leads it; a schema is enrolled in one group at most.
clusters = Table(
    "clusters",
    metadata,
    Column("host_group", Text, nullable=False),
    Column("schema_name", Text, nullable=False),
    Column("incarnation", OID, nullable=False),
    Column("owner", Integer, nullable=True),
    Column("epoch", Integer, nullable=True),
    Column("since", DateTime(timezone=True), nullable=True),
    Column("released_by", Integer, nullable=True),
    Column("released_at", DateTime(timezone=True), nullable=True),
    Column("state", Text, nullable=False, server_default=text("'active'")),
    Column("refused_why", Text, nullable=True),
    Column("enrolled_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("host_group", "schema_name", name="pk_clusters"),
    UniqueConstraint("schema_name", name="uq_clusters_schema_name"),
    CheckConstraint("state IN ('active', 'refused', 'moving', 'moved')", name="ck_clusters_state"),
)
Index("ix_clusters_host_group_owner", clusters.c.host_group, clusters.c.owner)

#: Our tables in the control schema: what the trust check looks at.
CONTROL_TABLES: tuple[str, ...] = ("clusters", "processes", HOST_VERSION_TABLE)


def control_options(schema: str) -> dict[str, object]:
    """Execution options that point the schema-less control tables at ``schema``."""
    return schema_options(schema)


# --- statements -----------------------------------------------------------------------------
# Run with control_options(schema). States are constants in the text, not parameters: a
# generic plan then still matches the partial index, and no caller can pass another state.

_MEMBER: ColumnElement[str] = literal_column("'member'", Text)
_LEFT: ColumnElement[str] = literal_column("'left'", Text)
_ACTIVE: ColumnElement[str] = literal_column("'active'", Text)
_REFUSED: ColumnElement[str] = literal_column("'refused'", Text)

_group = bindparam("group", type_=Text)
_schema_name = bindparam("schema", type_=Text)
_me = bindparam("me", type_=Integer)
_ids = bindparam("ids", type_=ARRAY(Integer))

_in_group = clusters.c.host_group == _group
_this_cluster = (clusters.c.host_group == _group) & (clusters.c.schema_name == _schema_name)

#: A new process id, taken before the process lock and the row: lock before row means a
#: row whose lock is free belongs to a dead process.
next_process_id = select(process_ids.next_value().label("process_id"))

#: The process's row (``:process_id``, ``:group``, ``:instance``), on its host session
#: after it took its lock: that session's pid, role and name, so ``status`` can name it.
insert_process = insert(processes).values(
    process_id=bindparam("process_id", type_=Integer),
    host_group=_group,
    instance=bindparam("instance", type_=Text),
    backend_pid=func.pg_backend_pid(),
    role=func.current_user(),
    application_name=func.current_setting(literal("application_name", Text)),
    state=_MEMBER,
)

_probed = func.unnest(_ids).table_valued("process_id").render_derived(name="probed")

#: The ids among ``:ids`` whose process lock is free: those processes are dead. Run in a
#: transaction that is rolled back (a true try takes the lock until then), without the
#: caller's own id (the server grants its own session a shared try on the lock it holds).
probe_dead = (
    select(_probed.c.process_id)
    .where(
        func.pg_try_advisory_xact_lock_shared(literal(LOCK_NS_HOST, Integer), _probed.c.process_id)
    )
    .order_by(_probed.c.process_id)
)

#: The group's processes that have not left (``process_id``, ``state``), by id: whom the
#: probe tries, and, less the ``draining`` ones, the members the targets split clusters over.
live_members = (
    select(processes.c.process_id, processes.c.state)
    .where(processes.c.host_group == _group, processes.c.state != _LEFT)
    .order_by(processes.c.process_id)
)

#: The processes ``:ids`` found dead have left, for good (their ids are never taken again);
#: returns the ids it marked.
mark_left = (
    update(processes)
    .where(processes.c.process_id == any_(_ids), processes.c.state != _LEFT)
    .values(state=_LEFT, left_at=func.now())
    .returning(processes.c.process_id)
)

#: The clusters of the dead processes ``:ids`` are nobody's: claimable by the survivors
#: (their epoch stays, the next claim bumps it); returns ``host_group``, ``schema_name``.
orphan_clusters = (
    update(clusters)
    .where(clusters.c.owner == any_(_ids))
    .values(owner=null())
    .returning(clusters.c.host_group, clusters.c.schema_name)
)

#: The clusters still owned by processes that left are nobody's. A process marks itself
#: left as it closes, or its survivors bury it; a cluster it owned past that (an older
#: version's ``leave``, a claim that committed as it was being buried) would otherwise wait
#: forever, since only members are ever buried. Returns ``host_group``, ``schema_name``.
orphan_left = (
    update(clusters)
    .where(
        clusters.c.owner.in_(
            select(processes.c.process_id).where(processes.c.state == _LEFT).scalar_subquery()
        )
    )
    .values(owner=null())
    .returning(clusters.c.host_group, clusters.c.schema_name)
)

#: How many active clusters each ``owner`` of the group leads (``owner`` NULL: unowned), as
#: ``owner``, ``clusters``: what the balancing targets start from.
owner_counts = (
    select(clusters.c.owner, func.count().label("clusters"))
    .where(_in_group, clusters.c.state == _ACTIVE)
    .group_by(clusters.c.owner)
    .order_by(clusters.c.owner.asc().nulls_first())
)

#: The keeper's one round trip: ``clusters`` (how many ``:me`` owns) and ``epochs`` (the sum
#: of their epochs). Only another process takes a cluster from ``:me`` (its count falls) and
#: epochs only grow (its sum rises), so any change to what ``:me`` holds moves one of them,
#: where a "changed since" read could miss sequence values that commit out of order.
owned_digest = select(
    func.count().label("clusters"),
    cast(func.coalesce(func.sum(clusters.c.epoch), 0), BigInteger).label("epochs"),
).where(_in_group, clusters.c.owner == _me)

#: What ``:me`` owns (``schema_name``, ``epoch``, ``incarnation``), by schema: read when the
#: digest differs from what the process holds, to step down each cluster taken from it.
owned_by = (
    select(clusters.c.schema_name, clusters.c.epoch, clusters.c.incarnation)
    .where(_in_group, clusters.c.owner == _me)
    .order_by(clusters.c.schema_name)
)

#: Up to ``:limit`` active clusters of the group that nobody owns or whose owner is among
#: ``:dead``, by schema name (claims lock in schema order, as commit groups do), locked for
#: the claim's transaction; rows another claim holds are skipped, not waited for. Returns
#: ``schema_name``, ``incarnation``, ``released_by``, ``released_at``, ``owner``.
claimable = (
    select(
        clusters.c.schema_name,
        clusters.c.incarnation,
        clusters.c.released_by,
        clusters.c.released_at,
        clusters.c.owner,
    )
    .where(
        _in_group,
        clusters.c.state == _ACTIVE,
        or_(
            clusters.c.owner.is_(None),
            clusters.c.owner == any_(bindparam("dead", type_=ARRAY(Integer))),
        ),
    )
    .order_by(clusters.c.schema_name)
    .limit(bindparam("limit", type_=Integer))
    .with_for_update(skip_locked=True)
)

#: The process lock, taken once by the host session right after its id is drawn (free by
#: construction: ids are never reused), held until the session ends.
take_process_lock = select(
    func.pg_advisory_lock(literal(LOCK_NS_HOST, Integer), bindparam("id", type_=Integer))
)

_pg_locks = table(
    "pg_locks",
    column("locktype", Text),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid"),
    column("granted"),
    column("pid", Integer),
    schema="pg_catalog",
)
_pg_stat_activity = table(
    "pg_stat_activity",
    column("pid", Integer),
    column("state", Text),
    column("wait_event", Text),
    column("state_change"),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid"), column("datname"), schema="pg_catalog")

#: End the host sessions of ``:ids`` that hold their process lock while stuck mid-statement
#: for longer than ``:seconds``: the server waits for the rest of an extended-protocol
#: message (``active``, ``ClientRead``), which no idle limit covers, so a process cut off
#: there would hold its lock (and any table lock of its claim) for as long as the path stays
#: silent. Its own keeper stepped its clusters down after ``session_timeout`` without an
#: answer; ``:seconds`` is longer. Returns the pids ended.
end_stuck_sessions = (
    select(_pg_stat_activity.c.pid, func.pg_terminate_backend(_pg_stat_activity.c.pid))
    .select_from(_pg_locks.join(_pg_stat_activity, _pg_locks.c.pid == _pg_stat_activity.c.pid))
    .where(
        _pg_locks.c.locktype == literal("advisory", Text),
        _pg_locks.c.database
        == select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery(),
        _pg_locks.c.classid == literal(LOCK_NS_HOST, Integer).cast(OID),
        _pg_locks.c.objid.cast(Integer) == any_(_ids),
        _pg_locks.c.objsubid == literal(2, Integer),
        _pg_locks.c.granted,
        _pg_stat_activity.c.state == literal("active", Text),
        _pg_stat_activity.c.wait_event == literal("ClientRead", Text),
        _pg_stat_activity.c.state_change
        < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("seconds", type_=Float)),
    )
)

_pg_locks_relation = table(
    "pg_locks",
    column("locktype", Text),
    column("relation"),
    column("granted"),
    column("pid", Integer),
    schema="pg_catalog",
)

#: End the sessions that hold ``:schema``'s leader table while stuck mid-statement for longer
#: than ``:seconds`` (``active``, ``ClientRead``): a commit of a process cut off in the middle
#: of its extended-protocol exchange, which no idle limit ends, and whose fence's share lock
#: would keep every claim of the cluster waiting for as long as the path stays silent.
#: ``:seconds`` is what a silent host session is given (``1.5 x session_timeout``): a path
#: that silent mid-message is a dead process's or a cut-off one's, which stepped down, and
#: ending the session rolls back a commit never acknowledged. Returns the pids.
end_stuck_holders = (
    select(_pg_stat_activity.c.pid, func.pg_terminate_backend(_pg_stat_activity.c.pid))
    .select_from(
        _pg_locks_relation.join(
            _pg_stat_activity, _pg_locks_relation.c.pid == _pg_stat_activity.c.pid
        )
    )
    .where(
        _pg_locks_relation.c.locktype == literal("relation", Text),
        _pg_locks_relation.c.relation
        == func.to_regclass(
            func.quote_ident(bindparam("schema", type_=Text)).concat(".cronoq_leader")
        ),
        _pg_locks_relation.c.granted,
        _pg_stat_activity.c.pid != func.pg_backend_pid(),
        _pg_stat_activity.c.state == literal("active", Text),
        _pg_stat_activity.c.wait_event == literal("ClientRead", Text),
        _pg_stat_activity.c.state_change
        < func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("seconds", type_=Float)),
    )
)

#: The start of a claim: the cluster's control row, locked, when it is still to be had (active,
#: and unowned); no row when another process took it first or holds it in a claim now.
claim_one = (
    select(clusters.c.schema_name, clusters.c.incarnation)
    .where(_this_cluster, clusters.c.state == _ACTIVE, clusters.c.owner.is_(None))
    .with_for_update(skip_locked=True)
)

#: The start of a claim of several clusters (``:schemas``), in one statement: the control row
#: of each still to be had (active, unowned), locked, by schema name; a row another claim
#: holds is skipped, not waited for. Returns ``schema_name``, ``incarnation`` and
#: ``schema_oid`` (the standalone leader lock's second key, as :data:`st.schema_oid
#: <cronoq_store._statements.schema_oid>` reads it; NULL: no such schema).
claim_many = (
    select(
        clusters.c.schema_name,
        clusters.c.incarnation,
        func.to_regnamespace(func.quote_ident(clusters.c.schema_name))
        .cast(Integer)
        .label("schema_oid"),
    )
    .where(
        _in_group,
        clusters.c.schema_name == any_(bindparam("schemas", type_=ARRAY(Text))),
        clusters.c.state == _ACTIVE,
        clusters.c.owner.is_(None),
    )
    .order_by(clusters.c.schema_name)
    .with_for_update(skip_locked=True)
)

_leader_keys = (
    func.unnest(bindparam("oids", type_=ARRAY(Integer)))
    .table_valued("oid")
    .render_derived(name="leader_keys")
)

#: Each cluster's standalone leader lock (``:oids``, their schemas' OIDs) tried for the
#: claim's transaction, in one statement: ``oid``, ``taken`` (false: a standalone leader, a
#: downgrade or an enrolment holds it, and the cluster is not claimed now).
try_leader_locks = select(
    _leader_keys.c.oid,
    func.pg_try_advisory_xact_lock(literal(st.LOCK_NS_LEADER, Integer), _leader_keys.c.oid).label(
        "taken"
    ),
)

_claimed = (
    func.unnest(bindparam("schemas", type_=ARRAY(Text)), bindparam("epochs", type_=ARRAY(Integer)))
    .table_valued("schema_name", "epoch")
    .render_derived(name="claimed")
)

#: The end of a claim of several clusters: ``:me`` leads each of ``:schemas`` at the epoch
#: of ``:epochs`` in the same place (the one it just took), since now, released by nobody;
#: returns ``schema_name`` for each row set.
set_owners = (
    update(clusters)
    .where(_in_group, clusters.c.schema_name == _claimed.c.schema_name)
    .values(
        owner=_me,
        epoch=_claimed.c.epoch,
        since=func.now(),
        released_by=null(),
        released_at=null(),
    )
    .returning(clusters.c.schema_name)
)

#: The end of a claim: ``:me`` leads the cluster at ``:epoch`` (the one it just took), since
#: now, released by nobody; returns ``schema_name`` (no row: not enrolled).
set_owner = (
    update(clusters)
    .where(_this_cluster)
    .values(
        owner=_me,
        epoch=bindparam("epoch", type_=Integer),
        since=func.now(),
        released_by=null(),
        released_at=null(),
    )
    .returning(clusters.c.schema_name)
)

#: A handover: ``:me`` lets the cluster go, if it still owns it, recording that it did and
#: when (for ``cool_down``); returns ``schema_name`` when it did, no row when not its own.
release_cluster = (
    update(clusters)
    .where(_this_cluster, clusters.c.owner == _me)
    .values(owner=null(), released_by=_me, released_at=func.now())
    .returning(clusters.c.schema_name)
)

_inserted = (
    pg_insert(clusters)
    .values(
        host_group=_group,
        schema_name=_schema_name,
        incarnation=bindparam("incarnation", type_=OID),
    )
    .on_conflict_do_nothing()
    .returning(clusters.c.host_group, clusters.c.incarnation)
    .cte("inserted")
)

#: Enrol a cluster (``:group``, ``:schema``, ``:incarnation``) unless its schema
#: is enrolled already, in this group or another: one row ``inserted``, ``host_group``,
#: ``incarnation``, true with the values given, or false with those already enrolled. No row
#: when an enrolment of the same schema committed while this statement ran: run it again.
enroll = union_all(
    select(true().label("inserted"), _inserted.c.host_group, _inserted.c.incarnation),
    select(false().label("inserted"), clusters.c.host_group, clusters.c.incarnation).where(
        clusters.c.schema_name == _schema_name, ~exists(select(_inserted.c.host_group))
    ),
)

#: A cluster leaves the group (``:group``, ``:schema``); returns ``schema_name``
#: and the ``owner`` that led it, so the caller can tell it; no row: not enrolled.
remove = delete(clusters).where(_this_cluster).returning(clusters.c.schema_name, clusters.c.owner)

#: A cluster a claim could not take safely (foreign objects, a revision not this build's, a
#: schema made again) is ``refused`` with ``:why`` until an operator clears it; it no longer
#: counts for the targets. Returns ``schema_name``.
mark_refused = (
    update(clusters)
    .where(_this_cluster)
    .values(state=_REFUSED, refused_why=bindparam("why", type_=Text))
    .returning(clusters.c.schema_name)
)

#: A refused cluster back to ``active`` (fixed, or to be tried again); returns ``schema_name``.
mark_active = (
    update(clusters)
    .where(_this_cluster)
    .values(state=_ACTIVE, refused_why=null())
    .returning(clusters.c.schema_name)
)

#: An enrolment again of a cluster already listed: its row takes the cluster the schema holds
#: now (``:incarnation``; one made again under the name is a new cluster), unowned and active,
#: whatever refusal it carried. An owner of the old incarnation sees its count fall and steps
#: down; its commits could only reach the old cluster anyway. Returns ``schema_name``.
reenroll = (
    update(clusters)
    .where(_this_cluster)
    .values(
        incarnation=bindparam("incarnation", type_=OID),
        owner=null(),
        epoch=null(),
        state=_ACTIVE,
        refused_why=null(),
    )
    .returning(clusters.c.schema_name)
)


def leader_rows(schemas: list[str]) -> CompoundSelect[Any]:
    """The leader rows of ``schemas`` in one statement (``schema``, ``epoch``, ``tableoid``):
    the host's sweep, which reads a slice of the clusters it leads each tick for what only
    their own rows show (an epoch moved outside the host, a schema made again). Every
    schema must hold a leader table (:data:`missing_leaders` first)."""
    parts = []
    for schema in schemas:
        leader = table(
            "cronoq_leader", column("id"), column("epoch"), column("tableoid"), schema=schema
        )
        parts.append(
            select(literal(schema, Text).label("schema"), leader.c.epoch, leader.c.tableoid).where(
                leader.c.id == LEADER_ROW_ID
            )
        )
    return union_all(*parts)


#: Which of ``:schemas`` hold no leader table (dropped, or never migrated).
missing_leaders = (
    select(column("name", Text))
    .select_from(
        func.unnest(bindparam("schemas", type_=ARRAY(Text))).table_valued("name").render_derived()
    )
    .where(
        func.to_regclass(func.quote_ident(column("name", Text)).concat(".cronoq_leader")).is_(None)
    )
)


#: Every cluster of the group (``schema_name``, ``incarnation``, ``owner``, ``epoch``,
#: ``state``), by schema: what ``status`` and the host's start read.
enrolled = (
    select(
        clusters.c.schema_name,
        clusters.c.incarnation,
        clusters.c.owner,
        clusters.c.epoch,
        clusters.c.state,
    )
    .where(_in_group)
    .order_by(clusters.c.schema_name)
)


# --- what operators read (``cronoq-store status``, ``health``, ``host list``) ----------------


def _process_lock_pid(process_id: ColumnElement[int | None]) -> ColumnElement[int | None]:
    """The backend pid of the session holding ``(LOCK_NS_HOST, process_id)`` in this
    database, NULL when none does: a process is live exactly while one holds it. A two-key
    lock shows as ``classid``, ``objid`` (unsigned ``oid``), ``objsubid = 2``."""
    return (
        select(_pg_locks.c.pid)
        .where(
            _pg_locks.c.locktype == literal("advisory", Text),
            _pg_locks.c.database
            == select(_pg_database.c.oid)
            .where(_pg_database.c.datname == func.current_database())
            .scalar_subquery(),
            cast(_pg_locks.c.classid, BigInteger) == literal(LOCK_NS_HOST, BigInteger),
            cast(_pg_locks.c.objid, BigInteger) == cast(process_id, BigInteger),
            _pg_locks.c.objsubid == 2,
            _pg_locks.c.granted.is_(true()),
        )
        .limit(1)
        .scalar_subquery()
    )


_last = processes.alias("last_owner")

#: One cluster's control row by ``:schema`` (in whichever group), with the process that owns
#: it or, unowned, the one that released it last (``process_*`` columns, NULL when neither is
#: known) and the pid of the session holding that process's lock now (``lock_pid``, NULL:
#: free, the process is dead or gone). No row: the schema is not enrolled here.
cluster_host = (
    select(
        clusters.c.host_group,
        clusters.c.incarnation,
        clusters.c.owner,
        clusters.c.epoch,
        clusters.c.since,
        clusters.c.released_by,
        clusters.c.released_at,
        clusters.c.state,
        clusters.c.refused_why,
        _last.c.process_id.label("process_id"),
        _last.c.instance.label("process_instance"),
        _last.c.backend_pid.label("process_backend_pid"),
        _last.c.role.label("process_role"),
        _last.c.application_name.label("process_application_name"),
        _last.c.joined_at.label("process_joined_at"),
        _last.c.state.label("process_state"),
        _process_lock_pid(_last.c.process_id).label("lock_pid"),
    )
    .select_from(
        clusters.outerjoin(
            _last, _last.c.process_id == func.coalesce(clusters.c.owner, clusters.c.released_by)
        )
    )
    .where(clusters.c.schema_name == _schema_name)
)

#: The processes that have not left, of every group (``process_id``, ``host_group``,
#: ``instance``, ``backend_pid``, ``role``, ``application_name``, ``joined_at``, ``state``,
#: ``lock_pid`` as in :data:`cluster_host`), by group and id.
process_list = (
    select(
        processes.c.process_id,
        processes.c.host_group,
        processes.c.instance,
        processes.c.backend_pid,
        processes.c.role,
        processes.c.application_name,
        processes.c.joined_at,
        processes.c.state,
        _process_lock_pid(processes.c.process_id).label("lock_pid"),
    )
    .where(processes.c.state != _LEFT)
    .order_by(processes.c.host_group, processes.c.process_id)
)

#: Every enrolled cluster of every group (``host_group``, ``schema_name``, ``owner``,
#: ``epoch``, ``since``, ``state``, ``refused_why``), by group and schema.
cluster_list = select(
    clusters.c.host_group,
    clusters.c.schema_name,
    clusters.c.owner,
    clusters.c.epoch,
    clusters.c.since,
    clusters.c.state,
    clusters.c.refused_why,
).order_by(clusters.c.host_group, clusters.c.schema_name)


# --- migrations -----------------------------------------------------------------------------

#: Where a control migration's bound on its lock waits is set, for its log lines and errors.
_BOUND_SETTINGS = "the bound is prepare_control(lock_timeout=)"


def script_location() -> Path:
    """The control schema's migrations: ``host/`` inside the cluster's script directory
    (Alembic reads a directory's ``versions/`` only, so neither sees the other's)."""
    return migrations.script_location() / "host"


@functools.lru_cache(maxsize=1)
def _scripts() -> ScriptDirectory:
    """The control schema's revisions, read once per process."""
    return ScriptDirectory(str(script_location()))


def control_head() -> str:
    """The newest control schema revision this build knows."""
    head = _scripts().get_current_head()
    assert head is not None, "the control migrations have a single head"
    return head


def control_schema() -> str:
    """The control schema the running migration targets: every operation of a revision
    names it, since it is never on ``search_path``."""
    return migrations.cluster_schema()


def control_revision(conn: Connection, schema: str) -> tuple[str, ...]:
    """The revisions ``schema``'s version table records (empty: not migrated), in ``conn``'s
    transaction; a revision this build does not know is refused
    (:class:`~cronoq_store.MigrationError`). Run it after the trust check."""
    validate_schema_name(schema)
    # No version table (no schema either) reads as no revision: one catalog look-up.
    context = MigrationContext.configure(
        conn, opts={"version_table": HOST_VERSION_TABLE, "version_table_schema": schema}
    )
    current = tuple(sorted(context.get_current_heads()))
    unknown = migrations.unknown_revisions(_scripts(), current)
    if unknown:
        raise MigrationError(
            f"control schema {schema!r} is at revision {', '.join(unknown)}, which this build "
            f"does not know (its newest is {control_head()}): a newer version of "
            "cronoq-store migrated it; upgrade cronoq-store"
        )
    return current


_pg_class = table("pg_class", column("relname"), column("relnamespace"), schema="pg_catalog")
_pg_namespace = table("pg_namespace", column("oid"), column("nspname", Text), schema="pg_catalog")

#: Every control schema of the database: the schemas holding the host's version table.
_control_schemas = (
    select(_pg_namespace.c.nspname)
    .select_from(_pg_class.join(_pg_namespace, _pg_class.c.relnamespace == _pg_namespace.c.oid))
    .where(_pg_class.c.relname == literal(HOST_VERSION_TABLE, Text))
)

#: Serializes the making of control schemas in a database (process ids start at 1: no
#: process lock takes key 0), so that two made at once under two names are seen.
_making_control = select(
    func.pg_advisory_xact_lock(literal(LOCK_NS_HOST, Integer), literal(0, Integer))
)


def _refuse_another(conn: Connection, schema: str) -> None:
    """Refuse a second control schema in the database. Process ids, drawn from a control
    schema's sequence, key process locks that are the database's: two control schemas
    would hand one id to two processes, and one's death would read as alive while the
    other holds it; their groups would also enrol one cluster twice."""
    others = sorted(n for n in conn.execute(_control_schemas).scalars() if n != schema)
    if others:
        raise MigrationError(
            f"control schema {schema!r} refused: this database already has the host control "
            f"schema {others[0]!r}, and every host of a database shares one "
            "(PgHostConfig.control_schema)"
        )


def _checked(conn: Connection, schema: str) -> tuple[str, ...]:
    """The trust check of the control schema, then its revision; a second control
    schema in the database is refused."""
    conn.execute(st.local_search_path)
    _refuse_another(conn, schema)
    refuse_untrusted(conn, schema, tables=CONTROL_TABLES)
    return control_revision(conn, schema)


def _opening(engine: AsyncEngine) -> str:
    """The message that opens a transaction on ``engine``'s pooled session with the store's
    own settings, whatever the application's session carries."""
    statements = st.store_transaction(st.IDLE_LIMIT_MS, borrowed=True)
    return door.opening_message(statements, engine.dialect)


async def prepare_control(
    engine: AsyncEngine,
    schema: str = DEFAULT_CONTROL_SCHEMA,
    *,
    lock_timeout: float = MIGRATION_LOCK_TIMEOUT,
) -> None:
    """Create or upgrade the control schema ``schema`` to this build's head.

    Idempotent and safe to run from every host process at once. A schema already at head
    costs one read transaction (the trust check and the revision) and takes no lock.
    Otherwise one transaction takes the schema's migration lock, waiting up to
    ``lock_timeout`` seconds with its holders logged, then creates, checks, migrates and
    checks again. Refused (:class:`~cronoq_store.MigrationError`): a schema, or anything in
    it, that a role we cannot trust owns or may create in, a trigger or rule on its tables,
    a revision newer than this build. Errors are :class:`~cronoq_store.StoreError`.
    """
    validate_schema_name(schema)
    check_seconds("lock_timeout", lock_timeout)
    opening = _opening(engine)
    head = control_head()
    async with door.translated(f"reading the revision of control schema {schema!r}"):
        current = await door.run_transaction(
            engine, opening, lambda conn: conn.run_sync(_checked, schema)
        )
    if current == (head,):
        return

    def run(conn: Connection) -> None:
        conn.execute(st.local_search_path)
        wait = LockWait(
            f"the migration lock of control schema {schema!r}", lock_timeout, _BOUND_SETTINGS
        )
        door.take_migration_lock(conn, schema, wait)
        conn.execute(_making_control)
        _refuse_another(conn, schema)
        # DDL waits for the tables' locks (a later revision's ALTER) end with the same bound.
        ms = max(1, round(wait.remaining * 1000))
        conn.execute(st.set_local_lock_timeout, {"ms": str(ms)})
        # Created first (a no-op if it exists), then checked: a schema another role creates
        # between a check and our CREATE ... IF NOT EXISTS is still refused.
        conn.execute(CreateSchema(schema, if_not_exists=True))
        refuse_untrusted(conn, schema, tables=CONTROL_TABLES)
        if control_revision(conn, schema) != (head,):
            config = _config(schema, conn)
            command.upgrade(config, "head")
        # Again: tables just created may carry default privileges that let another role in.
        refuse_untrusted(conn, schema, tables=CONTROL_TABLES)

    try:
        async with (
            door.translated(f"migrating control schema {schema!r}", passing=(CommandError,)),
            migrations.held_async(),
        ):
            await door.run_transaction(engine, opening, lambda conn: conn.run_sync(run))
    except CommandError as exc:
        raise MigrationError(f"migrating control schema {schema!r}: {exc}") from exc


def _config(schema: str, conn: Connection) -> Config:
    """Alembic's configuration of one run on ``conn``, inside the caller's transaction and
    its hold of the process's Alembic turn (:func:`cronoq_store._migrations.held_async`)."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["schema"] = schema
    config.attributes["connection"] = conn
    config.attributes[migrations.HELD] = True
    return config


def run_environment(context: EnvironmentContext) -> None:
    """What ``alembic/host/env.py`` runs: the migration, on the connection
    :func:`prepare_control` hands over, inside its transaction, lock and checks. The control
    schema is migrated from code only: a run without that connection is refused."""
    with migrations.held(context):
        conn = context.config.attributes.get("connection")
        if not isinstance(conn, Connection) or context.is_offline_mode():
            raise MigrationError(
                "the host's control schema is migrated from code, where its lock and trust "
                "checks run: await cronoq_store._host.control.prepare_control(engine, schema)"
            )
        schema = validate_schema_name(context.config.attributes["schema"])
        context.configure(
            connection=conn,
            target_metadata=metadata,
            version_table=HOST_VERSION_TABLE,
            version_table_schema=schema,
            transaction_per_migration=False,
        )
        with context.begin_transaction():
            context.run_migrations()


# --- what the console reads ------------------------------------------------------------------

#: The control rows of every schema in ``:schemas`` that has one, each with the columns of
#: :data:`cluster_host` and its ``schema_name``: a page of the console's overview in one
#: statement, however many of its clusters a host group leads.
cluster_hosts = (
    select(clusters.c.schema_name, *cluster_host.selected_columns)
    .select_from(*cluster_host.get_final_froms())
    .where(clusters.c.schema_name == any_(bindparam("schemas", type_=ARRAY(Text))))
)
