"""How the commands print: the console, label-and-value lines, tables, JSON documents, and
values in words (times, durations, task ids, schedules, outputs). Nothing a row holds can make
these fail.

On a terminal, tables are drawn to its width, and a table that cannot show every cell whole
at that width is printed as one block of lines per row instead, so an id is never cut.
Piped, output is plain: label-and-value lines never wrapped, tables as tab-separated lines
under a header, nothing cut at any width. ``--json`` prints one document (:func:`emit_json`):
ids as integers, times as RFC 3339 UTC.

Everything goes through :mod:`cronoq_store._terminal_safe`, on a terminal and piped alike: the
console
escapes every string it renders (cells, values, titles, messages), piped table lines are
written through the same function, and JSON documents through its encoder.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import click
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .._domain import EPOCH_MAX, I64_MAX, ID_COUNTER_BITS, UNIX_EPOCH, TaskId, epoch_of
from .._results import LockHolder, TaskRecord
from .._terminal_safe import json_text, visible

__all__ = [
    "ID_FORMS",
    "IdRef",
    "age_words",
    "console",
    "describe_foreign",
    "describe_schedule",
    "describe_session",
    "duration_words",
    "emit_json",
    "emit_json_line",
    "format_duration",
    "holder_document",
    "leader_of",
    "moment_words",
    "parse_id",
    "preview",
    "print_facts",
    "print_table",
    "relative_words",
    "retry_words",
    "rfc3339",
    "seconds_words",
    "session_document",
    "short_id",
    "store_log_on_stderr",
    "task_document",
    "task_id",
    "utc",
]

#: The width of a pipe: wide enough that nothing is ever wrapped or cut.
_PIPE_WIDTH = 1 << 16
#: The narrowest a wrapping column may become before rows are printed as blocks instead.
_MIN_WRAPPED = 20


class _SafeConsole(Console):
    """A console that writes every string it renders through
    :func:`~cronoq_store._terminal_safe.visible`.

    Text with markup (the demo's) is the caller's to make safe: markup's own escape is a
    backslash, so its values go through ``visible`` and then ``rich.markup.escape``.
    """

    def render_str(self, text: str, **kwargs: Any) -> Text:
        markup = kwargs.get("markup")
        if not (self._markup if markup is None else markup):
            text = visible(text)
        return super().render_str(text, **kwargs)


def console(*, markup: bool = False) -> Console:
    """Made per command: it reads the terminal (and ``COLUMNS``) as it is at that moment.

    Without markup and emoji codes: keys, messages and pool names are data, and ``[/b]`` or
    ``:fire:`` in them must print as written.
    """
    probe = Console()
    if probe.is_terminal:
        return _SafeConsole(highlight=False, markup=markup, emoji=False)
    return _SafeConsole(
        highlight=False, markup=markup, emoji=False, width=_PIPE_WIDTH, soft_wrap=True
    )


@contextmanager
def store_log_on_stderr() -> Iterator[None]:
    """While it lasts, the store's log lines from INFO up are printed on stderr, one line
    each (through :func:`~cronoq_store._terminal_safe.visible`): a migration waiting for a
    lock says whom it waits for, as it waits."""
    store = logging.getLogger("cronoq_store")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_VisibleFormatter("%(message)s"))
    level = store.level
    store.addHandler(handler)
    store.setLevel(logging.INFO)
    try:
        yield
    finally:
        store.setLevel(level)
        store.removeHandler(handler)


class _VisibleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def print_facts(out: Console, *facts: tuple[str, str]) -> None:
    """Label and value lines, aligned; on a terminal long values wrap under their value
    column. Piped: one line per fact, whole, with no padding after the value (a script's
    ``cut`` or ``grep`` would otherwise meet trailing spaces)."""
    if not out.is_terminal:
        width = max([11, *(len(label) for label, _ in facts)])
        for label, value in facts:
            out.print(f"{label:<{width}}  {value}", soft_wrap=True, highlight=False, markup=False)
        return
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", min_width=11)
    grid.add_column()
    for label, value in facts:
        grid.add_row(label, value)
    out.print(grid)


def print_table(
    out: Console,
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Sequence[str] = (),
    wrap: str | None = None,
) -> None:
    """Rows under ``columns``; only the ``wrap`` column may wrap, nothing is ever cut.

    Piped: a header line and one tab-separated line per row (cells through
    :func:`~cronoq_store._terminal_safe.visible`: a tab or line break in a cell is an
    escape). On a terminal: a table, or, when the terminal is too narrow for every
    unwrapped cell whole, one block of label-and-value lines per row.
    """
    cells = [list(row) for row in rows]
    if not out.is_terminal:
        for line in (columns, *cells):
            # Written as is: rich would expand the tabs into spaces.
            out.file.write("\t".join(visible(cell) for cell in line) + "\n")
        return
    widths = [
        _MIN_WRAPPED
        if name == wrap
        else max(cell_len(name), *(cell_len(visible(row[i])) for row in cells))
        for i, name in enumerate(columns)
    ]
    # Each cell has one space of padding either side and one border to its left.
    if sum(widths) + 3 * len(columns) + 1 > out.width:
        out.print(title)
        for row in cells:
            out.print()
            print_facts(out, *zip(columns, row, strict=True))
        return
    table = Table(title=title, title_justify="left")
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left", no_wrap=name != wrap)
    for row in cells:
        table.add_row(*row)
    out.print(table)


def emit_json(document: Mapping[str, object]) -> None:
    """The command's one JSON document, alone on stdout
    (:func:`~cronoq_store._terminal_safe.json_text`)."""
    click.echo(json_text(document))


def emit_json_line(document: Mapping[str, object]) -> None:
    """One JSON object on one line of stdout: a line of a command over many clusters."""
    click.echo(json_text(document, indent=None))


def rfc3339(moment: datetime | int | None) -> str | None:
    """A time (aware ``datetime`` or Unix ns) as RFC 3339 in UTC, ``Z``-suffixed."""
    if moment is None:
        return None
    if isinstance(moment, int):
        moment = UNIX_EPOCH + timedelta(microseconds=moment // 1000)
    text = moment.astimezone(timezone.utc).isoformat(timespec="microseconds")
    return text.removesuffix("+00:00") + "Z"


def holder_document(holder: LockHolder | None) -> dict[str, object] | None:
    """The leader lock's holder, as ``status --json`` and ``health --json`` show it."""
    if holder is None:
        return None
    return {
        "pid": holder.pid,
        "instance": holder.instance,
        "application_name": holder.application_name,
        "client_addr": holder.client_addr,
        "since": rfc3339(holder.since),
        "role": holder.role,
        "store_instance": holder.store_instance,
    }


def session_document(holder: LockHolder | None) -> dict[str, object] | None:
    """A session holding a lock that no store instance owns as such (the migration lock):
    :func:`holder_document` without ``store_instance``."""
    document = holder_document(holder)
    if document is not None:
        del document["store_instance"]
    return document


def describe_session(holder: LockHolder) -> str:
    """A session holding a lock, in words: pid, role, application name and since when."""
    return (
        f"backend pid {holder.pid}, role {holder.role or '(unknown)'!r}, application_name "
        f"{holder.application_name or ''!r}, session {_since(holder)}"
    )


def _since(holder: LockHolder) -> str:
    if holder.since is None:
        return "since an unknown time"
    return f"since {moment_words(holder.since)}"


def leader_of(holder: LockHolder | None) -> LockHolder | None:
    """The holder when it is a store instance: a foreign holder is never shown as leader."""
    return holder if holder is not None and holder.store_instance else None


def describe_foreign(holder: LockHolder) -> str:
    """A lock holder that is not a store instance, in words: pid, role, application name
    and since when (``health``, ``status``)."""
    return (
        f"{describe_session(holder)}, holds the leader lock but is not a store instance (it "
        "never took the epoch): no instance can lead until it lets go (`cronoq-store "
        "handover` ends it)"
    )


def task_document(record: TaskRecord, status: str) -> dict[str, object]:
    """A task, as ``tasks show --json`` and ``tasks finished --json`` show it: ``status``
    as stored (a newer build's name as written), the output as base64."""
    out = record.output
    return {
        "id": record.id,
        "short_id": short_id(record.id),
        "epoch": epoch_of(record.id) if 0 <= record.id <= I64_MAX else None,
        "key": record.key,
        "pool": record.pool,
        "kind": record.kind,
        "priority": record.priority.name.lower(),
        "tenant": record.tenant,
        "status": status,
        "attempt": record.attempt,
        "updated": rfc3339(record.updated),
        "message": record.message,
        "output_size": None if out is None else len(out),
        "output_base64": None if out is None else base64.b64encode(out).decode("ascii"),
    }


def utc(unix_ns: int) -> str:
    moment = UNIX_EPOCH + timedelta(microseconds=unix_ns // 1000)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def age_words(seconds: float) -> str:
    """A live task's age, to two units: ``12s``, ``4m 10s``, ``3h 5m``, ``2d 3h``."""
    whole = max(0, int(seconds))
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for i, (unit, size) in enumerate(units[:-1]):
        if whole >= size:
            smaller, small_size = units[i + 1]
            return f"{whole // size}{unit} {whole % size // small_size}{smaller}"
    return f"{whole}s"


def format_duration(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


_WORD_UNITS = (("d", 86_400), ("h", 3_600), ("min", 60), ("s", 1))


def duration_words(ns: int | None) -> str:
    """A stored duration as an operator reads it: ``30 s``, ``2 min 5 s``, ``1 h 3 min``,
    ``250 ms``; the two largest units, a zero second one left out. ``-`` for none."""
    if ns is None:
        return "-"
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    if ns < 1_000:
        return f"{sign}{ns} ns"
    if ns < 1_000_000:
        return f"{sign}{ns / 1_000:.4g} µs"
    if ns < 1_000_000_000:
        return f"{sign}{ns / 1_000_000:.4g} ms"
    if ns < 60_000_000_000 and ns % 1_000_000_000:
        return f"{sign}{ns / 1_000_000_000:.4g} s"
    return sign + seconds_words(ns // 1_000_000_000)


def seconds_words(seconds: int) -> str:
    """Whole seconds in the largest two units: ``30 s``, ``2 min 5 s``, ``3 d 4 h``."""
    for i, (unit, size) in enumerate(_WORD_UNITS):
        if seconds >= size or size == 1:
            words = f"{seconds // size} {unit}"
            if size > 1:
                smaller, small_size = _WORD_UNITS[i + 1]
                rest = seconds % size // small_size
                if rest:
                    words += f" {rest} {smaller}"
            return words
    raise AssertionError("the last unit is one second")


def relative_words(seconds: float) -> str:
    """How long ago (or, negative, how far ahead) a moment is: ``3 min ago``, ``in 5 s``."""
    whole = int(seconds)
    if whole == 0:
        return "just now"
    largest = seconds_words(abs(whole)).split(" ")[:2]
    return f"{' '.join(largest)} ago" if whole > 0 else f"in {' '.join(largest)}"


def moment_words(moment: datetime | str | None) -> str:
    """A time to the second in UTC with how long ago it was:
    ``2026-12-02 11:47:48 UTC (3 min ago)``; ``-`` for none."""
    if moment is None:
        return "-"
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment.removesuffix("Z") + "+00:00")
    seconds = (datetime.now(timezone.utc) - moment).total_seconds()
    return f"{moment.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC ({relative_words(seconds)})"


def retry_words(retry: object) -> str:
    """A stored retry policy (its JSON, decoded) in words: how many attempts, the first
    wait, how it grows and its cap. A value of another shape is shown as JSON."""
    if retry is None:
        return "no retry: the first failure is final"
    fields = ("max_attempts", "backoff_ns", "max_backoff_ns", "multiplier")
    if not isinstance(retry, dict) or not set(fields) <= retry.keys():
        return json.dumps(retry, ensure_ascii=False)
    attempts, backoff, cap, multiplier = (retry[f] for f in fields)
    if not isinstance(attempts, int) or not isinstance(backoff, int):
        return json.dumps(retry, ensure_ascii=False)
    if attempts <= 1:
        return "a single attempt: the first failure is final"
    words = f"up to {attempts:,} attempts; waits {duration_words(backoff)} after the first failure"
    if isinstance(multiplier, (int, float)) and multiplier != 1:
        words += f", multiplied by {multiplier:g} after each failure after it"
        words += f", at most {duration_words(cap)}" if isinstance(cap, int) else ", without a cap"
    elif isinstance(multiplier, (int, float)):
        words += ", the same after each failure after it"
    return words


#: What ``tasks show`` and the console's look-up take for an id: the id itself, its short
#: form ``EPOCH/N`` (the epoch that issued it and its number in that epoch, as
#: :func:`short_id` prints it), or a bare ``N``, which may name a task of any epoch.
ID_FORMS = "an id, EPOCH/N (as printed beside an id: 1/42 is task #42 of epoch 1), or N"

_SHORT = re.compile(r"([0-9]{1,5})/([0-9]{1,15})")
_DIGITS = re.compile(r"[0-9]+")
_COUNTER_MASK = (1 << ID_COUNTER_BITS) - 1


class IdRef(NamedTuple):
    """An id as an operator typed it, and the ids it may name: one for a whole id or a short
    one, one per epoch for a bare number that fits an epoch's counter."""

    text: str
    ids: tuple[TaskId, ...]

    @property
    def bare(self) -> bool:
        """Whether the number may name tasks of several epochs."""
        return len(self.ids) > 1


def short_id(value: int) -> str | None:
    """An id's short form, ``EPOCH/N``; ``None`` for a number no id can be."""
    if not 0 <= value <= I64_MAX:
        return None
    return f"{epoch_of(TaskId(value))}/{value & _COUNTER_MASK}"


def task_id(value: int) -> str:
    """An id with its short form beside it: ``281474976710698 (1/42)``."""
    short = short_id(value)
    return str(value) if short is None else f"{value} ({short})"


def parse_id(text: str) -> IdRef | None:
    """``text`` as an id in one of :data:`ID_FORMS`; ``None`` when it is in none of them (a
    key, then); ``ValueError`` for one of those forms that no task can have."""
    short = _SHORT.fullmatch(text)
    if short is not None:
        epoch, n = int(short[1]), int(short[2])
        if epoch > EPOCH_MAX or n > _COUNTER_MASK:
            raise ValueError(
                f"{text} is not a task id (the epoch is at most {EPOCH_MAX}, the number "
                f"below 2**{ID_COUNTER_BITS})"
            )
        return IdRef(text, (TaskId((epoch << ID_COUNTER_BITS) | n),))
    if _DIGITS.fullmatch(text) is None:
        return None
    value = int(text)
    if value > I64_MAX:
        raise ValueError(f"{text} is not a task id (ids fit a signed 64-bit integer)")
    if value > _COUNTER_MASK:
        return IdRef(text, (TaskId(value),))
    # Epoch 0 too: the whole id is then the number itself.
    return IdRef(text, tuple(TaskId((e << ID_COUNTER_BITS) | value) for e in range(EPOCH_MAX + 1)))


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
