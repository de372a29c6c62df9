"""The suite's embedded server does not outlive a test run that is SIGTERMed.

A real child process starts the harness's server, as the ``pg_server`` fixture does, and
gets SIGTERM (a cancelled CI job, a timeout): the server's postmaster must be gone and its
directory removed, and the child must still end as SIGTERM ends it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cronoq_store.testing import TEST_URL_ENV

from .support import ROOT

_CHILD = """
import json, sys, time
from tests.pgharness import EmbeddedServer
harness = EmbeddedServer()
server = harness.server
pid = int((server.data_dir / "postmaster.pid").read_text().split()[0])
print(json.dumps({"pid": pid, "base": str(server.base_dir)}), flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sigtermed_run_stops_its_embedded_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != TEST_URL_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True
    )
    started: dict[str, object] = {}
    try:
        assert child.stdout is not None
        started = json.loads(child.stdout.readline())
        pid, base = int(str(started["pid"])), Path(str(started["base"]))
        assert alive(pid)
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == -signal.SIGTERM
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), "the server outlived the SIGTERMed run"
        assert not base.exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
        # What a failing run left behind: SIGQUIT is the postmaster's immediate shutdown.
        if started:
            if alive(int(str(started["pid"]))):
                os.kill(int(str(started["pid"])), signal.SIGQUIT)
            shutil.rmtree(str(started["base"]), ignore_errors=True)
