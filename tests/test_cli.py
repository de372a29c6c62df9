"""The ``cronoq-store`` command line against a real server, errors and exit codes included.

Commands run through click's ``CliRunner`` in a worker thread (each command runs its own
event loop, and the tests' loop keeps serving stores that lead meanwhile); the console script
itself runs as a subprocess where only a real process can show the exit status and stderr.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store._cli import ExitCode, parse_duration
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    Dependency,
    FixedStart,
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._migrations import head_revision
from cronoq_store._store import PgStore
from cronoq_store._urls import URL_ENV

from .pgharness import admin_execute, asyncpg_dsn
from .support import (
    CANCELLED,
    DAY,
    FAILED,
    START_BASE,
    SUCCEEDED,
    changed,
    full,
    older_revisions,
    open_store,
    run,
    settles,
    submitted,
    submitted_in,
    without_ages,
)
from .waits import bounded


def first_cells(output: str) -> list[int]:
    """The ids in the first column of a piped (tab-separated) table."""
    return [int(m) for m in re.findall(r"^(\d+)\t", output, flags=re.MULTILINE)]


# --- usage, connection and URL errors ---------------------------------------------------------


async def test_help_documents_the_exit_codes() -> None:
    result = await run("--help")
    assert result.exit_code == 0
    for code, words in (
        (ExitCode.UNREACHABLE, "cannot connect"),
        (ExitCode.NOT_MIGRATED, "not migrated"),
        (ExitCode.NEWER_DATABASE, "newer cronoq-store"),
    ):
        assert re.search(rf"^\s+{int(code)}\s+.*{words}", result.output, re.MULTILINE), code
    assert URL_ENV in result.output


async def test_a_missing_url_or_bad_schema_name_is_a_usage_error() -> None:
    result = await run("status")
    assert result.exit_code == ExitCode.USAGE
    assert "no database URL: pass --url or set $CRONOQ_DATABASE_URL" in result.stderr

    bad = await run("--url", "postgresql://x@127.0.0.1/db", "--schema", 'x"; drop', "status")
    assert bad.exit_code == ExitCode.USAGE
    assert "invalid schema name" in bad.stderr


async def test_a_wrong_password_exits_3_with_every_password_masked(
    pg_url: URL, migrated: str
) -> None:
    secret = pg_url.password or ""
    wrong = pg_url.set(password=f"wrong-{secret}-pw")
    by_option = await run("--url", full(wrong), "--schema", migrated, "status")
    by_env = await run("--schema", migrated, "tasks", "show", "1", env={URL_ENV: full(wrong)})
    for result in (by_option, by_env):
        assert result.exit_code == ExitCode.UNREACHABLE, result.output
        assert "password authentication failed" in result.stderr
        assert f"cannot connect to postgresql://postgres:***@{pg_url.host}" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert f"wrong-{secret}-pw" not in result.output
        assert secret not in result.output


async def test_unreachable_servers_exit_3_and_malformed_urls_are_usage_errors_masked() -> None:
    refused = await run("--url", "postgresql://ops:hunter22@127.0.0.1:1/app", "status")
    assert refused.exit_code == ExitCode.UNREACHABLE
    assert "cannot connect to postgresql://ops:***@127.0.0.1:1/app" in refused.stderr
    unsupported = await run("--url", "mysql://ops:hunter22@db.example/app", "status")
    assert unsupported.exit_code == ExitCode.USAGE
    assert "unsupported database URL mysql://ops:***@db.example/app" in unsupported.stderr
    malformed = [unsupported]
    # Not a port, an unencoded "@" in the password, a libpq keyword DSN, another driver.
    for url in (
        "postgresql://ops:hunter22@db:notaport/app",
        "postgresql://ops:hunter@22@127.0.0.1:1/app",
        "host=127.0.0.1 port=1 user=ops password=hunter22 dbname=app",
        "postgresql+psycopg://ops:hunter22@127.0.0.1:1/app",
        "sqlite:///app.db",
    ):
        # Nothing is tried: a server on port 1 would have made this "cannot connect".
        result = await run("--url", url, "tasks", "show", "1")
        assert result.exit_code == ExitCode.USAGE, (url, result.output)
        assert "cannot connect" not in result.stderr
        malformed.append(result)
    for result in (refused, *malformed):
        assert "hunter22" not in result.output
        assert result.stderr.startswith("Error: ")
        assert len(result.stderr.splitlines()) == 1


async def test_console_script_prints_one_line_and_no_traceback(pg_url: URL, schema: str) -> None:
    script = shutil.which("cronoq-store", path=str(Path(sys.executable).parent))
    assert script is not None, "the cronoq-store console script is not installed"
    wrong = pg_url.set(password="wrong-password-123")

    def call(url: URL, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, "--url", full(url), "--schema", schema, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    unreachable, missing = await asyncio.gather(
        asyncio.to_thread(call, wrong, "status"), asyncio.to_thread(call, pg_url, "status")
    )
    assert unreachable.returncode == ExitCode.UNREACHABLE
    assert missing.returncode == ExitCode.NOT_MIGRATED
    for result in (unreachable, missing):
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "wrong-password-123" not in result.stdout + result.stderr
        assert (pg_url.password or "") not in result.stdout + result.stderr


# --- schema state --------------------------------------------------------------------------


async def test_missing_then_unmigrated_schema_exits_4(pg_url: URL, schema: str) -> None:
    commands = [["status"], ["tasks", "show", "1"], ["tasks", "finished"]]
    commands.append(["prune", "--older-than", "1d"])
    for command in commands:
        result = await run("--url", full(pg_url), "--schema", schema, *command)
        assert result.exit_code == ExitCode.NOT_MIGRATED, (command, result.output)
        assert f"schema {schema!r} does not exist: run `cronoq-store" in result.stderr

    await admin_execute(pg_url, f'CREATE SCHEMA "{schema}"')
    result = await run("--url", full(pg_url), "--schema", schema, "status")
    assert result.exit_code == ExitCode.NOT_MIGRATED
    assert re.search(r"^revision\s+- \(not migrated\)", result.stdout, re.M), result.stdout
    assert f"schema {schema!r} is not migrated" in result.stderr


async def test_a_newer_database_exits_5_everywhere(pg_url: URL, migrated: str) -> None:
    await admin_execute(
        pg_url, f"UPDATE \"{migrated}\".cronoq_alembic_version SET version_num = '9999_future'"
    )
    for command in (
        ["status"],
        ["migrate"],
        ["tasks", "finished"],
        ["prune", "--older-than", "1d"],
    ):
        result = await run("--url", full(pg_url), "--schema", migrated, *command)
        assert result.exit_code == ExitCode.NEWER_DATABASE, (command, result.output)
        assert "is at revision 9999_future, which this build does not know" in result.stderr
        assert "upgrade cronoq-store" in result.stderr


async def test_migrate_to_a_revision_then_to_head(pg_url: URL, schema: str) -> None:
    url = full(pg_url)
    first = await run("--url", url, "--schema", schema, "migrate", "0003_recurring_last_task_id")
    assert first.exit_code == 0, first.output
    assert f"schema {schema!r} upgraded: nothing -> 0003_recurring_last_task_id" in first.stdout

    behind = await run("--url", url, "--schema", schema, "status")
    assert behind.exit_code == ExitCode.NOT_MIGRATED
    pending = [*older_revisions(), head_revision()][3:]  # those after 0003, head last
    assert f"({len(pending)} revision(s) behind: {', '.join(pending)})" in behind.stdout
    assert f"behind this build's head {head_revision()}" in behind.stderr

    second = await run("--url", url, "--schema", schema, "migrate")
    assert second.exit_code == 0
    assert f"0003_recurring_last_task_id -> {head_revision()} (head)" in second.stdout
    again = await run("--url", url, "--schema", schema, "migrate")
    assert f"already at {head_revision()} (head)" in again.stdout
    status = await run("--url", url, "--schema", schema, "status")
    assert status.exit_code == 0, status.output
    assert re.search(rf"^revision\s+{head_revision()} \(up to date\)", status.stdout, re.M)

    unknown = await run("--url", url, "--schema", schema, "migrate", "nope")
    assert unknown.exit_code == ExitCode.FAILED
    assert "nope" in unknown.stderr


async def test_migrate_sql_prints_the_script_without_connecting() -> None:
    nowhere = "postgresql://ops:hunter22@127.0.0.1:1/app"
    result = await run("--url", nowhere, "--schema", "ops_review", "migrate", "--sql")
    assert result.exit_code == 0, result.output
    script = result.stdout
    assert script.index("BEGIN;") < script.index("pg_advisory_xact_lock(1668444013")
    assert "CREATE SCHEMA IF NOT EXISTS ops_review;" in script
    assert "CREATE TABLE ops_review.cronoq_tasks" in script
    assert script.rstrip().endswith("COMMIT;")

    last = await run("--schema", "ops_review", "migrate", "--sql", "0005_task_tenant:head")
    assert last.exit_code == 0, last.output
    assert "CREATE TABLE cronoq_tasks" not in last.stdout
    assert f"SET version_num='{head_revision()}'" in last.stdout


# --- status --------------------------------------------------------------------------------


async def test_status_names_the_session_holding_the_leader_lock(pg_url: URL, migrated: str) -> None:
    config = PgStoreConfig(schema=migrated, application_name="cli-probe")
    async with await PgStore.connect(pg_url, config) as leader:
        await leader.acquire_leadership()
        (row,) = await admin_execute(
            pg_url,
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE starts_with(application_name, 'cli-probe leader ')",
        )
        result = await run("--url", full(pg_url), "--schema", migrated, "status")
        assert result.exit_code == 0, result.output
        # Piped: no line padded after its value.
        assert [line for line in result.stdout.splitlines() if line.endswith(" ")] == []
        holder = re.search(
            r"^leader\s+instance ([0-9a-f]{8}), backend pid (\d+), 'cli-probe leader \1', "
            r"from (\S+)\s*$",
            result.stdout,
            re.M,
        )
        assert holder is not None, result.stdout
        assert row["application_name"] == f"cli-probe leader {holder[1]}"
        assert int(holder[2]) == row["pid"]
        assert holder[3] == "127.0.0.1"
        assert f"holds the advisory lock ({leader.leader_lock[0]}, {leader.leader_lock[1]})" in (
            result.stdout
        )
        assert re.search(r"^epoch\s+1\s*$", result.stdout, re.M)

        await leader.release_leadership()
        after = await run("--url", full(pg_url), "--schema", migrated, "status")
        assert re.search(r"^leader\s+none: no session holds", after.stdout, re.M), after.stdout


async def test_status_counts_tasks_quarantined_rows_and_schedules(
    pg_url: URL, store: PgStore
) -> None:
    schema = store.config.schema
    every = IntervalSchedule(every=timedelta(minutes=5))
    next_run = START_BASE.unix_ns + 3 * DAY
    batch: list[Mutation] = [
        submitted(1, pool="mail"),
        submitted(2, pool="mail"),
        changed(2, TaskStatus.RUNNING),
        submitted(3, pool="mail"),
        changed(3, SUCCEEDED),
        submitted(4, pool="batch"),
        changed(4, FAILED),
        submitted(5, pool="batch"),
        RecurringUpsert(RecurringSpec("digest", every, TaskSpec(b"t"))),
        RecurringNext("digest", next=next_run - START_BASE.unix_ns, last=TaskId(3)),
    ]
    await store.commit(0, START_BASE, batch, [])
    # An undecodable live row: recovery quarantines it as failed.
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_tasks SET deps = '[{{}}]' WHERE id = 5"
    )
    await store.recover(START_BASE)

    result = await run("--url", full(pg_url), "--schema", schema, "status")
    assert result.exit_code == 0, result.output
    # Piped, tables are tab-separated lines.
    rows = {tuple(line.split("\t")) for line in result.stdout.splitlines() if "\t" in line}
    assert {
        ("batch", "finished", "failed", "2"),
        ("mail", "finished", "succeeded", "1"),
        ("mail", "live", "queued", "1"),
        ("mail", "live", "running", "1"),
    } <= rows
    expected_next = datetime.fromtimestamp(next_run // 10**9, tz=timezone.utc)
    assert ("digest", "every 5m", f"{expected_next:%Y-%m-%d %H:%M:%S} UTC", "3") in rows
    assert re.search(r"^quarantined\s+1 rows\s*$", result.stdout, re.M)
    assert re.search(r"^epoch\s+0 \(no leader yet\)\s*$", result.stdout, re.M)
    assert re.search(r"^max id\s+5 \(0/5\)\s*$", result.stdout, re.M)


async def test_status_shows_schedules_nothing_can_decode(pg_url: URL, store: PgStore) -> None:
    """Rows written by hand: JSON nested past Python's recursion limit, an interval beyond
    any float. status still answers, and names them undecodable."""
    schema = store.config.schema
    deep = "[" * 1500 + "]" * 1500
    huge = "1" + "0" * 400
    for name, schedule in (("deep", deep), ("huge", f'{{"type": "interval", "every_ns": {huge}}}')):
        await admin_execute(
            pg_url,
            f'INSERT INTO "{schema}".cronoq_recurring (name, spec, template_payload) '
            f"VALUES ($1, CAST($2 AS jsonb), 'x')",
            name,
            f'{{"schedule": {schedule}, "template": {{}}}}',
        )

    result = await run("--url", full(pg_url), "--schema", schema, "status")
    assert result.exit_code == 0, result.output
    assert re.search(r"^deep\tundecodable: \[\[\[", result.stdout, re.M), result.stdout
    assert re.search(r"^huge\tundecodable: \{", result.stdout, re.M), result.stdout


# --- tasks ---------------------------------------------------------------------------------


async def test_tasks_show_prints_durations_the_retry_policy_and_times_in_words(
    pg_url: URL, store: PgStore
) -> None:
    fixed_at = 3 * 60 * 10**9
    await store.commit(
        0,
        START_BASE,
        [
            submitted(
                5,
                key="weekly",
                timeout=timedelta(seconds=30),
                duration_hint=timedelta(minutes=2, seconds=5),
                retry=RetryPolicy(5, timedelta(seconds=10), timedelta(minutes=5), 3.0),
                fixed_start=FixedStart(fixed_at, timedelta(milliseconds=250)),
                tags=["weekly"],
            )
        ],
        [],
    )
    url, schema = full(pg_url), store.config.schema
    shown = await run("--url", url, "--schema", schema, "tasks", "show", "weekly")
    assert shown.exit_code == 0, shown.output
    lines = dict(
        [*re.split(r"\s{2,}", line.rstrip(), maxsplit=1), ""][:2]
        for line in shown.stdout.splitlines()
        if line.strip()
    )
    assert lines["timeout"] == "30 s"
    assert lines["duration hint"] == "2 min 5 s"
    assert lines["retry"] == (
        "up to 5 attempts; waits 10 s after the first failure, multiplied by 3 after each "
        "failure after it, at most 5 min"
    )
    at = datetime.fromtimestamp((START_BASE.unix_ns + fixed_at) // 10**9, timezone.utc)
    assert re.fullmatch(
        rf"{at:%Y-%m-%d %H:%M:%S} UTC \([^()]+\), tolerance 250 ms, on miss skip",
        lines["fixed start"],
    ), lines["fixed start"]
    assert lines["tags"] == '["weekly"]'
    assert "ns" not in shown.stdout.replace("ms", "")

    as_json = json.loads(
        (await run("--url", url, "--schema", schema, "tasks", "show", "--json", "weekly")).stdout
    )
    assert as_json["spec"]["timeout_ns"] == 30 * 10**9
    assert as_json["spec"]["retry"]["max_attempts"] == 5


async def test_tasks_show_by_id_by_key_and_not_found(pg_url: URL, store: PgStore) -> None:
    await store.commit(
        0,
        START_BASE,
        [
            submitted(7, key="nightly", pool="etl", kind="report", tenant="acme"),
            changed(7, SUCCEEDED, message="all [/bold] good :fire:"),
            submitted(8, key="42"),
        ],
        [(TaskId(7), b"report.pdf")],
    )
    url, schema = full(pg_url), store.config.schema

    by_id = await run("--url", url, "--schema", schema, "tasks", "show", "7")
    assert by_id.exit_code == 0, by_id.output
    shown = dict(
        [*line.rstrip().split(None, 1), ""][:2]
        for line in by_id.stdout.splitlines()
        if line.strip()
    )
    assert shown["id"] == "7 (0/7)"
    assert (shown["key"], shown["pool"], shown["kind"], shown["tenant"]) == (
        "nightly",
        "etl",
        "report",
        "acme",
    )
    assert (shown["status"], shown["message"], shown["priority"]) == (
        "succeeded",
        "all [/bold] good :fire:",
        "normal",
    )
    assert shown["output"] == "10 bytes: b'report.pdf'"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(.+ ago\)", shown["updated"])
    assert (shown["timeout"], shown["retry"]) == ("-", "no retry: the first failure is final")

    by_key = await run("--url", url, "--schema", schema, "tasks", "show", "nightly")
    assert without_ages(by_key.stdout) == without_ages(by_id.stdout)
    numeric_key = await run("--url", url, "--schema", schema, "tasks", "show", "--key", "42")
    assert re.search(r"^status\s+queued\s*$", numeric_key.stdout, re.M), numeric_key.output

    missing = await run("--url", url, "--schema", schema, "tasks", "show", "42")
    assert missing.exit_code == ExitCode.FAILED
    assert "no task with id '42'" in missing.stderr
    too_big = await run("--url", url, "--schema", schema, "tasks", "show", str(2**63))
    assert too_big.exit_code == ExitCode.USAGE


async def test_tasks_show_takes_the_short_id_and_lists_a_number_of_several_epochs(
    pg_url: URL, store: PgStore
) -> None:
    one, other, alone = task_id(1, 42), task_id(3, 42), task_id(2, 7)
    batch: list[Mutation] = [
        submitted(one, key="first"),
        submitted(other, key="second"),
        submitted(alone, key="seventh"),
    ]
    await store.commit(0, START_BASE, batch, [])
    args = ("--url", full(pg_url), "--schema", store.config.schema, "tasks", "show")

    def facts(stdout: str) -> dict[str, str]:
        return dict(line.strip().split(None, 1) for line in stdout.splitlines() if line.strip())

    short = await run(*args, "3/42")
    assert short.exit_code == 0, short.output
    assert facts(short.stdout)["id"] == f"{other} (3/42)"
    assert facts(short.stdout)["key"] == "second"
    whole = await run(*args, str(alone))
    assert facts(whole.stdout)["id"] == f"{alone} (2/7)"
    # A number one epoch holds names that task.
    assert facts((await run(*args, "7")).stdout)["key"] == "seventh"

    several = await run(*args, "42")
    assert several.exit_code == ExitCode.AMBIGUOUS
    assert int(ExitCode.AMBIGUOUS) == 10  # documented
    assert "42 names 2 tasks of different epochs: give one as EPOCH/N" in several.stderr
    listed = [line.split("\t") for line in several.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[2]) for row in listed] == [
        (str(one), "1/42", "first"),
        (str(other), "3/42", "second"),
    ]
    as_json = await run(*args, "42", "--json")
    assert as_json.exit_code == ExitCode.AMBIGUOUS
    doc = json.loads(as_json.stdout)
    assert (doc["ambiguous"], doc["more"]) == ("42", False)
    assert [(t["id"], t["short_id"]) for t in doc["matches"]] == [(one, "1/42"), (other, "3/42")]

    assert "no task with id '4/42'" in (await run(*args, "4/42")).stderr
    assert (await run(*args, "32768/1")).exit_code == ExitCode.USAGE
    assert (await run(*args, f"1/{2**48}")).exit_code == ExitCode.USAGE
    # --key reads the same text as a key.
    assert (await run(*args, "--key", "3/42")).exit_code == ExitCode.FAILED
    help_text = (await run("tasks", "show", "--help")).stdout
    assert "EPOCH/N" in help_text
    assert "1/42 is task #42 of epoch 1" in help_text


def cursor_of(stdout: str) -> str | None:
    """The cursor a page printed for the next one, if any."""
    found = re.search(r"--cursor (\S+)", stdout)
    return None if found is None else found[1]


async def every_page(*args: str) -> list[list[int]]:
    """The ids of each page a listing prints, following its cursors to the end."""
    pages: list[list[int]] = []
    cursor: str | None = None
    while True:
        result = await run(*args, *(() if cursor is None else ("--cursor", cursor)))
        assert result.exit_code == 0, result.output
        pages.append(first_cells(result.stdout))
        cursor = cursor_of(result.stdout)
        if cursor is None:
            assert result.stdout.rstrip().endswith("end of list"), result.stdout
            return pages


async def test_tasks_finished_newest_first_with_the_consoles_filters(
    pg_url: URL, store: PgStore
) -> None:
    batch: list[Mutation] = []
    for id in range(1, 8):  # task n was updated n minutes ago: 1 is the newest
        batch += [
            submitted(id, pool="a" if id % 2 else "b", kind=f"k{id % 3}", tenant=f"t{id % 2}"),
            changed(id, [SUCCEEDED, FAILED][id % 2], at=-id * 60 * 10**9),
        ]
    batch += [submitted(8, key="nightly"), changed(8, CANCELLED, at=-DAY, message="m" * 100)]
    batch += [submitted(9, pool="a")]  # live: never listed
    await store.commit(0, START_BASE, batch, [])
    base = ("--url", full(pg_url), "--schema", store.config.schema, "tasks", "finished")

    assert await every_page(*base, "--limit", "3") == [[1, 2, 3], [4, 5, 6], [7, 8]]
    first = await run(*base, "--limit", "3")
    assert "8 matching, newest first" in first.stdout
    assert re.search(r"^next page \(older\): --cursor -?\d+\.\d+$", first.stdout, re.M)

    assert await every_page(*base, "--pool", "a", "--status", "FAILED") == [[1, 3, 5, 7]]
    assert await every_page(*base, "--kind", "k0", "--kind", "k2") == [[2, 3, 5, 6]]
    assert await every_page(*base, "--tenant", "t0") == [[2, 4, 6]]
    assert await every_page(*base, "--key", "nightly") == [[8]]
    since = datetime.fromtimestamp(START_BASE.unix_ns / 1e9, timezone.utc) - timedelta(
        minutes=4, seconds=30
    )
    window = await every_page(*base, "--since", since.strftime("%Y-%m-%dT%H:%M:%S"))
    assert window == [[1, 2, 3, 4]]
    assert await every_page(*base, "--pool", "none") == [[]]

    # A table cuts a message to its first 60 characters, marked; --full-messages does not.
    cut = await run(*base, "--key", "nightly")
    assert cut.stdout.splitlines()[1].endswith("\t" + "m" * 59 + "…")
    whole = await run(*base, "--key", "nightly", "--full-messages")
    assert whole.stdout.splitlines()[1].endswith("\t" + "m" * 100)

    live = await run(*base, "--status", "running")
    assert live.exit_code == ExitCode.USAGE
    assert (await run(*base, "--cursor", "12")).exit_code == ExitCode.USAGE


async def test_tasks_live_oldest_first_with_filters_ages_and_pages(
    pg_url: URL, store: PgStore
) -> None:
    hour = 3600 * 10**9
    batch: list[Mutation] = [
        Submitted(TaskId(1), seq=1, arrival=-2 * hour, spec=TaskSpec(b"p", pool="etl")),
        Submitted(TaskId(2), seq=2, arrival=-hour, spec=TaskSpec(b"p", kind="report")),
        submitted(3, pool="etl", tenant="acme", key="k3"),
        submitted(4, pool="web"),
        submitted(5, pool="etl"),
        submitted(6),
    ]
    batch += [
        StatusChanged(TaskId(3), TaskStatus.RUNNING, attempt=1, at=0),
        StatusChanged(TaskId(4), TaskStatus.RETRYING, attempt=1, at=0, message="x" * 80),
        changed(6, SUCCEEDED),  # finished: never listed
    ]
    await store.commit(0, START_BASE, batch, [])
    base = ("--url", full(pg_url), "--schema", store.config.schema, "tasks", "live")

    assert await every_page(*base, "--limit", "2") == [[1, 2], [3, 4], [5]]
    first = await run(*base)
    assert "5 matching, oldest first" in first.stdout
    header, *rows = first.stdout.splitlines()[:6]
    columns = header.split("\t")
    assert columns[:9] == [
        "id",
        "short",
        "key",
        "pool",
        "kind",
        "tenant",
        "status",
        "attempt",
        "age",
    ]
    cells = [dict(zip(columns, row.split("\t"), strict=True)) for row in rows]
    assert [c["status"] for c in cells] == ["queued", "queued", "running", "retrying", "queued"]
    assert cells[0]["age"].startswith("2h ")
    assert cells[1]["age"].startswith("1h ")
    assert cells[3]["message"] == "x" * 59 + "…"

    assert await every_page(*base, "--pool", "etl") == [[1, 3, 5]]
    assert await every_page(*base, "--status", "running", "--status", "RETRYING") == [[3, 4]]
    assert await every_page(*base, "--kind", "report") == [[2]]
    assert await every_page(*base, "--tenant", "acme", "--key", "k3") == [[3]]
    assert (await run(*base, "--status", "succeeded")).exit_code == ExitCode.USAGE

    before = time.time_ns()
    doc = json.loads((await run(*base, "--limit", "1", "--json")).stdout)
    after = time.time_ns()
    assert set(doc) == {
        "tasks",
        "next",
        "scan_stopped",
        "scan",
        "matching",
        "matching_at_least",
        "counted",
    }
    assert (doc["next"], doc["matching"], doc["matching_at_least"]) == ("1", 5, False)
    (task,) = doc["tasks"]
    assert (task["id"], task["short_id"], task["status"], task["pool"]) == (
        1,
        "0/1",
        "queued",
        "etl",
    )
    # Its age is since it arrived: two hours before START_BASE (taken when the suite was
    # imported); read while the command ran (a second either side for the age's rounding).
    arrived = START_BASE.unix_ns - 2 * hour
    assert (before - arrived) / 1e9 - 1 <= task["age_seconds"] <= (after - arrived) / 1e9 + 1
    assert rfc3339_ns(task["arrival"]) // 10**9 == (START_BASE.unix_ns - 2 * hour) // 10**9


def rfc3339_ns(text: str) -> int:
    moment = datetime.fromisoformat(text.removesuffix("Z") + "+00:00")
    return int(moment.timestamp()) * 10**9 + moment.microsecond * 1000


async def test_listings_stop_at_their_bound_and_say_at_least(pg_url: URL, store: PgStore) -> None:
    """Past the bound a page has examined, it says how far it looked and offers a cursor;
    past the count's bound, the count says "at least"."""
    from cronoq_store import _listing_statements as ls

    schema = store.config.schema
    many = ls.SCAN + 10
    now = START_BASE.unix_ns
    await admin_execute(
        pg_url,
        f"""
        INSERT INTO "{schema}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority,
            payload, status, terminal, attempt, updated_unix_ns)
        SELECT n, n, {now}, CASE WHEN n IN (10, {2 * many}) THEN 'rare' ELSE 'bulk' END, '', 0,
               '\\x00'::bytea, CASE WHEN n % 2 = 0 THEN 'queued' ELSE 'succeeded' END,
               n % 2 = 1, 0, {now} - n * 1000
        FROM generate_series(1, {2 * many}) AS n
        """,
    )
    base = ("--url", full(pg_url), "--schema", schema, "tasks")

    live = await run(*base, "live", "--pool", "rare")
    assert first_cells(live.stdout) == [10]
    assert (
        f"at least 1 matching (counted among the oldest {ls.LIVE_SAMPLE:,} live tasks)"
        in live.stdout
    )
    assert f"looked at {ls.SCAN:,} live tasks from here and found only these" in live.stdout
    further = await run(*base, "live", "--pool", "rare", "--cursor", str(cursor_of(live.stdout)))
    assert first_cells(further.stdout) == [2 * many]
    assert "end of list" in further.stdout

    # Finished: odd ids, newest first (the smaller the id, the newer); none of them is rare.
    finished = await run(*base, "finished", "--pool", "bulk", "--limit", "2")
    assert first_cells(finished.stdout) == [1, 3]
    assert f"at least {ls.SAMPLE:,} matching (counted among the newest" in finished.stdout
    nothing = await run(*base, "finished", "--pool", "rare", "--json")
    doc = json.loads(nothing.stdout)
    assert (doc["tasks"], doc["scan_stopped"], doc["matching"]) == ([], True, 0)
    assert doc["matching_at_least"] is True
    assert doc["next"] is not None


