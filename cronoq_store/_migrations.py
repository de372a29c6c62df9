"""Alembic, one cluster schema at a time: upgrades and downgrades from code, the revision
check, and the environment that ``alembic/env.py`` runs (:func:`run_environment`).

Every run for a schema happens in one transaction that first takes the schema's migration
lock, ``pg_try_advisory_xact_lock(0x63726f6d, hashtext(schema))``, tried again while another
session holds it, up to a bound (:mod:`cronoq_store._door`): concurrent upgrades
serialize (the second finds the schema at head) and a failed upgrade leaves nothing behind,
the schema's creation included. An upgrade to head reads the revision first and takes no
lock on a schema already there. The transaction runs under ``search_path = pg_catalog,
pg_temp``: the cluster's schema is never on it (a role that can write there could plant an
operator that a catalog lookup would run as us, CVE-2018-1058), so every operation in the
revisions names its schema (:func:`cluster_schema`); the version table is
``<schema>.cronoq_alembic_version``.

A fresh schema (no version table) that :func:`upgrade` takes to head runs every revision as
one script, Alembic's offline rendering of them for a placeholder schema made once per
process, in one message: the statements the steps would send one at a time, each prepared
then run. Creating thousands of clusters (a host's enrolment, a fleet's seeding) is bounded
by this; the catalog it leaves is the steps' (a test compares pg_dump of both).

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

One Alembic run at a time in this process, whatever loop or thread starts it.

Alembic keeps the running migration in module globals (the ``alembic.context`` and
``alembic.op`` proxies), and the greenlets of concurrent ``run_sync`` calls interleave at
every I/O: two runs at once share them (``KeyError: 'script'``, one schema's DDL on another's
connection). The database's advisory lock serializes runs of one schema across processes;
this lock serializes every run inside one process.

It is a ``threading.Lock`` (runs can start on several loops in several threads), never
waited on in a way that blocks a loop that may hold it: a coroutine, or sync code inside a
SQLAlchemy greenlet, polls it and yields to its loop meanwhile; only a thread that runs no
loop (or whose loop is already blocked by the caller's sync code) waits on it outright, and
one whose own loop holds the lock is refused instead of deadlocking.

Alembic installs its ``context`` proxy when a command starts, before ``env.py`` can take
the lock: callers therefore take it first (:func:`held_async` in
``migrations.upgrade``, :func:`held_for` in ``migrations.run_command``), and ``env.py``
refuses a run whose proxy another thread's raw ``alembic.command`` call replaced
(:func:`resolve`) rather than run the other command's migration.

A downgrade never runs under a live leader, nor to base of a cluster that issued ids,
unless the operator forces it.

Every revision's downgrade drops columns or tables, rows and all (no upgrade removes or
rewrites rows: 0006 drops only the hand-rolled version table it replaced). So before the
first downgrade step, in the migration's own transaction, the run takes the leader lock with
``pg_try_advisory_xact_lock`` and holds it until COMMIT: a standby that wants to lead waits
behind the downgrade, and then finds what it left. An instance that holds the lock is named
and the run refused, and so is a cluster enrolled in a host group (revision 0009), naming the
group: its host leads it without holding the lock. To base, a cluster that ever issued a
task id (its epoch moved, or it holds a task) is refused too: one made again in its place
starts at epoch 0 and issues the same ids again.

Forced (``force``: ``--force``, ``-x force=true``), the run goes on, and fences a live leader:
it locks the cluster's tables (waiting for commits in flight) and bumps the epoch before
its DDL, so every later commit of the old leader fails, as ``FencedError`` (the epoch
moved) or :class:`~cronoq_store._errors.SchemaGoneError` (its tables or columns are gone).

``guarded`` wraps the command's migration function, which Alembic calls inside the run's
transaction with the steps it will run: whatever the revision argument (``base``, ``-1``, a
range), the check sees the steps themselves.

Alembic's environment, :func:`run_environment`, is what ``alembic/env.py`` runs for every
command, offline (``--sql``) or against a database, for one cluster schema: it takes the
process's migration turn, finds its connection and schema, refuses what it cannot handle
safely, adopts the version table of earlier builds, and migrates as every run does, above.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import configparser
import contextlib
import functools
import io
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    asynccontextmanager,
    contextmanager,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import alembic.context
from alembic import command, op
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext, RevisionStep
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from alembic.util import CommandError
from sqlalchemy import (
    Connection,
    Engine,
    MetaData,
    column,
    select,
    table,
    text,
)
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.schema import CreateSchema
from sqlalchemy.util.concurrency import await_, in_greenlet

from . import _catalog as catalog
from . import _door as door
from . import _migrations as migrations
from . import _queries as queries
from . import _statements as st
from ._config import MIGRATION_LOCK_TIMEOUT, trusted_trigger_names, validate_schema_name
from ._domain import check_seconds
from ._door import LockWait
from ._errors import MigrationError, StoreError
from ._results import LockHolder
from ._schema import LEGACY_VERSION_TABLE, VERSION_TABLE, leader, metadata, schema_options
from ._statements import LOCK_NS_MIGRATE
from ._terminal_safe import visible
from ._trust import refuse_untrusted
from ._urls import (
    URL_ENV,
    redact,
    scrub,
)

__all__ = [
    "BOUND_SETTINGS",
    "FORCE",
    "HELD",
    "LEGACY_REVISIONS",
    "LOCK_NS_MIGRATE",
    "LOCK_TIMEOUT",
    "MUST_EXIST",
    "ClusterGone",
    "RevisionStatus",
    "alembic_config",
    "alembic_ini",
    "cluster_schema",
    "clusters_elsewhere",
    "downgrade",
    "downgrade_steps",
    "forced",
    "guarded",
    "head_revision",
    "held",
    "held_async",
    "held_for",
    "require_head",
    "resolve",
    "revision_status",
    "run_command",
    "run_environment",
    "upgrade",
]


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
TRUSTED_TRIGGERS = "trusted_triggers"
#: ``Config.attributes`` key (and ``-x`` argument) of the seconds a run waits for the
#: migration lock and the cluster's tables (:data:`MIGRATION_LOCK_TIMEOUT` if not given).
LOCK_TIMEOUT = "lock_timeout"
#: ``Config.attributes`` key: upgrade only a schema that holds a migrated cluster, checked
#: under the migration lock; a schema without one raises :class:`ClusterGone`.
MUST_EXIST = "must_exist"


#: ``Config.attributes`` key: Alembic's offline script of every revision, base to head, for
#: the schema :data:`_TEMPLATE_SCHEMA`; a run that finds its schema fresh runs it in one
#: message (:func:`_run_revisions`). :func:`upgrade` to head sets it.
FRESH_SCRIPT = "cronoq_store.fresh_script"
#: ``Config.attributes`` key of an offline run that renders the revisions alone, without
#: the script's opening (search path, lock, owner check): :func:`_fresh_template`.
REVISIONS_ONLY = "cronoq_store.revisions_only"
#: The schema :func:`_fresh_template` renders for, replaced by the cluster's own: a plain
#: identifier, so it is written the same way as an identifier and inside a literal.
_TEMPLATE_SCHEMA = "cronoq_template_schema"


class ClusterGone(MigrationError):
    """An upgrade of an existing cluster only (:func:`upgrade` with ``must_exist``) found
    no migrated cluster in the schema under the migration lock: it was dropped, or never
    migrated. Nothing was created."""


_P = ParamSpec("_P")
_R = TypeVar("_R")


def script_location() -> Path:
    """The migrations: packaged inside the wheel, or ``alembic/`` beside a source checkout."""
    package = Path(__file__).resolve().parent
    packaged = package / "_alembic"
    return packaged if packaged.is_dir() else package.parent / "alembic"


@functools.lru_cache(maxsize=4)
def _scripts(location: str) -> ScriptDirectory:
    """The migrations at ``location``, read once per process: parsing every revision file
    costs tens of milliseconds, which every console page and CLI check would pay again."""
    return ScriptDirectory(location)


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
    head = _scripts(str(script_location())).get_current_head()
    assert head is not None, "the migrations have a single head"
    return head


async def upgrade(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    revision: str = "head",
    *,
    trusted_triggers: frozenset[str] = frozenset(),
    lock_timeout: float = MIGRATION_LOCK_TIMEOUT,
    must_exist: bool = False,
) -> None:
    """Upgrade ``schema`` to ``revision`` in one transaction (idempotent, serialized).

    Given an ``AsyncConnection`` that is already in a transaction, the caller commits;
    otherwise this commits. Errors are :class:`~cronoq_store.StoreError`. Runs in this
    process take turns: any number of stores may open
    at once, on one loop or on several. ``trusted_triggers`` names the triggers allowed on
    the cluster's tables, as ``PgStoreConfig.trusted_triggers`` does.

    To head, the schema's revision is read first, without a lock: a schema already at head
    (after the trust check) needs nothing, whoever holds its migration lock. Otherwise the
    run waits up to ``lock_timeout`` seconds for the migration lock and then the cluster's
    tables, logging who holds them, and reads the
    revision again under the lock (an upgrade that ran meanwhile leaves nothing to do);
    past the bound it raises :class:`~cronoq_store.LockHeldError` naming them.

    ``must_exist``: upgrade only a cluster already there (``migrate --all`` over the
    schemas it listed), checked under the migration lock; a schema dropped meanwhile is
    not created again, and the run raises :class:`~cronoq_store.MigrationError` saying so.
    """
    check_seconds("lock_timeout", lock_timeout)
    async with _committed(bind):
        if revision == "head" and await _at_head(bind, schema, trusted_triggers):
            return
        await _run_on(
            bind,
            schema,
            trusted_triggers,
            command.upgrade,
            revision,
            lock_timeout,
            must_exist=must_exist,
        )


async def downgrade(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    revision: str,
    *,
    trusted_triggers: frozenset[str] = frozenset(),
    force: bool = False,
    lock_timeout: float = MIGRATION_LOCK_TIMEOUT,
) -> None:
    """Downgrade ``schema`` to ``revision`` (``base`` removes the cluster's tables): the
    same transaction, lock, lock wait and trust checks as :func:`upgrade`. What it undoes
    is lost, rows and all: ``cronoq-store downgrade`` says which revisions that is.

    Refused (:class:`~cronoq_store.MigrationError`) while an instance holds the leader lock,
    and to base once the cluster issued task ids, unless ``force``; forced, a live leader is
    fenced."""
    async with _committed(bind):
        await _run_on(
            bind, schema, trusted_triggers, command.downgrade, revision, lock_timeout, force=force
        )


@asynccontextmanager
async def _committed(bind: AsyncEngine | AsyncConnection) -> AsyncIterator[None]:
    """Commit the work inside on a caller's connection that was in no transaction when it
    started (rolled back if it fails), as :func:`upgrade` promises; a caller's transaction
    is the caller's to end, and an engine's session is the door's."""
    if not isinstance(bind, AsyncConnection) or bind.in_transaction():
        yield
        return
    try:
        yield
    except BaseException:
        if bind.in_transaction() and not bind.invalidated:
            await bind.rollback()
        raise
    if bind.in_transaction():
        await bind.commit()


async def _at_head(
    bind: AsyncEngine | AsyncConnection, schema: str, trusted_triggers: frozenset[str]
) -> bool:
    """Whether ``schema`` is at this build's head, read without a lock after the trust
    check; a schema a newer build migrated is refused here
    (:class:`~cronoq_store.MigrationError`)."""
    opening = _opening(bind) if isinstance(bind, AsyncEngine) else None
    status = await _read_status(bind, schema, trusted_trigger_names(trusted_triggers), opening)
    if status.unknown:
        raise MigrationError(newer_message(schema, status.unknown))
    return status.at_head


async def _run_on(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    trusted_triggers: frozenset[str],
    alembic_command: Callable[[Config, str], None],
    revision: str,
    lock_timeout: float,
    *,
    force: bool = False,
    must_exist: bool = False,
) -> None:
    validate_schema_name(schema)
    trusted = trusted_trigger_names(trusted_triggers)
    check_seconds("lock_timeout", lock_timeout)

    def run(sync_conn: Connection) -> None:
        cfg = alembic_config(schema, sync_conn)
        cfg.attributes[HELD] = True
        cfg.attributes[TRUSTED_TRIGGERS] = trusted
        cfg.attributes[FORCE] = force
        cfg.attributes[LOCK_TIMEOUT] = lock_timeout
        cfg.attributes[MUST_EXIST] = must_exist
        if alembic_command is command.upgrade and revision == "head":
            cfg.attributes[FRESH_SCRIPT] = _fresh_template(str(script_location()))
        alembic_command(cfg, revision)

    try:
        async with (
            door.translated(f"migrating schema {schema!r}", passing=(CommandError,)),
            held_async(),
        ):
            await _in_transaction(bind, run)
    except (CommandError, MigrationError) as exc:
        raise (exc if isinstance(exc, MigrationError) else MigrationError(str(exc))) from exc


@functools.lru_cache(maxsize=1)
def _fresh_template(location: str) -> str:
    """Alembic's offline script of the revisions at ``location``, base to head, for
    :data:`_TEMPLATE_SCHEMA`: rendered once per process (rendering costs about what the
    round trips it saves do). Called under the process's migration lock, which the offline
    run takes as its own."""
    cfg = Config()
    cfg.set_main_option("script_location", location)
    cfg.attributes["schema"] = _TEMPLATE_SCHEMA
    cfg.attributes[HELD] = True
    cfg.attributes[REVISIONS_ONLY] = True
    script = io.StringIO()
    cfg.output_buffer = script
    command.upgrade(cfg, "head", sql=True)
    return script.getvalue()


def downgrade_steps(current: Sequence[str], revision: str) -> tuple[str, ...]:
    """The revisions that going from ``current`` to ``revision`` would undo, newest first;
    empty when ``revision`` is not below ``current`` (it is ahead, the same, on no path
    from it, or unknown: an upgrade reports those)."""
    if len(current) != 1:
        return ()
    script = _scripts(str(script_location()))
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
    with held_for(config):
        return command_(config, *args, **kwargs)


async def _in_transaction(
    bind: AsyncEngine | AsyncConnection, run: Callable[[Connection], None]
) -> None:
    """``run`` in one transaction: on an engine's pooled session, one the store opens under
    its own settings, whatever the session carries (an application's ``SET
    default_transaction_read_only``, ``statement_timeout``, ``ROLE``, ... or a ``DISCARD
    ALL``: :func:`~cronoq_store._door.run_transaction`), so that a retry never meets the same
    refusal again; a caller's connection as it is (its transaction, its role on purpose)."""
    if isinstance(bind, AsyncEngine):
        await door.run_transaction(bind, _opening(bind), lambda conn: conn.run_sync(run))
    else:
        await bind.run_sync(run)


def _opening(engine: AsyncEngine) -> str:
    """The message that opens a migration's transaction on ``engine``, or its read of the
    revision, with the store's own settings (:func:`_in_transaction`)."""
    statements = st.store_transaction(st.IDLE_LIMIT_MS, borrowed=True)
    return door.opening_message(statements, engine.dialect)


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
            raise MigrationError(newer_message(self.schema, self.unknown))
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
    exists = conn.execute(st.schema_oid, {"schema": schema}).scalar() is not None
    current: tuple[str, ...] = ()
    if exists:
        context = MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
        )
        current = tuple(sorted(context.get_current_heads()))
    script = _scripts(str(script_location()))
    unknown = unknown_revisions(script, current)
    pending: tuple[str, ...] = ()
    if exists and not unknown and current != (head,):
        lower = current[0] if len(current) == 1 else None
        pending = tuple(r.revision for r in reversed(list(script.iterate_revisions(head, lower))))
    return RevisionStatus(schema, exists, current, head, unknown, pending)


