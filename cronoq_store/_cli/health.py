"""``cronoq-store health``: a probe for orchestrators. Exit 0 only when the schema is at this
build's head and some instance holds the leader lock; otherwise the exit code says which
(5 newer database, 4 not at head, 7 the lock held by a session that is not a store
instance, 6 no leader) and each reason is one line."""

from __future__ import annotations

import click
from rich.console import Console

from . import database, operations, output
from .app import Options
from .exits import ExitCode, run

__all__ = ["health"]


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@click.pass_obj
def health(options: Options, as_json: bool) -> None:
    """Exit 0 if the schema is at this build's head and an instance leads, else 4, 5, 6 or 7."""
    code = run(options.url, _health(options, as_json, output.console()))
    if code is not ExitCode.OK:
        raise click.exceptions.Exit(int(code))


async def _health(options: Options, as_json: bool, console: Console) -> ExitCode:
    async with database.database(options) as conn:
        health = await operations.read_health(conn, options.schema)
    code, revision, facts, holder = health.code, health.revision, health.facts, health.holder
    if as_json:
        output.emit_json(operations.health_document(options.schema, health))
        return code
    if holder is not None and facts is not None and code is ExitCode.OK:
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
