"""Alembic, one cluster schema at a time: the environment ``env.py`` runs, and upgrades from code.

Every run for a schema happens in one transaction that first takes
``pg_advisory_xact_lock(0x63726f6d, hashtext(schema))``: concurrent upgrades serialize (the
second finds the schema at head) and a failed upgrade leaves nothing behind, the schema's
creation included. The transaction runs under ``search_path = pg_catalog, pg_temp``: the
cluster's schema is never on it (a role that can write there could plant an operator that a
catalog lookup would run as us, CVE-2018-1058), so every operation in the revisions names
its schema (:func:`cluster_schema`); the version table is ``<schema>.cronoq_alembic_version``.

Before migrating, the run refuses what it cannot handle safely: a schema, or anything in it,
that a role we cannot trust owns or may create in, or any trigger on our tables that the
operator did not name (:func:`refuse_untrusted`, which every entry point runs before it
touches the schema; a migration runs it again after its last revision, in its
transaction, and the lock session at each acquisition), and a database newer than this build. A
schema created by the hand-rolled ``cronoq_schema_version`` table of earlier builds is
adopted: stamped at the matching revision, then upgraded; revision 0006 drops the old table.

Where a schema stands is read in one place, :func:`revision_status`: the ``cronoq-store``
commands show and check it, and a store opened with ``migrate=False`` checks it
(:func:`require_head`), so a schema behind or ahead of this build is refused in the same
words everywhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import configparser
import os
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from alembic import command, op
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    column,
    func,
    select,
    table,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import CreateSchema

from . import _catalog as catalog
from . import _downgrade_guard as downgrade_guard
from . import _lock_statements as lock_st
from . import _migration_lock as migration_lock
from . import _migration_statements as migration_st
from . import _session_statements as session_st
from ._config import trusted_trigger_names as trusted_trigger_names
from ._config import validate_schema_name as validate_schema_name
from ._driver import translate_error as translate_error
from ._errors import MigrationError as MigrationError
from ._schema import LEGACY_VERSION_TABLE as LEGACY_VERSION_TABLE
from ._schema import VERSION_TABLE as VERSION_TABLE
from ._schema import metadata as metadata
from ._terminal_safe import visible as visible
from ._trust import refuse_untrusted as refuse_untrusted
from ._urls import (
    URL_ENV as URL_ENV,
)
from ._urls import (
    engine_arguments as engine_arguments,
)
from ._urls import (
    redact as redact,
)
from ._urls import (
    scrub as scrub,
)

__all__ = [
    "CONNECT_TIMEOUT",
    "LEGACY_REVISIONS",
    "LOCK_NS_MIGRATE",
    "RevisionStatus",
    "alembic_config",
    "alembic_ini",
    "cluster_schema",
    "clusters_elsewhere",
    "downgrade",
    "downgrade_steps",
    "head_revision",
    "require_head",
    "revision_status",
    "run_command",
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
#: The tables of ours whose triggers, rules and TRIGGER grants the trust check refuses.
#: ``Config.attributes`` key (and ``-x`` argument, comma-separated) of the trusted triggers.
_TRUSTED_TRIGGERS = "trusted_triggers"
#: Seconds a silent host gets to answer Alembic's command line and the cronoq-store
#: commands: a firewall dropping packets must not hang them for asyncpg's minute.
CONNECT_TIMEOUT = 10.0

_P = ParamSpec("_P")
_R = TypeVar("_R")


def script_location() -> Path:
    """The migrations: packaged inside the wheel, or ``alembic/`` beside a source checkout."""
    package = Path(__file__).resolve().parent
    packaged = package / "_alembic"
    return packaged if packaged.is_dir() else package.parent / "alembic"


def alembic_ini() -> Path:
    """An ``alembic.ini`` for Alembic's own command line on these migrations, wherever they
    are (``alembic -c "$(cronoq-store alembic-ini)" -x schema=NAME upgrade head``): it lives
    beside ``env.py``, so an installed wheel has one too."""
    return script_location() / "alembic.ini"


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


async def upgrade(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    revision: str = "head",
    *,
    trusted_triggers: frozenset[str] = frozenset(),
) -> None:
    """Upgrade ``schema`` to ``revision`` in one transaction (idempotent, serialized).

    Given an ``AsyncConnection`` that is already in a transaction, the caller commits;
    otherwise this commits. Errors are :class:`~cronoq_store.StoreError`. Runs in this
    process take turns (:mod:`cronoq_store._migration_lock`): any number of stores may open
    at once, on one loop or on several. ``trusted_triggers``: see :func:`refuse_untrusted`.
    """
    await _run_on(bind, schema, trusted_triggers, command.upgrade, revision)


async def downgrade(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    revision: str,
    *,
    trusted_triggers: frozenset[str] = frozenset(),
    force: bool = False,
) -> None:
    """Downgrade ``schema`` to ``revision`` (``base`` removes the cluster's tables): the
    same transaction, lock and trust checks as :func:`upgrade`. What it undoes is lost,
    rows and all: :func:`downgrade_steps` says which revisions that is.

    Refused (:class:`~cronoq_store.MigrationError`) while an instance holds the leader lock,
    and to base once the cluster issued task ids, unless ``force``; forced, a live leader is
    fenced (:mod:`cronoq_store._downgrade_guard`)."""
    await _run_on(bind, schema, trusted_triggers, command.downgrade, revision, force=force)


async def _run_on(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    trusted_triggers: frozenset[str],
    alembic_command: Callable[[Config, str], None],
    revision: str,
    *,
    force: bool = False,
) -> None:
    validate_schema_name(schema)
    trusted = trusted_trigger_names(trusted_triggers)

    def run(sync_conn: Connection) -> None:
        cfg = alembic_config(schema, sync_conn)
        cfg.attributes[migration_lock.HELD] = True
        cfg.attributes[_TRUSTED_TRIGGERS] = trusted
        cfg.attributes[downgrade_guard.FORCE] = force
        alembic_command(cfg, revision)

    try:
        async with migration_lock.held_async():
            await _in_transaction(bind, run)
    except (CommandError, MigrationError) as exc:
        raise (exc if isinstance(exc, MigrationError) else MigrationError(str(exc))) from exc
    except Exception as exc:
        raise translate_error(exc, f"migrating schema {schema!r}") from exc


def downgrade_steps(current: Sequence[str], revision: str) -> tuple[str, ...]:
    """The revisions that going from ``current`` to ``revision`` would undo, newest first;
    empty when ``revision`` is not below ``current`` (it is ahead, the same, on no path
    from it, or unknown: an upgrade reports those)."""
    if len(current) != 1:
        return ()
    script = ScriptDirectory(str(script_location()))
    lower: str | None = None
    if revision != "base":
        try:
            target = script.get_revision(revision)
        except CommandError:
            return ()
        if target is None or target.revision == current[0]:
            return ()
        lower = target.revision
    try:
        return tuple(r.revision for r in script.iterate_revisions(current[0], lower))
    except (CommandError, RevisionError):
        return ()


def run_command(
    command_: Callable[Concatenate[Config, _P], _R],
    config: Config,
    *args: _P.args,
    **kwargs: _P.kwargs,
) -> _R:
    """Run an Alembic command on our migrations, e.g. ``run_command(command.upgrade, cfg,
    "head")``: the way to call ``alembic.command`` from code where other migrations may run
    at once in this process (threads, other stores opening).

    Alembic installs its module-global ``context`` proxy before ``env.py`` runs, so two raw
    ``command.*`` calls at once can see each other's; ``env.py`` then refuses the run
    (:class:`~cronoq_store.MigrationError`). Here the process's migration lock is taken
    before Alembic starts, so runs take turns instead. In a coroutine, await
    :func:`upgrade` rather than blocking the loop.
    """
    with migration_lock.held_for(config):
        return command_(config, *args, **kwargs)


async def _in_transaction(
    bind: AsyncEngine | AsyncConnection, run: Callable[[Connection], None]
) -> None:
    if isinstance(bind, AsyncEngine):
        async with bind.connect() as conn:
            await conn.run_sync(run)
            await conn.commit()
    else:
        await bind.run_sync(run)


@dataclass(frozen=True, slots=True)
class RevisionStatus:
    """Where a schema stands against this build (:func:`revision_status`): what the
    ``cronoq-store`` commands show and check, and what a store opened with ``migrate=False``
    checks."""

    schema: str
    exists: bool
    #: The revisions the schema's version table records; empty when it was never migrated.
    current: tuple[str, ...]
    #: This build's newest revision.
    head: str
    #: Recorded revisions this build does not know: a newer build migrated the schema.
    unknown: tuple[str, ...]
    #: What an upgrade to head would run, oldest first (empty when newer or missing).
    pending: tuple[str, ...]

    @property
    def at_head(self) -> bool:
        return self.current == (self.head,)

    def describe(self) -> str:
        """A few words: ``up to date``, ``missing``, ``2 revision(s) behind: ...``."""
        if not self.exists:
            return "missing"
        if not self.current:
            return "not migrated"
        if self.unknown:
            return "newer than this build"
        if self.at_head:
            return "up to date"
        return f"{len(self.pending)} revision(s) behind: {', '.join(self.pending)}"

    def require_head(self, fix: str) -> None:
        """Raise :class:`~cronoq_store.MigrationError` unless the schema is at head; ``fix``
        says how to migrate it (a newer database is fixed by upgrading cronoq-store)."""
        if self.unknown:
            raise MigrationError(_newer_message(self.schema, self.unknown))
        if not self.exists:
            raise MigrationError(f"schema {self.schema!r} does not exist: {fix}")
        if not self.current:
            raise MigrationError(f"schema {self.schema!r} is not migrated: {fix}")
        if not self.at_head:
            raise MigrationError(
                f"schema {self.schema!r} is at revision {', '.join(self.current)}, behind "
                f"this build's head {self.head}: {fix}"
            )


def revision_status(conn: Connection, schema: str) -> RevisionStatus:
    """Read where ``schema`` stands (in ``conn``'s transaction; reads only, needs no DDL
    rights). Run it after :func:`refuse_untrusted`; async callers use ``run_sync``."""
    validate_schema_name(schema)
    head = head_revision()
    exists = conn.execute(lock_st.schema_oid, {"schema": schema}).scalar() is not None
    current: tuple[str, ...] = ()
    if exists:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
        )
        current = tuple(sorted(context.get_current_heads()))
    script = ScriptDirectory(str(script_location()))
    unknown = _unknown_revisions(script, current)
    pending: tuple[str, ...] = ()
    if exists and not unknown and current != (head,):
        lower = current[0] if len(current) == 1 else None
        pending = tuple(r.revision for r in reversed(list(script.iterate_revisions(head, lower))))
    return RevisionStatus(schema, exists, current, head, unknown, pending)


def _unknown_revisions(script: ScriptDirectory, revisions: Sequence[str]) -> tuple[str, ...]:
    unknown = []
    for revision in revisions:
        try:
            script.get_revision(revision)
        except CommandError:
            unknown.append(revision)
    return tuple(unknown)


def _newer_message(schema: str, unknown: Sequence[str]) -> str:
    """The one refusal of a database that a newer build migrated."""
    return (
        f"schema {schema!r} is at revision {', '.join(unknown)}, which this build does not "
        f"know (its newest is {head_revision()}): the database was migrated by a newer "
        "version of cronoq-store; upgrade cronoq-store"
    )


async def require_head(
    engine: AsyncEngine, schema: str, *, trusted_triggers: frozenset[str] = frozenset()
) -> None:
    """Raise :class:`~cronoq_store.MigrationError` unless ``schema`` is at this build's head.

    What a store opened with ``migrate=False`` checks instead of migrating, after
    :func:`refuse_untrusted`: a runtime role without DDL rights can read the version, and a
    schema that ops have not upgraded yet (or that a newer build upgraded) is refused with
    the revisions named (:meth:`RevisionStatus.require_head`).
    """
    validate_schema_name(schema)

    def read(sync_conn: Connection) -> RevisionStatus:
        sync_conn.execute(session_st.local_search_path)
        refuse_untrusted(sync_conn, schema, trusted_triggers)
        return revision_status(sync_conn, schema)

    try:
        async with engine.connect() as conn:
            status = await conn.run_sync(read)
    except Exception as exc:
        raise translate_error(exc, f"reading the revision of schema {schema!r}") from exc
    status.require_head(
        f"run `cronoq-store --schema {schema} migrate` (or `alembic -x schema={schema} upgrade "
        "head`) with a role that owns the schema, or open the store with migrate=True"
    )


def cluster_schema() -> str:
    """The schema the running migration targets: every operation of a revision names it,
    since the cluster's schema is never on ``search_path``."""
    schema = op.get_context().version_table_schema
    assert schema is not None, "env.py always sets version_table_schema"
    return validate_schema_name(schema)


# --- the environment, run by alembic/env.py -------------------------------------------------


def run_environment(context: EnvironmentContext) -> None:
    """Run the migration Alembic asked for, offline (``--sql``) or against a database.

    The connection comes from ``config.attributes["connection"]`` (a sync ``Connection`` from
    ``AsyncConnection.run_sync``, an ``AsyncEngine`` or an ``Engine``), else from
    ``-x url=...``, ``$CRONOQ_DATABASE_URL`` or ``sqlalchemy.url``. The schema comes from
    ``attributes["schema"]`` or ``-x schema=NAME`` (default ``public``). One run at a time
    in this process (:mod:`cronoq_store._migration_lock`). A downgrade is refused under a
    live leader unless ``attributes["force"]`` or ``-x force=true``
    (:mod:`cronoq_store._downgrade_guard`).
    """
    context = migration_lock.resolve(context)  # refuses another command's context
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
        # else is a driver's traceback; a URL written into the message is masked, and what
        # it quotes made safe for a terminal.
        known = isinstance(exc, (MigrationError, ValueError))
        message = scrub(str(exc if known else translate_error(exc, "migrating")))
        raise CommandError(visible(message)) from exc


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


def _configure(context: EnvironmentContext, schema: str, **kwargs: Any) -> None:
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
        # transaction (:mod:`cronoq_store._downgrade_guard`).
        fn=downgrade_guard.guarded(context, schema, connection),
        **kwargs,
    )