def unknown_revisions(script: ScriptDirectory, revisions: Sequence[str]) -> tuple[str, ...]:
    unknown = []
    for revision in revisions:
        try:
            script.get_revision(revision)
        except CommandError:
            unknown.append(revision)
    return tuple(unknown)


def newer_message(schema: str, unknown: Sequence[str]) -> str:
    """The one refusal of a database that a newer build migrated."""
    return (
        f"schema {schema!r} is at revision {', '.join(unknown)}, which this build does not "
        f"know (its newest is {head_revision()}): the database was migrated by a newer "
        "version of cronoq-store; upgrade cronoq-store"
    )


async def require_head(
    engine: AsyncEngine,
    schema: str,
    *,
    trusted_triggers: frozenset[str] = frozenset(),
    opening: str | None = None,
) -> None:
    """Raise :class:`~cronoq_store.MigrationError` unless ``schema`` is at this build's head.

    What a store opened with ``migrate=False`` checks instead of migrating, after
    :func:`refuse_untrusted`: a runtime role without DDL rights can read the version, and a
    schema that ops have not upgraded yet (or that a newer build upgraded) is refused with
    the revisions named (:meth:`RevisionStatus.require_head`). ``opening``: the message that
    opens its transaction (:func:`~cronoq_store._door.run_transaction`), the store's settings.
    """
    status = await _read_status(engine, schema, trusted_triggers, opening)
    status.require_head(
        f"run `cronoq-store --schema {schema} migrate` (or `alembic -x schema={schema} upgrade "
        "head`) with a role that owns the schema, or open the store with migrate=True"
    )


