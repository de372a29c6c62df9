"""``cronoq-store``: the operator's tool for one cluster schema, and the HA demo.

Only ``migrate`` changes a schema's structure: the other commands refuse a schema that is not
at this build's head instead of migrating it as a side effect (an operator looking at a
database should not alter it, and may not have the right to), and they refuse a database
that a newer build migrated, whose columns this build cannot know. They need no more than
read access, except ``prune``. Statements are SQLAlchemy Core constructs, the cluster's schema
applied at execution as the store does, never pasted into SQL. Errors are one line on stderr
with the password masked, and the exit code tells a script what went wrong.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from enum import IntEnum
from typing import Any, NoReturn, TypeVar

import click
from alembic import command
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from click.core import ParameterSource
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal,
    select,
    table,
)
from sqlalchemy import Table as SqlTable
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from . import demo as demo_module
from . import statements as st
from .codec import QUARANTINE_PREFIX, clean_text
from .config import trusted_trigger_names
from .domain import I64_MAX, ID_COUNTER_BITS, UNIX_EPOCH, Priority, TaskId, TaskStatus, epoch_of
from .errors import MigrationError, translate_error
from .migrations import alembic_config, head_revision, refuse_untrusted, run_command, upgrade
from .queries import PRUNE_BATCH
from .schema import (
    LEADER_ROW_ID,
    VERSION_TABLE,
    leader,
    recurring,
    schema_options,
    tasks,
    validate_schema_name,
)
from .urls import URL_ENV, async_url, redact, scrub

__all__ = ["URL_ENV", "ExitCode", "cli", "main", "parse_duration"]

_T = TypeVar("_T")

#: Where the URL comes from when ``--url`` is not given.
#: A silent host must not hang the tool for asyncpg's default minute.
CONNECT_TIMEOUT = 10.0
#: How recovery marks a live row it could not decode (docs/storage-format.md).
_FINISHED = [s.value for s in TaskStatus if s.is_terminal]


class ExitCode(IntEnum):
    """What a script can tell from the exit status; listed in ``--help``."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_MIGRATED = 4
    NEWER_DATABASE = 5


_EPILOG = f"""\b
Exit codes:
  {ExitCode.OK:d}  success
  {ExitCode.FAILED:d}  the operation failed (task not found, migration refused, demo lost data)
  {ExitCode.USAGE:d}  usage error
  {ExitCode.UNREACHABLE:d}  cannot connect: wrong URL, host, password or database, or the
     server is unavailable
  {ExitCode.NOT_MIGRATED:d}  the schema is missing or not migrated to this build's head
     (run `cronoq-store migrate`)
  {ExitCode.NEWER_DATABASE:d}  the schema was migrated by a newer cronoq-store: upgrade it
"""


class CliError(Exception):
    """A failure to report as one line (``Error: ...``) and exit with ``code``."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code

    def exit(self, url: str | None) -> NoReturn:
        """Print the message, the URL's password masked, and leave with the exit code."""
        click.echo(f"Error: {scrub(str(self), [url])}", err=True)
        raise click.exceptions.Exit(int(self.code))


# --- statements the store does not run (catalogs and counts for operators) -----------------

# Catalog tables carry their schema: schema_translate_map only renames schema-less tables.
_pg_locks = table(
    "pg_locks",
    column("locktype", Text),
    column("database"),
    column("classid"),
    column("objid"),
    column("objsubid", Integer),
    column("pid", Integer),
    column("granted", Boolean),
    schema="pg_catalog",
)
_pg_stat_activity = table(
    "pg_stat_activity",
    column("pid", Integer),
    column("application_name", Text),
    column("client_addr"),
    column("backend_start", DateTime(timezone=True)),
    schema="pg_catalog",
)
_pg_database = table("pg_database", column("oid"), column("datname"), schema="pg_catalog")
#: Alembic's version table, schema-less like the cluster's own tables (a ``Table``: a bare
#: ``table()`` clause is not renamed by ``schema_translate_map``).
_version = SqlTable(VERSION_TABLE, MetaData(), Column("version_num", String(32), primary_key=True))

