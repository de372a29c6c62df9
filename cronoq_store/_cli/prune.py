"""``cronoq-store prune``: delete old finished tasks, or count them with ``--dry-run``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import _queries as queries
from . import database, operations, output
from .app import Options
from .exits import run

__all__ = ["parse_duration", "prune"]

_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> int:
    """Seconds in a whole number of seconds, minutes, hours, days or weeks: ``30s``,
    ``15m``, ``12h``, ``7d``, ``2w``; ``ValueError`` says what is accepted."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([smhdw])\s*", text)
    # Quoted to a bound: the text may come from a console page's query string.
    quoted = repr(text[:40]) + ("..." if len(text) > 40 else "")
    if match is None:
        raise ValueError(
            f"{quoted} is not a duration: use a whole number and a unit, "
            "like 30s, 15m, 12h, 7d or 2w"
        )
    # Any number of more digits is too long; int() would refuse thousands of them with a
    # message about the interpreter's own limit.
    digits = match[1].lstrip("0") or "0"
    seconds = int(digits) * _DURATION_UNITS[match[2]] if len(digits) <= 12 else None
    if seconds is None or seconds > queries.MAX_PRUNE_AGE:
        raise ValueError(f"{quoted} is too long: at most 36500d")
    return seconds


def _duration_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option(
    "--older-than",
    "older_than",
    callback=_duration_option,
    metavar="DURATION",
    required=True,
    help="Finished tasks last updated longer ago than this (30s, 15m, 12h, 7d, 2w).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document on stdout instead of text, and no progress bar.",
)
@click.pass_obj
def prune(options: Options, older_than: int, dry_run: bool, as_json: bool) -> None:
    """Delete old finished tasks, except those a live task depends on (by id or key).

    Deletes in batches, one short transaction each, with the store's own prune loop; the
    cutoff is counted on the server's clock.
    """
    run(options.url, _prune(options, older_than, dry_run, as_json, output.console()))


async def _prune(
    options: Options, older_than: int, dry_run: bool, as_json: bool, console: Console
) -> None:
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        # The server's clock, as PgStore.prune counts: the one every machine agrees on.
        cutoff_ns, victims, protected = await operations.plan_prune(conn, older_than)
        what = (
            f"finished tasks last updated before {output.utc(cutoff_ns)} "
            f"({output.format_duration(older_than)} ago)"
        )
        deleted = None
        if not dry_run:
            cluster = await operations.prune_cluster(conn, options.schema)
            with _progress_bar(victims, shown=not as_json) as progress:
                deleted = await operations.prune_batches(
                    conn, cluster, cutoff_ns, progress, options.lock_wait
                )
    if as_json:
        output.emit_json(
            {
                "schema": options.schema,
                "dry_run": dry_run,
                "older_than_s": older_than,
                "cutoff": output.rfc3339(cutoff_ns),
                "prunable": victims,
                "protected": protected,
                "deleted": deleted,
            }
        )
    elif deleted is None:
        console.print(f"would prune {victims:,} {what}")
        console.print(f"would keep {protected:,} of them that live tasks depend on")
    else:
        console.print(f"pruned {deleted:,} {what}")
        console.print(f"kept {protected:,} of them that live tasks depend on")


@contextmanager
def _progress_bar(expected: int, *, shown: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (stdout keeps the summary), gone when done; gives the
    callback that takes the running total of deleted rows. Not ``shown``: a callback that
    draws nothing."""
    if not shown:
        yield lambda total: None
        return
    bar = Progress(
        TextColumn("pruning"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with bar:
        task = bar.add_task("pruning", total=max(expected, 1))

        def update(total: int) -> None:
            bar.update(task, completed=total, total=max(expected, total, 1))

        yield update
