"""``cronoq-store downgrade``: the one command that undoes revisions, explicitly.

A downgrade drops what the undone revisions hold (``base``: every table of the cluster,
every task with them), so it names them and asks first: ``--yes`` in a script, a
confirmation on a terminal, a usage error otherwise. It runs as ``migrate`` does: one
transaction under the schema's migration lock, the same trust checks. It refuses (exit 1)
while an instance holds the leader lock, naming it, and to base once the cluster issued
task ids, unless ``--force`` (:mod:`cronoq_store._migrations`).
"""

from __future__ import annotations

import sys

import click
from alembic import command
from rich.console import Console

from .._errors import MigrationError
from .._migrations import downgrade, downgrade_steps
from . import database, output
from .app import Options
from .exits import CliError, ExitCode, run
from .migrate import lock_timeout_option, print_script

__all__ = ["downgrade_command"]


@click.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (scripts).")
@click.option(
    "--force",
    is_flag=True,
    help="Downgrade even while an instance leads (it is fenced), or to base of a cluster "
    "that issued task ids (a cluster migrated again here issues them again).",
)
@click.option(
    "--sql", is_flag=True, help="Print the downgrade script instead of running it (FROM:TO)."
)
@lock_timeout_option
@click.pass_obj
def downgrade_command(
    options: Options, revision: str, sql: bool, yes: bool, force: bool, lock_timeout: float
) -> None:
    """Downgrade the schema to REVISION (base removes the cluster), in one serialized
    transaction; what the undone revisions hold is lost.

    Refused while an instance holds the leader lock, and to base once the cluster issued
    task ids, unless --force.

    With --sql, print the script for review without connecting: REVISION is then a range,
    FROM:TO (e.g. 0006_drop_legacy_version_table:0005_task_tenant). The script stops if an
    instance leads when it runs (with --force: fences it).
    """
    if sql:
        print_script(
            command.downgrade, options.schema, revision, force=force, lock_timeout=lock_timeout
        )
        return
    current, undone = run(options.url, _plan(options, revision))
    question = (
        f"Downgrade schema {options.schema!r} from {current} to {revision}, undoing "
        f"{', '.join(undone)}? What they hold is lost."
    )
    if not yes:
        if not sys.stdin.isatty():
            CliError(f"{question} Pass --yes to confirm.", ExitCode.USAGE).exit(options.url)
        if not click.confirm(question, default=False):
            CliError("downgrade cancelled: nothing changed", ExitCode.FAILED).exit(options.url)
    with output.store_log_on_stderr():
        run(
            options.url,
            _downgrade(options, revision, current, force, lock_timeout, output.console()),
        )


async def _plan(options: Options, revision: str) -> tuple[str, tuple[str, ...]]:
    """Where the schema stands and which revisions going to ``revision`` undoes."""
    schema = options.schema
    async with database.database(options) as conn:
        before = await database.revision(conn, schema)
    if before.unknown or not before.current:
        database.refuse_unless_at_head(before)  # newer (5), missing or never migrated (4)
    undone = downgrade_steps(before.current, revision)
    if not undone:
        raise CliError(
            f"schema {schema!r} is at {', '.join(before.current)}: {revision!r} is not a "
            "revision below it (`cronoq-store migrate` upgrades)",
            ExitCode.USAGE,
        )
    return before.current[0], undone


async def _downgrade(
    options: Options,
    revision: str,
    current: str,
    force: bool,
    lock_timeout: float,
    console: Console,
) -> None:
    schema = options.schema
    engine = database.engine(options.database_url())
    try:
        await downgrade(
            engine,
            schema,
            revision,
            trusted_triggers=options.trusted_triggers,
            force=force,
            lock_timeout=lock_timeout,
        )
    except MigrationError as exc:
        raise CliError(str(exc), ExitCode.FAILED) from None
    finally:
        await engine.dispose()
    async with database.database(options) as conn:
        after = await database.revision(conn, schema)
    now = ", ".join(after.current) or "base (no cluster tables)"
    console.print(f"schema {schema!r} downgraded: {current} -> {now}")
