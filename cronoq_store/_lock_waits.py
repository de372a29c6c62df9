"""Waits for a lock another session holds: who holds it, said while the wait lasts, and
the bound after which a wait that is not the call's purpose gives up.

Opening a store, migrating and pruning wait for locks only on the way to their work, so
each wait has a bound; past it the call raises :class:`~cronoq_store.LockHeldError` naming
the holders (pid, role, application name, since when), with nothing changed. While it
waits, :class:`LockWait` logs who it waits behind: at INFO when the wait starts (two
instances opening at once is ordinary), then at WARNING every :data:`REPORT_INTERVAL`.

The waits themselves never queue on a lock for longer than an attempt:

- the migration lock is tried (``pg_try_advisory_xact_lock``) and tried again, with a look
  at its holder between tries (:func:`take_migration_lock`);
- a migration locks the cluster's tables before its DDL, an attempt of
  :data:`TABLE_LOCK_ATTEMPT` at a time (:func:`lock_tables`): a DDL statement queued behind
  a long transaction would stop every commit queued behind it for as long;
- the leader barrier of a takeover or a prune batch waits under ``lock_timeout``
  (:func:`leader_barrier`), and names who held the leader table when that ran out.

Each attempt runs in a savepoint of the caller's transaction, so a failed one leaves the
transaction (and the locks it holds, the migration lock first) as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timezone
from typing import Any

from sqlalchemy import Connection, Executable, Result

from . import _catalog as catalog
from . import _statements as st
from ._door import lock_not_available
from ._errors import LockHeldError
from ._results import LockHolder
from ._schema import leader

__all__ = [
    "REPORT_INTERVAL",
    "TABLE_LOCK_ATTEMPT",
    "LockWait",
    "describe_holders",
    "holder_of",
    "leader_barrier",
    "lock_tables",
    "take_migration_lock",
]

logger = logging.getLogger("cronoq_store")

#: A wait still going is said again (at WARNING) every this many seconds.
REPORT_INTERVAL = 30.0
#: How long one attempt at the cluster's tables queues (commits queue behind it meanwhile).
TABLE_LOCK_ATTEMPT = 0.5
#: The pause between two attempts at the tables, during which commits go on.
TABLE_LOCK_PAUSE = 1.0
#: The pause between two tries of the migration lock.
MIGRATION_LOCK_POLL = 0.2


def describe_holders(holders: Sequence[LockHolder]) -> str:
    """Sessions holding a lock, in words: pid, role, application name, address, since when.
    None: the holder let go meanwhile, or is no session (a prepared transaction)."""
    if not holders:
        return "no session now (it let go meanwhile, or is a prepared transaction)"
    return "; ".join(_describe(h) for h in holders)


def _describe(holder: LockHolder) -> str:
    since = "an unknown time" if holder.since is None else holder.since.isoformat()
    return (
        f"pid {holder.pid} (role {holder.role or '(hidden)'!r}, application "
        f"{holder.application_name or ''!r}, client {holder.client_addr or 'local or hidden'}, "
        f"session since {since})"
    )


class LockWait:
    """One wait for ``what`` (``"the migration lock of schema 'a'"``), given up after
    ``bound`` seconds; ``how`` names where the bound is set, for the error.

    Each failed attempt reports who held the lock (:meth:`held_by`), which logs it at a
    rate (INFO first, WARNING every :data:`REPORT_INTERVAL` after) and raises
    :class:`~cronoq_store.LockHeldError` once the bound has passed."""

    def __init__(self, what: str, bound: float, how: str) -> None:
        self.what = what
        self.bound = bound
        self._how = how
        self._started = time.monotonic()
        self._said_at: float | None = None

    def then(self, what: str) -> LockWait:
        """The same wait going on for ``what`` instead, with what remains of the bound."""
        following = LockWait(what, self.bound, self._how)
        following._started = self._started
        return following

    @property
    def waited(self) -> float:
        return time.monotonic() - self._started

    @property
    def remaining(self) -> float:
        return max(0.0, self.bound - self.waited)

    def held_by(self, holders: Sequence[LockHolder]) -> None:
        """An attempt found the lock held by ``holders``: say so, or give up."""
        waited = self.waited
        if waited >= self.bound:
            raise LockHeldError(
                f"gave up waiting for {self.what} after {self.bound:g} s ({self._how}): held "
                f"by {describe_holders(holders)}; nothing was changed",
                holders,
            )
        now = time.monotonic()
        if self._said_at is not None and now - self._said_at < REPORT_INTERVAL:
            return
        first = self._said_at is None
        self._said_at = now
        said = (
            f"waiting for {self.what}"
            if first
            else f"still waiting for {self.what} after {waited:.0f} s"
        )
        logger.log(
            logging.INFO if first else logging.WARNING,
            "%s, held by %s; giving up after %g s (%s)",
            said,
            describe_holders(holders),
            self.bound,
            self._how,
            extra={
                "lock": self.what,
                "waited": round(waited, 3),
                "bound": self.bound,
                "holder_pids": [h.pid for h in holders],
            },
        )


def holder_of(row: Any, *, store_instance: bool | None = None) -> LockHolder | None:
    """The holder in a row of :data:`~cronoq_store._statements.leader_holder_facts` (or of
    :data:`~cronoq_store._statements.health_facts`); ``store_instance`` where the row
    cannot say (:func:`leader_lock_holder`)."""
    if row.pid is None:
        return None
    since = row.backend_start
    return LockHolder(
        pid=row.pid,
        application_name=row.application_name,
        client_addr=row.client_addr,
        since=None if since is None else since.astimezone(timezone.utc),
        role=row.usename,
        store_instance=bool(row.store_instance) if store_instance is None else store_instance,
    )


def _holders(rows: Sequence[Any], *, store_instance: bool = False) -> list[LockHolder]:
    return [h for h in (holder_of(r, store_instance=store_instance) for r in rows) if h]


def take_migration_lock(conn: Connection, schema: str, wait: LockWait) -> None:
    """Take ``schema``'s migration lock for ``conn``'s transaction, trying again every
    :data:`MIGRATION_LOCK_POLL` while another session holds it; ``LockHeldError`` after
    ``wait``'s bound."""
    params = {"schema": schema}
    while not conn.execute(st.try_migration_lock, params).scalar():
        # pg_stat_activity is read once per transaction unless told to look again.
        conn.execute(catalog.clear_stats_snapshot)
        wait.held_by(_holders(conn.execute(catalog.migration_lock_holder, params).all()))
        conn.execute(st.pause, {"seconds": MIGRATION_LOCK_POLL})


