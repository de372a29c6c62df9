"""Folding and forward-only transitions, as the scheduler sees them through ``get_task``."""

from __future__ import annotations

import pytest

from cronoq_store import Mutation, TaskId

from ..support import (
    CANCELLED,
    FAILED,
    RETRYING,
    RUNNING,
    START_BASE,
    SUCCEEDED,
    changed,
    submitted,
)
from .support import Cluster, states, when


async def test_a_new_task_is_stored_once_with_its_latest_state_and_last_message(
    cluster: Cluster,
) -> None:
    store = await cluster.open()
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1),
            changed(1, RUNNING, 10, message="started"),
            changed(1, RETRYING, 20, message="lost the worker"),
            changed(1, RUNNING, 30, attempt=2),  # no message: the last one carries forward
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
            changed(1, RUNNING, 10, message="m1"),
            changed(1, RETRYING, 20, message="m2"),
            changed(1, RUNNING, 30, attempt=2),
            changed(2, RUNNING, 10, message="started"),
            changed(2, FAILED, 40, message="boom"),
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
    "a lower attempt": [changed(1, RETRYING, 90, message="no")],
    "running after retrying in one attempt": [changed(1, RUNNING, 60, attempt=2, message="no")],
    "a tie": [changed(1, RETRYING, 50, attempt=2, message="no")],
    "an earlier time": [changed(1, RETRYING, 49, attempt=2, message="no")],
    "the same transition again": [changed(1, RETRYING, 50, attempt=2, message="kept")],
}


@pytest.mark.parametrize("late", NOT_AHEAD)
async def test_a_transition_that_is_not_ahead_changes_nothing(cluster: Cluster, late: str) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), changed(1, RUNNING, 45, attempt=2)], [])
    await store.commit(0, START_BASE, [changed(1, RETRYING, 50, attempt=2, message="kept")], [])
    before = await states(store, [1])
    assert before == [(RETRYING, 2, "kept", when(50))]
    await store.commit(0, START_BASE, NOT_AHEAD[late], [])
    assert await states(store, [1]) == before


async def test_a_finished_task_is_final_whatever_comes_later(cluster: Cluster) -> None:
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), changed(1, SUCCEEDED, 50, message="done")], [])
    for late in (
        [changed(1, RUNNING, 90, attempt=9, message="again")],  # a higher attempt
        [changed(1, FAILED, 60, message="failed")],  # another finished state, later
        [changed(1, CANCELLED, 40, attempt=5)],
    ):
        await store.commit(0, START_BASE, late, [])
    assert await states(store, [1]) == [(SUCCEEDED, 1, "done", when(50))]


async def test_a_message_brought_by_a_transition_not_ahead_of_the_stored_one_is_dropped(
    cluster: Cluster,
) -> None:
    """The batch's first transition (with a message) is behind the stored state and its
    second (without one) is ahead: the task moves, but keeps its stored message."""
    store = await cluster.open()
    await store.commit(0, START_BASE, [submitted(1), changed(1, RUNNING, 50, message="stored")], [])
    await store.commit(
        0, START_BASE, [changed(1, RUNNING, 40, message="stale"), changed(1, RETRYING, 60)], []
    )
    assert await states(store, [1]) == [(RETRYING, 1, "stored", when(60))]
    # A message of a transition that is ahead comes along, even when a later one moves.
    await store.commit(
        0,
        START_BASE,
        [changed(1, RUNNING, 70, attempt=2, message="fresh"), changed(1, RETRYING, 80, attempt=2)],
        [],
    )
    assert await states(store, [1]) == [(RETRYING, 2, "fresh", when(80))]


HISTORY: list[Mutation] = [
    submitted(1),
    submitted(2),
    changed(1, RUNNING, 10, message="one"),
    changed(2, RUNNING, 10),
    submitted(3),
    changed(1, RETRYING, 20, message="lost"),
    changed(2, SUCCEEDED, 30, message="ok"),
    submitted(2),  # a submission sent again
    changed(3, RUNNING, 15),
    changed(1, RUNNING, 40, attempt=2),
    changed(2, RUNNING, 35, message="late"),  # after a finished state: ignored
    changed(3, RETRYING, 12),  # behind: ignored
    changed(1, FAILED, 50, attempt=2),
    changed(3, CANCELLED, 60, message="stop"),
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
