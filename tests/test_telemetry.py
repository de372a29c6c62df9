"""OpenTelemetry metrics and spans, read back through the real SDK's in-memory reader and
exporter, from a store on the real server; providers are per test, never global."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import asyncpg
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.engine import URL

from cronoq_store import (
    FencedError,
    GroupCommitter,
    IdCollisionError,
    KeyTakenError,
    PgStore,
    StoreError,
    TaskId,
    TaskStatus,
)
from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store.telemetry import DISABLED, instrument

from .pgharness import admin_execute, asyncpg_dsn, terminate_backends
from .support import START_BASE, changed, ha_config, lock_waited, submitted
from .waits import bounded, holds_for

PAYLOAD = b"secret-payload-bytes"
KEY = "secret-task-key"
MESSAGE = "secret message"


@dataclass
class Otel:
    """One test's providers, and what they received."""

    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    meters: MeterProvider
    tracers: TracerProvider

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found: list[Any] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def value(self, name: str, attrs: dict[str, str] | None = None) -> Any:
        """The one point of ``name`` whose attributes include ``attrs``: its value, or
        its count and sum for a histogram."""
        wanted = (attrs or {}).items()
        matching = [
            p for p in self.points(name) if all(p.attributes.get(k) == v for k, v in wanted)
        ]
        assert len(matching) == 1, (name, attrs, [p.attributes for p in self.points(name)])
        point = matching[0]
        return (point.count, point.sum) if hasattr(point, "count") else point.value

    def finished(self) -> tuple[ReadableSpan, ...]:
        return self.spans.get_finished_spans()

    def every_attribute_value(self) -> list[str]:
        values = [str(v) for span in self.finished() for v in (span.attributes or {}).values()]
        for span in self.finished():
            values.extend(str(v) for e in span.events for v in (e.attributes or {}).values())
            values.append(str(span.status.description))
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        values.extend(str(v) for v in (point.attributes or {}).values())
        return values


def make_otel() -> Otel:
    reader = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(spans))
    return Otel(reader, spans, MeterProvider(metric_readers=[reader]), tracers)


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = make_otel()
    yield made
    made.meters.shutdown()
    made.tracers.shutdown()


@pytest.fixture
async def store(pg_url: URL, schema: str, otel: Otel) -> AsyncIterator[PgStore]:
    async with await PgStore.connect(pg_url, ha_config(schema)) as s:
        instrument(s, meter_provider=otel.meters, tracer_provider=otel.tracers)
        yield s


async def test_without_a_configured_provider_the_store_records_nothing(
    pg_url: URL, schema: str
) -> None:
    async with await PgStore.connect(pg_url, ha_config(schema)) as s:
        assert s.telemetry is DISABLED
        assert not s.telemetry.enabled
        await s.commit(0, START_BASE, [submitted(1, PAYLOAD)], [])  # and commits as ever


# Run in a process of its own: the global providers can be set once per process.
GLOBAL_PROVIDERS = """
import asyncio, os, sys, time
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from cronoq_store import PgStore, PgStoreConfig, Submitted, TaskId, TaskSpec, TimeBase

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
trace.set_tracer_provider(TracerProvider())

async def main():
    config = PgStoreConfig(schema=sys.argv[1])
    async with await PgStore.connect(os.environ["CRONOQ_TEST_URL"], config) as store:
        assert store.telemetry.enabled
        task = Submitted(TaskId(1), seq=1, arrival=1, spec=TaskSpec(b"p"))
        await store.commit(0, TimeBase(engine_ns=0, unix_ns=time.time_ns()), [task], [])
    names = [m.name for r in reader.get_metrics_data().resource_metrics
             for s in r.scope_metrics for m in s.metrics]
    print(sorted(set(names)))

asyncio.run(main())
"""


async def test_a_store_opened_after_the_global_providers_are_set_records_to_them(
    pg_url: URL, schema: str
) -> None:
    env = {**os.environ, "CRONOQ_TEST_URL": pg_url.render_as_string(hide_password=False)}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        GLOBAL_PROVIDERS,
        schema,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, err.decode()
    assert "cronoq.commit.duration" in out.decode()
    assert "cronoq.commit.mutations" in out.decode()


