"""``status``, ``health`` and ``migrate`` over many clusters (``--all``, ``--schemas``): one
line per cluster, JSON Lines, the gravest exit code by its documented order, refused
schemas named, and a migration run that bounds its processes, survives an interruption and
finishes the rest when run again. Each test has a database of its own, so ``--all`` sees
its clusters only; every URL has the server's password, which no output may hold."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from urllib.parse import quote, quote_plus

import asyncpg
import pytest
from click.testing import Result
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._cli.exits import SEVERITY, ExitCode, worst
from cronoq_store._cli.fleet import Selection
from cronoq_store._migrations import head_revision, upgrade
from cronoq_store._schema import VERSION_TABLE
from cronoq_store._statements import LOCK_NS_MIGRATE
from cronoq_store._urls import URL_ENV, async_url

from .pgharness import admin_execute, asyncpg_dsn
from .support import ROOT, full, older_revisions, open_store, run
from .waits import bounded, until

#: A revision below head, where a cluster left behind stands.
OLD = list(older_revisions())[-2]
#: A schema holding the version table under a name the store refuses.
BAD_NAME = "Bad-Name"


def no_password(url: URL, *outputs: str) -> None:
    secret = url.password
    assert secret
    for text in outputs:
        for form in {str(secret), quote(str(secret), safe=""), quote_plus(str(secret))}:
            assert form not in text


def lines(result: Result | str) -> list[str]:
    text = result if isinstance(result, str) else result.stdout
    return text.splitlines()


def by_schema(stdout: str) -> dict[str, list[str]]:
    """Text lines by their first word (the schema), each split into schema, code, words."""
    found = {}
    for line in lines(stdout):
        if not line.startswith("summary:"):
            schema, code, words = line.split(maxsplit=2)
            found[schema] = [code, words]
    return found


async def make_fleet(
    url: URL, *, heads: Sequence[str] = (), behind: Sequence[str] = (), planted: bool = False
) -> None:
    """Clusters at head and at :data:`OLD`; ``planted``: one refused by the trust check (a
    trigger no one trusted) and one under a name the store refuses."""
    engine = create_async_engine(async_url(url))
    try:
        for schema in heads:
            await upgrade(engine, schema)
        for schema in behind:
            await upgrade(engine, schema, OLD)
        if planted:
            await upgrade(engine, "planted")
    finally:
        await engine.dispose()
    if planted:
        await admin_execute(
            url,
            "CREATE FUNCTION planted.f() RETURNS trigger LANGUAGE plpgsql "
            "AS $$BEGIN RETURN NEW; END$$",
        )
        await admin_execute(
            url,
            "CREATE TRIGGER audit BEFORE INSERT ON planted.cronoq_tasks "
            "FOR EACH ROW EXECUTE FUNCTION planted.f()",
        )
        await admin_execute(url, f'CREATE SCHEMA "{BAD_NAME}"')
        await admin_execute(
            url, f'CREATE TABLE "{BAD_NAME}".{VERSION_TABLE} (version_num varchar(32))'
        )


@pytest.fixture
async def database(pg_url: URL) -> AsyncIterator[URL]:
    """A database of its own: ``--all`` finds only this test's clusters."""
    name = f"cq_{uuid.uuid4().hex[:10]}"
    await admin_execute(pg_url, f"CREATE DATABASE {name}")
    # As the store requires of its database: only roles granted CONNECT may connect.
    await admin_execute(pg_url, f"REVOKE CONNECT ON DATABASE {name} FROM PUBLIC")
    try:
        yield pg_url.set(database=name)
    finally:
        await admin_execute(pg_url, f"DROP DATABASE {name} WITH (FORCE)")


async def revisions(url: URL, schemas: Sequence[str]) -> dict[str, str]:
    found = {}
    for schema in schemas:
        rows = await admin_execute(url, f'SELECT version_num FROM "{schema}".{VERSION_TABLE}')
        found[schema] = rows[0][0]
    return found


