"""The operators' catalog queries and counts: what ``cronoq-store`` (status, health,
handover, prune's dry run), the console, the HA demo and the migrations read of a
cluster and of the server's catalogs.

Commits, recovery and look-ups never run these; they are kept apart from the store's own
statements (:mod:`cronoq_store._statements`) so that the hot path reads on its own. Catalog
tables carry their schema (``pg_catalog``): ``schema_translate_map`` renames only the
cluster's schema-less tables.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Integer,
    MetaData,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    column,
    false,
    func,
    literal,
    or_,
    select,
    table,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.selectable import Select

from ._domain import TaskStatus
from ._schema import LEADER_ROW_ID, VERSION_TABLE, leader, leader_tableoid, recurring, tasks
from ._statements import LOCK_NS_MIGRATE, prune_victims

__all__ = [
    "LIKE_ESCAPE",
    "LOCK_MODES",
    "advisory_lock_holder",
    "clear_stats_snapshot",
    "cluster_page_after",
    "cluster_page_before",
    "cluster_schema_exists",
    "cluster_schemas",
    "cluster_schemas_like",
    "finished_before_count",
    "health_facts",
    "health_facts_unrecorded",
    "leader_columns",
    "leader_holder_facts",
    "leader_lock_holder",
    "leader_state",
    "migration_lock_holder",
    "prunable_count",
    "public_may_connect",
    "quarantined_count",
    "relation_exists",
    "schedule_summaries",
    "server_now",
    "server_version",
    "substring_pattern",
    "table_lock_holders",
    "task_counts",
    "task_statuses",
    "tasks_with_kind_or_message",
    "terminate_backend",
]

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


def advisory_lock_holder(k1: ColumnElement[int], k2: ColumnElement[int]) -> Select[Any]:
    """The session holding the advisory lock with keys ``k1``, ``k2`` in this database, with
    what ``pg_stat_activity`` shows of it. A two-int key shows as ``classid = k1, objid =
    k2, objsubid = 2``; those columns are ``oid`` (unsigned), so they are compared as
    BIGINT. Advisory locks are per database."""
    return (
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
            cast(_pg_locks.c.classid, BigInteger) == k1,
            cast(_pg_locks.c.objid, BigInteger) == k2,
            _pg_locks.c.objsubid == 2,
            _pg_locks.c.granted,
        )
    )


#: The session holding the leader's advisory lock (keys ``k1``, ``k2``; schema OIDs are per
#: database, as advisory locks are).
leader_lock_holder = advisory_lock_holder(
    bindparam("k1", type_=BigInteger), bindparam("k2", type_=BigInteger)
)

#: The session holding the migration lock of the schema named ``schema`` (keys
#: ``0x63726f6d`` and ``hashtext(schema)``, shown unsigned), whether a migration holds it
#: for its transaction or any session took it with ``pg_advisory_lock``: every migration of
#: that schema waits for it.
migration_lock_holder = advisory_lock_holder(
    literal(LOCK_NS_MIGRATE, BigInteger),
    cast(func.hashtext(bindparam("schema", type_=Text)), BigInteger).op("&")(
        literal(0xFFFFFFFF, BigInteger)
    ),
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

#: What :data:`prune_batch` would delete with ``batch`` as large as the table: its own
#: victims, so a dry run never disagrees with it about what a live task depends on.
prunable_count = select(func.count()).select_from(prune_victims)

# --- the HA demo (``cronoq_store._demo``) reads back what it wrote ----------------------------

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
#: Whether the holder is moving the epoch now: it holds or awaits the leader table
#: ``EXCLUSIVE`` (the takeover's barrier, where it waits for the old leader's commits), or
#: holds its row-exclusive lock (the bump's ``UPDATE``), and its role may update the table.
#: ``LOCK TABLE`` checks privileges before it queues, and ``pg_locks`` shows every
#: session's locks to every role.
_leader_table = select(_leader_oid.c.tableoid).limit(1).scalar_subquery()
_bumping = and_(
    select(_pg_locks.c.pid)
    .where(
        _pg_locks.c.pid == _holder.c.pid,
        _pg_locks.c.locktype == "relation",
        _pg_locks.c.relation == _leader_table,
        or_(
            _pg_locks.c.mode == "ExclusiveLock",
            and_(_pg_locks.c.mode == "RowExclusiveLock", _pg_locks.c.granted),
        ),
    )
    .exists(),
    # A statement takes that lock when parsed, its privileges are checked when it runs:
    # `PREPARE ... AS UPDATE` in an open transaction holds it for any role with USAGE on
    # the schema.
    func.pg_catalog.has_table_privilege(
        _holder.c.usesysid, _leader_table, literal("UPDATE", Text), type_=Boolean
    ),
)


def _holder_facts(store_instance: ColumnElement[bool]) -> Select[Any]:
    """The stored epoch, the cluster's incarnation (the leader table's OID), the leader
    lock's holder (NULL columns when none holds it) and ``store_instance``, whether it is
    one."""
    return (
        select(
            leader.c.epoch,
            leader_tableoid,
            _holder.c.pid,
            _holder.c.usename,
            _holder.c.application_name,
            _holder.c.client_addr,
            _holder.c.backend_start,
            store_instance.label("store_instance"),
        )
        .select_from(leader.outerjoin(_holder, true()))
        .where(leader.c.id == LEADER_ROW_ID)
    )


#: The stored epoch, the leader lock's holder (keys ``k1``, ``k2``; NULL columns when none
#: holds it) and whether it is a store instance (the session the leader row records, or one
#: bumping the epoch now), and the cluster's incarnation (the leader table's OID): what a
#: waiting standby's lock session reads, with no more privilege than it has (``SELECT`` on
#: the leader row).
leader_holder_facts = _holder_facts(
    or_(func.coalesce(_recorded, false()), _bumping, _unrecorded_epoch)
)

_revisions = (
    select(func.array_agg(_versions.c.version_num, type_=ARRAY(Text)))
    .scalar_subquery()
    .label("revisions")
)

#: The host group the leader row names (``hosted_by``; NULL: standalone), read through the
#: row as JSON so that a leader table without the column (before revision
#: ``0009_host_group``) reads as standalone instead of failing.
_hosted_by = (
    func.to_jsonb(leader.table_valued())
    .op("->>")(literal(leader.c.host_group.name, Text))
    .label("hosted_by")
)

#: In one round trip: :data:`leader_holder_facts`, the revisions the version table
#: records, and the host group the cluster is enrolled in.
health_facts = leader_holder_facts.add_columns(_revisions, _hosted_by)

#: :data:`health_facts` of a leader table with no holder columns (a schema before revision
#: 0007, mid rolling upgrade): no build that leads it records its lock session, so a
#: holder is a store instance once anyone took an epoch (as :data:`_unrecorded_epoch`
#: says), or while it bumps one.
health_facts_unrecorded = _holder_facts(or_(_bumping, leader.c.epoch > 0)).add_columns(
    _revisions, _hosted_by
)

_pg_attribute = table(
    "pg_attribute",
    column("attrelid"),
    column("attname"),
    column("attnum"),
    column("attisdropped"),
    schema="pg_catalog",
)

#: The names of the columns of ``<schema>.cronoq_leader`` (none when it has no such table):
#: which of the facts statements a schema at any revision, older or newer than this
#: build's, can answer. ``to_regclass`` takes a name it parses: quoted first.
leader_columns = select(cast(_pg_attribute.c.attname, Text)).where(
    _pg_attribute.c.attrelid
    == func.to_regclass(
        func.format(
            literal("%I.%I", Text),
            bindparam("schema", type_=Text),
            literal(leader.name, Text),
        )
    ),
    _pg_attribute.c.attnum > 0,
    _pg_attribute.c.attisdropped.is_(false()),
)

#: Whether every role may connect to this database (``CONNECT`` granted to ``PUBLIC``),
#: which stores refuse to lead in: what ``cronoq-store health`` can tell from any role.
public_may_connect = select(
    func.pg_catalog.has_database_privilege(
        literal("public", Text), func.current_database(), literal("CONNECT", Text), type_=Boolean
    )
)

#: Drops this transaction's cached view of ``pg_stat_activity``, so that a second look at
#: the lock holder in the same transaction sees sessions as they are now.
clear_stats_snapshot = select(func.pg_catalog.pg_stat_clear_snapshot())

# --- who holds a lock a wait gave up on (``cronoq_store._door``) -----------------------

_pg_class_oids = table(
    "pg_class", column("oid"), column("relname"), column("relnamespace"), schema="pg_catalog"
)
_pg_namespace_oids = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")

#: The table lock modes as ``pg_locks`` names them, weakest first: ``ACCESS EXCLUSIVE``
#: conflicts with every one, ``EXCLUSIVE`` with all but the first, ``ACCESS SHARE`` (a read)
#: with the last only.
LOCK_MODES = (
    "AccessShareLock",
    "RowShareLock",
    "RowExclusiveLock",
    "ShareUpdateExclusiveLock",
    "ShareLock",
    "ShareRowExclusiveLock",
    "ExclusiveLock",
    "AccessExclusiveLock",
)

#: The other sessions holding a lock on any of the tables ``tables`` of the schema
#: ``schema`` in one of the ``modes`` (of :data:`LOCK_MODES`), one row per session, as
#: :data:`leader_lock_holder` shows them. A row lock (``FOR SHARE``, an ``UPDATE``) comes
#: with a lock on its table, so it is found too.
table_lock_holders = (
    select(
        _pg_stat_activity.c.pid,
        _pg_stat_activity.c.usesysid,
        _pg_stat_activity.c.usename,
        _pg_stat_activity.c.application_name,
        func.host(_pg_stat_activity.c.client_addr).label("client_addr"),
        _pg_stat_activity.c.backend_start,
    )
    .distinct()
    .select_from(
        _pg_locks.join(_pg_stat_activity, _pg_locks.c.pid == _pg_stat_activity.c.pid)
        .join(_pg_class_oids, _pg_locks.c.relation == _pg_class_oids.c.oid)
        .join(_pg_namespace_oids, _pg_class_oids.c.relnamespace == _pg_namespace_oids.c.oid)
    )
    .where(
        _pg_locks.c.locktype == "relation",
        _pg_locks.c.granted,
        _pg_locks.c.pid != func.pg_backend_pid(),
        _pg_locks.c.database
        == select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery(),
        _pg_namespace_oids.c.nspname == bindparam("schema", type_=Text),
        _pg_class_oids.c.relname == any_(bindparam("tables", type_=ARRAY(Text))),
        _pg_locks.c.mode == any_(bindparam("modes", type_=ARRAY(Text))),
    )
    .order_by(_pg_stat_activity.c.pid)
)

# --- a forced handover (``cronoq-store handover``) ------------------------------------------

#: Ends the session ``pid`` (its transaction rolls back, its session locks are released);
#: needs the ``pg_signal_backend`` role (or superuser, or the same role as that session).
terminate_backend = select(
    func.pg_catalog.pg_terminate_backend(bindparam("pid", type_=Integer), type_=Boolean)
)

# --- the CLI: where the clusters are ----------------------------------------------------------

_pg_class = table(
    "pg_class",
    column("relname"),
    column("relnamespace"),
    column("relkind"),
    column("relpersistence"),
    schema="pg_catalog",
)
_pg_namespace = table("pg_namespace", column("oid"), column("nspname"), schema="pg_catalog")
_nspname = cast(_pg_namespace.c.nspname, Text)

#: A cluster's version table: an ordinary, permanent table of that name in a schema of
#: its own. Not a temporary table (any session may create one, in its pg_temp_N schema:
#: it would add a "cluster" to ``--all``), nor one in a system schema.
_version_table = and_(
    _pg_class.c.relname == literal(VERSION_TABLE, Text),
    _pg_class.c.relkind == "r",
    _pg_class.c.relpersistence == "p",
    ~_nspname.startswith("pg_temp_", autoescape=True),
    ~_nspname.startswith("pg_toast", autoescape=True),
    _nspname.not_in(["pg_catalog", "information_schema"]),
)

#: The schemas holding a cluster (its Alembic version table), by name: what the CLI lists
#: when no schema was named and ``public`` holds none. Catalogs only, schema-qualified: no
#: cluster's schema is ever on ``search_path``.
cluster_schemas = (
    select(_pg_namespace.c.nspname)
    .join_from(_pg_class, _pg_namespace, _pg_class.c.relnamespace == _pg_namespace.c.oid)
    .where(_version_table)
    .order_by(_pg_namespace.c.nspname)
)

#: The schemas holding a cluster whose name matches the ``LIKE`` pattern ``pattern`` (the
#: CLI's ``--schemas``, a glob it translates), in the same order: one catalog query, the
#: pattern a bound parameter, backslash its escape character.
cluster_schemas_like = cluster_schemas.where(
    cast(_pg_namespace.c.nspname, Text).like(bindparam("pattern", type_=Text), escape="\\")
)

#: The escape character of :func:`substring_pattern`'s patterns.
LIKE_ESCAPE = "/"


def substring_pattern(text: str) -> str:
    """A ``LIKE`` pattern matching names that hold ``text`` (its wildcards escaped)."""
    escaped = "".join(f"{LIKE_ESCAPE}{c}" if c in f"%_{LIKE_ESCAPE}" else c for c in text)
    return f"%{escaped}%"


def _cluster_page(forward: bool) -> Select[Any]:
    """A page of the schemas holding a cluster whose names match ``pattern`` (ILIKE, with
    :data:`LIKE_ESCAPE`), in one round trip from the catalogs alone: at most ``limit``
    names after ``after`` (``forward``) or before ``before`` (nearest first), how many
    names match (``matching``), how many come before the cursor (``preceding``: up to
    ``after`` inclusive, or strictly before ``before``), and how many schemas hold a
    cluster (``clusters``). Names compare bytewise (``COLLATE "C"``), as the page orders
    them, whatever the database's collation."""
    name = cast(_pg_namespace.c.nspname, Text).collate("C")
    clusters = (
        select(name.label("name"))
        .join_from(_pg_class, _pg_namespace, _pg_class.c.relnamespace == _pg_namespace.c.oid)
        .where(_version_table)
        .cte("clusters")
    )
    found = (
        select(clusters.c.name)
        .where(clusters.c.name.ilike(bindparam("pattern", type_=Text), escape=LIKE_ESCAPE))
        .cte("found")
    )
    if forward:
        cursor = bindparam("after", type_=Text)
        shown = found.c.name > cursor
        before_cursor = found.c.name <= cursor
        order = found.c.name.asc()
    else:
        cursor = bindparam("before", type_=Text)
        shown = found.c.name < cursor
        before_cursor = shown
        order = found.c.name.desc()
    names = (
        select(found.c.name).where(shown).order_by(order).limit(bindparam("limit", type_=Integer))
    )
    return select(
        func.array(names.scalar_subquery(), type_=ARRAY(Text)).label("names"),
        select(func.count()).select_from(found).scalar_subquery().label("matching"),
        select(func.count()).where(before_cursor).scalar_subquery().label("preceding"),
        select(func.count()).select_from(clusters).scalar_subquery().label("clusters"),
    )


#: :func:`_cluster_page` forward, from ``after`` (``""`` for the first page).
cluster_page_after = _cluster_page(forward=True)
#: :func:`_cluster_page` backward, from ``before``.
cluster_page_before = _cluster_page(forward=False)

#: Whether the schema named ``schema`` holds a cluster (one catalog look-up by name).
cluster_schema_exists = select(
    select(_pg_class.c.relname)
    .join_from(_pg_class, _pg_namespace, _pg_class.c.relnamespace == _pg_namespace.c.oid)
    .where(_version_table, _pg_namespace.c.nspname == bindparam("schema", type_=Text))
    .exists()
)