async def _read_status(
    bind: AsyncEngine | AsyncConnection,
    schema: str,
    trusted_triggers: frozenset[str],
    opening: str | None,
) -> RevisionStatus:
    """Where ``schema`` stands, after :func:`refuse_untrusted`; reads only, takes no lock
    (in ``bind``'s transaction, or in a transaction of an engine's that ``opening`` opens:
    :func:`~cronoq_store._door.run_transaction`)."""
    validate_schema_name(schema)

    def read(sync_conn: Connection) -> RevisionStatus:
        sync_conn.execute(st.local_search_path)
        refuse_untrusted(sync_conn, schema, trusted_triggers)
        return revision_status(sync_conn, schema)

    async with door.translated(f"reading the revision of schema {schema!r}"):
        if isinstance(bind, AsyncConnection):
            return await bind.run_sync(read)
        return await door.run_transaction(bind, opening, lambda conn: conn.run_sync(read))


def cluster_schema() -> str:
    """The schema the running migration targets: every operation of a revision names it,
    since the cluster's schema is never on ``search_path``."""
    schema = op.get_context().version_table_schema
    assert schema is not None, "env.py always sets version_table_schema"
    return validate_schema_name(schema)


#: ``Config.attributes`` key set by a caller that already holds the lock for this run.
HELD = "cronoq_store.migration_lock_held"
#: How often a waiting coroutine tries the lock again.
_POLL = 0.01
#: A coroutine still waiting says so this often (seconds).
_REPORT_INTERVAL = 30.0

