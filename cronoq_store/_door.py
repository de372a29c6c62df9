"""The door to the database, the one module that touches the driver: it makes every engine
the store uses and checks every pool at open, holds the commits' connection, opens and ends the
store's transactions, runs statements compiled for asyncpg, waits for locks with a bound,
and maps every driver failure to the store's errors.

Compiling: a Core statement of :mod:`cronoq_store._statements` becomes the driver's SQL text
for the cluster's schema once (:class:`CompiledStatement`, ``schema_translate_map``
rendered), and runs with asyncpg's prepared-statement cache, without SQLAlchemy's
per-execution work (the commit path, :mod:`cronoq_store._commit_path`; recovery's cursor).
:class:`Opening` sends ``BEGIN``, session settings and the epoch check as one message.

Mapping: :func:`translate_error` turns any failure into a :class:`~cronoq_store.StoreError`
by SQLSTATE, not exception class (the asyncpg dialect delivers serialization failures,
deadlocks and shutdowns alike as a plain ``DBAPIError``): whether work is retried or
abandoned is decided here. The few driver errors that mean something else than a failure are
read here too: the insert's refusals (:class:`InsertRefused`), the closing check's finding
of another cluster (:class:`ClusterMoved`), a connection an error left usable
(:func:`leaves_connection_sound`), a session that lost the driver's prepared statements
(:func:`forget_lost_statements`), a startup setting a transaction-pooling PgBouncer refused
(:func:`translate_open_error`), and a lock wait that ran out, for the callers that answer it
(:class:`LockNotAvailable`).

Engines: every engine the store makes is made here, by the same rules (no bound parameter
in an error's text, TLS and libpq's parameters read from the URL, connecting bounded):
the store's own pool (:func:`own_engine`), the leader lock session's (:func:`lock_engine`,
or :func:`borrowed_lock_engine` on an application's pool), Alembic's
(:func:`migration_engine`) and the commands' and console's (:func:`command_engine`).

Connections: :class:`HeldConnection` keeps the commits' connection between commits and
gives it up when in doubt; :func:`run_transaction` is a store transaction on a pooled
session, own or borrowed; the open checks (:func:`require_utf8`,
:func:`require_search_path`, :func:`cluster_identity`) run on any pool.

Lock waits: opening a store, migrating and pruning wait for locks another session holds
only on the way to their work, so each wait has a bound; past it the call raises
:class:`~cronoq_store.LockHeldError` naming the holders (pid, role, application name, since
when), with nothing changed. While it waits, :class:`LockWait` logs who it waits behind: at
INFO when the wait starts (two instances opening at once is ordinary), then at WARNING every
:data:`REPORT_INTERVAL`.

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

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import re
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from types import MappingProxyType, TracebackType
from typing import Any, Protocol, TypeVar, cast

import asyncpg
from sqlalchemy import URL, ClauseElement, Connection, Executable, Result, event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool, Pool, PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.util import await_, greenlet_spawn

from . import _catalog as catalog
from . import _statements as st
from ._config import PgStoreConfig, keepalive_settings
from ._errors import (
    LockHeldError,
    MigrationError,
    SchemaGoneError,
    StoreError,
    UnavailableError,
    UnsupportedParameterError,
)
from ._results import LockHolder
from ._retry import bounded
from ._schema import leader, schema_options, tasks
from ._urls import ConnectParameters, redact, resolve

__all__ = [
    "CONNECTION_CLASSES",
    "CONNECT_TIMEOUT",
    "LOCK_NOT_AVAILABLE",
    "LOCK_SESSION_CLOSE_TIMEOUT",
    "POOL_CONNECT_TIMEOUT",
    "PREPARED_STATEMENT_CODES",
    "READ_ONLY",
    "REPORT_INTERVAL",
    "SCHEMA_GONE_CODES",
    "TABLE_LOCK_ATTEMPT",
    "TRANSIENT_CLASSES",
    "TRANSIENT_CODES",
    "ClusterMoved",
    "CommitConnection",
    "CompiledStatement",
    "Dialer",
    "DriverConnection",
    "DriverCursor",
    "HeldConnection",
    "InsertRefused",
    "LeaderRow",
    "LockNotAvailable",
    "LockSession",
    "LockWait",
    "Opening",
    "RowsStatement",
    "accepts_writes",
    "borrowed_lock_engine",
    "closing_message",
    "cluster_identity",
    "command_engine",
    "demoted",
    "describe_holders",
    "engine_arguments",
    "executing",
    "forget_lost_statements",
    "holder_of",
    "idle_in_transaction_ms",
    "leader_barrier",
    "leaves_connection_sound",
    "lock_engine",
    "lock_tables",
    "migration_engine",
    "opening_message",
    "own_engine",
    "partitions",
    "refuse_ignored_parameters",
    "refused_statement",
    "require_search_path",
    "require_utf8",
    "row_count",
    "run_transaction",
    "separating_lock_waits",
    "take_migration_lock",
    "translate_error",
    "translate_open_error",
    "translated",
]


logger = logging.getLogger("cronoq_store")

_T = TypeVar("_T")

# --- compiled statements ----------------------------------------------------------------

# A positional parameter of a compiled statement.
_PARAMETER = re.compile(r"\$(\d+)")


class DriverCursor(Protocol):
    """A server-side cursor of the driver, read a part at a time (recovery's live tasks)."""

    async def fetch(self, n: int, *, timeout: float | None = None) -> list[Any]: ...


class DriverConnection(Protocol):
    """An asyncpg connection, as the door calls it: statements run, rows copied in, its state
    read, its socket dropped. asyncpg ships no types, so to mypy its connection is ``Any``;
    naming what the door calls lets mypy refuse anything else in its place (a SQLAlchemy
    connection, or a pooled one not unwrapped)."""

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str: ...

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> list[Any]: ...

    async def fetchrow(self, query: str, *args: Any, timeout: float | None = None) -> Any: ...

    async def fetchval(
        self, query: str, *args: Any, column: int = 0, timeout: float | None = None
    ) -> Any: ...

    def cursor(
        self, query: str, *args: Any, prefetch: int | None = None, timeout: float | None = None
    ) -> Awaitable[DriverCursor]: ...

    async def copy_records_to_table(
        self,
        table_name: str,
        *,
        records: Iterable[Sequence[Any]],
        columns: Sequence[str] | None = None,
        schema_name: str | None = None,
        timeout: float | None = None,
    ) -> str: ...

    def is_closed(self) -> bool: ...

    def is_in_transaction(self) -> bool: ...

    def terminate(self) -> None: ...


@dataclass(frozen=True, slots=True)
class CompiledStatement:
    """A Core statement as the driver's SQL text, with its parameters in positional order."""

    sql: str
    names: tuple[str, ...]
    #: Values the construct carries itself (literals such as the leader row's id).
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, statement: ClauseElement, dialect: Dialect, schema: str) -> CompiledStatement:
        """``statement`` as ``dialect`` renders it for the cluster in ``schema``.

        SQLAlchemy's compiler runs once per statement and dialect, whatever the schema
        (:func:`_schema_neutral`); each schema costs a substitution of its quoted name,
        as SQLAlchemy itself renders a ``schema_translate_map`` at execution. A commit
        path's statements cost tens of milliseconds to compile, and a process may open
        thousands of clusters."""
        neutral = _schema_neutral(statement, dialect)
        quote = dialect.identifier_preparer.quote_schema
        sql = _SCHEMA_TOKEN.sub(lambda m: quote(schema if m[1] == "_none" else m[1]), neutral.sql)
        return cls(sql, neutral.names, neutral.defaults)

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The positional arguments: ``values`` by name, the construct's own otherwise."""
        return [values[n] if n in values else self.defaults[n] for n in self.names]

    async def cursor(self, conn: DriverConnection, values: Mapping[str, Any]) -> DriverCursor:
        """A server-side cursor on ``conn`` (inside its transaction)."""
        return await conn.cursor(self.sql, *self.args(values))


