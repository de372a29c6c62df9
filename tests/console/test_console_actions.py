"""The console's actions, a handover and a prune, only with ``--allow-actions`` and
credentials: done through the pages in chromium (the new epoch shown; the dry run's count
deleted), and refused without the flag, without the CSRF token, and from another site's page
(a real second origin in the same browser)."""

from __future__ import annotations

import asyncio
import http.server
import threading
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import PgStore
from cronoq_store._cli import ExitCode
from cronoq_store._domain import Dependency, Mutation, Submitted, TaskId, TaskSpec

from ..support import DAY, START_BASE, SUCCEEDED, changed, ha_config, submitted
from ..waits import PATIENCE, bounded, holds_for
from .conftest import (
    Console,
    basic,
    fetch,
    refused_start,
    shots,
    start_console,
    stop_console,
    text_of,
    without_credentials,
)

PASSWORD = "pa55-" + uuid.uuid4().hex
CREDENTIALS = {"CRONOQ_CONSOLE_USER": "ops", "CRONOQ_CONSOLE_PASSWORD": PASSWORD}
AUTH = basic("ops", PASSWORD)


@pytest.fixture
def acting(pg_url: URL, tmp_path: Path) -> Iterator[Console]:
    console = start_console(
        pg_url, tmp_path, "--allow-actions", env=without_credentials(**CREDENTIALS)
    )
    try:
        yield console
    finally:
        stop_console(console)


@pytest.fixture
async def leader(pg_url: URL, migrated: str) -> AsyncIterator[PgStore]:
    """Leading, with a short session timeout: ask for it after the fixtures that block the
    event loop while they start (the browser, the console)."""
    async with await PgStore.connect(pg_url, ha_config(migrated, "handover-a")) as a:
        await a.acquire_leadership()
        yield a


def test_actions_refuse_to_start_without_credentials(pg_url: URL) -> None:
    done = refused_start(pg_url, "--allow-actions", "--port", "0", env=without_credentials())
    assert done.returncode == ExitCode.USAGE
    assert "refusing --allow-actions without authentication" in done.stderr


async def test_without_the_flag_there_is_no_action(
    browser: webdriver.Chrome, console_at: Console, leader: PgStore
) -> None:
    cluster = f"{console_at.base}/clusters/{leader.config.schema}"
    assert (await fetch(cluster + "/handover")).status == 404
    posted = await fetch(
        cluster + "/handover",
        {"Content-Type": "application/x-www-form-urlencoded"},
        method="POST",
    )
    assert posted.status == 404

    def look() -> None:
        browser.get(cluster)
        WebDriverWait(browser, PATIENCE).until(lambda b: b.find_elements(By.ID, "live-tasks"))
        assert browser.find_elements(By.ID, "handover") == []

    await asyncio.to_thread(look)
    assert leader.is_leader


def credentialed(base: str) -> str:
    scheme, rest = base.split("://")
    return f"{scheme}://ops:{PASSWORD}@{rest}"


