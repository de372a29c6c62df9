"""The console on clusters a host group leads (a real ``PgHost`` serving them): the overview
and the cluster page say each is hosted and by which host process, live exactly while its
process lock is held; the cluster page says what its ``leader_lock`` is; the JSON carries
``status --json``'s ``mode`` and ``host`` and ``health --json`` as the CLI prints them; a
page's owners are read in one statement, not one per cluster; and what a control row holds
reaches the page as text, the terminal without its controls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy import event
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._cli.exits import ExitCode
from cronoq_store._console import reads
from cronoq_store._console.source import Source
from cronoq_store._host.control import LOCK_NS_HOST
from cronoq_store._host.move import ARRIVING_MARK, MOVED_MARK
from cronoq_store._migrations import upgrade
from cronoq_store._urls import async_url

from ..fleet.conftest import Fleet, fleet
from ..fleet.hosts import config, serving
from ..pgharness import admin_execute
from ..support import create_role, drop_role, full, run
from ..waits import PATIENCE, until
from .conftest import Console, fetch, shots, start_console, stop_console, text_of

__all__ = ["fleet"]  # the fixture, imported for the tests of this file

#: What a role writing the control schema could leave in a process row.
HOSTILE_APP = "<script>alert(4)</script>\x1b[2J\u202eowned"


@pytest.fixture
def console_on(fleet: Fleet, tmp_path: Path) -> Iterator[Console]:
    """The console reading owners in the fleet's control schema; pages do not refresh."""
    console = start_console(
        fleet.url, tmp_path, "--refresh", "3600", "--control-schema", fleet.control
    )
    try:
        yield console
    finally:
        stop_console(console)


async def cli_json(fleet: Fleet, schema: str, command: str) -> Any:
    result = await run(
        "--url", full(fleet.url), "--schema", schema, command, "--json",
        "--control-schema", fleet.control,
    )  # fmt: skip
    return json.loads(result.stdout)


def statements_naming(seen: list[str], table: str) -> list[str]:
    return [s for s in seen if table in s.replace('"', "")]


async def test_the_overview_and_json_say_hosted_by_whom_as_the_cli_does(
    fleet: Fleet, console_on: Console
) -> None:
    hosted = fleet.clusters(3)
    alone = f"{fleet.prefix}_alone"
    engine = create_async_engine(async_url(fleet.url))
    try:
        await upgrade(engine, alone)
    finally:
        await engine.dispose()
    async with serving(fleet.url, config(fleet, "console-host"), hosted) as served:
        await until(lambda: len(served.host.led()) == 3, "the host to lead its clusters")
        pid = served.host.process_id
        await admin_execute(
            fleet.url,
            f'UPDATE "{fleet.control}".processes SET application_name = $1 WHERE process_id = $2',
            HOSTILE_APP,
            pid,
        )
        query = urlencode({"q": fleet.prefix, "format": "json"})
        overview = (await fetch(f"{console_on.base}/?{query}")).json()
        shown = {c["schema"]: c for c in overview["clusters"]}
        assert sorted(shown) == sorted([*hosted, alone])
        assert shown[alone]["mode"] == "standalone"
        assert "host" not in shown[alone]
        for schema in hosted:
            status = await cli_json(fleet, schema, "status")
            assert shown[schema]["mode"] == status["mode"] == "hosted"
            assert shown[schema]["host"] == status["host"]
            assert shown[schema]["health"] == await cli_json(fleet, schema, "health")
            assert shown[schema]["host"]["live"] is True
            assert shown[schema]["host"]["process"]["process_id"] == pid
        page = (await fetch(f"{console_on.base}/clusters/{hosted[0]}?format=json")).json()
        assert page["summary"]["host"] == shown[hosted[0]]["host"]

        html = (await fetch(f"{console_on.base}/?q={fleet.prefix}")).text()
        assert "&lt;script&gt;alert(4)" in html
        assert "<script>alert(4)" not in html
        assert "\x1b" not in html
        assert "\u202e" not in html
        text = await run(
            "--url", full(fleet.url), "--schema", hosted[0], "status",
            "--control-schema", fleet.control,
        )  # fmt: skip
        assert "alert(4)" in text.stdout
        assert "\x1b" not in text.stdout
        assert "\u202e" not in text.stdout

        # The page's owners: one statement on the control table, whatever the clusters.
        source = Source(full(fleet.url), control_schema=fleet.control)
        seen: list[str] = []
        event.listen(
            source.engine.sync_engine,
            "before_cursor_execute",
            lambda conn, cursor, statement, *rest: seen.append(statement),
        )
        try:
            doc = await reads.overview(source, fleet.prefix)
        finally:
            await source.close()
        assert [c["mode"] for c in doc["clusters"]] == ["hosted", "hosted", "hosted", "standalone"]
        assert len(statements_naming(seen, f"{fleet.control}.clusters")) == 1