@dataclass(frozen=True, slots=True)
class RowsStatement:
    """A compiled statement whose leading parameters are rows of values, row after row (a
    ``VALUES`` list), and the rest named: its arguments are the rows' values as they are,
    with no look-up by name per value (a batch of 31 new tasks has 775). A statement that
    skips a ``filler`` row takes fewer rows than it has: the others are that row."""

    compiled: CompiledStatement
    count: int
    #: The parameters after the rows', by name.
    named: tuple[str, ...]
    filler: tuple[Any, ...] | None = None

    @classmethod
    def of(
        cls,
        compiled: CompiledStatement,
        row_names: Sequence[str],
        count: int,
        filler: tuple[Any, ...] | None = None,
    ) -> RowsStatement:
        """``compiled``, whose first parameters must be ``row_names`` (``count`` rows'), in
        that order: else ``ValueError``, at construction rather than as values bound to the
        wrong columns."""
        lead = len(row_names)
        if tuple(row_names) != compiled.names[:lead]:
            raise ValueError(
                f"the statement's first {lead} parameters are not its {count} rows' values in order"
            )
        if filler is not None and len(filler) * count != lead:
            raise ValueError(f"a filler row of {len(filler)} values for rows of {lead // count}")
        return cls(compiled, count, compiled.names[lead:], filler)

    def args(self, rows: Sequence[Sequence[Any]], values: Mapping[str, Any]) -> list[Any]:
        """The positional arguments: the values of ``rows`` (:attr:`count` of them, or
        fewer with a filler), then the named parameters from ``values``, else the
        construct's own."""
        missing, filler = self.count - len(rows), self.filler
        if missing < 0 or (missing and filler is None):
            raise ValueError(f"the statement takes {self.count} rows, not {len(rows)}")
        args = list(itertools.chain.from_iterable(rows))
        if missing and filler is not None:
            args.extend(filler * missing)
        defaults = self.compiled.defaults
        args.extend(values[n] if n in values else defaults[n] for n in self.named)
        return args


# The compiler's mark of a table's schema where a ``schema_translate_map`` applies (the
# default schema's is ``_none``), put in place by :meth:`CompiledStatement.of`.
_SCHEMA_TOKEN = re.compile(r"__\[SCHEMA_([^\]]+)\]")
# Statements compiled with the marks in, by statement and what the compiler reads of the
# dialect; bounded, oldest use first out (the package's statements are a few dozen).
_NEUTRAL: OrderedDict[tuple[object, ...], CompiledStatement] = OrderedDict()
_NEUTRAL_MAX = 1024
_NEUTRAL_LOCK = threading.Lock()


def _schema_neutral(statement: ClauseElement, dialect: Dialect) -> CompiledStatement:
    """``statement`` compiled by ``dialect`` for any schema: the schema marks left in."""
    key = (statement, type(dialect), dialect.paramstyle, dialect.server_version_info)
    with _NEUTRAL_LOCK:
        found = _NEUTRAL.get(key)
        if found is not None:
            _NEUTRAL.move_to_end(key)
            return found
    compiled = statement.compile(
        dialect=dialect, schema_translate_map={None: None}, render_schema_translate=False
    )
    if isinstance(compiled, SQLCompiler):
        positions = tuple(compiled.positiontup or ())
        found = CompiledStatement(compiled.string, positions, MappingProxyType(compiled.params))
    else:  # DDL: no parameters
        found = CompiledStatement(compiled.string, (), MappingProxyType({}))
    with _NEUTRAL_LOCK:
        _NEUTRAL[key] = found
        if len(_NEUTRAL) > _NEUTRAL_MAX:
            _NEUTRAL.popitem(last=False)
    return found


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

    @classmethod
    def checking(cls, check: CompiledStatement) -> Opening:
        """``check`` alone: one of several joined before one ``COMMIT``, where commits of
        several clusters share a transaction (:func:`closing_message`)."""
        return cls(_template(check), check)

    def sql(self, values: Mapping[str, Any]) -> str:
        return self.template.format(*map(_integer, self.check.args(values)))


def closing_message(checks: Sequence[str]) -> str:
    """The message that ends a transaction shared by several commits: each one's closing
    check (:meth:`Opening.checking`, rendered), then ``COMMIT``; the first check that fails
    leaves the transaction aborted, and the server skips the rest."""
    return "; ".join([*checks, "COMMIT"])


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


class translated:
    """The way through the door for work on a connection of its own (the CLI's, the
    console's, Alembic's, a migration's, the lock session's), as ``async with`` or ``with``
    (Alembic's environment, a command's ``asyncio.run``): any failure inside leaves as the
    :class:`StoreError` :func:`translate_error` makes of it, raised ``from`` the failure;
    the errors of ``passing`` (the caller's own, which it handles) as they are.

    Only an ``Exception`` is translated: a cancellation or an interrupt is no failure.
    """

    __slots__ = ("_action", "_passing")

    def __init__(self, action: str, *, passing: tuple[type[Exception], ...] = ()) -> None:
        self._action = action
        self._passing = passing

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not isinstance(exc, Exception) or isinstance(exc, self._passing):
            return
        error = translate_error(exc, self._action)
        if error is not exc:
            raise error from exc

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, traceback)


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


class InsertRefused(Exception):
    """An insert the commit path explains instead of failing: an id a stored task holds (the
    insert's signal, :func:`_stored_id`) or a live key another live task holds (the unique
    index of live keys); from a COPY, which has no conflict rule, any unique index's
    refusal. ``unique``: a unique index refused it; ``keys``: the live key the server
    named, if it named one (:func:`_keys_named`). Raised ``from`` the driver's error."""

    def __init__(self, *, unique: bool, keys: list[str]) -> None:
        super().__init__("an insert was refused: an id or a live key is another task's")
        self.unique = unique
        self.keys = keys


class ClusterMoved(Exception):
    """A commit transaction's closing check found the schema's name leading to another
    cluster than the store's: ``found`` is that cluster's leader table OID, ``None`` where
    the schema has no leader table. Nothing was committed."""

    def __init__(self, found: int | None) -> None:
        super().__init__(f"the schema holds another cluster (leader table {found})")
        self.found = found


#: What the closing check raises when the schema's name leads to another cluster
#: (``statements.incarnation_kept``: 22P02, a text that is no integer, naming what it
#: found). No other statement of the closing message can raise it.
_CLUSTER_REPLACED = asyncpg.InvalidTextRepresentationError
_FOUND_INCARNATION = re.compile(r"its leader table is now (\d+|missing)")
#: A unique index refused a row: a stored id or a taken live key (COPY, which has no
#: conflict rule), or a taken live key (:func:`_keys_named`).
_UNIQUE_VIOLATION = asyncpg.UniqueViolationError
#: The driver errors of an insert that :func:`_explained` may explain.
_INSERT_REFUSALS = (asyncpg.NotNullViolationError, _UNIQUE_VIOLATION)
# The unique index on live keys (see :func:`_explained`).
_LIVE_KEY_INDEX = next(index.name for index in tasks.indexes if index.unique)
# The server's detail for a violation of it: the key as text.
_KEY_DETAIL = re.compile(r"Key \(key\)=\((.*)\) already exists\.", re.DOTALL)


def lock_not_available(exc: BaseException) -> bool:
    """Whether ``exc`` (as SQLAlchemy or asyncpg raise it) is only a lock wait that ran out
    of ``lock_timeout`` (55P03): the session answered, and is sound; a waiter then names
    who holds the lock (:mod:`cronoq_store._door`)."""
    return LOCK_NOT_AVAILABLE in _sqlstates(exc)


class LockNotAvailable(UnavailableError):
    """A lock wait that ran out of ``lock_timeout`` (55P03), told apart from other failures
    for a caller that waits on purpose and answers it: the keeper's check
    (:meth:`LockSession.check_leader`), a command's statements
    (:func:`separating_lock_waits`). Those callers handle it, so an application never sees
    it: to everyone else the same failure is a plain ``UnavailableError``, with the same
    message."""


@asynccontextmanager
async def separating_lock_waits(action: str) -> AsyncIterator[None]:
    """Within, a failure of ``action`` that is only a lock wait run out of ``lock_timeout``
    (raw, or already translated) leaves as :class:`LockNotAvailable`, with the message
    :func:`translate_error` gives it, raised ``from`` the failure. Every other failure
    leaves as it came, and so does a ``LockHeldError`` (which names the holders already)."""
    try:
        yield
    except (LockHeldError, LockNotAvailable):
        raise
    except Exception as exc:
        if not lock_not_available(exc):
            raise
        raise LockNotAvailable(str(translate_error(exc, action))) from exc


def _explained(exc: asyncpg.PostgresError) -> bool:
    """Whether an insert's failure is one the commit path explains (an id held by another
    task, a live key held by another live task) rather than an error to raise: the insert's
    signal (:func:`_stored_id`) or a violation of the unique index of live keys."""
    if isinstance(exc, asyncpg.NotNullViolationError):
        return _stored_id(exc)
    constraint: str | None = exc.constraint_name
    return constraint == _LIVE_KEY_INDEX


