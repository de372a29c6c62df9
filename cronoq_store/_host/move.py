"""Moving a hosted cluster from one database to another, losing nothing (``host move``).

The steps, each resumable from what the two databases show:

1. **Freeze** in the source, one transaction: the cluster's control row to ``moving`` with
   no owner; the leader table's barrier, which waits for the commits in flight; the epoch
   bumped, so every later commit of the old owner is fenced; the leader row's
   ``host_group`` set to :data:`MOVING_MARK`, which no group can be named (longer than a
   group's 63 bytes), so neither a host's claim nor a standalone ``PgStore`` takes it.
   Every commit acknowledged before the freeze committed before it.
2. **Copy** to the target, one transaction: the schema made by the migrations at this
   build's head (the source must be at head too) by the target URL's role, the three
   tables streamed by COPY from one snapshot of the source, and the leader row given the
   source's epoch and ``max_id``, marked :data:`ARRIVING_MARK`, its table's comment naming
   the copy (:func:`_copy_id`). The snapshot must show the freeze's mark and epoch. The
   target's first claim bumps past the source's last epoch, and no id is issued twice. A
   schema already in the target is refused, unless it is this move's copy (go on).
3. **Verify**: each table's row count and digest, the epoch and ``max_id``, equal.
4. **Enroll** in the target's group, one transaction: the mark replaced by the group.
5. **Tombstone** the source, one transaction: its control row ``moved`` and its leader row
   marked :data:`MOVED_MARK`; with ``drop_source``, then the schema dropped.

One move of a cluster at a time: each holds a session advisory lock of the source database
(:data:`LOCK_NS_MOVE`, ``hashtext(group || '/' || schema)``) for as long as it runs, so a
second one is refused at once, and an interrupted one's lock is free when its session is.
A session lock holds only on a direct connection: ``--from`` through a pooler in
transaction mode shares server sessions between clients, and the lock with them. The lock
also tells the target from the source: a target whose server lists it, held by the
source's session, in the target's own database is the source under another URL, refused
before anything else (:func:`_refuse_the_source`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Integer,
    MetaData,
    String,
    Text,
    bindparam,
    cast,
    delete,
    func,
    literal,
    literal_column,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import DropSchema, SetTableComment

from .. import _catalog as catalog
from .. import _door as door
from .. import _migrations as migrations
from .. import _statements as st
from .._errors import StoreError
from .._schema import (
    LEADER_ROW_ID,
    leader,
    leader_history,
    leader_tableoid,
    recurring,
    schema_options,
    tasks,
)
from .._trust import refuse_untrusted
from .._urls import redact
from . import control

__all__ = [
    "ARRIVING_MARK",
    "LOCK_NS_MOVE",
    "MOVED",
    "MOVED_MARK",
    "MOVING",
    "MOVING_MARK",
    "MoveError",
    "move",
]

logger = logging.getLogger("cronoq_store")

#: First key of the lock a move holds in the source database ('crov').
LOCK_NS_MOVE = 0x63726F76
#: ``host_group`` of a frozen source cluster. Every mark is longer than a group's name may
#: be (63 bytes), so no host group's statements ever match it.
MOVING_MARK = "(cronoq-store host move: frozen here, moving to another database; led nowhere)"
#: ``host_group`` of a copy in the target not enrolled yet.
ARRIVING_MARK = "(cronoq-store host move: a copy arriving from another database; led nowhere)"
#: ``host_group`` of a source cluster once moved: a tombstone no one leads.
MOVED_MARK = "(cronoq-store host move: moved to another database; this copy is a tombstone)"

#: The tables a move copies, each with the key its digest orders by.
_COPIED = (
    (tasks, tasks.c.id),
    (recurring, recurring.c.name),
    (leader_history, leader_history.c.epoch),
)
#: A cluster's control row while a move froze it, and once it moved (its tombstone).
MOVING, MOVED = "moving", "moved"
#: A cluster's newest term (``epoch``, ``began_at``, ``pid``): a copy carries it unchanged.
_newest_term = (
    select(leader_history.c.epoch, leader_history.c.began_at, leader_history.c.pid)
    .order_by(leader_history.c.began_at.desc(), leader_history.c.epoch.desc())
    .limit(1)
)
#: The term ``:epoch`` as ``_newest_term`` reads it.
_term = select(leader_history.c.epoch, leader_history.c.began_at, leader_history.c.pid).where(
    leader_history.c.epoch == bindparam("epoch", type_=Integer)
)
#: How many COPY chunks may wait between the source's read and the target's write.
_CHUNKS = 16


class MoveError(StoreError):
    """The move cannot go on as asked; the message says what to do. Nothing of the cluster
    was lost: each step is one transaction, and the source stays frozen until the target is
    verified."""


@dataclass(frozen=True, slots=True)
class MoveReport:
    """A move's outcome: the epoch and ``max_id`` carried over (``None`` when a move that
    had ended was run again), rows per table copied by this run."""

    epoch: int | None
    max_id: int | None
    rows: dict[str, int]


_group = bindparam("group", type_=Text)
_schema_name = bindparam("schema", type_=Text)
_clusters = control.clusters
_this = (_clusters.c.host_group == _group) & (_clusters.c.schema_name == _schema_name)

#: The cluster's control row, locked (``state``, ``incarnation``, ``refused_why``, ``epoch``).
_control_row = (
    select(_clusters.c.state, _clusters.c.incarnation, _clusters.c.refused_why, _clusters.c.epoch)
    .where(_this)
    .with_for_update()
)
#: The freeze's control row: ``moving`` to ``:target``, no owner, at the epoch the freeze took.
_set_moving = (
    update(_clusters)
    .where(_this)
    .values(
        state=MOVING,
        owner=None,
        epoch=bindparam("epoch", type_=Integer),
        refused_why=bindparam("why", type_=Text),
    )
)
#: The tombstone's control row.
_set_moved = (
    update(_clusters)
    .where(_this, _clusters.c.state == MOVING)
    .values(state=MOVED, owner=None, refused_why=bindparam("why", type_=Text))
)
#: The leader row's mark from ``:was`` to ``:mark``; returns the epoch and ``max_id``.
_remark = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID, leader.c.host_group == bindparam("was", type_=Text))
    .values(host_group=bindparam("mark", type_=Text))
    .returning(leader.c.epoch, leader.c.max_id)
)
#: The copy's leader row: the source's epoch and ``max_id``, marked as arriving.
_arrive = (
    update(leader)
    .where(leader.c.id == LEADER_ROW_ID)
    .values(
        epoch=bindparam("epoch", type_=Integer),
        max_id=bindparam("max_id"),
        host_group=ARRIVING_MARK,
    )
)
#: The move's state of the cluster named ``:schema`` in whichever group (``state``,
#: ``refused_why``), its control row locked: an enrolment reads it to refuse a cluster a move
#: froze or moved, and a freeze waits for the enrolment's transaction to end.
move_state = (
    select(_clusters.c.state, _clusters.c.refused_why)
    .where(_clusters.c.schema_name == _schema_name, _clusters.c.state.in_((MOVING, MOVED)))
    .with_for_update()
)


def refusal(schema: str, state: str, note: str | None) -> str:
    """Why a cluster a move froze (``moving``) or moved (``moved``) cannot be enrolled, and
    what to do: enrolling would make or lead a second writer of a cluster that lives on in
    the move's target."""
    if state == MOVING:
        return (
            f"enrolling schema {schema!r} failed: it is being moved ({note}): finish or resume "
            "the move first (`cronoq-store host move`)"
        )
    return (
        f"enrolling schema {schema!r} failed: it was {note}, and its control row here is the "
        "move's tombstone: enroll it where it went. To make a new cluster of that name in "
        "this database, remove the tombstone first (`cronoq-store host remove`)"
    )


