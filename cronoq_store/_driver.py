"""The door to the database: the store's statements compiled for the driver and run on the
asyncpg connection, and every driver failure mapped to the store's errors.

Compiling: a Core statement of :mod:`cronoq_store._statements` becomes the driver's SQL text
for the cluster's schema once (:class:`CompiledStatement`, ``schema_translate_map``
rendered), and runs with asyncpg's prepared-statement cache, without SQLAlchemy's
per-execution work (the commit path, :mod:`cronoq_store._writer`; recovery's cursor).
:class:`Opening` sends ``BEGIN``, session settings and the epoch check as one message.

Mapping: :func:`translate_error` turns any failure into a :class:`~cronoq_store.StoreError`
by SQLSTATE, not exception class (the asyncpg dialect delivers serialization failures,
deadlocks and shutdowns alike as a plain ``DBAPIError``): whether work is retried or
abandoned is decided here. The few driver errors that mean something else than a failure
are read here too: the insert's refusals (:func:`insert_refusal`, :func:`keys_named`), a
connection an error left usable (:func:`leaves_connection_sound`), a session that lost the
driver's prepared statements (:func:`forget_lost_statements`), and a startup setting a
transaction-pooling PgBouncer refused (:func:`translate_open_error`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import ClauseElement
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler

from ._errors import SchemaGoneError, StoreError, UnavailableError
from ._schema import tasks

__all__ = [
    "CLUSTER_REPLACED",
    "CONNECTION_CLASSES",
    "INSERT_REFUSALS",
    "LOCK_NOT_AVAILABLE",
    "PREPARED_STATEMENT_CODES",
    "READ_ONLY",
    "SCHEMA_GONE_CODES",
    "TRANSIENT_CLASSES",
    "TRANSIENT_CODES",
    "UNIQUE_VIOLATION",
    "CompiledStatement",
    "Opening",
    "forget_lost_statements",
    "insert_refusal",
    "keys_named",
    "leaves_connection_sound",
    "lock_not_available",
    "row_count",
    "translate_error",
    "translate_open_error",
]

# --- compiled statements ----------------------------------------------------------------

# A positional parameter of a compiled statement.
_PARAMETER = re.compile(r"\$(\d+)")


@dataclass(frozen=True, slots=True)
class CompiledStatement:
    """A Core statement as the driver's SQL text, with its parameters in positional order."""

    sql: str
    names: tuple[str, ...]
    #: Values the construct carries itself (literals such as the leader row's id).
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, statement: ClauseElement, dialect: Dialect, schema: str) -> CompiledStatement:
        """``statement`` as ``dialect`` renders it for the cluster in ``schema``."""
        compiled = statement.compile(
            dialect=dialect, schema_translate_map={None: schema}, render_schema_translate=True
        )
        if not isinstance(compiled, SQLCompiler):  # DDL: no parameters
            return cls(compiled.string, (), {})
        return cls(compiled.string, tuple(compiled.positiontup or ()), compiled.params)

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The positional arguments: ``values`` by name, the construct's own otherwise."""
        return [values[n] if n in values else self.defaults[n] for n in self.names]

    async def execute(self, conn: Any, values: Mapping[str, Any]) -> str:
        """Run on the asyncpg connection ``conn``; the command tag (``UPDATE 12``)."""
        status: str = await conn.execute(self.sql, *self.args(values))
        return status

    async def fetch(self, conn: Any, values: Mapping[str, Any]) -> Any:
        """Run on ``conn``; every row."""
        return await conn.fetch(self.sql, *self.args(values))

    async def fetchrow(self, conn: Any, values: Mapping[str, Any]) -> Any:
        """Run on ``conn``; the first row."""
        return await conn.fetchrow(self.sql, *self.args(values))

    async def fetchval(self, conn: Any, values: Mapping[str, Any]) -> Any:
        """Run on ``conn``; the first row's first value."""
        return await conn.fetchval(self.sql, *self.args(values))

    async def cursor(self, conn: Any, values: Mapping[str, Any]) -> Any:
        """A server-side cursor on ``conn`` (inside its transaction)."""
        return await conn.cursor(self.sql, *self.args(values))


