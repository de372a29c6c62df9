"""Many clusters at once: which ones a command runs over (``--all``, ``--schemas GLOB``), and
``status`` and ``health`` over them, one line per cluster and a summary, exiting with the
gravest cluster's code (:data:`~cronoq_store._cli.exits.SEVERITY`).

The clusters are the schemas holding the store's version table, found by one catalog
query (a pattern is a bound parameter of it). A name the store would refuse, or a schema
the trust check refuses, is a line of its own saying so, never left out: an operator who
asked for every cluster learns of each one. Reads run ``--jobs`` at once, each on its own
connection of one pool, and print in schema order as they come.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .. import _catalog as catalog
from .. import _door as door
from .. import _queries as queries
from .._config import validate_schema_name
from .._errors import MigrationError, StoreError
from .._terminal_safe import visible
from .._urls import redact, scrub
from . import database, hosted, operations, output
from .app import Options
from .exits import SEVERITY, CliError, ExitCode, code_of, worst

__all__ = [
    "Cluster",
    "Selection",
    "Verdict",
    "jobs_option",
    "over_clusters",
    "read_health",
    "read_status",
    "select",
    "selection",
    "selection_options",
    "unexpected",
]

_C = TypeVar("_C", bound=Callable[..., Any])

#: What a glob may hold: the characters of a schema name and the two wildcards.
_GLOB = re.compile(r"[A-Za-z0-9_*?]{1,63}")


@dataclass(frozen=True, slots=True)
class Selection:
    """The clusters a command runs over: every one, or those whose schema name matches
    ``glob`` (``*`` any run of characters, ``?`` one; case-sensitive, as PostgreSQL
    compares names)."""

    glob: str | None = None

    def like(self) -> str:
        """The glob as a ``LIKE`` pattern, backslash escaping: ``_`` and ``%`` match only
        themselves (``t_*`` must not match ``tx1``)."""
        assert self.glob is not None
        out = []
        for char in self.glob:
            if char == "*":
                out.append("%")
            elif char == "?":
                out.append("_")
            elif char in "%_\\":
                out.append("\\" + char)
            else:
                out.append(char)
        return "".join(out)

    def words(self) -> str:
        """The selection as a reader would say it."""
        return "every cluster" if self.glob is None else f"clusters matching {self.glob!r}"

    def none_found(self) -> str:
        """Why the command has nothing to do, and exits 11."""
        if self.glob is None:
            return "no schema in this database holds a cronoq cluster"
        return (
            f"no cluster schema matches {self.glob!r} (a glob: * matches any run of "
            "characters, ? one character; names compare case-sensitively)"
        )


def _check_glob(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and _GLOB.fullmatch(value) is None:
        raise click.BadParameter(
            f"{value!r} is not a pattern of schema names: use 1 to 63 ASCII letters, digits, "
            "'_', and the wildcards * (any run of characters) and ? (one character)"
        )
    return value


def selection_options(command: _C) -> _C:
    """``--all`` and ``--schemas PATTERN``: a command over many clusters instead of the one
    ``--schema`` names."""
    command = click.option(
        "--schemas",
        "glob",
        metavar="PATTERN",
        callback=_check_glob,
        help="Run over every cluster whose schema name matches PATTERN, a glob: * any run of "
        "characters, ? one (quote it from the shell). Not with --schema or --all.",
    )(command)
    return click.option(
        "--all",
        "every",
        is_flag=True,
        help="Run over every schema of the database that holds a cluster. Not with --schema.",
    )(command)


def jobs_option(default: int, what: str) -> Callable[[_C], _C]:
    """``--jobs N``: how many clusters a command over many works on at once."""
    return click.option(
        "--jobs",
        type=click.IntRange(min=1, max=64),
        default=default,
        show_default=True,
        help=f"With --all or --schemas: {what} at most this many clusters at once.",
    )


def selection(options: Options, every: bool, glob: str | None) -> Selection | None:
    """The selection the options make, ``None`` for the one cluster of ``--schema``; a
    usage error when they contradict each other."""
    if every and glob is not None:
        raise click.UsageError("--all and --schemas select clusters two ways: give one")
    if not every and glob is None:
        _refuse_many_options()
        return None
    if options.schema_typed:
        raise click.UsageError(
            f"--schema names one cluster and {'--all' if every else '--schemas'} selects many: "
            "give one or the other"
        )
    return Selection(glob)


#: Options that mean something only over many clusters.
_MANY_ONLY = {"jobs": "--jobs", "fail_fast": "--fail-fast"}


def _refuse_many_options() -> None:
    """A usage error for ``--jobs`` or ``--fail-fast`` given for one cluster: the operator
    most likely forgot ``--all`` or ``--schemas``, and a command that ignored them would
    run over one cluster where many were meant."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    for name, flag in _MANY_ONLY.items():
        source = ctx.get_parameter_source(name)
        if source is not None and source is not ParameterSource.DEFAULT:
            raise click.UsageError(
                f"{flag} applies to many clusters: give --all or --schemas PATTERN with it"
            )