#: The leader table's comment (the copy's name, :func:`_copy_id`) and the leader row's epoch.
_comment = select(
    func.obj_description(leader_tableoid, literal("pg_class")).label("comment"), leader.c.epoch
)
#: The control row of the schema named ``:schema``, in whichever group.
_listed = select(_clusters.c.host_group, _clusters.c.state).where(
    _clusters.c.schema_name == _schema_name
)
#: This group's tombstone of the cluster, which an enrolment of it coming back replaces.
_drop_tombstone = delete(_clusters).where(_this, _clusters.c.state == MOVED)
_leader_row = select(leader.c.epoch, leader.c.max_id, leader.c.host_group, leader_tableoid)
_try_move_lock = select(
    func.pg_try_advisory_lock(
        literal(LOCK_NS_MOVE, Integer), func.hashtext(bindparam("key", type_=Text))
    )
)
#: The backend of the session holding the move's lock, as its server numbers it.
_backend_pid = select(func.pg_backend_pid())
#: The sessions holding the move's lock of ``:key`` in the database this one is in: read
#: through ``--to``, the source's session among them says that ``--to`` reached the source
#: database itself, whatever its URL says.
_move_lock_holders = select(
    catalog.advisory_lock_holder(
        literal(LOCK_NS_MOVE, BigInteger),
        cast(func.hashtext(bindparam("key", type_=Text)), BigInteger).op("&")(
            literal(0xFFFFFFFF, BigInteger)
        ),
    )
    .subquery()
    .c.pid
)
_move_unlock = select(
    func.pg_advisory_unlock(
        literal(LOCK_NS_MOVE, Integer), func.hashtext(bindparam("key", type_=Text))
    )
)