def _refused(exc: asyncpg.PostgresError) -> InsertRefused:
    return InsertRefused(
        unique=isinstance(exc, _UNIQUE_VIOLATION),
        keys=_keys_named(exc) if isinstance(exc, _UNIQUE_VIOLATION) else [],
    )


def _keys_named(exc: asyncpg.UniqueViolationError) -> list[str]:
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


def refused_statement(exc: BaseException) -> bool:
    """Whether ``exc``, raised by one commit's statement, is the server refusing that
    statement (an insert's refusal the commit path explains, a value or a table it does
    not take), which the commit alone would meet too: in a transaction several clusters'
    commits share (the host's commit bus), that commit's own error, not the others'. Not
    such a refusal: a session lost or failing, a transient failure (a lock wait, a
    deadlock, a cancelled statement), or a prepared statement the session lost (the whole
    transaction runs again then, :func:`forget_lost_statements`)."""
    if isinstance(exc, InsertRefused):
        return True
    if isinstance(translate_error(exc, "committing a batch"), UnavailableError):
        return False
    return not any(s in PREPARED_STATEMENT_CODES for s in _sqlstates(exc))


def leaves_connection_sound(exc: BaseException, driver: DriverConnection) -> bool:
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
    # The commit bus's named statements and staging table (CommitConnection.named).
    _NAMED.pop(driver, None)
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


# --- the commits' connection --------------------------------------------------------


class HeldConnection:
    """The commits' connections from ``engine``'s pool.

    ``hold``: keep one pooled connection checked out between commits (for the whole
    term) instead of a checkout and a return per commit, which cost a greenlet switch each
    and the pool's bookkeeping. One commit at a time uses it; a concurrent one checks out
    another as before. It is given up, never reused, when in doubt (as any connection of a
    failed commit), when the server closed it, or when the pool it came from was disposed
    (a demoted primary); and returned by :meth:`release` (``PgStore`` calls it at close,
    ``release_leadership``, fencing, the first commit refused after a lost term, and
    ``acquire_leadership``: a standby holds none, a new term takes a fresh one).
    """

    def __init__(self, engine: AsyncEngine, *, hold: bool = False) -> None:
        self._engine = engine
        self._hold = hold
        self._held: PoolProxiedConnection | None = None
        self._held_driver: DriverConnection | None = None  # the held one's, read once
        self._held_from: Pool | None = None  # the pool it came from
        self._held_busy = False
        self._releases = 0  # a connection checked out before a release is not held

    @property
    def held(self) -> PoolProxiedConnection | None:
        """The connection kept between commits, if any."""
        return self._held

    async def release(self) -> None:
        """Return the held connection to the pool (a commit using it returns it when done);
        a later commit holds one again."""
        held, busy = self._held, self._held_busy
        self._drop_held()
        self._releases += 1
        if held is not None and not busy:
            if self._held_from is not self._engine.sync_engine.pool:
                # Its pool was disposed (a demoted primary): it would stay open there.
                _asyncpg_of(held).terminate()
                held.invalidate()
            await greenlet_spawn(held.close)

    def _drop_held(self) -> None:
        self._held, self._held_driver, self._held_busy = None, None, False

    async def run(self, work: Callable[[CommitConnection], Awaitable[_T]]) -> _T:
        """``work`` on a pooled connection's driver connection (the commit path's
        ``BatchWriter``), and once more on the same one if its session had lost prepared
        statements the driver made on it (:func:`forget_lost_statements`).

        Running the commit again is safe: the statement the server did not find failed the
        transaction it was in, or was the transaction, so the attempt wrote nothing; and
        commits are idempotent besides (a batch that landed changes nothing the second
        time). A second loss in a row is raised: the statements were just made anew, so
        something else than a reset shares the session (a transaction pooler).

        SQLAlchemy does not see what runs on the driver connection, so one that may be
        left in doubt (closed, still in a transaction, or interrupted by a timeout or a
        driver error) is invalidated here instead of going back to the pool. A server's
        error leaves it usable: asyncpg rolled the transaction back. With ``hold``, a sound
        connection is kept as the held one when none is (and none was released meanwhile).
        Written without a context manager: this is every commit's way to the driver.
        """
        pool, releases = self._engine.sync_engine.pool, self._releases
        pooled, driver = self._held, self._held_driver
        if pooled is None or driver is None or self._held_busy:
            pooled = await self._engine.raw_connection()
            driver = _asyncpg_of(pooled)
        elif self._held_from is pool and not driver.is_closed():
            self._held_busy = True
        else:
            # What the pool's checkout check would refuse, or a connection of a pool
            # disposed since (a demoted primary): discarded, never reused.
            self._drop_held()
            driver.terminate()
            pooled.invalidate()
            await greenlet_spawn(pooled.close)
            pooled = await self._engine.raw_connection()
            driver = _asyncpg_of(pooled)
        sound = False
        try:
            result = await self._attempts(work, pooled, driver)
            sound = True
            return result
        except BaseException as exc:
            if leaves_connection_sound(exc, driver):
                sound = True
            else:
                if pooled is self._held:
                    self._drop_held()
                # Close the socket first: a graceful close waits for the operation in
                # progress and fails ("another operation is in progress") after a timeout
                # or cancellation, which would mask the error being raised.
                driver.terminate()
                pooled.invalidate()
            raise
        finally:
            if pooled is self._held:
                self._held_busy = False
            elif sound and self._hold and self._held is None and self._releases == releases:
                self._held, self._held_driver, self._held_from = pooled, driver, pool
            else:
                if sound and pool is not self._engine.sync_engine.pool:
                    # Its pool was disposed meanwhile (close(), a demoted primary): returned
                    # there, it would stay open, never handed out nor closed.
                    driver.terminate()
                    pooled.invalidate()
                # Back to the pool (or, invalidated, discarded). Inside a greenlet, because
                # the pool's reset-on-return may call the driver; it has nothing to roll back.
                await greenlet_spawn(pooled.close)

    @staticmethod
    async def _attempts(
        work: Callable[[CommitConnection], Awaitable[_T]],
        pooled: PoolProxiedConnection,
        driver: DriverConnection,
    ) -> _T:
        """``work`` on ``driver``, and again once its session's lost statements are
        forgotten (:meth:`run`)."""
        conn = CommitConnection(driver)
        try:
            return await work(conn)
        except Exception as exc:
            if not await forget_lost_statements(exc, pooled):
                raise
        try:
            return await work(conn)
        except Exception as exc:
            # Left with no stale statement either way.
            await forget_lost_statements(exc, pooled)
            raise


def _asyncpg_of(pooled: PoolProxiedConnection) -> DriverConnection:
    """The asyncpg connection under a pooled one (the store's engines are asyncpg's)."""
    return cast(DriverConnection, pooled.driver_connection)


