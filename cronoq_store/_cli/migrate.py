"""``cronoq-store migrate``: the one command that changes a schema's structure."""

from __future__ import annotations

import io
from collections.abc import Callable

import click
from alembic import command
from alembic.util import CommandError
from rich.console import Console

from .._config import MIGRATION_LOCK_TIMEOUT
from .._errors import MigrationError
from .._migrations import (
    FORCE,
    LOCK_TIMEOUT,
    alembic_config,
    downgrade_steps,
    run_command,
    upgrade,
)
from . import database, fleet, fleet_migrate, output
from .app import Options, number_option
from .exits import CliError, ExitCode, run

__all__ = ["lock_timeout_option", "migrate", "print_script"]


#: The ``--lock-timeout`` of ``migrate`` and ``downgrade``.
lock_timeout_option = number_option(
    "--lock-timeout",
    click.FloatRange(min=0, min_open=True),
    MIGRATION_LOCK_TIMEOUT,
    "Seconds to wait for the schema's migration lock and its tables while other sessions "
    "hold them (who holds them is printed on stderr meanwhile); then exit 9, naming them.",
)


@click.command()
@click.argument("revision", default="head")
@click.option("--sql", is_flag=True, help="Print the upgrade script instead of running it.")
@lock_timeout_option
@fleet.selection_options
@fleet.jobs_option(2, "migrate")
@click.option(
    "--fail-fast",
    is_flag=True,
    help="With --all or --schemas: start no more migrations after one fails.",
)
@click.pass_obj
def migrate(
    options: Options,
    revision: str,
    sql: bool,
    lock_timeout: float,
    every: bool,
    glob: str | None,
    jobs: int,
    fail_fast: bool,
) -> None:
    """Upgrade the schema to REVISION (default: head), in one serialized transaction.

    With --sql, print the script for review without connecting (REVISION may then be a
    range, FROM:TO). A REVISION below the current one is refused: downgrades are their own
    command (cronoq-store downgrade --help).

    With --all or --schemas: every selected cluster to head, in --jobs worker processes
    (one migration at a time each); a line as each ends (from -> to, seconds, outcome)
    and a summary. Run it again after an interruption or a failure: it does only what is
    left. SIGINT or SIGTERM starts no more and waits for those running; a second signal
    cancels them.
    """
    chosen = fleet.selection(options, every, glob)
    if chosen is not None:
        if sql or revision != "head":
            raise click.UsageError(
                "--all and --schemas migrate to head, online: leave out REVISION and --sql "
                "(or give one --schema)"
            )
        code = run(
            options.url,
            fleet_migrate.migrate_clusters(options, chosen, jobs, lock_timeout, fail_fast),
        )
        if code:
            raise click.exceptions.Exit(code)
        return
    if sql:
        print_script(command.upgrade, options.schema, revision, lock_timeout=lock_timeout)
        return
    with output.store_log_on_stderr():
        run(options.url, _migrate(options, revision, lock_timeout, output.console()))


def print_script(
    alembic_command: Callable[..., None],
    schema: str,
    revision: str,
    *,
    force: bool = False,
    lock_timeout: float = MIGRATION_LOCK_TIMEOUT,
) -> None:
    """Print Alembic's offline script for ``schema`` without connecting (``force``: a
    downgrade's script does not stop under a live leader, it fences it; ``lock_timeout``:
    its lock waits give up after that long). Nothing but the arguments can make it fail (a
    revision or range Alembic refuses, ``downgrade`` without ``FROM:TO``): a usage error."""
    cfg = alembic_config(schema)
    cfg.attributes[FORCE] = force
    cfg.attributes[LOCK_TIMEOUT] = lock_timeout
    script = io.StringIO()
    cfg.output_buffer = script
    try:
        run_command(alembic_command, cfg, revision, sql=True)
    except CommandError as exc:
        CliError(str(exc), ExitCode.USAGE).exit(None)
    click.echo(script.getvalue(), nl=False)


async def _migrate(options: Options, revision: str, lock_timeout: float, console: Console) -> None:
    async with database.database(options) as conn:
        before = await database.revision(conn, options.schema)
    if before.unknown:
        database.refuse_unless_at_head(before)
    undone = downgrade_steps(before.current, revision)
    if undone:
        raise CliError(
            f"schema {options.schema!r} is at {before.current[0]}, above {revision}: migrate "
            f"only upgrades; to undo {', '.join(undone)} (what they hold is lost), run "
            f"`cronoq-store --schema {options.schema} downgrade {revision}`",
            ExitCode.USAGE,
        )
    engine = database.engine(options.database_url())
    try:
        await upgrade(
            engine,
            options.schema,
            revision,
            trusted_triggers=options.trusted_triggers,
            lock_timeout=lock_timeout,
        )
    except MigrationError as exc:
        raise CliError(str(exc), ExitCode.FAILED) from None
    finally:
        await engine.dispose()
    async with database.database(options) as conn:
        after = await database.revision(conn, options.schema)
    now = ", ".join(after.current)
    suffix = " (head)" if after.at_head else ""
    if before.current == after.current:
        console.print(f"schema {options.schema!r} already at {now}{suffix}")
    else:
        was = ", ".join(before.current) or "nothing"
        console.print(f"schema {options.schema!r} upgraded: {was} -> {now}{suffix}")
