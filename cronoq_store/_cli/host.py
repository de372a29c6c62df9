"""``cronoq-store host``: the host groups of a database (``PgHost``): their processes and
clusters (``host list``), clusters put in a group or taken out of it (``host enroll``,
``host remove``), and a cluster moved to another database (``host move``).

``list`` only reads the control schema. ``enroll`` and ``remove`` run the host's own
code (``PgHost.enroll``, ``PgHost.remove``) on a host that never serves: it registers no
process, holds no process lock, and leads nothing. ``enroll`` does not migrate: a cluster
must be at this build's head first (``cronoq-store migrate``), as every command but
``migrate`` leaves a schema's structure alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _door as door
from .._config import PgStoreConfig, validate_schema_name
from .._errors import MigrationError, StoreError
from .._host import control
from .._host import move as moving
from .._host.host import PgHost, PgHostConfig
from .._trust import refuse_untrusted
from .._urls import redact, scrub
from . import database, hosted, output
from .app import Options
from .exits import CliError, ExitCode, code_of, run

__all__ = ["host"]

_C = TypeVar("_C", bound=Callable[..., Any])

#: The group ``PgHostConfig`` uses unless told.
_DEFAULT_GROUP = PgHostConfig().group


def _check_schemas(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> tuple[str, ...]:
    try:
        return tuple(validate_schema_name(name) for name in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_group(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (not value or "\x00" in value or len(value.encode()) > 63):
        raise click.BadParameter("a host group's name is 1 to 63 bytes, no NUL")
    return value


def _group_option(default: str | None) -> Callable[[_C], _C]:
    return click.option(
        "--group",
        metavar="GROUP",
        default=default,
        show_default=default is not None,
        callback=_check_group,
        help="The host group (PgHostConfig.group)."
        + ("" if default is not None else " Without it: every group."),
    )


@click.group(short_help="Host groups (PgHost): list, enroll, remove, move.")
def host() -> None:
    """The host groups (PgHost) of the database: list, enroll, remove, move."""


@host.command("list", short_help="Host processes, enrolled clusters and their owners.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@_group_option(None)
@hosted.control_schema_option
@click.pass_obj
def list_command(options: Options, as_json: bool, group: str | None, control_schema: str) -> None:
    """The host processes that have not left (live while their process lock is held) and
    the enrolled clusters, with their owners, epochs and states, and each owner's count."""
    run(options.url, _list(options, as_json, group, control_schema, output.console()))


async def _read(
    conn: AsyncConnection, control_schema: str, group: str | None
) -> tuple[Sequence[Any], Sequence[Any]]:
    exists = (
        await conn.execute(catalog.relation_exists, {"schema": control_schema, "name": "clusters"})
    ).scalar()
    if not exists:
        raise CliError(
            f"control schema {control_schema!r} holds no host tables: no host ran in this "
            "database with it (another --control-schema?)",
            ExitCode.NO_MATCH,
        )
    try:
        await conn.run_sync(
            lambda sync: refuse_untrusted(sync, control_schema, tables=control.CONTROL_TABLES)
        )
    except MigrationError as exc:
        raise CliError(f"refused: {exc}", ExitCode.FAILED) from None
    in_control = control.control_options(control_schema)
    processes = (await conn.execute(control.process_list, execution_options=in_control)).all()
    clusters = (await conn.execute(control.cluster_list, execution_options=in_control)).all()
    await conn.rollback()
    if group is not None:
        processes = [p for p in processes if p.host_group == group]
        clusters = [c for c in clusters if c.host_group == group]
    return processes, clusters


async def _list(
    options: Options, as_json: bool, group: str | None, control_schema: str, console: Console
) -> None:
    url = options.database_url()
    engine = database.engine(url, lock_wait=options.lock_wait)
    try:
        try:
            async with door.translated("connecting"):
                conn = await engine.connect()
        except StoreError as reason:
            raise CliError(
                f"cannot connect to {redact(url)}: {reason}", ExitCode.UNREACHABLE
            ) from None
        try:
            async with door.translated("reading the control schema"):
                processes, clusters = await _read(conn, control_schema, group)
        finally:
            await conn.close()
    finally:
        await engine.dispose()
    counts: dict[tuple[str, int | None], int] = {}
    for row in clusters:
        if row.state == "active":
            key = (row.host_group, row.owner)
            counts[key] = counts.get(key, 0) + 1
    if as_json:
        output.emit_json(
            {
                "database": redact(url),
                "control_schema": control_schema,
                "group": group,
                "processes": [_process_document(row, counts) for row in processes],
                "clusters": [_cluster_document(row) for row in clusters],
                "counts": [
                    {"group": g, "owner": owner, "clusters": n}
                    for (g, owner), n in sorted(counts.items(), key=_count_order)
                ],
            }
        )
        return
    _print_list(console, url, control_schema, processes, clusters, counts)


