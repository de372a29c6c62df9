"""The leadership history against a real server: a row for each epoch, written by real
takeovers in the transaction of the bump, pruned there, and shown by ``status`` (text and
``--json``); a schema before revision 0008 has none to show and says so."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import datetime

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store._cli import ExitCode
from cronoq_store._migrations import upgrade
from cronoq_store._statements import TERMS_KEPT

from .pgharness import admin_execute, terminate_backends
from .support import LeadershipFactory, full, lead, leader_app, run
from .waits import bounded, until


async def history(url: URL, schema: str) -> list[dict[str, object]]:
    rows = await admin_execute(
        url, f'SELECT * FROM "{schema}".cronoq_leader_history ORDER BY began_at'
    )
    return [dict(r) for r in rows]


async def saw_the_lock_held(url: URL, schema: str, name: str) -> bool:
    """Whether standby ``name`` has polled the lock and found it held: its lock session is
    idle after a try (or after the look at the holder that follows a failed one)."""
    rows = await admin_execute(
        url,
        "SELECT query FROM pg_stat_activity WHERE application_name LIKE $1 AND state = 'idle'",
        leader_app(schema, name) + "%",
    )
    return any("pg_try_advisory_lock" in r[0] or "pg_locks" in r[0] for r in rows)


async def test_each_takeover_records_its_epoch_and_the_session_that_took_it(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str
) -> None:
    a, b = make_leadership("a"), make_leadership("b")
    assert await lead(a) == 1
    pid_a = (
        await admin_execute(
            pg_url,
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1",
            leader_app(migrated, "a") + "%",
        )
    )[0][0]
    standby = asyncio.ensure_future(b.acquire())
    await until(lambda: saw_the_lock_held(pg_url, migrated, "b"), "b to find the lock held")
    assert await terminate_backends(pg_url, leader_app(migrated, "a")) == 1
    assert await bounded(standby, "the standby's takeover") == 2

    first, second = await history(pg_url, migrated)
    user = (await admin_execute(pg_url, "SELECT session_user"))[0][0]
    assert (first["epoch"], first["pid"], first["role"]) == (1, pid_a, user)
    assert str(first["application_name"]).startswith(leader_app(migrated, "a"))
    assert first["client_addr"] in ("127.0.0.1", "::1", None)
    # a found the lock free at its first try; b saw it held before it took epoch 2.
    assert first["lock_seen_held_at"] is None
    assert second["epoch"] == 2
    assert str(second["application_name"]).startswith(leader_app(migrated, "b"))
    held, began = second["lock_seen_held_at"], second["began_at"]
    assert isinstance(held, datetime)
    assert isinstance(began, datetime)
    assert first["began_at"] < held <= began  # type: ignore[operator]

    # The row and the bump are one transaction: the same transaction id wrote both.
    same = await admin_execute(
        pg_url,
        f'SELECT h.xmin::text = l.xmin::text FROM "{migrated}".cronoq_leader_history h, '
        f'"{migrated}".cronoq_leader l WHERE h.epoch = l.epoch',
    )
    assert [r[0] for r in same] == [True]


async def test_a_takeover_prunes_the_history_to_the_newest_terms(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str
) -> None:
    await admin_execute(
        pg_url,
        f'INSERT INTO "{migrated}".cronoq_leader_history (epoch, began_at, pid) '
        "SELECT n, now() - make_interval(mins => 5000 - n), 1 FROM generate_series(1, $1) n",
        TERMS_KEPT + 20,
    )
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = {TERMS_KEPT + 20}')
    a = make_leadership("a")
    assert await lead(a) == TERMS_KEPT + 21
    rows = await admin_execute(
        pg_url, f'SELECT min(epoch), max(epoch), count(*) FROM "{migrated}".cronoq_leader_history'
    )
    assert tuple(rows[0]) == (22, TERMS_KEPT + 21, TERMS_KEPT)


async def test_status_shows_the_timeline_in_text_and_json(
    make_leadership: LeadershipFactory, pg_url: URL, migrated: str
) -> None:
    a, b = make_leadership("a"), make_leadership("b")
    assert await lead(a) == 1
    standby = asyncio.ensure_future(b.acquire())
    await until(lambda: saw_the_lock_held(pg_url, migrated, "b"), "b to find the lock held")
    await a.release()
    assert await bounded(standby, "the standby's takeover") == 2

    text = await run("--url", full(pg_url), "--schema", migrated, "status")
    assert text.exit_code == ExitCode.OK, text.output
    lines = text.stdout.splitlines()
    header = lines.index("epoch\tbegan\tinstance\tlasted\tno leader before it")
    newest, oldest = (line.split("\t") for line in lines[header + 1 : header + 3])
    assert (newest[0], oldest[0]) == ("2", "1")
    assert newest[3] == "leading"
    assert oldest[3].startswith("at most ")
    assert re.fullmatch(r"at most [0-9.]+ (ns|µs|ms|s)", newest[4]), newest[4]
    assert (
        oldest[4]
        == "unknown (the lock was free at its first try); the epoch before is not recorded"
    )
    assert leader_app(migrated, "b") in newest[2]

    as_json = await run("--url", full(pg_url), "--schema", migrated, "status", "--json")
    terms = json.loads(as_json.stdout)["leadership_history"]
    assert [t["epoch"] for t in terms] == [2, 1]
    assert terms[0]["previous_recorded"] is True
    assert terms[0]["lasted_at_most_s"] is None
    assert 0 <= terms[0]["leaderless_at_most_s"] < 10
    assert terms[1]["leaderless_at_most_s"] is None
    assert terms[1]["lasted_at_most_s"] >= 0
    assert [t["leading"] for t in terms] == [True, False]

    # b lets go and nobody takes over: its term ended, at a time the history does not hold.
    await b.release()
    text = await run("--url", full(pg_url), "--schema", migrated, "status")
    lines = text.stdout.splitlines()
    top = lines[lines.index("epoch\tbegan\tinstance\tlasted\tno leader before it") + 1]
    assert top.split("\t")[3] == "ended (when is not recorded; no leader now)"
    as_json = await run("--url", full(pg_url), "--schema", migrated, "status", "--json")
    assert [t["leading"] for t in json.loads(as_json.stdout)["leadership_history"]] == [
        False,
        False,
    ]


async def test_a_schema_before_the_history_shows_none_recorded(
    engine: AsyncEngine, pg_url: URL, schema: str
) -> None:
    await upgrade(engine, schema, "0007_leader_holder")
    text = await run("--url", full(pg_url), "--schema", schema, "status")
    assert text.exit_code == ExitCode.NOT_MIGRATED, text.output
    assert "leadership history: no history recorded" in text.stdout
    as_json = await run("--url", full(pg_url), "--schema", schema, "status", "--json")
    assert as_json.exit_code == ExitCode.NOT_MIGRATED
    assert json.loads(as_json.stdout)["leadership_history"] is None
