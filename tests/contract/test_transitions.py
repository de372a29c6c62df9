"""Folding and forward-only transitions, as the scheduler sees them through ``get_task``."""

from __future__ import annotations

import pytest

from cronoq_store import Mutation, TaskId

from ..support import CANCELLED, FAILED, RETRYING, RUNNING, START_BASE, SUCCEEDED, submitted
from .support import Cluster, states, step, when


async def test_a_new_task_is_stored_once_with_its_latest_state_and_last_message(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1),
            step(1, RUNNING, 1, 10, "started"),
            step(1, RETRYING, 1, 20, "lost the worker"),
            step(1, RUNNING, 2, 30),  # no message: the last one carries forward
            submitted(2),
        ],
        [],
    )
    assert (await states(store, [1]))[0] == (RUNNING, 2, "lost the worker", when(30))
    queued = await store.get_task(TaskId(2))
    assert queued is not None
    assert (queued.status, queued.attempt, queued.message) == (None, 0, None)


async def test_a_stored_task_moves_to_the_latest_state_of_a_batch(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), submitted(2)], [])
    await store.commit(
        0,
        START_BASE,
        [
            step(1, RUNNING, 1, 10, "m1"),
            step(1, RETRYING, 1, 20, "m2"),
            step(1, RUNNING, 2, 30),
            step(2, RUNNING, 1, 10, "started"),
            step(2, FAILED, 1, 40, "boom"),
        ],
        [],
    )
    assert await states(store, [1, 2]) == [
        (RUNNING, 2, "m2", when(30)),
        (FAILED, 1, "boom", when(40)),
    ]


# Each of these, committed on a task stored as retrying in attempt 2 at time 50 with the
# message "kept", is not ahead of that state and changes nothing, its message included.
NOT_AHEAD: dict[str, list[Mutation]] = {
    "a lower attempt": [step(1, RETRYING, 1, 90, "no")],
    "running after retrying in one attempt": [step(1, RUNNING, 2, 60, "no")],
    "a tie": [step(1, RETRYING, 2, 50, "no")],
    "an earlier time": [step(1, RETRYING, 2, 49, "no")],
    "the same transition again": [step(1, RETRYING, 2, 50, "kept")],
}


@pytest.mark.parametrize("late", NOT_AHEAD)
async def test_a_transition_that_is_not_ahead_changes_nothing(cluster: Cluster, late: str) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), step(1, RUNNING, 2, 45)], [])
    await store.commit(0, START_BASE, [step(1, RETRYING, 2, 50, "kept")], [])
    before = await states(store, [1])
    assert before == [(RETRYING, 2, "kept", when(50))]
    await store.commit(0, START_BASE, NOT_AHEAD[late], [])
    assert await states(store, [1]) == before


async def test_a_finished_task_is_final_whatever_comes_later(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), step(1, SUCCEEDED, 1, 50, "done")], [])
    for late in (
        [step(1, RUNNING, 9, 90, "again")],  # a higher attempt
        [step(1, FAILED, 1, 60, "failed")],  # another finished state, later
        [step(1, CANCELLED, 5, 40)],
    ):
        await store.commit(0, START_BASE, late, [])
    assert await states(store, [1]) == [(SUCCEEDED, 1, "done", when(50))]


async def test_a_message_brought_by_a_transition_not_ahead_of_the_stored_one_is_dropped(
    cluster: Cluster,
) -> None:
    """The batch's first transition (with a message) is behind the stored state and its
    second (without one) is ahead: the task moves, but keeps its stored message."""
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), step(1, RUNNING, 1, 50, "stored")], [])
    await store.commit(
        0, START_BASE, [step(1, RUNNING, 1, 40, "stale"), step(1, RETRYING, 1, 60)], []
    )
    assert await states(store, [1]) == [(RETRYING, 1, "stored", when(60))]
    # A message of a transition that is ahead comes along, even when a later one moves.
    await store.commit(
        0, START_BASE, [step(1, RUNNING, 2, 70, "fresh"), step(1, RETRYING, 2, 80)], []
    )
    assert await states(store, [1]) == [(RETRYING, 2, "fresh", when(80))]


HISTORY: list[Mutation] = [
    submitted(1),
    submitted(2),
    step(1, RUNNING, 1, 10, "one"),
    step(2, RUNNING, 1, 10),
    submitted(3),
    step(1, RETRYING, 1, 20, "lost"),
    step(2, SUCCEEDED, 1, 30, "ok"),
    submitted(2),  # a submission sent again
    step(3, RUNNING, 1, 15),
    step(1, RUNNING, 2, 40),
    step(2, RUNNING, 1, 35, "late"),  # after a finished state: ignored
    step(3, RETRYING, 1, 12),  # behind: ignored
    step(1, FAILED, 2, 50),
    step(3, CANCELLED, 1, 60, "stop"),
]


@pytest.mark.parametrize(
    "split",
    ["one batch", "one per mutation", "pairs, each delivered twice", "halves, first again last"],
)
async def test_the_stored_result_does_not_depend_on_how_mutations_were_batched(
    cluster: Cluster, split: str
) -> None:
    store = await cluster.open()
    if split == "one batch":
        plan = [HISTORY]
    elif split == "one per mutation":
        plan = [[m] for m in HISTORY]
    elif split == "pairs, each delivered twice":
        pairs = [HISTORY[i : i + 2] for i in range(0, len(HISTORY), 2)]
        plan = [p for pair in pairs for p in (pair, pair)]
    else:
        half = len(HISTORY) // 2
        plan = [HISTORY[:half], HISTORY[half:], HISTORY[:half]]
    for batch in plan:
        await store.commit(0, START_BASE, batch, [])
    assert await states(store, [1, 2, 3]) == [
        (FAILED, 2, "lost", when(50)),
        (SUCCEEDED, 1, "ok", when(30)),
        (CANCELLED, 1, "stop", when(60)),
    ]
