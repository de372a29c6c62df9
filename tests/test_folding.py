"""Batch folding: the pure rules, and batching invariance against a real schema.

The property test is the contract of ``commit``: however a mutation sequence is split into
batches, and whichever batches are delivered again later, the stored rows are the same, and
equal to a plain fold written out below.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import _statements as statements
from cronoq_store._commit_path import (
    COPY_MIN_ROWS,
    BatchWriter,
    FoldedBatch,
    RecurringAction,
    fold,
)
from cronoq_store._domain import (
    QUEUED,
    TERMINAL_LEVEL,
    CronSchedule,
    Dependency,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    level,
)
from cronoq_store._errors import IdCollisionError
from cronoq_store._schema import INSERT_COLUMNS
from cronoq_store._store import PgStore

from .support import (
    FAILED,
    FIXED_BASE,
    FIXED_NOW,
    FULL_SPEC,
    MESSAGES,
    RUNNING,
    STATUSES,
    SUCCEEDED,
    changed,
    submitted,
)

# --- the pure rules ----------------------------------------------------------------------


def test_new_task_is_inserted_once_with_its_latest_status_and_last_message() -> None:
    f = fold(
        [
            submitted(1, pool="first"),
            changed(1, RUNNING, 5, message="started"),
            submitted(1, pool="first"),  # the same submission again: a no-op
            changed(1, SUCCEEDED, 7),  # no message: the earlier one stays
        ],
        FIXED_BASE,
        FIXED_NOW,
    )
    assert f.insert_count == 1
    # Kept aside for the case that the task turns out to be stored already.
    assert f.update_count == 0
    assert f.inserted_updates["ids"] == [1]
    assert f.inserted_updates["messages"] == ["started"]
    row = {name: values[0] for name, values in f.inserts.items()}
    assert row["pool"] == "first"
    assert (row["status"], row["terminal"], row["attempt"]) == ("succeeded", True, 1)
    assert row["updated_unix_ns"] == FIXED_BASE.to_unix(7)
    assert row["message"] == "started"


def test_new_task_without_a_transition_is_queued_at_commit_time() -> None:
    row = {k: v[0] for k, v in fold([submitted(3)], FIXED_BASE, FIXED_NOW).inserts.items()}
    assert (row["status"], row["terminal"], row["attempt"], row["message"]) == (
        QUEUED,
        False,
        0,
        None,
    )
    assert row["updated_unix_ns"] == FIXED_NOW


def test_stored_task_gets_one_update_where_later_wins_and_messages_carry_forward() -> None:
    f = fold(
        [
            changed(1, RUNNING, 5, message="a"),
            changed(2, RUNNING, 6),
            changed(1, FAILED, 8),  # keeps "a"
            changed(2, SUCCEEDED, 9, message=""),  # an empty message is a message
        ],
        FIXED_BASE,
        FIXED_NOW,
    )
    assert f.insert_count == 0
    assert f.updates == {
        "ids": [1, 2],
        "statuses": ["failed", "succeeded"],
        "terminals": [True, True],
        "attempts": [1, 1],
        "updated": [FIXED_BASE.to_unix(8), FIXED_BASE.to_unix(9)],
        "levels": [TERMINAL_LEVEL, TERMINAL_LEVEL],
        "messages": ["a", ""],
        # Where each message came from: the statement keeps the stored message unless that
        # transition is ahead of the stored state.
        "message_levels": [level("running", False, 1), TERMINAL_LEVEL],
        "message_ats": [FIXED_BASE.to_unix(5), FIXED_BASE.to_unix(9)],
    }
    assert f.inserted_updates["ids"] == []


def test_later_message_replaces_an_earlier_one() -> None:
    f = fold(
        [changed(1, RUNNING, 5, message="a"), changed(1, RUNNING, 6, message="b")],
        FIXED_BASE,
        FIXED_NOW,
    )
    assert f.updates["messages"] == ["b"]


def test_only_transitions_that_move_forward_count_and_ties_keep_the_first() -> None:
    def folded(*mutations: StatusChanged) -> tuple[Any, ...]:
        u = fold(mutations, FIXED_BASE, FIXED_NOW).updates
        return u["statuses"][0], u["attempts"][0], u["updated"][0], u["messages"][0]

    retrying = TaskStatus.RETRYING
    # Attempt first, then the rank: running(2) is ahead of retrying(1), which is ahead of
    # running(1); a later one that is behind changes nothing, its message included.
    assert folded(changed(1, RUNNING, 5, attempt=2), changed(1, retrying, 9, message="late")) == (
        "running",
        2,
        FIXED_BASE.to_unix(5),
        None,
    )
    assert folded(changed(1, retrying, 5), changed(1, RUNNING, 9, message="x")) == (
        "retrying",
        1,
        FIXED_BASE.to_unix(5),
        None,
    )
    # Terminal is final: no later transition, whatever its attempt or time.
    assert folded(
        changed(1, SUCCEEDED, 5),
        changed(1, FAILED, 9, attempt=3, message="x"),
        changed(1, RUNNING, 10, attempt=4),
    ) == (
        "succeeded",
        1,
        FIXED_BASE.to_unix(5),
        None,
    )
    # Same state: the later time wins; the same time too keeps the first.
    assert folded(changed(1, RUNNING, 5, message="a"), changed(1, RUNNING, 6)) == (
        "running",
        1,
        FIXED_BASE.to_unix(6),
        "a",
    )
    assert folded(changed(1, RUNNING, 5, message="a"), changed(1, RUNNING, 5, message="b")) == (
        "running",
        1,
        FIXED_BASE.to_unix(5),
        "a",
    )


def test_a_different_task_under_an_id_in_the_same_batch_is_refused() -> None:
    with pytest.raises(IdCollisionError, match="task id 1 already taken") as caught:
        fold([submitted(1), submitted(1, pool="other")], FIXED_BASE, FIXED_NOW)
    assert caught.value.ids == [1]
    assert not caught.value.is_transient


def test_the_same_submission_again_in_a_batch_is_a_no_op_as_jsonb_compares() -> None:
    # The same resources in another key order: one task for jsonb, so one task here too.
    batch = [submitted(1, resources={"a": 1, "b": 2}), submitted(1, resources={"b": 2, "a": 1})]
    assert fold(batch, FIXED_BASE, FIXED_NOW).insert_count == 1


def test_last_output_per_task_wins() -> None:
    f = fold([], FIXED_BASE, FIXED_NOW, [(TaskId(1), b"x"), (TaskId(2), b"y"), (TaskId(1), b"z")])
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
            submitted(1, spec, arrival=0),
            changed(1, RUNNING, 1, message="m\0"),
            changed(2, RUNNING, 1, message="n\0"),
            RecurringRemove("r\0"),
        ],
        FIXED_BASE,
        FIXED_NOW,
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
        FIXED_BASE,
        FIXED_NOW,
    )
    assert [a for a, _ in f.recurring] == [
        RecurringAction.UPSERT,
        RecurringAction.NEXT,
        RecurringAction.REMOVE,
    ]
    assert f.recurring[1][1] == {"schedule": "r", "next": FIXED_BASE.to_unix(50), "last": 4}


def test_parameter_names_match_the_statements() -> None:
    """The folded dictionaries are bound by name: a renamed bind would silently be NULL."""

    def binds(stmt: Any) -> set[str]:
        """The parameters the caller gives (not those bound with their value)."""
        dialect = create_async_engine("postgresql+asyncpg://").dialect
        return {
            name for name, value in stmt.compile(dialect=dialect).params.items() if value is None
        }

    spec = RecurringSpec("r", CronSchedule("* * * * *"), TaskSpec(b"t"))
    f = fold(
        [
            submitted(1),
            changed(2, RUNNING, 1),
            RecurringUpsert(spec),
            RecurringNext("r", 1, None),
            RecurringRemove("r"),
        ],
        FIXED_BASE,
        FIXED_NOW,
        [(TaskId(1), b"o")],
    )
    assert set(f.inserts) == set(INSERT_COLUMNS) == binds(statements.insert_tasks)
    assert {*f.updates, "epoch", "incarnation"} == binds(statements.update_status_fenced)
    assert set(f.outputs) == binds(statements.store_outputs)
    assert set(f.recurring[0][1]) == binds(statements.upsert_recurring)
    assert set(f.recurring[1][1]) == binds(statements.advance_recurring)
    assert set(f.recurring[2][1]) == binds(statements.remove_recurring)


def test_writes_name_every_kind_of_write_a_batch_holds_in_the_transaction_order() -> None:
    spec = RecurringSpec("r", CronSchedule("* * * * *"), TaskSpec(b"t"))
    # The contract's order inside one transaction, after the epoch check.
    assert FoldedBatch.WRITES == ("updates", "insert_rows", "outputs", "recurring")
    assert fold([], FIXED_BASE, FIXED_NOW).writes() == ()
    assert fold([submitted(1)], FIXED_BASE, FIXED_NOW).writes() == ("insert_rows",)
    assert fold([changed(2, RUNNING, 1)], FIXED_BASE, FIXED_NOW).writes() == ("updates",)
    # A transition of a task the batch submits rides in its insert row.
    born_and_moved = fold([submitted(1), changed(1, RUNNING, 1)], FIXED_BASE, FIXED_NOW)
    assert born_and_moved.writes() == ("insert_rows",)
    assert fold([], FIXED_BASE, FIXED_NOW, [(TaskId(1), b"o")]).writes() == ("outputs",)
    assert fold([RecurringRemove("r")], FIXED_BASE, FIXED_NOW).writes() == ("recurring",)
    everything = fold(
        [RecurringUpsert(spec), changed(2, RUNNING, 1), submitted(1)],
        FIXED_BASE,
        FIXED_NOW,
        [(TaskId(1), b"o")],
    )
    assert everything.writes() == FoldedBatch.WRITES

    # Sent again, the submitted task's transition moves into the update (before the insert).
    again = born_and_moved.resubmitted()
    assert again.writes() == ("updates", "insert_rows")
    assert (again.updates["ids"], again.inserted_updates["ids"]) == ([1], [])
    assert again.insert_rows == born_and_moved.insert_rows


def test_a_write_the_batch_writer_cannot_write_is_refused_when_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new kind of write folded into a batch but not written would be lost silently."""
    dialect = create_async_engine("postgresql+asyncpg://").dialect
    monkeypatch.setattr(FoldedBatch, "WRITES", (*FoldedBatch.WRITES, "retirements"))
    with pytest.raises(RuntimeError, match="retirements"):
        BatchWriter(dialect, "public")


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


