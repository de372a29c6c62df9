"""Which schema a ``cronoq-store`` command acts on (``--schema`` before or after the command,
``$CRONOQ_SCHEMA``, a forgotten ``--schema`` in a database whose clusters are elsewhere), and
moving its revision down: ``migrate`` refuses, ``downgrade`` does it when confirmed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
import select
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._cli import ExitCode
from cronoq_store._cli.app import hoist_global_options
from cronoq_store._migrations import head_revision, script_location, upgrade
from cronoq_store._schema import VERSION_TABLE
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import ROOT, full, run


def schema_line(output: str) -> str:
    found = re.search(r"^schema\s+(\S+)", output, re.M)
    assert found is not None, output
    return found.group(1)


async def test_schema_after_the_command_and_from_the_environment(
    pg_url: URL, migrated: str
) -> None:
    url = full(pg_url)
    after = await run("--url", url, "status", "--schema", migrated)
    assert after.exit_code == 0, after.output
    assert schema_line(after.stdout) == migrated
    nested = await run("--url", url, "tasks", "finished", f"--schema={migrated}")
    assert nested.exit_code == 0, nested.output

    by_env = await run("--url", url, "status", env={"CRONOQ_SCHEMA": migrated})
    assert by_env.exit_code == 0, by_env.output
    assert schema_line(by_env.stdout) == migrated
    # The command line wins over the environment, and the last --schema over the first.
    missing = f"m_{uuid.uuid4().hex[:10]}"
    over = await run("--url", url, "status", "--schema", missing, env={"CRONOQ_SCHEMA": migrated})
    assert over.exit_code == ExitCode.NOT_MIGRATED
    assert f"schema {missing!r} does not exist" in over.stderr
    last = await run("--url", url, "--schema", missing, "status", "--schema", migrated)
    assert last.exit_code == 0, last.output
    assert schema_line(last.stdout) == migrated

    bad = await run("--url", url, "status", "--schema", 'x"; drop')
    assert bad.exit_code == ExitCode.USAGE
    assert "invalid schema name" in bad.stderr


def test_only_global_options_move_and_nothing_after_a_double_dash() -> None:
    assert hoist_global_options(["status", "--url", "u", "--json", "--url=v"]) == [
        "--url",
        "u",
        "--url=v",
        "status",
        "--json",
    ]
    assert hoist_global_options(["tasks", "show", "7", "--schema", "a", "--schema=b"]) == [
        "--schema",
        "a",
        "--schema=b",
        "tasks",
        "show",
        "7",
    ]
    assert hoist_global_options(["tasks", "show", "--", "--schema"]) == [
        "tasks",
        "show",
        "--",
        "--schema",
    ]


@pytest.fixture
async def database(pg_url: URL) -> AsyncIterator[URL]:
    """A database of its own: whether ``public`` holds a cluster is this test's to decide."""
    name = f"cq_{uuid.uuid4().hex[:10]}"
    await admin_execute(pg_url, f"CREATE DATABASE {name}")
    try:
        yield pg_url.set(database=name)
    finally:
        await admin_execute(pg_url, f"DROP DATABASE {name} WITH (FORCE)")


async def test_a_forgotten_schema_names_the_clusters_and_exits_2(database: URL) -> None:
    engine = create_async_engine(async_url(database))
    try:
        for schema in ("billing", "alpha"):
            await upgrade(engine, schema)
    finally:
        await engine.dispose()
    url = full(database)
    for command in (["status"], ["tasks", "finished"], ["migrate"]):
        result = await run("--url", url, *command)
        assert result.exit_code == ExitCode.USAGE, (command, result.output)
        assert "the clusters in this database are in: alpha, billing;" in result.stderr
        assert "pass --schema NAME (--schema public to use 'public' anyway)" in result.stderr
    # Nothing was created in public by the refused migrate.
    tables = await admin_execute(
        database, "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace"
    )
    assert tables == []

    named = await run("--url", url, "--schema", "public", "migrate")
    assert named.exit_code == 0, named.output
    defaulted = await run("--url", url, "status")
    assert defaulted.exit_code == 0, defaulted.output
    assert schema_line(defaulted.stdout) == "public"


async def test_an_empty_database_defaults_to_public(database: URL) -> None:
    result = await run("--url", full(database), "migrate")
    assert result.exit_code == 0, result.output
    assert "schema 'public' upgraded: nothing ->" in result.stdout


async def versions(url: URL, schema: str) -> list[str]:
    rows = await admin_execute(url, f'SELECT version_num FROM "{schema}".{VERSION_TABLE}')
    return [row[0] for row in rows]


async def test_migrate_below_the_current_revision_refuses_with_the_downgrade_command(
    pg_url: URL, migrated: str
) -> None:
    url = full(pg_url)
    result = await run("--url", url, "--schema", migrated, "migrate", "0004_task_labels")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert f"schema {migrated!r} is at {head_revision()}, above 0004_task_labels" in result.stderr
    assert f"run `cronoq-store --schema {migrated} downgrade 0004_task_labels`" in result.stderr
    assert await versions(pg_url, migrated) == [head_revision()]
    base = await run("--url", url, "--schema", migrated, "migrate", "base")
    assert base.exit_code == ExitCode.USAGE
    assert "downgrade base`" in base.stderr