async def test_a_handover_through_the_page_shows_the_new_epoch(
    browser: webdriver.Chrome, acting: Console, pg_url: URL, leader: PgStore, tmp_path: Path
) -> None:
    schema = leader.config.schema
    first = leader.epoch
    assert first is not None
    async with await PgStore.connect(pg_url, ha_config(schema, "handover-b")) as b:
        standby = asyncio.create_task(b.acquire_leadership())

        def hand_over() -> None:
            browser.get(credentialed(acting.base) + f"/clusters/{schema}")
            WebDriverWait(browser, PATIENCE).until(lambda d: d.find_elements(By.ID, "handover"))
            browser.find_element(By.ID, "handover").click()
            WebDriverWait(browser, PATIENCE).until(
                lambda d: d.find_elements(By.ID, "confirm-handover")
            )
            assert "handover-a" in browser.find_element(By.ID, "handover-holder").text
            assert browser.find_element(By.ID, "handover-epoch").text == str(first)
            browser.save_screenshot(str(shots(tmp_path) / "handover.png"))
            browser.find_element(By.ID, "confirm-handover").click()
            WebDriverWait(browser, PATIENCE).until(lambda d: d.find_elements(By.ID, "new-epoch"))
            assert browser.find_element(By.ID, "new-epoch").text == str(first + 1)
            assert "handover-b" in browser.find_element(By.ID, "new-leader").text
            browser.save_screenshot(str(shots(tmp_path) / "handed-over.png"))

        await asyncio.to_thread(hand_over)
        assert await bounded(standby, "the standby's takeover") == first + 1
        await bounded(leader.leadership_lost(), "the leader stepping down")
    assert f"handover of {schema} asked by ops: ending session pid" in acting.stderr()
    assert f"handover of {schema} asked by ops: epoch {first + 1}" in acting.stderr()
    assert PASSWORD not in acting.stderr()


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    """Another site: a page with a form that posts a handover to the console."""

    target = ""

    def do_GET(self) -> None:
        pid, action = self.path.lstrip("/?").split("&", 1)
        body = (
            f'<form method="post" action="{urllib.parse.unquote(action)}">'
            f'<input type="hidden" name="pid" value="{pid}">'
            '<button id="go">win a prize</button></form>'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


async def test_a_post_without_the_token_or_from_another_site_is_refused(
    browser: webdriver.Chrome, acting: Console, leader: PgStore
) -> None:
    schema = leader.config.schema
    target = f"{acting.base}/clusters/{schema}/handover"
    page = (await fetch(target + "?format=json", AUTH)).json()
    pid = page["leader"]["pid"]
    token = page["csrf"]
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    host = acting.base.split("://")[1]
    attempts = [
        (form, f"pid={pid}"),  # no token
        (form, f"pid={pid}&csrf={'0' * 64}"),  # a wrong one
        (form, f"pid={pid}&csrf={token}x"),
        ({**form, "Origin": "http://evil.example"}, f"pid={pid}&csrf={token}"),
        ({**form, "Origin": f"http://{host}.evil.example"}, f"pid={pid}&csrf={token}"),
        ({**form, "Sec-Fetch-Site": "cross-site"}, f"pid={pid}&csrf={token}"),
        ({**form, "Sec-Fetch-Site": "same-site"}, f"pid={pid}&csrf={token}"),
    ]
    for headers, body in attempts:
        reply = await asyncio.to_thread(_post, target, headers, body)
        assert reply == 403, (headers, body)
    assert leader.is_leader
    # Without the credentials, nothing is even looked at.
    bare = {"Content-Type": "application/x-www-form-urlencoded"}
    assert await asyncio.to_thread(_post, target, bare, f"pid={pid}&csrf={token}") == 401

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        elsewhere = (
            f"http://localhost:{server.server_address[1]}/?{pid}&{urllib.parse.quote(target)}"
        )

        def lured() -> str:
            # The browser holds the console's credentials, as an operator's would.
            browser.get(credentialed(acting.base) + f"/clusters/{schema}")
            WebDriverWait(browser, PATIENCE).until(lambda d: d.find_elements(By.ID, "handover"))
            browser.get(elsewhere)
            browser.find_element(By.ID, "go").click()
            WebDriverWait(browser, PATIENCE).until(lambda d: d.current_url.startswith(acting.base))
            text: str = browser.find_element(By.TAG_NAME, "body").text
            return text

        shown = await asyncio.to_thread(lured)
    finally:
        server.shutdown()
        server.server_close()
    assert "refused" in shown or "authentication required" in shown, shown
    await holds_for(
        lambda: leader.is_leader and "ending session" not in acting.stderr(),
        "the leader untouched by the lured request",
        0.5,
    )


def _post(url: str, headers: dict[str, str], body: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def test_a_prune_through_the_page_counts_first_then_deletes_what_it_counted(
    browser: webdriver.Chrome, acting: Console, store: PgStore, tmp_path: Path
) -> None:
    schema = store.config.schema
    changes: list[Mutation] = []
    for n in range(1, 31):  # 30 finished two days ago
        changes += [submitted(n, key=f"old-{n}"), changed(n, SUCCEEDED, at=-2 * DAY)]
    for n in range(31, 36):  # 5 finished just now
        changes += [submitted(n), changed(n, SUCCEEDED)]
    # A live task depends on old-7 by key: that one is kept.
    changes.append(
        Submitted(TaskId(40), seq=40, arrival=0, spec=TaskSpec(b"p", deps=[Dependency("old-7")]))
    )
    await store.commit(0, START_BASE, changes, [])
    target = f"{acting.base}/clusters/{schema}/prune"

    def prune() -> None:
        browser.get(credentialed(acting.base) + f"/clusters/{schema}")
        WebDriverWait(browser, PATIENCE).until(lambda d: d.find_elements(By.ID, "prune"))
        browser.find_element(By.ID, "prune").click()
        WebDriverWait(browser, PATIENCE).until(lambda d: d.find_elements(By.ID, "older-than"))
        field = browser.find_element(By.ID, "older-than")
        field.clear()
        field.send_keys("1d")
        browser.find_element(By.ID, "count").click()
        WebDriverWait(browser, PATIENCE).until(lambda d: "older_than=1d" in d.current_url)
        assert browser.find_element(By.ID, "would-delete").text == "29"
        assert browser.find_element(By.ID, "would-keep").text.startswith("1 ")
        browser.save_screenshot(str(shots(tmp_path) / "prune.png"))
        browser.find_element(By.ID, "confirm-prune").click()
        WebDriverWait(browser, PATIENCE).until(lambda d: "/prune/" in d.current_url)
        WebDriverWait(browser, PATIENCE).until(lambda d: text_of(d, "#prune-state") == "done")
        assert text_of(browser, "#deleted") == "29"
        assert text_of(browser, "#asked-by").startswith("ops, ")
        browser.save_screenshot(str(shots(tmp_path) / "pruning.png"))

    await asyncio.to_thread(prune)
    assert await store.get_task(TaskId(1)) is None
    assert await store.get_task("old-7") is not None
    assert await store.get_task(TaskId(31)) is not None
    assert f"prune of {schema} asked by ops: 29 deleted" in acting.stderr()
    assert f"prune of {schema} asked by ops: done, 29 deleted" in acting.stderr()

    # The token is bound to the dry run's cutoff: another cutoff is refused.
    page = (await fetch(target + "?older_than=0s&format=json", AUTH)).json()
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    later, counted = page["cutoff_ns"] + 10**9, page["would_delete"]
    token = f"csrf={page['csrf']}"
    for body in (
        f"cutoff={later}&expected={counted}&{token}",
        f"cutoff={page['cutoff_ns']}&expected={counted + 1}&{token}",
        f"cutoff={page['cutoff_ns']}&expected={counted}",
    ):
        assert await asyncio.to_thread(_post, target, form, body) == 403, body
    assert await store.get_task(TaskId(31)) is not None


async def test_a_prune_page_shows_its_progress_live_until_it_ends(
    browser: webdriver.Chrome, acting: Console, store: PgStore, engine: AsyncEngine
) -> None:
    """The real run starts in the background and its page refreshes itself: "running" with
    the rows deleted so far while a batch waits (here on the leader row, held by a commit
    that does not end), then "done" with the count, and then it stops asking."""
    schema = store.config.schema
    changes: list[Mutation] = []
    for n in range(1, 2501):  # three batches of the store's prune loop
        changes += [submitted(n), changed(n, SUCCEEDED, at=-2 * DAY)]
    await store.commit(0, START_BASE, changes, [])
    dry_run = f"{acting.base}/clusters/{schema}/prune?older_than=1d&format=json"
    dry = (await fetch(dry_run, AUTH)).json()
    assert dry["would_delete"] == 2500
    async with engine.connect() as blocker:
        # What a commit inserting tasks holds: each prune batch first waits for it.
        await blocker.exec_driver_sql(
            f'SELECT epoch FROM "{schema}".cronoq_leader WHERE id = 1 FOR UPDATE'
        )

        def start() -> str:
            browser.get(credentialed(acting.base) + f"/clusters/{schema}/prune?older_than=1d")
            WebDriverWait(browser, PATIENCE).until(
                lambda d: d.find_elements(By.ID, "confirm-prune")
            )
            browser.find_element(By.ID, "confirm-prune").click()
            WebDriverWait(browser, PATIENCE).until(lambda d: "/prune/" in d.current_url)
            assert text_of(browser, "#prune-state") == "running"
            assert text_of(browser, "#deleted") == "0"
            url: str = browser.current_url
            return url

        progress = await asyncio.to_thread(start)
        path = urllib.parse.urlsplit(progress).path

        async def still_blocked() -> bool:
            running = (await fetch(f"{acting.base}{path}?format=json", AUTH)).json()
            return (running["done"], running["deleted"], running["asked_by"]) == (False, 0, "ops")

        # A refresh or two, still blocked.
        await holds_for(still_blocked, "the prune blocked", 1.5, every=0.25)
        await blocker.rollback()

    def finish() -> None:
        WebDriverWait(browser, PATIENCE).until(lambda d: text_of(d, "#prune-state") == "done")
        assert browser.current_url == progress  # refreshed in place, not reloaded
        assert text_of(browser, "#deleted") == "2,500"
        assert text_of(browser, "#batches").startswith("3 ")
        WebDriverWait(browser, PATIENCE).until(
            lambda d: text_of(d, "#refreshed").startswith("final ")
        )

    await asyncio.to_thread(finish)
    log = acting.stderr()
    assert f"prune of {schema} asked by ops: 1000 deleted" in log
    assert f"prune of {schema} asked by ops: done, 2500 deleted" in log
    assert PASSWORD not in log