RANKS = {QUEUED: 0, "running": 1, "retrying": 2}


def ahead(row: Expected, m: StatusChanged) -> bool:
    """Whether ``m`` moves ``row`` forward: never from a terminal state, always to one, else
    by attempt, then rank, then time (a task still queued has no time to compare)."""
    if row.terminal:
        return False
    if m.status.is_terminal:
        return True
    new = (m.attempt, RANKS[m.status.value], FIXED_BASE.to_unix(m.at))
    return new > (row.attempt, RANKS[row.status], -1 if row.updated is None else row.updated)


def reference_fold(mutations: Sequence[Mutation]) -> dict[int, Expected]:
    """The meaning of a mutation sequence, one mutation at a time: a submission sent again
    changes nothing, a transition applies only if it moves the task forward, a message
    carries forward until an applied transition brings its own."""
    rows: dict[int, Expected] = {}
    for m in mutations:
        if isinstance(m, Submitted):
            rows.setdefault(m.id, Expected(key=m.spec.key))
        elif isinstance(m, StatusChanged):
            row = rows[m.id]
            if not ahead(row, m):
                continue
            row.status, row.terminal = m.status.value, m.status.is_terminal
            row.attempt, row.updated = m.attempt, FIXED_BASE.to_unix(m.at)
            if m.message is not None:
                row.message = m.message.replace("\0", "\ufffd")
    return rows