def _in_schema(schema: str) -> MetaData:
    """The tables in ``schema``, for ``alembic check``: with the schema off ``search_path``,
    autogenerate compares schema-qualified tables."""
    copy = MetaData(naming_convention=metadata.naming_convention)
    for table_ in metadata.tables.values():
        table_.to_metadata(copy, schema=schema)
    return copy


def _lock(schema: str) -> Any:
    return select(func.pg_advisory_xact_lock(LOCK_NS_MIGRATE, func.hashtext(schema)))


def _run_offline(context: EnvironmentContext, schema: str) -> None:
    """Print a script a DBA can review; it takes the same lock and search path, and stops
    before any DDL if the schema belongs to a role other than the one running it that is not
    a superuser (:data:`~cronoq_store._statements.refuse_foreign_owner`; the online check of
    every object in the schema is not in the script)."""
    _configure(context, schema, dialect_name="postgresql", literal_binds=True)
    with context.begin_transaction():
        context.execute(session_st.local_search_path)
        context.execute(_lock(schema))
        context.execute(CreateSchema(schema, if_not_exists=True))
        context.execute(migration_st.checked_schema(schema))
        context.execute(migration_st.refuse_foreign_owner)
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
                "server_settings": {"search_path": session_st.SEARCH_PATH},
                **tls,
            },
        )
        try:
            _run_coroutine(lambda: _run_async(context, schema, engine, dispose=True))
        except _ConnectFailed as failed:
            # The command line's one line names the server it could not reach, masked; no
            # colon after the URL, which a ?password=*** would run into when scrubbed.
            reason = translate_error(failed.__cause__ or failed, "connecting")
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
    try:
        try:
            conn = await engine.connect()
        except Exception as exc:
            if not dispose:
                raise  # the application's engine: its caller translates the error
            raise _ConnectFailed from exc
        try:
            await conn.run_sync(lambda sync_conn: _migrate(context, schema, sync_conn))
            await conn.commit()
        finally:
            await conn.close()
    finally:
        if dispose:
            await engine.dispose()