def undone_above(revision: str) -> str:
    """The revisions a downgrade to ``revision`` undoes, newest first, as the CLI names them."""
    newest_first = [s.revision for s in ScriptDirectory(str(script_location())).walk_revisions()]
    return ", ".join(newest_first[: newest_first.index(revision)])


async def test_downgrade_asks_then_undoes_the_revisions_named(pg_url: URL, migrated: str) -> None:
    url = full(pg_url)
    unconfirmed = await run("--url", url, "--schema", migrated, "downgrade", "0004")
    assert unconfirmed.exit_code == ExitCode.USAGE, unconfirmed.output
    undone = undone_above("0004_task_labels")
    assert f"undoing {undone}? What they hold is lost. Pass --yes" in unconfirmed.stderr
    assert undone.startswith(f"{head_revision()}, ")
    assert await versions(pg_url, migrated) == [head_revision()]

    done = await run("--url", url, "downgrade", "0004", "--yes", "--schema", migrated)
    assert done.exit_code == 0, done.output
    assert f"downgraded: {head_revision()} -> 0004_task_labels" in done.stdout
    assert await versions(pg_url, migrated) == ["0004_task_labels"]
    columns = await admin_execute(
        pg_url,
        "SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'tenant'",
        f'"{migrated}".cronoq_tasks',
    )
    assert columns == []  # 0005's column is gone

    upward = await run("--url", url, "--schema", migrated, "downgrade", "head", "--yes")
    assert upward.exit_code == ExitCode.USAGE
    assert "is not a revision below it" in upward.stderr

    gone = await run("--url", url, "--schema", migrated, "downgrade", "base", "--yes")
    assert gone.exit_code == 0, gone.output
    assert "downgraded: 0004_task_labels -> base" in gone.stdout
    tables = await admin_execute(
        pg_url,
        "SELECT relname FROM pg_class WHERE relnamespace = $1::regnamespace AND relkind = 'r'",
        migrated,
    )
    assert sorted(row[0] for row in tables) == [VERSION_TABLE]
    again = await run("--url", url, "--schema", migrated, "migrate")
    assert again.exit_code == 0, again.output


async def test_downgrade_refuses_a_newer_or_missing_schema(pg_url: URL, migrated: str) -> None:
    url = full(pg_url)
    missing = await run("--url", url, "--schema", "m_nowhere_x", "downgrade", "base", "--yes")
    assert missing.exit_code == ExitCode.NOT_MIGRATED
    await admin_execute(
        pg_url, f"UPDATE \"{migrated}\".{VERSION_TABLE} SET version_num = '9999_future'"
    )
    newer = await run("--url", url, "--schema", migrated, "downgrade", "base", "--yes")
    assert newer.exit_code == ExitCode.NEWER_DATABASE
    assert await versions(pg_url, migrated) == ["9999_future"]


async def test_downgrade_sql_prints_the_script_without_connecting() -> None:
    result = await run(
        "--url",
        "postgresql://x@127.0.0.1:1/db",
        "--schema",
        "ops_review",
        "downgrade",
        "--sql",
        "0005_task_tenant:0004_task_labels",
    )
    assert result.exit_code == 0, result.output
    assert "pg_advisory_xact_lock(1668444013" in result.stdout
    assert "ALTER TABLE ops_review.cronoq_tasks DROP COLUMN tenant" in result.stdout
    assert "UPDATE ops_review.cronoq_alembic_version SET version_num='0004_task_labels'" in (
        result.stdout
    )


def on_a_terminal(answer: str, *args: str) -> tuple[int, str]:
    """Run the console script on a pseudo-terminal (its three streams), type ``answer``."""
    leader, follower = pty.openpty()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "cronoq_store._cli", *args],
            stdin=follower,
            stdout=follower,
            stderr=follower,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        os.close(follower)
        shown = b""
        while b"[y/N]" not in shown:
            ready, _, _ = select.select([leader], [], [], 60)
            assert ready, shown
            chunk = os.read(leader, 4096)
            assert chunk, shown
            shown += chunk
        os.write(leader, answer.encode() + b"\n")
        process.wait(timeout=60)
        with contextlib.suppress(OSError):  # the terminal closes with the process
            while chunk := os.read(leader, 4096):
                shown += chunk
    finally:
        os.close(leader)
    # Rich wraps at the terminal's width: words, not line breaks, are what was shown.
    return process.returncode, " ".join(shown.decode().split())


async def test_downgrade_on_a_terminal_asks_and_a_no_changes_nothing(
    pg_url: URL, migrated: str
) -> None:
    url = full(pg_url)
    args = ("--url", url, "--schema", migrated, "downgrade", "0006_drop_legacy_version_table")
    code, shown = await asyncio.to_thread(on_a_terminal, "n", *args)
    assert code == ExitCode.FAILED, shown
    undone = undone_above("0006_drop_legacy_version_table")
    assert f"undoing {undone}? What they hold is lost. [y/N]" in shown
    assert await versions(pg_url, migrated) == [head_revision()]
    code, shown = await asyncio.to_thread(on_a_terminal, "y", *args)
    assert code == 0, shown
    assert f"downgraded: {head_revision()} -> 0006_drop_legacy_version_table" in shown
    assert await versions(pg_url, migrated) == ["0006_drop_legacy_version_table"]
