"""Rows by column name: every column of a task row maps to its own domain value, the column
lists follow the schema, and a column the mapping does not know is refused at import."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from cronoq_store import _schema as schema
from cronoq_store import _statements as statements
from cronoq_store._codec import encode_retry, unix_converter
from cronoq_store._domain import (
    QUEUED,
    FixedStart,
    Priority,
    TaskSpec,
    TaskStatus,
)
from cronoq_store._schema import (
    INSERT_COLUMNS,
    INSERT_POSITION,
    LIVE_COLUMNS,
    RECORD_COLUMNS,
    RECURRING_COLUMNS,
    LiveTasks,
    _check_columns,
    insert_row,
    recurring,
    task_record,
    tasks,
)

from .support import FIXED_NOW, FULL_SPEC, SHIFTED_BASE, submitted

UNIX = SHIFTED_BASE.unix_ns - SHIFTED_BASE.engine_ns

SUBMITTED = submitted(7, FULL_SPEC, seq=8, arrival=9)


def test_the_example_spec_sets_every_field() -> None:
    """So that the tests below cover a field added to TaskSpec, once it is set here."""
    default = TaskSpec(b"")
    unset = [
        f.name for f in fields(TaskSpec) if getattr(FULL_SPEC, f.name) == getattr(default, f.name)
    ]
    assert unset == []


def test_insert_row_puts_every_value_under_its_own_column() -> None:
    values = insert_row(SUBMITTED, unix_converter(SHIFTED_BASE), FIXED_NOW)
    row = dict(zip(INSERT_COLUMNS, values, strict=True))
    assert row == {
        "id": 7,
        "seq": 8,
        "arrival_unix_ns": UNIX + 9,
        "pool": "pool",
        "kind": "kind",
        "priority": int(Priority.HIGH),
        "key": "key",
        "payload": b"payload",
        "deadline_unix_ns": UNIX + 11,
        "fixed_at_unix_ns": UNIX + 12,
        "fixed_tolerance_ns": 2 * 10**9,
        "fixed_on_miss": "run",
        "duration_hint_ns": 3 * 10**9,
        "timeout_ns": 4 * 10**9,
        "retry": encode_retry(FULL_SPEC.retry),
        "deps": '[{"id":5,"on":"succeeded"}]',
        "resources": '{"gpu":1}',
        "tags": '["t"]',
        "status": QUEUED,
        "terminal": False,
        "attempt": 0,
        "updated_unix_ns": FIXED_NOW,
        "message": None,
        "labels": '["l"]',
        "tenant": "tenant",
    }


def test_a_live_row_decodes_to_the_submission_it_was_encoded_from() -> None:
    row = insert_row(SUBMITTED, unix_converter(SHIFTED_BASE), FIXED_NOW)
    row[INSERT_POSITION["status"]], row[INSERT_POSITION["attempt"]] = "running", 3
    task = LiveTasks(SHIFTED_BASE).decode(*(row[INSERT_POSITION[name]] for name in LIVE_COLUMNS))
    assert (task.id, task.seq, task.arrival, task.spec, task.attempt) == (7, 8, 9, FULL_SPEC, 3)


def test_a_stored_tolerance_of_null_reads_as_the_domain_default() -> None:
    row = insert_row(SUBMITTED, unix_converter(SHIFTED_BASE), FIXED_NOW)
    row[INSERT_POSITION["fixed_tolerance_ns"]] = None
    task = LiveTasks(SHIFTED_BASE).decode(*(row[INSERT_POSITION[name]] for name in LIVE_COLUMNS))
    assert task.spec.fixed_start is not None
    assert task.spec.fixed_start.tolerance == FixedStart(0).tolerance


def test_a_record_takes_each_value_from_its_own_column() -> None:
    values: dict[str, Any] = {
        "id": 7,
        "key": "key",
        "pool": "pool",
        "kind": "kind",
        "priority": int(Priority.LOW),
        "tenant": "tenant",
        "status": "failed",
        "attempt": 2,
        "message": "boom",
        "output": b"out",
        "updated_unix_ns": 1_500_000_000,
    }
    record = task_record(*(values[name] for name in RECORD_COLUMNS))
    assert (record.id, record.key, record.pool, record.kind, record.tenant) == (
        7,
        "key",
        "pool",
        "kind",
        "tenant",
    )
    assert (record.priority, record.status, record.attempt) == (
        Priority.LOW,
        TaskStatus.FAILED,
        2,
    )
    assert (record.message, record.output) == ("boom", b"out")
    assert record.updated.timestamp() == 1.5


def test_the_statements_select_and_insert_the_mapped_columns_by_name() -> None:
    assert [c.name for c in statements.live_tasks.selected_columns] == list(LIVE_COLUMNS)
    assert [c.name for c in statements.task_by_id.selected_columns] == list(RECORD_COLUMNS)
    assert [c.name for c in statements.recurring_schedules.selected_columns] == list(
        RECURRING_COLUMNS
    )
    assert set(INSERT_COLUMNS) == {c.name for c in tasks.c} - {"output"}
    assert set(RECURRING_COLUMNS) == {c.name for c in recurring.c}


def test_a_column_the_mapping_does_not_know_is_refused_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"not mapped: \['priority_hint'\]"):
        _check_columns("insert_row", ("id", "seq"), ("id", "seq", "priority_hint"))
    with pytest.raises(RuntimeError, match=r"not in the schema: \['sequence'\]"):
        _check_columns("live_task", ("id", "sequence"), ("id", "seq"))
    # A decoder's arguments are matched by name, in any order.
    _check_columns("live_task", ("seq", "id"), ("id", "seq"))


def test_a_live_decoder_shares_at_most_its_limit_of_values_and_decodes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(schema, "SHARED_VALUES", 2)  # the strings cache: "kind", then "p0"
    decode = LiveTasks(SHIFTED_BASE).decode
    row = insert_row(SUBMITTED, unix_converter(SHIFTED_BASE), FIXED_NOW)

    def pool_of_a_task_in(n: int) -> str:
        row[INSERT_POSITION["pool"]] = f"p{n}"  # a new string object every time
        return decode(*(row[INSERT_POSITION[name]] for name in LIVE_COLUMNS)).spec.pool

    pools = [pool_of_a_task_in(n % 3) for n in range(6)]
    assert pools == ["p0", "p1", "p2"] * 2
    assert pools[0] is pools[3]
    assert pools[1] is not pools[4]
    assert pools[2] is not pools[5]