def wait_for(browser: webdriver.Chrome, css: str) -> None:
    WebDriverWait(browser, PATIENCE).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, css), f"no {css}"
    )


SHOWN = ("dd.mode", "dd.leader", "#host-owner", "#host-process", "#host-live")


async def test_the_cluster_page_names_the_process_its_lock_and_whether_it_lives(
    fleet: Fleet, console_on: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    (schema,) = fleet.clusters(1)
    page = f"{console_on.base}/clusters/{schema}"

    def look(shot: str) -> dict[str, str]:
        browser.get(page)
        wait_for(browser, "#hosted")
        browser.save_screenshot(str(shots(tmp_path) / shot))
        return {css: text_of(browser, css) for css in (*SHOWN, "#leader-lock-meaning")}

    async with serving(fleet.url, config(fleet, "console-host"), [schema]) as served:
        await until(lambda: len(served.host.led()) == 1, "the host to lead the cluster")
        pid, instance = served.host.process_id, served.host.instance
        lock = f"({LOCK_NS_HOST}, {pid})"
        assert served.host.led()[schema].leader_lock == (LOCK_NS_HOST, pid)
        led = await asyncio.to_thread(look, "hosted.png")
    assert led["dd.mode"] == f"hosted (group {fleet.group})"
    assert led["dd.leader"].startswith(f"host process {pid}, instance {instance}, ")
    assert led["dd.leader"].endswith("; live: its process lock is held")
    assert led["#host-owner"].startswith(f"host process {pid}, since ")
    assert f"host process {pid}, instance {instance}, " in led["#host-process"]
    assert led["#host-live"].startswith(f"yes: its process lock {lock} is held by backend pid ")
    meaning = led["#leader-lock-meaning"]
    assert "HostedStore.leader_lock) reports its host process's lock" in meaning
    assert f"here {lock}" in meaning

    # The host closed: it released the cluster, and its process lock is free.
    gone = await asyncio.to_thread(look, "hosted-released.png")
    assert gone["dd.leader"].startswith("none: no live host process owns it; last owner host ")
    assert f"process {pid}, instance {instance}, released it " in gone["dd.leader"]
    assert gone["#host-owner"] == "none"
    assert gone["#host-live"] == f"no: its process lock {lock} is free, the process is gone"


async def test_a_role_that_cannot_read_the_control_schema_sees_the_owner_unknown(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A console on a role granted the cluster's tables and not the control schema: the
    overview and the cluster page still show the cluster, its owner unknown and why, never
    an error page or a traceback; the CLI says the same."""
    (schema,) = fleet.clusters(1)
    role = await create_role(fleet.url, f"{fleet.prefix}_reader")
    try:
        async with serving(fleet.url, config(fleet, "console-host"), [schema]) as served:
            await until(lambda: len(served.host.led()) == 1, "the host to lead the cluster")
            await admin_execute(fleet.url, f'GRANT USAGE ON SCHEMA "{schema}" TO {role.name}')
            await admin_execute(
                fleet.url, f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role.name}'
            )
            console = start_console(
                role.url, tmp_path, "--refresh", "3600", "--control-schema", fleet.control
            )
            try:
                pages = [
                    await fetch(f"{console.base}/clusters/{schema}?format=json"),
                    await fetch(f"{console.base}/?q={schema}&format=json"),
                ]
                html = await fetch(f"{console.base}/clusters/{schema}")
            finally:
                stop_console(console)
            health = await run(
                "--url", full(role.url), "--schema", schema, "health", "--json",
                "--control-schema", fleet.control,
            )  # fmt: skip
    finally:
        await drop_role(fleet.url, role.name)
    assert [p.status for p in (*pages, html)] == [200, 200, 200], [p.text() for p in pages]
    page, overview = pages[0].json(), pages[1].json()
    (shown,) = overview["clusters"]
    # Who leads it is unknown, not "nobody": exit 1 (the check failed), never 6.
    assert health.exit_code == ExitCode.FAILED, health.output
    assert "cannot tell which host process leads it" in json.loads(health.stdout)["reasons"][0]
    for host in (page["summary"]["host"], shown["host"], json.loads(health.stdout)["host"]):
        assert host["group"] == fleet.group
        assert f"permission denied for schema {fleet.control}" in host["unreadable"]
        assert (host["owner"], host["process"]) == (None, None)
    assert page["summary"]["schema"] == schema
    assert "unknown" in html.text()
    assert "Traceback" not in console.stderr()


async def test_a_refused_cluster_and_a_dead_owner_not_yet_buried_are_said(
    fleet: Fleet, console_on: Console
) -> None:
    """Control rows as no host left them to be read: one in the refused state with its
    reason (a control row's text, escaped on the page), one owned by a process whose row
    says member while its process lock is free (dead, not yet buried by a live member's
    probe). Both pages render, each saying why no host leads it; ``health`` agrees. And
    the marks of ``host move``: a tombstone and a copy not enrolled yet, each said so (not as
    led by a group, or by an empty one)."""
    refused, orphaned, moved, arriving = clusters = fleet.clusters(4)
    async with serving(fleet.url, config(fleet, "console-host"), clusters) as served:
        await until(lambda: len(served.host.led()) == 4, "the host to lead its clusters")
        pid = served.host.process_id
    # The host left: both clusters unowned, its process row left, its lock free.
    why = "<b>trust</b> check failed\x1b[2J"
    control = f'"{fleet.control}"'
    await admin_execute(
        fleet.url,
        f"UPDATE {control}.clusters SET state = 'refused', refused_why = $1 WHERE schema_name = $2",
        why,
        refused,
    )
    await admin_execute(
        fleet.url, f"UPDATE {control}.processes SET state = 'member' WHERE process_id = $1", pid
    )
    await admin_execute(
        fleet.url,
        f"UPDATE {control}.clusters SET owner = $1, since = now() WHERE schema_name = $2",
        pid,
        orphaned,
    )
    await admin_execute(
        fleet.url,
        f"UPDATE {control}.clusters SET state = 'moved', refused_why = 'moved to pg://west' "
        "WHERE schema_name = $1",
        moved,
    )
    await admin_execute(
        fleet.url, f"DELETE FROM {control}.clusters WHERE schema_name = $1", arriving
    )
    for schema, mark in ((moved, MOVED_MARK), (arriving, ARRIVING_MARK)):
        await admin_execute(fleet.url, f'UPDATE "{schema}".cronoq_leader SET host_group = $1', mark)
    pages = {s: await fetch(f"{console_on.base}/clusters/{s}") for s in clusters}
    docs = {s: await fetch(f"{console_on.base}/clusters/{s}?format=json") for s in clusters[:2]}
    assert [r.status for r in (*pages.values(), *docs.values())] == [200] * 6
    move = "by <code>cronoq-store host move</code>"
    html = pages[moved].text()
    assert f"hosted (moved {move}, group {fleet.group})" in html
    assert "moved: moved to pg://west" in html
    html = pages[arriving].text()
    assert f"hosted (arriving {move})" in html
    assert "holds no row for it: the move enrolls it as it ends" in html

    host = docs[refused].json()["summary"]["host"]
    assert (host["state"], host["refused_why"], host["live"]) == ("refused", why, False)
    html = pages[refused].text()
    assert 'refused: <span class="bad">&lt;b&gt;trust&lt;/b&gt; check failed' in html
    assert "\x1b" not in html
    health = docs[refused].json()["summary"]["health"]
    assert any(f"host group {fleet.group} refuses to lead it: " in r for r in health["reasons"])

    host = docs[orphaned].json()["summary"]["host"]
    assert (host["owner"], host["live"], host["state"]) == (pid, False, "active")
    assert (host["process"]["state"], host["process"]["lock_held_by_pid"]) == ("member", None)
    html = pages[orphaned].text()
    assert f"last owner host process {pid}, instance {served.host.instance}: its process " in html
    assert "lock is free, the process is gone" in html
    summary = docs[orphaned].json()["summary"]
    assert summary["health_exit_code"] == 6
    (reason,) = summary["health"]["reasons"]
    assert reason.endswith("its process lock is free (the process is gone)"), reason
    assert "Traceback" not in console_on.stderr()