@dataclass(frozen=True, slots=True)
class Opening:
    """``BEGIN`` and the statements that open a commit's transaction, ending with its epoch
    check, as one simple-protocol message: one round trip instead of one per statement. The
    simple protocol takes no parameters, so the check's (integers only: the epoch, the
    incarnation, the leader row's id) are rendered as literals; any other value is refused.
    :meth:`closing` is the same for the check that ends a transaction, before ``COMMIT``."""

    template: str
    check: CompiledStatement

    @classmethod
    def of(
        cls, check: CompiledStatement, *before: CompiledStatement, begin: str = "BEGIN"
    ) -> Opening:
        if any(statement.names for statement in before):
            raise ValueError("only the epoch check of an opening takes parameters")
        body = _template(check)
        return cls("; ".join([begin, *(statement.sql for statement in before), body]), check)

    @classmethod
    def closing(cls, check: CompiledStatement) -> Opening:
        """``check`` and ``COMMIT`` in one message: a check that fails leaves the
        transaction aborted, and the server skips the ``COMMIT`` after it."""
        return cls(f"{_template(check)}; COMMIT", check)

    def sql(self, values: Mapping[str, Any]) -> str:
        return self.template.format(*map(_integer, self.check.args(values)))


def _template(check: CompiledStatement) -> str:
    """``check``'s text with each ``$n`` a format field, for :meth:`Opening.sql`."""
    if sorted({int(n) for n in _PARAMETER.findall(check.sql)}) != list(
        range(1, len(check.names) + 1)
    ):
        raise ValueError(f"not one placeholder per parameter: {check.sql}")
    escaped = check.sql.replace("{", "{{").replace("}", "}}")
    return _PARAMETER.sub(lambda found: f"{{{int(found.group(1)) - 1}}}", escaped)


def _integer(value: object) -> str:
    """``value`` as an SQL literal, if it is an integer (a bool is not)."""
    if type(value) is not int:
        raise TypeError(f"only integers are rendered into SQL, not {type(value).__name__}")
    return str(value)


# --- driver errors to the store's errors ------------------------------------------------

#: SQLSTATE classes after which a session is gone or going: 08 connection exception, 57P
#: operator intervention (admin shutdown, crash shutdown, cannot connect now, terminated).
CONNECTION_CLASSES = ("08", "57P")
#: SQLSTATE classes of transient failures: the connection classes and 53, insufficient
#: resources (too many connections, out of memory or disk).
TRANSIENT_CLASSES = (*CONNECTION_CLASSES, "53")
#: Lock not available: a ``lock_timeout`` ended a wait, or ``NOWAIT`` found a lock held.
LOCK_NOT_AVAILABLE = "55P03"
#: Transient SQLSTATE codes: 40001 serialization failure, 40P01 deadlock, 55P03 lock not
#: available, 57014 query cancelled (statement timeout).
TRANSIENT_CODES = frozenset({"40001", "40P01", LOCK_NOT_AVAILABLE, "57014"})
#: Read-only transaction. A primary that was demoted to a standby answers this (and
#: "cannot execute ... during recovery"): the connection is in the wrong place.
READ_ONLY = "25006"
#: A named prepared statement missing (26000) or already defined (42P05) on the server: the
#: session was reset under the driver's statement caches (``DISCARD ALL``, ``DEALLOCATE``),
#: or clients share server sessions (a transaction-pooling PgBouncer before 1.21).
PREPARED_STATEMENT_CODES = frozenset({"26000", "42P05"})
#: What this build reads and writes is gone: 42P01 undefined table, 42703 undefined column,
#: 3F000 invalid schema name (a downgrade, or a schema dropped by hand, under the store).
SCHEMA_GONE_CODES = frozenset({"42P01", "42703", "3F000"})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, what it wraps (``orig``) and their causes, each once.

    ``__context__`` is not followed: an error raised while handling a transient one (a bug
    in a cleanup path, say) must not inherit its transience.
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for nxt in (getattr(current, "orig", None), current.__cause__):
            if isinstance(nxt, BaseException):
                todo.append(nxt)