class CommitConnection:
    """The driver connection a commit runs on, as the door lends it to the commit path
    (:class:`~cronoq_store._commit_path.BatchWriter`, through :meth:`HeldConnection.run`):
    compiled statements run, the transaction's messages sent (its opening and closing,
    :class:`Opening`), new tasks copied in, and a failed transaction rolled back. Nothing
    else of the driver is reachable from it."""

    __slots__ = ("_driver",)

    def __init__(self, driver: DriverConnection) -> None:
        self._driver = driver

    async def fetchrow(self, statement: CompiledStatement, values: Mapping[str, Any]) -> Any:
        """Run ``statement``; its first row. :class:`InsertRefused` for an insert's
        refusal the commit path explains."""
        return await self._fetchrow(statement.sql, statement.args(values))

    async def fetchrow_rows(
        self, statement: RowsStatement, rows: Sequence[Sequence[Any]], values: Mapping[str, Any]
    ) -> Any:
        """:meth:`fetchrow` of a statement that takes ``rows``."""
        return await self._fetchrow(statement.compiled.sql, statement.args(rows, values))

    async def _fetchrow(self, sql: str, args: Sequence[Any]) -> Any:
        try:
            return await self._driver.fetchrow(sql, *args)
        except _INSERT_REFUSALS as exc:
            if not _explained(exc):
                raise
            raise _refused(exc) from exc

    async def fetch(self, statement: CompiledStatement, values: Mapping[str, Any]) -> Any:
        """Run ``statement``; every row."""
        return await self._driver.fetch(statement.sql, *statement.args(values))

    async def execute(self, statement: CompiledStatement, values: Mapping[str, Any]) -> str:
        """Run ``statement``; its command tag (:func:`row_count` reads it).
        :class:`InsertRefused` for an insert's refusal the commit path explains."""
        try:
            return await self._driver.execute(statement.sql, *statement.args(values))
        except _INSERT_REFUSALS as exc:
            if not _explained(exc):
                raise
            raise _refused(exc) from exc

    async def send(self, message: str) -> str:
        """Send ``message`` (statements without parameters: an :class:`Opening`'s, a
        borrowed session's opening) as one simple-protocol message; its last command tag."""
        status: str = await self._driver.execute(message)
        return status

    async def copy_into(
        self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str], schema: str
    ) -> None:
        """``rows`` into ``schema.table`` by COPY, inside the open transaction;
        :class:`InsertRefused` if a unique index refused one (COPY has no conflict rule)."""
        try:
            await self._copy(table, rows, columns, schema)
        except _UNIQUE_VIOLATION as exc:
            raise _refused(exc) from exc

    async def _copy(
        self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str], schema: str
    ) -> None:
        """``rows`` into ``schema.table`` by asyncpg's COPY, leaving no waiter of it behind.

        asyncpg's COPY makes its waiter before it starts the COPY on its protocol, outside
        what fails the waiter on an error: a protocol out of step with a session the server
        ended (``InternalClientError``: its last words read before its closed socket, as a
        loop running late reads them) raises there, and the waiter stays the connection's,
        awaited by nobody. The connection's loss fails it later, and asyncio reports
        "Future exception was never retrieved". The driver keeps its waiters private: they
        are found among what its protocol holds (:func:`_settle_waiters`)."""
        try:
            await self._driver.copy_records_to_table(
                table, records=rows, columns=columns, schema_name=schema
            )
        except Exception:
            _settle_waiters(self._driver)
            raise

    async def finish(self, closing: str) -> None:
        """Send ``closing``, an :class:`Opening`'s closing (the check that the schema
        still holds the store's cluster, and ``COMMIT``), as one message;
        :class:`ClusterMoved` if the check found another cluster."""
        try:
            await self._driver.execute(closing)
        except _CLUSTER_REPLACED as exc:
            found = _FOUND_INCARNATION.search(str(exc))
            raise ClusterMoved(
                None if found is None or found[1] == "missing" else int(found[1])
            ) from exc

    async def roll_back(self) -> None:
        """End the open transaction, writing nothing."""
        await self._driver.execute("ROLLBACK")

    async def roll_back_failed(self) -> None:
        """Roll back a failed commit's transaction. On a connection that died or whose
        statement was cancelled, the rollback fails too ("another operation is in
        progress"); that must not replace the error that explains the failure. The
        connection left in a transaction is discarded (:class:`HeldConnection`)."""
        with contextlib.suppress(Exception):
            await self._driver.execute("ROLLBACK")

    async def named(
        self, statements: Sequence[CompiledStatement], setup: str, keep: int
    ) -> list[str] | None:
        """The names under which this session holds ``statements`` prepared, for
        :func:`executing`, once ``setup`` ran on it (the commit bus's staging table); the
        ones it lacks are prepared, in one message. At most ``keep`` stay prepared: the
        least recently used make room. ``None`` where the session cannot: ``setup`` refused
        (a role without ``TEMPORARY`` on the database), or more statements than ``keep``.

        Outside any transaction: a prepared statement is the session's whatever becomes of
        a transaction. A message that failed half-way is reconciled with what the session
        holds (:meth:`_reconcile`), so no name is taken for one it lacks."""
        state = _NAMED.get(self._driver)
        if state is None:
            state = _NAMED[self._driver] = _Named()
        wanted = list(dict.fromkeys(statement.sql for statement in statements))
        if state.refused or len(wanted) > keep:
            return None
        if not state.staging:
            try:
                await self._driver.execute(setup)
            except asyncpg.PostgresError as exc:
                if isinstance(translate_error(exc, _STAGING), UnavailableError):
                    raise
                state.refused = True
                logger.warning(
                    "the commit bus cannot stage commits on this session: each runs its "
                    "own statements",
                    extra={"error": _describe(exc)},
                )
                return None
            state.staging = True
        for sql in wanted:
            if sql in state.names:
                state.names.move_to_end(sql)
        new = {sql: f"{_NAME_PREFIX}{next(_NAMES)}" for sql in wanted if sql not in state.names}
        if new:
            evicted: list[str] = []
            while len(state.names) + len(new) > keep:
                evicted.append(state.names.popitem(last=False)[1])
            state.names.update(new)
            message = "; ".join(
                [
                    *(f"DEALLOCATE {name}" for name in evicted),
                    *(f"PREPARE {name} AS {sql}" for sql, name in new.items()),
                ]
            )
            try:
                await self._driver.execute(message)
            except BaseException:
                await self._reconcile(state)
                raise
        return [state.names[statement.sql] for statement in statements]

    async def _reconcile(self, state: _Named) -> None:
        """After a message of :meth:`named` failed: keep the names the session holds, and
        deallocate those it holds that are no longer kept. A session that cannot say is
        forgotten (it is discarded: a failed commit's connection is)."""
        try:
            rows = await self._driver.fetch(_HELD_NAMES, _NAME_PREFIX)
            held = {str(row[0]) for row in rows}
            for sql, name in list(state.names.items()):
                if name not in held:
                    del state.names[sql]
            stray = held - set(state.names.values())
            if stray:
                await self._driver.execute("; ".join(f"DEALLOCATE {n}" for n in sorted(stray)))
        except Exception:
            _NAMED.pop(self._driver, None)

    async def stage(
        self, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str]
    ) -> None:
        """``rows`` into the session's own ``table`` (``pg_temp``, made by :meth:`named`'s
        setup) by COPY, inside the open transaction. A table found missing (not kept by the
        session) stops staging on it (:meth:`lost_named`)."""
        try:
            await self._copy(table, rows, columns, "pg_temp")
        except asyncpg.UndefinedTableError:
            self.stop_staging()
            raise

    def lost_named(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the session lost, or never had, a statement or table the
        bus made on it (a prepared statement missing or its name taken, the staging table
        missing): then it is not one server session that keeps what it is given (a
        transaction-pooling proxy hands out any), and it is never staged on again."""
        states = _sqlstates(exc)
        staging = isinstance(exc, asyncpg.UndefinedTableError) and st.staged_tasks.name in str(exc)
        if not staging and not any(s in PREPARED_STATEMENT_CODES for s in states):
            return False
        self.stop_staging()
        return True

    def stop_staging(self) -> None:
        """Never stage on this session again: :meth:`named` answers ``None``."""
        state = _NAMED.get(self._driver)
        if state is None:
            state = _NAMED[self._driver] = _Named()
        state.refused = True


def _settle_waiters(driver: DriverConnection) -> None:
    """Have every pending future the asyncpg connection ``driver`` holds read as it ends:
    after an operation of the caller's failed, nobody awaits them (see
    :meth:`CommitConnection._copy`)."""
    protocol = getattr(driver, "_protocol", None)
    if protocol is None:
        return
    for held in gc.get_referents(protocol):
        if isinstance(held, asyncio.Future) and not held.done():
            held.add_done_callback(_read_outcome)


def _read_outcome(future: asyncio.Future[Any]) -> None:
    """Read how ``future`` ended, so that asyncio does not report an error nobody awaited."""
    if not future.cancelled():
        future.exception()


def executing(name: str, statement: CompiledStatement, values: Mapping[str, Any]) -> str:
    """``EXECUTE`` of ``statement``, held by the session as ``name``
    (:meth:`CommitConnection.named`), its parameters rendered as literals: integers only,
    as :class:`Opening`'s, so that several run in one simple-protocol message."""
    args = ", ".join(map(_integer, statement.args(values)))
    return f"EXECUTE {name}({args})" if args else f"EXECUTE {name}"


class _Named:
    """What one server session holds for the commit bus: its staging table made (or
    refused), and the statements it prepared, by text, least recently used first."""

    __slots__ = ("names", "refused", "staging")

    def __init__(self) -> None:
        self.staging = False
        self.refused = False
        self.names: OrderedDict[str, str] = OrderedDict()


