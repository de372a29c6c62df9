"""Alembic, one cluster schema at a time: the environment ``env.py`` runs, and upgrades from code.

Every run for a schema happens in one transaction that first takes
``pg_advisory_xact_lock(0x63726f6d, hashtext(schema))``: concurrent upgrades serialize (the
second finds the schema at head) and a failed upgrade leaves nothing behind, the schema's
creation included. Alembic's ALTER-type operations ignore ``schema_translate_map``, so the
transaction runs under ``SET LOCAL search_path`` instead; the version table is
``<schema>.cronoq_alembic_version``.

Before migrating, the run refuses what it cannot handle safely: a database newer than this
build, and ``cronoq_*`` tables owned by a role that is neither the connecting role nor a
superuser (their owner controls triggers that would run as us). A schema created by the
hand-rolled ``cronoq_schema_version`` table of earlier builds is adopted: stamped at the
matching revision, then upgraded; revision 0006 drops the old table.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateSchema

from . import migration_lock
from .errors import MigrationError, translate_error
from .schema import VERSION_TABLE, metadata, validate_schema_name
from .urls import async_url, scrub

__all__ = [
    "LEGACY_REVISIONS",
    "LOCK_NS_MIGRATE",
    "alembic_config",
    "head_revision",
    "run_environment",
    "upgrade",
]

#: First key of the advisory lock that serializes migrations of one schema ("crom").
LOCK_NS_MIGRATE = 0x63726F6D
#: The revision each version of the hand-rolled ``cronoq_schema_version`` table matches.
LEGACY_REVISIONS = {
    1: "0001_base",
    2: "0002_leader_max_id",
    3: "0003_recurring_last_task_id",
    4: "0004_task_labels",
    5: "0005_task_tenant",
}
_LEGACY_TABLE = "cronoq_schema_version"
_URL_ENV = "CRONOQ_DATABASE_URL"


def script_location() -> Path:
    """The migrations: packaged inside the wheel, or ``alembic/`` beside a source checkout."""
    package = Path(__file__).resolve().parent
    packaged = package / "_alembic"
    return packaged if packaged.is_dir() else package.parent / "alembic"


def alembic_config(schema: str, connection: Connection | AsyncEngine | None = None) -> Config:
    """An Alembic ``Config`` for ``schema`` that needs no ``alembic.ini`` (as from a wheel)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.attributes["schema"] = validate_schema_name(schema)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision this build knows."""
    head = ScriptDirectory(str(script_location())).get_current_head()
    assert head is not None, "the migrations have a single head"
    return head


async def upgrade(bind: AsyncEngine | AsyncConnection, schema: str, revision: str = "head") -> None:
    """Upgrade ``schema`` to ``revision`` in one transaction (idempotent, serialized).

    Given an ``AsyncConnection`` that is already in a transaction, the caller commits;
    otherwise this commits. Errors are :class:`~cronoq_store.StoreError`. Runs in this
    process take turns (:mod:`cronoq_store.migration_lock`): any number of stores may open
    at once, on one loop or on several.
    """
    validate_schema_name(schema)

    def run(sync_conn: Connection) -> None:
        cfg = alembic_config(schema, sync_conn)
        cfg.attributes[migration_lock.HELD] = True
        command.upgrade(cfg, revision)

    try:
        async with migration_lock.held_async():
            await _upgrade_on(bind, run)
    except (CommandError, MigrationError) as exc:
        raise (exc if isinstance(exc, MigrationError) else MigrationError(str(exc))) from exc
    except Exception as exc:
        raise translate_error(exc, f"migrating schema {schema!r}") from exc


async def _upgrade_on(
    bind: AsyncEngine | AsyncConnection, run: Callable[[Connection], None]
) -> None:
    if isinstance(bind, AsyncEngine):
        async with bind.connect() as conn:
            await conn.run_sync(run)
            await conn.commit()
    else:
        await bind.run_sync(run)


async def require_head(engine: AsyncEngine, schema: str) -> None:
    """Raise :class:`~cronoq_store.MigrationError` unless ``schema`` is at this build's head.

    What a store opened with ``migrate=False`` checks instead of migrating: a runtime role
    without DDL rights can read the version, and a schema that ops have not upgraded yet
    (or that a newer build upgraded) is refused with the revisions named.
    """
    validate_schema_name(schema)

    def current(sync_conn: Connection) -> tuple[str, ...]:
        context = MigrationContext.configure(
            sync_conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
        )
        return context.get_current_heads()

    try:
        async with engine.connect() as conn:
            heads = await conn.run_sync(current)
    except Exception as exc:
        raise translate_error(exc, f"reading the revision of schema {schema!r}") from exc
    head = head_revision()
    if heads != (head,):
        found = ", ".join(heads) if heads else "not migrated"
        raise MigrationError(
            f"schema {schema!r} is at revision {found}; this build of cronoq-store needs "
            f"{head!r}: run `cronoq-store migrate` (or `alembic upgrade head`) with a role "
            "that owns the schema, or open the store with migrate=True"
        )


# --- the environment, run by alembic/env.py -------------------------------------------------


def run_environment(context: EnvironmentContext) -> None:
    """Run the migration Alembic asked for, offline (``--sql``) or against a database.

    The connection comes from ``config.attributes["connection"]`` (a sync ``Connection`` from
    ``AsyncConnection.run_sync``, an ``AsyncEngine`` or an ``Engine``), else from
    ``-x url=...``, ``$CRONOQ_DATABASE_URL`` or ``sqlalchemy.url``. The schema comes from
    ``attributes["schema"]`` or ``-x schema=NAME`` (default ``public``). One run at a time
    in this process (:mod:`cronoq_store.migration_lock`).
    """
    context = migration_lock.resolve(context)
    with migration_lock.held(context):
        _run_environment(context)


def _run_environment(context: EnvironmentContext) -> None:
    config = context.config
    from_cli = config.cmd_opts is not None
    try:
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
        # else is a driver's traceback; a URL written into the message is masked.
        known = isinstance(exc, (MigrationError, ValueError))
        raise CommandError(scrub(str(exc if known else translate_error(exc, "migrating")))) from exc


def _schema_of(context: EnvironmentContext) -> str:
    schema = context.config.attributes.get("schema")
    if schema is None:
        schema = context.get_x_argument(as_dictionary=True).get("schema", "public")
    return validate_schema_name(schema)


def _url_of(context: EnvironmentContext) -> str:
    x_args = context.get_x_argument(as_dictionary=True)
    url = (
        x_args.get("url")
        or os.environ.get(_URL_ENV)
        or context.config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise MigrationError(f"no database URL: pass -x url=postgresql://... or set ${_URL_ENV}")
    return url


def _configure(context: EnvironmentContext, schema: str, **kwargs: Any) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        include_name=_include_name,
        compare_type=True,
        transaction_per_migration=False,
        **kwargs,
    )


def _include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Compare only the cluster's own tables (``None`` is the schema in the search path)."""
    if type_ == "schema":
        return True
    if type_ == "table":
        return name is not None and name != VERSION_TABLE and name in metadata.tables
    return True


