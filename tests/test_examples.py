"""examples/ runs as a reader runs it: real processes against the suite's server.

A leader that loses its lock session steps down and leads again at the next epoch; a
standby takes over when the leader stops; the health endpoint answers; an application's
own test suite passes with the pytest plugin and with ``InMemoryStore``, and pytest-asyncio
does not warn about its loop scope.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from sqlalchemy.engine import URL

from .pgharness import admin_execute, terminate_backends

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
ENV = {"PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}


@contextmanager
def example(name: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


async def line_matching(out: IO[str] | None, pattern: str, timeout: float = 60) -> re.Match[str]:
    """Read lines until one matches ``pattern``; fail after ``timeout`` seconds."""
    assert out is not None

    def read() -> re.Match[str]:
        seen = []
        for line in out:
            seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(f"no line matched {pattern!r}: {seen}")

    return await asyncio.wait_for(asyncio.to_thread(read), timeout)


async def test_the_leader_steps_down_leads_again_and_hands_over_to_the_standby(
    pg_url: URL, schema: str
) -> None:
    url = pg_url.render_as_string(hide_password=False)
    with example("leader.py", url, schema) as leader:
        first = int((await line_matching(leader.stdout, r"leading at epoch (\d+)")).group(1))
        # Its lock session dies (a network cut, a killed backend): it steps down, and
        # takes the lock again at the next epoch, since no one else waits for it.
        assert await terminate_backends(pg_url, "example-leader leader") == 1
        await line_matching(leader.stdout, rf"stepped down from epoch {first}")
        found = await line_matching(leader.stdout, r"leading at epoch (\d+): (\d+) live")
        assert (int(found.group(1)), int(found.group(2)) > 0) == (first + 1, True)
        with example("standby.py", url, schema) as standby:
            await line_matching(standby.stdout, "standing by")
            leader.terminate()  # SIGTERM: it releases leadership and exits
            await line_matching(leader.stdout, "released leadership")
            took = await line_matching(standby.stdout, r"took over at epoch (\d+): (\d+) live")
            assert int(took.group(1)) == first + 2
            epochs = await line_matching(standby.stdout, r"issued by the epochs \[(.*)\]")
            assert epochs.group(1) == f"{first}, {first + 1}"
            assert standby.wait(timeout=30) == 0
        assert leader.wait(timeout=30) == 0
    rows = await admin_execute(pg_url, f'SELECT count(*) FROM "{schema}".cronoq_tasks')
    assert rows[0][0] == int(took.group(2))


def _get(port: int, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def test_the_health_endpoint_answers_liveness_and_readiness(pg_url: URL, schema: str) -> None:
    url = pg_url.render_as_string(hide_password=False)
    with example("health.py", url, schema, "0") as server:
        port = int((await line_matching(server.stdout, r"serving on port (\d+)")).group(1))
        assert await asyncio.to_thread(_get, port, "/livez") == (200, {"alive": True})
        code, body = await asyncio.to_thread(_get, port, "/readyz")
        assert (code, body) == (
            200,
            {"leader": False, "cluster_has_leader": False, "epoch": 0, "at_head": True},
        )


async def test_an_applications_tests_pass_with_the_plugin_and_in_memory(pg_url: URL) -> None:
    env = {
        **ENV,
        "CRONOQ_TEST_DATABASE_URL": pg_url.render_as_string(hide_password=False),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q", "."],
        cwd=EXAMPLES / "app_test",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert re.search(r"^3 passed", ran.stdout, re.MULTILINE), ran.stdout
    assert "loop scope" not in ran.stdout + ran.stderr
    assert "asyncio_default_fixture_loop_scope" not in ran.stdout + ran.stderr
