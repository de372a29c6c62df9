"""Alembic's environment: what ``alembic/env.py`` runs for every command, offline
(``--sql``) or against a database, for one cluster schema.

The run takes the process's migration turn (:mod:`cronoq_store._migrations`), finds
its connection and schema, refuses what it cannot handle safely (a schema another role
controls, a database newer than this build, a downgrade under a live leader), adopts the
version table of earlier builds, and migrates in one transaction under the schema's
advisory lock (:mod:`cronoq_store._migrations` says what every run promises).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import configparser
import contextlib
import os
from collections.abc import Callable, Coroutine, Iterable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext, RevisionStep
from alembic.util import CommandError
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    column,
    select,
    table,
)
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateSchema

from . import _catalog as catalog
from . import _door as door
from . import _lock_waits as lock_waits
from . import _migrations as migrations
from . import _statements as st
from ._config import MIGRATION_LOCK_TIMEOUT, trusted_trigger_names, validate_schema_name
from ._domain import check_seconds
from ._errors import MigrationError, StoreError
from ._lock_waits import LockWait
from ._migrations import (
    CONNECT_TIMEOUT,
    LEGACY_REVISIONS,
    LOCK_TIMEOUT,
    TRUSTED_TRIGGERS,
    newer_message,
    revision_status,
    unknown_revisions,
)
from ._schema import LEGACY_VERSION_TABLE, VERSION_TABLE, metadata
from ._terminal_safe import visible
from ._trust import refuse_untrusted
from ._urls import (
    URL_ENV,
    engine_arguments,
    redact,
    scrub,
)

__all__ = ["BOUND_SETTINGS", "clusters_elsewhere", "run_environment"]

#: Where a migration's bound on its lock waits is set, for its log lines and errors.
BOUND_SETTINGS = (
    "the bound is PgStoreConfig.migration_lock_timeout, cronoq-store migrate --lock-timeout, "
    "alembic -x lock_timeout="
)


def run_environment(context: EnvironmentContext) -> None:
    """Run the migration Alembic asked for, offline (``--sql``) or against a database.

    The connection comes from ``config.attributes["connection"]`` (a sync ``Connection`` from
    ``AsyncConnection.run_sync``, an ``AsyncEngine`` or an ``Engine``), else from
    ``-x url=...``, ``$CRONOQ_DATABASE_URL`` or ``sqlalchemy.url``. The schema comes from
    ``attributes["schema"]`` or ``-x schema=NAME`` (default ``public``). One run at a time
    in this process (:mod:`cronoq_store._migrations`). A downgrade is refused under a
    live leader unless ``attributes["force"]`` or ``-x force=true``
    (:mod:`cronoq_store._migrations`).
    """
    context = migrations.resolve(context)  # refuses another command's context
    with migrations.held(context):
        _run_environment(context)


def _run_environment(context: EnvironmentContext) -> None:
    config = context.config
    from_cli = config.cmd_opts is not None
    # From the command line, every failure through the door: one line, not a traceback;
    # from code, the caller (:func:`cronoq_store._migrations.upgrade`) names the schema.
    translating: AbstractContextManager[None] = (
        door.translated_sync("migrating", passing=(CommandError, ValueError))
        if from_cli
        else contextlib.nullcontext()
    )
    try:
        with translating:
            schema = _schema_of(context)
            if context.is_offline_mode():
                _run_offline(context, schema)
            else:
                _run_online(context, schema)
    except CommandError:
        raise
    except Exception as exc:
        if not from_cli:
            raise
        # Alembic's command line prints a CommandError as one clear line, where anything
        # else is a driver's traceback; a URL written into the message is masked, and what
        # it quotes made safe for a terminal.
        raise CommandError(visible(scrub(str(exc)))) from exc


def _schema_of(context: EnvironmentContext) -> str:
    schema = context.config.attributes.get("schema")
    if schema is None:
        schema = context.get_x_argument(as_dictionary=True).get("schema", "public")
    return validate_schema_name(schema)


def _url_of(context: EnvironmentContext) -> str:
    x_args = context.get_x_argument(as_dictionary=True)
    url = x_args.get("url") or os.environ.get(URL_ENV) or _ini_url(context.config)
    if not url:
        raise MigrationError(f"no database URL: pass -x url=postgresql://... or set ${URL_ENV}")
    return url


def _ini_url(config: Config) -> str | None:
    """``sqlalchemy.url`` from the ini file. A percent-encoded password (``%40``) is not
    configparser interpolation: a value that does not interpolate is taken as written,
    since configparser's error would quote it, password and all."""
    try:
        return config.get_main_option("sqlalchemy.url")
    except configparser.Error:
        return config.file_config.get(config.config_ini_section, "sqlalchemy.url", raw=True)


