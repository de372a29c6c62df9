"""Fixtures of the HA tests: a fresh stack per test, proven gone afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .stack import HaStack, missing


@pytest.fixture
async def stack() -> AsyncIterator[HaStack]:
    """A 3-node stack in synchronous mode; the test fails if any of its processes outlives it."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    ha = HaStack(3, sync="on")
    await ha.start()
    try:
        yield ha
    finally:
        await ha.close()
    left = ha.leftovers()
    assert not left, "processes of the stack outlived it:\n" + "\n".join(left)
