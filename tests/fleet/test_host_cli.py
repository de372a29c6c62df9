"""``status``, ``health`` and ``host`` on clusters a host group leads, on a real server: the
owner named from the control schema and live only while its process lock is held (exit 6
once it is not), a session on the standalone key named (exit 7), a refused cluster's
reason, enrolment and removal with no process registered, the JSON shapes, names printed
terminal-safe, and never a password."""

from __future__ import annotations

from typing import Any

import asyncpg
from click.testing import Result
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store._cli.exits import ExitCode
from cronoq_store._cli.hosted import CONTROL_SCHEMA_ENV
from cronoq_store._host.control import LOCK_NS_HOST
from cronoq_store._migrations import upgrade
from cronoq_store._statements import LOCK_NS_LEADER
from cronoq_store._urls import async_url

from ..pgharness import admin_execute, asyncpg_dsn
from ..support import full, run
from ..test_cli_fleet import no_password
from ..test_cli_json import document
from ..test_cli_terminal_safe import unsafe_characters
from ..waits import until
from .conftest import Fleet
from .hosts import config, serving


async def migrated(fleet: Fleet, schemas: list[str]) -> None:
    engine = create_async_engine(async_url(fleet.url))
    try:
        for schema in schemas:
            await upgrade(engine, schema)
    finally:
        await engine.dispose()


async def cli(fleet: Fleet, *args: str, schema: str | None = None) -> Result:
    """The CLI on ``fleet``'s database and control schema (``--control-schema`` follows the
    command: every command that reads a hosted cluster takes it)."""
    chosen = () if schema is None else ("--schema", schema)
    result = await run("--url", full(fleet.url), *chosen, *args, "--control-schema", fleet.control)
    no_password(fleet.url, result.stdout, result.stderr)
    return result


def facts(stdout: str) -> dict[str, str]:
    """``status``'s label-and-value lines (piped), continuation lines joined to their label."""
    found: dict[str, str] = {}
    label = ""
    for line in stdout.splitlines():
        key, _, value = line.partition("  ")
        if key.strip():
            label = key.strip()
            found[label] = value.strip()
        elif label:
            found[label] += " | " + value.strip()
    return found


async def process_rows(fleet: Fleet) -> list[Any]:
    return await admin_execute(
        fleet.url,
        f'SELECT process_id FROM "{fleet.control}".processes WHERE host_group = $1',
        fleet.group,
    )


