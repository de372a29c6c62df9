"""The JSON beside each page holds the very documents the CLI's ``--json`` prints for the
same cluster: the overview's ``health`` is ``health --json``, a task's page extends
``tasks show --json``, and each finished task listed is the ``tasks finished --json`` entry
for it. The real commands in subprocesses, against one leading store."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import PgStore
from cronoq_store._domain import TaskId
from cronoq_store._migrations import head_revision, upgrade

from ..pgharness import admin_execute
from ..support import (
    FAILED,
    START_BASE,
    SUCCEEDED,
    changed,
    cli_command,
    cli_environment,
    ha_config,
    older_revisions,
    submitted,
)
from .conftest import Console, fetch

#: What a task's page adds to ``tasks show --json``.
TASK_PAGE_EXTRAS = {"schema", "deps", "deps_total", "deps_raw"}


async def cli_json(pg_url: URL, schema: str, *args: str, code: int = 0) -> Any:
    done = await asyncio.to_thread(
        subprocess.run,
        cli_command(pg_url, schema, *args, "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_environment(),
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
            START_BASE,
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


async def test_a_schema_at_every_older_revision_shows_its_verdict(
    engine: AsyncEngine, pg_url: URL, console_at: Console
) -> None:
    """Mid rolling upgrade the schema is behind this build: the overview and the cluster's
    page show its revision and ``health``'s verdict (exit 4), its task page refuses with
    the reason (409); none is a 500."""
    schemas = {f"{revision[:4]}_{uuid.uuid4().hex[:8]}": revision for revision in older_revisions()}
    try:
        for schema, revision in schemas.items():
            await upgrade(engine, f"r{schema}", revision)
        overview = await fetch(console_at.base + "/?format=json")
        assert overview.status == 200, overview.text()
        shown = {c["schema"]: c for c in overview.json()["clusters"]}
        for schema, revision in schemas.items():
            cluster = shown[f"r{schema}"]
            assert "refused" not in cluster, cluster
            assert cluster["revision"] == [revision]
            assert cluster["health_exit_code"] == 4
            assert cluster["health"] == await cli_json(pg_url, f"r{schema}", "health", code=4)

            base = f"{console_at.base}/clusters/r{schema}"
            page = await fetch(base)
            assert page.status == 200, page.text()
            assert "unhealthy (exit 4)" in page.text()
            assert "no history recorded" in page.text()
            as_json = await fetch(base + "?format=json")
            assert as_json.json()["leadership_history"] is None
            task = await fetch(base + "/task?id=1&format=json")
            assert task.status == 409, task.text()
            assert f"behind this build's head {head_revision()}" in task.json()["error"]
        assert (await fetch(console_at.base + "/")).status == 200
    finally:
        for schema in schemas:
            await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "r{schema}" CASCADE')
