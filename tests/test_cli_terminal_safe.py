"""Output is safe to put on a terminal: stored text, URLs and arguments that hold escape
sequences, C1 controls, bidi and format characters or line breaks reach the terminal only as
visible escapes, on a terminal and piped, and ``--json`` decodes to the values as stored.

The rows are committed through the store; the CLI runs against the real server, piped
(click's runner) and on a pseudo-terminal (the console script as a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import subprocess
import sys
import tty
import unicodedata
from datetime import timedelta

import pytest
from sqlalchemy.engine import URL

from cronoq_store._cli import ExitCode
from cronoq_store._domain import (
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store._store import PgStore
from cronoq_store._terminal_safe import json_text, visible
from cronoq_store._urls import URL_ENV

from .pgharness import admin_execute
from .support import START_BASE, changed, full, run, submitted

#: What a hostile neighbour writes: each drives a terminal, hides or reorders text, or forges
#: a line, if printed raw.
OSC8_LINK = "\x1b]8;;https://evil.example/\x1b\\click me\x1b]8;;\x1b\\"
CSI_COLOUR = "red\x1b[31;1;4mALERT\x1b[0m"
DCS = "\x1bP1$qm\x1b\\dcs"
C1_CSI = "c1\x9b2Jcleared"
ISOLATE = "user\u2066evil\u2069txt.exe"
LINE_SEPARATOR = "one\u2028two\u2029three"
CR_OVERWRITE = "failed: disk full\rsucceeded        "
BACKSPACE = "rm -rf /\x08\x08\x08\x08\x08\x08\x08\x08ok"
ZERO_WIDTH = "ad\u200bmin\ufeff\u061c\x7fend"
SPELLED = "not an escape: \\x1b[2J and \\u202e"
FORGED = "boom\nstatus       succeeded\nmessage  all good"

KEY, POOL, KIND, TENANT = OSC8_LINK, CSI_COLOUR, DCS, ISOLATE
MESSAGE = FORGED + CR_OVERWRITE + BACKSPACE
RECURRING = LINE_SEPARATOR + C1_CSI

#: Raw characters that must never reach the output (the line feed ends our own lines; a
#: tab separates piped cells).
_UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs"}


def unsafe_characters(text: str, allowed: str = "\n\t") -> list[str]:
    return [c for c in text if unicodedata.category(c) in _UNSAFE and c not in allowed]


def facts(stdout: str) -> dict[str, list[str]]:
    """Label-and-value lines: every value printed under each label."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        label, _, value = line.partition("  ")
        found.setdefault(label, []).append(value.strip())
    return found


@pytest.fixture
async def hostile(store: PgStore, pg_url: URL) -> PgStore:
    """A finished task and a live one holding hostile text everywhere text is stored, a
    recurring schedule with a hostile name, and a row recovery quarantines."""
    every = IntervalSchedule(every=timedelta(minutes=5))
    batch: list[Mutation] = [
        submitted(1, key=KEY, pool=POOL, kind=KIND, tenant=TENANT),
        changed(1, TaskStatus.FAILED, message=MESSAGE),
        submitted(2, key=SPELLED, pool=ZERO_WIDTH, kind=C1_CSI),
        changed(2, TaskStatus.SUCCEEDED, message=LINE_SEPARATOR + ISOLATE),
        submitted(3, key="quarantined", pool=POOL),
        RecurringUpsert(RecurringSpec(RECURRING, every, TaskSpec(b"t"))),
        RecurringNext(RECURRING, next=DAY_NS, last=TaskId(1)),
    ]
    await store.commit(0, START_BASE, batch, [(TaskId(2), b"\x1b]52;c;cHduZWQ=\x07")])
    schema = store.config.schema
    # A live row recovery cannot decode: its quarantine reason quotes the stored value.
    await admin_execute(
        pg_url,
        f'UPDATE "{schema}".cronoq_tasks SET deps = $1::jsonb WHERE id = 3',
        json.dumps([{"\x1b]0;owned\x07": CR_OVERWRITE}]),
    )
    await store.recover(START_BASE)
    return store


DAY_NS = 86400 * 10**9


