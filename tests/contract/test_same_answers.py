"""Both stores, side by side: any history, batched and delivered again any way, leaves
both showing the same thing through the API, failures included.

The contract tests pin chosen cases; this one draws histories (submissions with keys sent
again, transitions in any order, late and repeated batches, outputs, key conflicts, ids
reused for different tasks, batches large enough to travel by COPY) and compares what
``PgStore`` and ``InMemoryStore`` answer, errors with the ids or keys they name. Each example
uses ids and keys of its own, so neither store is reset between examples.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import (
    IdCollisionError,
    KeyTakenError,
    Mutation,
    PgStore,
    PgStoreConfig,
    StatusChanged,
    StoreError,
    Submitted,
    TaskId,
)
from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store.testing import InMemoryStore

from ..support import MESSAGES, START_BASE, STATUSES, submitted
from .support import ContractStore

TASKS_PER_EXAMPLE = 5
_examples = itertools.count(1)


@st.composite
def plans(draw: st.DrawFn) -> list[tuple[list[Mutation], list[tuple[TaskId, bytes]]]]:
    """Batches (with outputs) of one history over ids ``first .. first + 4``, each batch
    possibly delivered again later."""
    first = next(_examples) * 100
    ids = [first + i for i in range(TASKS_PER_EXAMPLE)]
    keys = [None, None, f"a{first}", f"b{first}", f"c{first}"]
    fresh = itertools.count(first + 20)  # ids outside ``ids``, each sent once
    sent: dict[int, Mutation] = {}
    mutations: list[Mutation] = []
    at = 0
    for _ in range(draw(st.integers(1, 16))):
        at = max(0, at + draw(st.integers(-300, 1000)))
        id = draw(st.sampled_from(ids))
        choice = draw(st.integers(0, 7))
        if id in sent and choice == 0:  # the id of a task sent before, for another task
            if draw(st.booleans()):  # behind a new task that may take a held key
                extra = next(fresh)
                sent[extra] = submitted(extra, key=draw(st.sampled_from(keys)))
                mutations.append(sent[extra])
            mutations.append(submitted(id, b"other", key=draw(st.sampled_from(keys))))
        elif id not in sent or choice == 1:
            sent.setdefault(id, submitted(id, key=draw(st.sampled_from(keys))))
            mutations.append(sent[id])  # submitted, or sent again
        else:
            status, attempt, message = draw(STATUSES), draw(st.integers(0, 3)), draw(MESSAGES)
            mutations.append(StatusChanged(TaskId(id), status, attempt, at, message))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(mutations) - 1)), max_size=5)))
    bounds = [0, *cuts, len(mutations)]
    batches = [mutations[a:b] for a, b in itertools.pairwise(bounds) if a < b]
    if draw(st.integers(0, 3)) == 0:  # enough new tasks for the COPY path, anywhere in it
        i = draw(st.integers(0, len(batches) - 1))
        fill = [submitted(first + 50 + n) for n in range(COPY_MIN_ROWS)]
        cut = draw(st.integers(0, len(batches[i])))
        batches[i] = batches[i][:cut] + fill + batches[i][cut:]
    outputs = st.lists(st.tuples(st.sampled_from(ids), st.binary(max_size=3)), max_size=2)
    plan = [(b, [(TaskId(i), o) for i, o in draw(outputs)]) for b in batches]
    for _ in range(draw(st.integers(0, 3))):
        plan.insert(draw(st.integers(1, len(plan))), plan[draw(st.integers(0, len(plan) - 1))])
    return plan


async def answers(
    store: ContractStore, plan: list[tuple[list[Mutation], list[tuple[TaskId, bytes]]]]
) -> list[Any]:
    """What the store answers while and after ``plan`` is committed."""
    seen: list[Any] = []
    ids: set[int] = set()
    for batch, outputs in plan:
        ids.update(m.id for m in batch if isinstance(m, (Submitted, StatusChanged)))
        try:
            await store.commit(0, START_BASE, batch, outputs)
            seen.append(("answered", "ok", None))
        except IdCollisionError as exc:
            seen.append(("answered", "IdCollisionError", exc.ids))
        except KeyTakenError as exc:
            seen.append(("answered", "KeyTakenError", exc.keys))
        except StoreError as exc:
            seen.append(("answered", type(exc).__name__, None))
    for id in sorted(ids):
        record = await store.get_task(TaskId(id))
        seen.append(
            None
            if record is None
            else (
                record.key,
                record.status,
                record.attempt,
                record.message,
                record.output,
                # A queued task's time is its commit's, which differs between the stores.
                None if record.status is None else record.updated,
            )
        )
    recovered = await store.recover(START_BASE)
    seen.append(sorted((t.id, t.attempt) for t in recovered.tasks if t.id in ids))
    seen.append(sorted(t.id for t in recovered.terminal if t.id in ids))
    return seen


@pytest.fixture
async def pg_store(engine: AsyncEngine, migrated: str) -> AsyncIterator[PgStore]:
    """One store for every example (hypothesis runs them all in one test call)."""
    async with await PgStore.from_engine(engine, PgStoreConfig(schema=migrated)) as store:
        yield store


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_any_history_gets_the_same_answers_from_both_stores(
    pg_store: PgStore, data: st.DataObject
) -> None:
    plan = data.draw(plans())
    expected = await answers(InMemoryStore(), plan)
    for outcome in expected:
        if isinstance(outcome, tuple) and outcome[0] == "answered":
            event(f"a commit answered {outcome[1]}")  # --hypothesis-show-statistics
    assert await answers(pg_store, plan) == expected