def _sqlstates(exc: BaseException) -> list[str]:
    states = []
    for e in _chain(exc):
        code = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
        if isinstance(code, str):
            states.append(code)
    return states


# asyncpg's own encoding errors quote the offending value: "invalid input for query argument
# $1: 'the value' (reason)". The value is a parameter and must not reach a message.
_BAD_ARGUMENT = re.compile(
    r"(invalid input for query argument \$\d+(?: in element #\d+ of \w+\(\) sequence)?): "
)
# SQLAlchemy's pointer to its error documentation: noise in a log line.
_BACKGROUND = re.compile(r"\s*\(Background on this error at: [^)]*\)")
# The driver saying that the connection is gone (no SQLSTATE: the server never said a word).
_CLOSED = ("connection is closed", "connection was closed")
# asyncpg's protocol out of step with the server ("cannot switch to state 12; another
# operation (2) is in progress"): seen when a shutdown or a terminated backend reaches an
# idle pooled connection, which is then handed out before its socket is seen closed. Misuse
# (a connection shared by two coroutines) is an InterfaceError instead; this one means the
# session is unusable, and a new one may well work.
_PROTOCOL_BROKEN = asyncpg.InternalClientError


def _describe(exc: BaseException) -> str:
    """A one-line description without SQL text or bound parameters (which can be huge)."""
    inner = exc
    if isinstance(exc, sa_exc.StatementError) and exc.orig is not None:
        inner = exc.orig
        # The dialect's adapter exception wraps the asyncpg one as its cause.
        if inner.__cause__ is not None and str(inner.__cause__):
            inner = inner.__cause__
    text = str(inner).strip()
    bad_argument = _BAD_ARGUMENT.match(text)
    if bad_argument is not None:
        value = text[bad_argument.end() : text.rfind(" (")].strip("'\"")
        reason = inner.__cause__
        text = bad_argument.group(1)
        if reason is not None:
            # The encoder's reason, unless it quotes the value too.
            said = "" if value in str(reason) else f": {reason}"
            text += f" ({type(reason).__name__}{said})"
    text = _BACKGROUND.sub("", text.splitlines()[0] if text else "")
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def translate_error(exc: BaseException, action: str) -> StoreError:
    """Map any failure of ``action`` to a :class:`StoreError`; the caller raises it ``from exc``.

    Transient (``UnavailableError``): lost or refused connections, pool exhaustion, timeouts,
    SQLSTATE classes 08, 53, 57P and codes 40001, 40P01, 55P03, 57014, and a read-only
    server (25006, with ``reconnect``), and a driver protocol out of step with a session the
    server ended (asyncpg's ``InternalClientError``). Everything else is a ``StoreError``,
    including driver misuse that merely looks like a connection problem (asyncpg's
    ``InterfaceError`` for a wrong argument count or a busy connection). A named prepared
    statement missing or taken (26000, 42P05) reaches this only when it was not a reset of
    the session (:func:`forget_lost_statements`): a permanent ``StoreError`` saying what
    shares the session and which settings avoid it. A table, column or schema missing (42P01,
    42703, 3F000) is a :class:`SchemaGoneError`. Store errors pass through unchanged.

    Cancellation is not a failure: let ``asyncio.CancelledError`` propagate untranslated.
    """
    if isinstance(exc, StoreError):
        return exc
    description = _describe(exc)
    message = f"{action} failed: {description}"
    states = _sqlstates(exc)
    if READ_ONLY in states or "during recovery" in description:
        return UnavailableError(message, reconnect=True)
    if any(s.startswith(TRANSIENT_CLASSES) or s in TRANSIENT_CODES for s in states):
        return UnavailableError(message)
    if any(s in SCHEMA_GONE_CODES for s in states):
        return SchemaGoneError(
            f"{message}; the cluster's schema lacks tables or columns this build uses "
            "(downgraded or dropped while in use?): this instance must not write to it; "
            "run `cronoq-store migrate` before any instance leads it again"
        )
    if any(s in PREPARED_STATEMENT_CODES for s in states):
        return StoreError(
            f"{message}; the connection's prepared statements vanish, and not by a reset of "
            "its session (the server session under it changed, or they vanished again right "
            "after the store made them anew): something hands its statements to more than "
            "one server session. A transaction-pooling proxy (PgBouncer before 1.21 is one) "
            "needs PgStoreConfig(prepared_statements=False) and, with from_engine, an engine "
            'with connect_args={"statement_cache_size": 0, "prepared_statement_cache_size": 0} '
            '(docs/reliability.md, "PgBouncer")'
        )
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return UnavailableError(message)
    if isinstance(exc, (sa_exc.TimeoutError, asyncio.TimeoutError, OSError)):
        return UnavailableError(message)
    if any(closed in str(e) for e in _chain(exc) for closed in _CLOSED):
        return UnavailableError(message)
    if any(isinstance(e, _PROTOCOL_BROKEN) for e in _chain(exc)):
        return UnavailableError(message)
    return StoreError(message)


