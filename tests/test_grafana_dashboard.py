"""docs/grafana/cronoq-store.json asks only for what the store exports: every panel's
query names metrics (and groups by labels) read from a real OpenTelemetry Prometheus export
of a store that committed, led, lost a leader, recovered, pruned and retried, not from a list
typed a second time."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import REGISTRY, generate_latest
from sqlalchemy.engine import URL

from cronoq_store import GroupCommitter, PgStore, StoreError, TaskStatus
from cronoq_store.telemetry import instrument

from .pgharness import admin_execute, asyncpg_dsn, terminate_backends
from .support import START_BASE, changed, ha_config, lock_waited, submitted
from .waits import bounded, until

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "cronoq-store.json"
_METRIC = re.compile(r"\bcronoq_[a-z0-9_]+")
_GROUPED = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", re.M)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHED = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


@pytest.fixture
def exported() -> Iterator[MeterProvider]:
    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        yield provider
    finally:
        provider.shutdown()  # also takes the reader's collector out of the registry


def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


async def standby_polling(url: URL) -> bool:
    """The instance named "standby" has its lock session open, polling for the lock."""
    rows = await admin_execute(
        url,
        "SELECT 1 FROM pg_stat_activity WHERE starts_with(application_name, 'standby leader ')",
    )
    return bool(rows)


async def test_every_panel_names_what_a_real_export_holds(
    pg_url: URL, schema: str, exported: MeterProvider
) -> None:
    async with (
        await PgStore.connect(pg_url, ha_config(schema)) as first,
        await PgStore.connect(
            pg_url, dataclasses.replace(ha_config(schema), application_name="standby")
        ) as second,
    ):
        for store in (first, second):
            instrument(store, meter_provider=exported)
        epoch = await first.acquire_leadership()
        await first.recover(START_BASE)
        async with GroupCommitter(first, epoch, START_BASE) as committer:
            await asyncio.gather(*(committer.submit([submitted(i)]) for i in range(1, 6)))
            # A taken key fails its submission alone: the batch is split.
            results = await asyncio.gather(
                committer.submit([submitted(1, payload=b"another")]),
                committer.submit([submitted(7)]),
                return_exceptions=True,
            )
            assert isinstance(results[0], StoreError)
            # A commit whose session is ended while it waits is transient: retried.
            blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
            try:
                await blocker.execute("BEGIN")
                await blocker.execute(f'LOCK TABLE "{schema}".cronoq_tasks IN EXCLUSIVE MODE')
                waiting = asyncio.ensure_future(committer.submit([submitted(8)]))
                await lock_waited(pg_url, first.config.application_name)
                assert await terminate_backends(pg_url, first.config.application_name) >= 1
                await until(lambda: committer.stats().retries >= 1, "the commit retried")
            finally:
                await blocker.close()
            await bounded(waiting, "the retried submission")
            assert committer.stats().retries >= 1
        await first.commit(epoch, START_BASE, [changed(2, TaskStatus.FAILED)], [])
        assert await first.prune(0) >= 1
        # The leader's lock session dies: the other takes over and recovers.
        taking = asyncio.ensure_future(second.acquire_leadership())
        await until(lambda: standby_polling(pg_url), "the standby polling for the lock")
        assert await terminate_backends(pg_url, f"{first.config.application_name} leader") == 1
        await bounded(taking, "the standby's takeover")
        await bounded(first.leadership_lost(), "the leader stepping down")
        await admin_execute(pg_url, f"UPDATE \"{schema}\".cronoq_tasks SET pool = '' WHERE id = 3")
        await second.recover(START_BASE)
        async with GroupCommitter(second, second.epoch or 0, START_BASE):
            text = generate_latest(REGISTRY).decode()

    labels_of: dict[str, set[str]] = {}
    for name, labels in _SAMPLE.findall(text):
        labels_of.setdefault(name, set()).update(_LABEL.findall(labels or ""))
    queries = panel_queries()
    assert len(queries) >= 12
    for title, expr in queries:
        # Metric names: what is left once label matchers and groupings are taken out.
        names = _METRIC.findall(_GROUPED.sub("", _MATCHERS.sub("", expr)))
        assert names, (title, expr)
        for name in names:
            assert name in labels_of, (title, name, sorted(n for n in labels_of if "cronoq" in n))
        grouped = [g.strip() for group in _GROUPED.findall(expr) for g in group.split(",")]
        matched = [m for group in _MATCHERS.findall(expr) for m in _MATCHED.findall(group)]
        for label in filter(None, grouped + matched):
            assert label == "le" or any(label in labels_of[n] for n in names), (title, label)
