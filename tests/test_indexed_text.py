"""Indexed text (task keys, dependency keys, schedule names): every value the domain accepts
commits and reads back, one byte more is refused when built, and stored rows stay readable."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._domain import (
    INDEXED_TEXT_MAX_BYTES,
    Dependency,
    DependencyCondition,
    IntervalSchedule,
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
    clean_text,
)
from cronoq_store._store import PgStore

from .support import START_BASE

EVERY = IntervalSchedule(every=timedelta(minutes=5))
RNG = random.Random(20)


def stored_size(value: str) -> int:
    return len(clean_text(value).encode("utf-8"))


def incompressible(alphabet: str, size: int) -> str:
    """Random characters from ``alphabet`` (each of one UTF-8 width), padded with ASCII
    letters to exactly ``size`` bytes as stored: nothing PostgreSQL could compress."""
    width = stored_size(alphabet[0])
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    body = "".join(RNG.choice(alphabet) for _ in range(size // width))
    return body + "".join(RNG.choice(letters) for _ in range(size - stored_size(body)))


#: The largest value of each shape: one byte more is over the bound.
SHAPES: dict[str, Callable[[], str]] = {
    "ascii": lambda: incompressible("abcdefghijklmnopqrstuvwxyz0123456789", INDEXED_TEXT_MAX_BYTES),
    "two-byte": lambda: incompressible("éèàùçñøåæœßðþ", INDEXED_TEXT_MAX_BYTES),
    "three-byte": lambda: incompressible("日本語漢字仮名文字列鍵", INDEXED_TEXT_MAX_BYTES),
    "four-byte": lambda: incompressible("😀😁😂🤣😃😄😅😆", INDEXED_TEXT_MAX_BYTES),
    # A NUL is stored as U+FFFD: three bytes for one character.
    "nul-heavy": lambda: "".join(
        RNG.choice(["\0", "\0", "q", "z", "7"]) for _ in range(INDEXED_TEXT_MAX_BYTES // 3)
    ),
}


def largest(shape: str) -> str:
    value = SHAPES[shape]()
    if shape == "nul-heavy":  # pad to the bound with letters
        value += "k" * (INDEXED_TEXT_MAX_BYTES - stored_size(value))
    assert stored_size(value) == INDEXED_TEXT_MAX_BYTES
    return value


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_the_largest_accepted_value_of_each_field_commits_and_reads_back(
    store: PgStore, shape: str
) -> None:
    key, name, target, other = (largest(shape) for _ in range(4))
    template = TaskSpec(b"t", key=other, deps=[Dependency(target)])
    batch: list[Mutation] = [
        Submitted(TaskId(1), 1, 0, TaskSpec(b"a", key=key)),
        Submitted(TaskId(2), 2, 0, TaskSpec(b"b", deps=[Dependency(target)])),
        RecurringUpsert(RecurringSpec(name, EVERY, template)),
        RecurringNext(name, 10, TaskId(1)),
    ]
    await store.commit(0, START_BASE, batch, [])
    record = await store.get_task(key)
    assert record is not None
    assert (record.id, record.key) == (1, clean_text(key))
    recovered = await store.recover(START_BASE)
    assert [t.spec.key for t in recovered.tasks] == [clean_text(key), None]
    assert recovered.tasks[1].spec.deps == (Dependency(clean_text(target)),)
    [schedule] = recovered.recurring
    assert (schedule.spec.name, schedule.spec.template.key) == (clean_text(name), clean_text(other))
    await store.commit(0, START_BASE, [RecurringRemove(name)], [])
    assert (await store.recover(START_BASE)).recurring == []


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("extra", ["x", "\0", "é"], ids=["one byte", "a NUL", "two bytes"])
def test_a_value_over_the_bound_is_refused_when_built_naming_the_field(
    shape: str, extra: str
) -> None:
    over = largest(shape) + extra
    size = stored_size(over)
    builders: dict[str, Callable[[], object]] = {
        "key": lambda: TaskSpec(b"", key=over),
        "name": lambda: RecurringSpec(over, EVERY, TaskSpec(b"")),
    }
    for field, build in builders.items():
        with pytest.raises(
            ValueError,
            match=rf"^{field}: must take at most "
            rf"{INDEXED_TEXT_MAX_BYTES} bytes as stored .* got {size} bytes",
        ):
            build()


async def test_lookups_by_a_longer_key_or_name_are_not_bounded(store: PgStore) -> None:
    """A dependency's target, ``RecurringNext``, ``RecurringRemove``, ``get_task`` and the
    pools of ``list_finished`` only look a value up (a dependency lives in jsonb, pools are
    not indexed): they may name a longer value stored by an earlier build, and never fail."""
    long = incompressible("abcdefghijklmnopqrstuvwxyz", 100_000)
    assert await store.get_task(long) is None
    assert await store.list_finished(pools=[long, "\0" * 50_000]) == []
    dependent = TaskSpec(b"d", deps=[Dependency(long, DependencyCondition.FINISHED)])
    batch: list[Mutation] = [
        Submitted(TaskId(1), 1, 0, dependent),
        RecurringNext(long, 5, None),
        RecurringRemove(long),
    ]
    await store.commit(0, START_BASE, batch, [])
    recovered = await store.recover(START_BASE)
    assert [t.spec.deps for t in recovered.tasks] == [
        (Dependency(long, DependencyCondition.FINISHED),)
    ]
    assert recovered.recurring == []


async def test_a_stored_key_over_the_bound_is_recovered_not_quarantined(
    engine: AsyncEngine, store: PgStore
) -> None:
    """PostgreSQL indexes a long value that compresses, and an earlier build had no bound:
    such a row, already stored, stays readable."""
    await store.commit(0, START_BASE, [Submitted(TaskId(1), 1, 0, TaskSpec(b"a", key="k"))], [])
    await store.commit(
        0,
        START_BASE,
        [RecurringUpsert(RecurringSpec("n", EVERY, TaskSpec(b"t", key="k")))],
        [],
    )
    long = "k" * 50_000
    schema = store.config.schema
    async with engine.begin() as conn:
        await conn.execute(text(f'UPDATE "{schema}".cronoq_tasks SET key = :k'), {"k": long})
        await conn.execute(
            text(
                f'UPDATE "{schema}".cronoq_recurring SET name = :k, spec = jsonb_set('
                "spec, '{template,key}', to_jsonb(CAST(:k AS text)))"
            ),
            {"k": long},
        )
    recovered = await store.recover(START_BASE)
    assert [(t.id, t.spec.key) for t in recovered.tasks] == [(1, long)]
    assert [(r.spec.name, r.spec.template.key) for r in recovered.recurring] == [(long, long)]
    record = await store.get_task(TaskId(1))
    assert record is not None
    assert record.status is None  # still queued: not quarantined


async def test_text_columns_without_an_index_take_any_length(store: PgStore) -> None:
    """``pool``, ``kind``, ``tenant`` and the message are not indexed: no bound applies."""
    pool, kind, tenant, message = (
        incompressible("abcdefghijklmnopqrstuvwxyz", 20_000) for _ in range(4)
    )
    spec = TaskSpec(b"a", pool=pool, kind=kind, tenant=tenant)
    done = StatusChanged(TaskId(1), TaskStatus.FAILED, 1, 5, message)
    await store.commit(0, START_BASE, [Submitted(TaskId(1), 1, 0, spec), done], [])
    record = await store.get_task(TaskId(1))
    assert record is not None
    assert (record.pool, record.kind, record.tenant, record.message) == (
        pool,
        kind,
        tenant,
        message,
    )
    assert [r.id for r in await store.list_finished(pools=[pool])] == [1]
