"""``cronoq-store demo`` end to end, in real processes, and the verdict it relies on."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from cronoq_store._cli import ExitCode
from cronoq_store._demo import find_lost, parse_acks
from cronoq_store._demo.fleet import FleetAck, epochs_of_two, find_fleet_lost, parse_fleet_acks
from cronoq_store._urls import URL_ENV

from .pgharness import admin_execute
from .waits import PATIENCE

#: How long a command of this file may run before it counts as hung: a demo starts three
#: processes and, by default, an embedded server (initdb), each slower on a loaded machine.
HUNG = 10 * PATIENCE


def cronoq_store(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = shutil.which("cronoq-store", path=str(Path(sys.executable).parent))
    assert script is not None, "the cronoq-store console script is not installed"
    return subprocess.run(
        [script, *args],
        capture_output=True,
        text=True,
        timeout=HUNG,
        check=False,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )


def account(stdout: str) -> dict[str, str]:
    """The account's lines, by label."""
    labels = ("epochs", "takeover", "acknowledged", "throughput", "recovered", "lost")
    found = {}
    for line in stdout.splitlines():
        for label in (*labels, "stale writes"):
            if line.strip().startswith(label + " "):
                found[label] = line.strip()[len(label) :].strip()
    return found


async def demo_schemas(url: URL) -> list[str]:
    rows = await admin_execute(
        url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'cronoq\\_demo\\_%'"
    )
    return [r["nspname"] for r in rows]