async def test_a_commit_records_its_mutations_bytes_write_path_and_span(
    store: PgStore, otel: Otel, schema: str
) -> None:
    await store.commit(
        0, START_BASE, [submitted(1, PAYLOAD), submitted(2, PAYLOAD), submitted(3, PAYLOAD)], []
    )
    await store.commit(
        0,
        START_BASE,
        [
            changed(1, TaskStatus.RUNNING, 100, message=MESSAGE),
            changed(2, TaskStatus.RUNNING, 100, message=MESSAGE),
        ],
        [],
    )
    await store.commit(
        0,
        START_BASE,
        [submitted(4, PAYLOAD), changed(3, TaskStatus.RUNNING, 100, message=MESSAGE)],
        [],
    )
    await store.commit(
        0, START_BASE, [submitted(i, PAYLOAD) for i in range(10, 10 + COPY_MIN_ROWS)], []
    )

    for path in ("insert", "update", "transaction", "copy"):
        count, seconds = otel.value(
            "cronoq.commit.duration",
            {"cronoq.commit.outcome": "ok", "cronoq.commit.write_path": path},
        )
        assert (count, seconds > 0) == (1, True), path
    assert otel.value("cronoq.commit.mutations") == (4, 3 + 2 + 2 + COPY_MIN_ROWS)
    count, size = otel.value("cronoq.commit.size")
    assert count == 4
    assert size > COPY_MIN_ROWS * len(PAYLOAD)

    (point,) = otel.points("cronoq.commit.mutations")
    assert dict(point.attributes) == {
        "db.system.name": "postgresql",
        "db.system": "postgresql",
        "db.namespace": schema,
    }
    spans = [s for s in otel.finished() if s.name == f"commit {schema}"]
    assert len(spans) == 4
    assert spans[0].attributes is not None
    assert spans[0].attributes["db.operation.name"] == "commit"
    assert spans[0].attributes["db.namespace"] == schema


async def test_the_meter_and_the_tracer_carry_the_package_version(
    store: PgStore, otel: Otel
) -> None:
    await store.commit(0, START_BASE, [submitted(1, PAYLOAD)], [])
    version = metadata.version("cronoq-store")
    data = otel.reader.get_metrics_data()
    assert data is not None
    meters = {
        (s.scope.name, s.scope.version) for r in data.resource_metrics for s in r.scope_metrics
    }
    assert meters == {("cronoq_store", version)}
    tracers = {
        (span.instrumentation_scope.name, span.instrumentation_scope.version)
        for span in otel.finished()
        if span.instrumentation_scope is not None
    }
    assert tracers == {("cronoq_store", version)}


async def test_a_fenced_commit_records_outcome_fenced_and_a_step_down(
    store: PgStore, otel: Otel, pg_url: URL, schema: str
) -> None:
    epoch = await store.acquire_leadership()
    await store.commit(epoch, START_BASE, [submitted(1, PAYLOAD)], [])
    await admin_execute(pg_url, f'UPDATE "{schema}".cronoq_leader SET epoch = epoch + 1')
    with pytest.raises(FencedError):
        await store.commit(
            epoch, START_BASE, [changed(1, TaskStatus.RUNNING, 100, message=MESSAGE)], []
        )

    count, _ = otel.value("cronoq.commit.duration", {"cronoq.commit.outcome": "fenced"})
    assert count == 1
    assert otel.value("cronoq.commit.duration", {"cronoq.commit.outcome": "ok"})[0] == 1
    assert otel.value("cronoq.leadership.step_downs", {"cronoq.step_down.reason": "fenced"}) == 1
    assert otel.value("cronoq.leadership.acquisitions") == 1
    assert otel.value("cronoq.leadership.is_leader") == 0
    assert otel.points("cronoq.leadership.epoch") == []  # no epoch while not leading
    (failed,) = [s for s in otel.finished() if s.status.status_code.name == "ERROR"]
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == "FencedError"