#: Whether ``<schema>.cronoq_alembic_version`` exists (``format('%I')`` quotes on the server).
_has_version_table = select(
    func.to_regclass(
        func.format("%I.%I", bindparam("schema", type_=Text), literal(VERSION_TABLE, Text))
    ).is_not(None)
)
_revisions = select(_version.c.version_num).order_by(_version.c.version_num)
_leader_row = select(leader.c.epoch, leader.c.max_id).where(leader.c.id == LEADER_ROW_ID)

#: The session holding the leader's advisory lock in this database. A two-int key shows as
#: ``classid = k1, objid = k2, objsubid = 2``; the columns are ``oid`` (unsigned), so they
#: are compared as BIGINT. Advisory locks are per database, and so are schema OIDs.
_lock_holder = (
    select(
        _pg_stat_activity.c.pid,
        _pg_stat_activity.c.application_name,
        func.host(_pg_stat_activity.c.client_addr).label("client_addr"),
        _pg_stat_activity.c.backend_start,
    )
    .select_from(_pg_locks.join(_pg_stat_activity, _pg_locks.c.pid == _pg_stat_activity.c.pid))
    .where(
        _pg_locks.c.locktype == "advisory",
        _pg_locks.c.database
        == select(_pg_database.c.oid)
        .where(_pg_database.c.datname == func.current_database())
        .scalar_subquery(),
        cast(_pg_locks.c.classid, BigInteger) == bindparam("k1", type_=BigInteger),
        cast(_pg_locks.c.objid, BigInteger) == bindparam("k2", type_=BigInteger),
        _pg_locks.c.objsubid == 2,
        _pg_locks.c.granted,
    )
)

#: A full scan of the tasks table: status is an operator's occasional look, not a probe.
_task_counts = (
    select(tasks.c.pool, tasks.c.terminal, tasks.c.status, func.count().label("n"))
    .group_by(tasks.c.pool, tasks.c.terminal, tasks.c.status)
    .order_by(tasks.c.pool, tasks.c.terminal, tasks.c.status)
)
_quarantined = select(func.count()).where(
    tasks.c.terminal,
    tasks.c.status == TaskStatus.FAILED.value,
    tasks.c.message.startswith(QUARANTINE_PREFIX, autoescape=True),
)
_schedules = select(
    recurring.c.name,
    # As text: the dialect's json.loads recurses on a hand-written value nested too deep.
    cast(recurring.c.spec["schedule"], Text).label("schedule"),
    recurring.c.next_unix_ns,
    recurring.c.last_task_id,
).order_by(recurring.c.name)

#: Finished tasks last updated before ``cutoff``, whether prunable or protected.
_finished_before = select(func.count()).where(
    tasks.c.terminal, tasks.c.updated_unix_ns < bindparam("cutoff", type_=BigInteger)
)
#: What ``prune`` would delete: the WHERE clause of the store's own delete, so a dry run can
#: never disagree with it about what a live task depends on (``batch`` is set to everything).
_PRUNE_WHERE = st.prune_batch.whereclause
assert _PRUNE_WHERE is not None, "the store's prune statement names its victims"
_prunable = select(func.count()).select_from(tasks).where(_PRUNE_WHERE)


# --- options, connection and errors --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    url: str | None
    schema: str
    #: Triggers the operator allows on the cluster's tables (``PgStoreConfig.trusted_triggers``).
    trusted_triggers: frozenset[str] = frozenset()

    def database_url(self) -> str:
        if self.url is None:
            raise click.UsageError(f"no database URL: pass --url or set ${URL_ENV}")
        return self.url


def _run(options: _Options, work: Coroutine[Any, Any, _T]) -> _T:
    """Run a command's coroutine; every failure leaves as one scrubbed line and its code."""
    try:
        return asyncio.run(work)
    except click.ClickException:
        raise  # usage errors: click prints them and exits with 2
    except CliError as exc:
        exc.exit(options.url)
    except demo_module.DemoError as exc:
        CliError(str(exc), ExitCode.FAILED).exit(options.url)
    except Exception as exc:
        error = translate_error(exc, "the command")
        code = ExitCode.UNREACHABLE if error.is_transient else ExitCode.FAILED
        CliError(str(error), code).exit(options.url)


def _engine(url: str) -> AsyncEngine:
    """A pool-less engine: a command opens a connection or two and is gone."""
    try:
        return create_async_engine(
            async_url(url),
            poolclass=NullPool,
            hide_parameters=True,
            connect_args={
                "timeout": CONNECT_TIMEOUT,
                "server_settings": {
                    "application_name": "cronoq-store cli",
                    # No schema another role can write is ever on the path (CVE-2018-1058).
                    "search_path": st.SEARCH_PATH,
                },
            },
        )
    except ValueError as exc:  # async_url's messages are already masked
        raise CliError(str(exc), ExitCode.UNREACHABLE) from None


