"""The event loop of a run (``python -m benchmarks.run --loop``): asyncio's own, or uvloop
(an optional benchmark dependency; the store never requires it). Child processes
(recovery, the takeover's leader) read the choice from ``$BENCH_LOOP``, so every process of
a run uses the same loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

LOOPS = ("asyncio", "uvloop")
LOOP_ENV = "BENCH_LOOP"

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on the loop ``$BENCH_LOOP`` names (asyncio's own by default)."""
    if os.environ.get(LOOP_ENV, "asyncio") == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