@st.composite
def histories(draw: st.DrawFn) -> list[Mutation]:
    """Anything a scheduler, its retries and a confused clock can emit once every task was
    submitted: submissions sent again, transitions in any order of attempt and status
    (backwards ones too, and after the task finished), times that tie or go back, a key
    handed over (its holder finishes, a new task takes it, and a retried batch sends the old
    holder again). Live keys are unique (the store refuses a second live holder, whatever
    the batching)."""
    mutations: list[Mutation] = []
    sent: dict[int, Submitted] = {}
    state: dict[int, Expected] = {}  # the reference's view, to keep live keys unique
    next_id, at = 1, 0
    for _ in range(draw(st.integers(1, 16))):
        at = max(0, at + draw(st.integers(-300, 1000)))
        choice = draw(st.integers(0, 6))
        holders = sorted(i for i, r in state.items() if r.key is not None and not r.terminal)
        if holders and next_id <= 4 and choice == 6:
            id = draw(st.sampled_from(holders))
            done = draw(st.sampled_from([t for t in TaskStatus if t.is_terminal]))
            mutations.append(changed(id, done, at, attempt=draw(st.integers(0, 3))))
            state[id].terminal = True
            sent[next_id] = submitted(next_id, key=state[id].key)
            state[next_id] = Expected(key=state[id].key)
            mutations += [sent[next_id], sent[id]]
            next_id += 1
        elif sent and choice <= 3:
            id = draw(st.sampled_from(sorted(sent)))
            m = changed(
                id, draw(STATUSES), at, attempt=draw(st.integers(0, 3)), message=draw(MESSAGES)
            )
            mutations.append(m)
            if ahead(state[id], m):
                state[id].terminal = state[id].terminal or m.status.is_terminal
                state[id].attempt, state[id].status = m.attempt, m.status.value
                state[id].updated = FIXED_BASE.to_unix(at)
        elif sent and choice == 4:
            mutations.append(sent[draw(st.sampled_from(sorted(sent)))])  # sent again
        elif next_id <= 4:
            held = {r.key for r in state.values() if not r.terminal}
            key = draw(st.sampled_from([k for k in (None, "a", "b") if k is None or k not in held]))
            sent[next_id] = submitted(next_id, key=key)
            state[next_id] = Expected(key=key)
            mutations.append(sent[next_id])
            next_id += 1
    return mutations


