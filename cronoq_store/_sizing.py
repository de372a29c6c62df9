"""How many bytes a batch puts on the wire, estimated from above, cheaply, per mutation.

PostgreSQL refuses a protocol message over 1 GiB - 1 and any single value over 1 GiB, and
it refuses them by closing the connection: to a client that is indistinguishable from an
outage, so a batch that large would be retried forever. The group committer builds batches
under a byte bound with :func:`mutation_size` and :func:`output_size`, and
``PgStore.commit`` refuses, before sending anything, a batch over :data:`MAX_COMMIT_BYTES`
by :func:`batch_size`: the same estimate on both sides.

The estimate is an upper bound of what the commit's statements carry: bytes as they are,
text as UTF-8 after cleaning (at most 4 bytes per character, NUL becoming U+FFFD), JSON
strings escaped (at most 6 bytes per character), plus a fixed allowance per row for the
other columns and the array framing. It never encodes anything.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ._domain import CronSchedule, IntervalSchedule, TaskId, TaskSpec
from ._errors import BatchTooLargeError
from ._mutations import (
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    unhandled,
)

__all__ = ["MAX_COMMIT_BYTES", "batch_size", "check_batch_size", "mutation_size", "output_size"]

#: The largest batch ``PgStore.commit`` sends: half of PostgreSQL's 1 GiB - 1 limit on a
#: protocol message and on any one value, so that neither the estimate's slack nor the
#: server's own copies of a value can reach it.
MAX_COMMIT_BYTES = 512 * 2**20

# Fixed allowances, in bytes: the columns of a new task's row that are not measured below
# (ids, times, flags, each with a 4-byte length in its array), a status transition's row, an
# output's id and framing, and a recurring change's parameters and statement.
_TASK_ROW = 320
_TRANSITION_ROW = 96
_OUTPUT_ROW = 32
_RECURRING_ROW = 256
# Per element of a JSON array or object: punctuation, field names, numbers.
_JSON_ITEM = 64


def _text(value: str | None) -> int:
    """UTF-8 bytes of ``value`` as stored: ASCII exactly (a NUL becomes 3 bytes), else at
    most 4 per character."""
    if value is None:
        return 0
    if value.isascii():
        return len(value) + 2 * value.count("\x00")
    return 4 * len(value)


def _json_strings(values: Collection[str]) -> int:
    """An upper bound for ``values`` as JSON strings (escapes included)."""
    return 6 * sum(map(len, values)) + _JSON_ITEM * len(values)


def _json_columns(spec: TaskSpec) -> int:
    """The spec's JSON columns: dependencies, resources, tags, labels, retry policy."""
    size = 0
    if spec.deps:
        size += _JSON_ITEM * len(spec.deps)
        for dep in spec.deps:
            if isinstance(dep.target, str):
                size += 6 * len(dep.target)
    if spec.resources:
        size += _json_strings(spec.resources.keys())
    if spec.tags:
        size += _json_strings(spec.tags)
    if spec.labels:
        size += _json_strings(spec.labels)
    if spec.retry is not None:
        size += 2 * _JSON_ITEM
    return size


def mutation_size(mutation: Mutation) -> int:
    """Upper bound of the bytes ``mutation`` adds to a commit."""
    match mutation:
        case Submitted(spec=spec):
            # Short text columns at 4 bytes per character: measuring them costs more than
            # the slack does.
            text = len(spec.kind) + len(spec.pool)
            if spec.key is not None:
                text += len(spec.key)
            if spec.tenant is not None:
                text += len(spec.tenant)
            return _TASK_ROW + len(spec.payload) + 4 * text + _json_columns(spec)
        case StatusChanged(message=message):
            return _TRANSITION_ROW + _text(message)
        case RecurringUpsert(spec=recurring):
            template = recurring.template
            # The template is stored as JSON (its payload in a column of its own), so its
            # text fields count as JSON strings, and so do a cron schedule's.
            strings = [template.kind, template.pool, template.key or "", template.tenant or ""]
            match recurring.schedule:
                case CronSchedule(expr=expr, timezone=zone):
                    strings += (expr, zone)
                case IntervalSchedule():
                    pass
                case schedule:
                    unhandled(schedule, "schedule")
            return (
                _RECURRING_ROW
                + _text(recurring.name)
                + len(template.payload)
                + _json_strings(strings)
                + _json_columns(template)
            )
        case RecurringRemove(name=name) | RecurringNext(name=name):
            return _RECURRING_ROW + _text(name)
        case _:
            unhandled(mutation)


def output_size(output: tuple[TaskId, bytes]) -> int:
    """Upper bound of the bytes one ``(id, output)`` pair adds to a commit."""
    return _OUTPUT_ROW + len(output[1])


def batch_size(batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]]) -> int:
    """Upper bound of the bytes a commit of ``batch`` and ``outputs`` sends."""
    return sum(map(mutation_size, batch)) + sum(map(output_size, outputs))


def check_batch_size(
    batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]], limit: int
) -> int:
    """:func:`batch_size` of ``batch`` and ``outputs``; ``BatchTooLargeError``, before
    anything is sent, when that is over ``limit`` bytes: the check of both stores."""
    size = batch_size(batch, outputs)
    if size > limit:
        raise BatchTooLargeError(
            f"committing a batch failed: its {len(batch)} mutations and {len(outputs)} "
            f"outputs take up to {size} bytes, over the {limit} bytes one commit may send "
            "(PostgreSQL refuses a message over 1 GiB); commit them in smaller batches"
        )
    return size