@asynccontextmanager
async def _database(options: _Options) -> AsyncIterator[AsyncConnection]:
    """One connection with the cluster's schema applied; failing to open it is exit code 3.

    The schema is checked for objects an untrusted role controls before any command reads
    it (``migrations.refuse_untrusted``).
    """
    url = options.database_url()
    engine = _engine(url)
    try:
        try:
            conn = await engine.execution_options(**schema_options(options.schema)).connect()
        except Exception as exc:
            reason = translate_error(exc, "connecting")
            raise CliError(
                f"cannot connect to {redact(url)}: {reason}", ExitCode.UNREACHABLE
            ) from None
        try:
            await conn.run_sync(refuse_untrusted, options.schema, options.trusted_triggers)
            await conn.rollback()
            yield conn
        finally:
            await conn.close()
    finally:
        await engine.dispose()


# --- where a schema stands ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Revision:
    """A schema against this build: ``current`` is empty when it was never migrated."""

    schema: str
    exists: bool
    current: tuple[str, ...]
    head: str
    unknown: tuple[str, ...]
    pending: tuple[str, ...]

    @property
    def at_head(self) -> bool:
        return self.current == (self.head,)

    def describe(self) -> str:
        if not self.exists:
            return "missing"
        if not self.current:
            return "not migrated"
        if self.unknown:
            return "newer than this build"
        if self.at_head:
            return "up to date"
        return f"{len(self.pending)} revision(s) behind: {', '.join(self.pending)}"

    def require_head(self) -> None:
        """Refuse a schema this build cannot read: missing, behind, or newer."""
        fix = f"run `cronoq-store --schema {self.schema} migrate`"
        if not self.exists:
            raise CliError(f"schema {self.schema!r} does not exist: {fix}", ExitCode.NOT_MIGRATED)
        if not self.current:
            raise CliError(f"schema {self.schema!r} is not migrated: {fix}", ExitCode.NOT_MIGRATED)
        if self.unknown:
            raise CliError(_newer_message(self), ExitCode.NEWER_DATABASE)
        if not self.at_head:
            raise CliError(
                f"schema {self.schema!r} is at {', '.join(self.current)}, behind this build's "
                f"head {self.head}: {fix}",
                ExitCode.NOT_MIGRATED,
            )


def _newer_message(revision: _Revision) -> str:
    return (
        f"schema {revision.schema!r} is at revision {', '.join(revision.unknown)}, which this "
        f"build does not know (its newest is {revision.head}): the database was migrated by a "
        "newer cronoq-store; upgrade cronoq-store"
    )


async def _revision(conn: AsyncConnection, schema: str) -> _Revision:
    head = head_revision()
    exists = (await conn.execute(st.schema_oid, {"schema": schema})).scalar() is not None
    current: tuple[str, ...] = ()
    if exists and (await conn.execute(_has_version_table, {"schema": schema})).scalar_one():
        current = tuple((await conn.execute(_revisions)).scalars())
    await conn.rollback()  # no transaction left open across an upgrade or a long command
    script = ScriptDirectory.from_config(alembic_config(schema))
    unknown: list[str] = []
    for rev in current:
        try:
            script.get_revision(rev)
        except CommandError:
            unknown.append(rev)
    pending: tuple[str, ...] = ()
    if exists and not unknown and current != (head,):
        lower = current[0] if len(current) == 1 else None
        pending = tuple(r.revision for r in reversed(list(script.iterate_revisions(head, lower))))
    return _Revision(schema, exists, current, head, tuple(unknown), pending)


async def _require_head(conn: AsyncConnection, schema: str) -> None:
    (await _revision(conn, schema)).require_head()


# --- formatting -----------------------------------------------------------------------------


def _console(*, markup: bool = False) -> Console:
    """Made per command: it reads the terminal (and ``COLUMNS``) as it is at that moment.

    Without markup and emoji codes: keys, messages and pool names are data, and ``[/b]`` or
    ``:fire:`` in them must print as written.
    """
    return Console(highlight=False, markup=markup, emoji=False)