async def test_a_failed_and_a_transient_commit_are_told_apart(
    store: PgStore, otel: Otel, pg_url: URL, schema: str
) -> None:
    await store.commit(0, START_BASE, [submitted(1, PAYLOAD)], [])
    with pytest.raises(IdCollisionError):  # id 1 is another task's
        await store.commit(0, START_BASE, [submitted(1, b"another")], [])
    assert otel.value("cronoq.commit.duration", {"cronoq.commit.outcome": "failed"})[0] == 1
    # A commit whose backend is ended while it waits on a lock is transient.
    blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await blocker.execute("BEGIN")
        await blocker.execute(f'LOCK TABLE "{schema}".cronoq_leader IN ACCESS EXCLUSIVE MODE')
        commit = asyncio.ensure_future(store.commit(0, START_BASE, [submitted(3, PAYLOAD)], []))
        await lock_waited(pg_url, store.config.application_name)
        assert await terminate_backends(pg_url, store.config.application_name) >= 1
        with pytest.raises(StoreError) as caught:
            await commit
        assert caught.value.is_transient
    finally:
        await blocker.close()
    assert otel.value("cronoq.commit.duration", {"cronoq.commit.outcome": "transient"})[0] == 1


async def test_a_takeover_moves_the_epoch_gauge_and_counts_the_step_down(
    pg_url: URL, schema: str
) -> None:
    first, second = make_otel(), make_otel()
    async with (
        await PgStore.connect(pg_url, ha_config(schema)) as leader,
        await PgStore.connect(
            pg_url, dataclasses.replace(ha_config(schema), application_name="standby")
        ) as standby,
    ):
        instrument(leader, meter_provider=first.meters, tracer_provider=first.tracers)
        instrument(standby, meter_provider=second.meters, tracer_provider=second.tracers)
        epoch = await leader.acquire_leadership()
        assert first.value("cronoq.leadership.epoch") == epoch
        assert first.value("cronoq.leadership.is_leader") == 1
        taking = asyncio.ensure_future(standby.acquire_leadership())
        await holds_for(
            lambda: second.value("cronoq.leadership.is_leader") == 0 and not taking.done(),
            "the standby not leading",
            0.3,
        )
        # The leader's lock session dies: the standby takes over with the next epoch.
        assert await terminate_backends(pg_url, "cronoq-store leader") == 1
        new_epoch = await bounded(taking, "the standby's takeover")
        assert new_epoch == epoch + 1
        assert second.value("cronoq.leadership.epoch") == new_epoch
        assert second.value("cronoq.leadership.is_leader") == 1
        count, waited = second.value("cronoq.leadership.acquisition.duration")
        assert count == 1
        assert waited >= 0.3
        await bounded(leader.leadership_lost(), "the leader stepping down")
        assert first.value("cronoq.leadership.is_leader") == 0
        assert (
            first.value("cronoq.leadership.step_downs", {"cronoq.step_down.reason": "session_lost"})
            == 1
        )
        assert [s.name for s in second.finished()] == [f"acquire {schema}"]
    for made in (first, second):
        made.meters.shutdown()
        made.tracers.shutdown()


async def test_two_stores_of_one_schema_on_one_provider_report_one_leader(
    pg_url: URL, schema: str, otel: Otel
) -> None:
    """The leader's gauges, whichever store was watched last: the SDK keeps one observation
    per attribute set, and the standby's 0 must not hide the leader's 1."""
    async with (
        await PgStore.connect(pg_url, ha_config(schema)) as leader,
        await PgStore.connect(pg_url, ha_config(schema, "standby")) as standby,
    ):
        instrument(leader, meter_provider=otel.meters)
        instrument(standby, meter_provider=otel.meters)
        epoch = await leader.acquire_leadership()
        assert otel.value("cronoq.leadership.is_leader") == 1
        assert otel.value("cronoq.leadership.epoch") == epoch
        assert not standby.is_leader


