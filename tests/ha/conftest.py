"""Fixtures of the HA tests: a fresh stack per test, proven gone afterwards."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from .stack import HaStack, missing


async def _stack(nodes: int) -> AsyncIterator[HaStack]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    ha = HaStack(nodes, sync="on")
    await ha.start()
    try:
        yield ha
    finally:
        await ha.close()
    left = ha.leftovers()
    assert not left, "processes of the stack outlived it:\n" + "\n".join(left)


@pytest.fixture
async def stack() -> AsyncIterator[HaStack]:
    """A 3-node stack in synchronous mode; the test fails if any of its processes outlives it."""
    async for ha in _stack(3):
        yield ha


@pytest.fixture
async def two_node_stack() -> AsyncIterator[HaStack]:
    """The same with 2 nodes: a switchover always moves the primary to the other one."""
    async for ha in _stack(2):
        yield ha
