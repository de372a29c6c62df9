"""Usage errors exit 2 wherever they are found, global options follow the command as operators
type them, and both prunes count their cutoff on the database server's clock."""

from __future__ import annotations

import time

import pytest
from sqlalchemy.engine import URL

from cronoq_store._cli import ExitCode
from cronoq_store._domain import Mutation, TaskStatus
from cronoq_store._store import PgStore

from .pgharness import admin_execute
from .support import HOUR, START_BASE, changed, full, run, submitted, without_ages


@pytest.mark.parametrize(
    "args",
    [
        ["downgrade", "base", "--sql"],
        ["downgrade", "0001_base", "--sql"],
        ["migrate", "no_such_revision", "--sql"],
        ["migrate", "0001_base:no_such_revision", "--sql"],
    ],
)
async def test_an_offline_script_alembic_refuses_is_a_usage_error(args: list[str]) -> None:
    result = await run("--schema", "ops_review", *args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.stderr.startswith("Error: ")
    assert result.stdout == ""


async def test_url_schema_and_triggers_may_follow_the_command(pg_url: URL, store: PgStore) -> None:
    await store.commit(0, START_BASE, [submitted(1, key="k"), changed(1, TaskStatus.SUCCEEDED)], [])
    url, schema = full(pg_url), store.config.schema
    before = await run("--url", url, "--schema", schema, "tasks", "show", "1")
    assert before.exit_code == 0, before.output
    for args in (
        ["tasks", "show", "1", "--url", url, "--schema", schema],
        ["tasks", "show", f"--url={url}", "1", f"--schema={schema}"],
        ["--schema", schema, "tasks", "show", "1", "--url", url, "--trusted-trigger", "audit"],
    ):
        after = await run(*args)
        assert after.exit_code == 0, (args, after.output)
        assert without_ages(after.stdout) == without_ages(before.stdout)
    # The last --url wins, as the last --schema does.
    wrong = await run("--url", url, "status", "--url", "postgresql://x@127.0.0.1:1/db")
    assert wrong.exit_code == ExitCode.UNREACHABLE


async def test_both_prunes_count_from_the_servers_clock(
    pg_url: URL, store: PgStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine whose clock runs two days ahead must not prune what finished an hour ago
    (nor one behind keep what is old): the server's clock is the one every pruner shares."""
    batch: list[Mutation] = []
    for id in (1, 2):  # finished an hour ago
        batch += [submitted(id), changed(id, TaskStatus.SUCCEEDED, at=-HOUR)]
    batch += [submitted(3), changed(3, TaskStatus.FAILED, at=-30 * HOUR)]  # old
    await store.commit(0, START_BASE, batch, [])
    schema = store.config.schema
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 48 * HOUR)
    assert await store.prune(24 * 3600) == 1
    dry = await run(
        "--url", full(pg_url), "--schema", schema, "prune", "--older-than", "1d", "--dry-run"
    )
    assert "would prune 0 finished tasks" in dry.stdout, dry.output
    monkeypatch.setattr(time, "time_ns", lambda: real() - 48 * HOUR)
    assert await store.prune(1800) == 2
    rows = await admin_execute(pg_url, f'SELECT count(*) AS n FROM "{schema}".cronoq_tasks')
    assert rows[0]["n"] == 0
