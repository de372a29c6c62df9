"""The console in Debian's chromium, against the real command and the suite's PostgreSQL,
seeded through the store: what an operator clicks through, what an attacker's stored text
does (nothing), and that the page refreshes itself after a commit.

Screenshots of each page go to ``$CRONOQ_CONSOLE_SCREENSHOTS`` when it is set (how
docs/console/*.png are made), else to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait
from sqlalchemy.engine import URL

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store import _listing_statements as cs
from cronoq_store._domain import (
    Dependency,
    DependencyCondition,
    Mutation,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._terminal_safe import visible

from ..pgharness import admin_execute
from ..support import DAY, FAILED, START_BASE, SUCCEEDED, changed, submitted
from ..waits import PATIENCE
from .conftest import Console, fetch, logs, shots, text_of

HOSTILE_KEY = "<img src=x onerror=alert(1)>"
HOSTILE_POOL = "<script>alert(2)</script>\u202eloop"
HOSTILE_MESSAGE = "\x1b]0;owned\x07\x1b[2J\x9bstatus  succeeded\n<b onmouseover=alert(3)>x</b>"

#: A time as the pages show it: to the second in UTC, with how long ago.
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \((\d+ (s|min|h|d) ago|just now)\)"


def no_alert(browser: webdriver.Chrome) -> None:
    with pytest.raises(NoAlertPresentException):
        _ = browser.switch_to.alert.text


def wait_for(browser: webdriver.Chrome, css: str, timeout: float = PATIENCE) -> None:
    WebDriverWait(browser, timeout).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, css), f"no {css}"
    )


def follow(browser: webdriver.Chrome, link: WebElement, css: str) -> None:
    """Click ``link`` and wait for the page it loads to show ``css``. The old page must be
    gone first: an element that both pages have (a table, a form) would otherwise be found
    on the old one, and go stale as a test reads it."""
    old = browser.find_element(By.TAG_NAME, "html")
    link.click()

    def gone(_: webdriver.Chrome) -> bool:
        try:
            old.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as error:
            # Chromedriver, asked mid-navigation, may say the node left the document in an
            # inspector error instead of a stale reference.
            if "does not belong to the document" in str(error):
                return True
            raise
        return False

    WebDriverWait(browser, PATIENCE).until(gone, "the page did not change")
    wait_for(browser, css)


def spec_of(id: int, **spec: object) -> Submitted:
    return Submitted(TaskId(id), seq=id, arrival=0, spec=TaskSpec(b"payload", **spec))  # type: ignore[arg-type]


async def test_overview_to_cluster_to_task_and_back(
    pg_url: URL, migrated: str, console_at: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    config = PgStoreConfig(schema=migrated, application_name="billing-worker")
    async with await PgStore.connect(pg_url, config) as store:
        epoch = await store.acquire_leadership()
        await store.commit(
            epoch,
            START_BASE,
            [
                submitted(1, key="nightly", pool="etl", kind="report", tenant="acme"),
                changed(1, SUCCEEDED, message="42 rows"),
                spec_of(
                    2,
                    key="invoice-7",
                    pool="billing",
                    kind="invoice",
                    deps=[
                        Dependency(TaskId(1)),
                        Dependency("nightly", DependencyCondition.SUCCEEDED),
                        Dependency(TaskId(99)),
                    ],
                    resources={"cpu": 2},
                    tags=["monthly"],
                    labels=["team:finance"],
                ),
                submitted(3, pool="billing"),
                submitted(4, pool="etl"),
                changed(4, FAILED, message="upstream timed out"),
            ],
            [(TaskId(1), b"csv")],
        )
        where = shots(tmp_path)
        base = console_at.base

        def walk() -> None:
            browser.get(base + "/")
            section = f"#cluster-{migrated}"
            wait_for(browser, section)
            summary = text_of(browser, section)
            assert "healthy" in summary
            assert "unhealthy" not in summary
            assert f"epoch\n{epoch}" in summary
            assert "billing-worker" in summary  # the leader's application_name
            # Times as the task page gives them (the leader's, the newest change), none raw.
            assert len(re.findall(STAMP, summary)) == 2, summary
            assert not re.search(r"\d{4}-\d\d-\d\dT", summary), summary
            assert "queued 2" in text_of(browser, f"{section} .live")
            assert text_of(browser, f"{section} .finished") == "failed 1 · succeeded 1"
            browser.save_screenshot(str(where / "overview.png"))

            follow(
                browser,
                browser.find_element(By.CSS_SELECTOR, f"{section} a.cluster-link"),
                "#live-tasks",
            )
            live = text_of(browser, "#live-tasks")
            assert "billing queued 2" in live
            finished = browser.find_elements(By.CSS_SELECTOR, "#finished-tasks tbody tr")
            assert [r.find_element(By.CSS_SELECTOR, "td").text for r in finished] == ["4", "1"]
            browser.save_screenshot(str(where / "cluster.png"))

            browser.find_element(By.ID, "lookup-key").send_keys("invoice-7")
            follow(browser, browser.find_element(By.CSS_SELECTOR, "form.lookup button"), "#task-id")
            assert text_of(browser, "#task-id") == "2 (0/2)"
            assert text_of(browser, "#task-status") == "queued"
            assert json.loads(text_of(browser, "#task-resources")) == {"cpu": 2}
            assert json.loads(text_of(browser, "#task-labels")) == ["team:finance"]
            rows = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#deps tbody tr")]
            assert len(rows) == 3
            assert "succeeded" in rows[0]
            assert "succeeded" in rows[1]
            assert "(nightly)" in rows[1]
            assert "no such task" in rows[2]
            browser.save_screenshot(str(where / "task.png"))

            follow(browser, browser.find_element(By.CSS_SELECTOR, "a.dep-link"), "#task-key")
            assert text_of(browser, "#task-key") == "nightly"
            assert "3 bytes" in text_of(browser, "#task")
            browser.back()
            wait_for(browser, "#deps")
            assert text_of(browser, "#task-id").startswith("2 ")
            follow(browser, browser.find_element(By.ID, "back"), "#live-tasks")
            follow(
                browser,
                browser.find_element(By.CSS_SELECTOR, "header a.home"),
                f"#cluster-{migrated}",
            )
            no_alert(browser)

        await asyncio.to_thread(walk)


async def test_the_lookup_takes_a_short_id_and_lists_a_number_of_several_epochs(
    store: PgStore, console_at: Console, browser: webdriver.Chrome
) -> None:
    one, other = task_id(1, 42), task_id(3, 42)
    await store.commit(
        0, START_BASE, [submitted(one, key="first"), submitted(other, key="second")], []
    )
    cluster = f"{console_at.base}/clusters/{store.config.schema}"

    def look_up(text: str) -> None:
        browser.get(cluster)
        wait_for(browser, "#lookup-id")
        browser.find_element(By.ID, "lookup-id").send_keys(text)
        browser.find_element(By.ID, "lookup-id").submit()

    def walk() -> None:
        look_up("3/42")
        wait_for(browser, "#task-id")
        assert text_of(browser, "#task-id") == f"{other} (3/42)"
        assert text_of(browser, "#task-key") == "second"

        look_up("42")
        wait_for(browser, "#matches")
        assert "42 names a task in each of these epochs" in text_of(browser, "#ambiguous")
        rows = browser.find_elements(By.CSS_SELECTOR, "#matches tbody tr")
        assert [r.text.split()[:3] for r in rows] == [
            [str(one), "1/42", "first"],
            [str(other), "3/42", "second"],
        ]
        follow(browser, rows[0].find_element(By.CSS_SELECTOR, "a.task-link"), "#task-key")
        assert text_of(browser, "#task-key") == "first"
        no_alert(browser)

    await asyncio.to_thread(walk)
    listed = await fetch(f"{cluster}/task?id=42&format=json")
    assert listed.status == 300
    assert [t["short_id"] for t in listed.json()["matches"]] == ["1/42", "3/42"]
    assert (await fetch(f"{cluster}/task?id=4/42")).status == 404
    assert (await fetch(f"{cluster}/task?id=32768/1")).status == 400


def seconds(age: str) -> int:
    """An age as the pages print it (``1h 5m``, ``12s``) in seconds."""
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(part[:-1]) * units[part[-1]] for part in age.split())


async def test_the_live_page_lists_oldest_first_with_filters_ages_and_pages(
    store: PgStore, console_at: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    minute = 60 * 10**9
    batch: list[Mutation] = [
        Submitted(
            TaskId(n),
            seq=n,
            arrival=-(61 - n) * minute,  # task 1 arrived an hour ago, task 60 a minute ago
            spec=TaskSpec(b"p", pool="etl" if n % 2 else "web", kind=f"k{n % 3}", key=f"key-{n}"),
        )
        for n in range(1, 61)
    ]
    batch += [StatusChanged(TaskId(n), TaskStatus.RUNNING, attempt=1, at=0) for n in (3, 6)]
    batch += [submitted(61), changed(61, SUCCEEDED)]  # finished: not listed
    await store.commit(0, START_BASE, batch, [])
    cluster = f"{console_at.base}/clusters/{store.config.schema}"
    where = shots(tmp_path)

    def ids() -> list[int]:
        cells = browser.find_elements(By.CSS_SELECTOR, "#live-list tbody a.task-link")
        return [int(c.text) for c in cells]

    def walk() -> None:
        browser.get(cluster)
        wait_for(browser, "#live-link")
        follow(browser, browser.find_element(By.ID, "live-link"), "#live-list")
        assert text_of(browser, "#matching") == "60 matching, oldest first"
        assert ids() == list(range(1, 51))
        shown = browser.find_elements(By.CSS_SELECTOR, "#live-list td.age")
        ages = [seconds(a.text) for a in shown]
        assert ages == sorted(ages, reverse=True)
        # Since it arrived: task n arrived 61 - n minutes before START_BASE (taken at import).
        for n in (1, 50):
            expected = (time.time_ns() - (START_BASE.unix_ns - (61 - n) * minute)) / 1e9
            assert expected - 120 < ages[n - 1] <= expected, (n, shown[n - 1].text)
        # Times to the second, with how long ago: as on the task page.
        updated = [c.text for c in browser.find_elements(By.CSS_SELECTOR, "#live-list td.when")]
        assert len(updated) == 50
        assert all(re.fullmatch(STAMP, u) for u in updated), updated[:3]
        browser.save_screenshot(str(where / "live.png"))
        follow(browser, browser.find_element(By.ID, "next-page"), "#end")
        assert ids() == list(range(51, 61))
        assert text_of(browser, "#end") == "end of list"
        follow(browser, browser.find_element(By.ID, "first-page"), "#filters")
        assert ids()[0] == 1

        browser.find_element(By.NAME, "pool").send_keys("etl")
        Select(browser.find_element(By.NAME, "status")).select_by_visible_text("running")
        follow(browser, browser.find_element(By.ID, "apply"), "#matching")
        assert ids() == [3]
        assert text_of(browser, "#matching") == "1 matching, oldest first"
        browser.get(f"{cluster}/live?key=key-7&kind=k1")
        wait_for(browser, "#live-list")
        assert ids() == [7]
        no_alert(browser)

    await asyncio.to_thread(walk)
    doc = (await fetch(f"{cluster}/live?format=json&status=running")).json()
    assert doc["schema"] == store.config.schema
    page = doc["live"]
    assert [(t["id"], t["status"]) for t in page["tasks"]] == [(3, "running"), (6, "running")]
    assert (page["matching"], page["matching_at_least"], page["scan_stopped"]) == (2, False, False)
    assert (page["next"], page["next_url"], page["first_url"]) == (None, None, None)
    assert (await fetch(f"{cluster}/live?status=succeeded")).status == 400
    assert (await fetch(f"{cluster}/live?after=x")).status == 400


async def test_filters_and_keyset_pages(
    store: PgStore, console_at: Console, browser: webdriver.Chrome
) -> None:
    # 130 finished tasks, one a minute apart, in two pools and two statuses.
    changes: list[Mutation] = []
    for n in range(1, 131):
        changes.append(submitted(n, pool="etl" if n % 2 else "web", kind=f"k{n % 3}"))
        changes.append(changed(n, FAILED if n % 5 == 0 else SUCCEEDED, at=-n * 60 * 10**9))
    await store.commit(0, START_BASE, changes, [])
    cluster = f"{console_at.base}/clusters/{store.config.schema}"

    def ids() -> list[int]:
        cells = browser.find_elements(By.CSS_SELECTOR, "#finished-tasks tbody a.task-link")
        return [int(c.text) for c in cells]

    def every_page() -> list[int]:
        seen = ids()
        while browser.find_elements(By.ID, "next-page"):
            follow(browser, browser.find_element(By.ID, "next-page"), "#finished-tasks")
            seen += ids()
        assert text_of(browser, "#end") == "end of list"
        return seen

    def walk() -> None:
        browser.get(cluster)
        wait_for(browser, "#finished-tasks")
        assert text_of(browser, "#matching") == "130 matching, newest first"
        # Newest first: the smallest `ago` is the newest update.
        assert every_page() == list(range(1, 131))

        browser.get(cluster)
        wait_for(browser, "#filters")
        browser.find_element(By.NAME, "pool").send_keys("etl")
        Select(browser.find_element(By.NAME, "status")).select_by_visible_text("failed")
        follow(browser, browser.find_element(By.ID, "apply"), "#matching")
        expected = [n for n in range(1, 131) if n % 2 and n % 5 == 0]
        assert every_page() == expected
        assert text_of(browser, "#matching") == f"{len(expected)} matching, newest first"

        # A time window: updated within the last 55 minutes (tasks 1..54), kind k0.
        since = datetime.fromtimestamp(START_BASE.unix_ns / 1e9, timezone.utc) - timedelta(
            minutes=55
        )
        browser.get(f"{cluster}?kind=k0&since={since:%Y-%m-%dT%H:%M:%S}")
        wait_for(browser, "#finished-tasks")
        assert every_page() == [n for n in range(1, 55) if n % 3 == 0]
        no_alert(browser)

    await asyncio.to_thread(walk)
    # Past the last page: nothing, and no error.
    past = await fetch(f"{cluster}?before=0.0&format=json")
    assert past.json()["finished"] == {
        "tasks": [],
        "next": None,
        "next_url": None,
        "first_url": "?format=json",
        "matching": 130,
        "matching_at_least": False,
        "counted": f"the newest {cs.SAMPLE:,} of the window",
        "scan": cs.SCAN,
        "scan_stopped": False,
    }


async def test_the_overview_refreshes_after_a_commit(
    store: PgStore, refreshing: Console, browser: webdriver.Chrome
) -> None:
    console_at = refreshing
    await store.commit(0, START_BASE, [submitted(1)], [])
    live = f"#cluster-{store.config.schema} .live"
    browser.get(console_at.base + "/")
    wait_for(browser, live)
    assert text_of(browser, live) == "queued 1"

    await store.commit(0, START_BASE, [submitted(2), submitted(3), changed(3, SUCCEEDED)], [])
    await asyncio.to_thread(
        WebDriverWait(browser, PATIENCE).until, lambda b: text_of(b, live) == "queued 2"
    )
    finished = f"#cluster-{store.config.schema} .finished"
    assert text_of(browser, finished) == "succeeded 1"
    assert text_of(browser, "#refreshed").startswith("refreshed ")


async def test_hostile_text_is_shown_as_text(
    store: PgStore, console_at: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    await store.commit(
        0,
        START_BASE,
        [
            submitted(1, key=HOSTILE_KEY, pool=HOSTILE_POOL, kind="<i>k</i>", tenant="\u2066t"),
            changed(1, FAILED, message=HOSTILE_MESSAGE),
            submitted(2, key="\u202egnp.exe", pool=HOSTILE_POOL),
        ],
        [],
    )
    cluster = f"{console_at.base}/clusters/{store.config.schema}"

    def look() -> None:
        logs(browser)  # drains what earlier pages logged
        browser.get(cluster)
        wait_for(browser, "#finished-tasks")
        row = browser.find_element(By.CSS_SELECTOR, "#finished-tasks tbody tr")
        cells = [c.text for c in row.find_elements(By.CSS_SELECTOR, "td")]
        assert cells[1:5] == [HOSTILE_KEY, visible(HOSTILE_POOL), "<i>k</i>", "\\u2066t"]
        # (A table cell collapses runs of spaces, as HTML does.)
        assert cells[8] == visible(HOSTILE_MESSAGE)[:120].replace("  ", " ")
        assert visible(HOSTILE_POOL) in text_of(browser, "#live-tasks")
        for tag in ("img", "i", "b"):
            assert browser.find_elements(By.CSS_SELECTOR, f"main {tag}") == []
        # One <script>, the page's own file: nothing stored became one.
        scripts = browser.find_elements(By.TAG_NAME, "script")
        assert [s.get_attribute("src") for s in scripts] == [console_at.base + "/static/console.js"]
        browser.save_screenshot(str(shots(tmp_path) / "hostile.png"))

        browser.get(f"{cluster}/task?id=1")
        wait_for(browser, "#task-message")
        assert text_of(browser, "#task-key") == HOSTILE_KEY
        # A block keeps its newline, and nothing else of the terminal's controls.
        assert text_of(browser, "#task-message") == (
            "\\x1b]0;owned\\x07\\x1b[2J\\x9bstatus  succeeded\n<b onmouseover=alert(3)>x</b>"
        )
        assert browser.title == "task 1 · " + store.config.schema
        browser.get(f"{cluster}/task?key=%E2%80%AEgnp.exe")
        wait_for(browser, "#task-key")
        assert text_of(browser, "#task-key") == "\\u202egnp.exe"
        no_alert(browser)
        errors = [e for e in logs(browser) if e["level"] == "SEVERE"]
        assert errors == [], errors  # no policy violation, no script error

    await asyncio.to_thread(look)
    doc = (await fetch(f"{cluster}/task?id=1&format=json")).json()
    assert (doc["key"], doc["pool"], doc["message"]) == (HOSTILE_KEY, HOSTILE_POOL, HOSTILE_MESSAGE)


async def test_the_task_page_speaks_in_durations_words_and_coloured_statuses(
    store: PgStore, console_at: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    await store.commit(
        0,
        START_BASE,
        [
            spec_of(
                1,
                key="weekly",
                timeout=timedelta(seconds=30),
                duration_hint=timedelta(minutes=2, seconds=5),
                retry=RetryPolicy(5, timedelta(seconds=10), timedelta(minutes=5), 3.0),
                deps=[Dependency(TaskId(2)), Dependency(TaskId(3))],
            ),
            submitted(2),
            changed(2, FAILED),
            submitted(3),
            changed(3, SUCCEEDED),
        ],
        [],
    )
    cluster = f"{console_at.base}/clusters/{store.config.schema}"

    def look() -> None:
        logs(browser)
        browser.get(f"{cluster}/task?key=weekly")
        wait_for(browser, "#task-timeout")
        assert text_of(browser, "#task-timeout") == "30 s"
        assert text_of(browser, "#task-duration-hint") == "2 min 5 s"
        assert text_of(browser, "#task-retry").startswith(
            "up to 5 attempts; waits 10 s after the first failure, multiplied by 3 after each "
            "failure after it, at most 5 min"
        )
        assert re.fullmatch(STAMP, text_of(browser, "#task-updated"))
        assert " ns" not in text_of(browser, "#task")
        colours = {}
        for badge in browser.find_elements(By.CSS_SELECTOR, ".status"):
            colours[badge.text] = badge.value_of_css_property("background-color")
        # Each status keeps its name as text, and the three differ in colour.
        assert set(colours) == {"queued", "failed", "succeeded"}
        assert len(set(colours.values())) == 3
        assert "rgba(0, 0, 0, 0)" not in colours.values()
        browser.save_screenshot(str(shots(tmp_path) / "task-words.png"))
        browser.get(cluster)
        wait_for(browser, "#finished-tasks")
        finished = browser.find_elements(By.CSS_SELECTOR, "#finished-tasks .status")
        assert [b.text for b in finished] == ["succeeded", "failed"]
        assert "style" not in browser.page_source.replace("stylesheet", "")
        errors = [e for e in logs(browser) if e["level"] == "SEVERE"]
        assert errors == [], errors  # no policy violation

    await asyncio.to_thread(look)


async def test_the_cluster_page_shows_the_leadership_timeline(
    pg_url: URL, migrated: str, console_at: Console, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    """Three real takeovers, each by an instance of its own: the timeline lists the terms
    newest first, with who took each and how long the cluster had no leader before it; the
    newest leads while its instance does, and reads as ended once it let go."""
    for name in ("billing-a", "billing-b"):
        config = PgStoreConfig(schema=migrated, application_name=name)
        async with await PgStore.connect(pg_url, config) as store:
            await store.acquire_leadership()
    config = PgStoreConfig(schema=migrated, application_name="billing-c")
    leader = await PgStore.connect(pg_url, config)
    await leader.acquire_leadership()
    cluster = f"{console_at.base}/clusters/{migrated}"

    def look() -> None:
        logs(browser)
        browser.get(cluster)
        wait_for(browser, "#timeline")
        terms = browser.find_elements(By.CSS_SELECTOR, "#timeline li.term")
        assert [t.text.split(" began")[0] for t in terms] == ["epoch 3", "epoch 2", "epoch 1"]
        assert "leading" in terms[0].text
        assert "lasted at most" in terms[1].text
        holders = [t.find_element(By.CSS_SELECTOR, ".term-holder").text for t in terms]
        for holder, name in zip(holders, ("billing-c", "billing-b", "billing-a"), strict=True):
            assert f", {name} leader" in holder, holder
        gaps = [g.text for g in browser.find_elements(By.CSS_SELECTOR, "#timeline li.gap")]
        assert gaps[-1] == (
            "no leader before it: unknown (the lock was free at its first try); "
            "the epoch before is not recorded"
        )
        browser.execute_script("document.getElementById('timeline').scrollIntoView()")
        browser.save_screenshot(str(shots(tmp_path) / "timeline.png"))
        errors = [e for e in logs(browser) if e["level"] == "SEVERE"]
        assert errors == [], errors

    try:
        await asyncio.to_thread(look)
        doc = (await fetch(cluster + "?format=json")).json()
        assert [t["epoch"] for t in doc["leadership_history"]] == [3, 2, 1]
        assert [t["leading"] for t in doc["leadership_history"]] == [True, False, False]
    finally:
        await leader.close()
    doc = (await fetch(cluster + "?format=json")).json()
    assert [t["leading"] for t in doc["leadership_history"]] == [False, False, False]
    page = (await fetch(cluster)).text()
    assert "epoch 3</span> began" in page
    assert "ended (when is not recorded; no leader now)" in page


async def test_old_finished_tasks_are_counted_at_least(store: PgStore, console_at: Console) -> None:
    """More finished tasks than a count examines: the overview says "at least"."""
    many = cs.SAMPLE + 5
    changes: list[Mutation] = []
    for n in range(1, many + 1):
        changes += [submitted(n), changed(n, SUCCEEDED, at=-DAY)]
    await store.commit(0, START_BASE, changes, [])
    clusters = (await fetch(console_at.base + "/?format=json")).json()["clusters"]
    (cluster,) = [c for c in clusters if c["schema"] == store.config.schema]
    assert cluster["finished"] == {
        "statuses": [{"status": "succeeded", "count": cs.SAMPLE}],
        "examined": cs.SAMPLE,
        "sample": cs.SAMPLE,
        "at_least": True,
    }
    page = (await fetch(console_at.base + "/")).text()
    assert f"succeeded ≥ {cs.SAMPLE:,}" in page
    assert "(at least: among the newest" in page


async def test_a_slow_refresh_is_never_overlapped_by_the_next(
    store: PgStore, refreshing: Console, browser: webdriver.Chrome
) -> None:
    """Refreshes slower than the page's period (1 s here): the page waits for each to end
    before it starts the next, so one open tab never piles requests up on the server (the
    overview of many clusters can take longer than its period)."""
    await store.commit(0, START_BASE, [submitted(1)], [])
    browser.get(refreshing.base + "/")
    wait_for(browser, f"#cluster-{store.config.schema} .live")
    # Every refresh from now on takes 3 s longer than the server does.
    browser.execute_script(
        "var real = window.fetch, seen = window.reading = {open: 0, most: 0, ended: 0};"
        " window.fetch = function () {"
        "   var args = arguments; seen.open += 1; seen.most = Math.max(seen.most, seen.open);"
        "   return new Promise(function (done) { setTimeout(done, 3000); })"
        "     .then(function () { return real.apply(window, args); })"
        "     .finally(function () { seen.open -= 1; seen.ended += 1; }); };"
    )
    await asyncio.to_thread(
        WebDriverWait(browser, PATIENCE + 10).until,
        lambda b: b.execute_script("return window.reading.ended") >= 2,
    )
    seen = browser.execute_script("return window.reading")
    assert seen["most"] == 1, seen
    assert text_of(browser, "#refreshed").startswith("refreshed ")


async def test_a_refused_refresh_says_why(
    pg_url: URL, store: PgStore, refreshing: Console, browser: webdriver.Chrome
) -> None:
    """A refresh the server refuses after the page opened shows the reason its error page
    gives (as that page writes it), and the content shown before stays."""
    schema = store.config.schema
    await store.commit(0, START_BASE, [submitted(1)], [])
    browser.get(f"{refreshing.base}/clusters/{schema}/live")
    wait_for(browser, "#live-list")
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_alembic_version SET version_num = '0003_x'"
    )
    await asyncio.to_thread(
        WebDriverWait(browser, PATIENCE).until,
        lambda b: text_of(b, "#refreshed").startswith("not refreshed: HTTP 409: "),
    )
    assert f"schema '{schema}' is at revision 0003_x" in text_of(browser, "#refreshed")
    assert browser.find_elements(By.CSS_SELECTOR, "#live-list")