logger = logging.getLogger("cronoq_store")

_lock = threading.Lock()
#: The loop whose coroutine holds the lock, if one does.
_owner: asyncio.AbstractEventLoop | None = None


async def _acquire() -> None:
    global _owner
    loop = asyncio.get_running_loop()
    started = said = loop.time()
    # Polled: an asyncio primitive cannot be woken by a holder on another loop or thread.
    while not _lock.acquire(blocking=False):
        await asyncio.sleep(_POLL)
        if loop.time() - said >= _REPORT_INTERVAL:
            said = loop.time()
            # Each run's own waits are bounded and said: this one is only their sum.
            logger.warning(
                "a migration has waited %.0f s for another Alembic run in this process "
                "(runs take turns: Alembic keeps the running command in module globals)",
                said - started,
            )
    _owner = loop


def _release() -> None:
    global _owner
    _owner = None
    _lock.release()


@asynccontextmanager
async def held_async() -> AsyncIterator[None]:
    """Hold the lock in a coroutine; waiting yields to the loop (its holder may be on it)."""
    await _acquire()
    try:
        yield
    finally:
        _release()


def _acquire_here() -> None:
    """Take the lock from sync code: polled inside a greenlet, refused on the loop that holds
    it (waiting would block the very loop that must release it), else waited on outright."""
    if in_greenlet():
        await_(_acquire())
        return
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None and _owner is loop:
        raise MigrationError(
            "a migration is running on this event loop, and Alembic was called "
            "synchronously on the same loop, which blocks it: await "
            "cronoq_store.upgrade() (or use AsyncConnection.run_sync) instead"
        )
    _lock.acquire()


