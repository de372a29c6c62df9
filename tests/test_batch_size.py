"""The size estimate that bounds batches is an upper bound of what a commit really sends.

The commit's values are measured after folding (what the statements bind: text as UTF-8,
JSON as its text, 8 bytes a number, 4 bytes of length each); the estimate must never be
below, whatever the text holds (NUL, lone surrogates, astral characters, JSON escapes).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import pytest

from cronoq_store._commit_path import batch_size, fold
from cronoq_store._domain import (
    CronSchedule,
    Dependency,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    TaskId,
    TaskSpec,
    task_id,
)

from .support import FAILED, PROCESS_BASE, RUNNING, changed, submitted

NASTY = ['"\\\x00\x01', "\ud800x", "\U0001f600" * 3, "é" * 5, "plain"]


def _wire(values: Iterable[Any]) -> int:
    total = 0
    for v in values:
        total += 4
        if isinstance(v, str):
            total += len(v.encode("utf-8", "surrogatepass"))  # as U+FFFD: 3 bytes
        elif isinstance(v, bytes):
            total += len(v)
        elif v is not None:
            total += 8
    return total


def wire_size(batch: list[Mutation], outputs: list[tuple[TaskId, bytes]]) -> int:
    folded = fold(batch, PROCESS_BASE, time.time_ns(), outputs)
    size = sum(_wire(row) for row in folded.insert_rows)
    size += sum(_wire(column) for column in folded.updates.values())
    size += sum(_wire(column) for column in folded.outputs.values())
    size += sum(_wire(params.values()) for _, params in folded.recurring)
    return size


def spec(text: str, n: int) -> TaskSpec:
    return TaskSpec(
        (text * 50).encode("utf-8", "surrogatepass"),
        kind=text,
        pool=text,
        key=f"{text}{n}",
        tenant=text,
        deps=[Dependency(text), Dependency(task_id(1, 1))],
        resources={f"{text}{i}": i for i in range(3)},
        tags=[text, text * 2],
        labels=[text],
        retry=RetryPolicy(max_backoff=timedelta(seconds=5)),
    )


@pytest.mark.parametrize("text", NASTY)
def test_the_estimate_is_never_below_what_a_commit_sends(text: str) -> None:
    batch: list[Mutation] = [
        submitted(task_id(1, 2), spec(text, 2), seq=1, arrival=PROCESS_BASE.engine_ns),
        changed(task_id(1, 2), RUNNING, PROCESS_BASE.engine_ns, message=text * 40),
        changed(task_id(1, 9), FAILED, PROCESS_BASE.engine_ns, attempt=2, message=text),
        RecurringUpsert(RecurringSpec(text, CronSchedule("* * * * *"), spec(text, 3))),
        RecurringNext(text * 10, PROCESS_BASE.engine_ns, task_id(1, 2)),
        RecurringRemove(text * 3),
    ]
    outputs = [(task_id(1, 9), (text * 20).encode("utf-8", "surrogatepass"))]
    assert batch_size(batch, outputs) >= wire_size(batch, outputs)
    assert batch_size(batch, outputs) < 40 * wire_size(batch, outputs)  # and not absurd


def test_payloads_and_outputs_count_byte_for_byte() -> None:
    small = submitted(task_id(1, 1), b"", seq=1, arrival=PROCESS_BASE.engine_ns)
    big = submitted(task_id(1, 1), bytes(10**6), seq=1, arrival=PROCESS_BASE.engine_ns)
    assert batch_size([big], []) - batch_size([small], []) == 10**6
    assert batch_size([], [(task_id(1, 1), bytes(10**6))]) - batch_size([], []) >= 10**6


class AppKey(str):
    """An application's own key type: a ``str``, which ``Dependency`` takes as a key."""


@pytest.mark.parametrize("kind", ["submitted", "recurring"])
def test_a_dependency_on_a_key_of_a_str_subclass_is_counted_as_sent(kind: str) -> None:
    """The key is sent as JSON whatever its class (6 bytes per control character): the
    estimate counts it as it counts a plain ``str`` key, never below what is sent."""
    key = "\x01" * 1000

    def batch(target: str) -> list[Mutation]:
        spec = TaskSpec(b"", deps=[Dependency(target)])
        if kind == "recurring":
            return [RecurringUpsert(RecurringSpec("r", CronSchedule("* * * * *"), spec))]
        return [submitted(task_id(1, 1), spec, seq=1, arrival=PROCESS_BASE.engine_ns)]

    assert batch_size(batch(AppKey(key)), []) >= wire_size(batch(AppKey(key)), [])
    assert batch_size(batch(AppKey(key)), []) == batch_size(batch(key), [])
