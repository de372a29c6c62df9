"""The leader lock session's statements: the advisory lock, the epoch bump, the session's
own settings, the keeper's check of the leader row, and the schema's OID that keys the lock.

Run by :class:`~cronoq_store._leadership.Leadership` on its dedicated session, never on a
commit's connection.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    DateTime,
    Integer,
    Text,
    bindparam,
    case,
    cast,
    column,
    delete,
    false,
    func,
    literal,
    select,
    table,
    update,
)
from sqlalchemy.dialects import postgresql

from ._domain import EPOCH_MAX
from ._schema import LEADER_ROW_ID, leader, leader_history, leader_tableoid

__all__ = [
    "LOCK_NS_LEADER",
    "LOCK_NS_MIGRATE",
    "LOCK_SESSION_SETTINGS",
    "TERMS_KEPT",
    "bump_epoch",
    "bump_epoch_only",
    "keeper_lock_timeout",
    "leader_now",
    "lock_session_settings",
    "prune_terms",
    "record_term",
    "schema_oid",
    "take_epoch",
    "try_leader_lock",
]

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

#: Taking the lock takes the next epoch (:data:`bump_epoch`), only in the cluster
#: ``:incarnation`` (the leader table's OID) that the store was opened on: no row in another.
take_epoch = bump_epoch.where(leader_tableoid == bindparam("incarnation", type_=postgresql.OID))

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
