"""Batch folding: the pure rules, and batching invariance against a real schema.

The property test is the contract of ``commit``: however a mutation sequence is split into
batches, the stored rows are the same, and equal to a plain fold written out below.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import statements
from cronoq_store.config import PgStoreConfig
from cronoq_store.domain import (
    QUEUED,
    CronSchedule,
    Dependency,
    FixedStart,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store.folding import INSERT_COLUMNS, RecurringAction, fold
from cronoq_store.store import PgStore

BASE = TimeBase(engine_ns=0, unix_ns=1_700_000_000_000_000_000)
NOW = 1_800_000_000_000_000_000
RUNNING, SUCCEEDED, FAILED = TaskStatus.RUNNING, TaskStatus.SUCCEEDED, TaskStatus.FAILED


def submitted(id: int, key: str | None = None, **spec: Any) -> Submitted:
    return Submitted(TaskId(id), seq=id, arrival=10 * id, spec=TaskSpec(b"p", key=key, **spec))


def changed(id: int, status: TaskStatus, at: int, message: str | None = None) -> StatusChanged:
    return StatusChanged(TaskId(id), status, attempt=1, at=at, message=message)


# --- the pure rules ----------------------------------------------------------------------


def test_new_task_is_inserted_once_with_its_latest_status_and_last_message() -> None:
    f = fold(
        [
            submitted(1, pool="first"),
            changed(1, RUNNING, 5, "started"),
            submitted(1, pool="second"),  # a duplicate: the first one wins
            changed(1, SUCCEEDED, 7),  # no message: the earlier one stays
        ],
        BASE,
        NOW,
    )
    assert f.insert_count == 1
    assert f.update_count == 0
    assert f.max_id == 1
    row = {name: values[0] for name, values in f.inserts.items()}
    assert row["pool"] == "first"
    assert (row["status"], row["terminal"], row["attempt"]) == ("succeeded", True, 1)
    assert row["updated_unix_ns"] == BASE.to_unix(7)
    assert row["message"] == "started"


def test_new_task_without_a_transition_is_queued_at_commit_time() -> None:
    row = {k: v[0] for k, v in fold([submitted(3)], BASE, NOW).inserts.items()}
    assert (row["status"], row["terminal"], row["attempt"], row["message"]) == (
        QUEUED,
        False,
        0,
        None,
    )
    assert row["updated_unix_ns"] == NOW


def test_stored_task_gets_one_update_where_later_wins_and_messages_carry_forward() -> None:
    f = fold(
        [
            changed(1, RUNNING, 5, "a"),
            changed(2, RUNNING, 6),
            changed(1, FAILED, 8),  # keeps "a"
            changed(2, SUCCEEDED, 9, ""),  # an empty message is a message
        ],
        BASE,
        NOW,
    )
    assert f.insert_count == 0
    assert f.max_id is None
    assert f.updates == {
        "ids": [1, 2],
        "statuses": ["failed", "succeeded"],
        "terminals": [True, True],
        "attempts": [1, 1],
        "updated": [BASE.to_unix(8), BASE.to_unix(9)],
        "messages": ["a", ""],
    }


def test_later_message_replaces_an_earlier_one() -> None:
    f = fold([changed(1, RUNNING, 5, "a"), changed(1, RUNNING, 6, "b")], BASE, NOW)
    assert f.updates["messages"] == ["b"]


def test_last_output_per_task_wins() -> None:
    f = fold([], BASE, NOW, [(TaskId(1), b"x"), (TaskId(2), b"y"), (TaskId(1), b"z")])
    assert f.outputs == {"ids": [1, 2], "outputs": [b"z", b"y"]}


def test_nul_becomes_replacement_character_in_every_string() -> None:
    spec = TaskSpec(
        b"\0payload",
        kind="k\0",
        pool="p\0",
        key="key\0",
        tenant="t\0",
        tags=["t\0ag"],
        labels=["l\0"],
        deps=[Dependency("d\0ep")],
        resources={"r\0": 1},
    )
    f = fold(
        [
            Submitted(TaskId(1), 1, 0, spec),
            changed(1, RUNNING, 1, "m\0"),
            changed(2, RUNNING, 1, "n\0"),
            RecurringRemove("r\0"),
        ],
        BASE,
        NOW,
    )
    row = {k: v[0] for k, v in f.inserts.items()}
    assert row["payload"] == b"\0payload"  # bytes are stored as they are
    texts = [v for k, v in row.items() if isinstance(v, str)]
    assert len(texts) == 10  # pool, kind, key, tenant, status, message and the JSON columns
    assert not any("\0" in v for v in texts)
    assert row["message"] == "m\ufffd"
    assert f.updates["messages"] == ["n\ufffd"]
    assert '"d\ufffdep"' in row["deps"]
    assert '"r\ufffd"' in row["resources"]
    assert f.recurring == [(RecurringAction.REMOVE, {"schedule": "r\ufffd"})]


def test_recurring_changes_keep_batch_order() -> None:
    spec = RecurringSpec("r", CronSchedule("* * * * *"), TaskSpec(b"t"))
    f = fold(
        [RecurringUpsert(spec), RecurringNext("r", 50, TaskId(4)), RecurringRemove("r")],
        BASE,
        NOW,
    )
    assert [a for a, _ in f.recurring] == [
        RecurringAction.UPSERT,
        RecurringAction.NEXT,
        RecurringAction.REMOVE,
    ]
    assert f.recurring[1][1] == {"schedule": "r", "next": BASE.to_unix(50), "last": 4}


def test_parameter_names_match_the_statements() -> None:
    """The folded dictionaries are bound by name: a renamed bind would silently be NULL."""

    def binds(stmt: Any) -> set[str]:
        return set(
            stmt.compile(dialect=create_async_engine("postgresql+asyncpg://").dialect).params
        )

    spec = RecurringSpec("r", CronSchedule("* * * * *"), TaskSpec(b"t"))
    f = fold(
        [
            submitted(1),
            changed(2, RUNNING, 1),
            RecurringUpsert(spec),
            RecurringNext("r", 1, None),
            RecurringRemove("r"),
        ],
        BASE,
        NOW,
        [(TaskId(1), b"o")],
    )
    assert set(f.inserts) == set(INSERT_COLUMNS) == binds(statements.insert_tasks)
    assert set(f.updates) == binds(statements.update_status)
    assert set(f.outputs) == binds(statements.store_outputs)
    assert set(f.recurring[0][1]) == binds(statements.upsert_recurring)
    assert set(f.recurring[1][1]) == binds(statements.advance_recurring)
    assert set(f.recurring[2][1]) == binds(statements.remove_recurring)


# --- batching invariance on a real schema ------------------------------------------------


@dataclass
class Expected:
    """One task as the reference fold sees it."""

    key: str | None
    status: str = QUEUED
    terminal: bool = False
    attempt: int = 0
    updated: int | None = None  # commit time for a task that never changed status
    message: str | None = None


def reference_fold(mutations: Sequence[Mutation]) -> dict[int, Expected]:
    """The obvious meaning of a mutation sequence, one mutation at a time."""
    rows: dict[int, Expected] = {}
    for m in mutations:
        if isinstance(m, Submitted):
            rows.setdefault(m.id, Expected(key=m.spec.key))
        elif isinstance(m, StatusChanged):
            row = rows[m.id]
            row.status, row.terminal = m.status.value, m.status.is_terminal
            row.attempt, row.updated = m.attempt, BASE.to_unix(m.at)
            if m.message is not None:
                row.message = m.message.replace("\0", "\ufffd")
    return rows


MESSAGES = st.sampled_from([None, None, "", "boom", "nul\0here"])
# Live transitions are weighted up so that tasks live through several batches.
STATUSES = st.sampled_from([TaskStatus.RUNNING, TaskStatus.RETRYING] * 3 + list(TaskStatus))


@st.composite
def histories(draw: st.DrawFn) -> list[Mutation]:
    """What a scheduler emits: tasks are submitted once, live keys are unique, finished
    tasks never change again, times only move forward."""
    mutations: list[Mutation] = []
    live: dict[int, str | None] = {}
    next_id, at = 1, 0
    for _ in range(draw(st.integers(1, 14))):
        at += draw(st.integers(1, 1000))
        held = set(live.values())
        transition = draw(st.booleans())
        if live and transition:
            id = draw(st.sampled_from(sorted(live)))
            status = draw(STATUSES)
            attempt = draw(st.integers(0, 3))
            mutations.append(StatusChanged(TaskId(id), status, attempt, at, draw(MESSAGES)))
            if status.is_terminal:
                del live[id]
        elif next_id <= 6:
            key = draw(st.sampled_from([k for k in (None, "a", "b") if k is None or k not in held]))
            mutations.append(submitted(next_id, key=key))
            live[next_id] = key
            next_id += 1
    return mutations


@st.composite
def splits(draw: st.DrawFn, mutations: list[Mutation]) -> list[list[Mutation]]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(mutations) - 1)), max_size=5)))
    bounds = [0, *cuts, len(mutations)]
    return [mutations[a:b] for a, b in itertools.pairwise(bounds) if a < b]


@pytest.fixture
async def store(engine: AsyncEngine, migrated: str) -> AsyncIterator[PgStore]:
    async with await PgStore.from_engine(engine, PgStoreConfig(schema=migrated)) as s:
        yield s


async def stored_rows(store: PgStore) -> dict[int, Expected]:
    async with store.engine.connect() as conn:
        rows = await conn.execute(
            text(
                f"SELECT id, key, status, terminal, attempt, updated_unix_ns, message, seq "
                f'FROM "{store.config.schema}".cronoq_tasks ORDER BY id'
            )
        )
        result = {}
        for r in rows:
            assert r.seq == r.id  # spec columns come from the Submitted, whatever the split
            # A task that never changed status carries its commit time, which differs by run.
            updated = None if r.status == QUEUED else r.updated_unix_ns
            result[r.id] = Expected(r.key, r.status, r.terminal, r.attempt, updated, r.message)
    return result


async def replay(store: PgStore, batches: list[list[Mutation]]) -> dict[int, Expected]:
    async with store.engine.begin() as conn:
        await conn.execute(text(f'TRUNCATE "{store.config.schema}".cronoq_tasks'))
    for batch in batches:
        await store.commit(0, BASE, batch, [])
    return await stored_rows(store)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_any_split_into_batches_stores_the_reference_fold(
    store: PgStore, data: st.DataObject
) -> None:
    mutations = data.draw(histories())
    expected = reference_fold(mutations)
    assert await replay(store, [mutations]) == expected
    assert await replay(store, [[m] for m in mutations]) == expected
    assert await replay(store, data.draw(splits(mutations))) == expected


async def test_every_spec_field_is_written_by_the_insert(store: PgStore) -> None:
    """The insert binds 25 arrays by name; a column left out would be silently NULL."""
    spec = TaskSpec(
        b"payload",
        kind="kind",
        pool="pool",
        key="key",
        deadline=11,
        fixed_start=FixedStart(12, timedelta(seconds=2)),
        duration_hint=timedelta(seconds=3),
        timeout=timedelta(seconds=4),
        retry=RetryPolicy(),
        deps=[Dependency(TaskId(5))],
        resources={"gpu": 1},
        tags=["t"],
        labels=["l"],
        tenant="tenant",
    )
    await store.commit(0, BASE, [Submitted(TaskId(1), 1, 0, spec)], [])
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                text(f'SELECT * FROM "{store.config.schema}".cronoq_tasks WHERE id = 1')
            )
        ).one()
    nulls = {k for k, v in row._mapping.items() if v is None}
    assert nulls == {"message", "output"}