def _print_facts(console: Console, *facts: tuple[str, str]) -> None:
    """Label and value lines, aligned; long values wrap under their value column."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", min_width=11)
    grid.add_column()
    for label, value in facts:
        grid.add_row(label, value)
    console.print(grid)


def _utc(unix_ns: int) -> str:
    moment = UNIX_EPOCH + timedelta(microseconds=unix_ns // 1000)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(moment: datetime) -> str:
    seconds = max(0, int((datetime.now(timezone.utc) - moment).total_seconds()))
    return f"{_format_duration(seconds)} ago" if seconds else "just now"


def _format_duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _task_id(value: int) -> str:
    """An id with what it encodes: the epoch that issued it and its number in that epoch."""
    if not 0 <= value <= I64_MAX:
        return str(value)
    counter = value & ((1 << ID_COUNTER_BITS) - 1)
    return f"{value} (epoch {epoch_of(TaskId(value))}, #{counter})"


def _describe_schedule(stored: str | None) -> str:
    """The stored schedule (its JSON text) as words; undecodable ones are shown, not skipped
    (status is for finding exactly those), and nothing a row holds can make this fail."""
    try:
        return _schedule_words(None if stored is None else json.loads(stored))
    except (ValueError, RecursionError, OverflowError):
        return f"undecodable: {stored}"[:80]


def _schedule_words(schedule: object) -> str:
    if isinstance(schedule, dict):
        if schedule.get("type") == "cron":
            return f"cron {schedule.get('expr')} ({schedule.get('timezone', 'UTC')})"[:80]
        every = schedule.get("every_ns")
        # What recovery decodes: a positive BIGINT of nanoseconds.
        if schedule.get("type") == "interval" and isinstance(every, int) and 0 < every < 2**63:
            if every % 10**9 == 0:
                return f"every {_format_duration(every // 10**9)}"
            return f"every {every / 1e9:g}s"
    return f"undecodable: {schedule!r}"[:80]


def _preview(data: bytes | None) -> str:
    if data is None:
        return "-"
    shown = data[:48]
    return f"{len(data)} bytes: {shown!r}{'...' if len(data) > len(shown) else ''}"


# --- the command line -----------------------------------------------------------------------


def _check_schema(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_schema_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_triggers(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> frozenset[str]:
    try:
        return trusted_trigger_names(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar=URL_ENV,
    show_envvar=True,
    metavar="URL",
    help="Database URL, postgresql://user:password@host/db (the password is never printed).",
)
@click.option(
    "--schema",
    default="public",
    show_default=True,
    callback=_check_schema,
    help="The cluster's schema.",
)
@click.option(
    "--trusted-trigger",
    "trusted_triggers",
    multiple=True,
    metavar="NAME",
    callback=_check_triggers,
    help="A trigger allowed on the cluster's tables, such as an audit (repeatable); it must "
    "have no WHEN clause and run a trusted role's function.",
)
@click.version_option(package_name="cronoq-store")
@click.pass_context
def cli(ctx: click.Context, url: str | None, schema: str, trusted_triggers: frozenset[str]) -> None:
    """Migrate, inspect and prune the PostgreSQL schema of a cronoq scheduler cluster."""
    ctx.obj = _Options(url=url, schema=schema, trusted_triggers=trusted_triggers)


@cli.command()
@click.argument("revision", default="head")
@click.option("--sql", is_flag=True, help="Print the upgrade script instead of running it.")
@click.pass_obj
def migrate(options: _Options, revision: str, sql: bool) -> None:
    """Upgrade the schema to REVISION (default: head), in one serialized transaction.

    With --sql, print the script for review without connecting (REVISION may then be a
    range, FROM:TO).
    """
    if sql:
        _print_script(options.schema, revision)
        return
    _run(options, _migrate(options, revision, _console()))


def _print_script(schema: str, revision: str) -> None:
    cfg = alembic_config(schema)
    script = io.StringIO()
    cfg.output_buffer = script
    try:
        run_command(command.upgrade, cfg, revision, sql=True)
    except CommandError as exc:
        CliError(str(exc), ExitCode.FAILED).exit(None)
    click.echo(script.getvalue(), nl=False)


async def _migrate(options: _Options, revision: str, console: Console) -> None:
    async with _database(options) as conn:
        before = await _revision(conn, options.schema)
    if before.unknown:
        raise CliError(_newer_message(before), ExitCode.NEWER_DATABASE)
    engine = _engine(options.database_url())
    try:
        await upgrade(engine, options.schema, revision, trusted_triggers=options.trusted_triggers)
    except MigrationError as exc:
        raise CliError(str(exc), ExitCode.FAILED) from None
    finally:
        await engine.dispose()
    async with _database(options) as conn:
        after = await _revision(conn, options.schema)
    now = ", ".join(after.current)
    suffix = " (head)" if after.at_head else ""
    if before.current == after.current:
        console.print(f"schema {options.schema!r} already at {now}{suffix}")
    else:
        was = ", ".join(before.current) or "nothing"
        console.print(f"schema {options.schema!r} upgraded: {was} -> {now}{suffix}")


@cli.command()
@click.pass_obj
def status(options: _Options) -> None:
    """Revision, leader, lock holder, task counts, quarantined rows and recurring schedules."""
    _run(options, _status(options, _console()))


async def _status(options: _Options, console: Console) -> None:
    async with _database(options) as conn:
        revision = await _revision(conn, options.schema)
        _print_facts(
            console,
            ("database", redact(options.database_url())),
            ("schema", options.schema),
            ("revision", f"{', '.join(revision.current) or '-'} ({revision.describe()})"),
            ("head", f"{revision.head} (this build)"),
        )
        revision.require_head()
        oid = (await conn.execute(st.schema_oid, {"schema": options.schema})).scalar_one()
        epoch, max_id = (await conn.execute(_leader_row)).one()
        # The store passes the OID as a signed int4; pg_locks shows it unsigned.
        keys = {"k1": st.LOCK_NS_LEADER, "k2": oid & 0xFFFFFFFF}
        holder = (await conn.execute(_lock_holder, keys)).first()
        counts = (await conn.execute(_task_counts)).all()
        quarantined = (await conn.execute(_quarantined)).scalar_one()
        schedules = (await conn.execute(_schedules)).all()

    lock = f"advisory lock ({keys['k1']}, {keys['k2']})"
    if holder is None:
        leader_facts = [("leader", f"none: no session holds the {lock}")]
    elif holder.backend_start is None:
        # Another role's session, and this one may not see its details.
        leader_facts = [
            ("leader", f"pid {holder.pid} (details hidden: grant this role pg_read_all_stats)"),
            ("", f"holds the {lock}"),
        ]
    else:
        since = holder.backend_start.astimezone(timezone.utc)
        leader_facts = [
            (
                "leader",
                f"pid {holder.pid}, {holder.application_name or '(no application_name)'!r}, "
                f"from {holder.client_addr or 'a local socket'}",
            ),
            ("", f"session since {since:%Y-%m-%d %H:%M:%S} UTC ({_ago(since)})"),
            ("", f"holds the {lock}"),
        ]
    _print_facts(
        console,
        ("epoch", f"{epoch}" + (" (no leader yet)" if epoch == 0 else "")),
        ("max id", _task_id(max_id) if max_id else "0 (no task issued)"),
        *leader_facts,
        ("quarantined", f"{quarantined:,} rows"),
    )

    counts_table = Table(title="tasks by pool and status", title_justify="left")
    for name in ("pool", "state", "status"):
        counts_table.add_column(name)
    counts_table.add_column("count", justify="right")
    for row in counts:
        counts_table.add_row(
            row.pool, "finished" if row.terminal else "live", row.status, f"{row.n:,}"
        )
    if counts:
        console.print(counts_table)
    else:
        console.print("no tasks")

    if schedules:
        recurring_table = Table(title="recurring schedules", title_justify="left")
        for name in ("name", "schedule", "next run", "last task"):
            recurring_table.add_column(name)
        for row in schedules:
            recurring_table.add_row(
                row.name,
                _describe_schedule(row.schedule),
                "-" if row.next_unix_ns is None else _utc(row.next_unix_ns),
                "-" if row.last_task_id is None else str(row.last_task_id),
            )
        console.print(recurring_table)
    else:
        console.print("no recurring schedules")


@cli.group("tasks")
def tasks_group() -> None:
    """Look tasks up."""


@tasks_group.command("show")
@click.argument("ref")
@click.option("--key", "as_key", is_flag=True, help="Treat REF as a key even if it is numeric.")
@click.pass_obj
def tasks_show(options: _Options, ref: str, as_key: bool) -> None:
    """Show one task: REF is an id (digits) or a key (the newest task holding it)."""
    by_id = not as_key and re.fullmatch(r"[0-9]+", ref) is not None
    if by_id and int(ref) > I64_MAX:
        raise click.BadParameter(f"{ref} is not a task id (ids fit a signed 64-bit integer)")
    _run(options, _show(options, ref, by_id, _console()))


async def _show(options: _Options, ref: str, by_id: bool, console: Console) -> None:
    async with _database(options) as conn:
        await _require_head(conn, options.schema)
        if by_id:
            row = (await conn.execute(st.task_by_id, {"id": int(ref)})).first()
        else:
            row = (await conn.execute(st.task_by_key, {"key": clean_text(ref)})).first()
    if row is None:
        raise CliError(f"no task with {'id' if by_id else 'key'} {ref!r}", ExitCode.FAILED)
    _print_facts(
        console,
        ("id", _task_id(row.id)),
        ("key", row.key or "-"),
        ("pool", row.pool),
        ("kind", row.kind or "-"),
        ("priority", Priority.from_stored(row.priority).name.lower()),
        ("tenant", row.tenant or "-"),
        ("status", row.status),
        ("attempt", str(row.attempt)),
        ("updated", _utc(row.updated_unix_ns)),
        ("message", row.message or "-"),
        ("output", _preview(row.output)),
    )


@tasks_group.command("finished")
@click.option("--pool", "pools", multiple=True, help="Only this pool (repeatable).")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(_FINISHED, case_sensitive=False),
    help="Only this status (repeatable).",
)
@click.option(
    "--after",
    type=click.IntRange(0, I64_MAX),
    help="Start after this id (the cursor the previous page printed).",
)
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Tasks per page."
)
@click.pass_obj
def tasks_finished(
    options: _Options,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    after: int | None,
    limit: int,
) -> None:
    """List finished tasks in id order, a page at a time."""
    _run(options, _finished(options, pools, statuses, after, limit, _console()))


async def _finished(
    options: _Options,
    pools: Sequence[str],
    statuses: Sequence[str],
    after: int | None,
    limit: int,
    console: Console,
) -> None:
    params = {
        "pools": [clean_text(p) for p in pools],
        "statuses": [s.lower() for s in statuses],
        "after": -1 if after is None else after,
        "limit": limit + 1,  # one more tells whether another page follows
    }
    async with _database(options) as conn:
        await _require_head(conn, options.schema)
        rows = (await conn.execute(st.finished_page, params)).all()
    page, more = rows[:limit], len(rows) > limit
    if not page:
        console.print("no finished tasks" + (" after that id" if after is not None else ""))
        return
    listing = Table(title=f"finished tasks ({len(page)})", title_justify="left")
    for name in ("id", "key", "pool", "kind", "status", "attempt", "updated", "message"):
        listing.add_column(name, justify="right" if name in ("id", "attempt") else "left")
    for row in page:
        listing.add_row(
            str(row.id),
            row.key or "-",
            row.pool,
            row.kind or "-",
            row.status,
            str(row.attempt),
            _utc(row.updated_unix_ns),
            (row.message or "-")[:60],
        )
    console.print(listing)
    if more:
        console.print(f"next page: --after {page[-1].id}")
    else:
        console.print("end of list")


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: Cutoffs are Unix nanoseconds in a BIGINT: keep them far from its limit (292 years).
_MAX_DURATION = 36500 * 86400


def parse_duration(text: str) -> int:
    """Seconds in a whole number of seconds, minutes, hours or days: ``30s``, ``15m``,
    ``12h``, ``7d``; ``ValueError`` says what is accepted."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([smhd])\s*", text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: use a whole number and a unit, like 30s, 15m, 12h or 7d"
        )
    seconds = int(match[1]) * _DURATION_UNITS[match[2]]
    if seconds > _MAX_DURATION:
        raise ValueError(f"{text!r} is too long: at most 36500d")
    return seconds