def _configure(
    context: EnvironmentContext, schema: str, wait: LockWait | None = None, **kwargs: Any
) -> None:
    """``wait``: the run's wait for locks (online only), which also bounds its wait for the
    cluster's tables before the first revision's DDL."""
    connection = kwargs.get("connection")
    # Autogenerate calls the engine's default schema None.
    default = None if connection is None else connection.dialect.default_schema_name
    compared = None if schema == default else schema

    def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
        """Compare only the cluster's schema and its own tables."""
        if type_ == "schema":
            return name == compared
        if type_ == "table":
            return name is not None and name != VERSION_TABLE and name in metadata.tables
        return True

    context.configure(
        target_metadata=_in_schema(schema),
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_schemas=True,
        include_name=include_name,
        compare_type=True,
        transaction_per_migration=False,
        # Every downgrade checks for a live leader before its first step, in the run's
        # transaction (:mod:`cronoq_store._migrations`); then a run with steps to take
        # locks the tables, bounded.
        fn=_locking_tables(
            migrations.guarded(context, schema, connection, wait), connection, schema, wait
        ),
        **kwargs,
    )


def _locking_tables(
    fn: Callable[[Any, MigrationContext], Iterable[Any]] | None,
    conn: Connection | None,
    schema: str,
    wait: LockWait | None,
) -> Callable[[Any, MigrationContext], Iterable[Any]] | None:
    """The command's migration function, locking the cluster's tables (bounded, holders
    named: :func:`~cronoq_store._lock_waits.lock_tables`) before the first step that runs a
    revision: its DDL then never queues behind a transaction, with every commit queued
    behind it. A run with nothing to do locks nothing."""
    if fn is None or conn is None or wait is None:
        return fn
    checked = fn

    def steps(heads: Any, migration: MigrationContext) -> list[Any]:
        planned = list(checked(heads, migration))
        if any(isinstance(step, RevisionStep) for step in planned):
            lock_waits.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
        return planned

    return steps


def _lock_wait(context: EnvironmentContext, schema: str) -> LockWait:
    """The run's wait for the migration lock: ``attributes["lock_timeout"]`` or ``-x
    lock_timeout=SECONDS`` seconds at most (:data:`MIGRATION_LOCK_TIMEOUT` if neither)."""
    given = context.config.attributes.get(LOCK_TIMEOUT)
    if given is None:
        given = context.get_x_argument(as_dictionary=True).get(LOCK_TIMEOUT)
    try:
        bound = (
            MIGRATION_LOCK_TIMEOUT if given is None else check_seconds(LOCK_TIMEOUT, float(given))
        )
    except ValueError:
        raise MigrationError(
            f"{LOCK_TIMEOUT} must be a positive number of seconds, got {given!r}"
        ) from None
    return LockWait(f"the migration lock of schema {schema!r}", bound, BOUND_SETTINGS)


def _in_schema(schema: str) -> MetaData:
    """The tables in ``schema``, for ``alembic check``: with the schema off ``search_path``,
    autogenerate compares schema-qualified tables."""
    copy = MetaData(naming_convention=metadata.naming_convention)
    for table_ in metadata.tables.values():
        table_.to_metadata(copy, schema=schema)
    return copy


def _run_offline(context: EnvironmentContext, schema: str) -> None:
    """Print a script a DBA can review; it takes the same lock and search path, and stops
    before any DDL if the schema belongs to a role other than the one running it that is not
    a superuser (:data:`~cronoq_store._statements.refuse_foreign_owner`; the online check of
    every object in the schema is not in the script). Its waits for locks give up after the
    run's bound (``-x lock_timeout``), as ``lock_timeout`` errors."""
    bound = _lock_wait(context, schema).bound
    _configure(context, schema, dialect_name="postgresql", literal_binds=True)
    with context.begin_transaction():
        context.execute(st.local_search_path)
        context.execute(st.set_local_lock_timeout.params(ms=str(round(bound * 1000))))
        context.execute(st.wait_migration_lock.params(schema=schema))
        context.execute(CreateSchema(schema, if_not_exists=True))
        context.execute(st.checked_schema(schema))
        context.execute(st.refuse_foreign_owner)
        context.run_migrations()