# --- prune ---------------------------------------------------------------------------------


async def test_prune_dry_run_counts_what_prune_then_deletes(pg_url: URL, store: PgStore) -> None:
    batch: list[Mutation] = []
    for id in range(1, 6):  # old and unprotected: prunable
        batch += [submitted(id), changed(id, SUCCEEDED, at=-2 * DAY)]
    batch += [submitted(6, key="base"), changed(6, CANCELLED, at=-3 * DAY)]  # old, protected
    batch += [submitted(7), changed(7, FAILED, at=-DAY // 2)]  # recent
    batch += [submitted(8, deps=[Dependency("base")])]  # live, depends on 6 by key
    await store.commit(0, START_BASE, batch, [])
    url, schema = full(pg_url), store.config.schema

    async def ids() -> list[int]:
        rows = await admin_execute(pg_url, f'SELECT id FROM "{schema}".cronoq_tasks ORDER BY id')
        return [r["id"] for r in rows]

    dry = await run("--url", url, "--schema", schema, "prune", "--older-than", "1d", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "would prune 5 finished tasks last updated before" in dry.stdout
    assert "(1d ago)" in dry.stdout
    assert "would keep 1 of them that live tasks depend on" in dry.stdout
    assert await ids() == list(range(1, 9))

    real = await run("--url", url, "--schema", schema, "prune", "--older-than", "24h")
    assert real.exit_code == 0, real.output
    assert "pruned 5 finished tasks" in real.stdout
    assert "kept 1 of them that live tasks depend on" in real.stdout
    assert await ids() == [6, 7, 8]

    wider = await run("--url", url, "--schema", schema, "prune", "--older-than", "1h", "--dry-run")
    assert "would prune 1 finished tasks" in wider.stdout  # 7; 6 stays protected


async def test_prune_json_says_what_it_counted_kept_and_deleted(
    pg_url: URL, store: PgStore
) -> None:
    """One JSON document on stdout, nothing on stderr (no progress bar), in a dry run and a
    real one; weeks are a unit."""
    batch: list[Mutation] = []
    for id in range(1, 4):  # three weeks old, unprotected
        batch += [submitted(id), changed(id, SUCCEEDED, at=-21 * DAY)]
    batch += [submitted(4, key="base"), changed(4, FAILED, at=-21 * DAY)]  # protected
    batch += [submitted(5, deps=[Dependency("base")])]
    batch += [submitted(6), changed(6, SUCCEEDED, at=-DAY)]  # recent
    await store.commit(0, START_BASE, batch, [])
    url, schema = full(pg_url), store.config.schema
    command = ("--url", url, "--schema", schema, "prune", "--older-than", "2w", "--json")

    dry = await run(*command, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stderr == ""
    counted = json.loads(dry.stdout)
    cutoff = datetime.fromisoformat(counted.pop("cutoff").replace("Z", "+00:00"))
    assert abs(cutoff - (datetime.now(timezone.utc) - timedelta(weeks=2))) < timedelta(minutes=5)
    assert counted == {
        "schema": schema,
        "dry_run": True,
        "older_than_s": 14 * 86400,
        "prunable": 3,
        "protected": 1,
        "deleted": None,
    }

    real = await run(*command)
    assert real.exit_code == 0, real.output
    assert real.stderr == ""
    done = json.loads(real.stdout)
    assert (done["dry_run"], done["prunable"], done["protected"], done["deleted"]) == (
        False,
        3,
        1,
        3,
    )
    rows = await admin_execute(pg_url, f'SELECT id FROM "{schema}".cronoq_tasks ORDER BY id')
    assert [r["id"] for r in rows] == [4, 5, 6]


async def test_prune_json_that_fails_prints_nothing_on_stdout(pg_url: URL, migrated: str) -> None:
    """A script reading ``prune --json`` gets one document or nothing: a failure is one line
    on stderr, the password masked, with its exit code."""
    url = full(pg_url)
    wrong = full(pg_url.set(password="wrong-password-123"))
    await admin_execute(
        pg_url,
        f'UPDATE "{migrated}".cronoq_alembic_version'
        " SET version_num = '0003_recurring_last_task_id'",
    )
    for given, schema, code in (
        (url, migrated, ExitCode.NOT_MIGRATED),  # behind this build
        (url, "public", ExitCode.NOT_MIGRATED),  # holds no cluster
        (url, f"{migrated}_none", ExitCode.NOT_MIGRATED),
        (wrong, migrated, ExitCode.UNREACHABLE),
        ("postgresql://x:sekrit-123@127.0.0.1:1/db", migrated, ExitCode.UNREACHABLE),
    ):
        command = ("--url", given, "--schema", schema, "prune", "--older-than", "2w", "--json")
        result = await run(*command)
        assert (result.exit_code, result.stdout) == (code, ""), (schema, result.output)
        assert len(result.stderr.splitlines()) == 1, result.stderr
        for secret in ("wrong-password-123", "sekrit-123", pg_url.password or ""):
            assert secret not in result.stderr


async def test_prune_waits_for_a_commit_that_adds_a_dependency(pg_url: URL, schema: str) -> None:
    """As the store's prune does (tests/test_prune_race.py): a batch waits for a commit in
    flight, so a dependency that commit adds protects its target."""
    async with open_store(pg_url, schema, application_name=f"c-{schema}") as store:
        epoch = await store.acquire_leadership()
        done, dependent = task_id(epoch, 1), task_id(epoch, 3)
        await store.commit(
            epoch,
            START_BASE,
            [submitted_in(epoch, 1), StatusChanged(done, SUCCEEDED, 1, START_BASE.engine_ns)],
            [],
        )
        batch: list[Mutation] = [submitted_in(epoch, 3, deps=[Dependency(done)])]
        # An uncommitted row with the dependent's id: the commit's insert waits on it.
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        tx = blocker.transaction()
        await tx.start()
        try:
            await blocker.execute(
                "CREATE TEMPORARY TABLE copy ON COMMIT DROP AS "
                f'SELECT * FROM "{schema}".cronoq_tasks WHERE id = {done}; '
                f"UPDATE copy SET id = {dependent}, key = NULL; "
                f'INSERT INTO "{schema}".cronoq_tasks SELECT * FROM copy'
            )
            commit = asyncio.create_task(store.commit(epoch, START_BASE, batch, []))
            await settles(pg_url, f"c-{schema}", commit)
            assert not commit.done(), "the commit was not held open"
            url = full(pg_url)
            prune = asyncio.create_task(
                run("--url", url, "--schema", schema, "prune", "--older-than", "0s")
            )
            await settles(pg_url, "cronoq-store cli", prune)
            waited = not prune.done()
            await tx.rollback()
            await bounded(commit, "the commit once the blocker rolled back")
            pruned = await bounded(prune, "the CLI's prune once the commit is done")
        finally:
            await blocker.close()
    assert pruned.exit_code == 0, pruned.output
    rows = await admin_execute(pg_url, f'SELECT id FROM "{schema}".cronoq_tasks')
    assert {r["id"] for r in rows} == {done, dependent}, "prune deleted a depended-on task"
    assert waited, "prune did not wait for the commit in flight"
    assert "pruned 0 finished tasks" in pruned.stdout


def test_durations_parse_whole_units() -> None:
    assert [parse_duration(d) for d in ("30s", "15m", "12h", "7d", "2w", " 0s ")] == [
        30,
        900,
        43200,
        604800,
        1209600,
        0,
    ]


@pytest.mark.parametrize(
    "text", ["7", "7x", "1.5h", "-1d", "", "d", "7 days", "1y", "36501d", "5215w", "9" * 5000 + "s"]
)
async def test_bad_durations_are_usage_errors(text: str) -> None:
    result = await run("--url", "postgresql://x@127.0.0.1:1/db", "prune", "--older-than", text)
    assert result.exit_code == ExitCode.USAGE
    assert "Invalid value for '--older-than'" in result.stderr
    too_long = text in ("36501d", "5215w") or len(text) > 100
    assert ("too long" if too_long else "is not a duration") in result.stderr
    assert "sys." not in result.stderr  # the interpreter's own limits are not the reason
    assert len(result.stderr) < 500  # the text quoted to a bound