#: Each driver connection's :class:`_Named`, gone with it (and with its session).
_NAMED: weakref.WeakKeyDictionary[Any, _Named] = weakref.WeakKeyDictionary()
#: Names of the bus's prepared statements, unique in the process: never given twice, so a
#: name left on a session by a failed message is never taken for another statement.
_NAME_PREFIX = "cronoq_bus_"
_NAMES = itertools.count(1)
_HELD_NAMES = (
    "SELECT name FROM pg_catalog.pg_prepared_statements WHERE pg_catalog.starts_with(name, $1)"
)
_STAGING = "preparing the commit bus's statements"


# --- a store transaction on a pooled session -------------------------------------------


def opening_message(statements: Sequence[ClauseElement], dialect: Dialect) -> str:
    """``statements`` (``BEGIN`` first, none with parameters) as one simple-protocol message
    for :func:`run_transaction`: no more round trips than SQLAlchemy's ``BEGIN``."""
    compiled = [statement.compile(dialect=dialect) for statement in statements]
    if any(c.params for c in compiled):
        raise ValueError("an opening takes no parameters")
    return "; ".join(c.string for c in compiled)


async def run_transaction(
    db: AsyncEngine, opening: str | None, work: Callable[[AsyncConnection], Awaitable[_T]]
) -> _T:
    """``work`` on a pooled connection in a transaction, with the cluster's schema applied
    (``db``'s execution options); it commits when ``work`` returns. ``opening``: the message
    that opens the transaction with the store's settings (:func:`opening_message`), or ``None`` for
    SQLAlchemy's ``BEGIN`` (the session's own settings are the store's).

    If the session had lost prepared statements the driver or SQLAlchemy made on it (an
    application's ``DISCARD ALL`` between two checkouts), their caches are emptied and
    ``work`` runs again on the same connection (another of the pool may have lost them
    too). That is safe: the statement the server did not find failed the transaction, so
    nothing ``work`` wrote stayed. A second loss in a row is raised.
    """
    async with db.connect() as conn:
        try:
            return await _attempt(conn, opening, work)
        except Exception as exc:
            if conn.invalidated or not await _forgot(conn, exc):
                raise
        try:
            return await _attempt(conn, opening, work)
        except Exception as exc:
            if not conn.invalidated:
                await _forgot(conn, exc)
            raise


async def _forgot(conn: AsyncConnection, exc: BaseException) -> bool:
    """Whether ``exc`` was a lost prepared statement on ``conn``, now forgotten, with the
    failed transaction ended for SQLAlchemy too."""
    if not await forget_lost_statements(exc, await conn.get_raw_connection()):
        return False
    await conn.rollback()
    return True


async def _attempt(
    conn: AsyncConnection, opening: str | None, work: Callable[[AsyncConnection], Awaitable[_T]]
) -> _T:
    async with _transaction(conn, opening):
        return await work(conn)


@asynccontextmanager
async def _transaction(conn: AsyncConnection, opening: str | None) -> AsyncIterator[None]:
    """A transaction on ``conn``, under the store's settings. A failure inside is raised as
    it is, never replaced by the rollback's on a connection that is gone.

    With ``opening`` the store opens the transaction itself (on a borrowed session: the
    message that sets the store's settings for it alone, the writer's
    :attr:`~cronoq_store._commit_path.BatchWriter.borrowed_opening`), and the driver adapter
    sends no ``BEGIN`` of its own meanwhile (its DBAPI ``autocommit``; SQLAlchemy's
    isolation-level option would leave the application's session reset to another level).
    A connection left in doubt (a failed rollback, a cancellation) is discarded.
    """
    if opening is None:
        failure: BaseException | None = None
        try:
            async with conn.begin():
                try:
                    yield
                except BaseException as exc:
                    failure = exc
                    raise
        except BaseException as exc:
            if failure is None or exc is failure:
                raise
            # The rollback failed too, on a connection that is gone (a crash): the
            # first failure is what explains it.
            raise failure from None
        return
    pooled = await conn.get_raw_connection()
    adapter: Any = pooled.dbapi_connection
    driver: Any = pooled.driver_connection
    adapter.autocommit = True
    try:
        await driver.execute(opening)
        yield
        await driver.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            await driver.execute("ROLLBACK")
        if driver.is_closed() or driver.is_in_transaction():
            driver.terminate()
            await conn.invalidate()
        raise
    finally:
        adapter.autocommit = False


# --- dialling: a driver connection from a URL's parameters -------------------------------


#: asyncpg connections made by a :class:`Dialer` (``from_engine`` tells an engine made from
#: :func:`engine_arguments` from one SQLAlchemy dials from its URL).
_DIALLED: weakref.WeakSet[Any] = weakref.WeakSet()


class Dialer:
    """SQLAlchemy's asyncpg connection factory for one :class:`ConnectParameters`.

    SQLAlchemy calls it with the keywords it made from ``engine.url`` (ignored: the
    parameters say where to go) and the engine's ``connect_args`` (the caller's
    ``server_settings``, ``timeout``, statement cache...). The URL's settings go first and
    the caller's over them (the store's own ``search_path`` wins over ``options``); the
    URL's ``application_name`` names the session over the caller's, which is a fallback;
    the URL's ``connect_timeout`` replaces the caller's bound."""

    def __init__(self, parameters: ConnectParameters) -> None:
        self.parameters = parameters

    def __repr__(self) -> str:
        return f"Dialer({self.parameters.shown})"

    async def __call__(self, *_args: Any, **given: Any) -> Any:
        p = self.parameters
        for name in ("dsn", "host", "port", "user", "password", "database", "passfile"):
            given.pop(name, None)
        caller = dict(given.pop("server_settings", None) or {})
        settings = {**dict(p.settings), **caller}
        settings["application_name"] = p.session_name(caller.get("application_name", ""))
        if not settings["application_name"]:
            del settings["application_name"]
        bound = given.pop("timeout", 60.0)
        # libpq's connect_timeout bounds each host; without one, the caller's bound covers
        # the whole attempt.
        connection = await asyncio.wait_for(
            self._dial(settings, given), None if p.connect_timeout_given else bound
        )
        _tune_socket(connection, p)
        _DIALLED.add(connection)
        return connection

    async def _dial(self, settings: dict[str, str], given: dict[str, Any]) -> Any:
        """Each host in turn, as libpq tries them: the first that connects and has the
        ``target_session_attrs`` asked for (``prefer-standby``: a standby, else any)."""
        p = self.parameters
        arguments = p.asyncpg_arguments()
        hosts, ports = arguments.pop("host"), arguments.pop("port")
        attrs = arguments.pop("target_session_attrs")
        if not isinstance(hosts, list):
            return await asyncpg.connect(
                host=hosts,
                port=ports,
                target_session_attrs=attrs,
                server_settings=settings,
                timeout=p.connect_timeout,
                **arguments,
                **given,
            )
        passes = ["standby", "any"] if attrs == "prefer-standby" else [attrs]
        failure: Exception | None = None
        for wanted in passes:
            for host, port in zip(hosts, ports, strict=True):
                try:
                    return await asyncpg.connect(
                        host=host,
                        port=port,
                        target_session_attrs=wanted,
                        server_settings=settings,
                        timeout=p.connect_timeout,
                        **arguments,
                        **given,
                    )
                except Exception as exc:  # libpq tries the next host after any failure
                    failure = exc
        assert failure is not None
        raise failure


def _tune_socket(connection: Any, p: ConnectParameters) -> None:
    """libpq's TCP settings on the connection's socket (a unix socket has none)."""
    transport = getattr(connection, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, int(p.keepalives))
    if p.keepalives:
        for option, value in (
            ("TCP_KEEPIDLE", p.keepalives_idle),
            ("TCP_KEEPINTVL", p.keepalives_interval),
            ("TCP_KEEPCNT", p.keepalives_count),
        ):
            if value > 0 and hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    if p.tcp_user_timeout > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, p.tcp_user_timeout)


def _dialled_by_store(driver_connection: Any) -> bool:
    """Whether ``driver_connection`` was made by a :class:`Dialer`."""
    return driver_connection in _DIALLED


