"""Waiting for a state, never for a duration.

A test that sleeps a fixed time and then asserts depends on the machine's speed: on a
loaded machine the state it expects is not there yet. These helpers poll for the state and,
when it does not come, fail saying what was waited for and what was seen last. Their
bounds are generous (``PATIENCE``): a bound is how long a test may take to fail, not how
long the behaviour may take. A test that asserts something *does not* happen samples for a
while (``holds_for``) and names the duration it watched.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

#: How long a wait for a state may last before the test fails: far beyond what any state
#: takes on a quiet machine, so a loaded one still gets there.
PATIENCE = 60.0

Check = Callable[[], "bool | Awaitable[bool]"]


async def _value(check: Callable[[], object]) -> object:
    result = check()
    if inspect.isawaitable(result):
        result = await result
    return result


async def until(check: Check, what: str, within: float = PATIENCE, every: float = 0.02) -> None:
    """Return once ``check()`` (sync or async) is true; fail naming ``what`` after ``within``."""
    deadline = time.monotonic() + within
    while not await _value(check):
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {within:g} s for {what}")
        await asyncio.sleep(every)


@overload
async def until_value(
    read: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    what: str,
    within: float = PATIENCE,
    every: float = 0.02,
) -> T: ...


@overload
async def until_value(
    read: Callable[[], T],
    accept: Callable[[T], bool],
    what: str,
    within: float = PATIENCE,
    every: float = 0.02,
) -> T: ...


async def until_value(
    read: Callable[[], Any],
    accept: Callable[[Any], bool],
    what: str,
    within: float = PATIENCE,
    every: float = 0.02,
) -> Any:
    """Poll ``read()`` (sync or async) until ``accept`` takes its value; return it, or fail
    showing the last. The overloads give the value's type: an async ``read`` is awaited."""
    deadline = time.monotonic() + within
    while True:
        value = await _value(read)
        if accept(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {within:g} s for {what}; last seen: {value!r}")
        await asyncio.sleep(every)


async def holds_for(check: Check, what: str, duration: float, every: float = 0.02) -> None:
    """Fail as soon as ``check()`` is false during ``duration`` seconds (a negative claim:
    "nothing happens" can only be watched for a while, and the test says for how long)."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if not await _value(check):
            raise AssertionError(f"{what} stopped holding within {duration:g} s")
        await asyncio.sleep(every)


async def bounded(awaitable: Awaitable[T], what: str, within: float = PATIENCE) -> T:
    """Await with a bound that turns a hang into a failure naming what hung."""
    try:
        return await asyncio.wait_for(awaitable, within)
    except TimeoutError:
        raise AssertionError(f"waited {within:g} s for {what}") from None
