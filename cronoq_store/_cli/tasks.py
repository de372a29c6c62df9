"""``cronoq-store tasks``: look one task up, or page through finished ones. Rows are decoded
by :mod:`cronoq_store._rows` through :mod:`cronoq_store._queries`, as the store's look-ups are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import click
from rich.console import Console

from .. import _queries as queries
from .._domain import I64_MAX, TaskId, TaskStatus
from .._queries import ListedTask
from .._stored_values import TaskRecord
from . import database, operations, output
from .app import Options
from .exits import CliError, ExitCode, run

__all__ = ["tasks"]

#: The statuses ``--status`` accepts: the finished ones.
_FINISHED = [s.value for s in TaskStatus if s.is_terminal]

_json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)


@click.group()
def tasks() -> None:
    """Look tasks up."""


@tasks.command("show", epilog=f"REF: {output.ID_FORMS}; anything else is a key.")
@click.argument("ref")
@click.option(
    "--key", "as_key", is_flag=True, help="Treat REF as a key even if it looks like an id."
)
@_json_option
@click.pass_obj
def show(options: Options, ref: str, as_key: bool, as_json: bool) -> None:
    """Show one task: REF is an id, its short form EPOCH/N, a bare number N, or a key (the
    newest task holding it).

    A bare N that names tasks of several epochs lists them and exits 10: give EPOCH/N."""
    try:
        parsed = None if as_key else output.parse_id(ref)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    run(options.url, _show(options, ref if parsed is None else parsed, as_json, output.console()))


async def _show(options: Options, ref: output.IdRef | str, as_json: bool, console: Console) -> None:
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        found = await operations.find_tasks(conn, ref)
    if not found:
        kind = "key" if isinstance(ref, str) else "id"
        text = ref if isinstance(ref, str) else ref.text
        raise CliError(f"no task with {kind} '{text}'", ExitCode.FAILED)
    if len(found) > 1:
        assert isinstance(ref, output.IdRef)
        _ambiguous(ref, found, as_json, console)
    record, status = found[0]
    if as_json:
        output.emit_json(output.task_document(record, status))
        return
    output.print_facts(
        console,
        ("id", output.task_id(record.id)),
        ("key", record.key or "-"),
        ("pool", record.pool),
        ("kind", record.kind or "-"),
        ("priority", record.priority.name.lower()),
        ("tenant", record.tenant or "-"),
        ("status", status),
        ("attempt", str(record.attempt)),
        ("updated", _updated(record)),
        ("message", record.message or "-"),
        ("output", output.preview(record.output)),
    )


def _ambiguous(
    ref: output.IdRef, found: Sequence[ListedTask], as_json: bool, console: Console
) -> NoReturn:
    """List the tasks a bare number names in several epochs, and exit 10."""
    shown = found[: operations.MATCHES_SHOWN]
    more = len(found) > len(shown)
    if as_json:
        output.emit_json(
            {
                "ambiguous": ref.text,
                "matches": [output.task_document(*listed) for listed in shown],
                "more": more,
            }
        )
    else:
        output.print_table(
            console,
            f"tasks numbered {ref.text}",
            ("id", "short", "key", "pool", "status", "updated"),
            (
                (str(r.id), output.short_id(r.id) or "-", r.key or "-", r.pool, status, _updated(r))
                for r, status in shown
            ),
            right=("id",),
        )
    count = f"more than {len(shown)}" if more else str(len(shown))
    raise CliError(
        f"{ref.text} names {count} tasks of different epochs: give one as EPOCH/N",
        ExitCode.AMBIGUOUS,
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
@_json_option
@click.pass_obj
def finished(
    options: Options,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    after: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """List finished tasks in id order, a page at a time."""
    chosen = [TaskStatus(s.lower()) for s in statuses]
    cursor = None if after is None else TaskId(after)
    run(options.url, _finished(options, pools, chosen, cursor, limit, as_json, output.console()))


async def _finished(
    options: Options,
    pools: Sequence[str],
    statuses: Sequence[TaskStatus],
    after: TaskId | None,
    limit: int,
    as_json: bool,
    console: Console,
) -> None:
    # One more than a page tells whether another page follows.
    params = queries.finished_params(pools, statuses, after, limit + 1)
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        records = await queries.list_listed_finished(conn, params)
    page, more = records[:limit], len(records) > limit
    next_after = page[-1].record.id if more else None
    if as_json:
        output.emit_json(
            {"tasks": [output.task_document(*listed) for listed in page], "next_after": next_after}
        )
        return
    if not page:
        console.print("no finished tasks" + (" after that id" if after is not None else ""))
        return
    output.print_table(
        console,
        f"finished tasks ({len(page)})",
        ("id", "key", "pool", "kind", "status", "attempt", "updated", "message"),
        (
            (
                str(r.id),
                r.key or "-",
                r.pool,
                r.kind or "-",
                status,
                str(r.attempt),
                _updated(r),
                (r.message or "-")[:60],
            )
            for r, status in page
        ),
        right=("id", "attempt"),
        wrap="message",
    )
    console.print("end of list" if next_after is None else f"next page: --after {next_after}")


def _updated(record: TaskRecord) -> str:
    return record.updated.strftime("%Y-%m-%d %H:%M:%S UTC")