#: The settings a row's text depends on, for the digest's transaction only: two servers may
#: differ in them (initdb takes the machine's zone), and equal rows must read as equal text.
_text_settings = select(
    *(
        func.set_config(name, value, True)
        for name, value in (
            ("TimeZone", "UTC"),
            ("DateStyle", "ISO, MDY"),
            ("IntervalStyle", "postgres"),
            ("bytea_output", "hex"),
            ("extra_float_digits", "3"),
        )
    )
)


#: Rows a part of a table's digest joins (:func:`_digest`): 32 MiB of joined text at most,
#: where one value of every row would stop at PostgreSQL's 1 GB bound (2^25 rows).
DIGEST_PART_ROWS = 1 << 20


def _digest(table: Any, key: Any, part_rows: int = DIGEST_PART_ROWS) -> Any:
    """One table's row count and a digest of every row in key order: equal in source and
    target when every row arrived whole. Rows are rendered as text by the server, so the
    comparison needs no decoding of the client's. Each row's md5 is joined with the others
    of its part (``part_rows`` rows in key order), each part's joined md5s hashed, and the
    parts' hashes joined and hashed in order: no value nears the 1 GB bound on a value, nor
    a backend's memory, whatever the table's size. A text key is ordered by its bytes: each
    database's own collation could order the same rows two ways, and refuse a faithful copy
    every time."""
    row_text = cast(tuple_(*table.c), Text) if len(table.c) > 1 else cast(table.c[0], Text)
    order = key.collate("C") if isinstance(key.type, String) else key
    rows = select(
        (func.row_number().over(order_by=order) - 1).label("position"),
        func.md5(row_text).label("row_md5"),
    ).subquery("digested_rows")
    part = rows.c.position.op("/", return_type=BigInteger)(literal(part_rows, BigInteger))
    in_order: Any = aggregate_order_by(literal_column("''"), rows.c.position)
    parts = (
        select(
            part.label("part"),
            func.count().label("rows"),
            func.md5(func.string_agg(rows.c.row_md5, in_order)).label("part_md5"),
        )
        .group_by(part)
        .subquery("digested_parts")
    )
    joined = func.string_agg(
        parts.c.part_md5, aggregate_order_by(literal_column("''"), parts.c.part)
    )
    return select(
        cast(func.coalesce(func.sum(parts.c.rows), 0), BigInteger),
        func.md5(func.coalesce(joined, "")),
    )


