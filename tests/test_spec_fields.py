"""A ``TaskSpec`` field is declared once (``_domain.SPEC_FIELDS``) and everything else is
derived from it: each test walks the declaration, so a field added there is covered here
with no change to this file (unless it brings a new kind, which needs an example below)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import timedelta
from typing import Any

import pytest

from cronoq_store import _schema as schema
from cronoq_store._cli import operations
from cronoq_store._codec import TEMPLATE_MEMBERS, decode_recurring, encode_recurring, unix_converter
from cronoq_store._commit_path import mutation_size
from cronoq_store._console.app import _environment
from cronoq_store._domain import (
    QUEUED,
    SPEC_FIELDS,
    Dependency,
    DependencyCondition,
    FixedStart,
    IntervalSchedule,
    MissPolicy,
    Priority,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    SpecField,
    SpecKind,
    TaskId,
    TaskSpec,
)
from cronoq_store._listing_statements import task_spec
from cronoq_store._schema import INSERT_COLUMNS, LIVE_COLUMNS, LiveTasks, insert_row, tasks

from .support import FIXED_NOW, ROOT, SHIFTED_BASE, submitted

DEFAULT = TaskSpec(b"")

#: A value of each kind that no field has as its default.
EXAMPLES: dict[SpecKind, Any] = {
    SpecKind.BYTES: b"bytes",
    SpecKind.TEXT: "text",
    SpecKind.OPTIONAL_TEXT: "optional text",
    SpecKind.PRIORITY: Priority.HIGH,
    SpecKind.ENGINE_TIME: 123_000_000,
    SpecKind.DURATION: timedelta(seconds=3),
    SpecKind.FIXED_START: FixedStart(12_000, timedelta(seconds=2), MissPolicy.RUN),
    SpecKind.RETRY: RetryPolicy(max_attempts=5),
    SpecKind.DEPS: (Dependency(TaskId(5)), Dependency("other", DependencyCondition.FINISHED)),
    SpecKind.RESOURCES: {"gpu": 2},
    SpecKind.STRINGS: ("a", "b"),
}

_LONG = "é\0" * 300  # 1,500 bytes stored: beyond the allowance, within an index entry
#: A value of each kind that takes many bytes, where a kind's size can grow.
LARGE: dict[SpecKind, Any] = {
    SpecKind.BYTES: b"x" * 20_000,
    SpecKind.TEXT: _LONG,
    SpecKind.OPTIONAL_TEXT: _LONG,
    SpecKind.DEPS: tuple(Dependency(f"{_LONG}{i}") for i in range(3)),
    SpecKind.RESOURCES: {f"{_LONG}{i}": i for i in range(3)},
    SpecKind.STRINGS: tuple(f"{_LONG}{i}" for i in range(3)),
}

_FIELDS = pytest.mark.parametrize("f", SPEC_FIELDS, ids=[f.name for f in SPEC_FIELDS])


def _only(f: SpecField) -> TaskSpec:
    """A spec that differs from the default in ``f`` alone."""
    spec = dataclasses.replace(DEFAULT, **{f.name: EXAMPLES[f.kind]})
    assert getattr(spec, f.name) != getattr(DEFAULT, f.name)
    return spec


def _row(spec: TaskSpec) -> dict[str, Any]:
    row = insert_row(submitted(7, spec, seq=8, arrival=9), unix_converter(SHIFTED_BASE), FIXED_NOW)
    return dict(zip(INSERT_COLUMNS, row, strict=True))


def test_the_declaration_names_every_taskspec_field_in_order() -> None:
    assert [f.name for f in SPEC_FIELDS] == [f.name for f in dataclasses.fields(TaskSpec)]


def test_every_kind_has_an_example() -> None:
    assert set(EXAMPLES) == set(SpecKind)


def test_every_column_of_a_task_is_a_spec_fields_or_the_tasks_own() -> None:
    spec_columns = [c for f in SPEC_FIELDS for c in f.columns]
    assert len(spec_columns) == len(set(spec_columns)), "a column declared by two fields"
    own = {"id", "seq", "arrival_unix_ns", "status", "terminal", "attempt"}
    own |= {"updated_unix_ns", "message", "output"}
    assert set(spec_columns) | own == {c.name for c in tasks.c}
    assert set(spec_columns).isdisjoint(own)


@_FIELDS
def test_a_field_goes_into_its_own_columns_and_comes_back_from_them(f: SpecField) -> None:
    spec = _only(f)
    row, default = _row(spec), _row(DEFAULT)
    changed = {name for name in INSERT_COLUMNS if row[name] != default[name]}
    assert changed, f"{f.name} changes no column"
    assert changed <= set(f.columns)
    row["status"], row["attempt"] = "running", 3
    task = LiveTasks(SHIFTED_BASE).decode(*(row[name] for name in LIVE_COLUMNS))
    assert task.spec == spec


@_FIELDS
def test_a_field_goes_into_the_recurring_template_and_comes_back(f: SpecField) -> None:
    spec = RecurringSpec("r", IntervalSchedule(timedelta(minutes=1)), _only(f))
    text = encode_recurring(SHIFTED_BASE, spec)
    assert decode_recurring(SHIFTED_BASE, "r", text, spec.template.payload) == spec
    template = json.loads(text)["template"]
    assert list(template) == list(TEMPLATE_MEMBERS.values())
    if f.member is None:  # a column of its own (the payload)
        assert f.name not in TEMPLATE_MEMBERS
    else:
        default = json.loads(
            encode_recurring(SHIFTED_BASE, dataclasses.replace(spec, template=DEFAULT))
        )
        assert template[f.member] != default["template"][f.member]


class _Connection:
    """Answers ``task_spec`` with one row, as the database would."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    async def execute(self, statement: Any, params: Any) -> Any:
        assert statement is task_spec
        selected = {c.name for c in task_spec.selected_columns}
        answer = {name: value for name, value in self.row.items() if name in selected}
        assert set(answer) == selected, "the statement reads a column the row does not hold"
        mapping = type("Row", (), {"_mapping": answer})
        return type("Result", (), {"one": lambda _: mapping})()