class _ConnectFailed(Exception):
    """The engine made from a URL could not connect (the cause says why)."""


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
    _configure(context, schema, connection=conn)
    with context.begin_transaction():
        conn.execute(session_st.local_search_path)
        conn.execute(_lock(schema))
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
            conn.execute(
                session_st.set_local_search_path, {"path": f"pg_catalog, {quoted}, pg_temp"}
            )
        _adopt_legacy(context, conn, schema)
        _refuse_newer(context, schema)
        context.run_migrations()
        # Again, in the same transaction: the tables just created may carry default privileges
        # (ALTER DEFAULT PRIVILEGES ... GRANT ALL ON TABLES) that let another role plant a
        # trigger; a refusal here rolls the whole migration back.
        refuse_untrusted(conn, schema, trusted)


def _trusted_of(context: EnvironmentContext) -> frozenset[str]:
    """The trusted triggers: ``attributes["trusted_triggers"]`` or ``-x trusted_triggers=a,b``."""
    trusted = context.config.attributes.get(_TRUSTED_TRIGGERS)
    if trusted is None:
        given = context.get_x_argument(as_dictionary=True).get(_TRUSTED_TRIGGERS, "")
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
    unknown = _unknown_revisions(context.script, context.get_context().get_current_heads())
    if unknown:
        raise MigrationError(_newer_message(schema, unknown))
