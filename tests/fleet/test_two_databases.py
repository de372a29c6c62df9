"""Clusters placed in two databases, each its own PostgreSQL server (a second embedded
server for this module): one process leading both, one server stopped and started again,
and ``host move`` from one to the other, whole and interrupted."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
from click.testing import Result
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import (
    ClusterRef,
    FencedError,
    MultiDatabaseHost,
    StoreError,
    UnavailableError,
)
from cronoq_store._cli import database
from cronoq_store._cli.exits import ExitCode
from cronoq_store._domain import TimeBase, task_id
from cronoq_store._host import move as moving
from cronoq_store._host.host import HostedStore

from ..pgharness import EmbeddedServer, admin_execute, asyncpg_dsn
from ..support import full, run, unused_port
from ..test_cli_fleet import no_password
from ..waits import until
from .conftest import Fleet
from .hosts import Served, commit_one, config, serving


@pytest.fixture(scope="module")
def west_server() -> Iterator[EmbeddedServer]:
    server = EmbeddedServer()
    yield server
    server.close()


@pytest.fixture
async def west(fleet: Fleet, west_server: EmbeddedServer) -> AsyncIterator[Fleet]:
    """``fleet``'s control schema, group and names in the second server."""
    made = Fleet(west_server.url, fleet.control, fleet.group, fleet.prefix)
    yield made
    rows = await admin_execute(
        made.url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"%{fleet.group[2:]}%"
    )
    for row in rows:
        await admin_execute(made.url, f'DROP SCHEMA IF EXISTS "{row["nspname"]}" CASCADE')


class Led:
    """What the application's ``lead`` saw: each cluster gained, by where it lives."""

    def __init__(self) -> None:
        self.gained: list[ClusterRef] = []

    async def lead(self, ref: ClusterRef, store: HostedStore) -> None:
        self.gained.append(ref)
        await store.leadership_lost()


async def test_one_process_leads_two_databases_and_outlives_one_stopped(
    fleet: Fleet, west: Fleet, west_server: EmbeddedServer
) -> None:
    a, b, c = fleet.clusters(3)
    # A third database that never answers: the others are led all the same.
    north = fleet.url.set(port=unused_port())
    placed = {"east": fleet.url, "west": west.url, "north": north}
    host = await MultiDatabaseHost.connect(placed, config(fleet, "placed"))
    led = Led()
    task = None
    try:
        await host.enroll([a, b], "east")
        await host.enroll(c, "west")
        with pytest.raises(StoreError, match="in database 'east' already"):
            await host.enroll(a, "west")
        await host.enroll(a, "west", allow_duplicate_names=True)
        serving = [ClusterRef("east", a), ClusterRef("east", b)]
        serving += [ClusterRef("west", a), ClusterRef("west", c)]
        task = asyncio.ensure_future(host.serve(led.lead))
        await until(lambda: sorted(host.led()) == serving, "both databases' clusters led")
        # A cluster is in led() once claimed, and its lead task starts a moment later.
        await until(lambda: sorted(led.gained) == serving, "lead called for each, with its ref")
        assert host.host("north") is None
        assert host.process_ids["north"] is None
        before = dict(host.led())
        west_server.stop()
        await until(
            lambda: not any(ref.database == "west" for ref in host.led()),
            "the stopped server's clusters stepped down",
        )
        for n, ref in enumerate(serving[:2]):
            assert host.led()[ref] is before[ref]
            await commit_one(before[ref], n)
        west_server.start()
        await until(lambda: sorted(host.led()) == serving, "the restarted server's clusters led")
        again = host.led()[ClusterRef("west", c)]
        assert again is not before[ClusterRef("west", c)]
        await commit_one(again, 7)
    finally:
        await host.close()
        if task is not None:
            await asyncio.wait({task})


