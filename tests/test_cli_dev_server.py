"""``cronoq-store dev-server`` as a newcomer runs it: a real process, its URL used by the
other commands, stopped by a signal, and nothing left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cronoq_store._cli import ExitCode
from cronoq_store._migrations import head_revision

from .support import ROOT, run


def start_dev_server() -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start it and read its announcement: the data directory and the export line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "cronoq_store._cli", "dev-server"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    lines = [process.stdout.readline() for _ in range(4)]
    assert lines[0].startswith("PostgreSQL running in "), [*lines, process.stderr.read()]
    assert lines[2].startswith("export CRONOQ_DATABASE_URL="), lines
    seen = {
        "dir": lines[0].removeprefix("PostgreSQL running in ").split(" until ")[0],
        "url": lines[1].removeprefix("URL: ").strip(),
        "export": lines[2].strip(),
        "hint": lines[3].strip(),
    }
    return process, seen


def holds_a_cluster_data_dir(base: Path) -> bool:
    return (base / "data" / "PG_VERSION").is_file()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_dev_server_serves_the_commands_and_a_signal_removes_it(
    signum: signal.Signals,
) -> None:
    process, seen = start_dev_server()
    data_dir = Path(seen["dir"])
    try:
        assert holds_a_cluster_data_dir(data_dir)
        assert seen["export"] == f"export CRONOQ_DATABASE_URL='{seen['url']}'"
        assert ":***@" not in seen["url"]  # no password to mask: the socket needs none
        # The hint names the cluster schema the docs' examples use, never `public`.
        assert seen["hint"] == (
            "then: cronoq-store --schema cluster_a migrate && "
            "cronoq-store --schema cluster_a status"
        )
        schema = f"dev_{uuid.uuid4().hex[:8]}"
        env: dict[str, str | None] = {"CRONOQ_DATABASE_URL": seen["url"]}
        migrated = await run("--schema", schema, "migrate", env=env)
        assert migrated.exit_code == 0, migrated.output
        status = await run("status", "--schema", schema, env=env)
        assert status.exit_code == ExitCode.OK, status.output
        assert f"{head_revision()} (up to date)" in status.stdout
    finally:
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "PostgreSQL stopped and removed" in stderr
    assert not await asyncio.to_thread(data_dir.exists)
