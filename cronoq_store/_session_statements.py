"""What the store's transactions set on a session: the one ``search_path``, the opening of
a transaction on a session the store does not own (an application's engine, a
transaction-pooling PgBouncer), which sets the store's settings for that transaction alone,
and how long a transaction may sit idle.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Text,
    bindparam,
    case,
    func,
    literal_column,
    not_,
    select,
    text,
    true,
)

__all__ = [
    "IDLE_LIMIT_MS",
    "SEARCH_PATH",
    "borrowed_transaction",
    "current_user",
    "local_search_path",
    "session_search_path",
    "set_local_search_path",
    "store_transaction",
]

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

#: The role the session runs as: who a trust check ran as, the role a pool connects as.
current_user = select(func.current_user())

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
