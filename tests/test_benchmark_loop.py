"""``python -m benchmarks.run --loop``: the run and its child processes (which read
``$BENCH_LOOP``) run on the loop chosen, asyncio's own by default."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.loops import LOOP_ENV, run_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOOP_ENV, raising=False)
    assert run_loop(_loop_module()).startswith("asyncio")


def test_uvloop_when_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOP_ENV, "uvloop")
    assert run_loop(_loop_module()).startswith("uvloop")
