"""``cronoq-store demo``: the command only; the demo itself (:mod:`cronoq_store._demo`) is
imported when the command runs, so the operator's commands never load it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from click.core import ParameterSource
from rich.console import Console

from . import database, output
from .app import Options, number_option
from .exits import CliError, ExitCode, run

if TYPE_CHECKING:
    from .._demo import DemoReport

__all__ = ["demo"]


@click.command()
@number_option(
    "--submitters",
    click.IntRange(1, 1000),
    64,
    "Concurrent submitters in instance A, each waiting for its acknowledgements.",
)
@number_option(
    "--seconds",
    click.FloatRange(0.5, 300),
    5.0,
    "How long instance A accepts submissions before it is killed.",
)
@click.pass_context
def demo(ctx: click.Context, submitters: int, seconds: float) -> None:
    """Crash the leader mid-stream and show that nothing acknowledged is lost.

    On an embedded PostgreSQL, or, given --url (before or after the command), on that
    server in a throwaway schema; the demo never reads $CRONOQ_DATABASE_URL.

    Instance A leads and acknowledges submissions from concurrent submitters through group
    commit; B waits as standby. A is killed with SIGKILL; B takes over with the next epoch
    and recovers; a zombie holding A's epoch tries to write and is fenced. Exits 1 if any
    acknowledged write is lost or a stale write lands.
    """
    options: Options = ctx.obj
    parent = ctx.parent
    # `--url X` means X; a URL from the environment never does (it is the operator's
    # database, not a demo's).
    given = parent is not None and parent.get_parameter_source("url") is ParameterSource.COMMANDLINE
    demo_url = options.url if given else None
    report = run(demo_url, _demo(demo_url, submitters, seconds, output.console(markup=True)))
    if not report.ok:
        CliError(f"the demo failed: {'; '.join(report.failures)}", ExitCode.FAILED).exit(demo_url)


async def _demo(url: str | None, submitters: int, seconds: float, console: Console) -> DemoReport:
    from .._demo import DemoError, run_demo

    if url is not None:
        # A wrong URL or password is exit code 3 here as everywhere.
        async with database.database(Options(url=url, schema="public")):
            pass
    try:
        return await run_demo(url, submitters=submitters, seconds=seconds, console=console)
    except DemoError as exc:
        raise CliError(str(exc), ExitCode.FAILED) from None
