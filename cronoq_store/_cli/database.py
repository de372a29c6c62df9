"""The command's connection to the cluster's schema, and where that schema stands.

One pool-less engine per command, the cluster's schema applied at execution as the store
does, ``search_path`` kept to ``pg_catalog, pg_temp``; the schema is checked for objects an
untrusted role controls before any command reads it. A URL that is not a PostgreSQL URL is
a usage error (2), failing to connect is exit code 3; a schema that is not at this build's
head is 4, one that a newer build migrated 5. No statement waits longer than
``--lock-wait`` (:data:`LOCK_WAIT` by default) for a lock another session holds (a
migration's, or any session's lock on the cluster's tables): the command then exits 9
naming who held it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .. import _catalog as catalog
from .. import _door as door
from .._door import CONNECT_TIMEOUT, describe_holders, holder_of
from .._errors import MigrationError, StoreError
from .._migrations import RevisionStatus, clusters_elsewhere, revision_status
from .._schema import schema_options
from .._statements import CLUSTER_TABLES
from .._trust import refuse_untrusted, untrusted_among
from .._urls import redact
from .app import LOCK_WAIT, SCHEMA_ENV, Options
from .exits import CliError, ExitCode

__all__ = [
    "CONNECT_TIMEOUT",
    "LOCK_WAIT",
    "Vetted",
    "database",
    "engine",
    "refuse_unless_at_head",
    "require_head",
    "revision",
    "vet",
]


def engine(url: str, *, lock_wait: float = LOCK_WAIT, pool_size: int = 0) -> AsyncEngine:
    """The command's engine (:func:`~cronoq_store._door.command_engine`): pool-less, or
    keeping ``pool_size`` connections open (the console's); every statement waits
    ``lock_wait`` seconds at most for a lock."""
    try:
        return door.command_engine(
            url, application_name="cronoq-store cli", lock_timeout=lock_wait, pool_size=pool_size
        )
    except ValueError as exc:  # the messages of urls' refusals are already masked
        # A URL that cannot name a PostgreSQL server (another scheme, unparsable, a keyword
        # DSN, a parameter the store refuses) is the operator's to fix: a usage error,
        # found before anything connects.
        raise CliError(str(exc), ExitCode.USAGE) from None


@dataclass(frozen=True)
class Vetted:
    """Schemas in which the trust check, run by :func:`vet` on ``engine`` with
    ``trusted_triggers``, found nothing to refuse: :func:`database` opens them on that
    engine without checking each again."""

    schemas: frozenset[str]
    trusted_triggers: frozenset[str]
    engine: AsyncEngine

    def covers(self, options: Options, pooled: AsyncEngine | None) -> bool:
        """Whether this check stands for the one :func:`database` would run."""
        return (
            pooled is self.engine
            and options.schema in self.schemas
            and options.trusted_triggers == self.trusted_triggers
        )


async def vet(
    pooled: AsyncEngine, schemas: Sequence[str], trusted_triggers: frozenset[str]
) -> tuple[Vetted, dict[str, MigrationError]]:
    """The trust check of all of ``schemas`` in one statement (``trust.untrusted_among``:
    checking each alone reads the catalogs again, at thousands of schemas most of the
    time a schema takes): those it found nothing in, and the refusal of each other one."""
    async with door.translated("checking the schemas"), pooled.connect() as conn:
        refused = await conn.run_sync(untrusted_among, schemas, trusted_triggers)
        await conn.rollback()
    return Vetted(frozenset(schemas) - refused.keys(), trusted_triggers, pooled), refused


@asynccontextmanager
async def database(
    options: Options, pooled: AsyncEngine | None = None, vetted: Vetted | None = None
) -> AsyncIterator[AsyncConnection]:
    """One connection with the cluster's schema applied, after the trust check
    (``trust.refuse_untrusted``); failing to open it is exit code 3. From ``pooled``
    when given (the caller's long-lived engine), else from an engine of its own. Without
    the check when ``vetted`` (:func:`vet`) already found nothing in this schema. Its
    statements wait ``options.lock_wait`` for a lock (``pooled`` is made with that bound)."""
    url = options.database_url()
    made = engine(url, lock_wait=options.lock_wait) if pooled is None else pooled
    try:
        try:
            async with door.translated("connecting"):
                conn = await made.execution_options(**schema_options(options.schema)).connect()
        except StoreError as reason:
            raise CliError(
                f"cannot connect to {redact(url)}: {reason}", ExitCode.UNREACHABLE
            ) from None
        try:
            if not options.schema_chosen:
                await _refuse_defaulted_schema(conn, options.schema)
            if vetted is None or not vetted.covers(options, pooled):
                await conn.run_sync(refuse_untrusted, options.schema, options.trusted_triggers)
                await conn.rollback()
            try:
                async with door.separating_lock_waits("running the command"):
                    yield conn
            except door.LockNotAvailable:
                raise await _lock_held(conn, options) from None
        finally:
            await conn.close()
    finally:
        if pooled is None:
            await made.dispose()


async def _lock_held(conn: AsyncConnection, options: Options) -> CliError:
    """Exit 9 for a statement that waited ``options.lock_wait`` for the cluster's tables,
    naming the sessions that hold them exclusively (a migration's DDL, a ``LOCK TABLE``)."""
    schema = options.schema
    await conn.rollback()
    rows = (
        await conn.execute(
            catalog.table_lock_holders,
            {
                "schema": schema,
                "tables": list(CLUSTER_TABLES),
                # What a read (ACCESS SHARE) waits for.
                "modes": list(catalog.LOCK_MODES[-1:]),
            },
        )
    ).all()
    await conn.rollback()
    holders = [h for h in (holder_of(row, store_instance=False) for row in rows) if h]
    return CliError(
        f"gave up after {options.lock_wait:g} s waiting for a lock on the tables of schema "
        f"{schema!r}, held by {describe_holders(holders)}",
        ExitCode.LOCK_HELD,
    )


async def _refuse_defaulted_schema(conn: AsyncConnection, schema: str) -> None:
    """Exit 2 when no schema was named, the default holds no cluster and other schemas do:
    the operator most likely forgot ``--schema``, and the default would show (or, for
    ``migrate``, create) an empty one."""
    found = await conn.run_sync(clusters_elsewhere, schema)
    await conn.rollback()
    if found:
        raise CliError(
            f"no --schema given (nor ${SCHEMA_ENV}) and schema {schema!r} holds no cronoq "
            f"cluster; the clusters in this database are in: {', '.join(found)}; pass "
            f"--schema NAME (--schema {schema} to use {schema!r} anyway)",
            ExitCode.USAGE,
        )


async def revision(conn: AsyncConnection, schema: str) -> RevisionStatus:
    """Where ``schema`` stands; no transaction is left open (an upgrade or a long command
    may follow)."""
    status = await conn.run_sync(revision_status, schema)
    await conn.rollback()
    return status


def refuse_unless_at_head(status: RevisionStatus) -> None:
    """Exit 5 for a schema a newer build migrated, 4 for one missing or behind."""
    try:
        status.require_head(f"run `cronoq-store --schema {status.schema} migrate`")
    except MigrationError as exc:
        code = ExitCode.NEWER_DATABASE if status.unknown else ExitCode.NOT_MIGRATED
        raise CliError(str(exc), code) from None


async def require_head(conn: AsyncConnection, schema: str) -> None:
    """Refuse a schema this build cannot read: missing, behind, or newer."""
    refuse_unless_at_head(await revision(conn, schema))
