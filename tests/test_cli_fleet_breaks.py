"""What a hostile review of ``--all`` / ``--schemas`` found: each test states the contract
the docs give and fails on main until it holds. A cluster the role cannot read still gets
its line and the summary still comes last; a wrong password exits 3 as for one cluster;
another session's temporary table is not a cluster; a schema dropped after the listing is
not created again; a worker killed from outside is a failure, not a cancelled migration."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._cli import fleet_migrate
from cronoq_store._cli.exits import ExitCode
from cronoq_store._cli.migrate_worker import migrate_schema
from cronoq_store._migrations import ClusterGone, upgrade
from cronoq_store._urls import async_url

from .pgharness import admin_execute, asyncpg_dsn
from .support import ROOT, full, run
from .test_cli_fleet import database, environment, lines, make_fleet, no_password, outcomes
from .waits import until

__all__ = ["database"]  # the fixture, imported for the tests of this file


@pytest.fixture
async def reader(database: URL) -> AsyncIterator[URL]:
    """A role that may read clusters a1 and a3, not a2 (no USAGE on its schema)."""
    await make_fleet(database, heads=["a1", "a2", "a3"])
    role = f"mon_{uuid.uuid4().hex[:8]}"
    await admin_execute(database, f"CREATE ROLE {role} LOGIN PASSWORD 'monPW_secret9'")
    try:
        for schema in ("a1", "a3"):
            await admin_execute(database, f"GRANT USAGE ON SCHEMA {schema} TO {role}")
            await admin_execute(
                database, f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}"
            )
        await admin_execute(database, f"GRANT CONNECT ON DATABASE {database.database} TO {role}")
        yield database.set(username=role, password="monPW_secret9")
    finally:
        await admin_execute(database, f"DROP OWNED BY {role}")
        await admin_execute(database, f"DROP ROLE {role}")


@pytest.mark.parametrize("command", ["status", "health"])
async def test_a_cluster_the_role_cannot_read_gets_its_line_and_the_rest_are_read(
    reader: URL, command: str
) -> None:
    text = await run("--url", full(reader), command, "--all")
    assert [line.split()[0] for line in lines(text)[:-1]] == ["a1", "a2", "a3"], text.output
    assert lines(text)[-1].startswith("summary: 3 cluster(s)")
    as_json = await run("--url", full(reader), command, "--all", "--json")
    documents = [json.loads(line) for line in lines(as_json)]
    assert "summary" in documents[-1], as_json.output
    assert [d["schema"] for d in documents[:-1]] == ["a1", "a2", "a3"]
    no_password(reader, text.output, as_json.output)


@pytest.mark.parametrize("command", ["status", "health", "migrate"])
async def test_a_wrong_password_exits_3_over_many_clusters_as_over_one(
    database: URL, command: str
) -> None:
    await make_fleet(database, heads=["a1"])
    wrong = full(database.set(password="not-the-password"))
    one = await run("--url", wrong, "--schema", "a1", command)
    many = await run("--url", wrong, command, "--all")
    assert one.exit_code == ExitCode.UNREACHABLE, one.output
    assert many.exit_code == one.exit_code, many.output


async def test_another_sessions_temporary_table_is_not_a_cluster(database: URL) -> None:
    await make_fleet(database, heads=["a1"])
    other = await asyncpg.connect(asyncpg_dsn(database))
    try:
        await other.execute("CREATE TEMP TABLE cronoq_alembic_version (version_num text)")
        result = await run("--url", full(database), "status", "--all")
    finally:
        await other.close()
    assert [line.split()[0] for line in lines(result)[:-1]] == ["a1"], result.output
    assert result.exit_code == ExitCode.OK


async def _migrate_process(url: URL, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "cronoq_store._cli",
        "migrate",
        *args,
        cwd=ROOT,
        env=environment(url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def _waiting_on(url: URL, schema: str) -> bool:
    """Whether a worker's migration of ``schema`` waits for its tables (it polls)."""
    rows = await admin_execute(
        url,
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = 'cronoq-store cli' AND state = 'active' "
        "AND (query LIKE $1 OR query LIKE '%pg_sleep%')",
        f"LOCK TABLE ONLY {schema}.%",
    )
    return bool(rows)


async def test_a_schema_dropped_after_the_listing_is_not_created_again(database: URL) -> None:
    await make_fleet(database, behind=["a1", "z9"])
    holder = await asyncpg.connect(asyncpg_dsn(database))
    try:
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE a1.cronoq_tasks IN ACCESS SHARE MODE")
        parent = await _migrate_process(database, "--all", "--jobs", "1")
        await until(lambda: _waiting_on(database, "a1"), "the worker waiting on a1")
        await admin_execute(database, "DROP SCHEMA z9 CASCADE")
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    out, err = await asyncio.wait_for(parent.communicate(), 120)
    rows = await admin_execute(database, "SELECT 1 FROM pg_namespace WHERE nspname = 'z9'")
    assert rows == [], (out.decode(), err.decode())


