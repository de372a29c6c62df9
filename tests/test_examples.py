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

from cronoq_store import (
    PgStore,
    PgStoreConfig,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)

from .pgharness import admin_execute, terminate_backends
from .support import ROOT

EXAMPLES = ROOT / "examples"
ENV = {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}


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


async def test_the_leader_retries_a_task_left_running_and_fails_one_out_of_attempts(
    pg_url: URL, schema: str
) -> None:
    """What examples/leader.py shows a new leader doing with each recovered task: a queued
    or retrying task is left to run as before; a task left running counts the lost attempt
    as failed, and is retrying while its policy allows another attempt, else failed."""
    url = pg_url.render_as_string(hide_password=False)
    base = TimeBase.now()
    three = RetryPolicy(max_attempts=3)
    async with await PgStore.connect(url, PgStoreConfig(schema=schema)) as store:
        epoch = await store.acquire_leadership()
        ids = [task_id(epoch, n) for n in range(4)]
        specs = [
            TaskSpec(b"queued", key="queued"),
            TaskSpec(b"retrying", key="retrying", retry=three),
            TaskSpec(b"running", key="running", retry=three),
            TaskSpec(b"last", key="last"),  # no policy: one attempt
        ]
        now = base.engine_ns
        await store.commit(
            epoch,
            base,
            [
                *(
                    Submitted(i, n, now, spec)
                    for n, (i, spec) in enumerate(zip(ids, specs, strict=True))
                ),
                StatusChanged(ids[1], TaskStatus.RUNNING, 1, now + 1),
                StatusChanged(ids[1], TaskStatus.RETRYING, 1, now + 2, "boom"),
                StatusChanged(ids[2], TaskStatus.RUNNING, 1, now + 1),
                StatusChanged(ids[3], TaskStatus.RUNNING, 1, now + 1),
            ],
            [],
        )
        await store.release_leadership()  # as if it had died: nothing settled
    with example("leader.py", url, schema) as leader:
        found = await line_matching(leader.stdout, r"^resumed: (.*)$")
        assert found.group(1) == (
            "1 queued; 1 retrying; 1 was running: retrying; 1 was running: failed"
        )
        rows = await admin_execute(
            pg_url,
            f'SELECT key, status, attempt, message FROM "{schema}".cronoq_tasks'
            " WHERE key IS NOT NULL ORDER BY id",
        )
        leader.terminate()
        assert leader.wait(timeout=30) == 0
    assert [tuple(r) for r in rows] == [
        ("queued", "queued", 0, None),
        ("retrying", "retrying", 1, "boom"),
        ("running", "retrying", 1, "its leader was lost during attempt 1 of 3"),
        ("last", "failed", 1, "its leader was lost during attempt 1 of 1"),
    ]


async def test_the_readme_shows_the_whole_pytest_ini_whose_asyncio_mode_is_required(
    pg_url: URL, tmp_path: Path
) -> None:
    """The README shows examples/app_test/pytest.ini whole (tests/test_docs_code.py keeps
    the copy equal) and says ``asyncio_mode = auto`` is required: without that line the
    same application's tests fail."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "<!-- same as: examples/app_test/pytest.ini -->" in readme
    assert "`asyncio_mode = auto` is required" in readme
    for path in (EXAMPLES / "app_test").glob("*.py"):
        (tmp_path / path.name).write_text(path.read_text())
    ini = (EXAMPLES / "app_test" / "pytest.ini").read_text().splitlines()
    (tmp_path / "pytest.ini").write_text(
        "\n".join(line for line in ini if not line.startswith("asyncio_mode")) + "\n"
    )
    env = {**ENV, "CRONOQ_TEST_DATABASE_URL": pg_url.render_as_string(hide_password=False)}
    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "."],
        cwd=tmp_path,
        env={**env, "HOME": os.environ.get("HOME", "/tmp")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert re.search(r"^3 failed", ran.stdout, re.MULTILINE), ran.stdout
    assert "async def functions are not natively supported" in ran.stdout
