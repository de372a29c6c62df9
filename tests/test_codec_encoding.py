"""The per-row JSON encoders write the very text ``json`` writes, with or without orjson."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cronoq_store import _codec as codec
from cronoq_store._codec import encode_deps, encode_resources
from cronoq_store._domain import (
    Dependency,
    DependencyCondition,
    TaskId,
    clean_text,
)

pytestmark = pytest.mark.skipif(codec._orjson_dumps is None, reason="orjson is not installed")

# Any text, escapes and control characters included (cleaned as the encoders clean it).
_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
_AMOUNTS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def reference(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@given(st.dictionaries(_TEXT, _AMOUNTS, max_size=5))
def test_resources_encode_as_json_would(resources: dict[str, int]) -> None:
    cleaned = {clean_text(name): amount for name, amount in resources.items()}
    assert encode_resources(resources) == (reference(cleaned) if resources else "{}")


@given(
    st.lists(
        st.tuples(
            st.one_of(st.integers(min_value=1, max_value=2**63 - 1), _TEXT.filter(bool)),
            st.sampled_from(list(DependencyCondition)),
        ),
        max_size=5,
    )
)
def test_dependencies_encode_as_json_would(
    targets: list[tuple[int | str, DependencyCondition]],
) -> None:
    deps = [
        Dependency(TaskId(t) if isinstance(t, int) else t, condition) for t, condition in targets
    ]
    expected = [
        {"key": clean_text(t), "on": c.value} if isinstance(t, str) else {"id": t, "on": c.value}
        for t, c in targets
    ]
    assert encode_deps(deps) == (reference(expected) if deps else "[]")


def test_an_integer_orjson_refuses_is_encoded_by_json() -> None:
    huge = {"cpu": 2**70}
    assert codec._dumps_plain(huge) == '{"cpu":1180591620717411303424}'