async def test_a_hosted_cluster_names_its_owner_and_exits_6_once_the_host_is_gone(
    fleet: Fleet,
) -> None:
    schemas = fleet.clusters(2)
    one = schemas[0]
    async with serving(fleet.url, config(fleet, "cli-host"), schemas) as served:
        await until(lambda: len(served.host.led()) == 2, "the host to lead both clusters")
        host = served.host
        pid = host.process_id
        assert pid is not None
        epoch = served.host.led()[one].epoch
        (backend,) = await admin_execute(
            fleet.url,
            f'SELECT backend_pid FROM "{fleet.control}".processes WHERE process_id = $1',
            pid,
        )

        healthy = await cli(fleet, "health", schema=one)
        assert healthy.exit_code == ExitCode.OK, healthy.output
        assert f"hosted (group {fleet.group}): host process {pid}, instance {host.instance}" in (
            healthy.stdout
        )
        assert f"epoch {epoch}\n" in healthy.stdout

        doc = document((await cli(fleet, "health", "--json", schema=one)).stdout)
        assert (doc["healthy"], doc["mode"], doc["leader"]) == (True, "hosted", None)
        shown = doc["host"]
        assert (shown["group"], shown["owner"], shown["live"], shown["epoch"]) == (
            fleet.group,
            pid,
            True,
            epoch,
        )
        assert shown["state"] == "active"
        assert shown["standalone_lock_holder"] is None
        process = shown["process"]
        assert (process["instance"], process["backend_pid"], process["live"]) == (
            host.instance,
            backend["backend_pid"],
            True,
        )
        assert process["lock"] == [LOCK_NS_HOST, pid]
        assert process["lock_held_by_pid"] == backend["backend_pid"]
        assert process["application_name"].startswith("cli-host")

        status = await cli(fleet, "status", schema=one)
        assert status.exit_code == ExitCode.OK, status.output
        lines = facts(status.stdout)
        assert lines["mode"] == f"hosted (group {fleet.group}), control schema {fleet.control}"
        assert lines["leader"].startswith(
            f"host process {pid}, instance {host.instance}, backend pid {backend['backend_pid']}"
        )
        assert f"epoch {epoch}" in lines["leader"]
        assert f"its process lock ({LOCK_NS_HOST}, {pid}) is held" in lines["leader"]
        assert lines["standalone lock"].startswith("free (advisory lock")

        status_doc = document((await cli(fleet, "status", "--json", schema=one)).stdout)
        assert status_doc["mode"] == "hosted"
        assert (status_doc["host"]["owner"], status_doc["host"]["live"]) == (pid, True)
        assert status_doc["leadership_history"][0]["leading"] is True

        over = await cli(fleet, "status", "--schemas", f"{fleet.prefix}_*")
        assert over.exit_code == ExitCode.OK, over.output
        for schema in schemas:
            assert f"hosted (group {fleet.group}), leader host process {pid}, " in next(
                line for line in over.stdout.splitlines() if line.startswith(schema)
            )
        probes = await cli(fleet, "health", "--schemas", f"{fleet.prefix}_*", "--json")
        assert probes.exit_code == ExitCode.OK, probes.output
        rows = [document(line) for line in probes.stdout.splitlines()]
        assert [r["host"]["owner"] for r in rows[:-1]] == [pid, pid]

    gone = await cli(fleet, "health", schema=one)
    assert gone.exit_code == ExitCode.NO_LEADER, gone.output
    assert gone.stdout.startswith(
        f"unhealthy: no live host process owns it; last owner process {pid} (instance "
        f"{host.instance}, backend pid {backend['backend_pid']}, "
    )
    assert ", released it 20" in gone.stdout
    after = document((await cli(fleet, "health", "--json", schema=one)).stdout)
    assert (after["host"]["owner"], after["host"]["live"]) == (None, False)
    assert after["host"]["process"]["live"] is False
    over = await cli(fleet, "health", "--schemas", f"{fleet.prefix}_*")
    assert over.exit_code == ExitCode.NO_LEADER
    assert over.stdout.count("no live host process owns it") == 2

    # A process that died owning it (no survivor took it yet): its row still names it, and
    # its free process lock says it is gone.
    await admin_execute(
        fleet.url,
        f'UPDATE "{fleet.control}".clusters SET owner = released_by WHERE schema_name = $1',
        one,
    )
    dead = await cli(fleet, "health", schema=one)
    assert dead.exit_code == ExitCode.NO_LEADER, dead.output
    assert f"last owner process {pid} (instance {host.instance}" in dead.stdout
    assert dead.stdout.endswith(": its process lock is free (the process is gone)\n")
    assert (
        document((await cli(fleet, "status", "--json", schema=one)).stdout)["host"]["owner"] == pid
    )

    # The control schema from the environment, as other options may come; a wrong one is
    # named, and who leads the cluster is unknown there, not "nobody" (exit 1, not 6).
    wrong = await run(
        "--url", full(fleet.url), "--schema", one, "health", env={CONTROL_SCHEMA_ENV: "nowhere"}
    )
    assert wrong.exit_code == ExitCode.FAILED
    assert "cannot tell which host process leads it" in wrong.stdout
    assert "control schema 'nowhere' holds no host tables" in wrong.stdout


