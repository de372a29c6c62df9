"""The store's errors and the one place where driver failures are translated into them.

The scheduler retries :class:`UnavailableError` and treats everything else as a bug or a
misconfiguration, so the classification below decides whether work is retried or abandoned.
It follows SQLSTATE, not exception classes: the asyncpg dialect delivers serialization
failures, deadlocks and shutdowns alike as a plain ``DBAPIError``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import asyncpg
from sqlalchemy import exc as sa_exc

from ._domain import show as show

__all__ = [
    "CONNECTION_CLASSES",
    "PREPARED_STATEMENT_CODES",
    "READ_ONLY",
    "SCHEMA_GONE_CODES",
    "TRANSIENT_CLASSES",
    "TRANSIENT_CODES",
    "BatchTooLargeError",
    "CommitterClosedError",
    "FencedError",
    "IdCollisionError",
    "KeyTakenError",
    "MigrationError",
    "SchemaGoneError",
    "StoreError",
    "UnavailableError",
    "translate_error",
]

#: SQLSTATE classes after which a session is gone or going: 08 connection exception, 57P
#: operator intervention (admin shutdown, crash shutdown, cannot connect now, terminated).
CONNECTION_CLASSES = ("08", "57P")
#: SQLSTATE classes of transient failures: the connection classes and 53, insufficient
#: resources (too many connections, out of memory or disk).
TRANSIENT_CLASSES = (*CONNECTION_CLASSES, "53")
#: Transient SQLSTATE codes: 40001 serialization failure, 40P01 deadlock, 55P03 lock not
#: available, 57014 query cancelled (statement timeout).
TRANSIENT_CODES = frozenset({"40001", "40P01", "55P03", "57014"})
#: Read-only transaction. A primary that was demoted to a standby answers this (and
#: "cannot execute ... during recovery"): the connection is in the wrong place.
READ_ONLY = "25006"
#: A named prepared statement missing (26000) or already defined (42P05) on the server:
#: clients sharing server sessions behind a transaction-pooling PgBouncer before 1.21.
PREPARED_STATEMENT_CODES = frozenset({"26000", "42P05"})
#: What this build reads and writes is gone: 42P01 undefined table, 42703 undefined column,
#: 3F000 invalid schema name (a downgrade, or a schema dropped by hand, under the store).
SCHEMA_GONE_CODES = frozenset({"42P01", "42703", "3F000"})


class StoreError(Exception):
    """Base of every error the store raises; the driver's exception is chained as cause."""

    #: Whether retrying the same call later can succeed.
    is_transient: bool = False


class UnavailableError(StoreError):
    """The database could not be reached or did not answer in time; retry later.

    Commits are idempotent, so retrying one that did land changes nothing.
    """

    is_transient = True

    def __init__(self, message: str, *, reconnect: bool = False) -> None:
        super().__init__(message)
        #: The pool's connections point at a server that can no longer take writes (a demoted
        #: primary); they should be dropped so new ones find the current primary.
        self.reconnect = reconnect


class FencedError(StoreError):
    """Another instance took leadership: this instance must never write again."""


class SchemaGoneError(FencedError):
    """The cluster's tables or columns that this build uses are gone (a forced downgrade, or
    a schema dropped by hand, while it ran): nothing of the failed call was written, and
    retrying cannot help. A leader steps down on it (``leadership_lost()`` returns); migrate
    the schema before any instance leads it again."""


class MigrationError(StoreError):
    """The schema cannot be migrated safely (newer than this build, foreign-owned, ...)."""


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
    statement missing or taken (26000, 42P05: a transaction-pooling PgBouncer) is a permanent
    ``StoreError`` saying which settings avoid it. A table, column or schema missing (42P01,
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
            f"{message}; named prepared statements do not survive a transaction-pooling "
            "PgBouncer before 1.21: open the store with PgStoreConfig(prepared_statements=False) "
            'and, with from_engine, an engine with connect_args={"statement_cache_size": 0, '
            '"prepared_statement_cache_size": 0} (docs/reliability.md, "PgBouncer")'
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


class IdCollisionError(StoreError):
    """A ``Submitted`` reuses the id of a different task (another seq, arrival, key, payload,
    ...); nothing of its batch was written. Not transient: the same batch fails again. The
    same submission sent again is not a collision (a no-op). ``ids`` are the ids named."""

    def __init__(self, ids: list[int], *, in_batch: bool = False) -> None:
        named = ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        where = "another Submitted in the same batch" if in_batch else "a different stored task"
        super().__init__(
            f"task id {named or '(gone when looked up)'} already taken by {where}: nothing of "
            "the batch was written (issue ids from Recovered.next_id, see task_id)"
        )
        self.ids = ids


class KeyTakenError(StoreError):
    """A ``Submitted`` gives a live task a key that another live task holds (keys are unique
    among live tasks; a finished task releases its key); nothing of its batch was written.
    Not transient: the same batch fails again. ``keys`` are every key of the batch taken so,
    sorted (empty only when the holders were gone when looked up). A batch that also reuses
    a stored id raises ``IdCollisionError`` instead: the batch is not what the store holds,
    so its keys mean nothing yet."""

    def __init__(self, keys: list[str]) -> None:
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        named = ", ".join(map(show, keys[:5])) + more or "(gone when looked up)"
        super().__init__(
            f"committing a batch failed: {'keys' if len(keys) > 1 else 'key'} {named} "
            "held by another live task or given twice by the batch (a key is unique among "
            "live tasks): nothing of the batch was written"
        )
        self.keys = keys


class BatchTooLargeError(StoreError):
    """A batch (or one submission) is too large to commit in one transaction; never retried.

    PostgreSQL refuses a protocol message over 1 GiB by closing the connection, which would
    look like an outage; the store refuses such a batch before sending anything instead.
    """


class CommitterClosedError(StoreError):
    """The group committer was closed before this submission could be committed or confirmed.

    Raised by ``GroupCommitter.submit`` after ``GroupCommitter.close``, and given to pending
    submitters that a close without draining (or a drain that timed out) abandons. The
    message says whether the submission may nonetheless have been committed.
    """