async def test_tasks_show_piped_prints_every_value_escaped_on_its_own_line(
    pg_url: URL, hostile: PgStore
) -> None:
    url, schema = full(pg_url), hostile.config.schema
    shown = await run("--url", url, "--schema", schema, "tasks", "show", "1")
    assert shown.exit_code == 0, shown.output
    assert unsafe_characters(shown.stdout, allowed="\n") == []
    lines = facts(shown.stdout)
    assert lines["key"] == [visible(KEY)]
    assert lines["pool"] == [visible(POOL)]
    assert lines["kind"] == [visible(KIND)]
    assert lines["tenant"] == [visible(TENANT)]
    assert lines["message"] == [visible(MESSAGE)]
    # The message's line breaks forge nothing: one status line, the real one.
    assert lines["status"] == ["failed"]
    assert "\\nstatus       succeeded\\nmessage  all good" in shown.stdout
    assert "\\x1b]8;;https://evil.example/\\x1b\\\\click me" in shown.stdout
    assert "\\r" in shown.stdout
    assert "\\x08" in shown.stdout

    spelled = await run("--url", url, "--schema", schema, "tasks", "show", SPELLED)
    assert spelled.exit_code == 0, spelled.output
    # A backslash in the value is doubled: text that spells an escape cannot pass for one.
    assert facts(spelled.stdout)["key"] == ["not an escape: \\\\x1b[2J and \\\\u202e"]
    assert facts(spelled.stdout)["pool"] == ["ad\\u200bmin\\ufeff\\u061c\\x7fend"]
    assert facts(spelled.stdout)["kind"] == ["c1\\x9b2Jcleared"]
    assert facts(spelled.stdout)["message"] == [
        "one\\u2028two\\u2029threeuser\\u2066evil\\u2069txt.exe"
    ]
    # The output's bytes are shown as Python bytes literals, escapes and all.
    assert facts(spelled.stdout)["output"] == ["16 bytes: b'\\\\x1b]52;c;cHduZWQ=\\\\x07'"]

    quarantined = await run("--url", url, "--schema", schema, "tasks", "show", "3")
    assert quarantined.exit_code == 0, quarantined.output
    assert unsafe_characters(quarantined.stdout, allowed="\n") == []
    assert len(facts(quarantined.stdout)["message"]) == 1
    assert facts(quarantined.stdout)["status"] == ["failed"]


async def test_tasks_finished_and_status_tables_piped_keep_one_row_per_line(
    pg_url: URL, hostile: PgStore
) -> None:
    url, schema = full(pg_url), hostile.config.schema
    listed = await run("--url", url, "--schema", schema, "tasks", "finished")
    assert listed.exit_code == 0, listed.output
    assert unsafe_characters(listed.stdout) == []
    rows = [line.split("\t") for line in listed.stdout.splitlines() if "\t" in line]
    # Newest first: recovery quarantined task 3 last; 1 and 2 finished in one commit.
    assert [row[0] for row in rows] == ["id", "3", "2", "1"]
    assert all(len(row) == 10 for row in rows)
    assert rows[3][2:7] == [visible(KEY), visible(POOL), visible(KIND), visible(TENANT), "failed"]
    assert rows[3][9] == visible(MESSAGE[:59]) + "…"

    status = await run("--url", url, "--schema", schema, "status")
    assert status.exit_code == 0, status.output
    assert unsafe_characters(status.stdout) == []
    cells = [line.split("\t") for line in status.stdout.splitlines() if "\t" in line]
    assert [visible(POOL), "finished", "failed", "2"] in cells
    assert [visible(ZERO_WIDTH), "finished", "succeeded", "1"] in cells
    assert visible(RECURRING) in [row[0] for row in cells]


async def test_json_is_valid_escaped_and_decodes_to_the_stored_values(
    pg_url: URL, hostile: PgStore
) -> None:
    url, schema = full(pg_url), hostile.config.schema
    shown = await run("--url", url, "--schema", schema, "tasks", "show", "1", "--json")
    assert shown.exit_code == 0, shown.output
    assert unsafe_characters(shown.stdout, allowed="\n") == []
    document = json.loads(shown.stdout)
    assert (document["key"], document["pool"], document["kind"]) == (KEY, POOL, KIND)
    assert (document["tenant"], document["message"]) == (TENANT, MESSAGE)
    assert "\\u001b]8;;https://evil.example/" in shown.stdout

    listed = await run("--url", url, "--schema", schema, "tasks", "finished", "--json")
    assert unsafe_characters(listed.stdout, allowed="\n") == []
    second = json.loads(listed.stdout)["tasks"][1]
    assert (second["key"], second["pool"], second["kind"]) == (SPELLED, ZERO_WIDTH, C1_CSI)
    assert second["message"] == LINE_SEPARATOR + ISOLATE
    for escape in ("\\u009b", "\\u2066", "\\u2028"):
        assert escape in listed.stdout

    status = await run("--url", url, "--schema", schema, "status", "--json")
    assert unsafe_characters(status.stdout, allowed="\n") == []
    document = json.loads(status.stdout)
    assert {row["pool"] for row in document["tasks"]} == {POOL, ZERO_WIDTH}
    assert [row["name"] for row in document["recurring"]] == [RECURRING]


