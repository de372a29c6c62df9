"""The fold's shortcut for transitions of distinct tasks builds what its general loop does."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cronoq_store._commit_path import fold
from cronoq_store._domain import StatusChanged, TaskId, TaskStatus

from .support import FAILED, FIXED_BASE, FIXED_NOW, changed, submitted

_TRANSITIONS = st.lists(
    st.builds(
        StatusChanged,
        id=st.integers(min_value=1, max_value=10**6).map(TaskId),
        status=st.sampled_from(list(TaskStatus)),
        attempt=st.integers(min_value=0, max_value=5),
        at=st.integers(min_value=-(10**12), max_value=10**12),
        message=st.none() | st.text(max_size=5),
    ),
    max_size=8,
    unique_by=lambda m: m.id,
)


@given(_TRANSITIONS, st.lists(st.tuples(st.integers(1, 10**6), st.binary(max_size=3)), max_size=3))
def test_distinct_transitions_fold_as_in_any_other_batch(
    batch: list[StatusChanged], outputs: list[tuple[int, bytes]]
) -> None:
    outs = [(TaskId(i), o) for i, o in outputs]
    alone = fold(batch, FIXED_BASE, FIXED_NOW, outs)
    # A submission of another task sends the same transitions through the general loop.
    other = submitted(10**7, seq=1, arrival=0)
    mixed = fold([*batch, other], FIXED_BASE, FIXED_NOW, outs)
    assert alone.updates == mixed.updates
    assert alone.outputs == mixed.outputs
    assert alone.inserted_updates == mixed.inserted_updates
    assert (alone.insert_rows, alone.recurring) == ([], [])


def test_a_message_is_cleaned_on_the_shortcut_too() -> None:
    folded = fold([changed(1, FAILED, 5, message="a\0b")], FIXED_BASE, FIXED_NOW)
    assert folded.updates["messages"] == ["a\ufffdb"]
    assert folded.updates["message_levels"] == folded.updates["levels"]
