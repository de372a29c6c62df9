"""The JSON beside each page holds the very documents the CLI's ``--json`` prints for the
same cluster: the overview's ``health`` is ``health --json``, a task's page extends
``tasks show --json``, and each finished task listed is the ``tasks finished --json`` entry
for it. The real commands in subprocesses, against one leading store."""

from __future__ import annotations

import asyncio
import json
import subprocess
from typing import Any

from sqlalchemy.engine import URL

from cronoq_store import PgStore
from cronoq_store._domain import TaskId

from ..test_cli import BASE, FAILED, SUCCEEDED, changed, submitted
from ..test_cli_json import command, environment, ha_config
from .conftest import Console, fetch

#: What a task's page adds to ``tasks show --json``.
TASK_PAGE_EXTRAS = {"schema", "spec", "deps", "deps_total", "deps_raw"}


async def cli_json(pg_url: URL, schema: str, *args: str, code: int = 0) -> Any:
    done = await asyncio.to_thread(
        subprocess.run,
        command(pg_url, schema, *args, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(),
    )
    assert done.returncode == code, done.stderr
    return json.loads(done.stdout)


async def test_every_page_holds_the_clis_documents(
    pg_url: URL, migrated: str, console_at: Console
) -> None:
    async with await PgStore.connect(pg_url, ha_config(migrated, "json-leader")) as store:
        epoch = await store.acquire_leadership()
        await store.commit(
            epoch,
            BASE,
            [
                submitted(1, key="nightly", pool="etl", tenant="acme"),
                changed(1, SUCCEEDED, message="42 rows"),
                submitted(2, key="<b>x</b>\u202e", pool="web"),
                changed(2, FAILED, message="\x1b[2Jboom"),
                submitted(3),
            ],
            [(TaskId(1), b"csv")],
        )
        overview = (await fetch(console_at.base + "/?format=json")).json()
        (cluster,) = [c for c in overview["clusters"] if c["schema"] == migrated]
        assert cluster["health"] == await cli_json(pg_url, migrated, "health")
        assert cluster["health_exit_code"] == 0

        page = (await fetch(f"{console_at.base}/clusters/{migrated}?format=json")).json()
        listed = await cli_json(pg_url, migrated, "tasks", "finished")
        by_id = {t["id"]: t for t in listed["tasks"]}
        assert [t["id"] for t in page["finished"]["tasks"]] == [2, 1]
        for shown in page["finished"]["tasks"]:
            assert shown == by_id[shown["id"]]

        for ref, query in (("1", "id=1"), ("<b>x</b>\u202e", "key=%3Cb%3Ex%3C%2Fb%3E%E2%80%AE")):
            task = (
                await fetch(f"{console_at.base}/clusters/{migrated}/task?{query}&format=json")
            ).json()
            args = ("tasks", "show", ref) if ref.isdigit() else ("tasks", "show", "--key", ref)
            cli = await cli_json(pg_url, migrated, *args)
            assert {k: v for k, v in task.items() if k not in TASK_PAGE_EXTRAS} == cli

    # No leader now: both say so, with the same exit code.
    overview = (await fetch(console_at.base + "/?format=json")).json()
    (cluster,) = [c for c in overview["clusters"] if c["schema"] == migrated]
    assert cluster["health"] == await cli_json(pg_url, migrated, "health", code=6)
    assert cluster["health_exit_code"] == 6