def engine_arguments(
    url: str | URL | ConnectParameters,
) -> tuple[URL, dict[str, Any]]:
    """The URL and the ``connect_args`` of an engine that connects as libpq would with
    ``url``: ``create_async_engine(dialled, connect_args={**arguments, ...})``.

    Every engine the store makes from a URL (its pool, the lock session, the CLI's,
    Alembic's) is made from these. ``url`` is read once, as libpq 18 reads it: the URL, then
    its service's file, then the ``PG*`` environment, then the defaults. Every session is
    dialled from what was read (the asyncpg adapter's ``async_creator_fn``), so nothing
    SQLAlchemy makes of a URL can drop a parameter. Further ``connect_args``
    (``server_settings``, ``timeout``, ``statement_cache_size``...) reach
    ``asyncpg.connect()`` too; the URL's ``application_name`` and ``connect_timeout`` win
    over theirs. Raises ``ValueError`` for what is not a PostgreSQL URL or names a service
    no file defines, and ``UnsupportedParameterError`` naming each parameter asyncpg cannot
    honour (docs/cli.md lists every parameter)."""
    parameters = url if isinstance(url, ConnectParameters) else resolve(url)
    arguments: dict[str, Any] = {"async_creator_fn": Dialer(parameters)}
    if parameters.prepared_statement_cache_size is not None:
        arguments["prepared_statement_cache_size"] = parameters.prepared_statement_cache_size
    return parameters.url(), arguments


# --- the engines, and the checks at open -------------------------------------------------

#: Seconds a new connection of the store's own pool may take to open: asyncpg's own bound,
#: written out (each store call is bounded by its own timeout besides).
POOL_CONNECT_TIMEOUT = 60.0
#: Seconds a silent host gets to answer Alembic's command line and the cronoq-store
#: commands: a firewall dropping packets must not hang them for asyncpg's minute.
CONNECT_TIMEOUT = 10.0


def _engine(
    url: str | URL | ConnectParameters,
    *,
    connect_timeout: float,
    connect_args: Mapping[str, Any],
    **options: Any,
) -> AsyncEngine:
    """An engine that dials ``url`` as libpq would (its TLS, service and password file:
    :func:`engine_arguments`), under the rules every engine the store
    makes from a URL keeps. No bound parameter shows in an error's text: one can carry a
    secret or a payload. Connecting is bounded by ``connect_timeout`` seconds, unless the
    URL's ``connect_timeout`` says otherwise. ``connect_args`` come last, and ``options``
    are the engine's own (its pool, its isolation level)."""
    dialled, arguments = engine_arguments(url)
    return create_async_engine(
        dialled,
        hide_parameters=True,
        **options,
        connect_args={**arguments, "timeout": connect_timeout, **connect_args},
    )


def own_engine(
    url: str | URL, config: PgStoreConfig, *, statement_cache: int | None = None
) -> AsyncEngine:
    """The engine of a store opened with :meth:`PgStore.connect`: its own pool of
    ``max_connections``, the store's session settings, closed connections replaced at
    checkout. ``statement_cache``: the prepared statements each session keeps (asyncpg's
    ``statement_cache_size``; its default, 100, without): a host's sessions each commit
    for many clusters, each cluster's statements its own."""
    arguments = _pool_connect_args(config)
    if statement_cache is not None and config.prepared_statements:
        arguments["statement_cache_size"] = statement_cache
    engine = _engine(
        url,
        connect_timeout=POOL_CONNECT_TIMEOUT,
        # The URL's application_name (or $PGAPPNAME) names the sessions over the config's.
        connect_args=arguments,
        pool_size=config.max_connections,
        max_overflow=0,
        # No store call waits for a connection longer than a commit may take.
        pool_timeout=config.commit_timeout,
    )
    event.listen(engine.sync_engine.pool, "checkout", _reject_closed)
    return engine


def lock_engine(
    parameters: ConnectParameters, settings: Mapping[str, str], connect_timeout: float
) -> AsyncEngine:
    """The leader lock session's engine, dialled from the store's URL: no pool (a session
    ends with the lock it holds), autocommit (the lock is the session's, and the epoch
    bump opens its own transaction), the session's ``settings`` (its ``search_path``
    among them) sent at startup, connecting bounded by ``connect_timeout``."""
    return _engine(
        parameters,
        connect_timeout=connect_timeout,
        connect_args={"server_settings": dict(settings)},
        poolclass=NullPool,
        isolation_level="AUTOCOMMIT",
    )


def borrowed_lock_engine(url: str | URL, pool: Pool) -> AsyncEngine:
    """The leader lock session's engine on an application's ``pool`` (its engine's pool
    ``recreate()``-d): sessions are made as the application's engine makes its own (its
    creator, TLS, connect arguments and bound), in autocommit, and ``url`` only names the
    dialect. The session's settings are applied once connected
    (:meth:`LockSession.apply_settings`); its ``search_path`` before anything else
    (:func:`_safe_path_first`)."""
    engine = create_async_engine(url, pool=pool, isolation_level="AUTOCOMMIT", hide_parameters=True)
    event.listen(engine.sync_engine.pool, "connect", _safe_path_first, insert=True)
    return engine


def _safe_path_first(dbapi_connection: Any, record: Any) -> None:
    """Set :data:`~cronoq_store._statements.SEARCH_PATH` on a new lock session before the
    pool's other listeners query it: SQLAlchemy reads ``current_schema()`` as an engine
    first connects, and the dialect's codec set-up queries the catalog with unqualified
    operators, under the ``search_path`` the application's connect arguments gave (a
    schema another role writes, put first, would answer as us). A command that resolves
    no name."""
    driver = dbapi_connection.driver_connection
    await_(driver.execute(f"SET search_path TO {st.SEARCH_PATH}"))


def migration_engine(url: str | URL) -> AsyncEngine:
    """Alembic's engine when its command line names a URL: no pool (a run opens one
    connection), the safe ``search_path``, connecting bounded by :data:`CONNECT_TIMEOUT`."""
    return _engine(
        url,
        connect_timeout=CONNECT_TIMEOUT,
        connect_args={"server_settings": {"search_path": st.SEARCH_PATH}},
        poolclass=NullPool,
    )


def command_engine(
    url: str, *, application_name: str, lock_timeout: float, pool_size: int = 0
) -> AsyncEngine:
    """The engine of an operator's command (the CLI's): without a pool by default, as a
    command opens a connection or two and is gone; with a ``pool_size``, one that keeps
    that many open (a server that reads again and again, like the console: connecting costs
    more than most of its pages' statements). Its sessions are named ``application_name``,
    run with the safe ``search_path``, wait ``lock_timeout`` seconds at most for a lock,
    and connect within :data:`CONNECT_TIMEOUT`."""
    pooling: dict[str, Any] = (
        {"poolclass": NullPool}
        if pool_size == 0
        else {"pool_size": pool_size, "max_overflow": pool_size, "pool_pre_ping": True}
    )
    return _engine(
        url,
        connect_timeout=CONNECT_TIMEOUT,
        connect_args={
            "server_settings": {
                "application_name": application_name,
                # No schema another role can write is ever on the path (CVE-2018-1058).
                "search_path": st.SEARCH_PATH,
                "lock_timeout": str(round(lock_timeout * 1000)),
            }
        },
        **pooling,
    )