def lock_tables(conn: Connection, schema: str, wait: LockWait) -> None:
    """Lock the cluster's tables that exist in ``schema`` in ``ACCESS EXCLUSIVE`` mode for
    ``conn``'s transaction, an attempt of :data:`TABLE_LOCK_ATTEMPT` at a time with
    :data:`TABLE_LOCK_PAUSE` between attempts; ``LockHeldError`` naming who held them after
    ``wait``'s bound. Afterwards the transaction's other lock waits are bounded by what
    remains of it."""
    names = tuple(
        name
        for name in st.CLUSTER_TABLES
        if conn.execute(catalog.relation_exists, {"schema": schema, "name": name}).scalar()
    )
    if names:
        statement = st.lock_cluster_tables(schema, conn.dialect, names)
        # Every mode conflicts with ACCESS EXCLUSIVE.
        looking = {"schema": schema, "tables": list(names), "modes": list(catalog.LOCK_MODES)}
        while not _attempt(conn, statement, TABLE_LOCK_ATTEMPT):
            conn.execute(catalog.clear_stats_snapshot)
            wait.held_by(_holders(conn.execute(catalog.table_lock_holders, looking).all()))
            conn.execute(st.pause, {"seconds": TABLE_LOCK_PAUSE})
    conn.execute(st.set_local_lock_timeout, {"ms": _ms(max(wait.remaining, 1.0))})


def _attempt(conn: Connection, statement: Executable, seconds: float) -> bool:
    """Run ``statement`` under a ``lock_timeout`` of ``seconds`` in a savepoint; false (and
    the savepoint undone) if the lock it waited for was still held then."""
    conn.execute(st.savepoint)
    conn.execute(st.set_local_lock_timeout, {"ms": _ms(seconds)})
    try:
        conn.execute(statement)
    except Exception as exc:
        if not lock_not_available(exc):
            raise
        conn.execute(st.rollback_to_savepoint)
        return False
    conn.execute(st.release_savepoint)
    return True


#: Runs a statement with its parameters on the caller's connection, in its transaction.
Execute = Callable[[Executable, dict[str, Any] | None], Awaitable[Result[Any]]]


async def leader_barrier(execute: Execute, schema: str, bound: float, what: str) -> None:
    """:data:`~cronoq_store._statements.leader_barrier` in the caller's transaction, waiting
    at most ``bound`` seconds for the sessions that hold the leader table (commits in
    flight, or any session holding its row); then ``LockHeldError`` naming them. ``what``
    is the call that waits, and where its bound is set, for the error."""
    await execute(st.savepoint, None)
    await execute(st.set_local_lock_timeout, {"ms": _ms(bound)})
    try:
        await execute(st.leader_barrier, None)
    except Exception as exc:
        if not lock_not_available(exc):
            raise
        await execute(st.rollback_to_savepoint, None)
        # The barrier's EXCLUSIVE conflicts with every mode but ACCESS SHARE.
        modes = list(catalog.LOCK_MODES[1:])
        looking = {"schema": schema, "tables": [leader.name], "modes": modes}
        holders = _holders((await execute(catalog.table_lock_holders, looking)).all())
        raise LockHeldError(
            f"{what} gave up after {bound:g} s waiting for the leader table of schema "
            f"{schema!r}, held by {describe_holders(holders)}",
            holders,
        ) from exc
    await execute(st.release_savepoint, None)


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))