async def move(
    source: AsyncEngine,
    target: AsyncEngine,
    schema: str,
    *,
    group: str,
    control_schema: str,
    trusted_triggers: frozenset[str] = frozenset(),
    drop_source: bool = False,
    barrier_bound: float = 30.0,
    said: Callable[[str], None] = lambda line: None,
) -> MoveReport:
    """Move the cluster ``schema`` of host group ``group`` from the database of ``source``
    to that of ``target`` (see the module's docstring), or go on with a move of it that
    was interrupted. ``said`` gets a line per step done. ``MoveError`` when it cannot."""
    to = redact(target.url.set(drivername="postgresql"))
    await control.prepare_control(source, control_schema)
    key = f"{group}/{schema}"
    async with source.connect() as locked:
        async with door.translated("taking the move's lock"):
            held = (await locked.execute(_try_move_lock, {"key": key})).scalar()
            await locked.commit()
        if not held:
            raise MoveError(
                f"another move of schema {schema!r} (host group {group!r}) is running: wait "
                "for it to end (a move that was interrupted frees its lock with its session)"
            )
        try:
            await _refuse_the_source(locked, target, schema, key)
            await control.prepare_control(target, control_schema)
            return await _steps(
                source, target, schema, group, control_schema, trusted_triggers,
                drop_source, barrier_bound, to, said,
            )  # fmt: skip
        finally:
            # The lock goes with its session anyway, closed next: a failure to free it here
            # (the server gone) must not hide why the move stopped.
            with contextlib.suppress(Exception):
                await locked.execute(_move_unlock, {"key": key})
                await locked.commit()


async def _refuse_the_source(
    locked: AsyncConnection, target: AsyncEngine, schema: str, key: str
) -> None:
    """Refuse a target that is the source database under another URL (another host name
    or address for the server, its unix socket, a pooler or proxy in front of it, another
    role or options): its schema is the cluster itself, so no copy could be made, and a
    refusal saying "drop it there" would drop the only one. Known by what the server shows,
    not by the URL: the target's ``pg_locks`` lists the move's lock, held by the source's
    session, in the target's own database. Any role may read ``pg_locks``; a physical
    clone of the source (its ``system_identifier`` and database OIDs the same) holds no
    lock of this session, so it stays a valid target. Another database of the same server
    is one too: its locks are listed under its own OID."""
    async with door.translated("telling the target database from the source"):
        pid = (await locked.execute(_backend_pid)).scalar()
        await locked.commit()
        async with target.connect() as c:
            holders = (await c.execute(_move_lock_holders, {"key": key})).scalars().all()
            await c.rollback()
    if pid in holders:
        raise MoveError(
            "--to reaches the source database itself through another URL (its server shows "
            "this move's lock, held by the source's session, in the database --to connects "
            f"to): schema {schema!r} there is the cluster, not a copy, so do not drop it. "
            "Name the target database in --to (another database of the same server will "
            "do); the cluster was left as it was"
        )


