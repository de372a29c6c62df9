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
    from .._demo import DemoReport, FleetReport

__all__ = ["demo"]


@click.command()
@number_option(
    "--submitters",
    click.IntRange(1, 1000),
    64,
    "Concurrent submitters in instance A, each waiting for its acknowledgements (with "
    "--fleet: spread over the clusters, at least one each).",
)
@number_option(
    "--seconds",
    click.FloatRange(0.5, 300),
    5.0,
    "How long instance A accepts submissions before it is killed.",
)
@click.option(
    "--fleet",
    is_flag=True,
    help="The fleet variant: host processes share many clusters, and one is killed.",
)
@number_option("--clusters", click.IntRange(2, 1000), 12, "With --fleet: the clusters.")
@number_option("--processes", click.IntRange(2, 16), 3, "With --fleet: the host processes.")
@click.pass_context
def demo(
    ctx: click.Context,
    submitters: int,
    seconds: float,
    fleet: bool,
    clusters: int,
    processes: int,
) -> None:
    """Crash the leader mid-stream and show that nothing acknowledged is lost.

    On an embedded PostgreSQL, or, given --url (before or after the command), on that
    server in a throwaway schema; the demo never reads $CRONOQ_DATABASE_URL.

    Instance A leads and acknowledges submissions from concurrent submitters through group
    commit; B waits as standby. A is killed with SIGKILL; B takes over with the next epoch
    and recovers; a zombie holding A's epoch tries to write and is fenced. Exits 1 if any
    acknowledged write is lost or a stale write lands.

    With --fleet, host processes (PgHost) share --clusters clusters, the submitters spread
    over them; one process is killed, the others take its clusters over with their next
    epochs and recover them. Exits 1 if any acknowledged write is lost or an epoch of a
    cluster was acknowledged by two processes.
    """
    if not fleet:
        for name in ("clusters", "processes"):
            if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                raise click.UsageError(f"--{name} applies to the fleet variant: add --fleet")
    elif clusters < processes:
        raise click.UsageError("--clusters: at least one per process (--processes)")
    options: Options = ctx.obj
    parent = ctx.parent
    # `--url X` means X; a URL from the environment never does (it is the operator's
    # database, not a demo's).
    given = parent is not None and parent.get_parameter_source("url") is ParameterSource.COMMANDLINE
    demo_url = options.url if given else None
    console = output.console(markup=True)
    shape = (clusters, processes) if fleet else None
    report = run(demo_url, _demo(demo_url, submitters, seconds, shape, console))
    if not report.ok:
        CliError(f"the demo failed: {'; '.join(report.failures)}", ExitCode.FAILED).exit(demo_url)


async def _demo(
    url: str | None,
    submitters: int,
    seconds: float,
    fleet: tuple[int, int] | None,
    console: Console,
) -> DemoReport | FleetReport:
    from .._demo import DemoError, run_demo, run_fleet_demo

    if url is not None:
        # A wrong URL or password is exit code 3 here as everywhere.
        async with database.database(Options(url=url, schema="public")):
            pass
    try:
        if fleet is None:
            return await run_demo(url, submitters=submitters, seconds=seconds, console=console)
        clusters, processes = fleet
        return await run_fleet_demo(
            url,
            clusters=clusters,
            processes=processes,
            submitters=submitters,
            seconds=seconds,
            console=console,
        )
    except DemoError as exc:
        raise CliError(str(exc), ExitCode.FAILED) from None