def _lock(schema: str) -> Any:
    return select(func.pg_advisory_xact_lock(LOCK_NS_MIGRATE, func.hashtext(schema)))


def _search_path(conn_dialect: Any, schema: str) -> Any:
    # `schema` passed validate_schema_name; quoting keeps its case.
    quoted = conn_dialect.identifier_preparer.quote_identifier(schema)
    return text(f"SET LOCAL search_path TO {quoted}")


def _run_offline(context: EnvironmentContext, schema: str) -> None:
    """Print a script a DBA can review; it takes the same lock and search path."""
    _configure(context, schema, dialect_name="postgresql", literal_binds=True)
    dialect = context.get_context().dialect
    with context.begin_transaction():
        context.execute(_lock(schema))
        context.execute(CreateSchema(schema, if_not_exists=True))
        context.execute(_search_path(dialect, schema))
        context.run_migrations()


def _run_online(context: EnvironmentContext, schema: str) -> None:
    bind = context.config.attributes.get("connection")
    if bind is None:
        engine = create_async_engine(async_url(_url_of(context)), poolclass=NullPool)
        _run_coroutine(lambda: _run_async(context, schema, engine, dispose=True))
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
    try:
        async with engine.connect() as conn:
            await conn.run_sync(lambda sync_conn: _migrate(context, schema, sync_conn))
            await conn.commit()
    finally:
        if dispose:
            await engine.dispose()


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


