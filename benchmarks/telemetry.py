"""What telemetry costs a commit: ``python -m benchmarks.telemetry [--base DIR] [--rounds N]``.

Commits the same small batches (the case where per-commit overhead shows most) with
telemetry off (no provider configured), with the OpenTelemetry SDK recording metrics only
(a ``MeterProvider`` with an in-memory reader), and metrics and spans (``sdk``: also a
``TracerProvider`` exporting to memory),
and, given ``--base``, with the code of a checkout without telemetry (``git archive`` of the
base branch). Each variant runs in a process of its own against one throwaway server
(``synchronous_commit=off``, so the client's work is not hidden behind WAL flushes), in
rounds, interleaved; the figures are medians over rounds of microseconds per commit,
elapsed and client CPU (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cronoq_store import PgStore, PgStoreConfig, Submitted, TaskId, TaskSpec, TimeBase

_ROOT = Path(__file__).resolve().parent.parent
_BATCH = 10
_COMMITS = 2000


async def _trial(url: str, schema: str, variant: str) -> tuple[float, float]:
    """Microseconds per commit of ``_COMMITS`` batches of ``_BATCH`` submissions: elapsed,
    and this process's CPU (the client's work, which telemetry adds to)."""
    store = await PgStore.connect(url, PgStoreConfig(schema=schema))
    try:
        if variant in ("sdk", "metrics"):
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import InMemoryMetricReader
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
                InMemorySpanExporter,
            )

            from cronoq_store.telemetry import instrument

            tracers = TracerProvider()
            tracers.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
            meters = MeterProvider(metric_readers=[InMemoryMetricReader()])
            # "metrics": no tracer provider (none is configured globally): no spans.
            instrument(
                store,
                meter_provider=meters,
                tracer_provider=tracers if variant == "sdk" else None,
            )
        epoch = await store.acquire_leadership()
        base = TimeBase(engine_ns=0, unix_ns=time.time_ns())
        next_id = (await store.recover(base)).next_id
        batches = [
            [
                Submitted(TaskId(i), seq=i, arrival=i, spec=TaskSpec(b"x" * 64))
                for i in range(start, start + _BATCH)
            ]
            for start in range(next_id, next_id + _COMMITS * _BATCH, _BATCH)
        ]
        for batch in batches[:100]:  # warm up: pool, prepared statements
            await store.commit(epoch, base, batch, [])
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches[100:]:
            await store.commit(epoch, base, batch, [])
        n = len(batches) - 100
        return (
            (time.perf_counter() - started) / n * 1e6,
            (time.process_time() - cpu) / n * 1e6,
        )
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, help="a checkout without telemetry, to compare")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trial", nargs=3, metavar=("URL", "SCHEMA", "VARIANT"))
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(asyncio.run(_trial(*args.trial))))
        return
    from cronoq_store.testing import EmbeddedPostgres

    variants = {"off": _ROOT, "metrics": _ROOT, "sdk": _ROOT}
    if args.base is not None:
        variants = {"base": args.base.resolve(), **variants}
    figures: dict[str, list[list[float]]] = {name: [] for name in variants}
    with EmbeddedPostgres(settings={"synchronous_commit": "off"}) as server:
        url = server.url().render_as_string(hide_password=False)
        for round_ in range(args.rounds):
            for name, root in variants.items():
                env = {**os.environ, "PYTHONPATH": str(root)}
                # The base checkout runs this file from here, with its own cronoq_store.
                script = [sys.executable, str(Path(__file__).resolve())]
                trial = [*script, "--trial", url, f"bench_{name}_{round_}", name]
                out = subprocess.run(trial, env=env, check=True, capture_output=True, text=True)
                figures[name].append(json.loads(out.stdout))
    for name, values in figures.items():
        elapsed = statistics.median(v[0] for v in values)
        cpu = statistics.median(v[1] for v in values)
        print(f"{name:>7}: {elapsed:7.1f} us/commit elapsed, {cpu:6.1f} us/commit client CPU")


if __name__ == "__main__":
    main()