def _count_order(item: tuple[tuple[str, int | None], int]) -> tuple[str, int]:
    (group, owner), _ = item
    return group, -1 if owner is None else owner


def _process_document(row: Any, counts: dict[tuple[str, int | None], int]) -> dict[str, object]:
    return {
        "process_id": row.process_id,
        "group": row.host_group,
        "instance": row.instance,
        "backend_pid": row.backend_pid,
        "role": row.role,
        "application_name": row.application_name,
        "joined_at": output.rfc3339(row.joined_at),
        "state": row.state,
        "live": row.lock_pid is not None,
        "clusters": counts.get((row.host_group, row.process_id), 0),
    }


def _cluster_document(row: Any) -> dict[str, object]:
    return {
        "schema": row.schema_name,
        "group": row.host_group,
        "owner": row.owner,
        "epoch": row.epoch,
        "since": output.rfc3339(row.since),
        "state": row.state,
        "refused_why": row.refused_why,
    }


def _print_list(
    console: Console,
    url: str,
    control_schema: str,
    processes: Sequence[Any],
    clusters: Sequence[Any],
    counts: dict[tuple[str, int | None], int],
) -> None:
    output.print_facts(
        console,
        ("database", redact(url)),
        ("control schema", control_schema),
        ("processes", f"{len(processes):,} not left"),
        ("clusters", f"{len(clusters):,} enrolled"),
    )
    if processes:
        output.print_table(
            console,
            "host processes",
            ("group", "process", "instance", "backend pid", "state", "live", "clusters"),
            (
                (
                    row.host_group,
                    str(row.process_id),
                    row.instance,
                    str(row.backend_pid),
                    row.state,
                    "yes" if row.lock_pid is not None else "no (process lock free)",
                    f"{counts.get((row.host_group, row.process_id), 0):,}",
                )
                for row in processes
            ),
            right=("process", "backend pid", "clusters"),
        )
    else:
        console.print("no host processes")
    unowned = sum(n for (_, owner), n in counts.items() if owner is None)
    if unowned:
        console.print(f"unowned active clusters: {unowned:,}")
    if clusters:
        output.print_table(
            console,
            "enrolled clusters",
            ("group", "schema", "owner", "epoch", "state", "note"),
            (
                (
                    row.host_group,
                    row.schema_name,
                    "-" if row.owner is None else str(row.owner),
                    "-" if row.epoch is None else str(row.epoch),
                    row.state,
                    row.refused_why or "",
                )
                for row in clusters
            ),
            right=("owner", "epoch"),
            wrap="note",
        )
    else:
        console.print("no enrolled clusters")


async def _connect(options: Options, group: str, control_schema: str) -> PgHost:
    """A host that will never serve (``PgHost.connect`` registers no process): a URL that
    cannot name a server is a usage error first, as for every command, and failing to
    reach the server exit 3."""
    url = options.database_url()
    await _reach(url)
    store = PgStoreConfig(
        application_name="cronoq-store cli", trusted_triggers=options.trusted_triggers
    )
    config = PgHostConfig(
        store=store, group=group, control_schema=control_schema, max_connections=1
    )
    return await PgHost.connect(url, config)


async def _reach(url: str) -> None:
    """Connect once, as every command does first: whatever fails the connection (a wrong
    password or database name as much as a server down) is exit 3."""
    engine = database.engine(url)
    try:
        async with door.translated("connecting"):
            conn = await engine.connect()
            await conn.close()
    except StoreError as reason:
        raise CliError(f"cannot connect to {redact(url)}: {reason}", ExitCode.UNREACHABLE) from None
    finally:
        await engine.dispose()


@host.command("enroll", short_help="Put clusters in a host group.")
@click.argument("schemas", nargs=-1, required=True, callback=_check_schemas)
@_group_option(_DEFAULT_GROUP)
@hosted.control_schema_option
@click.pass_obj
def enroll(options: Options, schemas: tuple[str, ...], group: str, control_schema: str) -> None:
    """Put the clusters in SCHEMAS in a host group: its processes lead them from then on.

    Each must be at this build's head (run `cronoq-store migrate` first) and led by no
    standalone PgStore (its leader lock held: exit 9). A cluster already in the group is
    made claimable again (a refusal cleared, a cluster made again under its name taken as
    the group's); one in another group fails the command.
    """
    run(options.url, _enroll(options, schemas, group, control_schema, output.console()))