def translate_open_error(exc: BaseException, where: str, action: str) -> StoreError:
    """:func:`translate_error` for the first statement on a new pool: a peer that refused
    the store's session settings at startup is a transaction-pooling PgBouncer, and the
    error says what to configure instead."""
    refused = _refused_setting(exc)
    if refused is None:
        return translate_error(exc, action)
    return StoreError(
        f"the server at {where} refused the store's session settings ({refused}): "
        "a transaction-pooling PgBouncer does; open the store with "
        "PgStoreConfig(prepared_statements=False) and lock_url= a direct URL to the "
        'server (docs/reliability.md, "PgBouncer")'
    )


def _refused_setting(exc: BaseException) -> str | None:
    """What the peer said when it refused a startup parameter, as PgBouncer does with
    ``search_path`` and every other setting it does not track; ``None`` for other errors."""
    orig = getattr(exc, "orig", exc)
    found = re.search(r"unsupported startup parameter: \S+", str(orig))
    if getattr(orig, "sqlstate", None) != "08P01" or found is None:
        return None
    return found[0]


# --- a commit's refusals ----------------------------------------------------------------

#: What a commit transaction's closing check raises when the schema's name leads to another
#: cluster than the store's (``statements.incarnation_kept``: 22P02, a text that is no
#: integer). No other statement of the closing message can raise it.
CLUSTER_REPLACED = asyncpg.InvalidTextRepresentationError

# --- the insert's refusals --------------------------------------------------------------

#: A unique index refused a row: a stored id or a taken live key (COPY, which has no
#: conflict rule), or a taken live key (:func:`keys_named`).
UNIQUE_VIOLATION = asyncpg.UniqueViolationError
#: The driver errors of an insert that :func:`insert_refusal` may explain.
INSERT_REFUSALS = (asyncpg.NotNullViolationError, UNIQUE_VIOLATION)
# The unique index on live keys (see :func:`insert_refusal`).
_LIVE_KEY_INDEX = next(index.name for index in tasks.indexes if index.unique)
# The server's detail for a violation of it: the key as text.
_KEY_DETAIL = re.compile(r"Key \(key\)=\((.*)\) already exists\.", re.DOTALL)


def lock_not_available(exc: BaseException) -> bool:
    """Whether ``exc`` (as SQLAlchemy or asyncpg raise it) is only a lock wait that ran out
    of ``lock_timeout`` (55P03): the session answered, and is sound; a waiter then names
    who holds the lock (:mod:`cronoq_store._lock_waits`)."""
    return LOCK_NOT_AVAILABLE in _sqlstates(exc)


