"""The store's own pool (how it connects, what it checks at checkout) and the checks every
pool the store opens on passes first (the database's encoding; behind PgBouncer, the
sessions' ``search_path``).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import URL, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import PoolProxiedConnection

from . import _lock_statements as lock_st
from . import _session_statements as session_st
from . import _statements as st
from . import _transactions as transactions
from ._config import PgStoreConfig, keepalive_settings
from ._driver import translate_error, translate_open_error
from ._errors import StoreError
from ._retry import bounded
from ._schema import schema_options
from ._trust import TrustCheck
from ._urls import engine_arguments, redact

__all__ = [
    "accepts_writes",
    "cluster_identity",
    "demoted",
    "idle_in_transaction_ms",
    "own_engine",
    "require_search_path",
    "require_utf8",
]

logger = logging.getLogger("cronoq_store")


def own_engine(url: str | URL, config: PgStoreConfig) -> AsyncEngine:
    """The engine of a store opened with :meth:`PgStore.connect`: its own pool of
    ``max_connections``, the store's session settings, closed connections replaced at
    checkout."""
    dialled, arguments = engine_arguments(url)
    engine = create_async_engine(
        dialled,
        pool_size=config.max_connections,
        max_overflow=0,
        # No store call waits for a connection longer than a commit may take.
        pool_timeout=config.commit_timeout,
        # Batches carry payloads; errors and logs must not.
        hide_parameters=True,
        # The URL's application_name (or $PGAPPNAME) names the sessions over the config's.
        connect_args={**arguments, **_pool_connect_args(config)},
    )
    event.listen(engine.sync_engine.pool, "checkout", _reject_closed)
    return engine


async def require_utf8(engine: AsyncEngine, where: str, opening: str) -> None:
    """Refuse a database whose encoding is not UTF8, before anything is created in it: every
    string the domain accepts must be storable, and another encoding lacks most characters.
    Read in a transaction opened by ``opening`` (the store's settings)."""

    async def read(conn: AsyncConnection) -> str:
        encoding: str = (await conn.execute(st.server_encoding)).scalar_one()
        return encoding

    try:
        encoding = await transactions.run(engine, opening, read)
    except Exception as exc:
        raise translate_open_error(exc, where, "reading the database's encoding") from exc
    if encoding != "UTF8":
        raise StoreError(
            f"the database at {where} is encoded in {encoding}: cronoq-store needs a UTF8 "
            "database (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )


async def require_search_path(engine: AsyncEngine, where: str) -> None:
    """Refuse pooled sessions whose ``search_path`` is not the store's: without prepared
    statements they come from a transaction-pooling PgBouncer, where the store cannot set
    it per session, and a schema another role can write on it could capture an operator."""
    try:
        async with engine.connect() as conn:
            path = (await conn.execute(session_st.session_search_path)).scalar_one()
    except Exception as exc:
        raise translate_error(exc, "reading the pooled sessions' search_path") from exc
    if [part.strip() for part in path.split(",")] != [
        part.strip() for part in session_st.SEARCH_PATH.split(",")
    ]:
        raise StoreError(
            f"the pooled sessions at {where} run with search_path {path!r}, not "
            f"{session_st.SEARCH_PATH!r}: with prepared_statements=False the store cannot set it "
            "per session; set it for the store's PgBouncer database entry (connect_query = "
            f"'SET search_path = {session_st.SEARCH_PATH}') or for the role (ALTER ROLE ... SET "
            f'search_path = {session_st.SEARCH_PATH}) (docs/reliability.md, "PgBouncer")'
        )


def _pool_connect_args(config: PgStoreConfig) -> dict[str, Any]:
    """How the store's own pool connects: its server settings, or, without prepared
    statements (a transaction-pooling PgBouncer), unnamed statements and no settings but
    ``application_name``, the one such a PgBouncer accepts at connection start."""
    if not config.prepared_statements:
        return {
            # asyncpg then sends every statement unnamed (Parse, Describe and Bind travel
            # before one Sync, so PgBouncer keeps them on one server connection).
            "statement_cache_size": 0,
            "prepared_statement_cache_size": 0,
            "server_settings": {"application_name": config.application_name},
        }
    return {
        "server_settings": {
            "application_name": config.application_name,
            # No schema another role can write is ever on the path (CVE-2018-1058).
            "search_path": session_st.SEARCH_PATH,
            # A leader frozen or cut off between two statements of a commit holds the
            # leader row lock; the server ends such a session, so a takeover waits at most
            # this long for it (the keeper has stepped down by then).
            "idle_in_transaction_session_timeout": str(idle_in_transaction_ms(config)),
            # And one cut off while the server sends or waits on it (keepalive_settings).
            **keepalive_settings(config),
        }
    }


def idle_in_transaction_ms(config: PgStoreConfig) -> int:
    """How long the server lets a transaction of the store sit idle before it ends the
    session: ``session_timeout``, so a takeover waits at most that long for a frozen
    leader's row lock."""
    return round(config.session_timeout * 1000)


def _reject_closed(dbapi_connection: Any, record: Any, proxy: PoolProxiedConnection) -> None:
    """The pool's pre-ping, without a round trip: a pooled connection that the server
    closed (restart, terminated backend, idle timeout) is replaced at checkout.

    asyncpg notices a closed socket as soon as the event loop reads its end, so this catches
    what a ``SELECT 1`` would, three round trips cheaper (the asyncpg dialect pings inside
    ``BEGIN ... ROLLBACK``). A connection that died silently fails its next statement
    instead, with ``UnavailableError``, and is invalidated; commits are idempotent and the
    caller retries.
    """
    driver: Any = proxy.driver_connection
    if driver.is_closed():
        raise DisconnectionError("the server closed this pooled connection")


async def cluster_identity(
    engine: AsyncEngine, schema: str, opening: str
) -> tuple[int | None, int | None, str]:
    """Read at open: the OID of ``schema`` (``None`` if there is none), the cluster's
    incarnation (its leader table's OID, ``None`` without a leader row) and the role the
    pool connects as, in a transaction opened by ``opening`` (the store's settings: a role
    an application left ``SET`` on a borrowed session is not the pool's)."""

    async def read(conn: AsyncConnection) -> tuple[int | None, int | None, str]:
        await conn.execute(session_st.local_search_path)
        oid = (await conn.execute(lock_st.schema_oid, {"schema": schema})).scalar()
        incarnation = None
        if oid is not None:
            found = await conn.execute(st.incarnation, execution_options=schema_options(schema))
            incarnation = found.scalar()
        pool_role = (await conn.execute(TrustCheck.current_user)).scalar_one()
        return oid, incarnation, pool_role

    try:
        return await transactions.run(engine, opening, read)
    except Exception as exc:
        raise translate_error(exc, f"reading the identity of schema {schema!r}") from exc


async def demoted(db: AsyncEngine, *, owned: bool, timeout: float) -> bool:
    """Whether a read-only failure is evidence enough to drop the pool's connections:
    always for the store's own pool (``owned``); for an application's, only if a session
    it hands out is on a server in recovery (a standby)."""
    if owned:
        return True
    try:
        # In the session's own transaction: the store's opening is read-write, which a
        # server in recovery refuses before anything could be asked.
        writable = await bounded(transactions.run(db, None, accepts_writes), timeout)
    except Exception as exc:
        logger.warning(
            "a read-only failure on the application's pool, and the server cannot say "
            "whether it is in recovery: its connections are left alone",
            extra={
                "url": redact(db.url),
                "error": str(translate_error(exc, "checking recovery")),
            },
        )
        return False
    return writable is False


async def accepts_writes(conn: AsyncConnection) -> bool | None:
    """Whether the server ``conn`` reaches takes writes (not in recovery)."""
    writable: bool | None = (await conn.execute(st.accepts_writes)).scalar()
    return writable