async def _steps(
    source: AsyncEngine,
    target: AsyncEngine,
    schema: str,
    group: str,
    control_schema: str,
    trusted_triggers: frozenset[str],
    drop_source: bool,
    barrier_bound: float,
    to: str,
    said: Callable[[str], None],
) -> MoveReport:
    names = {"group": group, "schema": schema}
    in_control = control.control_options(control_schema)
    in_cluster = schema_options(schema)
    async with door.translated(f"reading schema {schema!r} in the source"), source.connect() as c:
        row = (await c.execute(_control_row, names, execution_options=in_control)).first()
        await c.rollback()
    if row is None:
        raise MoveError(f"schema {schema!r} is not enrolled in host group {group!r} in the source")
    if row.state == MOVED:
        said(f"already {row.refused_why}")
        if drop_source:
            await _drop(source, schema, said)
        return MoveReport(row.epoch, None, {})
    if row.state == MOVING and row.refused_why != _moving_to(to):
        raise MoveError(
            f"schema {schema!r} is being moved ({row.refused_why}), and --to is not that URL "
            "as written: resume the move with --to spelled as the note shows (host, port, "
            "database and options; the password is not compared)"
        )
    arrived = await _arrival(target, schema, group, control_schema, trusted_triggers)
    frozen = -1 if row.epoch is None else int(row.epoch)
    if row.state != MOVING:
        if arrived is not None:
            raise MoveError(
                f"the target database holds a schema {schema!r} already: drop or rename it "
                "there first (nothing was frozen)"
            )
        # Before the freeze: a cluster that cannot be copied is not taken from its owner.
        await migrations.require_head(source, schema, trusted_triggers=trusted_triggers)
        await _target_ready(target, schema, group, control_schema, trusted_triggers)
        frozen = await _freeze(source, schema, group, control_schema, barrier_bound, to)
        said(f"frozen in the source at epoch {frozen}: every later commit of its owner is fenced")
    elif arrived is None:
        # Resumed before the copy: it reads the source's schema as it stands now.
        await migrations.require_head(source, schema, trusted_triggers=trusted_triggers)
    rows: dict[str, int] = {}
    if arrived is None:
        rows = await _copy(source, target, schema, trusted_triggers, frozen)
        said("copied: " + ", ".join(f"{name} {n:,} rows" for name, n in rows.items()))
        arrived = ARRIVING_MARK
    elif arrived not in (ARRIVING_MARK, group):
        raise MoveError(
            f"the target database holds a schema {schema!r} this move did not make (its "
            "leader row is not marked as arriving): drop or rename it there, then run the "
            "move again (the source stays frozen until then)"
        )
    source_leader = await _leader(source, schema)
    if arrived == group:
        await _same_copy(source, target, schema, frozen)
    else:
        await _verify(source, target, schema)
        said("verified: row counts and digests, epoch and max_id equal")
        await _enroll(target, schema, group, control_schema)
        said(f"enrolled in host group {group!r} in the target")
    async with door.translated(f"tombstoning schema {schema!r}"), source.begin() as c:
        moved = await c.execute(
            _set_moved, {**names, "why": f"moved to {to}"}, execution_options=in_control
        )
        marked = (
            await c.execute(
                _remark, {"was": MOVING_MARK, "mark": MOVED_MARK}, execution_options=in_cluster
            )
        ).first()
        if moved.rowcount != 1 or marked is None:
            # Rolled back: a source that was not frozen (its rows edited or restored) is
            # never marked moved while a process may still commit to it.
            raise MoveError(
                f"schema {schema!r} in the source is no longer frozen by this move (its "
                "control row or its leader row changed): it may be led there again, so "
                "the copy in the target must not be: remove it there (`cronoq-store host "
                "remove`) and find which one holds the acknowledged commits"
            )
    said("tombstoned in the source: no host or store leads it there")
    if drop_source:
        await _drop(source, schema, said)
    return MoveReport(source_leader.epoch, source_leader.max_id, rows)


async def _drop(source: AsyncEngine, schema: str, said: Callable[[str], None]) -> None:
    async with door.translated(f"dropping schema {schema!r}"), source.begin() as c:
        await c.execute(DropSchema(schema, cascade=True, if_exists=True))
    said(f"dropped schema {schema!r} in the source")


def _moving_to(to: str) -> str:
    return f"moving to {to}"


async def _leader(engine: AsyncEngine, schema: str) -> Any:
    async with door.translated(f"reading schema {schema!r}"), engine.connect() as c:
        row = (await c.execute(_leader_row, execution_options=schema_options(schema))).first()
        await c.rollback()
    if row is None:
        raise MoveError(f"schema {schema!r} holds no leader row")
    return row


async def _arrival(
    target: AsyncEngine,
    schema: str,
    group: str,
    control_schema: str,
    trusted_triggers: frozenset[str],
) -> str | None:
    """The mark on the leader row of the target's ``schema`` (``None``: no such schema;
    the group: this move's copy enrolled; ``""``: a schema that holds no cluster, or one
    the group does not list). Read only once the trust check passed: the schema may be
    anyone's, and its relations run their owners' code for whoever reads them."""
    in_control = control.control_options(control_schema)
    async with door.translated(f"reading schema {schema!r} in the target"), target.connect() as c:
        try:
            if (await c.execute(st.schema_oid, {"schema": schema})).scalar() is None:
                return None
            await c.run_sync(
                lambda sync: refuse_untrusted(
                    sync, schema, trusted_triggers, tables=st.CLUSTER_TABLES
                )
            )
            looking = {"schema": schema, "name": leader.name}
            if not (await c.execute(catalog.relation_exists, looking)).scalar():
                return ""
            found = (await c.execute(_leader_row, execution_options=schema_options(schema))).first()
            if found is None:
                return ""
            if found.host_group != group:
                return str(found.host_group or "")
            names = {"group": group, "schema": schema}
            listed = (await c.execute(_control_row, names, execution_options=in_control)).first()
            return group if listed is not None else ""
        finally:
            await c.rollback()


