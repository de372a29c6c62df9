"""The charts page and its JSON document against rows committed through the store at known
times: each bucket's counts, the window's edges, the bound on the tasks a bucket examines
(and the estimate past it), the backlog and its oldest task; a cluster with no task, a
schema that holds none, one behind this build."""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import PgStore, TaskStatus
from cronoq_store import _listing_statements as cs
from cronoq_store._cli import output
from cronoq_store._console import reads
from cronoq_store._domain import Mutation, StatusChanged, Submitted, TaskId, TaskSpec, TimeBase
from cronoq_store._terminal_safe import visible

from ..pgharness import admin_execute
from ..support import CANCELLED, FAILED, SKIPPED, SUCCEEDED
from .conftest import Console, fetch

S = 10**9
MINUTE = 60 * S
#: Where the charts end: a minute boundary an hour ago, so no bucket is the minute under way.
END = (time.time_ns() // MINUTE - 60) * MINUTE
BASE = TimeBase(engine_ns=0, unix_ns=END)


def first_read(browser: Any, url: str) -> None:
    """Open the charts page at ``url`` and wait until its script has read its document."""
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE

    browser.get(url)
    WebDriverWait(browser, PATIENCE).until(
        lambda b: b.execute_script("return (window.cronoqCharts || {}).reads || 0") >= 1,
        "the charts never read their document",
    )


def arrived(id: int, seconds_before_end: int = 7200) -> Submitted:
    return Submitted(TaskId(id), seq=id, arrival=-seconds_before_end * S, spec=TaskSpec(b"p"))


def finished(id: int, status: TaskStatus, seconds_before_end: float) -> StatusChanged:
    return StatusChanged(TaskId(id), status, attempt=1, at=-round(seconds_before_end * S))


def charts_url(console: Console, schema: str, end: int = END) -> str:
    return f"{console.base}/clusters/{schema}/charts?end={output.rfc3339(end)}"


async def charts_json(console: Console, schema: str, end: int = END) -> Any:
    reply = await fetch(charts_url(console, schema, end) + "&format=json")
    assert reply.status == 200, reply.text()
    return reply.json()


def non_empty(window: dict[str, Any]) -> dict[int, dict[str, int]]:
    """The counts of each bucket that holds any, by its index."""
    return {i: b["counts"] for i, b in enumerate(window["buckets"]) if b["counts"]}


async def test_each_bucket_counts_the_tasks_that_finished_in_it(
    store: PgStore, console_at: Console
) -> None:
    """A bucket holds the tasks updated from its start (included) to the next one's
    (excluded); the hour's buckets are minutes, the day's quarter hours."""
    schema = store.config.schema
    epoch = await store.acquire_leadership()
    done = {
        1: (SUCCEEDED, 30),  # the hour's last minute
        2: (SUCCEEDED, 60),  # its start: the same minute
        3: (FAILED, 61),  # the minute before
        4: (CANCELLED, 90),
        5: (SKIPPED, 3599),  # the hour's first minute
        6: (SUCCEEDED, 3601),  # before the hour: the day only
        7: (SUCCEEDED, 0),  # the end itself: after the window
        8: (FAILED, 86400),  # the day's first moment
        9: (FAILED, 86401),  # before the day
    }
    batch: list[Mutation] = []
    for id, (status, ago) in done.items():
        batch += [arrived(id), finished(id, status, ago)]
    batch += [arrived(10, seconds_before_end=600), arrived(11, seconds_before_end=60)]
    batch += [arrived(12, 30), finished(12, TaskStatus.RUNNING, 20)]
    await store.commit(epoch, BASE, batch, [])

    doc = await charts_json(console_at, schema)
    assert doc["end"] == output.rfc3339(END)
    assert doc["statuses"] == list(reads.FINISHED_STATUSES)
    hour, day = doc["hour"], doc["day"]
    assert (hour["bucket_seconds"], len(hour["buckets"])) == (60, 60)
    assert (day["bucket_seconds"], len(day["buckets"])) == (900, 96)
    assert hour["start"] == output.rfc3339(END - 60 * MINUTE)
    assert day["start"] == output.rfc3339(END - 1440 * MINUTE)
    assert hour["buckets"][59]["start_unix_s"] == (END - MINUTE) // S
    assert non_empty(hour) == {
        59: {"succeeded": 2},
        58: {"failed": 1, "cancelled": 1},
        0: {"skipped": 1},
    }
    assert hour["buckets"][59]["per_minute"] == {"succeeded": 2.0}
    # The last quarter hour holds 1 to 4; the fourth from last runs from 3,600 s before the
    # end (5 finished 3,599 s before), the fifth from last up to it (6, 3,601 s before);
    # 86,400 s before the end is the first quarter hour's start.
    assert non_empty(day) == {
        95: {"succeeded": 2, "failed": 1, "cancelled": 1},
        92: {"skipped": 1},
        91: {"succeeded": 1},
        0: {"failed": 1},
    }
    assert day["buckets"][95]["per_minute"] == {
        "succeeded": round(2 / 15, 2),
        "failed": round(1 / 15, 2),
        "cancelled": round(1 / 15, 2),
    }
    assert all(b["complete"] for b in [*hour["buckets"], *day["buckets"]])
    assert (hour["estimated"], day["estimated"]) == (0, 0)

    backlog = doc["backlog"]
    assert backlog["live"] == 3
    assert backlog["by_status"] == [
        {"status": "queued", "count": 2},
        {"status": "running", "count": 1},
    ]
    assert backlog["at_least"] is False
    # The live task issued first (id 10), arrived 600 s before the end.
    assert backlog["oldest"]["id"] == 10
    assert backlog["oldest"]["arrival"] == output.rfc3339(END - 600 * S)
    age = (time.time_ns() - (END - 600 * S)) / S
    assert age - 60 <= backlog["oldest"]["age_seconds"] <= age

    # The page shows the same numbers as text.
    html = (await fetch(charts_url(console_at, schema))).text()
    assert "3 live tasks" in html
    assert 'href="/clusters/' + schema + '/task?id=10"' in html
    assert "the numbers: 5 finished" in html  # the hour
    assert "the numbers: 7 finished" in html  # the day
    assert f'data-source="/clusters/{schema}/charts?end=' in html


async def test_a_bucket_past_its_bound_says_so_and_estimates_its_rate(
    engine: AsyncEngine, migrated: str, console_at: Console
) -> None:
    """1,200 tasks finished in one minute, 50 ms apart: the bucket examines its newest
    500 (a lower bound, said to be one) and estimates 1,200 from the 25 s they span."""
    cap = reads.HOUR.cap
    minute_start = END - 10 * MINUTE
    async with engine.begin() as conn:
        await conn.exec_driver_sql(
            f"""
            INSERT INTO "{migrated}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind,
                priority, payload, status, terminal, attempt, updated_unix_ns)
            SELECT n, n, {minute_start}, 'default', '', 0, '\\x00'::bytea,
                   CASE WHEN n % 4 = 0 THEN 'failed' ELSE 'succeeded' END, true, 1,
                   {minute_start} + (n - 1) * 50000000::bigint
            FROM generate_series(1, 1200) AS n
            """
        )
    doc = await charts_json(console_at, migrated)
    bucket = doc["hour"]["buckets"][50]
    assert bucket["start_unix_s"] == minute_start // S
    assert (bucket["examined"], bucket["complete"]) == (cap, False)
    assert bucket["counts"] == {"succeeded": 375, "failed": 125}
    assert bucket["per_minute"] == {"succeeded": 900.0, "failed": 300.0}
    assert doc["hour"]["estimated"] == 1
    # The day's quarter hour holds the same tasks, examined up to its own bound of 300.
    (quarter,) = [b for b in doc["day"]["buckets"] if b["examined"]]
    assert (quarter["examined"], quarter["complete"]) == (reads.DAY.cap, False)
    html = (await fetch(charts_url(console_at, migrated))).text()
    assert "the numbers: at least 500 finished, 1 of 60 buckets estimated" in html
    assert "≥ 375" in html
    assert "≈ 1,200.0" in html


async def test_a_bucket_past_its_bound_is_marked_in_chromium(
    engine: AsyncEngine, migrated: str, console_at: Console, browser: Any, tmp_path: Any
) -> None:
    """The estimated bucket is the one the page's script marks, in both charts, and the
    estimate is what it draws there."""
    from selenium.webdriver.common.by import By

    from .conftest import shots

    minute_start = END - 10 * MINUTE
    async with engine.begin() as conn:
        await conn.exec_driver_sql(
            f"""
            INSERT INTO "{migrated}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind,
                priority, payload, status, terminal, attempt, updated_unix_ns)
            SELECT n, n, {minute_start}, 'default', '', 0, '\\x00'::bytea, 'succeeded',
                   true, 1, {minute_start} + (n - 1) * 50000000::bigint
            FROM generate_series(1, 1200) AS n
            """
        )
    expected = await charts_json(console_at, migrated)
    (day_index,) = [i for i, b in enumerate(expected["day"]["buckets"]) if b["examined"]]
    first_read(browser, charts_url(console_at, migrated))
    state = browser.execute_script(
        "var s = window.cronoqCharts; return {estimated: s.estimated,"
        " hour: s.plots.hour.data[1][50], error: s.error};"
    )
    assert state == {"estimated": {"hour": [50], "day": [day_index]}, "hour": 1200, "error": None}
    browser.set_window_size(1280, 1500)
    try:
        browser.find_element(By.CSS_SELECTOR, "#hour-numbers summary").click()  # its table
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(str(shots(tmp_path) / "charts-estimated.png"))
    finally:
        browser.set_window_size(1280, 900)


async def test_a_cluster_with_no_task_charts_nothing(migrated: str, console_at: Console) -> None:
    doc = await charts_json(console_at, migrated, time.time_ns())
    assert all(b["counts"] == {} and b["complete"] for b in doc["hour"]["buckets"])
    assert all(b["counts"] == {} for b in doc["day"]["buckets"])
    assert doc["backlog"] == {
        "live": 0,
        "at_least": False,
        "sample": cs.LIVE_SAMPLE,
        "estimate": None,
        "by_status": [],
        "oldest": None,
    }
    # By default the charts end at the current minute's start.
    now = await fetch(f"{console_at.base}/clusters/{migrated}/charts?format=json")
    end = now.json()["end"]
    assert end.endswith(":00.000000Z")
    html = (await fetch(f"{console_at.base}/clusters/{migrated}/charts")).text()
    assert "0 live tasks" in html
    assert "no live task" in html
    assert "the numbers: 0 finished" in html


async def test_a_schema_that_is_no_cluster_or_behind_this_build_is_not_charted(
    pg_url: Any, migrated: str, console_at: Console
) -> None:
    base = console_at.base
    for path, status in (
        (f"/clusters/{migrated}x/charts", 404),
        ("/clusters/public/charts", 404),
        (f"/clusters/{migrated}/charts?end=yesterday", 400),
    ):
        reply = await fetch(base + path)
        assert reply.status == status, (path, reply.text())
    await admin_execute(
        pg_url, f"UPDATE \"{migrated}\".cronoq_alembic_version SET version_num = '0003_x'"
    )
    reply = await fetch(f"{base}/clusters/{migrated}/charts?format=json")
    assert reply.status == 409, reply.text()
    assert "this build" in reply.json()["error"]


def _history() -> list[Mutation]:
    """Tasks finished over the day before ``END``: a few a minute in the last hour, a
    slower, varying stream before it (ids from 100), with a status mix."""
    batch: list[Mutation] = []
    statuses = [
        FAILED if n % 7 == 0 else CANCELLED if n % 13 == 0 else SUCCEEDED for n in range(400)
    ]
    id = 100
    for minute in range(60):
        for k in range(3 + (minute * 7) % 5):
            batch += [arrived(id), finished(id, statuses[id % 400], minute * 60 + 5 + k * 7)]
            id += 1
    for quarter in range(4, 96):
        for k in range(2 + quarter % 6):
            ago = quarter * 900 + 30 + k * 97
            status = SKIPPED if k == 5 else statuses[id % 400]
            batch += [arrived(id, ago + 60), finished(id, status, ago)]
            id += 1
    return batch


async def test_the_charts_draw_in_chromium_from_the_json_under_the_policy(
    store: PgStore, refreshing: Console, browser: Any, tmp_path: Any
) -> None:
    """The page's script fetches the JSON document and draws it with the vendored uPlot:
    a canvas of non-zero size per chart, lines in the badges' colours, the data the plots
    hold the document's, the backlog gaining a point each time the page reads it; and the
    browser logs nothing (a policy violation would be logged as an error)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE
    from .conftest import logs, shots

    schema = store.config.schema
    epoch = await store.acquire_leadership()
    batch = _history()
    for start in range(0, len(batch), 400):
        await store.commit(epoch, BASE, batch[start : start + 400], [])
    await store.commit(epoch, BASE, [arrived(n, 1800 - n * 60) for n in range(1, 6)], [])
    url = charts_url(refreshing, schema)
    expected = await charts_json(refreshing, schema)

    logs(browser)
    browser.set_window_size(1280, 1600)
    try:
        first_read(browser, url)
        state = browser.execute_script(
            "var s = window.cronoqCharts; return {doc: s.doc, error: s.error,"
            " hour: s.plots.hour.data, day: s.plots.day.data};"
        )
        assert state["error"] is None
        assert state["doc"]["hour"] == expected["hour"]
        assert state["doc"]["day"] == expected["day"]
        for window in ("hour", "day"):
            buckets = expected[window]["buckets"]
            assert state[window][0] == [b["start_unix_s"] for b in buckets]
            for i, status in enumerate(expected["statuses"]):
                drawn = state[window][i + 1]
                assert drawn == [b["per_minute"].get(status, 0) for b in buckets], status
        for chart in ("hour", "day", "backlog"):
            canvas = browser.find_element(By.CSS_SELECTOR, f"#chart-{chart} canvas")
            assert canvas.size["width"] > 300, chart
            assert canvas.size["height"] > 100, chart
        # The succeeded line is drawn, in the succeeded badge's colour.
        badge = browser.execute_script(
            "var e = document.createElement('span'); e.className = 'status status-succeeded';"
            " document.body.appendChild(e); var c = getComputedStyle(e).color; e.remove();"
            " return c;"
        )
        painted = browser.execute_script(
            "var c = document.querySelector('#chart-hour canvas');"
            " var d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            " var rgb = arguments[0].match(/[0-9]+/g).map(Number), n = 0;"
            " for (var i = 0; i < d.length; i += 4) {"
            "  if (d[i] === rgb[0] && d[i + 1] === rgb[1] && d[i + 2] === rgb[2]) { n++; } }"
            " return n;",
            badge,
        )
        assert painted > 100, (badge, painted)
        legend = browser.find_element(By.CSS_SELECTOR, "#chart-hour").text
        for status in ("succeeded", "failed", "cancelled"):
            assert status in legend

        # New live tasks: the backlog's line gains points as the page reads again.
        await store.commit(epoch, BASE, [arrived(n, 30) for n in range(6, 9)], [])
        WebDriverWait(browser, PATIENCE).until(
            lambda b: b.execute_script("return window.cronoqCharts.backlog[1].slice(-1)[0]") == 8,
            "the backlog chart never showed the new tasks",
        )
        await store.commit(epoch, BASE, [arrived(n, 20) for n in range(9, 12)], [])
        WebDriverWait(browser, PATIENCE).until(
            lambda b: b.execute_script("return window.cronoqCharts.backlog[1].slice(-1)[0]") == 11,
            "the backlog chart never showed the new tasks",
        )
        # The backlog's text follows the charts, its badges those the server renders.
        WebDriverWait(browser, PATIENCE).until(
            lambda b: b.find_element(By.ID, "backlog").text == "11 live tasks · queued 11",
            "the backlog's text never followed",
        )
        assert browser.find_elements(By.CSS_SELECTOR, "#backlog .status.status-queued")
        # The oldest task's arrival as the other pages give times: to the second, in UTC.
        assert re.fullmatch(
            r"oldest live task: 1, arrived \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, waiting .+",
            browser.find_element(By.ID, "oldest").text,
        ), browser.find_element(By.ID, "oldest").text
        points = browser.execute_script("return window.cronoqCharts.plots.backlog.data[1]")
        assert points[0] == 5
        assert points[-1] == 11
        browser.save_screenshot(str(shots(tmp_path) / "charts.png"))
        assert [e for e in logs(browser) if e["level"] in ("SEVERE", "WARNING")] == []
    finally:
        browser.set_window_size(1280, 900)


async def test_an_end_at_either_edge_of_a_time_is_charted_or_refused_never_failed(
    pg_url: Any, store: PgStore, console_at: Console
) -> None:
    """Ends as far as the stored times reach, either way, with tasks finished at the very
    first and last nanoseconds a BIGINT holds: each is a chart or a 400 that says why, never
    a failed statement. The charts end on a minute: an end whose day before is in range may
    not be once floored to its minute."""
    schema = store.config.schema
    for id, at in ((1, -(2**63)), (2, 2**63 - 1)):
        await admin_execute(
            pg_url,
            f'INSERT INTO "{schema}".cronoq_tasks (id, seq, pool, kind, priority,'
            " arrival_unix_ns, payload, status, terminal, attempt, updated_unix_ns, tenant)"
            f" VALUES ({id}, {id}, 'default', '', 0, 0, 'p', 'succeeded', true, 1, {at}, '')",
        )
    day_ns = reads.DAY.span_ns
    first_day = output.rfc3339(-(2**63) + day_ns + 1_000)  # floors to before the range
    for end, status in (
        ("2262-04-11T23:47:16.854775", 200),  # the last microsecond a BIGINT of ns holds
        ("2262-04-11T23:47:16.854776", 400),
        ("9999-12-31T23:59:59", 400),
        ("2262-04-11T23:47:16.854775+00:01", 200),
        ("1677-09-21T00:12:43.145225Z", 400),  # the first; the day before is out of range
        (first_day, 400),
        (output.rfc3339(-(2**63) + day_ns + 2 * MINUTE), 200),
        ("0001-01-01T00:00", 400),
        ("1970-01-01T00:00-00:01", 200),
        ("2026-13-01T00:00", 400),
        ("\0", 400),
        ("x" * 100_000, 400),
    ):
        query = urlencode({"format": "json", "end": end})
        reply = await fetch(f"{console_at.base}/clusters/{schema}/charts?{query}")
        assert reply.status == status, (end, reply.text())
        if status == 400:
            assert "end:" in reply.json()["error"], end
    latest = await charts_json(console_at, schema, 2**63 - 1)
    assert latest["hour"]["buckets"][-1]["counts"] == {}  # the end itself is after the window
    assert latest["end"] == output.rfc3339((2**63 - 1) // MINUTE * MINUTE)
    earliest = await charts_json(console_at, schema, -(2**63) + day_ns + 2 * MINUTE)
    # The first nanosecond is before any whole minute's day: no bucket reaches it.
    assert earliest["day"]["start"] == output.rfc3339(
        reads.chart_end(-(2**63) + day_ns + 2 * MINUTE) - day_ns
    )
    assert all(b["counts"] == {} for b in earliest["day"]["buckets"])


def _finished_as(schema: str, id: int, status: str, at: int) -> str:
    return (
        f'INSERT INTO "{schema}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority,'
        f" payload, status, terminal, attempt, updated_unix_ns) VALUES ({id}, {id}, {at},"
        f" 'default', '', 0, '\\x00'::bytea, '{status}', true, 1, {at})"
    )


def _drawn(browser: Any) -> Any:
    return browser.execute_script(
        "var s = window.cronoqCharts; return {doc: s.doc, error: s.error, reads: s.reads,"
        " labels: s.plots.hour.series.slice(1).map(function (x) { return x.label; }),"
        " hour: s.plots.hour.data.slice(1).map(function (line) {"
        "   return line.map(function (v) { return typeof v === 'number' ? v : String(v); }); })};"
    )


def _expected_lines(doc: Any) -> list[list[float]]:
    return [[b["per_minute"].get(s, 0) for b in doc["hour"]["buckets"]] for s in doc["statuses"]]


async def test_statuses_a_newer_build_wrote_are_drawn_under_their_own_names_in_chromium(
    pg_url: Any, migrated: str, refreshing: Console, browser: Any
) -> None:
    """Status names the page's script meets only as keys of the document: names an object
    already has (``constructor``, ``__proto__``) count only where a bucket holds them, markup
    stays text, and a name that appears while the page is open gets a line of its own
    instead of shifting the others under the wrong names."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE

    for id, status, minutes in (
        (1, "constructor", 10),
        (2, "__proto__", 20),
        (3, "<b>bold</b>", 30),
        (6, "x\u202ey\u200bz", 35),
        (4, "succeeded", 40),
    ):
        await admin_execute(pg_url, _finished_as(migrated, id, status, END - minutes * MINUTE))
    first_read(browser, charts_url(refreshing, migrated))
    # As the server wrote it (a WebDriver copy of the browser's loses a "__proto__" key).
    expected = await charts_json(refreshing, migrated)
    state = _drawn(browser)
    assert state["error"] is None
    assert state["labels"] == [visible(s) for s in expected["statuses"]]
    assert {"constructor", "__proto__", "<b>bold</b>"} <= set(state["labels"])
    assert state["hour"] == _expected_lines(expected)
    legend = browser.find_element(By.CSS_SELECTOR, "#chart-hour").text
    assert "<b>bold</b>" in legend
    # As the page's table and every other page write it: the bidi override and the
    # zero-width space as escapes, not reordering the legend.
    assert "x\\u202ey\\u200bz" in legend
    assert "\u202e" not in legend
    assert browser.find_elements(By.CSS_SELECTOR, "#charts b") == []

    # A name sorted between the others appears while the page is open.
    await admin_execute(pg_url, _finished_as(migrated, 5, "a_newer", END - 5 * MINUTE))
    WebDriverWait(browser, PATIENCE).until(
        lambda b: "a_newer" in (_drawn(b)["doc"]["statuses"]),
        "the page never read the new status",
    )
    expected = await charts_json(refreshing, migrated)
    state = _drawn(browser)
    assert state["error"] is None
    assert state["labels"] == [visible(s) for s in expected["statuses"]]
    assert state["hour"] == _expected_lines(expected)


async def test_a_slow_read_is_never_overlapped_by_the_next_in_chromium(
    migrated: str, refreshing: Console, browser: Any
) -> None:
    """Reads slower than the page's refresh (1 s here): the page waits for each read to end
    before it starts the next, so one open tab never piles requests up on the server."""
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE

    first_read(browser, charts_url(refreshing, migrated))
    # Every later read takes 3 s longer than the server does.
    browser.execute_script(
        "var real = window.fetch, seen = window.reading = {open: 0, most: 0, started: 0};"
        " window.fetch = function () {"
        "   var args = arguments; seen.open += 1; seen.started += 1;"
        "   seen.most = Math.max(seen.most, seen.open);"
        "   return new Promise(function (done) { setTimeout(done, 3000); })"
        "     .then(function () { return real.apply(window, args); })"
        "     .finally(function () { seen.open -= 1; }); };"
    )
    reads_before = browser.execute_script("return window.cronoqCharts.reads")
    WebDriverWait(browser, PATIENCE + 10).until(
        lambda b: b.execute_script("return window.cronoqCharts.reads") >= reads_before + 2,
        "the slow reads never ended",
    )
    seen = browser.execute_script("return window.reading")
    assert seen["most"] == 1, seen
    assert browser.execute_script("return window.cronoqCharts.error") is None


async def test_the_backlog_a_tab_keeps_is_bounded_in_chromium(
    migrated: str, refreshing: Console, browser: Any
) -> None:
    """A tab left open keeps its latest 10,000 reads of the backlog, not every read since
    it opened: the oldest points go as new ones come."""
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE

    first_read(browser, charts_url(refreshing, migrated))
    # As if the tab had been open for 15,000 reads.
    reads_before = browser.execute_script(
        "var s = window.cronoqCharts, t0 = s.backlog[0][0] - 15000;"
        " s.backlog = [[], [], []];"
        " for (var i = 0; i < 15000; i++) { s.backlog[0].push(t0 + i); s.backlog[1].push(i);"
        "  s.backlog[2].push(null); }"
        " return s.reads;"
    )
    WebDriverWait(browser, PATIENCE).until(
        lambda b: b.execute_script("return window.cronoqCharts.reads") > reads_before,
        "the charts never read again",
    )
    kept = browser.execute_script(
        "var s = window.cronoqCharts; return {lengths: s.backlog.map(function (l) {"
        " return l.length; }), first: s.backlog[1][0], error: s.error};"
    )
    assert kept["error"] is None
    assert kept["lengths"] == [10_000] * 3
    assert 5_000 <= kept["first"] <= 5_010  # the oldest gone, whatever reads came meanwhile


async def test_a_refused_read_says_why_in_chromium(
    pg_url: Any, migrated: str, refreshing: Console, browser: Any
) -> None:
    """A read the server refuses after the page opened shows the reason its error document
    gives, controls and bidi characters as escapes, and the charts drawn before stay."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from ..waits import PATIENCE

    first_read(browser, charts_url(refreshing, migrated))
    await admin_execute(
        pg_url, f"UPDATE \"{migrated}\".cronoq_alembic_version SET version_num = '0003_x'"
    )

    def stamp(b: Any) -> str:
        return str(b.find_element(By.ID, "refreshed").text)

    WebDriverWait(browser, PATIENCE).until(
        lambda b: stamp(b).startswith("charts not read: HTTP 409: "), "no reason shown"
    )
    assert f"schema '{migrated}' is at revision 0003_x" in stamp(browser)
    assert browser.execute_script("return window.cronoqCharts.plots.hour.data.length") > 1
    # An error document holding what a terminal or a reader would act on.
    browser.execute_script(
        "window.fetch = function () { return Promise.resolve(new Response("
        " JSON.stringify({error: 'a\\u202eb\\u001b[2Jc\\nd\\\\e'}), {status: 500})); };"
    )
    WebDriverWait(browser, PATIENCE).until(
        lambda b: stamp(b).startswith("charts not read: HTTP 500: "), "no reason shown"
    )
    assert stamp(browser) == "charts not read: HTTP 500: a\\u202eb\\x1b[2Jc\\nd\\\\e"
    # A page that is not the console's document (a proxy's): the status alone.
    browser.execute_script(
        "window.fetch = function () { return Promise.resolve(new Response("
        " '<html>Bad gateway</html>', {status: 502})); };"
    )
    WebDriverWait(browser, PATIENCE).until(
        lambda b: stamp(b) == "charts not read: HTTP 502", "no status shown"
    )