def _migrate(context: EnvironmentContext, schema: str, conn: Connection) -> None:
    _configure(context, schema, connection=conn)
    with context.begin_transaction():
        conn.execute(_lock(schema))
        conn.execute(CreateSchema(schema, if_not_exists=True))
        conn.execute(_search_path(conn.dialect, schema))
        _refuse_foreign_tables(conn, schema)
        _adopt_legacy(context, conn)
        _refuse_newer(context, schema)
        context.run_migrations()


def _refuse_foreign_tables(conn: Connection, schema: str) -> None:
    # `pg_has_role` would accept anything for a superuser connection, the case where a
    # planted trigger gains the most: only this role or a superuser may own the tables.
    foreign = (
        conn.execute(
            text(
                "SELECT c.relname::text FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "JOIN pg_roles o ON o.oid = c.relowner "
                "WHERE n.nspname = :schema AND c.relname LIKE 'cronoq\\_%' "
                "AND o.rolname <> current_user AND NOT o.rolsuper ORDER BY 1"
            ),
            {"schema": schema},
        )
        .scalars()
        .all()
    )
    if foreign:
        raise MigrationError(
            f"schema {schema!r} holds cronoq tables owned by another role "
            f"({', '.join(foreign)}); refusing to use them: they must belong to the "
            "connecting role or a superuser"
        )


def _adopt_legacy(context: EnvironmentContext, conn: Connection) -> None:
    """Stamp a schema made by the hand-rolled versioning at the revision it matches."""
    migration = context.get_context()
    if migration.get_current_heads():
        return
    has_legacy = conn.execute(
        text("SELECT to_regclass(:name) IS NOT NULL"), {"name": _LEGACY_TABLE}
    ).scalar_one()
    if not has_legacy:
        if conn.execute(text("SELECT to_regclass('cronoq_tasks') IS NOT NULL")).scalar_one():
            raise MigrationError(
                "the schema holds cronoq tables but no version table: it was not created by "
                "cronoq-store's migrations; move the tables aside or stamp the revision they "
                "match with `alembic stamp`"
            )
        return
    version = conn.execute(
        text(f"SELECT version FROM {_LEGACY_TABLE} WHERE id = 1")  # noqa: S608 (constant)
    ).scalar_one_or_none()
    if version is None or version == 0:
        return  # the legacy run never committed a migration: nothing to adopt
    revision = LEGACY_REVISIONS.get(version)
    if revision is None:
        raise MigrationError(
            f"{_LEGACY_TABLE} records version {version}, newer than this build knows "
            f"(1..{max(LEGACY_REVISIONS)})"
        )
    assert context.script is not None
    migration.stamp(context.script, revision)


def _refuse_newer(context: EnvironmentContext, schema: str) -> None:
    assert context.script is not None
    for current in context.get_context().get_current_heads():
        try:
            context.script.get_revision(current)
        except CommandError:
            raise MigrationError(
                f"schema {schema!r} is at revision {current!r}, which this build of "
                f"cronoq-store does not know (its newest is {head_revision()!r}): the database "
                "was migrated by a newer version; upgrade cronoq-store instead"
            ) from None