def insert_refusal(exc: asyncpg.PostgresError) -> bool:
    """Whether the insert's failure is one the writer explains (an id held by another task,
    a live key held by another live task) rather than an error to raise: the insert's
    signal (:func:`_stored_id`) or a violation of the unique index of live keys."""
    if isinstance(exc, asyncpg.NotNullViolationError):
        return _stored_id(exc)
    constraint: str | None = exc.constraint_name
    return constraint == _LIVE_KEY_INDEX


def keys_named(exc: asyncpg.UniqueViolationError) -> list[str]:
    """The key the server names in a live-key violation ("Key (key)=(k) already exists.")."""
    detail: str | None = exc.detail
    found = _KEY_DETAIL.fullmatch(detail or "")
    return [] if found is None else [found.group(1)]


def _stored_id(exc: asyncpg.NotNullViolationError) -> bool:
    """Whether ``exc`` is the insert's signal that a stored row holds one of its ids
    (``statements._insert_from``)."""
    table: str | None = exc.table_name
    column: str | None = exc.column_name
    return table == tasks.name and column == "seq"


def leaves_connection_sound(exc: BaseException, driver: Any) -> bool:
    """Whether the asyncpg connection ``driver`` is usable after ``exc``: a server's error
    that is not about the session (asyncpg rolled the transaction back), on a connection
    that is open and out of any transaction."""
    return (
        isinstance(exc, asyncpg.PostgresError)
        and not exc.sqlstate.startswith(CONNECTION_CLASSES)
        and not driver.is_closed()
        and not driver.is_in_transaction()
    )


async def forget_lost_statements(exc: BaseException, pooled: PoolProxiedConnection) -> bool:
    """Whether ``exc`` says that the session of ``pooled`` was reset under the driver's
    prepared statements, on a connection otherwise sound (open, out of any transaction);
    if so, the driver's and SQLAlchemy's statement caches of that connection are emptied,
    so that every statement is prepared anew on its next use.

    An application that shares its pool with the store may reset a session between two
    checkouts (``DISCARD ALL``, ``DEALLOCATE``): both caches then name statements the server
    no longer has (26000), or a name the session already holds (42P05). The server refused
    the statement before running it, and the refusal failed the transaction it was in, so
    the work that met it wrote nothing and may run again on the same connection.
    SQLAlchemy's asyncpg adapter keeps its own cache (``prepared_statement_cache_size``);
    it offers no call to empty it, so its attribute is read, where present.

    A transaction-pooling proxy (PgBouncer before 1.21) loses statements too, by handing
    each transaction to any of its server sessions, where another process's statement may
    bear the same name. That is no reset, and is not recovered from: the server session
    under the connection (its backend pid) is read at each loss, and one that changed
    since the previous loss means ``False``.
    """
    driver: Any = pooled.driver_connection
    if not any(s in PREPARED_STATEMENT_CODES for s in _sqlstates(exc)):
        return False
    if driver.is_closed() or driver.is_in_transaction():
        return False
    cache = getattr(pooled.dbapi_connection, "_prepared_statement_cache", None)
    if cache is not None:
        cache.clear()
    # asyncpg's own cache (and its type cache, which is read again on demand).
    await driver.reload_schema_state()
    try:
        # In a transaction: a transaction-pooling proxy keeps both of the query's messages
        # (its statement made, then run) on one server session. The session's own timeout
        # is the application's: not this question's.
        async with driver.transaction():
            await driver.execute("SET LOCAL statement_timeout TO DEFAULT")
            backend: int = await driver.fetchval(_BACKEND_PID)
    except Exception:
        return False  # the session cannot say which it is: the loss is raised as it is
    first: int = pooled.info.setdefault(_BACKEND_INFO, backend)
    return first == backend


# The server session's own backend pid, and where a connection keeps the one it had at its
# first loss of prepared statements (SQLAlchemy's info of the DBAPI connection).
_BACKEND_PID = "SELECT pg_catalog.pg_backend_pid()"
_BACKEND_INFO = "cronoq_store.backend_pid"


def row_count(status: str) -> int:
    """The row count of a command tag such as ``UPDATE 12``."""
    return int(status.rpartition(" ")[2])