@contextmanager
def held_for(config: Config) -> Iterator[None]:
    """Hold the lock around a whole Alembic command for ``config``, from before Alembic
    installs its module proxies until after it removes them: no other run can replace them."""
    if config.attributes.get(HELD):
        yield
        return
    _acquire_here()
    config.attributes[HELD] = True
    try:
        yield
    finally:
        del config.attributes[HELD]
        _release()


@contextmanager
def held(environment: EnvironmentContext) -> Iterator[None]:
    """Hold the lock for the run of ``environment``, unless its caller already does.

    On leaving, the run's own proxies are installed again: a run that started meanwhile
    replaced them before it queued here, and Alembic removes them when this run ends.
    """
    if environment.config.attributes.get(HELD):
        try:
            yield
        finally:
            environment._install_proxy()
        return
    _acquire_here()
    try:
        yield
    finally:
        environment._install_proxy()
        _release()


def resolve(context: Any) -> EnvironmentContext:
    """The ``EnvironmentContext`` of this run itself (``env.py`` passes ``alembic.context``,
    a module that proxies whichever run installed itself last).

    Alembic installs that proxy when it enters the run, before ``env.py`` can take the lock:
    an Alembic command started meanwhile in another thread, not through
    :func:`held_for`, can have replaced or removed it. Such a run is refused, never run with
    the other command's context: its ``script`` is not the ``ScriptDirectory`` whose
    ``run_env()`` is running ``env.py`` here (Alembic makes a new one for every command).
    """
    proxy = context if isinstance(context, EnvironmentContext) else getattr(context, "_proxy", None)
    running = _running_script()
    if not isinstance(proxy, EnvironmentContext) or (
        running is not None and proxy.script is not running
    ):
        # Alembic removes "this run's" proxies as the error leaves (a KeyError if another
        # run removed them already): let there be some to remove.
        if not isinstance(proxy, EnvironmentContext) and running is not None:
            proxy = EnvironmentContext(Config(), running)
        if isinstance(proxy, EnvironmentContext):
            proxy._install_proxy()
        raise MigrationError(
            "another Alembic command started in this process while this one was starting, "
            "and Alembic keeps the running command in module globals: refusing to run the "
            "other command's migration in place of this one's. Run concurrent Alembic commands "
            "through cronoq_store.run_command(command.upgrade, config, ...) "
            "(or await cronoq_store.upgrade()): they then take turns"
        )
    if proxy.__dict__.get("_remove_proxy") is None:
        proxy._remove_proxy = lambda: _remove_own_proxy(proxy)  # type: ignore[method-assign]
    return proxy


