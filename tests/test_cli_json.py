"""What a script or an orchestrator reads from ``cronoq-store``: ``health`` and its exit
codes, ``--json`` documents, and task ids whole at any terminal width and when piped. Against
a real server; the narrow terminal is a real pty."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import subprocess
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any
from unittest.mock import ANY

from sqlalchemy.engine import URL

from cronoq_store import Mutation, PgStore, PgStoreConfig, TaskId, TaskStatus, task_id
from cronoq_store._cli import ExitCode
from cronoq_store._cli.output import short_id
from cronoq_store._migrations import head_revision

from .pgharness import admin_execute
from .support import (
    START_BASE,
    changed,
    cli_command,
    cli_environment,
    full,
    ha_config,
    run,
    submitted,
)
from .waits import bounded

#: The largest id an epoch can issue: 19 digits, the widest an id gets.
WIDE = task_id(32767, (1 << 48) - 1)


def document(stdout: str) -> Any:
    """The one JSON document on stdout (``json.loads`` refuses anything around it)."""
    return json.loads(stdout)


def rfc3339(text: str) -> datetime:
    assert text.endswith("Z"), text
    moment = datetime.fromisoformat(text.removesuffix("Z") + "+00:00")
    assert moment.tzinfo == timezone.utc
    return moment


# --- health --------------------------------------------------------------------------------


async def test_health_exits_0_only_with_a_leader_at_head(pg_url: URL, migrated: str) -> None:
    url = full(pg_url)
    leaderless = await run("--url", url, "--schema", migrated, "health")
    assert leaderless.exit_code == ExitCode.NO_LEADER
    assert int(ExitCode.NO_LEADER) == 6  # documented
    assert leaderless.stdout == "unhealthy: no instance holds the leader lock\n"

    config = PgStoreConfig(schema=migrated, application_name="probe-a")
    async with await PgStore.connect(pg_url, config) as leader:
        epoch = await leader.acquire_leadership()
        (row,) = await admin_execute(
            pg_url,
            "SELECT pid, application_name FROM pg_stat_activity "
            "WHERE starts_with(application_name, 'probe-a leader ')",
        )
        name = row["application_name"]
        plain = await run("--url", url, "--schema", migrated, "health")
        assert plain.exit_code == ExitCode.OK, plain.output
        assert plain.stdout == (
            f"healthy: schema {migrated} at {head_revision()}, leader's backend pid {row['pid']} "
            f"({name}), epoch {epoch}\n"
        )
        probe = await run("--url", url, "--schema", migrated, "health", "--json")
        assert probe.exit_code == ExitCode.OK
        doc = document(probe.stdout)
        assert doc["leader"]["since"] is not None
        assert rfc3339(doc["leader"].pop("since")) <= datetime.now(timezone.utc)
        # The lock's holder, whoever it is; here the leader.
        assert doc.pop("lock_holder") == {**doc["leader"], "since": ANY}
        assert doc == {
            "healthy": True,
            "schema": migrated,
            "revision": [head_revision()],
            "head": head_revision(),
            "at_head": True,
            "revision_state": "up to date",
            "stored_epoch": epoch,
            "incarnation": leader.incarnation,
            "leader": {
                "pid": row["pid"],
                "instance": name.removeprefix("probe-a leader "),
                "application_name": name,
                "client_addr": "127.0.0.1",
                "role": pg_url.username,
                "store_instance": True,
            },
            "migration_lock": None,
            "reasons": [],
            "warnings": [],
            # A standalone cluster gains only its mode; a hosted one's "host" is in
            # tests/fleet/test_host_cli.py.
            "mode": "standalone",
        }

        # Behind head and leading: 4, whatever the leader.
        await admin_execute(
            pg_url, f"UPDATE \"{migrated}\".cronoq_alembic_version SET version_num = '9999_x'"
        )
        newer = await run("--url", url, "--schema", migrated, "health", "--json")
        assert newer.exit_code == ExitCode.NEWER_DATABASE
        doc = document(newer.stdout)
        assert (doc["healthy"], doc["at_head"], doc["leader"]["pid"]) == (False, False, row["pid"])
        assert doc["reasons"] == [
            f"schema {migrated} is newer than this build (this build's head is {head_revision()})"
        ]


async def test_health_of_a_missing_schema_exits_4_and_unreachable_3(
    pg_url: URL, schema: str
) -> None:
    missing = await run("--url", full(pg_url), "--schema", schema, "health", "--json")
    assert missing.exit_code == ExitCode.NOT_MIGRATED
    doc = document(missing.stdout)
    assert (doc["healthy"], doc["revision"], doc["leader"]) == (False, [], None)
    assert doc["reasons"] == [
        f"schema {schema} is missing (this build's head is {head_revision()})",
        "no instance holds the leader lock",
    ]
    wrong = pg_url.set(password="wrong-password-123")
    unreachable = await run("--url", full(wrong), "--schema", schema, "health", "--json")
    assert unreachable.exit_code == ExitCode.UNREACHABLE
    assert unreachable.stdout == ""
    assert "wrong-password-123" not in unreachable.stderr


# --- --json --------------------------------------------------------------------------------


async def test_status_json_masks_the_password_and_counts(pg_url: URL, store: PgStore) -> None:
    schema = store.config.schema
    await store.commit(
        0, START_BASE, [submitted(1), submitted(2), changed(2, TaskStatus.FAILED)], []
    )
    result = await run("--url", full(pg_url), "--schema", schema, "status", "--json")
    assert result.exit_code == 0, result.output
    doc = document(result.stdout)
    assert pg_url.password
    assert pg_url.password not in result.stdout
    assert doc["database"] == pg_url.render_as_string(hide_password=True)
    assert (doc["schema"], doc["revision"], doc["epoch"], doc["max_id"]) == (
        schema,
        [head_revision()],
        0,
        2,
    )
    assert doc["incarnation"] == store.incarnation
    assert doc["leader"] is None
    assert doc["mode"] == "standalone"
    assert "host" not in doc
    assert doc["lock"] == [store.leader_lock[0], store.leader_lock[1] & 0xFFFFFFFF]
    assert doc["tasks"] == [
        {"pool": "default", "state": "live", "status": "queued", "count": 1},
        {"pool": "default", "state": "finished", "status": "failed", "count": 1},
    ]
    assert (doc["quarantined"], doc["recurring"]) == (0, [])

    newer = "9999_future"
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_alembic_version SET version_num = '{newer}'"
    )
    refused = await run("--url", full(pg_url), "--schema", schema, "status", "--json")
    assert refused.exit_code == ExitCode.NEWER_DATABASE
    assert newer in refused.stderr
    # What every revision holds, and nothing read from tables this build cannot know.
    doc = document(refused.stdout)
    assert (doc["revision"], doc["at_head"], doc["revision_state"], doc["epoch"]) == (
        [newer],
        False,
        "newer than this build",
        0,
    )
    assert "tasks" not in doc
    assert "max_id" not in doc


async def test_tasks_show_and_finished_json(pg_url: URL, store: PgStore) -> None:
    big = TaskId(WIDE)
    await store.commit(
        0,
        START_BASE,
        [
            submitted(big, key="nightly", pool="etl", kind="report"),
            changed(big, TaskStatus.SUCCEEDED, message="done"),
            submitted(5),
            changed(5, TaskStatus.FAILED),
        ],
        [(big, b"\x00pdf")],
    )
    args = ("--url", full(pg_url), "--schema", store.config.schema, "tasks")
    shown = await run(*args, "show", "nightly", "--json")
    assert shown.exit_code == 0, shown.output
    doc = document(shown.stdout)
    updated = rfc3339(doc.pop("updated"))
    spec = doc.pop("spec")
    assert (spec["payload_size"], spec["timeout_ns"], spec["retry"]) == (len(b"p"), None, None)
    record = await store.get_task(big)
    assert record is not None
    assert updated == record.updated
    assert doc == {
        "id": WIDE,
        "short_id": "32767/281474976710655",
        "epoch": 32767,
        "key": "nightly",
        "pool": "etl",
        "kind": "report",
        "priority": "normal",
        "tenant": None,
        "status": "succeeded",
        "attempt": 1,
        "message": "done",
        "output_size": 4,
        "output_base64": "AHBkZg==",
    }

    # Newest first: the big id finished after task 5.
    first = document((await run(*args, "finished", "--limit", "1", "--json")).stdout)
    assert [t["id"] for t in first["tasks"]] == [WIDE]
    assert (first["matching"], first["matching_at_least"], first["scan_stopped"]) == (
        2,
        False,
        False,
    )
    rest = document((await run(*args, "finished", "--cursor", first["next"], "--json")).stdout)
    assert [t["id"] for t in rest["tasks"]] == [5]
    assert rest["next"] is None

    missing = await run(*args, "show", "77", "--json")
    assert (missing.exit_code, missing.stdout) == (ExitCode.FAILED, "")
    assert "no task with id '77'" in missing.stderr


# --- widths ---------------------------------------------------------------------------------


def in_a_terminal(argv: list[str], columns: int, typed: bytes = b"", expect: int = 0) -> str:
    """What ``argv`` shows on a real terminal ``columns`` wide, ``typed`` typed into it."""
    main, child = pty.openpty()
    with subprocess.Popen(
        argv, stdin=child, stdout=child, stderr=child, env=cli_environment(COLUMNS=str(columns))
    ) as process:
        os.close(child)
        os.write(main, typed)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(timeout=60) == expect, b"".join(chunks)
    os.close(main)
    # Without the styles' escape codes, lines ending as on a file.
    text = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())
    return text.replace("\r\n", "\n")


async def test_ids_are_whole_on_a_narrow_terminal_and_piped(pg_url: URL, store: PgStore) -> None:
    key = "k" * 100
    ids = [TaskId(WIDE - 1), TaskId(WIDE)]
    batch: list[Mutation] = [
        submitted(ids[0], key=key),
        changed(ids[0], TaskStatus.CANCELLED, message="m" * 70),
    ]
    batch += [submitted(ids[1]), changed(ids[1], TaskStatus.SUCCEEDED, message="a\tb\nc\\")]
    await store.commit(0, START_BASE, batch, [])
    argv = cli_command(pg_url, store.config.schema, "tasks", "finished")

    for columns in (40, 80, 120):
        shown = await asyncio.to_thread(in_a_terminal, argv, columns)
        for id in ids:  # whole, on a line of their own
            assert re.search(rf"^id\s+{id}\s*$", shown, re.M), (columns, shown)
        assert max(len(line) for line in shown.splitlines()) <= columns, shown
    wide = await asyncio.to_thread(in_a_terminal, argv, 300)
    assert "┃ key" in wide  # a table where one fits
    assert re.search(rf"^│ +{ids[0]} │ {short_id(ids[0])} │ {key} │", wide, re.M), wide

    piped = await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=60, env=cli_environment()
    )
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert lines[0].split("\t") == [
        "id", "short", "key", "pool", "kind", "tenant", "status", "attempt", "updated", "message"
    ]  # fmt: skip
    # Updated in one commit: newest first, then the larger id first.
    assert [line.split("\t")[:3] for line in lines[1:3]] == [
        [str(ids[1]), short_id(ids[1]), "-"],
        [str(ids[0]), short_id(ids[0]), key],
    ]
    # Messages are shortened, the cut marked (--full-messages prints them whole); never ids
    # or keys.
    assert lines[2].split("\t")[9] == "m" * 59 + "…"
    assert lines[1].split("\t")[9] == "a\\tb\\nc\\\\"  # one line, its tab a field's end
    assert lines[3:] == ["2 matching, newest first", "end of list"]


# --- handover -------------------------------------------------------------------------------


async def test_handover_ends_the_holder_and_prints_the_standbys_epoch(
    pg_url: URL, migrated: str
) -> None:
    url = full(pg_url)

    # A session check may take over a second on a loaded machine: this test is about what
    # the command prints, not about noticing a lost session fast.
    def slow(name: str) -> PgStoreConfig:
        return replace(ha_config(migrated, name), keepalive=1.0, session_timeout=10.0)

    async with (
        await PgStore.connect(pg_url, slow("handover-a")) as a,
        await PgStore.connect(pg_url, slow("handover-b")) as b,
    ):
        first = await a.acquire_leadership()
        standby = asyncio.create_task(b.acquire_leadership())

        unconfirmed = await run("--url", url, "--schema", migrated, "handover")
        assert unconfirmed.exit_code == ExitCode.USAGE
        assert "pass --yes" in unconfirmed.stderr
        assert a.is_leader
        assert not standby.done()

        result = await run("--url", url, "--schema", migrated, "handover", "--yes")
        assert result.exit_code == 0, result.output
        epoch = await bounded(standby, "the standby to take over")
        assert epoch == first + 1
        assert re.search(
            r"^new leader: instance ([0-9a-f]{8}), not [0-9a-f]{8}: backend pid \d+ "
            r"\(handover-b leader \1\), epoch (\d+)$",
            result.stdout,
            re.M,
        )
        assert result.stdout.rstrip().endswith(f"epoch {epoch}")
        assert re.search(rf"^epoch\s+{first}\s*$", result.stdout, re.M)
        await bounded(a.leadership_lost(), "a to step down")
        assert not a.is_leader

        # No standby now: the command ends the holder and gives up after --timeout.
        alone = await run("--url", url, "--schema", migrated, "handover", "--yes", "--timeout", "1")
        assert alone.exit_code == ExitCode.NO_LEADER
        assert "no instance took the leader lock within 1 s" in alone.stderr
        await bounded(b.leadership_lost(), "b to step down")

    nobody = await run("--url", url, "--schema", migrated, "handover", "--yes")
    assert nobody.exit_code == ExitCode.NO_LEADER
    assert "nothing to hand over" in nobody.stderr


async def test_handover_asks_on_a_terminal(pg_url: URL, migrated: str) -> None:
    async with (
        await PgStore.connect(pg_url, ha_config(migrated, "asked-a")) as a,
        await PgStore.connect(pg_url, ha_config(migrated, "asked-b")) as b,
    ):
        first = await a.acquire_leadership()
        standby = asyncio.create_task(b.acquire_leadership())
        argv = cli_command(pg_url, migrated, "handover", "--timeout", "10")

        declined = await asyncio.to_thread(in_a_terminal, argv, 100, b"n\n", ExitCode.FAILED)
        assert "so that another instance leads? [y/N]" in declined
        assert "handover cancelled" in declined
        assert a.is_leader
        assert not standby.done()

        accepted = await asyncio.to_thread(in_a_terminal, argv, 100, b"y\n")
        epoch = await bounded(standby, "the standby to take over")
        assert epoch == first + 1
        assert re.search(rf"\(asked-b leader [0-9a-f]{{8}}\), epoch {epoch}", accepted)