def test_json_escapes_beyond_the_basic_plane_and_keeps_readable_text() -> None:
    values = {"tag": "\U000e0041\U000e007f", "name": "Zoë — 東京 ✓", "nbsp": "a\u00a0b"}
    text = json_text(values)
    assert "\\udb40\\udc41\\udb40\\udc7f" in text
    assert "Zoë — 東京 ✓" in text
    assert "a\u00a0b" in text
    assert json.loads(text) == values
    assert visible("\U000e0041") == "\\U000e0041"


async def test_errors_quote_hostile_arguments_escaped(pg_url: URL, hostile: PgStore) -> None:
    url, schema = full(pg_url), hostile.config.schema
    key = "\x1b]52;c;ZXZpbA==\x07\u202egnp.exe"
    missing = await run("--url", url, "--schema", schema, "tasks", "show", "--key", key)
    assert missing.exit_code == ExitCode.FAILED
    assert missing.stderr == f"Error: no task with key '{visible(key)}'\n"

    hostile_url = "mysql://ops@db\x1b]0;owned\x07\u009b2J/app"
    bad_url = await run("--url", hostile_url, "status")
    assert bad_url.exit_code == ExitCode.USAGE
    assert "\\x1b]0;owned\\x07\\x9b2J" in bad_url.stderr

    usage_errors = [
        await run("--url", url, "--schema", "\x1b[2J\u2067", "status"),
        await run("--url", url, "--schema", schema, "prune", "--older-than", "\x9b6n\u2028"),
        await run("--url", url, "nosuch\x1bP+q\x1b\\"),
        await run("--url", url, "tasks", "finished", "--limit", "\x1b[5n"),
        await run("--url", url, "status", "extra\rforged"),
    ]
    for result in (missing, bad_url, *usage_errors):
        assert unsafe_characters(result.stderr, allowed="\n") == [], result.stderr
    for result in usage_errors:
        assert result.exit_code == ExitCode.USAGE, result.output


def run_on_a_terminal(*args: str, url: URL) -> str:
    """The console script on a pseudo-terminal (raw mode: the terminal adds no carriage
    returns), with a terminal that takes no colours, so that any escape sequence in the
    output is a value's."""
    controller, terminal = pty.openpty()
    tty.setraw(terminal)
    env = {**os.environ, "TERM": "dumb", "COLUMNS": "200", URL_ENV: full(url)}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "cronoq_store._cli", *args],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=env,
        close_fds=True,
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert process.wait(timeout=60) == 0, b"".join(chunks)
    return b"".join(chunks).decode()


async def test_on_a_terminal_nothing_raw_reaches_it(pg_url: URL, hostile: PgStore) -> None:
    schema = hostile.config.schema
    shown, listed, status = await asyncio.gather(
        asyncio.to_thread(run_on_a_terminal, "--schema", schema, "tasks", "show", "1", url=pg_url),
        asyncio.to_thread(run_on_a_terminal, "tasks", "finished", "--schema", schema, url=pg_url),
        asyncio.to_thread(run_on_a_terminal, "status", "--schema", schema, url=pg_url),
    )
    for text in (shown, listed, status):
        assert unsafe_characters(text, allowed="\n") == [], text
    assert re.findall(r"^status\s+(\S+)", shown, re.M) == ["failed"]
    for value, text in ((KEY, shown), (TENANT, shown), (KEY, listed), (RECURRING, status)):
        assert visible(value) in text


async def test_a_status_this_build_does_not_know_is_shown_as_stored(
    pg_url: URL, store: PgStore
) -> None:
    """A newer build's status names, live and finished, are neither ``queued`` nor lost."""
    await store.commit(
        0,
        START_BASE,
        [submitted(1, key="a"), submitted(2, key="b"), changed(2, TaskStatus.SUCCEEDED)],
        [],
    )
    schema = store.config.schema
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_tasks SET status = 'paused' WHERE id = 1"
    )
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_tasks SET status = 'archived' WHERE id = 2"
    )
    url = full(pg_url)
    live = await run("--url", url, "--schema", schema, "tasks", "show", "1")
    assert facts(live.stdout)["status"] == ["paused"], live.output
    done = await run("--url", url, "--schema", schema, "tasks", "show", "2", "--json")
    assert json.loads(done.stdout)["status"] == "archived"
    listed = await run("--url", url, "--schema", schema, "tasks", "finished")
    row = listed.stdout.splitlines()[1].split("\t")
    assert row[:7] == ["2", "0/2", "b", "default", "-", "-", "archived"]
