"""How the commands print: the console, label-and-value lines, and values in words (times,
durations, task ids, schedules, outputs). Nothing a row holds can make these fail."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from rich.console import Console
from rich.table import Table

from ..domain import I64_MAX, ID_COUNTER_BITS, UNIX_EPOCH, TaskId, epoch_of

__all__ = [
    "ago",
    "console",
    "describe_schedule",
    "format_duration",
    "preview",
    "print_facts",
    "task_id",
    "utc",
]


def console(*, markup: bool = False) -> Console:
    """Made per command: it reads the terminal (and ``COLUMNS``) as it is at that moment.

    Without markup and emoji codes: keys, messages and pool names are data, and ``[/b]`` or
    ``:fire:`` in them must print as written.
    """
    return Console(highlight=False, markup=markup, emoji=False)


def print_facts(out: Console, *facts: tuple[str, str]) -> None:
    """Label and value lines, aligned; long values wrap under their value column."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", min_width=11)
    grid.add_column()
    for label, value in facts:
        grid.add_row(label, value)
    out.print(grid)


def utc(unix_ns: int) -> str:
    moment = UNIX_EPOCH + timedelta(microseconds=unix_ns // 1000)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(moment: datetime) -> str:
    seconds = max(0, int((datetime.now(timezone.utc) - moment).total_seconds()))
    return f"{format_duration(seconds)} ago" if seconds else "just now"


def format_duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def task_id(value: int) -> str:
    """An id with what it encodes: the epoch that issued it and its number in that epoch."""
    if not 0 <= value <= I64_MAX:
        return str(value)
    counter = value & ((1 << ID_COUNTER_BITS) - 1)
    return f"{value} (epoch {epoch_of(TaskId(value))}, #{counter})"


def describe_schedule(stored: str | None) -> str:
    """The stored schedule (its JSON text) as words; undecodable ones are shown, not skipped
    (status is for finding exactly those), and nothing a row holds can make this fail."""
    try:
        return _schedule_words(None if stored is None else json.loads(stored))
    except (ValueError, RecursionError, OverflowError):
        return f"undecodable: {stored}"[:80]


def _schedule_words(schedule: object) -> str:
    if isinstance(schedule, dict):
        if schedule.get("type") == "cron":
            return f"cron {schedule.get('expr')} ({schedule.get('timezone', 'UTC')})"[:80]
        every = schedule.get("every_ns")
        # What recovery decodes: a positive BIGINT of nanoseconds.
        if schedule.get("type") == "interval" and isinstance(every, int) and 0 < every <= I64_MAX:
            if every % 10**9 == 0:
                return f"every {format_duration(every // 10**9)}"
            return f"every {every / 1e9:g}s"
    return f"undecodable: {schedule!r}"[:80]


def preview(data: bytes | None) -> str:
    if data is None:
        return "-"
    shown = data[:48]
    return f"{len(data)} bytes: {shown!r}{'...' if len(data) > len(shown) else ''}"