async def _target_ready(
    target: AsyncEngine,
    schema: str,
    group: str,
    control_schema: str,
    trusted_triggers: frozenset[str],
) -> None:
    """Refuse, before anything is frozen, a target the copy or the enrolment would fail in:
    its role cannot make the schema (the migrations are run and rolled back), or its
    control schema lists the name, other than as this group's tombstone of an earlier move
    (the enrolment replaces that one: the cluster comes back)."""
    in_control = control.control_options(control_schema)
    async with door.translated(f"checking the target for schema {schema!r}"), target.connect() as c:
        listed = (
            await c.execute(_listed, {"schema": schema}, execution_options=in_control)
        ).first()
        await c.rollback()
    if listed is not None and (listed.state, listed.host_group) != (MOVED, group):
        raise MoveError(
            f"the target's control schema lists schema {schema!r} already (host group "
            f"{listed.host_group!r}, {listed.state}): remove it there (`cronoq-store host "
            "remove`), then run the move again (nothing was frozen)"
        )
    try:
        async with target.connect() as c:
            await c.begin()
            try:
                await migrations.upgrade(c, schema, trusted_triggers=trusted_triggers)
            finally:
                await c.rollback()
    except StoreError as exc:
        raise MoveError(
            f"the migrations cannot make schema {schema!r} in the target ({exc}): fix that "
            "(a role without CREATE on the database: grant it, or name one that has it in "
            "--to), then run the move again (nothing was frozen)"
        ) from exc


async def _freeze(
    source: AsyncEngine,
    schema: str,
    group: str,
    control_schema: str,
    bound: float,
    to: str,
) -> int:
    names = {"group": group, "schema": schema}
    in_control = control.control_options(control_schema)
    in_cluster = schema_options(schema)
    async with door.translated(f"freezing schema {schema!r}"), source.begin() as c:
        row = (await c.execute(_control_row, names, execution_options=in_control)).first()
        if row is None or row.state not in ("active", "refused"):
            raise MoveError(
                f"schema {schema!r} changed as the move began "
                f"({'gone' if row is None else row.state}): run it again"
            )
        await door.leader_barrier(
            lambda statement, params: c.execute(statement, params, execution_options=in_cluster),
            schema,
            bound,
            "freezing a cluster to move it",
        )
        found = (await c.execute(_leader_row, execution_options=in_cluster)).first()
        if found is None or int(found.tableoid) != int(row.incarnation):
            raise MoveError(
                f"schema {schema!r} holds another cluster than the one enrolled (made again "
                "since): enroll it again first (`cronoq-store host enroll`)"
            )
        epoch = (
            await c.execute(
                st.take_hosted_epoch,
                {"incarnation": int(row.incarnation), "group": group},
                execution_options=in_cluster,
            )
        ).scalar()
        if epoch is None:
            raise MoveError(
                f"schema {schema!r} is not marked as host group {group!r}'s in its own leader "
                "row: enroll it again first (`cronoq-store host enroll`)"
            )
        await c.execute(_remark, {"was": group, "mark": MOVING_MARK}, execution_options=in_cluster)
        # The freeze is a term of its own in the history: status names the move's session,
        # and the copy carries the row, by which a resumed move knows its copy.
        term = {"epoch": epoch, "lock_seen_held_at": None}
        await c.execute(st.record_term, term, execution_options=in_cluster)
        await c.execute(st.prune_terms, execution_options=in_cluster)
        await c.execute(
            _set_moving,
            {**names, "epoch": epoch, "why": _moving_to(to)},
            execution_options=in_control,
        )
    return int(epoch)