def _page(spec: TaskSpec) -> tuple[operations.TaskSpecView, Any]:
    """The view and the dependencies ``read_spec`` gives for a task of ``spec``."""
    row = _row(spec)
    row["payload_size"] = len(row["payload"])
    connection: Any = _Connection(row)
    return asyncio.run(operations.read_spec(connection, 7))


@_FIELDS
def test_a_field_is_read_and_shown_on_a_tasks_page_or_in_its_record(f: SpecField) -> None:
    (shown, deps), (default, default_deps) = _page(_only(f)), _page(DEFAULT)
    facts = {fact.label: fact for fact in shown.facts}
    if f.label is None:  # shown with the record: the page's spec leaves it alone
        assert (shown.document, deps) == (default.document, default_deps)
        assert set(facts) == {fact.label for fact in default.facts}
        return
    assert (shown.document, deps) != (default.document, default_deps), (
        f"{f.name} does not change the document"
    )
    assert facts[f.label].words != {d.label: d for d in default.facts}[f.label].words
    assert {c.name for c in task_spec.selected_columns} >= {
        f"{c}_size" if f.kind is SpecKind.BYTES else c for c in f.columns
    }


@_FIELDS
def test_the_console_draws_every_fact_but_the_deps_table(f: SpecField) -> None:
    view = _page(_only(f))[0]
    doc: dict[str, Any] = {
        "id": 7,
        "short_id": None,
        "key": None,
        "pool": "default",
        "kind": "",
        "tenant": None,
    }
    doc |= {"priority": "normal", "status": QUEUED, "attempt": 0, "updated": None}
    doc |= {"message": None, "output_size": None, "spec": view.document, "schema": "s"}
    doc |= {"deps": [], "deps_total": 0, "deps_raw": None}
    request = type("Request", (), {"url": type("URL", (), {"query": ""})})
    page = _environment(5).get_template("task.html")
    html = page.render(doc=doc, request=request, facts=view.facts)
    for fact in view.facts:
        if fact.style != "deps":
            assert f"<dt>{fact.label}</dt>" in html
            assert f'id="task-{fact.slug}"' in html


def test_a_kind_stored_in_other_columns_than_declared_is_refused_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fixed = SpecField("fixed_start", SpecKind.FIXED_START, ("fixed_at_unix_ns",), None, None)
    monkeypatch.setattr(schema, "SPEC_FIELDS", (fixed,))
    with pytest.raises(RuntimeError, match=r"stored in 3 columns, SPEC_FIELDS declares"):
        schema._spec_columns()


def _stored_bytes(value: object) -> int:
    if isinstance(value, str):
        return len(value.encode())
    return len(value) if isinstance(value, bytes) else 8


@_FIELDS
def test_a_commits_size_estimate_counts_the_field(f: SpecField) -> None:
    """The estimate bounds what a commit sends (``_commit_path``): a field of a kind whose size
    can grow must be measured there, or a batch could exceed what PostgreSQL takes."""
    spec = dataclasses.replace(DEFAULT, **{f.name: LARGE.get(f.kind, EXAMPLES[f.kind])})
    row = _row(spec)
    assert mutation_size(submitted(7, spec, seq=8, arrival=9)) >= sum(
        map(_stored_bytes, row.values())
    )
    recurring = RecurringSpec("r", IntervalSchedule(timedelta(minutes=1)), spec)
    stored = len(encode_recurring(SHIFTED_BASE, recurring).encode()) + len(spec.payload)
    assert mutation_size(RecurringUpsert(recurring)) >= stored


@pytest.mark.parametrize("table", sorted(schema.metadata.tables))
def test_the_storage_format_documents_every_column(table: str) -> None:
    """docs/storage-format.md is what another program reading the tables relies on: a
    column added without its row there fails here, naming it."""
    text = (ROOT / "docs" / "storage-format.md").read_text()
    assert f"`{table}`" in text
    undocumented = [
        c.name for c in schema.metadata.tables[table].columns if f"`{c.name}`" not in text
    ]
    assert undocumented == []