async def test_demo_on_a_given_server_loses_nothing_and_fences_the_zombie(pg_url: URL) -> None:
    url = pg_url.render_as_string(hide_password=False)
    started = time.monotonic()
    result = await asyncio.to_thread(
        cronoq_store, "demo", "--url", url, "--seconds", "2", "--submitters", "16"
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr

    lines = account(result.stdout)
    assert lines["epochs"] == "A led epoch 1, B took over with epoch 2"
    assert lines["lost"] == "0"
    assert lines["stale writes"] == "16 of 16 refused (FencedError), 0 landed"
    acked = re.fullmatch(
        r"([\d,]+) tasks; ([\d,]+) writes with status changes, in ([\d.]+) s", lines["acknowledged"]
    )
    assert acked is not None, lines["acknowledged"]
    tasks = int(acked[1].replace(",", ""))
    assert tasks > 0  # A was killed mid-stream, with writes acknowledged: how many is speed
    # Traffic for about --seconds, within the run.
    window = float(acked[3])
    assert 1.5 < window < elapsed
    recovered = re.match(
        r"([\d,]+) tasks \(([\d,]+) committed, not yet acked\)", lines["recovered"]
    )
    assert recovered is not None, lines["recovered"]
    assert int(recovered[1].replace(",", "")) == tasks + int(recovered[2].replace(",", ""))
    takeover = re.match(r"([\d.]+) s from SIGKILL", lines["takeover"])
    assert takeover is not None
    # The takeover (B's next lock poll and its recovery) is a small part of the run, which
    # also starts three processes and carries the traffic: a takeover waiting for a stale
    # session or a timeout would be most of it. A ratio holds on a machine of any speed.
    assert float(takeover[1]) < (elapsed - window) / 2, (takeover[1], elapsed, window)
    assert re.match(r"[\d,]+ acks/s", lines["throughput"])
    assert "OK: every acknowledged write survived the crash" in result.stdout
    assert "SIGKILL A mid-stream" in result.stdout

    assert pg_url.password
    assert pg_url.password not in result.stdout + result.stderr
    assert await demo_schemas(pg_url) == []  # the throwaway schema is gone


async def test_fleet_demo_takes_a_killed_process_clusters_over_and_loses_nothing(
    pg_url: URL,
) -> None:
    url = pg_url.render_as_string(hide_password=False)
    args = ("--seconds", "1", "--clusters", "6", "--processes", "3", "--submitters", "12")
    result = await asyncio.to_thread(cronoq_store, "demo", "--fleet", "--url", url, *args)
    assert result.returncode == 0, result.stdout + result.stderr

    lines = fleet_account(result.stdout)
    assert lines["clusters"] == "6 led by 3 processes (p1 2, p2 2, p3 2)"
    takeover = re.fullmatch(
        r"(\d+) clusters of p1 led again by (p[23](?:, p[23])?) in ([\d.]+) s from SIGKILL "
        r"\(epochs ([\d to]+) -> ([\d to]+)\)",
        lines["takeover"],
    )
    assert takeover is not None, lines["takeover"]
    assert takeover[1] == "2"
    # Each cluster is led again under a later epoch than the killed process's: the ranges
    # (lowest to highest over its clusters) both move up. The clusters' epochs may differ
    # (one handed over during the open), so the new lowest need not pass the old highest.
    old, new = ([int(e) for e in epochs.split(" to ")] for epochs in (takeover[4], takeover[5]))
    assert new[0] > old[0]
    assert new[-1] > old[-1]
    acked = re.fullmatch(
        r"([\d,]+) tasks; ([\d,]+) writes with status changes.*", lines["acknowledged"]
    )
    assert acked is not None, lines["acknowledged"]
    assert int(acked[1].replace(",", "")) > 0
    recovered = re.fullmatch(r"([\d,]+) tasks of the killed process's clusters", lines["recovered"])
    assert recovered is not None, lines["recovered"]
    # The takers recovered what the killed process's clusters held: its writes among them.
    assert int(recovered[1].replace(",", "")) > 0
    assert lines["lost"] == "0"
    assert lines["epochs"] == "0 acknowledged by two processes"
    assert "OK: every acknowledged write survived the crash" in result.stdout
    assert "SIGKILL p1 mid-stream" in result.stdout

    assert pg_url.password
    assert pg_url.password not in result.stdout + result.stderr
    assert await demo_schemas(pg_url) == []  # the clusters and the control schema are gone


def test_fleet_options_without_fleet_are_a_usage_error() -> None:
    result = cronoq_store("demo", "--clusters", "5")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--clusters applies to the fleet variant: add --fleet" in result.stderr


def fleet_account(stdout: str) -> dict[str, str]:
    """The fleet account's lines, by label."""
    labels = ("clusters", "takeover", "acknowledged", "throughput", "recovered", "lost", "epochs")
    found = {}
    for line in stdout.splitlines():
        label, _, value = line.strip().partition(" ")
        if label in labels:
            found[label] = value.strip()
    return found


def ack(kind: str, task: int, schema: str = "s", epoch: int = 1, process: int = 1) -> FleetAck:
    return FleetAck(kind, task, schema, epoch, process)


def test_parse_fleet_acks_drops_a_torn_last_line() -> None:
    assert parse_fleet_acks("T 1 s 1 7\nR 1 s 1 7\nT 2 s") == [
        ack("T", 1, process=7),
        ack("R", 1, process=7),
    ]


def test_find_fleet_lost_checks_the_table_and_the_takeover_recovery() -> None:
    acks = [ack("T", 1), ack("S", 1), ack("T", 2), ack("T", 3, epoch=2, process=2)]
    table = {"s": {1: "succeeded", 2: "queued", 3: "queued"}}
    # Taken over by epoch 2, whose recovery holds what epoch 1 acknowledged.
    assert find_fleet_lost(acks, table, {"s": (2, {1: "succeeded", 2: "queued"})}) == []
    # Missing from the takeover's recovery, though in the table.
    assert find_fleet_lost(acks, table, {"s": (2, {1: "succeeded"})}) == [ack("T", 2)]
    # Missing from the table; a success stored as running.
    assert find_fleet_lost(acks, {"s": {1: "running", 2: "queued"}}, {}) == [
        ack("S", 1),
        ack("T", 3, epoch=2, process=2),
    ]


def test_epochs_of_two_names_each_epoch_acknowledged_by_two_processes() -> None:
    acks = [ack("T", 1), ack("T", 2), ack("T", 3, process=2), ack("T", 4, epoch=2, process=2)]
    assert epochs_of_two(acks) == [("s", 1)]
    assert epochs_of_two(acks[:2] + acks[3:]) == []


async def test_demo_runs_on_an_embedded_server_by_default() -> None:
    # The demo never takes the operator's database from the environment.
    nowhere = {URL_ENV: "postgresql://ops:hunter22@127.0.0.1:1/app"}
    result = await asyncio.to_thread(
        cronoq_store, "demo", "--seconds", "1", "--submitters", "8", env=nowhere
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"embedded PostgreSQL \d+", result.stdout)
    assert account(result.stdout)["lost"] == "0"


async def test_demo_with_a_wrong_password_exits_3_masked(pg_url: URL) -> None:
    wrong = pg_url.set(password="wrong-password-456").render_as_string(hide_password=False)
    # `cronoq-store --url X demo` means X too.
    for args in (["demo", "--url", wrong], ["--url", wrong, "demo"]):
        result = await asyncio.to_thread(cronoq_store, *args)
        assert result.returncode == ExitCode.UNREACHABLE, result.stdout + result.stderr
        assert "password authentication failed" in result.stderr
        assert "wrong-password-456" not in result.stdout + result.stderr


def test_the_operator_commands_never_import_the_demo() -> None:
    """The demo (and the test server it starts) loads only when `cronoq-store demo` runs."""
    script = (
        "import sys\n"
        "from cronoq_store._cli import cli\n"
        "try:\n"
        "    cli(['--help'], prog_name='cronoq-store')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('cronoq_store.'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert re.search(r"^  demo +Crash the leader mid-stream", result.stdout, re.M), result.stdout
    loaded = result.stdout.splitlines()[-1].split()
    assert "cronoq_store._cli.demo" in loaded  # the command is there, its module loaded
    assert [m for m in loaded if m.startswith(("cronoq_store._demo", "cronoq_store.testing"))] == []


def test_parse_acks_drops_a_torn_last_line() -> None:
    assert parse_acks("T 1\nR 1\nS 1\nT 2\nT 3") == [("T", 1), ("R", 1), ("S", 1), ("T", 2)]
    assert parse_acks("") == []


@pytest.mark.parametrize(
    ("recovered", "stored", "lost"),
    [
        # Everything kept; a committed but unacknowledged task (9) is no loss.
        ({1: "succeeded", 2: "queued", 9: "queued"}, {1: "succeeded", 2: "queued"}, []),
        # Missing from the recovery, or from the table.
        ({1: "succeeded"}, {1: "succeeded", 2: "queued"}, [("T", 2)]),
        ({1: "succeeded", 2: "queued"}, {2: "queued"}, [("T", 1), ("R", 1), ("S", 1)]),
        # An acknowledged success that came back as merely started.
        ({1: "started", 2: "queued"}, {1: "running", 2: "queued"}, [("S", 1)]),
        # A start that came back queued, and a zombie's cancellation that landed.
        ({1: "queued", 2: "queued"}, {1: "cancelled", 2: "queued"}, [("R", 1), ("S", 1)]),
    ],
)
def test_find_lost_reports_every_broken_promise(
    recovered: dict[int, str], stored: dict[int, str], lost: list[tuple[str, int]]
) -> None:
    acks = [("T", 1), ("R", 1), ("S", 1), ("T", 2)]
    assert find_lost(acks, recovered, stored) == lost
