"""Commits: idempotent retries, outputs, live keys, id collisions, text, schedules, bounds."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from cronoq_store import (
    BatchTooLargeError,
    CronSchedule,
    Dependency,
    GroupCommitter,
    IdCollisionError,
    IntervalSchedule,
    KeyTakenError,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    TaskId,
    TaskSpec,
)
from cronoq_store._commit_path import COPY_MIN_ROWS

from ..support import (
    CANCELLED,
    FAILED,
    NUL,
    NUL_CLEANED,
    NUL_SPEC,
    QUEUED,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    submitted,
)
from .support import Cluster, observe, state, summary, when


def every(seconds: int, name: str = "r", **template: Any) -> RecurringSpec:
    return RecurringSpec(
        name, IntervalSchedule(timedelta(seconds=seconds)), TaskSpec(b"tpl", **template)
    )


async def test_a_batch_committed_again_changes_nothing(cluster: Cluster) -> None:
    """The retry of a batch whose acknowledgement was lost."""
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), submitted(2)], [])
    batch: list[Mutation] = [
        changed(1, RUNNING, 10, message="started"),
        changed(1, SUCCEEDED, 20),
        submitted(3),
        changed(3, RUNNING, 10, message="also started"),
        submitted(4, key="k"),
        RecurringUpsert(every(60)),
        RecurringNext("r", 500, TaskId(3)),
    ]
    outputs = [(TaskId(1), b"out")]
    await store.commit(0, START_BASE, batch, outputs)
    landed = await observe(store, range(1, 5))
    for _ in range(2):
        await store.commit(0, START_BASE, batch, outputs)
        assert await observe(store, range(1, 5)) == landed
    records, stored_outputs, _, recovered = landed
    assert [r.status if r else "missing" for r in records] == [SUCCEEDED, QUEUED, RUNNING, QUEUED]
    assert stored_outputs == [b"out", None, None, None]
    assert recovered["recurring"] == [["r", 500, 3]]


async def test_an_output_is_kept_only_for_a_task_that_ends_succeeded(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), submitted(5)], [])
    batch: list[Mutation] = [
        changed(1, CANCELLED, 10),  # stored: cancelled first, so final
        changed(1, SUCCEEDED, 20),
        submitted(2),
        changed(2, FAILED, 20),
        submitted(3),
        changed(3, RUNNING, 20),
        submitted(4),
        changed(4, SUCCEEDED, 20),
        submitted(5),  # stored, and sent again
        changed(5, CANCELLED, 10),
        changed(5, SUCCEEDED, 20),
    ]
    await store.commit(0, START_BASE, batch, [(TaskId(i), b"OUT") for i in range(1, 7)])
    records = [await store.get_task(TaskId(i)) for i in range(1, 6)]
    assert [(r.status, r.output) if r else None for r in records] == [
        (CANCELLED, None),
        (FAILED, None),
        (RUNNING, None),
        (SUCCEEDED, b"OUT"),
        (CANCELLED, None),
    ]
    assert [await store.load_output(TaskId(i)) for i in range(1, 7)] == [
        None,
        None,
        None,
        b"OUT",
        None,
        None,
    ]
    # The last output given for a task wins, in a batch and across batches.
    await store.commit(0, START_BASE, [], [(TaskId(4), b"first"), (TaskId(4), b"\0last")])
    assert await store.load_output(TaskId(4)) == b"\0last"


async def test_a_key_is_held_by_at_most_one_live_task(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1, key="k")], [])
    before = await observe(store, range(1, 4))
    with pytest.raises(KeyTakenError) as caught:
        await store.commit(0, START_BASE, [submitted(3), submitted(2, key="k")], [])
    assert caught.value.keys == ["k"]
    assert "nothing of the batch was written" in str(caught.value)
    assert not caught.value.is_transient
    assert await observe(store, range(1, 4)) == before  # not even task 3
    # Its holder finishing releases it: in the same batch, updates come before inserts.
    await store.commit(0, START_BASE, [changed(1, SUCCEEDED, 100), submitted(2, key="k")], [])
    # A task that finishes in the batch that submits it never holds its key.
    await store.commit(0, START_BASE, [submitted(3, key="k"), changed(3, CANCELLED, 100)], [])
    newest = await store.get_task("k")
    assert newest is not None
    assert (newest.id, newest.status) == (3, CANCELLED)
    live = [t.id for t in (await store.recover(START_BASE)).tasks]
    assert live == [2]


async def test_a_task_sent_again_with_later_transitions_moves_as_a_stored_task(
    cluster: Cluster,
) -> None:
    """A submission delivered again with transitions beyond the stored state (a retried
    batch that grew) moves the stored row as an update does: its message carries forward,
    its output is kept, and the key it releases can be taken in the same batch."""
    store = await cluster.open()
    await store.commit(
        0, START_BASE, [submitted(1, key="k"), changed(1, RUNNING, 100, message="started")], []
    )
    again: list[Mutation] = [
        submitted(1, key="k"),
        changed(1, SUCCEEDED, 200),
        submitted(2, key="k"),
    ]
    await store.commit(0, START_BASE, again, [(TaskId(1), b"out")])
    one = await store.get_task(TaskId(1))
    assert state(one) == (SUCCEEDED, 1, "started", when(200))
    assert await store.load_output(TaskId(1)) == b"out"
    assert [t.id for t in (await store.recover(START_BASE)).tasks] == [2]
    newest = await store.get_task("k")
    assert newest is not None
    assert (newest.id, newest.status) == (2, QUEUED)


async def test_keys_that_differ_only_by_nul_and_u_fffd_are_one_key(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1, key="k\0")], [])
    with pytest.raises(KeyTakenError) as caught:
        await store.commit(0, START_BASE, [submitted(2, key="k\ufffd")], [])
    assert caught.value.keys == ["k\ufffd"]
    found = await store.get_task("k\ufffd")
    assert found is not None
    assert (found.id, found.key) == (1, "k\ufffd")


OTHER_TASKS: dict[str, Mutation] = {
    "seq": submitted(1, key="k", seq=2),
    "arrival": submitted(1, key="k", arrival=2),
    "key": submitted(1, key="other"),
    "payload": submitted(1, b"q", key="k"),
    "tags": submitted(1, key="k", tags=["t"]),
}


@pytest.mark.parametrize("field", OTHER_TASKS)
async def test_a_different_task_under_a_stored_id_is_refused_with_nothing_written(
    cluster: Cluster, field: str
) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1, key="k"), submitted(2)], [])
    before = await observe(store, range(1, 12))
    batch: list[Mutation] = [changed(2, RUNNING, 100), submitted(11), OTHER_TASKS[field]]
    with pytest.raises(IdCollisionError, match="task id 1 already taken") as caught:
        await store.commit(0, START_BASE, batch, [])
    assert caught.value.ids == [1]
    assert not caught.value.is_transient
    assert await observe(store, range(1, 12)) == before  # next_id did not move either
    # The same submission again is no collision.
    await store.commit(
        0, START_BASE, [changed(2, RUNNING, 100), submitted(11), submitted(1, key="k")], []
    )
    assert [t.id for t in (await store.recover(START_BASE)).tasks] == [1, 2, 11]


async def test_a_different_task_under_an_id_of_the_same_batch_is_refused(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    with pytest.raises(IdCollisionError, match="task id 3 already taken by another Submitted"):
        await store.commit(0, START_BASE, [submitted(3), submitted(4), submitted(3, b"other")], [])
    assert summary(await store.recover(START_BASE))["next_id"] == 1  # ids 3 and 4 not recorded


async def test_nul_in_every_string_is_stored_as_the_replacement_character(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1, **{f: getattr(NUL_SPEC, f) for f in ("kind", "pool", "key", "tenant")}),
            submitted(2, b"\0", **{f: getattr(NUL_SPEC, f) for f in ("tags", "labels", "deps")}),
            submitted(
                3, **{f: getattr(NUL_SPEC, f) for f in ("resources", "retry", "fixed_start")}
            ),
            changed(3, RUNNING, 10, message=NUL),
            RecurringUpsert(RecurringSpec(NUL, CronSchedule("* * * * *"), NUL_SPEC)),
            RecurringNext(NUL, 9, TaskId(1)),
        ],
        [],
    )
    recovered = await store.recover(START_BASE)
    one, two, three = (t.spec for t in recovered.tasks)
    assert (one.kind, one.pool, one.key, one.tenant) == (NUL_CLEANED,) * 4
    assert (two.tags, two.labels, two.deps, two.payload) == (
        (NUL_CLEANED,),
        (NUL_CLEANED,),
        (Dependency(NUL_CLEANED),),
        b"\0",
    )
    assert three.resources == {NUL_CLEANED: 2}
    record = await store.get_task(TaskId(3))
    assert record is not None
    assert record.message == NUL_CLEANED
    [schedule] = recovered.recurring
    template = schedule.spec.template
    assert (schedule.spec.name, schedule.next, schedule.last) == (NUL_CLEANED, 9, 1)
    assert (template.kind, template.pool, template.key, template.tenant) == (NUL_CLEANED,) * 4
    assert (template.tags, template.labels, template.resources) == (
        (NUL_CLEANED,),
        (NUL_CLEANED,),
        {NUL_CLEANED: 2},
    )
    assert await store.get_task(NUL) == await store.get_task(TaskId(1))


async def test_recurring_changes_apply_in_batch_order(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            RecurringUpsert(every(10, "a")),
            RecurringNext("a", 1_000, TaskId(7)),
            RecurringRemove("a"),
            RecurringUpsert(every(20, "a")),  # a new schedule: nothing carried over
            RecurringUpsert(every(30, "b")),
            RecurringNext("b", 2_000, None),
            RecurringUpsert(every(40, "b")),  # a replaced one keeps its progress
            RecurringRemove("c"),  # removing what is not there is fine
            RecurringNext("d", 3_000, None),  # and so is advancing it
        ],
        [],
    )
    recovered = await store.recover(START_BASE)
    got = {r.spec.name: (r.spec.schedule, r.next, r.last) for r in recovered.recurring}
    assert got == {
        "a": (IntervalSchedule(timedelta(seconds=20)), None, None),
        "b": (IntervalSchedule(timedelta(seconds=40)), 2_000, None),
    }


async def test_an_engine_time_outside_bigint_fails_its_batch_naming_the_field(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    far = 2**63 - 1  # fits the domain, but not once converted to Unix ns through START_BASE
    batches: list[tuple[list[Mutation], str]] = [
        ([submitted(1), submitted(2, deadline=far)], "deadline"),
        ([submitted(1), changed(1, RUNNING, far)], "at"),
        ([submitted(1), RecurringUpsert(every(5, deadline=far))], "template.deadline"),
    ]
    for batch, field in batches:
        with pytest.raises(ValueError, match=f"^{field}: "):
            await store.commit(0, START_BASE, batch, [])
    records, _, finished, recovered = await observe(store, [1, 2])
    assert (records, finished, recovered["next_id"], recovered["recurring"]) == (
        [None, None],
        [],
        1,  # nothing recorded: the fresh store's
        [],
    )


async def test_a_batch_over_the_byte_bound_is_refused_before_anything_is_written(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    store.max_commit_bytes = 10_000
    with pytest.raises(BatchTooLargeError):
        await store.commit(0, START_BASE, [submitted(1), submitted(2, b"x" * 10_000)], [])
    assert await store.get_task(TaskId(1)) is None
    await store.commit(0, START_BASE, [submitted(1)], [])
    assert await store.get_task(TaskId(1)) is not None


async def test_what_a_group_committer_acknowledges_is_recovered(cluster: Cluster) -> None:
    store = await cluster.open()
    epoch = await store.acquire_leadership()
    async with GroupCommitter(store, epoch, START_BASE) as committer:
        await asyncio.gather(
            *(committer.submit([submitted(i), changed(i, RUNNING, i)]) for i in range(1, 41))
        )
    recovered = await store.recover(START_BASE)
    assert [(t.id, t.attempt) for t in recovered.tasks] == [(i, 1) for i in range(1, 41)]
    assert recovered.next_id == 41


def _padded(batch: list[Mutation], path: str) -> list[Mutation]:
    """``batch``, with enough new tasks in front for the COPY path when ``path`` says so."""
    if path == "insert":
        return batch
    return [submitted(100 + n) for n in range(COPY_MIN_ROWS)] + batch


@pytest.mark.parametrize("path", ["insert", "copy"])
@pytest.mark.parametrize("order", ["collision first", "keys first"])
async def test_an_id_collision_wins_over_taken_keys_whatever_the_order(
    cluster: Cluster, path: str, order: str
) -> None:
    """One documented precedence: a batch that reuses a stored id for another task is not
    what the store holds, so ``IdCollisionError`` is raised even where its rows taking held
    keys meet the index first."""
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(2, key="k1"), submitted(5, key="k2")], [])
    before = await observe(store, range(1, 12))
    keys: list[Mutation] = [submitted(1, key="k1"), submitted(9, key="k2")]
    colliding: list[Mutation] = [submitted(5, b"other")]
    batch = colliding + keys if order == "collision first" else keys + colliding
    with pytest.raises(IdCollisionError) as caught:
        await store.commit(0, START_BASE, _padded(batch, path), [])
    assert caught.value.ids == [5]
    assert await observe(store, range(1, 12)) == before


@pytest.mark.parametrize("path", ["insert", "copy"])
async def test_key_taken_names_every_key_taken(cluster: Cluster, path: str) -> None:
    """Held by a stored live task (not one the batch finishes), or by an earlier new task
    of the same batch: every such key is named, sorted."""
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [submitted(1, key="k1"), submitted(2, key="k2"), submitted(3, key="free")],
        [],
    )
    batch: list[Mutation] = [
        changed(3, SUCCEEDED, 100),  # releases "free" before the inserts
        submitted(11, key="k2"),
        submitted(12, key="free"),
        submitted(13, key="k1"),
        submitted(14, key="twice"),
        submitted(15, key="twice"),
        submitted(16, key="new"),
    ]
    with pytest.raises(KeyTakenError) as caught:
        await store.commit(0, START_BASE, _padded(batch, path), [])
    assert caught.value.keys == ["k1", "k2", "twice"]
    assert "'k1', 'k2', 'twice'" in str(caught.value)
    assert [t.id for t in (await store.recover(START_BASE)).tasks] == [1, 2, 3]