def _remove_own_proxy(environment: EnvironmentContext) -> None:
    """What Alembic runs as ``environment`` ends: remove its proxies if they are still its
    own; those another run installed meanwhile are that run's to remove (removing twice is
    a ``KeyError`` in Alembic)."""
    if getattr(alembic.context, "_proxy", None) is environment:
        EnvironmentContext._remove_proxy(environment)


def _running_script() -> ScriptDirectory | None:
    """The ``ScriptDirectory`` whose ``run_env()`` is on this thread's (or greenlet's) stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is ScriptDirectory.run_env.__code__:
            script = frame.f_locals.get("self")
            return script if isinstance(script, ScriptDirectory) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None


logger = logging.getLogger("cronoq_store")

#: ``Config.attributes`` key and ``-x`` argument (``-x force=true``) of a forced downgrade.
FORCE = "force"
#: The revision that adds the leader row's record of who bumped the epoch.
HOLDER_REVISION = "0007_leader_holder"
#: The revision that adds the host group a cluster is enrolled in.
HOST_GROUP_REVISION = "0009_host_group"

_MigrationFn = Callable[[Any, MigrationContext], Iterable[Any]]


def forced(context: EnvironmentContext) -> bool:
    """Whether the operator forces this run: ``attributes["force"]`` or ``-x force=true``."""
    given = context.config.attributes.get(FORCE)
    if given is None:
        given = context.get_x_argument(as_dictionary=True).get(FORCE, "false")
    return given is True or str(given).strip().lower() in ("true", "1", "yes")


def guarded(
    context: EnvironmentContext, schema: str, conn: Connection | None, wait: LockWait | None
) -> _MigrationFn | None:
    """The command's migration function, checking its steps before the first one runs: on
    ``conn`` online, in the script offline (``conn`` is ``None``); ``None`` if it has none.
    ``wait`` bounds a forced downgrade's wait for the cluster's tables (online)."""
    fn: _MigrationFn | None = context.context_opts.get("fn")
    if fn is None:
        return None
    force = forced(context)

    def steps(heads: Any, migration: MigrationContext) -> list[Any]:
        planned = list(fn(heads, migration))
        undone = [s for s in planned if isinstance(s, RevisionStep) and s.is_downgrade]
        if undone:
            to_base = any(not s.to_revisions for s in undone)
            if conn is None:
                _script(context, migration, schema, force, heads)
            else:
                assert wait is not None, "an online run always bounds its waits"
                _check(conn, schema, force=force, to_base=to_base, wait=wait)
        return planned

    return steps


def _check(conn: Connection, schema: str, *, force: bool, to_base: bool, wait: LockWait) -> None:
    oid = conn.execute(st.schema_oid, {"schema": schema}).scalar_one()
    lock = (st.LOCK_NS_LEADER, oid)
    cluster = schema_options(schema)
    took = conn.execute(st.try_leader_lock_for_transaction, {"k1": lock[0], "k2": lock[1]})
    if not took.scalar():
        row = conn.execute(catalog.leader_lock_holder, queries.lock_keys(lock)).first()
        holder = _describe(None if row is None else queries.holder_of(row, store_instance=False))
        if not force:
            raise MigrationError(
                f"an instance leads schema {schema!r} ({holder} holds its leader lock): "
                "refusing to downgrade under a live leader, which would lose what it commits; "
                "stop every instance first, or force it (`cronoq-store downgrade --force`, "
                "`alembic -x force=true`: the leader is fenced, and what the downgrade "
                "removes is lost)"
            )
        logger.warning(
            "forced downgrade under a live leader: fencing it",
            extra={"schema": schema, "holder": holder},
        )
        # Waits for its commits in flight (bounded, holders named); the bump fences every
        # later one.
        door.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
        columns = frozenset(conn.execute(catalog.leader_columns, {"schema": schema}).scalars())
        conn.execute(_bump(columns >= queries.HOLDER_COLUMNS), execution_options=cluster)
        return
    group = _host_group(conn, schema)
    if group is not None:
        # A host leads an enrolled cluster without the leader lock: the lock taken above
        # keeps a host from claiming it meanwhile, not one that leads it now.
        if not force:
            raise MigrationError(
                f"schema {schema!r} is enrolled in host group {group!r}: a host leads it "
                "without holding its leader lock, and downgrading it would lose what the "
                "host commits; remove it from the host group first, or force it "
                "(`cronoq-store downgrade --force`, `alembic -x force=true`: the host is "
                "fenced, and what the downgrade removes is lost)"
            )
        logger.warning(
            "forced downgrade of a cluster enrolled in a host group: fencing its host",
            extra={"schema": schema, "host_group": group},
        )
        door.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
        conn.execute(st.bump_epoch, execution_options=cluster)
        return
    if (
        to_base
        and not force
        and conn.execute(st.cluster_issued_ids, execution_options=cluster).scalar()
    ):
        raise MigrationError(
            f"schema {schema!r} has issued task ids: downgrading it to base drops them, and "
            "a cluster migrated again in its place starts at epoch 0 and issues the same ids "
            "again, to other tasks; force it (`cronoq-store downgrade --force`, `alembic -x "
            "force=true`) only if no one keeps an id of this cluster"
        )


def _host_group(conn: Connection, schema: str) -> str | None:
    """The host group the cluster in ``schema`` is enrolled in: ``None`` for a standalone
    cluster, and for a schema before revision 0009, which has no column for it."""
    columns = conn.execute(catalog.leader_columns, {"schema": schema}).scalars()
    if leader.c.host_group.name not in frozenset(columns):
        return None
    row = conn.execute(st.leader_enrolment, execution_options=schema_options(schema)).first()
    group: str | None = None if row is None else row.host_group
    return group


def _bump(records_holder: bool) -> Any:
    """The epoch bump a forced downgrade fences with: a leader table from revision 0007 on
    records who bumped; an older one has no columns for it."""
    return st.bump_epoch if records_holder else st.bump_epoch_only


def _records_holder(context: EnvironmentContext, heads: Any) -> bool:
    """Whether the schema a script starts from (``heads``) has the holder columns: whether
    :data:`HOLDER_REVISION` is among its revisions."""
    return _reached(context, heads, HOLDER_REVISION)


def _reached(context: EnvironmentContext, heads: Any, revision: str) -> bool:
    """Whether the schema a script starts from (``heads``) is at ``revision`` or above it."""
    assert context.script is not None
    start = tuple(heads or ())
    if not start:
        return False
    return any(r.revision == revision for r in context.script.iterate_revisions(start, "base"))


def _script(
    context: EnvironmentContext,
    migration: MigrationContext,
    schema: str,
    force: bool,
    heads: Any,
) -> None:
    """The same in an offline script: refuse a live leader and hold the lock, and refuse a
    cluster enrolled in a host group (from :data:`HOST_GROUP_REVISION` on); or, forced,
    lock the tables and fence with the epoch. The base check (issued ids) is online only."""
    if not force:
        context.execute(st.refuse_live_leader)
        if _reached(context, heads, HOST_GROUP_REVISION):
            context.execute(st.refuse_enrolled)
        return
    context.execute(st.lock_cluster_tables(schema, migration.dialect))
    bump = _bump(_records_holder(context, heads)).compile(
        dialect=migration.dialect,
        schema_translate_map={None: schema},
        render_schema_translate=True,
        compile_kwargs={"literal_binds": True},
    )
    context.execute(text(str(bump)))


def _describe(holder: LockHolder | None) -> str:
    """The holder, in words; it may have let go since the lock was tried."""
    if holder is None:
        return "a session that has let go since"
    since = "an unknown time" if holder.since is None else holder.since.isoformat()
    return (
        f"pid {holder.pid}, application {holder.application_name!r}, role "
        f"{holder.role or '(hidden)'!r}, client "
        f"{holder.client_addr or 'local socket or hidden'}, since {since}"
    )


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
        door.translated("migrating", passing=(CommandError, ValueError))
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
        # Only a comparison with the model reads it; copying every table costs a few ms.
        target_metadata=_in_schema(schema) if _autogenerating(context) else None,
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
    named: :func:`~cronoq_store._door.lock_tables`) before the first step that runs a
    revision: its DDL then never queues behind a transaction, with every commit queued
    behind it. A run with nothing to do locks nothing."""
    if fn is None or conn is None or wait is None:
        return fn
    checked = fn

    def steps(heads: Any, migration: MigrationContext) -> list[Any]:
        planned = list(checked(heads, migration))
        if any(isinstance(step, RevisionStep) for step in planned):
            door.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
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
    _configure(context, schema, dialect_name="postgresql", literal_binds=True)
    if context.config.attributes.get(REVISIONS_ONLY):
        context.run_migrations()
        return
    bound = _lock_wait(context, schema).bound
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
        engine = door.migration_engine(url)
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
        door.require_transaction(conn, f"migrating schema {schema!r}")
        door.take_migration_lock(conn, schema, wait)
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
        if context.config.attributes.get(MUST_EXIST) and not revision_status(conn, schema).current:
            raise ClusterGone(
                f"schema {schema!r} holds no cronoq cluster any more (dropped since it was "
                "listed?): not created again"
            )
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
        _run_revisions(context, schema, conn, wait)
        # Again, in the same transaction: the tables just created may carry default privileges
        # (ALTER DEFAULT PRIVILEGES ... GRANT ALL ON TABLES) that let another role plant a
        # trigger; a refusal here rolls the whole migration back.
        refuse_untrusted(conn, schema, trusted)


