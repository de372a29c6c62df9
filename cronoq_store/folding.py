"""Batch folding: a commit batch turned into the column-wise parameters of a few statements.

Pure (no SQLAlchemy, no I/O), so the folding rules can be tested on their own:

- a task submitted in the batch is inserted once (the first ``Submitted`` wins), carrying its
  latest status, so a task that is born and finishes in one batch is written once;
- a task stored by an earlier batch gets one update, where later transitions win and a
  message carries forward until a later transition brings its own;
- recurring changes keep their batch order.

These rules make the stored result independent of how mutations were split into batches.
Every string, inside JSON values too, goes through ``clean_text`` (NUL and lone surrogates
become U+FFFD): PostgreSQL cannot store them, and one bad string would fail the whole batch.

The parameter names of the returned dictionaries are the bind names of the statements in
:mod:`cronoq_store.statements` (``INSERT_COLUMNS`` for the insert).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .codec import (
    clean_text,
    duration_to_ns,
    encode_deps,
    encode_miss_policy,
    encode_recurring,
    encode_resources,
    encode_retry,
    encode_strings,
    unix_converter,
)
from .domain import (
    QUEUED,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TimeBase,
)

__all__ = ["INSERT_COLUMNS", "JSON_COLUMNS", "FoldedBatch", "RecurringAction", "fold"]

#: The columns a new task is inserted with, in statement order; each names its parameter.
INSERT_COLUMNS: tuple[str, ...] = (
    "id", "seq", "arrival_unix_ns", "pool", "kind", "priority", "key", "payload",
    "deadline_unix_ns", "fixed_at_unix_ns", "fixed_tolerance_ns", "fixed_on_miss",
    "duration_hint_ns", "timeout_ns", "retry", "deps", "resources", "tags", "status",
    "terminal", "attempt", "updated_unix_ns", "message", "labels", "tenant",
)  # fmt: skip
#: Insert columns whose parameters are pre-serialized JSON text (cast to jsonb in SQL).
JSON_COLUMNS = frozenset({"retry", "deps", "resources", "tags", "labels"})

# Where a later transition of a task inserted in the same batch writes, in an insert row.
_STATUS, _TERMINAL, _ATTEMPT, _UPDATED, _MESSAGE = (
    INSERT_COLUMNS.index(name)
    for name in ("status", "terminal", "attempt", "updated_unix_ns", "message")
)


class RecurringAction(Enum):
    """Which recurring statement a change runs."""

    UPSERT = "upsert"
    REMOVE = "remove"
    NEXT = "next"


@dataclass(slots=True)
class _Transition:
    """The latest transition of a stored task within one batch."""

    status: str
    terminal: bool
    attempt: int
    at: int
    message: str | None


@dataclass(slots=True)
class FoldedBatch:
    """What one commit writes, in the order the transaction writes it."""

    #: Largest id inserted by the batch (the high-water mark to record), if any.
    max_id: int | None
    #: ``update_status`` parameters: one row per stored task.
    updates: dict[str, list[Any]]
    #: New tasks, one row each in ``INSERT_COLUMNS`` order (what COPY takes).
    insert_rows: list[list[Any]]
    #: ``store_outputs`` parameters: one row per task (the last output given wins).
    outputs: dict[str, list[Any]]
    #: Recurring changes in batch order.
    recurring: list[tuple[RecurringAction, dict[str, Any]]] = field(default_factory=list)

    @property
    def inserts(self) -> dict[str, list[Any]]:
        """``insert_tasks`` parameters: the rows transposed, one array per column."""
        if not self.insert_rows:
            return {name: [] for name in INSERT_COLUMNS}
        columns = zip(*self.insert_rows, strict=True)
        return {name: list(values) for name, values in zip(INSERT_COLUMNS, columns, strict=True)}

    @property
    def update_count(self) -> int:
        return len(self.updates["ids"])

    @property
    def insert_count(self) -> int:
        return len(self.insert_rows)

    @property
    def output_count(self) -> int:
        return len(self.outputs["ids"])


def fold(
    batch: Sequence[Mutation],
    base: TimeBase,
    now_unix_ns: int,
    outputs: Sequence[tuple[TaskId, bytes]] = (),
) -> FoldedBatch:
    """Fold ``batch`` and ``outputs``; new tasks without a transition get ``now_unix_ns`` as
    their update time. Engine times are converted to Unix ns through ``base``; one that
    leaves BIGINT raises ``ValueError`` naming the field (only its submission then fails)."""
    # The insert's rows: one list per row is much cheaper than 25 column appends. A later
    # transition of a task inserted here patches its row.
    rows: list[list[Any]] = []
    inserted: dict[int, int] = {}
    transitions: dict[int, _Transition] = {}  # insertion-ordered: first transition's order
    recurring: list[tuple[RecurringAction, dict[str, Any]]] = []
    to_unix = unix_converter(base)

    for m in batch:
        if isinstance(m, StatusChanged):
            status = m.status
            message = None if m.message is None else clean_text(m.message)
            at = to_unix(m.at, "at")
            i = inserted.get(m.id)
            if i is not None:
                row = rows[i]
                row[_STATUS] = status.value
                row[_TERMINAL] = status.is_terminal
                row[_ATTEMPT] = m.attempt
                row[_UPDATED] = at
                if message is not None:
                    row[_MESSAGE] = message
                continue
            earlier = transitions.get(m.id)
            if earlier is not None and message is None:
                message = earlier.message
            transitions[m.id] = _Transition(
                status.value, status.is_terminal, m.attempt, at, message
            )
        elif isinstance(m, Submitted):
            if m.id in inserted:
                continue
            inserted[m.id] = len(rows)
            s = m.spec
            fixed, key, tenant = s.fixed_start, s.key, s.tenant
            rows.append(
                [  # INSERT_COLUMNS order
                    m.id,
                    m.seq,
                    to_unix(m.arrival, "arrival"),
                    clean_text(s.pool),
                    clean_text(s.kind),
                    int(s.priority),
                    None if key is None else clean_text(key),
                    s.payload,
                    None if s.deadline is None else to_unix(s.deadline, "deadline"),
                    None if fixed is None else to_unix(fixed.at, "fixed_start.at"),
                    None if fixed is None else duration_to_ns(fixed.tolerance),
                    None if fixed is None else encode_miss_policy(fixed.on_miss),
                    None if s.duration_hint is None else duration_to_ns(s.duration_hint),
                    None if s.timeout is None else duration_to_ns(s.timeout),
                    encode_retry(s.retry),
                    encode_deps(s.deps),
                    encode_resources(s.resources),
                    encode_strings(s.tags),
                    QUEUED,
                    False,
                    0,
                    now_unix_ns,
                    None,
                    encode_strings(s.labels),
                    None if tenant is None else clean_text(tenant),
                ]
            )
        elif isinstance(m, RecurringUpsert):
            spec = m.spec
            recurring.append(
                (
                    RecurringAction.UPSERT,
                    {
                        "schedule": clean_text(spec.name),
                        "spec_json": encode_recurring(base, spec),
                        "payload": spec.template.payload,
                    },
                )
            )
        elif isinstance(m, RecurringRemove):
            recurring.append((RecurringAction.REMOVE, {"schedule": clean_text(m.name)}))
        elif isinstance(m, RecurringNext):
            recurring.append(
                (
                    RecurringAction.NEXT,
                    {
                        "schedule": clean_text(m.name),
                        "next": None if m.next is None else to_unix(m.next, "next"),
                        "last": m.last,
                    },
                )
            )
        else:
            raise TypeError(f"not a mutation: {type(m).__name__}")

    latest = transitions.values()
    last_output = dict(outputs)
    return FoldedBatch(
        max_id=max(inserted) if inserted else None,
        updates={
            "ids": list(transitions),
            "statuses": [t.status for t in latest],
            "terminals": [t.terminal for t in latest],
            "attempts": [t.attempt for t in latest],
            "updated": [t.at for t in latest],
            "messages": [t.message for t in latest],
        },
        insert_rows=rows,
        outputs={"ids": list(last_output), "outputs": list(last_output.values())},
        recurring=recurring,
    )
