"""``cronoq-store tasks``: look one task up, or page through live or finished ones (the
console's lists, read by the same :mod:`cronoq_store._cli.operations`). Rows are decoded
by :mod:`cronoq_store._schema` through :mod:`cronoq_store._queries`, as the store's look-ups are."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timezone
from typing import Any, NamedTuple, NoReturn

import click
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _listing_statements as ls
from .._domain import I64_MAX, LIVE_STATUS_NAMES, UNIX_EPOCH, TaskStatus, clean_text
from .._queries import ListedTask
from .._results import TaskRecord
from . import database, operations, output
from .app import Options
from .exits import CliError, ExitCode, run

__all__ = ["MESSAGE_SHOWN", "tasks"]

#: The statuses ``--status`` accepts: the finished ones, the live ones.
_FINISHED = [s.value for s in TaskStatus if s.is_terminal]
_LIVE = sorted(LIVE_STATUS_NAMES)

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
        spec = await operations.read_spec(conn, found[0].record.id) if len(found) == 1 else None
    if not found:
        kind = "key" if isinstance(ref, str) else "id"
        text = ref if isinstance(ref, str) else ref.text
        raise CliError(f"no task with {kind} '{text}'", ExitCode.FAILED)
    if len(found) > 1:
        assert isinstance(ref, output.IdRef)
        _ambiguous(ref, found, as_json, console)
    record, status = found[0]
    assert spec is not None
    view = spec[0]
    if as_json:
        output.emit_json({**output.task_document(record, status), "spec": view.document})
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
        ("updated", output.moment_words(record.updated)),
        ("message", record.message or "-"),
        ("output", output.preview(record.output)),
        *((fact.label, fact.words) for fact in view.facts),
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


#: The characters of a message a table shows unless ``--full-messages``.
MESSAGE_SHOWN = 60

_CURSOR = re.compile(r"(-?[0-9]{1,19})\.([0-9]{1,19})")

_UTC_FORMATS = ["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M"]


def _filter_options(
    statuses: Sequence[str],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The filters ``tasks finished`` and ``tasks live`` share with the console's lists."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        for option in reversed(
            [
                click.option("--pool", "pools", multiple=True, help="Only this pool (repeatable)."),
                click.option(
                    "--status",
                    "statuses",
                    multiple=True,
                    type=click.Choice(list(statuses), case_sensitive=False),
                    help="Only this status (repeatable).",
                ),
                click.option("--kind", "kinds", multiple=True, help="Only this kind (repeatable)."),
                click.option(
                    "--tenant", "tenants", multiple=True, help="Only this tenant (repeatable)."
                ),
                click.option("--key", "keys", multiple=True, help="Only this key (repeatable)."),
                click.option(
                    "--limit",
                    type=click.IntRange(1, 10_000),
                    default=50,
                    show_default=True,
                    help="Tasks per page.",
                ),
                click.option(
                    "--full-messages",
                    "full",
                    is_flag=True,
                    help=f"Print messages whole (a table shows their first {MESSAGE_SHOWN} "
                    "characters).",
                ),
                _json_option,
            ]
        ):
            command = option(command)
        return command

    return decorate


def _filters(
    pools: Sequence[str],
    statuses: Sequence[str],
    kinds: Sequence[str],
    tenants: Sequence[str],
    keys: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
) -> operations.TaskFilters:
    return operations.TaskFilters(
        pools=tuple(clean_text(p) for p in pools),
        statuses=tuple(s.lower() for s in statuses),
        kinds=tuple(clean_text(k) for k in kinds),
        tenants=tuple(clean_text(t) for t in tenants),
        keys=tuple(clean_text(k) for k in keys),
        since_ns=_unix_ns(since),
        until_ns=_unix_ns(until),
    )


def _unix_ns(moment: datetime | None) -> int | None:
    """A time the operator gave (UTC unless it says otherwise) as Unix ns."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    delta = moment - UNIX_EPOCH
    return (delta.days * 86400 + delta.seconds) * 10**9 + delta.microseconds * 1000


