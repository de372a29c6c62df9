"""``cronoq-store health``: a probe for orchestrators. Exit 0 only when the schema is at this
build's head and some instance holds the leader lock; otherwise the exit code says which
(5 newer database, 4 not at head, 7 the lock held by a session that is not a store
instance, 6 no leader) and each reason is one line."""

from __future__ import annotations

import click
from rich.console import Console

from . import database, fleet, hosted, operations, output
from .app import Options
from .exits import ExitCode, run

__all__ = ["health"]


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@fleet.selection_options
@fleet.jobs_option(2, "probe")
@hosted.control_schema_option
@click.pass_obj
def health(
    options: Options,
    as_json: bool,
    every: bool,
    glob: str | None,
    jobs: int,
    control_schema: str,
) -> None:
    """Exit 0 if the schema is at this build's head and an instance leads, else 4, 5, 6 or 7.

    A cluster a host group leads (PgHost) is led by the host process its control row
    names, while that process's lock is held: else 6; a session holding the cluster's own
    leader lock blocks every claim: 7.

    With --all or --schemas: one line per cluster and a summary (with --json, one JSON
    object per line, the summary last); the exit code is the gravest cluster's.
    """
    chosen = fleet.selection(options, every, glob)
    # The control schema's trust check, once for every hosted cluster of the run.
    vetted: set[str] = set()
    if chosen is not None:
        work = fleet.over_clusters(
            options,
            chosen,
            jobs,
            as_json,
            lambda conn, schema: fleet.read_health(conn, schema, control_schema, vetted),
            "healthy",
        )
    else:
        work = _health(options, as_json, output.console(), control_schema)
    code = run(options.url, work)
    if code is not ExitCode.OK:
        raise click.exceptions.Exit(int(code))


async def _health(
    options: Options, as_json: bool, console: Console, control_schema: str
) -> ExitCode:
    async with database.database(options) as conn:
        health = await operations.read_health(conn, options.schema, control_schema)
    code, revision, facts, holder = health.code, health.revision, health.facts, health.holder
    if as_json:
        output.emit_json(operations.health_document(options.schema, health))
        return code
    host = health.host
    if host is not None and facts is not None and code is ExitCode.OK:
        console.print(
            f"healthy: schema {options.schema} at {revision.head}, {host.mode_words()}: "
            f"{hosted.leader_words(host)}, epoch {facts.stored_epoch}"
        )
    elif holder is not None and facts is not None and code is ExitCode.OK:
        console.print(
            f"healthy: schema {options.schema} at {revision.head}, "
            f"leader's backend pid {holder.pid} "
            f"({holder.application_name or 'details hidden'}), epoch {facts.stored_epoch}"
        )
    else:
        for reason in health.reasons:
            console.print(f"unhealthy: {reason}")
    for warning in health.warnings:
        console.print(f"warning: {warning}")
    return code