# --- the order of exit codes and the pattern: no server needed ------------------------------


def test_the_severity_order_names_every_code_once_and_is_not_the_numeric_order() -> None:
    assert sorted(SEVERITY) == sorted(ExitCode)
    assert len(set(SEVERITY)) == len(SEVERITY)
    assert worst([ExitCode.NO_LEADER, ExitCode.FAILED]) is ExitCode.FAILED
    assert worst([ExitCode.NOT_MIGRATED, ExitCode.NO_LEADER]) is ExitCode.NO_LEADER
    assert worst([ExitCode.FOREIGN_HOLDER, ExitCode.NO_LEADER]) is ExitCode.FOREIGN_HOLDER
    assert worst([ExitCode.OK, ExitCode.OK]) is ExitCode.OK
    assert worst([]) is ExitCode.OK


def test_a_glob_becomes_a_like_pattern_whose_underscores_match_themselves() -> None:
    assert Selection("t_*").like() == "t\\_%"
    assert Selection("tenant_?1").like() == "tenant\\__1"
    assert Selection("*").like() == "%"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--schema", "a", "status", "--all"], "--schema names one cluster"),
        (["status", "--schema", "a", "--schemas", "a*"], "--schema names one cluster"),
        (["health", "--all", "--schemas", "a*"], "give one"),
        (["status", "--schemas", "a-b"], "not a pattern of schema names"),
        (["status", "--schemas", "a%"], "not a pattern of schema names"),
        (["health", "--all", "--jobs", "0"], "--jobs"),
        (["migrate", "--all", "0001_base"], "migrate to head, online"),
        (["migrate", "--schemas", "a*", "--sql"], "migrate to head, online"),
    ],
)
async def test_contradicting_or_bad_selections_are_usage_errors(args: list[str], said: str) -> None:
    result = await run("--url", "postgresql://u:secret@127.0.0.1:1/db", *args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert said in result.stderr
    assert "secret" not in result.output


# --- status and health ---------------------------------------------------------------------


async def test_status_and_health_over_every_cluster_give_a_line_each_and_the_gravest_code(
    database: URL,
) -> None:
    heads = [f"fleet_{n:02}" for n in range(6)]
    await make_fleet(database, heads=[*heads, "fleetx1"], behind=["fleet_old"], planted=True)
    url = full(database)
    async with open_store(database, "fleet_00", application_name="fleet-leader") as leader:
        epoch = await bounded(leader.acquire_leadership(), "leadership of fleet_00")

        health = await run("--url", url, "health", "--all", "--jobs", "3")
        seen = by_schema(health.stdout)
        assert sorted(seen) == sorted([*heads, "fleetx1", "fleet_old", "planted", BAD_NAME])
        assert seen["fleet_00"][0] == "0"
        assert seen["fleet_00"][1].startswith(f"healthy: epoch {epoch}, leader instance ")
        for schema in [*heads[1:], "fleetx1"]:
            assert seen[schema] == ["6", "unhealthy: no instance holds the leader lock"]
        assert seen["fleet_old"][0] == "4"
        assert seen["fleet_old"][1].startswith(
            "unhealthy: schema fleet_old is 2 revision(s) behind"
        )
        assert seen["planted"][0] == "1"
        assert seen["planted"][1].startswith("refused: schema 'planted' is not safe to use")
        assert "trigger audit on planted.cronoq_tasks" in seen["planted"][1]
        assert seen[BAD_NAME][0] == "1"
        assert seen[BAD_NAME][1].startswith("refused: invalid schema name 'Bad-Name'")
        # Schema order, then the summary; exit 1 (refused) is graver than 6, though smaller.
        assert [line.split()[0] for line in lines(health)[:-1]] == sorted(seen)
        assert health.exit_code == ExitCode.FAILED
        assert lines(health)[-1] == (
            "summary: 10 cluster(s), every cluster: 1 healthy, 2 exit 1, 6 exit 6, "
            "1 exit 4, 2 of them refused; exit code 1"
        )

        # A pattern leaves the refused ones out: the gravest is then 6, not 4.
        pattern = await run("--url", url, "health", "--schemas", "fleet_*")
        assert sorted(by_schema(pattern.stdout)) == sorted([*heads, "fleet_old"])
        assert pattern.exit_code == ExitCode.NO_LEADER
        # "_" matches itself only: fleetx1 is not fleet_*; ? is one character.
        two = await run("--url", url, "health", "--schemas", "fleet_0?")
        assert sorted(by_schema(two.stdout)) == heads

        probe = await run("--url", url, "health", "--all", "--json")
        documents = [json.loads(line) for line in lines(probe)]
        *clusters, summary = documents
        assert summary == {
            "summary": {
                "database": summary["summary"]["database"],
                "selection": "all",
                "pattern": None,
                "clusters": 10,
                "by_exit_code": {"0": 1, "1": 2, "4": 1, "6": 6},
                "refused": 2,
                "exit_code": 1,
            }
        }
        assert "***" in summary["summary"]["database"]
        named = {doc["schema"]: doc for doc in clusters}
        assert named["fleet_00"]["healthy"] is True
        assert named["fleet_00"]["stored_epoch"] == epoch
        assert named["fleet_01"]["reasons"] == ["no instance holds the leader lock"]
        assert named["fleet_old"]["exit_code"] == 4
        assert named["planted"]["refused"] is True
        assert named["planted"]["exit_code"] == 1
        assert probe.exit_code == ExitCode.FAILED

        status = await run("--url", url, "status", "--schemas", "fleet*")
        seen = by_schema(status.stdout)
        assert seen["fleet_00"][0] == "0"
        assert seen["fleet_00"][1].startswith(f"{head_revision()} (up to date), epoch {epoch}, ")
        assert seen["fleet_01"] == ["0", f"{head_revision()} (up to date), epoch 0, no leader"]
        assert seen["fleet_old"][0] == "4"
        assert seen["fleet_old"][1].startswith(f"{OLD} (")
        assert status.exit_code == ExitCode.NOT_MIGRATED
        assert lines(status)[-1] == (
            "summary: 8 cluster(s), clusters matching 'fleet*': 7 at head, 1 exit 4; exit code 4"
        )
        status_json = await run("--url", url, "status", "--all", "--json")
        *docs, last = [json.loads(line) for line in lines(status_json)]
        assert {d["schema"]: d["exit_code"] for d in docs}["fleet_old"] == 4
        assert last["summary"]["exit_code"] == 1
        assert status_json.exit_code == ExitCode.FAILED

    for result in (health, pattern, two, probe, status, status_json):
        no_password(database, result.stdout, result.stderr)


async def test_a_selection_that_matches_nothing_exits_11_with_a_message(database: URL) -> None:
    url = full(database)
    empty = await run("--url", url, "health", "--all")
    assert empty.exit_code == ExitCode.NO_MATCH
    assert int(ExitCode.NO_MATCH) == 11  # documented
    assert empty.stdout == ""
    assert "no schema in this database holds a cronoq cluster" in empty.stderr
    await make_fleet(database, heads=["alpha"])
    for command in ("status", "health", "migrate"):
        result = await run("--url", url, command, "--schemas", "beta*")
        assert result.exit_code == ExitCode.NO_MATCH, result.output
        assert result.stdout == ""
        assert result.stderr == (
            "Error: no cluster schema matches 'beta*' (a glob: * matches any run of characters, "
            "? one character; names compare case-sensitively)\n"
        )
    unreachable = await run("--url", full(database.set(port=1)), "status", "--all")
    assert unreachable.exit_code == ExitCode.UNREACHABLE
    no_password(database, empty.output, result.output, unreachable.output)


# --- migrate -------------------------------------------------------------------------------


def environment(url: URL) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
    env.update({URL_ENV: full(url), "PYTHONPATH": str(ROOT)})
    return env


async def migrate(url: URL, *args: str) -> tuple[int, str, str]:
    """``cronoq-store migrate ARGS`` in a process of its own, as an operator runs it."""
    process = await asyncio.create_subprocess_exec(
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
    out, err = await asyncio.wait_for(process.communicate(), 180)
    assert process.returncode is not None
    no_password(url, out.decode(), err.decode())
    return process.returncode, out.decode(), err.decode()


def outcomes(stdout: str) -> dict[str, str]:
    """Each progress line's schema and its last words (``ok``, ``already current``...)."""
    found = {}
    for line in lines(stdout):
        if line.startswith("["):
            _, schema, rest = line.split(maxsplit=2)
            found[schema] = rest
    return found


async def test_migrate_all_brings_every_cluster_to_head_and_a_second_run_does_nothing(
    database: URL,
) -> None:
    behind = [f"fleet_{n:02}" for n in range(6)]
    await make_fleet(database, heads=["fleet_top", "other"], behind=behind, planted=True)

    code, out, err = await migrate(database, "--schemas", "fleet_*", "--jobs", "2")
    assert code == 0, (out, err)
    done = outcomes(out)
    assert sorted(done) == sorted([*behind, "fleet_top"])
    for schema in behind:
        assert done[schema].startswith(f"{OLD} -> {head_revision()}  ")
        assert done[schema].endswith(" s  ok")
    assert done["fleet_top"] == f"at {head_revision()}  already current"
    progress = [line.split()[0] for line in lines(out) if line.startswith("[")]
    assert progress == [f"[{n}/7]" for n in range(1, 8)]
    assert lines(out)[-1].startswith(
        "summary: 7 cluster(s), clusters matching 'fleet_*': migrated 6, already current 1, "
        "failed 0, refused 0, skipped 0 in "
    )
    assert set((await revisions(database, [*behind, "fleet_top"])).values()) == {head_revision()}

    again, out, err = await migrate(database, "--schemas", "fleet_*", "--jobs", "2")
    assert again == 0, (out, err)
    assert set(outcomes(out).values()) == {f"at {head_revision()}  already current"}
    assert "migrated 0, already current 7, failed 0" in lines(out)[-1]

    every, out, err = await migrate(database, "--all")
    assert every == ExitCode.FAILED, (out, err)
    done = outcomes(out)
    assert done["planted"].startswith("refused: schema 'planted' is not safe to use")
    assert done[BAD_NAME].startswith("refused: invalid schema name")
    assert "migrated 0, already current 8, failed 0, refused 2, skipped 0" in lines(out)[-1]


async def test_a_failure_in_one_cluster_does_not_stop_the_others_unless_fail_fast(
    database: URL,
) -> None:
    behind = [f"fleet_{n:02}" for n in range(4)]
    await make_fleet(database, behind=behind)
    # A migration lock held elsewhere makes fleet_01's migration give up (exit 9).
    async with MigrationLock(database, "fleet_01"):
        code, out, err = await migrate(
            database, "--all", "--jobs", "1", "--lock-timeout", "0.5", "--fail-fast"
        )
        assert code == ExitCode.LOCK_HELD, (out, err)
        done = outcomes(out)
        assert done["fleet_00"].endswith("ok")
        assert "failed (exit 9): gave up waiting for the migration lock" in done["fleet_01"]
        assert done["fleet_02"] == "skipped (not started)"
        assert done["fleet_03"] == "skipped (not started)"
        assert "fleet_01: " in err  # its stderr, forwarded with the schema in front

        code, out, err = await migrate(database, "--all", "--jobs", "1", "--lock-timeout", "0.5")
        assert code == ExitCode.LOCK_HELD, (out, err)
        done = outcomes(out)
        assert done["fleet_00"].endswith("already current")
        assert "failed (exit 9)" in done["fleet_01"]
        assert done["fleet_02"].endswith("ok")
        assert done["fleet_03"].endswith("ok")
    code, out, err = await migrate(database, "--all")
    assert code == 0, (out, err)
    assert "migrated 1, already current 3" in lines(out)[-1]


class MigrationLock:
    """A session of the test's holding a schema's migration lock, as another operator's
    migration would."""

    def __init__(self, url: URL, schema: str) -> None:
        self.url, self.schema = url, schema
        self.conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> MigrationLock:
        self.conn = await asyncpg.connect(asyncpg_dsn(self.url))
        await self.conn.execute(
            "SELECT pg_advisory_lock($1, hashtext($2))", LOCK_NS_MIGRATE, self.schema
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.conn is not None
        await self.conn.close()


async def start(url: URL, *args: str) -> asyncio.subprocess.Process:
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


async def read_until(stream: asyncio.StreamReader | None, wanted: str, said: list[str]) -> None:
    """Read ``stream``'s lines into ``said`` until one holds ``wanted``."""
    assert stream is not None

    async def reading() -> None:
        async for raw in stream:
            said.append(raw.decode())
            if wanted in said[-1]:
                return
        raise AssertionError(f"{wanted!r} never said: {said}")

    await asyncio.wait_for(reading(), 60)


async def cli_sessions(url: URL) -> bool:
    """Whether no session of the command is left in the database."""
    rows = await admin_execute(
        url,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name = 'cronoq-store cli'",
    )
    return rows == []


async def test_an_interrupted_run_waits_or_cancels_and_a_rerun_finishes_the_rest(
    database: URL,
) -> None:
    behind = [f"fleet_{n:02}" for n in range(6)]
    await make_fleet(database, behind=behind)

    # SIGTERM while fleet_02's migration waits for a lock: nothing more starts, and the
    # parent waits for that one, which migrates once the lock is free.
    said: list[str] = []
    async with MigrationLock(database, "fleet_02") as held:
        parent = await start(database, "--all", "--jobs", "1", "--lock-timeout", "60")
        await read_until(parent.stderr, "fleet_02: waiting for the migration lock", said)
        parent.send_signal(signal.SIGTERM)
        await read_until(parent.stderr, "SIGTERM: starting no more migrations", said)
        await asyncio.sleep(0.3)
        assert parent.returncode is None  # still waiting for fleet_02
        assert held.conn is not None
        await held.conn.execute("SELECT pg_advisory_unlock_all()")
        out, err = await asyncio.wait_for(parent.communicate(), 60)
    assert parent.returncode == 128 + signal.SIGTERM, (out, said, err)
    done = outcomes(out.decode())
    assert [done[s].endswith("ok") for s in behind] == [True] * 3 + [False] * 3
    for schema in behind[3:]:
        assert done[schema] == "skipped (not started)"
    assert lines(out.decode())[-1].endswith(
        "interrupted by SIGTERM: run the same command again to finish"
    )
    assert "migrated 3, already current 0, failed 0, refused 0, skipped 3" in out.decode()
    versions = await revisions(database, behind)
    assert [versions[s] for s in behind] == [head_revision()] * 3 + [OLD] * 3

    # SIGINT twice while fleet_04's migration waits: the second cancels it, rolled back.
    said = []
    async with MigrationLock(database, "fleet_04"):
        parent = await start(database, "--all", "--jobs", "1", "--lock-timeout", "60")
        await read_until(parent.stderr, "fleet_04: waiting for the migration lock", said)
        parent.send_signal(signal.SIGINT)
        await read_until(parent.stderr, "SIGINT: starting no more migrations", said)
        parent.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(parent.communicate(), 60)
        assert parent.returncode == 128 + signal.SIGINT, (out, said, err)
        # The child's session is gone, its transaction rolled back, while the lock is held.
        await until(lambda: cli_sessions(database), "the cancelled migration's session to end")
    done = outcomes(out.decode())
    assert done["fleet_03"].endswith("ok")
    assert done["fleet_04"].endswith("skipped (cancelled)")
    assert done["fleet_05"] == "skipped (not started)"
    versions = await revisions(database, behind)
    assert [versions[s] for s in behind] == [head_revision()] * 4 + [OLD] * 2

    code, out_text, err_text = await migrate(database, "--all", "--jobs", "2")
    assert code == 0, (out_text, err_text)
    assert "migrated 2, already current 4, failed 0, refused 0, skipped 0" in out_text
    assert set((await revisions(database, behind)).values()) == {head_revision()}
    no_password(database, "".join(said), out.decode(), err.decode())


async def test_a_worker_whose_parent_is_killed_stops_and_its_migration_rolls_back(
    database: URL,
) -> None:
    """SIGKILL cannot be caught: the workers learn of it from the kernel (Linux), cancel
    their migration and end, rather than go on with nobody reading what they say."""
    if sys.platform != "linux":
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    await make_fleet(database, behind=["fleet_00", "fleet_01"])
    said: list[str] = []
    async with MigrationLock(database, "fleet_00"):
        parent = await start(database, "--all", "--jobs", "2", "--lock-timeout", "300")
        await read_until(parent.stderr, "fleet_00: waiting for the migration lock", said)
        parent.kill()
        await parent.wait()
        # Well within the worker's 300 s lock timeout: it did not wait that out.
        await until(
            lambda: cli_sessions(database), "the orphaned worker's session to end", within=30
        )
    versions = await revisions(database, ["fleet_00"])
    assert versions["fleet_00"] == OLD


async def test_trusted_triggers_reach_the_workers(database: URL) -> None:
    """A trigger the operator names is trusted by the parent's checks and by each worker's
    migration alike; unnamed, the schema is refused before any worker sees it."""
    engine = create_async_engine(async_url(database))
    try:
        await upgrade(engine, "audited", OLD)
    finally:
        await engine.dispose()
    await admin_execute(
        database,
        "CREATE FUNCTION audited.f() RETURNS trigger LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$",
    )
    await admin_execute(
        database,
        "CREATE TRIGGER audit BEFORE INSERT ON audited.cronoq_tasks "
        "FOR EACH ROW EXECUTE FUNCTION audited.f()",
    )
    refused, out, err = await migrate(database, "--all")
    assert refused == ExitCode.FAILED, (out, err)
    assert outcomes(out)["audited"].startswith("refused: schema 'audited' is not safe to use")
    code, out, err = await migrate(database, "--all", "--trusted-trigger", "audit")
    assert code == 0, (out, err)
    assert outcomes(out)["audited"].startswith(f"{OLD} -> {head_revision()}  ")


async def test_a_newer_schema_fails_with_5_and_a_hostile_name_prints_as_visible_escapes(
    database: URL,
) -> None:
    await make_fleet(database, heads=["newer"], behind=["older"])
    await admin_execute(database, f"UPDATE newer.{VERSION_TABLE} SET version_num = '9999_future'")
    hostile = "x\x1b]0;owned\x07\u202ey"
    await admin_execute(database, f'CREATE SCHEMA "{hostile}"')
    await admin_execute(database, f'CREATE TABLE "{hostile}".{VERSION_TABLE} (version_num text)')

    code, out, err = await migrate(database, "--all")
    assert code == ExitCode.FAILED, (out, err)  # refused (1) is graver than newer (5)
    done = outcomes(out)
    assert "failed (exit 5): schema 'newer' is at revision 9999_future" in done["newer"]
    assert done["older"].endswith("ok")
    assert done["x\\x1b]0;owned\\x07\\u202ey"].startswith("refused: invalid schema name")
    health = await run("--url", full(database), "health", "--all")
    for text in (out, err, health.stdout, health.stderr):
        assert "\x1b" not in text
        assert "\u202e" not in text
    assert by_schema(health.stdout)["newer"][0] == "5"
    code, out, err = await migrate(database, "--schemas", "newer")
    assert code == ExitCode.NEWER_DATABASE, (out, err)