@st.composite
def splits(draw: st.DrawFn, mutations: list[Mutation]) -> list[list[Mutation]]:
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(mutations) - 1)), max_size=5)))
    bounds = [0, *cuts, len(mutations)]
    return [mutations[a:b] for a, b in itertools.pairwise(bounds) if a < b]


@st.composite
def deliveries(draw: st.DrawFn, batches: list[list[Mutation]]) -> list[list[Mutation]]:
    """``batches`` in order, with batches delivered again (a retry, arriving late) any
    number of times at any point after their first delivery."""
    again: dict[int, list[int]] = {}
    last = len(batches) - 1
    for _ in range(draw(st.integers(0, 4))):
        first = draw(st.integers(0, last))
        again.setdefault(draw(st.integers(first, last)), []).append(first)
    plan: list[list[Mutation]] = []
    for i, batch in enumerate(batches):
        plan.append(batch)
        plan.extend(batches[j] for j in again.get(i, []))
    return plan


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
        await store.commit(0, FIXED_BASE, batch, [])
    return await stored_rows(store)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.parametrize("copy_min_rows", [COPY_MIN_ROWS, 1], ids=["arrays", "copy"])
async def test_any_split_with_late_duplicates_stores_the_history_committed_once(
    store: PgStore, data: st.DataObject, copy_min_rows: int
) -> None:
    # With a threshold of 1, every insert travels by COPY first.
    store._commits.writer = BatchWriter(
        store.engine.dialect, store.config.schema, copy_min_rows=copy_min_rows
    )
    mutations = data.draw(histories())
    expected = reference_fold(mutations)
    assert await replay(store, [mutations]) == expected
    assert await replay(store, [[m] for m in mutations]) == expected
    plan = data.draw(deliveries(data.draw(splits(mutations))))
    assert await replay(store, plan) == expected


async def test_every_spec_field_is_written_by_the_insert(store: PgStore) -> None:
    """The insert binds 25 arrays by name; a column left out would be silently NULL."""
    await store.commit(0, FIXED_BASE, [submitted(1, FULL_SPEC, arrival=0)], [])
    async with store.engine.connect() as conn:
        row = (
            await conn.execute(
                text(f'SELECT * FROM "{store.config.schema}".cronoq_tasks WHERE id = 1')
            )
        ).one()
    nulls = {k for k, v in row._mapping.items() if v is None}
    assert nulls == {"message", "output"}