async def test_a_session_on_the_standalone_key_of_a_hosted_cluster_exits_7(fleet: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    await migrated(fleet, [schema])
    enrolled = await cli(fleet, "host", "enroll", schema, "--group", fleet.group)
    assert enrolled.exit_code == ExitCode.OK, enrolled.output
    (oid,) = await admin_execute(fleet.url, "SELECT $1::regnamespace::oid AS oid", schema)
    blocker = await asyncpg.connect(
        asyncpg_dsn(fleet.url), server_settings={"application_name": "squatter"}
    )
    try:
        await blocker.execute(
            "SELECT pg_advisory_lock($1, $2::oid::bigint::int)", LOCK_NS_LEADER, oid["oid"]
        )
        probe = await cli(fleet, "health", schema=schema)
        assert probe.exit_code == ExitCode.FOREIGN_HOLDER, probe.output
        reasons = probe.stdout.splitlines()
        assert "application_name 'squatter'" in reasons[0]
        assert "holds the cluster's standalone leader lock" in reasons[0]
        assert reasons[1] == (
            "unhealthy: no live host process owns it; no owner recorded (never claimed, or "
            "its last owner died)"
        )
        lines = facts((await cli(fleet, "status", schema=schema)).stdout)
        assert lines["standalone lock"].startswith("held by backend pid")
        assert "'squatter'" in lines["standalone lock"]
        doc = document((await cli(fleet, "health", "--json", schema=schema)).stdout)
        assert doc["host"]["standalone_lock_holder"]["application_name"] == "squatter"
    finally:
        await blocker.close()


async def test_host_enroll_list_remove_register_no_process(fleet: Fleet) -> None:
    schemas = fleet.clusters(3)
    await migrated(fleet, schemas)
    added = await cli(fleet, "host", "enroll", *schemas[:2], "--group", fleet.group)
    assert added.exit_code == ExitCode.OK, added.output
    assert added.stdout.splitlines() == [
        f"enrolled: schema {s} in host group {fleet.group}" for s in schemas[:2]
    ]
    again = await cli(fleet, "host", "enroll", schemas[0], "--group", fleet.group)
    assert again.stdout == f"already enrolled: schema {schemas[0]} in host group {fleet.group}\n"
    assert await process_rows(fleet) == []

    listed = document((await cli(fleet, "host", "list", "--json", "--group", fleet.group)).stdout)
    assert listed["processes"] == []
    assert [(c["schema"], c["owner"], c["state"]) for c in listed["clusters"]] == [
        (s, None, "active") for s in schemas[:2]
    ]
    assert listed["counts"] == [{"group": fleet.group, "owner": None, "clusters": 2}]

    async with serving(fleet.url, config(fleet, "lister")) as served:
        await until(lambda: len(served.host.led()) == 2, "the host to lead both")
        pid = served.host.process_id
        listed = document(
            (await cli(fleet, "host", "list", "--json", "--group", fleet.group)).stdout
        )
        (process,) = listed["processes"]
        assert (process["process_id"], process["live"], process["clusters"]) == (pid, True, 2)
        assert process["instance"] == served.host.instance
        assert {c["owner"] for c in listed["clusters"]} == {pid}
        text = await cli(fleet, "host", "list", "--group", fleet.group)
        assert text.exit_code == ExitCode.OK, text.output
        row = next(line for line in text.stdout.splitlines() if line.startswith(fleet.group))
        assert row.split("\t")[1:3] == [str(pid), served.host.instance]

        removed = await cli(fleet, "host", "remove", schemas[0], "--group", fleet.group)
        assert removed.exit_code == ExitCode.OK, removed.output
        assert removed.stdout == f"removed: schema {schemas[0]} from host group {fleet.group}\n"
        await until(lambda: schemas[0] not in served.host.led(), "the host to let it go")
        standalone = document((await cli(fleet, "health", "--json", schema=schemas[0])).stdout)
        assert standalone["mode"] == "standalone"
        assert "host" not in standalone
        assert standalone["reasons"] == ["no instance holds the leader lock"]
        assert [p["process_id"] for p in listed["processes"]] == [
            r["process_id"] for r in await process_rows(fleet)
        ]

    missing = await cli(fleet, "host", "remove", schemas[0], "--group", fleet.group)
    assert missing.exit_code == ExitCode.FAILED
    assert f"schema '{schemas[0]}' is not enrolled in host group '{fleet.group}'" in missing.stderr
    behind = await cli(fleet, "host", "enroll", f"{fleet.prefix}_none", "--group", fleet.group)
    assert behind.exit_code == ExitCode.NOT_MIGRATED, behind.output


async def test_a_refused_cluster_reports_its_reason(fleet: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    await migrated(fleet, [schema])
    assert (await cli(fleet, "host", "enroll", schema, "--group", fleet.group)).exit_code == 0
    await admin_execute(
        fleet.url,
        f"UPDATE \"{fleet.control}\".clusters SET state = 'refused', "
        "refused_why = 'a trigger nobody trusted' WHERE schema_name = $1",
        schema,
    )
    probe = await cli(fleet, "health", schema=schema)
    assert probe.exit_code == ExitCode.NO_LEADER
    assert probe.stdout == (
        f"unhealthy: host group {fleet.group} refuses to lead it: a trigger nobody trusted "
        "(once that is fixed, `cronoq-store host enroll` it again)\n"
    )
    doc = document((await cli(fleet, "status", "--json", schema=schema)).stdout)
    assert (doc["host"]["state"], doc["host"]["refused_why"]) == (
        "refused",
        "a trigger nobody trusted",
    )
    await admin_execute(
        fleet.url,
        f"UPDATE \"{fleet.control}\".clusters SET state = 'active', incarnation = 1 "
        "WHERE schema_name = $1",
        schema,
    )
    replaced = await cli(fleet, "health", schema=schema)
    assert replaced.exit_code == ExitCode.NO_LEADER
    assert "than the one enrolled (incarnation 1): no host process can claim it" in (
        replaced.stdout
    )
    await admin_execute(
        fleet.url,
        f"UPDATE \"{fleet.control}\".clusters SET state = 'refused', incarnation = $2 "
        "WHERE schema_name = $1",
        schema,
        doc["incarnation"],
    )
    listed = document((await cli(fleet, "host", "list", "--json")).stdout)
    (row,) = [c for c in listed["clusters"] if c["schema"] == schema]
    assert (row["state"], row["refused_why"]) == ("refused", "a trigger nobody trusted")
    assert listed["counts"] == []

    # Enrolled again: the operator's word that the cause is gone.
    again = await cli(fleet, "host", "enroll", schema, "--group", fleet.group)
    assert again.exit_code == ExitCode.OK, again.output
    cleared = await cli(fleet, "health", schema=schema)
    assert cleared.stdout.startswith("unhealthy: no live host process owns it; no owner recorded")


async def test_hosted_names_print_terminal_safe(fleet: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    await migrated(fleet, [schema])
    group = "g\x1b[31m\u202e\nx"
    assert (await cli(fleet, "host", "enroll", schema, "--group", group)).exit_code == 0
    await admin_execute(
        fleet.url,
        f"UPDATE \"{fleet.control}\".clusters SET state = 'refused', refused_why = $2 "
        "WHERE schema_name = $1",
        schema,
        "why\x1b]0;owned\x07\r",
    )
    outputs = [
        await cli(fleet, "health", schema=schema),
        await cli(fleet, "status", schema=schema),
        await cli(fleet, "host", "list"),
        await cli(fleet, "status", "--schemas", f"{fleet.prefix}_*"),
        await cli(fleet, "health", "--json", schema=schema),
    ]
    for result in outputs:
        assert result.stdout
        assert unsafe_characters(result.stdout) == [], result.stdout
        assert unsafe_characters(result.stderr) == []
    assert document(outputs[-1].stdout)["host"]["group"] == group
    removed = await cli(fleet, "host", "remove", schema, "--group", group)
    assert removed.exit_code == ExitCode.OK, removed.output
    assert unsafe_characters(removed.stdout) == []


async def test_an_enrolment_refused_by_a_standalone_leader_changes_nothing(fleet: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    await migrated(fleet, [schema])
    async with await PgStore.connect(fleet.url, PgStoreConfig(schema=schema)) as store:
        await store.acquire_leadership()
        refused = await cli(fleet, "host", "enroll", schema, "--group", fleet.group)
        assert refused.exit_code == ExitCode.LOCK_HELD, refused.output
        assert "failed: its leader lock is held by pid" in refused.stderr
        assert "(a standalone leader, a downgrade, or a claim" in refused.stderr
        doc = document((await cli(fleet, "status", "--json", schema=schema)).stdout)
        assert doc["mode"] == "standalone"
        assert "host" not in doc


async def test_a_standalone_store_on_an_enrolled_cluster_reports_its_host_group(
    fleet: Fleet,
) -> None:
    schemas = fleet.clusters(2)
    await migrated(fleet, schemas)
    assert (await cli(fleet, "host", "enroll", schemas[0], "--group", fleet.group)).exit_code == 0
    async with await PgStore.connect(fleet.url, PgStoreConfig(schema=schemas[0])) as store:
        health = await store.health()
        assert health.hosted_by == fleet.group
        assert (health.is_leader, health.has_leader, health.at_head) == (False, False, True)
    async with await PgStore.connect(fleet.url, PgStoreConfig(schema=schemas[1])) as store:
        assert (await store.health()).hosted_by is None


async def test_a_hosted_stores_health_names_its_owner_as_the_health_command_does(
    fleet: Fleet,
) -> None:
    """A ``HostedStore``'s ``health()`` has the leader ``cronoq-store health`` judges by: the
    owner's host session, holding its process lock (a store instance, so ``has_leader``),
    and not the cluster's standalone key, which a hosted cluster keeps free; a session
    squatting on that key (health exit 7) is its ``foreign_holder``."""
    (schema,) = fleet.clusters(1)
    async with serving(fleet.url, config(fleet, "healthy"), [schema]) as served:
        await until(lambda: schema in served.host.led(), "the host to lead the cluster")
        store = served.host.led()[schema]
        (row,) = await admin_execute(
            fleet.url,
            f'SELECT backend_pid FROM "{fleet.control}".processes WHERE process_id = $1',
            served.host.process_id,
        )
        health = await store.health()
        assert (health.is_leader, health.has_leader, health.hosted_by) == (True, True, fleet.group)
        assert health.holder is not None
        assert (health.holder.pid, health.foreign_holder) == (row["backend_pid"], None)
        assert (await cli(fleet, "health", schema=schema)).exit_code == ExitCode.OK

        (oid,) = await admin_execute(fleet.url, "SELECT $1::regnamespace::oid AS oid", schema)
        blocker = await asyncpg.connect(
            asyncpg_dsn(fleet.url), server_settings={"application_name": "squatter"}
        )
        try:
            await blocker.execute(
                "SELECT pg_advisory_lock($1, $2::oid::bigint::int)", LOCK_NS_LEADER, oid["oid"]
            )
            health = await store.health()
            assert health.foreign_holder is not None
            assert health.foreign_holder.application_name == "squatter"
            assert (health.is_leader, health.has_leader) == (True, False)
            probe = await cli(fleet, "health", schema=schema)
            assert probe.exit_code == ExitCode.FOREIGN_HOLDER, probe.output
        finally:
            await blocker.close()


async def test_host_commands_fail_as_every_command_does(fleet: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    wrong = full(fleet.url.set(password="not-the-password"))
    for args in (("host", "remove", schema), ("host", "list"), ("host", "enroll", schema)):
        refused = await run("--url", wrong, *args)
        assert refused.exit_code == ExitCode.UNREACHABLE, (args, refused.output)
        assert "not-the-password" not in refused.output
        assert refused.stderr.startswith("Error: cannot connect to ")
    usage = await run("--url", "mysql://u:secret@db/x", "host", "remove", schema)
    assert usage.exit_code == ExitCode.USAGE
    assert "secret" not in usage.output