@dataclass(frozen=True, slots=True)
class Cluster:
    """A schema the selection found; ``refusal`` says why no command may touch it (a name
    the store refuses, or the trust check's finding), ``None`` when it may."""

    schema: str
    refusal: str | None = None


async def select(options: Options, chosen: Selection, engine: AsyncEngine) -> list[Cluster]:
    """The clusters of ``chosen``, in name order, each name checked as ``--schema`` checks
    one; exit 11 when there are none."""
    url = options.database_url()
    statement, params = catalog.cluster_schemas, {}
    if chosen.glob is not None:
        statement, params = catalog.cluster_schemas_like, {"pattern": chosen.like()}
    try:
        async with door.translated("connecting"):
            conn = await engine.connect()
    except StoreError as reason:
        # As for one cluster (database.database): whatever fails the connection (a wrong
        # password or database name as much as a server down) is exit 3.
        raise CliError(f"cannot connect to {redact(url)}: {reason}", ExitCode.UNREACHABLE) from None
    try:
        async with door.translated("listing the clusters"):
            found = (await conn.execute(statement, params)).scalars().all()
    except StoreError as reason:
        code = code_of(reason)
        if code is ExitCode.UNREACHABLE:
            raise CliError(f"cannot connect to {redact(url)}: {reason}", code) from None
        raise CliError(str(reason), code) from None
    finally:
        await conn.close()
    if not found:
        raise CliError(chosen.none_found(), ExitCode.NO_MATCH)
    return [_checked_name(schema) for schema in found]