async def test_an_upgrade_of_existing_clusters_only_creates_nothing(database: URL) -> None:
    """The check under the migration lock, which no listing can race: a schema without a
    cluster is refused with ``ClusterGone`` and not created; one behind head is upgraded."""
    await make_fleet(database, behind=["a1"])
    engine = create_async_engine(async_url(database))
    try:
        with pytest.raises(ClusterGone):
            await upgrade(engine, "z9", must_exist=True)
        await upgrade(engine, "a1", must_exist=True)
        answer = await migrate_schema(full(database), "z9", frozenset(), 5.0, engine)
    finally:
        await engine.dispose()
    assert answer["gone"] is True, answer
    rows = await admin_execute(database, "SELECT 1 FROM pg_namespace WHERE nspname = 'z9'")
    assert rows == []
    status = await run("--url", full(database), "--schema", "a1", "status")
    assert status.exit_code == ExitCode.OK, status.output


async def test_a_worker_killed_from_outside_is_a_failure_not_a_cancellation(
    database: URL,
) -> None:
    await make_fleet(database, behind=["a1", "a2"])
    holder = await asyncpg.connect(asyncpg_dsn(database))
    try:
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE a1.cronoq_tasks IN ACCESS SHARE MODE")
        parent = await _migrate_process(database, "--all", "--jobs", "1")
        await until(lambda: _waiting_on(database, "a1"), "the worker waiting on a1")
        workers = (
            await asyncio.create_subprocess_exec(
                "pgrep", "-P", str(parent.pid), stdout=asyncio.subprocess.PIPE
            )
        ).stdout
        assert workers is not None
        for pid in (await workers.read()).split():
            os.kill(int(pid), signal.SIGKILL)
        await holder.execute("ROLLBACK")
    finally:
        await holder.close()
    out, err = await asyncio.wait_for(parent.communicate(), 120)
    assert parent.returncode == ExitCode.FAILED
    said = outcomes(out.decode())
    assert "failed" in said["a1"], (out.decode(), err.decode())
    assert "SIGKILL" in said["a1"]
    assert "failed 1" in out.decode().splitlines()[-1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is 3.11's")
async def test_the_workers_import_nothing_from_the_working_directory(
    database: URL, tmp_path: Path
) -> None:
    """``python -m`` puts the working directory first on ``sys.path``: a module there (a
    checkout of another version, or anything in a shared directory such as /tmp) would run
    in the worker, with the URL and its password in its environment."""
    await make_fleet(database, behind=["a1"])
    marker = tmp_path / "ran"
    (tmp_path / "argparse.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nraise ImportError('shadowed')\n"
    )
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-P",  # the parent itself is started safely: only its workers are on trial
        "-m",
        "cronoq_store._cli",
        "migrate",
        "--all",
        cwd=tmp_path,
        env=environment(database),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(parent.communicate(), 120)
    assert not marker.exists(), (out.decode(), err.decode())
    assert parent.returncode == 0


async def test_a_reader_that_goes_away_is_not_a_server_that_cannot_be_reached(
    database: URL,
) -> None:
    """``migrate --all | head -1``, or a pager quit early: the broken pipe must not read as
    exit 3 (cannot connect), and must not kill the migrations in flight."""
    await make_fleet(database, behind=[f"a{n}" for n in range(6)])
    read, write = os.pipe()
    os.close(read)
    try:
        parent = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cronoq_store._cli",
            "migrate",
            "--all",
            "--jobs",
            "2",
            cwd=ROOT,
            env=environment(database),
            stdout=write,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(parent.communicate(), 120)
    assert parent.returncode != ExitCode.UNREACHABLE, err.decode()
    assert "cannot connect" not in err.decode()
    # Documented: the output was not all delivered (1); what ran was not killed.
    assert parent.returncode == ExitCode.FAILED, err.decode()
    assert "standard output closed" in err.decode()
    assert "Traceback" not in err.decode()
    assert "SIGKILL" not in err.decode()


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("status", "--jobs=3"),
        ("health", "--jobs=3"),
        ("migrate", "--jobs=3"),
        ("migrate", "--fail-fast"),
    ],
)
async def test_an_option_of_many_clusters_without_a_selection_is_a_usage_error(
    database: URL, command: str, option: str
) -> None:
    """``--jobs`` or ``--fail-fast`` alone: ``--all`` was most likely forgotten."""
    await make_fleet(database, heads=["a1"])
    result = await run("--url", full(database), "--schema", "a1", command, option)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "--all or --schemas" in result.output


async def test_a_worker_that_cannot_start_fails_its_clusters_not_the_run(
    database: URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong with one cluster's worker is that cluster's line: the others
    get theirs, and the summary comes last."""
    await make_fleet(database, heads=["a0"], behind=["a1", "a2"])

    async def cannot_start(*args: object) -> object:
        raise OSError("no processes left (test)")

    monkeypatch.setattr(fleet_migrate._Worker, "start", cannot_start)
    result = await run("--url", full(database), "migrate", "--all", "--jobs", "1")
    said = outcomes(result.stdout)
    assert said["a0"].endswith("already current"), result.output
    assert "no processes left" in said["a1"]
    assert "no processes left" in said["a2"]
    assert "failed 2" in lines(result)[-1]
    assert result.exit_code == ExitCode.FAILED


async def test_status_to_a_closed_output_exits_1_not_3(database: URL) -> None:
    """Any command, not only ``migrate``: a reader gone is no unreachable server."""
    await make_fleet(database, heads=["a1", "a2"])
    read, write = os.pipe()
    os.close(read)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "cronoq_store._cli",
            "status",
            "--all",
            cwd=ROOT,
            env=environment(database),
            stdout=write,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == ExitCode.FAILED, err.decode()
    assert "standard output closed" in err.decode()
    assert "Traceback" not in err.decode()