async def test_recovery_counts_rows_loaded_and_a_quarantined_row(
    store: PgStore, otel: Otel, pg_url: URL, schema: str
) -> None:
    await store.commit(
        0, START_BASE, [submitted(1, PAYLOAD), submitted(2, PAYLOAD), submitted(3, PAYLOAD)], []
    )
    await admin_execute(pg_url, f"UPDATE \"{schema}\".cronoq_tasks SET pool = '' WHERE id = 2")
    recovered = await store.recover(START_BASE)
    assert [t.id for t in recovered.tasks] == [1, 3]

    assert otel.value("cronoq.recovery.quarantined") == 1
    assert otel.value("cronoq.recovery.rows", {"cronoq.row.kind": "live"}) == 2
    assert otel.value("cronoq.recovery.rows", {"cronoq.row.kind": "finished"}) == 1
    assert otel.value("cronoq.recovery.rows", {"cronoq.row.kind": "recurring"}) == 0
    assert otel.value("cronoq.recovery.duration")[0] == 1
    # Quarantined once: the next recovery finds an ordinary failed task.
    await store.recover(START_BASE)
    assert otel.value("cronoq.recovery.quarantined") == 1
    assert [s.name for s in otel.finished()].count(f"recover {schema}") == 2


async def test_prune_records_rows_and_duration(store: PgStore, otel: Otel, schema: str) -> None:
    await store.commit(0, START_BASE, [submitted(i, PAYLOAD) for i in range(5)], [])
    await store.commit(
        0, START_BASE, [changed(i, TaskStatus.FAILED, 100, message=MESSAGE) for i in range(3)], []
    )
    assert await store.prune(0) == 3
    assert otel.value("cronoq.prune.rows") == 3
    assert otel.value("cronoq.prune.duration")[0] == 1
    assert f"prune {schema}" in [s.name for s in otel.finished()]


async def test_the_group_committer_records_batches_acks_splits_and_queue_depth(
    store: PgStore, otel: Otel
) -> None:
    async with GroupCommitter(store, 0, START_BASE) as committer:
        assert otel.value("cronoq.committer.queue.depth") == 0
        await asyncio.gather(*(committer.submit([submitted(i, PAYLOAD)]) for i in range(5)))
        # A key held by a live task fails its submission alone: the batch is split.
        results = await asyncio.gather(
            committer.submit([submitted(10, PAYLOAD)]),
            committer.submit([submitted(1, b"another")]),
            committer.submit([submitted(12, PAYLOAD)]),
            return_exceptions=True,
        )
        assert [isinstance(r, StoreError) for r in results] == [False, True, False]
    _count, mutations = otel.value("cronoq.committer.batch.size")
    assert mutations == 7  # every acknowledged mutation, once
    assert otel.value("cronoq.committer.ack.duration")[0] == 7
    assert otel.value("cronoq.committer.splits") >= 1
    assert otel.points("cronoq.committer.queue.depth") == []  # closed: no longer reported


async def test_no_attribute_holds_the_password_a_payload_a_key_or_a_message(
    store: PgStore, otel: Otel, pg_url: URL
) -> None:
    assert pg_url.password
    epoch = await store.acquire_leadership()
    await store.commit(epoch, START_BASE, [submitted(1, PAYLOAD, key=KEY)], [(TaskId(1), PAYLOAD)])
    with pytest.raises(KeyTakenError):  # the key is live
        await store.commit(epoch, START_BASE, [submitted(2, PAYLOAD, key=KEY)], [])
    await store.commit(
        epoch,
        START_BASE,
        [changed(1, TaskStatus.SUCCEEDED, 100, message=MESSAGE)],
        [(TaskId(1), PAYLOAD)],
    )
    with pytest.raises(StoreError):
        await store.commit(epoch, START_BASE, [submitted(1, b"another", key=KEY)], [])
    await store.recover(START_BASE)
    await store.prune(0)
    await store.release_leadership()
    values = otel.every_attribute_value()
    assert values
    for secret in (pg_url.password, PAYLOAD.decode(), KEY, MESSAGE, pg_url.host):
        assert not [v for v in values if secret and secret in v], secret