def _checked_name(schema: str) -> Cluster:
    try:
        return Cluster(validate_schema_name(schema))
    except ValueError as exc:
        return Cluster(schema, f"refused: {exc}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One cluster's line: its exit code, its words, and its JSON object."""

    schema: str
    code: ExitCode
    words: str
    document: dict[str, Any] = field(default_factory=dict)
    refused: bool = False


async def _read(
    options: Options,
    cluster: Cluster,
    engine: AsyncEngine,
    read: Callable[[AsyncConnection, str], Awaitable[Verdict]],
) -> Verdict:
    """``read`` on ``cluster`` through the CLI's own opening (the trust check first), every
    failure turned into the cluster's verdict, the URL masked in it."""
    if cluster.refusal is not None:
        return _failed(cluster.schema, ExitCode.FAILED, cluster.refusal, refused=True)
    one = Options(
        url=options.url,
        schema=cluster.schema,
        trusted_triggers=options.trusted_triggers,
        lock_wait=options.lock_wait,
    )
    try:
        async with (
            door.translated(f"reading schema {cluster.schema!r}", passing=(CliError,)),
            database.database(one, engine) as conn,
        ):
            return await read(conn, cluster.schema)
    except CliError as exc:
        return _failed(cluster.schema, exc.code, scrub(str(exc), [options.url]))
    except MigrationError as exc:  # the trust check's refusal
        return _failed(cluster.schema, ExitCode.FAILED, f"refused: {exc}", refused=True)
    except StoreError as exc:
        return _failed(cluster.schema, code_of(exc), scrub(str(exc), [options.url]))
    except Exception as exc:  # one cluster's failure never ends the run
        return _failed(cluster.schema, ExitCode.FAILED, unexpected(exc, options.url))


def unexpected(exc: BaseException, url: str | None) -> str:
    """The words of a failure nothing translated (a bug, most likely), as a cluster's
    verdict: its type and message, the URL's password masked."""
    return scrub(f"unexpected {type(exc).__name__}: {exc}", [url])


def _failed(schema: str, code: ExitCode, message: str, *, refused: bool = False) -> Verdict:
    document = {"schema": schema, "exit_code": int(code), "error": message}
    if refused:
        document["refused"] = True
    return Verdict(schema, code, message, document, refused)


async def _verdicts(
    options: Options,
    clusters: Sequence[Cluster],
    jobs: int,
    engine: AsyncEngine,
    read: Callable[[AsyncConnection, str], Awaitable[Verdict]],
) -> AsyncIterator[Verdict]:
    """Each cluster's verdict in ``clusters``' order, ``jobs`` read at once."""
    slots = asyncio.Semaphore(jobs)

    async def bounded(cluster: Cluster) -> Verdict:
        async with slots:
            return await _read(options, cluster, engine, read)

    pending = [asyncio.ensure_future(bounded(cluster)) for cluster in clusters]
    try:
        for task in pending:
            yield await task
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def over_clusters(
    options: Options,
    chosen: Selection,
    jobs: int,
    as_json: bool,
    read: Callable[[AsyncConnection, str], Awaitable[Verdict]],
    healthy: str,
) -> ExitCode:
    """Print one line per cluster of ``chosen`` as ``read`` judges it, then the summary;
    return the gravest code. ``healthy``: the word for a cluster whose code is 0.

    Text: ``SCHEMA  CODE  WORDS`` per cluster, then ``summary: ...``. JSON: one object per
    line (JSON Lines), each cluster's, then ``{"summary": {...}}``."""
    url = options.database_url()
    engine = database.engine(url, lock_wait=options.lock_wait, pool_size=jobs)
    try:
        clusters = await select(options, chosen, engine)
        width = max(len(visible(c.schema)) for c in clusters)
        counts: dict[ExitCode, int] = {}
        refused = 0
        async for verdict in _verdicts(options, clusters, jobs, engine, read):
            counts[verdict.code] = counts.get(verdict.code, 0) + 1
            refused += verdict.refused
            if as_json:
                output.emit_json_line(verdict.document)
            else:
                click.echo(
                    f"{visible(verdict.schema):<{width}}  {int(verdict.code):>2}  "
                    f"{visible(verdict.words)}"
                )
    finally:
        await engine.dispose()
    code = worst(counts)
    if as_json:
        output.emit_json_line(
            {
                "summary": {
                    "database": redact(url),
                    "selection": "all" if chosen.glob is None else "pattern",
                    "pattern": chosen.glob,
                    "clusters": len(clusters),
                    "by_exit_code": {str(int(c)): counts[c] for c in sorted(counts)},
                    "refused": refused,
                    "exit_code": int(code),
                }
            }
        )
    else:
        click.echo(_summary(chosen, len(clusters), counts, refused, code, healthy))
    return code


def _summary(
    chosen: Selection,
    total: int,
    counts: dict[ExitCode, int],
    refused: int,
    code: ExitCode,
    healthy: str,
) -> str:
    parts = [f"{counts.get(ExitCode.OK, 0)} {healthy}"]
    parts += [
        f"{counts[c]} exit {int(c)}" for c in SEVERITY if c is not ExitCode.OK and c in counts
    ]
    if refused:
        parts.append(f"{refused} of them refused")
    return (
        f"summary: {total} cluster(s), {chosen.words()}: {', '.join(parts)}; exit code {int(code)}"
    )


def _leader_words(holder: Any) -> str:
    leader = output.leader_of(holder)
    if leader is None:
        return "no leader" if holder is None else "lock held by a session that is not a store"
    instance = "" if leader.instance is None else f"instance {leader.instance}, "
    return f"leader {instance}backend pid {leader.pid}"


async def read_health(
    conn: AsyncConnection,
    schema: str,
    control_schema: str = hosted.DEFAULT_CONTROL_SCHEMA,
    vetted: set[str] | None = None,
) -> Verdict:
    """``health``'s verdict on one cluster of many (its single-schema document, and the
    code); a hosted cluster's owner read in ``control_schema`` (checked once per run with
    ``vetted``, :func:`~cronoq_store._cli.hosted.read_host`)."""
    health = await operations.read_health(conn, schema, control_schema, vetted)
    document = {**operations.health_document(schema, health), "exit_code": int(health.code)}
    if health.code is ExitCode.OK:
        epoch = None if health.facts is None else health.facts.stored_epoch
        leader = (
            _leader_words(health.holder)
            if health.host is None
            else f"{health.host.mode_words()}, leader {hosted.leader_words(health.host)}"
        )
        words = f"healthy: epoch {epoch}, {leader}"
    else:
        words = "unhealthy: " + "; ".join(health.reasons)
    warnings = health.warnings
    if health.migration_lock is not None:
        words += f" (warning: {warnings[0]})"
    return Verdict(schema, health.code, words, document)


async def read_status(
    conn: AsyncConnection,
    schema: str,
    control_schema: str = hosted.DEFAULT_CONTROL_SCHEMA,
    vetted: set[str] | None = None,
) -> Verdict:
    """``status``'s line on one cluster of many: what every revision holds (revision, epoch,
    leader, migration lock), without the task counts, which read the cluster's tables; the
    code is ``status``'s own (4 or 5 off head, else 0). A hosted cluster's leader is its
    owning host process, read in ``control_schema``."""
    revision = await database.revision(conn, schema)
    facts, holder = await operations.schema_facts(conn, revision)
    migrating = await queries.migration_lock_holder(conn, schema)
    group = hosted.host_group(facts)
    await conn.rollback()
    host = None
    if group is not None:
        host = await hosted.read_host(conn, schema, group, control_schema, vetted)
    code = ExitCode.OK
    if not revision.at_head:
        code = ExitCode.NEWER_DATABASE if revision.unknown else ExitCode.NOT_MIGRATED
    epoch = None if facts is None else facts.stored_epoch
    document = {
        "schema": schema,
        "revision": list(revision.current),
        "head": revision.head,
        "at_head": revision.at_head,
        "revision_state": revision.describe(),
        "epoch": epoch,
        "incarnation": None if facts is None else facts.incarnation,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
        "migration_lock": output.session_document(migrating),
        **operations.mode_document(host, holder),
        "exit_code": int(code),
    }
    words = [
        f"{', '.join(revision.current) or '-'} ({revision.describe()})",
        f"epoch {'-' if epoch is None else epoch}",
        _leader_words(holder)
        if host is None
        else f"{host.mode_words()}, leader {hosted.leader_words(host)}",
    ]
    if migrating is not None:
        words.append(f"migration lock held by backend pid {migrating.pid}")
    return Verdict(schema, code, ", ".join(words), document)
