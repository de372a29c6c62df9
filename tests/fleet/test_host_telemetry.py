"""Telemetry of a host leading many clusters, read back through the real OpenTelemetry SDK
(its in-memory reader, set as the global provider in a process of its own, the one a host
records to): with the default settings every hosted cluster records under its host group,
so the exported label values stay as few as the groups whatever the clusters; a cluster
whose ``lead`` passes its store to ``telemetry.instrument`` gets series of its own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ..pgharness import ServerUnderTest, admin_execute
from ..support import full

#: Clusters the host leads: enough that a label per cluster would show, few enough to be quick.
CLUSTERS = 20

# Run in a process of its own: the global providers can be set once per process. Each
# cluster's lead commits one task, then waits for phase 2 ("go" on stdin); in phase 2 the
# watched cluster's lead instruments its store first, and every lead commits once more.
# The reader's points are printed after each phase, as JSON lines.
HOSTED = """
import asyncio, json, os, sys, time
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from cronoq_store import PgStoreConfig, Submitted, TaskId, TaskSpec, TimeBase
from cronoq_store._domain import task_id
from cronoq_store._host.host import PgHost, PgHostConfig
from cronoq_store.telemetry import instrument

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
control, group, watched, *schemas = sys.argv[1:]

def points():
    found = []
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for p in metric.data.data_points:
                    value = p.count if hasattr(p, "count") else p.value
                    found.append([metric.name, dict(p.attributes), value])
    print(json.dumps(found), flush=True)

async def main():
    store = PgStoreConfig(lock_poll=0.1, keepalive=0.3, session_timeout=2.0, commit_timeout=10.0)
    config = PgHostConfig(
        store=store, control_schema=control, group=group, max_connections=3, join_settle=0.3
    )
    committed = [0, 0]
    phase_two = asyncio.Event()

    async def commit(store, n):
        base = TimeBase(engine_ns=0, unix_ns=time.time_ns())
        task = Submitted(task_id(store.epoch, n), n, 0, TaskSpec(b"p"))
        await store.commit(store.epoch, base, [task], [])
        committed[n - 1] += 1

    async def lead(store):
        await commit(store, 1)
        await phase_two.wait()
        if store.config.schema == watched:
            instrument(store)
        await commit(store, 2)
        await store.leadership_lost()

    host = await PgHost.connect(os.environ["CRONOQ_TEST_URL"], config)
    try:
        await host.enroll(schemas)
        serving = asyncio.ensure_future(host.serve(lead))
        while committed[0] < len(schemas):
            await asyncio.sleep(0.05)
        points()
        await asyncio.to_thread(sys.stdin.readline)
        phase_two.set()
        while committed[1] < len(schemas):
            await asyncio.sleep(0.05)
        points()
    finally:
        await host.close()
    await serving

asyncio.run(main())
"""


Point = tuple[str, dict[str, Any], Any]


@pytest.fixture(scope="module")
def phases(pg_server: ServerUnderTest) -> Iterator[tuple[list[Point], list[Point], dict[str, str]]]:
    """The points a host of :data:`CLUSTERS` clusters exported after each phase, and the
    run's names (``group``, ``watched``, ``prefix``); its schemas dropped afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = {"control": f"h_{tag}", "prefix": f"f_{tag}"}
    schemas = [f"{names['prefix']}_{i:03d}" for i in range(CLUSTERS)]
    # The group is named like the watched cluster: its figures must stay apart all the same.
    names["watched"] = names["group"] = schemas[7]
    env = {**os.environ, "CRONOQ_TEST_URL": full(pg_server.url)}
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOSTED,
            names["control"],
            names["group"],
            names["watched"],
            *schemas,
        ],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        first = child.stdout.readline()
        child.stdin.write("go\n")
        child.stdin.flush()
        second = child.stdout.readline()
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        yield json.loads(first), json.loads(second), names
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        asyncio.run(_drop(pg_server, tag))


async def _drop(pg_server: ServerUnderTest, tag: str) -> None:
    rows = await admin_execute(
        pg_server.url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"%{tag}%"
    )
    for row in rows:
        await admin_execute(pg_server.url, f'DROP SCHEMA IF EXISTS "{row["nspname"]}" CASCADE')


def series(points: list[Point], name: str) -> dict[tuple[str | None, str | None], Any]:
    """``name``'s points by their ``db.namespace`` and ``cronoq.host.group``."""
    found = [
        ((attrs.get("db.namespace"), attrs.get("cronoq.host.group")), value)
        for metric, attrs, value in points
        if metric == name
    ]
    assert len(found) == len(dict(found)), found
    return dict(found)


def test_by_default_every_hosted_cluster_records_under_its_group(
    phases: tuple[list[Point], list[Point], dict[str, str]],
) -> None:
    first, _, names = phases
    assert series(first, "cronoq.commit.mutations") == {(None, names["group"]): CLUSTERS}
    assert series(first, "cronoq.leadership.acquisitions") == {}  # the host claims, not a store
    assert not [attrs for _, attrs, _ in first if "db.namespace" in attrs]  # no cluster's label
    values = {str(v) for _, attrs, _ in first for v in attrs.values()}
    assert values <= {"postgresql", names["group"], "ok", "insert"}


def test_a_cluster_instrumented_in_its_lead_records_under_its_own_schema(
    phases: tuple[list[Point], list[Point], dict[str, str]],
) -> None:
    _, second, names = phases
    group, watched = names["group"], names["watched"]
    # Its second commit in a series of its own; the others' in the group's, although the
    # group bears its name.
    apart = {(None, group): 2 * CLUSTERS - 1, (watched, None): 1}
    assert series(second, "cronoq.commit.mutations") == apart
    assert series(second, "cronoq.commit.duration") == apart
    assert series(second, "cronoq.leadership.is_leader") == {(watched, None): 1}
    (epoch,) = series(second, "cronoq.leadership.epoch").values()
    assert epoch >= 1
    schemas = {attrs.get("db.namespace") for _, attrs, _ in second}
    assert schemas == {None, watched}