def _run_online(context: EnvironmentContext, schema: str) -> None:
    bind = context.config.attributes.get("connection")
    if bind is None:
        url = _url_of(context)
        dialled, tls = engine_arguments(url)
        engine = create_async_engine(
            dialled,
            poolclass=NullPool,
            connect_args={
                "timeout": CONNECT_TIMEOUT,
                "server_settings": {"search_path": st.SEARCH_PATH},
                **tls,
            },
        )
        try:
            _run_coroutine(lambda: _run_async(context, schema, engine, dispose=True))
        except _ConnectFailed as failed:
            # The command line's one line names the server it could not reach, masked; no
            # colon after the URL, which a ?password=*** would run into when scrubbed.
            reason = failed.__cause__
            raise MigrationError(f"cannot connect to {redact(url)} ({reason})") from failed
    elif isinstance(bind, AsyncEngine):
        _run_coroutine(lambda: _run_async(context, schema, bind, dispose=False))
    elif isinstance(bind, Connection):
        _migrate(context, schema, bind)
    elif isinstance(bind, Engine):
        with bind.connect() as conn:
            _migrate(context, schema, conn)
            conn.commit()
    else:
        raise TypeError(
            "config.attributes['connection'] must be a Connection (use "
            "AsyncConnection.run_sync), an AsyncEngine or an Engine, "
            f"not {type(bind).__name__}"
        )


async def _run_async(
    context: EnvironmentContext, schema: str, engine: AsyncEngine, *, dispose: bool
) -> None:
    # The application's engine: its caller translates the error.
    connecting: AbstractAsyncContextManager[None] = (
        door.translated("connecting") if dispose else contextlib.nullcontext()
    )
    try:
        try:
            async with connecting:
                conn = await engine.connect()
        except StoreError as reason:
            if not dispose:
                raise
            raise _ConnectFailed from reason
        try:
            await conn.run_sync(lambda sync_conn: _migrate(context, schema, sync_conn))
            await conn.commit()
        finally:
            await conn.close()
    finally:
        if dispose:
            await engine.dispose()


class _ConnectFailed(Exception):
    """The engine made from a URL could not connect (the cause, a store error, says why)."""