def _duration_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command()
@click.option(
    "--older-than",
    "older_than",
    callback=_duration_option,
    metavar="DURATION",
    required=True,
    help="Finished tasks last updated longer ago than this (30s, 15m, 12h, 7d).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.pass_obj
def prune(options: _Options, older_than: int, dry_run: bool) -> None:
    """Delete old finished tasks, except those a live task depends on (by id or key).

    Deletes in batches, one short transaction each, as the store does.
    """
    _run(options, _prune(options, older_than, dry_run, _console()))


async def _prune(options: _Options, older_than: int, dry_run: bool, console: Console) -> None:
    async with _database(options) as conn:
        await _require_head(conn, options.schema)
        # The server's clock, not this machine's: the one every operator's run agrees on.
        now = (await conn.execute(select(func.now()))).scalar_one()
        cutoff_ns = (now - UNIX_EPOCH) // timedelta(microseconds=1) * 1000 - older_than * 10**9
        old = (await conn.execute(_finished_before, {"cutoff": cutoff_ns})).scalar_one()
        victims = (
            await conn.execute(_prunable, {"cutoff": cutoff_ns, "batch": I64_MAX})
        ).scalar_one()
        await conn.rollback()
        protected = max(0, old - victims)
        what = (
            f"finished tasks last updated before {_utc(cutoff_ns)} "
            f"({_format_duration(older_than)} ago)"
        )
        if dry_run:
            console.print(f"would prune {victims:,} {what}")
            console.print(f"would keep {protected:,} of them that live tasks depend on")
            return
        deleted = await _delete_in_batches(conn, cutoff_ns, victims)
    console.print(f"pruned {deleted:,} {what}")
    console.print(f"kept {protected:,} of them that live tasks depend on")


async def _delete_in_batches(conn: AsyncConnection, cutoff_ns: int, expected: int) -> int:
    """The store's prune loop, with a progress bar on stderr (stdout keeps the summary)."""
    params = {"cutoff": cutoff_ns, "batch": PRUNE_BATCH}
    total = 0
    progress = Progress(
        TextColumn("pruning"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        bar = progress.add_task("pruning", total=max(expected, 1))
        while True:
            async with conn.begin():
                deleted = (await conn.execute(st.prune_batch, params)).rowcount
            total += deleted
            progress.update(bar, completed=total, total=max(expected, total, 1))
            if deleted < PRUNE_BATCH:
                return total


@cli.command()
@click.option(
    "--url",
    "demo_url",
    metavar="URL",
    help="Run on this server (in a throwaway schema) instead of an embedded PostgreSQL. "
    f"The demo never reads ${URL_ENV}.",
)
@click.option(
    "--submitters",
    type=click.IntRange(1, 1000),
    default=64,
    show_default=True,
    help="Concurrent submitters in instance A, each waiting for its acknowledgements.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(0.5, 300),
    default=5.0,
    show_default=True,
    help="How long instance A accepts submissions before it is killed.",
)
@click.pass_context
def demo(ctx: click.Context, demo_url: str | None, submitters: int, seconds: float) -> None:
    """Crash the leader mid-stream and show that nothing acknowledged is lost.

    Instance A leads and acknowledges submissions from concurrent submitters through group
    commit; B waits as standby. A is killed with SIGKILL; B takes over with the next epoch
    and recovers; a zombie holding A's epoch tries to write and is fenced. Exits 1 if any
    acknowledged write is lost or a stale write lands.
    """
    options: _Options = ctx.obj
    parent = ctx.parent
    # `cronoq-store --url X demo` means X; a URL from the environment never does (it is the
    # operator's database, not a demo's).
    if (
        demo_url is None
        and parent is not None
        and parent.get_parameter_source("url") is ParameterSource.COMMANDLINE
    ):
        demo_url = options.url
    report = _run(
        _Options(url=demo_url, schema=options.schema),
        _demo(demo_url, submitters, seconds, _console(markup=True)),
    )
    if not report.ok:
        CliError(f"the demo failed: {'; '.join(report.failures)}", ExitCode.FAILED).exit(demo_url)


async def _demo(
    url: str | None, submitters: int, seconds: float, console: Console
) -> demo_module.DemoReport:
    if url is not None:
        # A wrong URL or password is exit code 3 here as everywhere.
        async with _database(_Options(url=url, schema="public")):
            pass
    return await demo_module.run_demo(url, submitters=submitters, seconds=seconds, console=console)


def main() -> None:
    """The ``cronoq-store`` console script."""
    cli(prog_name="cronoq-store")


if __name__ == "__main__":
    main()