def _run_revisions(
    context: EnvironmentContext, schema: str, conn: Connection, wait: LockWait
) -> None:
    """Run the revisions the command asked for, in the run's transaction.

    A schema without a version table (none adopted by :func:`_adopt_legacy` either; a
    downgrade to base leaves an empty one), migrated to head with the template
    :func:`upgrade` passes, runs Alembic's offline script of every revision in
    one message: the statements the steps would send one by one, each prepared then run
    (two round trips apiece, about 120 for a fresh schema). Its lock waits are bounded by
    what remains of ``wait``, as the steps' are once they lock the tables. The steps are
    taken instead for a name that must be quoted, which the template's plain name would
    not be."""
    template = context.config.attributes.get(FRESH_SCRIPT)
    if (
        template is None
        or conn.dialect.driver != "asyncpg"
        or conn.dialect.identifier_preparer.quote(schema) != schema
        or conn.execute(catalog.relation_exists, {"schema": schema, "name": VERSION_TABLE}).scalar()
    ):
        context.run_migrations()
        return
    door.lock_tables(conn, schema, wait.then(f"the tables of schema {schema!r}"))
    door.run_script(conn, template.replace(_TEMPLATE_SCHEMA, schema))


def _trusted_of(context: EnvironmentContext) -> frozenset[str]:
    """The trusted triggers: ``attributes["trusted_triggers"]`` or ``-x trusted_triggers=a,b``."""
    trusted = context.config.attributes.get(TRUSTED_TRIGGERS)
    if trusted is None:
        given = context.get_x_argument(as_dictionary=True).get(TRUSTED_TRIGGERS, "")
        trusted = [name.strip() for name in given.split(",") if name.strip()]
    return trusted_trigger_names(trusted)


def _autogenerating(context: EnvironmentContext) -> bool:
    """Whether this run compares the database with the model (``alembic check``,
    ``revision --autogenerate``), known before the run is configured."""
    return "revision_context" in context.context_opts


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