async def _copy(
    source: AsyncEngine,
    target: AsyncEngine,
    schema: str,
    trusted_triggers: frozenset[str],
    frozen: int,
) -> dict[str, int]:
    """The target's schema made and filled in one transaction, from one snapshot of the
    source: all of it lands, or nothing (then the move starts this step again). The source
    must show the freeze at epoch ``frozen`` in that snapshot: a control row saying
    ``moving`` proves nothing (restored, or written by hand), and a cluster its owner still
    commits to would lose every commit after the copy."""
    rows: dict[str, int] = {}
    async with (
        door.translated(f"copying schema {schema!r}"),
        source.connect() as read,
        target.connect() as write,
    ):
        read = await read.execution_options(isolation_level="REPEATABLE READ")
        await read.begin()
        # The driver's transaction begins with the first statement: the raw COPYs below
        # run inside it, in the snapshot this read takes, only once it ran.
        found = (await read.execute(_leader_row, execution_options=schema_options(schema))).one()
        if found.host_group != MOVING_MARK or found.epoch != frozen:
            raise MoveError(
                f"schema {schema!r} in the source is not frozen by a move (its leader row "
                f"is not marked so at epoch {frozen}), though its control row says "
                "'moving' (restored or edited): nothing was copied. Set that row's state "
                "back to 'active' by hand and run the move again"
            )
        copy_id = await _copy_id(read, schema, frozen)
        await write.begin()
        if (await write.execute(st.schema_oid, {"schema": schema})).scalar() is not None:
            raise MoveError(f"a schema {schema!r} appeared in the target meanwhile: run it again")
        await migrations.upgrade(write, schema, trusted_triggers=trusted_triggers)
        reader = (await read.get_raw_connection()).driver_connection
        writer = (await write.get_raw_connection()).driver_connection
        for table, _ in _COPIED:
            rows[table.name] = await _stream(reader, writer, schema, table)
        await write.execute(
            _arrive,
            {"epoch": found.epoch, "max_id": found.max_id},
            execution_options=schema_options(schema),
        )
        named = leader.to_metadata(MetaData())
        named.comment = copy_id
        await write.execute(SetTableComment(named), execution_options=schema_options(schema))
        await write.commit()
        await read.rollback()
    return rows


async def _stream(reader: Any, writer: Any, schema: str, table: Any) -> int:
    """``table``'s rows from ``reader``'s COPY into ``writer``'s, in binary, by column name
    (the two tables were made by the same migrations), never more than a few chunks held."""
    columns = [c.name for c in table.c]
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(_CHUNKS)

    async def take(chunk: bytes) -> None:
        await chunks.put(bytes(chunk))

    async def read() -> None:
        try:
            await reader.copy_from_table(
                table.name, schema_name=schema, columns=columns, output=take, format="binary"
            )
        finally:
            await chunks.put(None)

    async def source() -> Any:
        while (chunk := await chunks.get()) is not None:
            yield chunk

    reading = asyncio.ensure_future(read())
    try:
        status = await writer.copy_to_table(
            table.name, schema_name=schema, columns=columns, source=source(), format="binary"
        )
    finally:
        if not reading.done():
            reading.cancel()
        await asyncio.wait({reading})
    reading.result()
    return int(status.split()[-1])


async def _verify(source: AsyncEngine, target: AsyncEngine, schema: str) -> None:
    for table, key in _COPIED:
        there = await _one(source, schema, _digest(table, key))
        here = await _one(target, schema, _digest(table, key))
        if tuple(there) != tuple(here):
            differs = (
                f"its {here[0]:,} rows are not the source's {there[0]:,}"
                if here[0] != there[0]
                else f"the same {here[0]:,} rows, with other contents"
            )
            raise MoveError(
                f"the copy of {table.name} differs from the source ({differs}): drop schema "
                f"{schema!r} in the target and run the move again (the source stays frozen)"
            )
    a, b = await _leader(source, schema), await _leader(target, schema)
    if (a.epoch, a.max_id) != (b.epoch, b.max_id):
        raise MoveError(
            f"the copy's epoch and max_id ({b.epoch}, {b.max_id}) are not the source's "
            f"({a.epoch}, {a.max_id}): drop schema {schema!r} in the target and run the "
            "move again (the source stays frozen)"
        )


