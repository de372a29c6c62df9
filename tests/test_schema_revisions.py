"""A schema that is not at this build's head is an operator's ordinary state (a rolling
upgrade, a migration not yet run, a newer build ahead): every ``cronoq-store`` command
reports it with its documented verdict and exit code, never a driver error. Checked at
every revision older than head, with the schema's tables never created, missing, and
newer than this build, against a real server."""

from __future__ import annotations

import json

import asyncpg
import pytest
from click.testing import Result
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._cli import ExitCode
from cronoq_store._migrations import head_revision, upgrade
from cronoq_store._statements import LOCK_NS_LEADER

from .pgharness import admin_execute, asyncpg_dsn
from .support import full, older_revisions, run

#: A revision no build knows: what a newer build leaves.
FUTURE = "9999_future"


#: What each state is, and the exit code every command refusing it gives.
STATES = [
    *((revision, ExitCode.NOT_MIGRATED) for revision in older_revisions()),
    ("no tables", ExitCode.NOT_MIGRATED),
    ("missing", ExitCode.NOT_MIGRATED),
    ("newer", ExitCode.NEWER_DATABASE),
]

#: Every command that reads or changes a cluster without upgrading it.
COMMANDS = [
    ("status",),
    ("status", "--json"),
    ("health",),
    ("health", "--json"),
    ("tasks", "show", "1"),
    ("tasks", "show", "1", "--json"),
    ("tasks", "finished"),
    ("tasks", "finished", "--json"),
    ("prune", "--older-than", "1d", "--dry-run"),
    ("prune", "--older-than", "1d"),
    ("handover", "--yes"),
]


async def make_state(engine: AsyncEngine, pg_url: URL, schema: str, state: str) -> None:
    if state == "missing":
        return
    if state == "no tables":
        await admin_execute(pg_url, f'CREATE SCHEMA "{schema}"')
        return
    await upgrade(engine, schema, "head" if state == "newer" else state)
    if state == "newer":
        await admin_execute(
            pg_url, f"UPDATE \"{schema}\".cronoq_alembic_version SET version_num = '{FUTURE}'"
        )


def assert_said_plainly(result: Result, command: tuple[str, ...]) -> None:
    """One line on stderr at most, no driver error, and with --json one document."""
    assert "Traceback" not in result.output, (command, result.output)
    assert "Error" not in result.stdout, (command, result.stdout)
    for word in ("UndefinedColumn", "UndefinedTable", "does not exist;", "the command failed"):
        assert word not in result.stderr, (command, result.stderr)
    assert len(result.stderr.splitlines()) <= 1, (command, result.stderr)


@pytest.mark.parametrize(("state", "code"), STATES, ids=[state for state, _ in STATES])
async def test_every_command_gives_the_documented_verdict(
    engine: AsyncEngine, pg_url: URL, schema: str, state: str, code: ExitCode
) -> None:
    await make_state(engine, pg_url, schema, state)
    for command in COMMANDS:
        result = await run("--url", full(pg_url), "--schema", schema, *command)
        assert result.exit_code == code, (command, result.output)
        assert_said_plainly(result, command)
        if command[0] in ("status", "health") and "--json" in command:
            doc = json.loads(result.stdout)
            assert doc["at_head"] is False
            assert doc["head"] == head_revision()
            assert doc["revision"] == {
                "missing": [],
                "no tables": [],
                "newer": [FUTURE],
            }.get(state, [state])
        if command == ("health", "--json"):
            assert doc["healthy"] is False
            assert doc["reasons"][0].startswith(f"schema {schema} is ")
            assert doc["migration_lock"] is None


async def take_epoch_as_an_older_build(pg_url: URL, schema: str) -> asyncpg.Connection:
    """A leader of a build whose head is below revision 0007: it holds the leader lock and
    moved the epoch, and records nothing else."""
    conn = await asyncpg.connect(
        asyncpg_dsn(pg_url), server_settings={"application_name": "older-build leader"}
    )
    oid = await conn.fetchval("SELECT $1::regnamespace::oid::int", schema)
    assert await conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", LOCK_NS_LEADER, oid)
    await conn.execute(f'UPDATE "{schema}".cronoq_leader SET epoch = epoch + 1 WHERE id = 1')
    return conn


@pytest.mark.parametrize("revision", list(older_revisions()))
async def test_health_and_status_name_the_leader_of_an_older_schema(
    engine: AsyncEngine, pg_url: URL, schema: str, revision: str
) -> None:
    """Mid rolling upgrade the previous release leads a schema behind this build's head:
    ``health`` says the schema is behind (exit 4) and names that leader as the leader."""
    await upgrade(engine, schema, revision)
    leader = await take_epoch_as_an_older_build(pg_url, schema)
    try:
        result = await run("--url", full(pg_url), "--schema", schema, "health", "--json")
        assert result.exit_code == ExitCode.NOT_MIGRATED, result.output
        doc = json.loads(result.stdout)
        assert doc["stored_epoch"] == 1
        assert doc["leader"]["pid"] == leader.get_server_pid()
        assert doc["leader"]["application_name"] == "older-build leader"
        assert len(doc["reasons"]) == 1, doc["reasons"]

        status = await run("--url", full(pg_url), "--schema", schema, "status")
        assert status.exit_code == ExitCode.NOT_MIGRATED, status.output
        assert f"backend pid {leader.get_server_pid()}, 'older-build leader'" in status.stdout
        assert_said_plainly(status, ("status",))
    finally:
        await leader.close()


def one_step_down() -> list[tuple[str, str]]:
    """Every revision with the one below it, head included (``base`` below the first)."""
    chain = [*older_revisions(), head_revision()]
    return list(zip(chain, ["base", *chain[:-1]], strict=True))


async def epoch_of(pg_url: URL, schema: str) -> int:
    rows = await admin_execute(pg_url, f'SELECT epoch FROM "{schema}".cronoq_leader')
    return int(rows[0]["epoch"])


@pytest.mark.parametrize(("revision", "below"), one_step_down()[1:])
async def test_a_forced_downgrade_fences_the_leader_of_any_revision(
    engine: AsyncEngine, pg_url: URL, schema: str, revision: str, below: str
) -> None:
    """A rolling upgrade rolled back: the previous release leads, and the operator forces
    the schema down one revision. The run fences that leader (the epoch moves) whatever
    the leader row records, online and in its ``--sql`` script."""
    for how in ("online", "script"):
        await upgrade(engine, schema, revision)
        leader = await take_epoch_as_an_older_build(pg_url, schema)
        try:
            before = await epoch_of(pg_url, schema)
            if how == "online":
                args = ("downgrade", below, "--yes", "--force")
                result = await run("--url", full(pg_url), "--schema", schema, *args)
                assert result.exit_code == 0, result.output
            else:
                args = ("downgrade", "--sql", f"{revision}:{below}", "--force")
                script = await run("--url", full(pg_url), "--schema", schema, *args)
                assert script.exit_code == 0, script.output
                conn = await asyncpg.connect(asyncpg_dsn(pg_url))
                try:
                    await conn.execute(script.stdout)  # the whole script, as psql runs it
                finally:
                    await conn.close()
            assert await epoch_of(pg_url, schema) == before + 1, how
        finally:
            await leader.close()
        await admin_execute(pg_url, f'DROP SCHEMA "{schema}" CASCADE')