def _run_coroutine(make: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a coroutine to completion from sync code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(make())
        return
    # A host application's loop is running in this thread: asyncio.run would refuse, so the
    # migration gets a loop of its own in a worker thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: asyncio.run(make())).result()


def clusters_elsewhere(conn: Connection, schema: str) -> list[str]:
    """The schemas that hold a cluster, when ``schema`` holds none and others do; else
    empty. For a schema nobody named (the ``public`` default) that means the operator most
    likely forgot to name one: ``cronoq-store`` and Alembic's env both refuse it then,
    rather than show, or create, an empty cluster beside the real ones."""
    found = list(conn.execute(catalog.cluster_schemas).scalars())
    return found if found and schema not in found else []


def _schema_named(context: EnvironmentContext) -> bool:
    return context.config.attributes.get(
        "schema"
    ) is not None or "schema" in context.get_x_argument(as_dictionary=True)


def _refuse_defaulted_schema(context: EnvironmentContext, schema: str, conn: Connection) -> None:
    """The CLI's rule (:func:`clusters_elsewhere`), worded for Alembic's command line."""
    if _schema_named(context):
        return
    elsewhere = clusters_elsewhere(conn, schema)
    if elsewhere:
        raise MigrationError(
            f"no -x schema=NAME given and schema {schema!r} holds no cronoq cluster; the "
            f"clusters in this database are in: {', '.join(elsewhere)}; pass -x schema=NAME "
            f"(-x schema={schema} to use {schema!r} anyway)"
        )


def _command_name(context: EnvironmentContext) -> str:
    """The Alembic command this run is (``current``, ``downgrade``...), or ``""`` when
    called from code."""
    command_line = getattr(context.config.cmd_opts, "cmd", None)
    return "" if command_line is None else getattr(command_line[0], "__name__", "")


def _migrate(context: EnvironmentContext, schema: str, conn: Connection) -> None:
    wait = _lock_wait(context, schema)
    _configure(context, schema, wait, connection=conn)
    with context.begin_transaction():
        conn.execute(st.local_search_path)
        lock_waits.take_migration_lock(conn, schema, wait)
        _refuse_defaulted_schema(context, schema, conn)
        command = _command_name(context)
        if command in ("current", "downgrade") and not revision_status(conn, schema).current:
            # `current` would print nothing and a downgrade do nothing (both creating the
            # schema) and exit 0: say why instead; a downgrade of a typo fails.
            said = f"schema {schema!r} holds no cronoq cluster (not migrated)"
            if command == "downgrade":
                raise MigrationError(f"{said}: nothing to downgrade")
            context.config.print_stdout(f"{said}: nothing to show")
            return
        # Created first (a no-op if it exists) and then checked: a schema that another role
        # creates between a check and our CREATE ... IF NOT EXISTS is still refused.
        conn.execute(CreateSchema(schema, if_not_exists=True))
        trusted = _trusted_of(context)
        refuse_untrusted(conn, schema, trusted)
        if _autogenerating(context) and schema == conn.dialect.default_schema_name:
            # Autogenerate (`alembic check`) reflects the engine's default schema as "the
            # tables visible on search_path"; it just passed the trust check above.
            quoted = conn.dialect.identifier_preparer.quote_identifier(schema)
            conn.execute(st.set_local_search_path, {"path": f"pg_catalog, {quoted}, pg_temp"})
        _adopt_legacy(context, conn, schema)
        _refuse_newer(context, schema)
        context.run_migrations()
        # Again, in the same transaction: the tables just created may carry default privileges
        # (ALTER DEFAULT PRIVILEGES ... GRANT ALL ON TABLES) that let another role plant a
        # trigger; a refusal here rolls the whole migration back.
        refuse_untrusted(conn, schema, trusted)


def _trusted_of(context: EnvironmentContext) -> frozenset[str]:
    """The trusted triggers: ``attributes["trusted_triggers"]`` or ``-x trusted_triggers=a,b``."""
    trusted = context.config.attributes.get(TRUSTED_TRIGGERS)
    if trusted is None:
        given = context.get_x_argument(as_dictionary=True).get(TRUSTED_TRIGGERS, "")
        trusted = [name.strip() for name in given.split(",") if name.strip()]
    return trusted_trigger_names(trusted)


def _autogenerating(context: EnvironmentContext) -> bool:
    """Whether this run compares the database with the model (``alembic check``)."""
    environment = context.get_context().environment_context
    return environment is not None and "revision_context" in environment.context_opts


def _adopt_legacy(context: EnvironmentContext, conn: Connection, schema: str) -> None:
    """Stamp a schema made by the hand-rolled versioning at the revision it matches."""
    migration = context.get_context()
    if migration.get_current_heads():
        return

    def exists(name: str) -> bool:
        found = conn.execute(catalog.relation_exists, {"schema": schema, "name": name})
        return bool(found.scalar_one())

    if not exists(LEGACY_VERSION_TABLE):
        if exists("cronoq_tasks"):
            raise MigrationError(
                "the schema holds cronoq tables but no version table: it was not created by "
                "cronoq-store's migrations; move the tables aside or stamp the revision they "
                "match with `alembic stamp`"
            )
        return
    legacy = table(LEGACY_VERSION_TABLE, column("id"), column("version"), schema=schema)
    version = conn.execute(select(legacy.c.version).where(legacy.c.id == 1)).scalar_one_or_none()
    if version is None or version == 0:
        return  # the legacy run never committed a migration: nothing to adopt
    revision = LEGACY_REVISIONS.get(version)
    if revision is None:
        raise MigrationError(
            f"{LEGACY_VERSION_TABLE} records version {version}, newer than this build knows "
            f"(1..{max(LEGACY_REVISIONS)})"
        )
    assert context.script is not None
    migration.stamp(context.script, revision)


def _refuse_newer(context: EnvironmentContext, schema: str) -> None:
    assert context.script is not None
    unknown = unknown_revisions(context.script, context.get_context().get_current_heads())
    if unknown:
        raise MigrationError(newer_message(schema, unknown))