async def test_a_database_that_never_answers_holds_up_neither_connect_enroll_nor_close(
    fleet: Fleet, silent_server: int
) -> None:
    """A server that accepts and never answers holds a dial for the pool's connect bound
    (60 s): the host's connect, the name check of an enrolment elsewhere and its close each
    wait ``session_timeout`` (2 s here) at most, and the other database is led meanwhile."""
    (schema,) = fleet.clusters(1)
    placed = {"east": fleet.url, "silent": fleet.url.set(host="127.0.0.1", port=silent_server)}
    clock = asyncio.get_running_loop().time
    started = clock()
    host = await MultiDatabaseHost.connect(placed, config(fleet, "silent"))
    led = Led()
    task = None
    try:
        assert host.host("east") is not None
        assert host.host("silent") is None
        await host.enroll(schema, "east")
        task = asyncio.ensure_future(host.serve(led.lead))
        await until(lambda: led.gained == [ClusterRef("east", schema)], "the cluster led")
    finally:
        closing = clock()
        await host.close()
        if task is not None:
            await asyncio.wait({task})
    # Bounds far from 60 s and far above 2 s, for a loaded machine.
    assert closing - started < 30
    assert clock() - closing < 20


async def test_an_enrolment_in_a_database_that_never_answers_names_it(
    fleet: Fleet, silent_server: int
) -> None:
    (schema,) = fleet.clusters(1)
    silent = fleet.url.set(host="127.0.0.1", port=silent_server)
    silent = silent.update_query_dict({"connect_timeout": "2"})
    async with await MultiDatabaseHost.connect({"silent": silent}, config(fleet, "silent")) as host:
        with pytest.raises(UnavailableError, match="database 'silent' of this host has not"):
            await host.enroll(schema, "silent")


@asynccontextmanager
async def two_hosts(
    fleet: Fleet, west: Fleet, schemas: list[str]
) -> AsyncIterator[tuple[Served, Served]]:
    """A host in each database, the east one leading ``schemas``."""
    async with (
        serving(fleet.url, config(fleet, "east"), schemas) as east,
        serving(west.url, config(fleet, "west")) as west_host,
    ):
        await until(lambda: len(east.host.led()) == len(schemas), "the east host to lead")
        yield east, west_host


async def move_cli(fleet: Fleet, west: Fleet, schema: str, *extra: str) -> tuple[int, str]:
    result = await run(
        "host", "move", schema, "--from", full(fleet.url), "--to", full(west.url),
        "--group", fleet.group, "--control-schema", fleet.control, *extra,
    )  # fmt: skip
    no_password(fleet.url, result.stdout, result.stderr)
    no_password(west.url, result.stdout, result.stderr)
    return result.exit_code, result.stdout + result.stderr


