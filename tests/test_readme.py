"""README.md's "Using the store from code" example runs as written, so it cannot rot."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

from sqlalchemy.engine import URL

from .pgharness import admin_execute

REPO = Path(__file__).resolve().parent.parent
README_URL = '"postgresql://app@db/app"'
README_SCHEMA = '"cluster_a"'


def _example() -> str:
    """The first Python block of the section."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Using the store from code") :]
    found = re.search(r"```python\n(.*?)```\n", section, re.DOTALL)
    assert found is not None, "no Python block in README's 'Using the store from code'"
    return found.group(1)


async def test_the_readme_example_runs_and_says_what_it_shows(pg_url: URL, schema: str) -> None:
    code = _example()
    # The example names one server and one schema, each once: point them at the suite's.
    assert code.count(README_URL) == 1, README_URL
    assert code.count(README_SCHEMA) == 1, README_SCHEMA
    url = pg_url.render_as_string(hide_password=False)
    code = code.replace(README_URL, repr(url)).replace(README_SCHEMA, repr(schema))
    ran = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "refused, nothing written: ['mail-42']",
        "output: b'42 rows'",
        "live: ['mail']",
        "finished: [('report-day-1', 'succeeded')]",
    ]
    rows = await admin_execute(
        pg_url, f'SELECT key, status FROM "{schema}".cronoq_tasks ORDER BY id'
    )
    assert [tuple(r) for r in rows] == [("report-day-1", "succeeded"), ("mail-42", "queued")]