async def _copy_id(source: AsyncConnection, schema: str, frozen: int) -> str:
    """What names this move's copy: the source's leader table, the freeze's epoch and the
    instant its term began, read in the source, which the freeze leaves unchanged. The copy
    keeps it as its leader table's comment, which no term prunes, unlike its history."""
    in_cluster = schema_options(schema)
    oid = (await source.execute(select(leader_tableoid), execution_options=in_cluster)).scalar()
    term = (await source.execute(_term, {"epoch": frozen}, execution_options=in_cluster)).first()
    began = "?" if term is None else term.began_at.isoformat()
    return f"cronoq-store host move: a copy of table {oid} frozen at epoch {frozen} at {began}"


async def _same_copy(source: AsyncEngine, target: AsyncEngine, schema: str, frozen: int) -> None:
    """Refuse a target found enrolled that is not this move's copy. Its leader table's
    comment names the copy (:func:`_copy_id`); a copy without one (made by a build before
    the comment) is known by the freeze's term in its history, which a cluster made apart
    never carries. Digests cannot tell: once enrolled, the copy may have been led and
    changed. A cluster ever led (its epoch above 0) is never called for dropping: it may
    hold acknowledged commits, whichever it is."""
    async with door.translated(f"checking schema {schema!r}"), source.connect() as c:
        expected = await _copy_id(c, schema, frozen)
        await c.rollback()
    found = await _maybe_one(target, schema, _comment, {})
    if found is not None and found.comment == expected:
        return
    if found is not None and found.comment is None:
        newest = await _maybe_one(source, schema, _newest_term, {})
        there = (
            None
            if newest is None
            else await _maybe_one(target, schema, _term, {"epoch": newest.epoch})
        )
        if newest is not None and there is not None and tuple(there) == tuple(newest):
            return
    led = found is None or found.epoch > 0
    what = (
        "it was led there since, so it may hold acknowledged commits: remove it there "
        "(`cronoq-store host remove`) and drop it only once you know what it holds"
        if led
        else "remove and drop it there"
    )
    raise MoveError(
        f"the target database holds a cluster {schema!r} enrolled in the group that is not "
        f"this move's copy: {what}, then run the move again (the source stays frozen until "
        "then)"
    )


async def _maybe_one(
    engine: AsyncEngine, schema: str, statement: Any, params: dict[str, Any]
) -> Any:
    async with door.translated(f"checking schema {schema!r}"), engine.connect() as c:
        row = (await c.execute(statement, params, execution_options=schema_options(schema))).first()
        await c.rollback()
    return row


async def _one(engine: AsyncEngine, schema: str, statement: Any) -> Any:
    async with door.translated(f"checking schema {schema!r}"), engine.connect() as c:
        await c.execute(_text_settings)
        row = (await c.execute(statement, execution_options=schema_options(schema))).one()
        await c.rollback()
    return row


async def _enroll(target: AsyncEngine, schema: str, group: str, control_schema: str) -> None:
    in_cluster = schema_options(schema)
    async with door.translated(f"enrolling schema {schema!r} in the target"), target.begin() as c:
        oid = (await c.execute(st.schema_oid, {"schema": schema})).scalar()
        if oid is None:
            raise MoveError(f"schema {schema!r} is gone from the target: run the move again")
        key = {"k1": st.LOCK_NS_LEADER, "k2": int(oid)}
        locked = (await c.execute(st.try_leader_lock_for_transaction, key)).scalar()
        if not locked:
            raise MoveError(
                f"the leader lock of schema {schema!r} in the target is held (a standalone "
                "store or a downgrade): stop it, then run the move again"
            )
        found = (await c.execute(_leader_row, execution_options=in_cluster)).one()
        await c.execute(
            _remark, {"was": ARRIVING_MARK, "mark": group}, execution_options=in_cluster
        )
        row = {"group": group, "schema": schema, "incarnation": int(found.tableoid)}
        in_control = control.control_options(control_schema)
        await c.execute(_drop_tombstone, row, execution_options=in_control)
        added = (
            await c.execute(
                control.enroll, row, execution_options=control.control_options(control_schema)
            )
        ).first()
        if added is None or not added.inserted:
            raise MoveError(
                f"schema {schema!r} is listed in the target's control schema already "
                f"({'' if added is None else added.host_group}): remove it there "
                "(`cronoq-store host remove`), then run the move again"
            )