async def _enroll(
    options: Options,
    schemas: Sequence[str],
    group: str,
    control_schema: str,
    console: Console,
) -> None:
    for schema in schemas:
        one = Options(
            url=options.url,
            schema=schema,
            trusted_triggers=options.trusted_triggers,
            lock_wait=options.lock_wait,
        )
        async with database.database(one) as conn:
            await database.require_head(conn, schema)
    made = await _connect(options, group, control_schema)
    try:
        added = await made.enroll(list(schemas), migrate=False)
    finally:
        await made.close()
    for schema in schemas:
        said = "enrolled" if schema in added else "already enrolled"
        console.print(f"{said}: schema {schema} in host group {group}")


@host.command("remove", short_help="Take a cluster out of its host group, fenced.")
@click.argument(
    "schema", callback=lambda ctx, param, value: _check_schemas(ctx, param, (value,))[0]
)
@_group_option(_DEFAULT_GROUP)
@hosted.control_schema_option
@click.pass_obj
def remove(options: Options, schema: str, group: str, control_schema: str) -> None:
    """Take the cluster in SCHEMA out of its host group: the epoch is bumped after the
    commits in flight, so whichever process led it is fenced, and a standalone PgStore may
    lead it from then on. Exit 1 if it is not in the group.
    """
    run(options.url, _remove(options, schema, group, control_schema, output.console()))


async def _remove(
    options: Options, schema: str, group: str, control_schema: str, console: Console
) -> None:
    made = await _connect(options, group, control_schema)
    try:
        removed = await made.remove(schema)
    finally:
        await made.close()
    if not removed:
        raise CliError(
            f"schema {schema!r} is not enrolled in host group {group!r}", ExitCode.FAILED
        )
    console.print(f"removed: schema {schema} from host group {group}")


#: The environment variable that may name the target database of ``host move``, so that
#: its password stays off the command line.
MOVE_TO_ENV = "CRONOQ_MOVE_TO_URL"


@host.command("move", short_help="Move a hosted cluster to another database, losing nothing.")
@click.argument(
    "schema", callback=lambda ctx, param, value: _check_schemas(ctx, param, (value,))[0]
)
@click.option(
    "--from",
    "from_url",
    metavar="URL",
    help="The database the cluster is in. Without it: --url (or its environment variable).",
)
@click.option(
    "--to",
    "to_url",
    metavar="URL",
    envvar=MOVE_TO_ENV,
    show_envvar=True,
    required=True,
    help="The database to move it to, as the role the cluster's store uses there.",
)
@click.option(
    "--drop-source",
    is_flag=True,
    help="Drop the schema in the source once moved (else it stays there as a tombstone).",
)
@_group_option(_DEFAULT_GROUP)
@hosted.control_schema_option
@click.pass_obj
def move(
    options: Options,
    schema: str,
    from_url: str | None,
    to_url: str,
    drop_source: bool,
    group: str,
    control_schema: str,
) -> None:
    """Move the hosted cluster in SCHEMA from one database to another: frozen in the source
    (its epoch bumped: its owner's later commits are fenced), copied to the target in one
    transaction, verified (row counts, digests, epoch, max_id), enrolled there in the same
    host group, and left in the source as a tombstone no one leads.

    Run it again after any interruption: it goes on from the step it reached. A second
    move of the same cluster at the same time is refused. The target must not hold the
    schema, and must be another database than the source (another database of the same
    server is one), which the server tells, whatever the URL. Exit 1 when the move cannot
    go on; the message says what to do.
    """
    source = from_url or options.database_url()
    run(source, _move(options, schema, source, to_url, drop_source, group, control_schema))


async def _move(
    options: Options,
    schema: str,
    source: str,
    target: str,
    drop_source: bool,
    group: str,
    control_schema: str,
) -> None:
    urls = [source, target]
    for url in urls:
        await _reach(url)
    engines = [database.engine(url, lock_wait=options.lock_wait) for url in urls]
    console = output.console()
    try:
        report = await moving.move(
            engines[0],
            engines[1],
            schema,
            group=group,
            control_schema=control_schema,
            trusted_triggers=options.trusted_triggers,
            drop_source=drop_source,
            said=lambda line: console.print(scrub(line, urls)),
        )
    except StoreError as error:
        raise CliError(scrub(str(error), urls), code_of(error)) from None
    finally:
        for engine in engines:
            await engine.dispose()
    carried = "" if report.max_id is None else f" (epoch {report.epoch}, max id {report.max_id})"
    console.print(f"moved: schema {schema} in host group {group} to {redact(target)}{carried}")