async def require_utf8(engine: AsyncEngine, where: str, opening: str) -> None:
    """Refuse a database whose encoding is not UTF8, before anything is created in it: every
    string the domain accepts must be storable, and another encoding lacks most characters.
    Read in a transaction opened by ``opening`` (the store's settings)."""

    async def read(conn: AsyncConnection) -> str:
        encoding: str = (await conn.execute(st.server_encoding)).scalar_one()
        return encoding

    try:
        encoding = await run_transaction(engine, opening, read)
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
            path = (await conn.execute(st.session_search_path)).scalar_one()
    except Exception as exc:
        raise translate_error(exc, "reading the pooled sessions' search_path") from exc
    if [part.strip() for part in path.split(",")] != [
        part.strip() for part in st.SEARCH_PATH.split(",")
    ]:
        raise StoreError(
            f"the pooled sessions at {where} run with search_path {path!r}, not "
            f"{st.SEARCH_PATH!r}: with prepared_statements=False the store cannot set it "
            "per session; set it for the store's PgBouncer database entry (connect_query = "
            f"'SET search_path = {st.SEARCH_PATH}') or for the role (ALTER ROLE ... SET "
            f'search_path = {st.SEARCH_PATH}) (docs/reliability.md, "PgBouncer")'
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
            "search_path": st.SEARCH_PATH,
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
        await conn.execute(st.local_search_path)
        oid = (await conn.execute(st.schema_oid, {"schema": schema})).scalar()
        incarnation = None
        if oid is not None:
            found = await conn.execute(st.incarnation, execution_options=schema_options(schema))
            incarnation = found.scalar()
        pool_role = (await conn.execute(st.current_user)).scalar_one()
        return oid, incarnation, pool_role

    try:
        return await run_transaction(engine, opening, read)
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
        writable = await bounded(run_transaction(db, None, accepts_writes), timeout)
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


async def refuse_unsafe_lock_session(
    engine: AsyncEngine, *, prepared_statements: bool, lock_url: str | URL | None, borrowed: bool
) -> None:
    """Refuse, before anything connects, a leader lock session that could not be trusted:
    on a pool without prepared statements (a transaction-pooling PgBouncer) without a
    direct ``lock_url``, where the session advisory lock would live on a server connection
    other clients share; a ``lock_url`` that cannot be honoured; a borrowed ``engine`` that
    dials somewhere its URL does not say (:func:`refuse_ignored_parameters`), whose sessions
    the lock session is made like."""
    if not prepared_statements and lock_url is None:
        raise ValueError(
            "prepared_statements=False (a pool behind a transaction-pooling PgBouncer) "
            "needs lock_url=, a direct URL to the server: the leader's session advisory "
            "lock cannot live on a pooled server connection"
        )
    if lock_url is not None:
        resolve(lock_url)
    elif borrowed:
        await refuse_ignored_parameters(engine)


async def refuse_ignored_parameters(engine: AsyncEngine) -> None:
    """Refuse, by name, an application's engine that dials somewhere its URL does not say.

    SQLAlchemy hands a URL's ``service`` and ``servicefile`` to ``asyncpg.connect()``, which
    ignores them (and ``$PGSERVICE``) without a DSN, and dials the default server instead:
    the store would lead a cluster in another database. An engine made from
    :func:`engine_arguments` reads them as libpq does, and passes."""
    names = [name for name in ("service", "servicefile") if name in engine.url.query]
    if "PGSERVICE" in os.environ:
        names.append("$PGSERVICE")
    if not names:
        return
    try:
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            if _dialled_by_store(raw.driver_connection):
                return
    except Exception:
        # Opening the store goes on, and says why it cannot connect.
        return
    raise UnsupportedParameterError(
        f"engine {redact(engine.url)}: cronoq-store cannot honour the parameter"
        f"{'s' if len(names) > 1 else ''} {', '.join(names)}: SQLAlchemy hands it to asyncpg, "
        "which ignores it and dials the default server; make the engine from "
        "cronoq_store.engine_arguments(url)",
        [name.lstrip("$") for name in names],
    )


# --- recovery's cursor ------------------------------------------------------------------


async def partitions(
    conn: AsyncConnection, statement: ClauseElement, schema: str, size: int
) -> AsyncIterator[list[Any]]:
    """``statement``'s rows in the cluster in ``schema``, ``size`` at a time, through a
    server-side cursor on the driver connection under ``conn``, in its transaction
    (recovery's live tasks). The rows are the driver's records, as :mod:`cronoq_store._schema`
    decodes them: SQLAlchemy's result rows cost more per row than the decoding they feed."""
    compiled = CompiledStatement.of(statement, conn.dialect, schema)
    cursor = await compiled.cursor(_asyncpg_of(await conn.get_raw_connection()), {})
    while rows := await cursor.fetch(size):
        yield rows


# --- the leader lock session --------------------------------------------------------------

#: How long a graceful close of the lock session may take before the socket is dropped.
LOCK_SESSION_CLOSE_TIMEOUT = 1.0

# The transaction of a takeover on the lock session, which is in autocommit otherwise: the
# bump runs behind :data:`cronoq_store._statements.leader_barrier` (:meth:`LockSession.takeover`).
_TAKEOVER_BEGIN = text("BEGIN")
_TAKEOVER_COMMIT = text("COMMIT")
_ROLLBACK = text("ROLLBACK")


@dataclass(frozen=True, slots=True)
class LeaderRow:
    """The leader row as the lock session reads it (:data:`~cronoq_store._statements.leader_now`):
    the stored epoch and the cluster's incarnation (the leader table's OID)."""

    epoch: int
    tableoid: int
    #: The host group the cluster is enrolled in (``None``: standalone), when the read
    #: asked for it (:data:`~cronoq_store._statements.leader_enrolment`); else ``None``.
    host_group: str | None = None


#: What the keeper's check is, in its errors.
_CHECKING_LEADER = "checking the leader lock session"


class LockSession:
    """The leader lock session, a connection of its own, one method per operation
    (:mod:`cronoq_store._leadership` decides which run, and when): the session's settings,
    the trust checks, the lock's key and the lock polled, its holder, the epoch bump's
    transaction, the keeper's check, and the close. Each statement is bounded by the
    ``timeout`` its caller gives.

    The driver connection under it is used only to close: ``terminate()`` drops the socket
    at once, where any polite close would wait for a peer that may never answer.
    """

    def __init__(self, conn: AsyncConnection, driver: Any) -> None:
        self._conn = conn
        self._driver = driver
        self.closed = False

    @property
    def broken(self) -> bool:
        """Whether the session is gone (closed, or its socket dropped): a failure on a
        session that is not broken was the server's answer, and the session goes on."""
        return self.closed or bool(self._driver.is_closed())

    @classmethod
    async def open(cls, db: AsyncEngine, timeout: float) -> LockSession:
        """A new session of ``db`` (the lock session's own engine), its connect bounded by
        ``timeout`` (an application's creator may have none); a connect done as the caller
        is cancelled (or times out) is closed, not lost."""
        conn = await bounded(db.connect(), timeout, discard=AsyncConnection.close)
        try:
            raw = await conn.get_raw_connection()
        except BaseException:
            await conn.close()
            raise
        return cls(conn, raw.driver_connection)

    async def _run(
        self, statement: Executable, params: Mapping[str, Any] | None, timeout: float
    ) -> Result[Any]:
        """Execute ``statement``; a session silent for ``timeout`` seconds is torn down.

        The statement is not cancelled (that would send a cancel request over a new
        connection, into the same silence); aborting the socket makes it fail at once.
        """
        return await bounded(
            self._conn.execute(statement, None if params is None else dict(params)),
            timeout,
            abort=self._driver.terminate,
            grace=LOCK_SESSION_CLOSE_TIMEOUT,
            silent="the lock session did not answer",
        )

    async def execute(
        self,
        statement: Executable,
        params: Mapping[str, Any] | None,
        timeout: float,
        *,
        schema: str,
    ) -> Result[Any]:
        """Execute ``statement`` with its schema-less tables in ``schema``: for a session
        that works in many schemas (a host's, :mod:`cronoq_store._host`), where the
        standalone lock session's engine is bound to its cluster's. Bounded as every
        statement of the session is."""
        return await self.execute_with(statement, params, timeout, schema_options(schema))

    async def execute_with(
        self,
        statement: Executable,
        params: Mapping[str, Any] | None,
        timeout: float,
        options: Mapping[str, Any],
    ) -> Result[Any]:
        """Execute ``statement`` with the execution ``options`` it was made with: a
        statement naming several clusters' tables at once, each through its own entry of
        the schema map (:class:`~cronoq_store._statements.HostedClaims`). Bounded as every
        statement of the session is."""
        return await bounded(
            self._conn.execute(
                statement, None if params is None else dict(params), execution_options=options
            ),
            timeout,
            abort=self._driver.terminate,
            grace=LOCK_SESSION_CLOSE_TIMEOUT,
            silent="the lock session did not answer",
        )

    async def run_sync(self, work: Callable[[Connection], _T], timeout: float) -> _T:
        """``work`` on the session as a synchronous connection (a check written for
        Alembic's side too, such as the trust checks), bounded as every statement is."""
        return await bounded(
            self._conn.run_sync(work),
            timeout,
            abort=self._driver.terminate,
            grace=LOCK_SESSION_CLOSE_TIMEOUT,
            silent="the lock session did not answer",
        )

    @asynccontextmanager
    async def transaction(self, timeout: float) -> AsyncIterator[None]:
        """``BEGIN``, the work, ``COMMIT``; a failure inside rolls back and is raised, and
        the session goes on (a host's session outlives any one claim). A session that
        cannot roll back is torn down: its lock goes with it, as silence would take it;
        the failure inside is what is raised then (a statement that went silent tore the
        session down already, and the rollback's own error would only say it is gone),
        unless the rollback was cancelled."""
        await self._run(_TAKEOVER_BEGIN, None, timeout)
        try:
            yield
        except BaseException as failure:
            try:
                await self._run(_ROLLBACK, None, timeout)
            except asyncio.CancelledError:
                self._driver.terminate()
                raise
            except BaseException:
                self._driver.terminate()
                raise failure from None
            raise
        await self._run(_TAKEOVER_COMMIT, None, timeout)

    async def apply_settings(self, settings: Mapping[str, str], timeout: float) -> None:
        """Set the session's own ``settings`` (one for each name of
        :data:`~cronoq_store._statements.LOCK_SESSION_SETTINGS`), on a session whose
        connect did not send them (an application's pool creator)."""
        await self._run(st.lock_session_settings, settings, timeout)

    async def setting(self, name: str, timeout: float) -> str:
        """The session's setting ``name``, as the session sees it."""
        value: str = (await self._run(st.session_setting, {"name": name}, timeout)).scalar_one()
        return value

    async def findings(
        self, check: Executable, params: Mapping[str, Any], timeout: float
    ) -> list[str]:
        """What the caller's ``check`` (a trust check of :mod:`cronoq_store._trust`) finds:
        the first column of each row, as names."""
        found = (await self._run(check, params, timeout)).scalars().all()
        return [str(name) for name in found]

    async def current_user(self, timeout: float) -> str:
        """The role the session runs as (who a trust check ran as)."""
        role: str = (await self._run(st.current_user, None, timeout)).scalar_one()
        return role

    async def current_database(self, timeout: float) -> str:
        """The database the session is in."""
        name: str = (await self._run(st.current_database, None, timeout)).scalar_one()
        return name

    async def schema_oid(self, schema: str, timeout: float) -> int | None:
        """The OID of ``schema`` now (the lock's second key), ``None`` if there is none."""
        oid: int | None = (await self._run(st.schema_oid, {"schema": schema}, timeout)).scalar()
        return oid

    async def try_lock(
        self, key: Mapping[str, int], timeout: float
    ) -> tuple[bool, datetime | None]:
        """One poll for the leader lock (:data:`~cronoq_store._statements.try_leader_lock`):
        whether this session holds it now, and since when another session held it."""
        row: Any = (await self._run(st.try_leader_lock, key, timeout)).one()
        return bool(row[0]), row[1]

    async def lock_holder(
        self, keys: Mapping[str, int], timeout: float
    ) -> tuple[LockHolder | None, int]:
        """Who holds the leader lock of ``keys``, if a session does, and the stored epoch
        (:data:`~cronoq_store._catalog.leader_holder_facts`)."""
        row: Any = (await self._run(catalog.leader_holder_facts, keys, timeout)).one()
        return holder_of(row), int(row.epoch)

    @asynccontextmanager
    async def takeover(self, timeout: float) -> AsyncIterator[None]:
        """The epoch bump's transaction: ``BEGIN``, the work, ``COMMIT``. A failure inside
        leaves it open: the caller closes the session, which ends it."""
        await self._run(_TAKEOVER_BEGIN, None, timeout)
        yield
        await self._run(_TAKEOVER_COMMIT, None, timeout)

    async def leader_barrier(self, schema: str, bound: float, what: str, timeout: float) -> None:
        """:func:`leader_barrier` in the takeover's transaction: at most ``bound`` seconds
        for the sessions holding the leader table, then ``LockHeldError`` naming them."""
        await leader_barrier(
            lambda statement, params: self._run(statement, params, timeout), schema, bound, what
        )

    async def bump_epoch(self, incarnation: int, timeout: float) -> int | None:
        """Take the next epoch in the cluster ``incarnation``
        (:data:`~cronoq_store._statements.take_epoch`); ``None`` when that cluster has no
        leader row to move."""
        found = (await self._run(st.take_epoch, {"incarnation": incarnation}, timeout)).scalar()
        return None if found is None else int(found)

    async def record_term(
        self, epoch: int, lock_seen_held_at: datetime | None, timeout: float
    ) -> None:
        """The takeover's row in the leadership history, and the history pruned to the
        newest terms (:data:`~cronoq_store._statements.record_term`, ``prune_terms``)."""
        term = {"epoch": epoch, "lock_seen_held_at": lock_seen_held_at}
        await self._run(st.record_term, term, timeout)
        await self._run(st.prune_terms, None, timeout)

    async def set_lock_timeout(self, ms: int, timeout: float) -> None:
        """How long the session's statements wait for a lock from now on, in milliseconds
        (:data:`~cronoq_store._statements.keeper_lock_timeout`)."""
        await self._run(st.keeper_lock_timeout, {"lock_timeout": str(ms)}, timeout)

    async def leader_row(self, timeout: float) -> LeaderRow | None:
        """The leader row (:data:`~cronoq_store._statements.leader_now`), ``None``
        without one."""
        row: Any = (await self._run(st.leader_now, None, timeout)).first()
        return None if row is None else LeaderRow(row.epoch, row.tableoid)

    async def leader_enrolment(self, timeout: float) -> LeaderRow | None:
        """The leader row with the host group the cluster is enrolled in
        (:data:`~cronoq_store._statements.leader_enrolment`), ``None`` without one."""
        row: Any = (await self._run(st.leader_enrolment, None, timeout)).first()
        return None if row is None else LeaderRow(row.epoch, row.tableoid, row.host_group)

    async def check_leader(self, timeout: float) -> LeaderRow | None:
        """The keeper's check: :meth:`leader_row`, every failure translated, and a wait
        for a lock on the leader table that ran out of the session's ``lock_timeout`` told
        apart as :class:`LockNotAvailable` (the session answered)."""
        async with translated(_CHECKING_LEADER), separating_lock_waits(_CHECKING_LEADER):
            return await self.leader_row(timeout)

    async def close(self) -> None:
        """Close the session, ending the server's backend and so releasing its lock; bounded.

        A graceful close is tried when the socket is still open; the socket is dropped if
        that fails or takes longer than :data:`LOCK_SESSION_CLOSE_TIMEOUT`. Closing twice is
        harmless.
        """
        if self.closed:
            return
        self.closed = True
        try:
            if not self._driver.is_closed():
                try:
                    await self._driver.close(timeout=LOCK_SESSION_CLOSE_TIMEOUT)
                except Exception:
                    self._driver.terminate()
        finally:
            try:
                # The driver connection is closed: this settles SQLAlchemy's bookkeeping.
                await self._conn.invalidate()
                await self._conn.close()
            except Exception as exc:
                logger.warning("closing the leader lock session failed", extra={"error": repr(exc)})


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
    return "; ".join(_describe_holder(h) for h in holders)


def _describe_holder(holder: LockHolder) -> str:
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
        while not _attempt_lock(conn, statement, TABLE_LOCK_ATTEMPT):
            conn.execute(catalog.clear_stats_snapshot)
            wait.held_by(_holders(conn.execute(catalog.table_lock_holders, looking).all()))
            conn.execute(st.pause, {"seconds": TABLE_LOCK_PAUSE})
    conn.execute(st.set_local_lock_timeout, {"ms": _ms(max(wait.remaining, 1.0))})


def require_transaction(conn: Connection, action: str) -> None:
    """Raise :class:`~cronoq_store.MigrationError` if ``conn``'s session is in no
    transaction block after a statement (an ``AUTOCOMMIT`` connection): each statement of
    ``action`` would commit on its own, its transaction-scoped locks and settings would
    end with it, and a refusal at the end would leave what ran before it. Known on
    asyncpg's sessions (the server's status after each statement), the store's driver."""
    if conn.dialect.driver != "asyncpg":
        return
    driver: Any = conn.connection.driver_connection
    if not driver.is_in_transaction():
        raise MigrationError(
            f"{action}: the connection is in autocommit mode (isolation_level='AUTOCOMMIT'), "
            "and a migration must run in one transaction; pass a connection in a "
            "transaction, or the engine"
        )


def run_script(conn: Connection, script: str) -> None:
    """Run ``script``, any number of statements, as one message on ``conn`` (asyncpg's
    simple query protocol), in its transaction: a fresh schema's whole migration costs one
    round trip instead of two per statement (:func:`~cronoq_store._migrations.upgrade`).
    A failure leaves the transaction aborted, for the caller to roll back; one that ended
    the session invalidates ``conn``, as SQLAlchemy does when a statement of its own meets
    that (the script bypasses it): the caller's rollback then raises nothing in place of
    the failure."""
    driver: Any = conn.connection.driver_connection
    try:
        await_(driver.execute(script))
    except Exception as exc:
        if driver.is_closed():
            conn.invalidate(exc)
        raise


def _attempt_lock(conn: Connection, statement: Executable, seconds: float) -> bool:
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