async def test_a_move_keeps_every_acknowledged_commit_and_fences_the_old_owner(
    fleet: Fleet, west: Fleet
) -> None:
    (schema,) = fleet.clusters(1)
    async with two_hosts(fleet, west, [schema]) as (east, west_host):
        old = east.host.led()[schema]
        epoch = old.epoch
        assert epoch is not None
        for n in range(3):
            await commit_one(old, n)
        # The leader row's high-water mark past every stored id and past the ids of the
        # epoch the target's first claim takes (as after the epoch wrapped): only the
        # mark keeps the target from issuing ids below it.
        high = task_id(epoch + 3, 7)
        await admin_execute(fleet.url, f'UPDATE "{schema}".cronoq_leader SET max_id = {high}')
        code, said = await move_cli(fleet, west, schema)
        assert code == 0, said
        assert await fleet.stored_epoch(schema) > epoch  # the server fences the old owner
        with pytest.raises(FencedError):
            await commit_one(old, 3, epoch)
        await until(leading(west_host, schema), "the west host to lead the moved one")
        new = west_host.host.led()[schema]
        assert new.epoch is not None
        assert new.epoch > epoch
        recovered = await new.recover(TimeBase.now())
        assert sorted(t.id for t in recovered.tasks) == [task_id(epoch, n) for n in range(3)]
        assert recovered.next_id > high
        await commit_one(new, 4)
        assert schema not in east.host.led()
        assert await state_in_control(fleet, schema) == "moved"
        code, said = await move_cli(fleet, west, schema)
        assert code == 0, said
        assert "already moved to" in said
        # A process with the old placement enrolls it in the source again: refused, so the
        # tombstone is never led beside the moved cluster, and told where it went.
        with pytest.raises(StoreError, match=f"it was moved to postgresql://{west.url.username}:"):
            await east.host.enroll(schema)
        assert await state_in_control(fleet, schema) == "moved"
        shown = await cli(fleet, "status", schema=schema)
        assert f"hosted (moved by `cronoq-store host move`, group {fleet.group})" in shown.output
        health = await cli(fleet, "health", schema=schema)
        assert health.exit_code == ExitCode.NO_LEADER
        for said in (shown.output, health.output):
            assert "a tombstone `cronoq-store host move` left (moved to " in said
            assert "(cronoq-store host move:" not in said  # the mark is no group's name
        listed = await run(
            "--url", full(fleet.url), "host", "list", "--control-schema", fleet.control
        )
        no_password(west.url, listed.stdout)
        assert f"moved to postgresql://{west.url.username}:***@" in listed.stdout
        stored = await admin_execute(
            fleet.url, f'SELECT count(*) AS n FROM "{schema}".cronoq_tasks'
        )
        assert stored[0]["n"] == 3
        # The tombstone's row may go (a move back needs the name free); its mark stays.
        assert (await cli(fleet, "host", "remove", schema, "--group", fleet.group)).exit_code == 0
        assert await state_in_control(fleet, schema) is None
        assert await leader_mark(fleet, schema) == moving.MOVED_MARK


# Run in a process of its own, as the global providers can be set once per process: a
# cluster of one name in each database, each committing once; then the reader's points of
# cronoq.commit.mutations, as JSON.
LABELLED = """
import asyncio, json, os, sys
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from cronoq_store import MultiDatabaseHost, PgStoreConfig, Submitted, TaskSpec, TimeBase
from cronoq_store._domain import task_id
from cronoq_store._host.host import PgHostConfig

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
control, group, schema = sys.argv[1:]

async def main():
    store = PgStoreConfig(lock_poll=0.1, keepalive=0.3, session_timeout=2.0, commit_timeout=10.0)
    config = PgHostConfig(
        store=store, control_schema=control, group=group, max_connections=3, join_settle=0.3
    )
    committed = []
    both = asyncio.Event()

    async def lead(ref, store):
        base = TimeBase.now()
        task = Submitted(task_id(store.epoch, 1), 1, base.engine_ns, TaskSpec(b"p"))
        await store.commit(store.epoch, base, [task], [])
        committed.append(ref.database)
        if len(committed) == 2:
            both.set()
        await store.leadership_lost()

    placed = {"east": os.environ["EAST"], "west": os.environ["WEST"]}
    host = await MultiDatabaseHost.connect(placed, config)
    try:
        await host.enroll(schema, "east")
        await host.enroll(schema, "west", allow_duplicate_names=True)
        serving = asyncio.ensure_future(host.serve(lead))
        await asyncio.wait_for(both.wait(), 60)
    finally:
        await host.close()
    await serving
    found = []
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "cronoq.commit.mutations":
                    found += [[dict(p.attributes), p.count] for p in metric.data.data_points]
    print(json.dumps(found))

asyncio.run(main())
"""


