"""``cronoq-store tasks``: look one task up, or page through finished ones."""

from __future__ import annotations

import re
from collections.abc import Sequence

import click
from rich.console import Console
from rich.table import Table

from .. import statements as st
from ..codec import clean_text
from ..domain import I64_MAX, Priority, TaskStatus
from . import database, output
from .app import Options
from .exits import CliError, ExitCode, run

__all__ = ["tasks"]

#: The statuses ``--status`` accepts: the finished ones.
_FINISHED = [s.value for s in TaskStatus if s.is_terminal]


@click.group()
def tasks() -> None:
    """Look tasks up."""


@tasks.command("show")
@click.argument("ref")
@click.option("--key", "as_key", is_flag=True, help="Treat REF as a key even if it is numeric.")
@click.pass_obj
def show(options: Options, ref: str, as_key: bool) -> None:
    """Show one task: REF is an id (digits) or a key (the newest task holding it)."""
    by_id = not as_key and re.fullmatch(r"[0-9]+", ref) is not None
    if by_id and int(ref) > I64_MAX:
        raise click.BadParameter(f"{ref} is not a task id (ids fit a signed 64-bit integer)")
    run(options.url, _show(options, ref, by_id, output.console()))


async def _show(options: Options, ref: str, by_id: bool, console: Console) -> None:
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        if by_id:
            row = (await conn.execute(st.task_by_id, {"id": int(ref)})).first()
        else:
            row = (await conn.execute(st.task_by_key, {"key": clean_text(ref)})).first()
    if row is None:
        raise CliError(f"no task with {'id' if by_id else 'key'} {ref!r}", ExitCode.FAILED)
    output.print_facts(
        console,
        ("id", output.task_id(row.id)),
        ("key", row.key or "-"),
        ("pool", row.pool),
        ("kind", row.kind or "-"),
        ("priority", Priority.from_stored(row.priority).name.lower()),
        ("tenant", row.tenant or "-"),
        ("status", row.status),
        ("attempt", str(row.attempt)),
        ("updated", output.utc(row.updated_unix_ns)),
        ("message", row.message or "-"),
        ("output", output.preview(row.output)),
    )


@tasks.command("finished")
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
def finished(
    options: Options,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    after: int | None,
    limit: int,
) -> None:
    """List finished tasks in id order, a page at a time."""
    run(options.url, _finished(options, pools, statuses, after, limit, output.console()))


async def _finished(
    options: Options,
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
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
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
            output.utc(row.updated_unix_ns),
            (row.message or "-")[:60],
        )
    console.print(listing)
    if more:
        console.print(f"next page: --after {page[-1].id}")
    else:
        console.print("end of list")