@tasks.command(
    "finished",
    help=f"""List finished tasks, newest first (by last update), a page at a time.

    A page examines at most {ls.SCAN:,} finished tasks; when its filters match fewer than a
    page there, it says so and prints the cursor that looks further. The count of matches
    stops at the newest {ls.SAMPLE:,} of the window and then says "at least".""",
)
@_filter_options(_FINISHED)
@click.option("--since", type=click.DateTime(_UTC_FORMATS), help="Updated at or after (UTC).")
@click.option("--until", type=click.DateTime(_UTC_FORMATS), help="Updated at or before (UTC).")
@click.option(
    "--cursor",
    metavar="UPDATED.ID",
    help="Start strictly older than this (the cursor the previous page printed).",
)
@click.pass_obj
def finished(
    options: Options,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    kinds: tuple[str, ...],
    tenants: tuple[str, ...],
    keys: tuple[str, ...],
    since: datetime | None,
    until: datetime | None,
    cursor: str | None,
    limit: int,
    full: bool,
    as_json: bool,
) -> None:
    """``--help`` says what it does (its count's bounds written once, in the statements)."""
    before = None
    if cursor is not None:
        match = _CURSOR.fullmatch(cursor)
        if match is None or not all(-(2**63) <= int(g) <= I64_MAX for g in match.groups()):
            raise click.BadParameter("not a cursor a page printed", param_hint="--cursor")
        before = (int(match[1]), int(match[2]))
    filters = _filters(pools, statuses, kinds, tenants, keys, since, until)
    page = _ListPage("finished", "newest first", "older", full, as_json)
    run(
        options.url,
        page.show(
            options, filters, lambda conn: operations.finished_page(conn, filters, before, limit)
        ),
    )


@tasks.command(
    "live",
    help=f"""List live tasks (queued, running, retrying), oldest first (in id order, the order
    they were issued), each with its age (since it arrived), a page at a time.

    A page examines at most {ls.SCAN:,} live tasks; when its filters match fewer than a page
    there, it says so and prints the cursor that looks further. The count of matches stops
    at the oldest {ls.LIVE_SAMPLE:,} live tasks and then says "at least".""",
)
@_filter_options(_LIVE)
@click.option(
    "--cursor",
    type=click.IntRange(-1, I64_MAX),
    help="Start after this id (the cursor the previous page printed).",
)
@click.pass_obj
def live(
    options: Options,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    kinds: tuple[str, ...],
    tenants: tuple[str, ...],
    keys: tuple[str, ...],
    cursor: int | None,
    limit: int,
    full: bool,
    as_json: bool,
) -> None:
    """``--help`` says what it does (its count's bounds written once, in the statements)."""
    filters = _filters(pools, statuses, kinds, tenants, keys)
    page = _ListPage("live", "oldest first", "newer", full, as_json)
    run(
        options.url,
        page.show(
            options, filters, lambda conn: operations.live_page(conn, filters, cursor, limit)
        ),
    )


class _ListPage(NamedTuple):
    """How ``tasks finished`` and ``tasks live`` print a page."""

    what: str
    order: str
    onwards: str
    full: bool
    as_json: bool

    async def show(
        self,
        options: Options,
        filters: operations.TaskFilters,
        read: Callable[[AsyncConnection], Awaitable[dict[str, Any]]],
    ) -> None:
        async with database.database(options) as conn:
            await database.require_head(conn, options.schema)
            page = await read(conn)
        if self.as_json:
            output.emit_json(page)
            return
        self._print(page, output.console())

    def _print(self, page: dict[str, Any], console: Console) -> None:
        tasks, live = page["tasks"], self.what == "live"
        if tasks:
            columns = ["id", "short", "key", "pool", "kind", "tenant", "status", "attempt"]
            columns += ["age"] if live else []
            output.print_table(
                console,
                f"{self.what} tasks ({len(tasks)})",
                (*columns, "updated", "message"),
                (
                    (
                        str(t["id"]),
                        t["short_id"] or "-",
                        t["key"] or "-",
                        t["pool"],
                        t["kind"] or "-",
                        t["tenant"] or "-",
                        t["status"],
                        str(t["attempt"]),
                        *([output.age_words(t["age_seconds"])] if live else []),
                        _utc_text(t["updated"]),
                        _message(t["message"], self.full),
                    )
                    for t in tasks
                ),
                right=("id", "attempt", "age"),
                wrap="message",
            )
        else:
            console.print(f"no {self.what} tasks match")
        counted = f"{page['matching']:,} matching"
        if page["matching_at_least"]:
            counted = f"at least {counted} (counted among {page['counted']})"
        console.print(f"{counted}, {self.order}")
        following = page["next"]
        if page["scan_stopped"]:
            found = "only these" if tasks else "none that match"
            console.print(
                f"looked at {page['scan']:,} {self.what} tasks from here and found {found}: "
                f"--cursor {following} looks further"
            )
        elif following is None:
            console.print("end of list")
        else:
            console.print(f"next page ({self.onwards}): --cursor {following}")


def _message(text: str | None, full: bool) -> str:
    """A message as a table shows it: its first :data:`MESSAGE_SHOWN` characters, the cut
    marked, unless ``full``."""
    if text is None:
        return "-"
    if full or len(text) <= MESSAGE_SHOWN:
        return text
    return text[: MESSAGE_SHOWN - 1] + "…"


def _utc_text(rfc: str) -> str:
    return datetime.fromisoformat(rfc.removesuffix("Z") + "+00:00").strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _updated(record: TaskRecord) -> str:
    return record.updated.strftime("%Y-%m-%d %H:%M:%S UTC")