async def test_each_databases_host_records_under_its_label(fleet: Fleet, west: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    env = {**os.environ, "EAST": full(fleet.url), "WEST": full(west.url)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LABELLED, fleet.control, fleet.group, schema,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    by_series = {
        (attrs["cronoq.host.group"], attrs.get("cronoq.host.database")): count
        for attrs, count in json.loads(out)
    }
    assert by_series == {(fleet.group, "east"): 1, (fleet.group, "west"): 1}


class Interrupted(Exception):
    """Raised by a move's report of one step: the move stops right after that step."""


async def interrupted_move(fleet: Fleet, to: URL, schema: str, step: str) -> None:
    """Run ``host move`` of ``schema`` from ``fleet``'s database to ``to`` in this process,
    and interrupt it once it says it did ``step`` (its line starts so)."""

    def stop(line: str) -> None:
        if line.startswith(step):
            raise Interrupted(line)

    source, target = _engine(fleet.url), _engine(to)
    try:
        with pytest.raises(Interrupted):
            await moving.move(
                source, target, schema, group=fleet.group, control_schema=fleet.control,
                said=stop,
            )  # fmt: skip
    finally:
        await source.dispose()
        await target.dispose()


async def test_an_interrupted_move_goes_on_when_run_again(fleet: Fleet, west: Fleet) -> None:
    steps = ("frozen", "copied", "enrolled")
    schemas = fleet.clusters(len(steps))
    async with two_hosts(fleet, west, schemas) as (east, west_host):
        for schema, step in zip(schemas, steps, strict=True):
            await commit_one(east.host.led()[schema], 1)
            await interrupted_move(fleet, west.url, schema, step)
            assert await state_in_control(fleet, schema) == "moving"
            mover = await asyncpg.connect(asyncpg_dsn(fleet.url))
            try:
                key = f"{fleet.group}/{schema}"
                held = "SELECT pg_try_advisory_lock($1, hashtext($2))"
                assert await mover.fetchval(held, moving.LOCK_NS_MOVE, key)  # it was freed
                code, said = await move_cli(fleet, west, schema)
                assert code == 1
                assert "another move of schema" in said
            finally:
                await mover.close()
            if step == "frozen":
                # Removing it now would leave it frozen with no row to resume the move from.
                removing = await cli(fleet, "host", "remove", schema, "--group", fleet.group)
                assert removing.exit_code == ExitCode.FAILED
                assert "is being moved (moving to postgresql://" in removing.output
                assert await state_in_control(fleet, schema) == "moving"
                shown = await cli(fleet, "status", schema=schema)
                assert "frozen by `cronoq-store host move` (moving to " in shown.output
                # Another cluster of that name made and enrolled in the target meanwhile: not
                # taken for this move's copy, the source stays frozen.
                await west_host.host.enroll(schema)
                code, said = await move_cli(fleet, west, schema)
                assert code == 1
                assert "not this move's copy" in said
                assert await state_in_control(fleet, schema) == "moving"
                await west_host.host.remove(schema)
                await admin_execute(west.url, f'DROP SCHEMA "{schema}" CASCADE')
            code, said = await move_cli(fleet, west, schema)
            assert code == 0, said
            assert schema not in east.host.led()
            await until(leading(west_host, schema), f"{schema} led in the west")
            tasks = await admin_execute(
                west.url, f'SELECT count(*) AS n FROM "{schema}".cronoq_tasks'
            )
            assert tasks[0]["n"] == 1
        # A frozen cluster was never claimed again in the source meanwhile.
        assert sorted(s for s, _ in east.gained) == sorted(schemas)


def leading(served: Served, schema: str) -> Callable[[], bool]:
    return lambda: schema in served.host.led()


def _engine(url: URL) -> AsyncEngine:
    """An engine as ``host move``'s: the library's move is called with two of them."""
    return database.engine(full(url))


async def state_in_control(fleet: Fleet, schema: str) -> str | None:
    rows = await admin_execute(
        fleet.url, f'SELECT state FROM "{fleet.control}".clusters WHERE schema_name = $1', schema
    )
    return str(rows[0]["state"]) if rows else None


async def leader_mark(fleet: Fleet, schema: str) -> str:
    rows = await admin_execute(fleet.url, f'SELECT host_group FROM "{schema}".cronoq_leader')
    return str(rows[0]["host_group"])


async def cli(fleet: Fleet, *args: str, schema: str | None = None) -> Result:
    """The CLI on ``fleet``'s (the source's) database and control schema."""
    chosen = () if schema is None else ("--schema", schema)
    result = await run("--url", full(fleet.url), *chosen, *args, "--control-schema", fleet.control)
    no_password(fleet.url, result.stdout, result.stderr)
    return result
