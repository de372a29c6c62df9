"""The overview of a database holding many clusters: a page of them at a time by schema
name, searchable by any text, its discovery one catalog query and its reads the page's
clusters alone; and a slow database never gets a second refresh from a tab, nor more
overview reads than the console keeps connections for.

The clusters are real (migrated to head), 120 of them under a prefix of this module's own:
three pages, so a search lands on a later one. Whether a read touched a cluster is told by
a lock a test session holds on that cluster's tasks table: a read of it would wait there.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote, urlencode

import asyncpg
import pytest
from selenium import webdriver
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._console.app import OVERVIEWS_AT_ONCE
from cronoq_store._console.reads import CLUSTERS_SHOWN, NAME_BYTES
from cronoq_store._migrations import upgrade
from cronoq_store._schema import tasks
from cronoq_store._urls import async_url

from ..pgharness import ServerUnderTest, admin_execute, asyncpg_dsn
from ..waits import PATIENCE, until
from .conftest import Console, Reply, fetch, get

#: Clusters the module migrates: two full pages and part of a third.
CLUSTERS = 2 * CLUSTERS_SHOWN + 20


@pytest.fixture(scope="module")
def many(pg_server: ServerUnderTest) -> Iterator[list[str]]:
    """:data:`CLUSTERS` cluster schemas migrated to head, named under a prefix no other
    module uses, in the order the overview lists them; dropped afterwards."""
    prefix = f"m_{uuid.uuid4().hex[:8]}_"
    names = [f"{prefix}c{i:03d}" for i in range(CLUSTERS)]

    async def migrate() -> None:
        engine = create_async_engine(async_url(pg_server.url))
        try:
            for name in names:
                await upgrade(engine, name)
        finally:
            await engine.dispose()

    async def drop() -> None:
        for name in names:
            await admin_execute(pg_server.url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')

    try:
        asyncio.run(migrate())
        yield names
    finally:
        asyncio.run(drop())


def prefix_of(names: list[str]) -> str:
    return names[0].removesuffix("c000")


async def overview(console: Console, **query: str) -> Any:
    reply = await fetch(console.base + "/?" + urlencode({**query, "format": "json"}))
    assert reply.status == 200, reply.text()
    return reply.json()


def shown(doc: Any) -> list[str]:
    return [c["schema"] for c in doc["clusters"]]


@asynccontextmanager
async def locked_tasks(pg_url: URL, schema: str) -> AsyncIterator[None]:
    """``schema``'s tasks table held ``ACCESS EXCLUSIVE`` by a session of the test's: any
    statement reading it waits until the block ends."""
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        async with conn.transaction():
            await conn.execute(f'LOCK TABLE "{schema}".{tasks.name} IN ACCESS EXCLUSIVE MODE')
            yield
    finally:
        await conn.close()


async def waiting_on(pg_url: URL, schema: str) -> int:
    """Sessions waiting for a lock on ``schema``'s tasks table."""
    rows = await admin_execute(
        pg_url,
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass($1)",
        f'"{schema}".{tasks.name}',
    )
    return int(rows[0][0])


async def test_the_overview_shows_a_page_at_a_time(many: list[str], console_at: Console) -> None:
    prefix = prefix_of(many)
    first = await overview(console_at, q=prefix)
    assert shown(first) == many[:CLUSTERS_SHOWN]
    assert all(c["at_head"] for c in first["clusters"])
    page = first["page"]
    assert (page["first"], page["last"], page["matching"]) == (1, CLUSTERS_SHOWN, CLUSTERS)
    assert page["clusters"] >= CLUSTERS
    assert first["previous_url"] is None
    assert first["next_url"] == "?" + urlencode({"q": prefix, "after": many[CLUSTERS_SHOWN - 1]})

    second = await overview(console_at, q=prefix, after=many[CLUSTERS_SHOWN - 1])
    assert shown(second) == many[CLUSTERS_SHOWN : 2 * CLUSTERS_SHOWN]
    last = await overview(console_at, q=prefix, after=many[2 * CLUSTERS_SHOWN - 1])
    assert shown(last) == many[2 * CLUSTERS_SHOWN :]
    assert (last["page"]["first"], last["page"]["last"]) == (2 * CLUSTERS_SHOWN + 1, CLUSTERS)
    assert last["next_url"] is None
    # Back from the last page: the second again, the same names in the same order.
    back = await overview(console_at, q=prefix, before=many[2 * CLUSTERS_SHOWN])
    assert shown(back) == shown(second)
    assert back["page"]["first"] == CLUSTERS_SHOWN + 1
    assert back["previous_url"] == "?" + urlencode({"q": prefix, "before": many[CLUSTERS_SHOWN]})

    # A cursor past the end (the last names dropped meanwhile): no cluster, a way back.
    past = await overview(console_at, q=prefix, after=many[-1] + "z")
    assert (past["clusters"], past["page"]["first"], past["page"]["matching"]) == ([], 0, CLUSTERS)
    assert (past["next_url"], past["previous_url"]) == (None, None)
    assert past["first_url"] == "?" + urlencode({"q": prefix})
    assert first["first_url"] is None

    # Unsearched, the page is as long, whatever else the database holds.
    assert len(shown(await overview(console_at))) == CLUSTERS_SHOWN

    html = (await fetch(console_at.base + "/?" + urlencode({"q": prefix}))).text()
    assert f"1-{CLUSTERS_SHOWN} of {CLUSTERS} matching, by schema name" in html
    assert 'id="next-page"' in html
    assert 'id="previous-page"' not in html


async def test_a_page_reads_its_own_clusters_only(
    pg_url: URL, many: list[str], console_at: Console
) -> None:
    """A cluster on the last page is held by a lock that any read of its tasks waits for:
    the first page answers all the same, its clusters read, without waiting for it."""
    async with locked_tasks(pg_url, many[-1]):
        doc = await overview(console_at, q=prefix_of(many))
        assert shown(doc) == many[:CLUSTERS_SHOWN]
        assert all("live" in c for c in doc["clusters"])
        assert await waiting_on(pg_url, many[-1]) == 0


async def test_a_search_finds_a_cluster_on_a_later_page(
    many: list[str], console_at: Console
) -> None:
    wanted = many[-3]
    doc = await overview(console_at, q=wanted)
    assert shown(doc) == [wanted]
    assert doc["clusters"][0]["at_head"]
    assert doc["clusters"][0]["health_exit_code"] == 0 or doc["clusters"][0]["health"]["reasons"]
    # Any case, and any part of the name.
    assert shown(await overview(console_at, q=wanted.upper())) == [wanted]
    tail = wanted.removeprefix(prefix_of(many))
    assert wanted in shown(await overview(console_at, q=tail))
    tens = await overview(console_at, q=prefix_of(many) + "c11")
    assert shown(tens) == [n for n in many if "c11" in n]
    html = (await fetch(console_at.base + "/?" + urlencode({"q": wanted}))).text()
    assert f'id="cluster-{wanted}"' in html
    assert "1-1 of 1 matching" in html


@pytest.mark.parametrize(
    "search",
    [
        "c0_1",  # `_` is any one character to LIKE: c001, c011, ... would match
        "c%1",
        "%",
        "/",  # the pattern's escape character
        "\\",
        "<script>alert(1)</script>",
        "\u202ec001",
        "é",
        "'; DROP SCHEMA public; --",
    ],
)
async def test_a_search_is_taken_as_text(many: list[str], console_at: Console, search: str) -> None:
    """Wildcards, quotes, markup and controls in a search are characters to find, and
    no cluster name here holds them."""
    doc = await overview(console_at, q=prefix_of(many) + search)
    assert doc["clusters"] == []
    assert doc["page"]["matching"] == 0
    assert doc["search_refused"] is None
    html = (await fetch(console_at.base + "/?" + urlencode({"q": search}))).text()
    assert "<script>alert(1)</script>" not in html


@pytest.mark.parametrize(
    ("search", "said"),
    [
        ("c\x00", "no schema name holds a NUL character"),
        ("c" * 10_000, f"a schema name is at most {NAME_BYTES} bytes long"),
        ("é" * 32, f"a schema name is at most {NAME_BYTES} bytes long"),
    ],
)
async def test_a_search_no_name_can_hold_is_answered_on_the_page(
    console_at: Console, search: str, said: str
) -> None:
    doc = await overview(console_at, q=search)
    assert doc["clusters"] == []
    assert doc["search_refused"].startswith(said)
    assert len(doc["search"]) <= NAME_BYTES + 1
    reply = await fetch(console_at.base + "/?q=" + quote(search))
    assert reply.status == 200
    assert 'id="search-refused"' in reply.text()
    assert said in reply.text()


@pytest.mark.parametrize(
    "query",
    [
        {"after": "c\x00"},
        {"before": "c" * (NAME_BYTES + 1)},
        {"after": "a", "before": "b"},
    ],
)
async def test_a_cursor_the_page_did_not_give_is_a_400(
    console_at: Console, query: dict[str, str]
) -> None:
    reply = await fetch(console_at.base + "/?" + urlencode(query))
    assert reply.status == 400
    assert 'id="error"' in reply.text()


def get_in_background(url: str) -> tuple[threading.Thread, list[Reply]]:
    """A request on a thread of its own, its reply in the list once it ends."""
    replies: list[Reply] = []
    thread = threading.Thread(target=lambda: replies.append(get(url)), daemon=True)
    thread.start()
    return thread, replies


async def test_a_slow_database_gets_one_refresh_per_tab_and_a_bounded_number_of_reads(
    pg_url: URL, many: list[str], refreshing: Console, browser: webdriver.Chrome
) -> None:
    """The first page's first cluster held by a lock: a tab refreshing every second has
    one read waiting for it, and starts no other while that one lasts; requests beyond
    :data:`OVERVIEWS_AT_ONCE` answer 503 at once instead of adding reads; once the lock
    goes, the waiting reads end and the tab refreshes."""
    page = refreshing.base + "/?" + urlencode({"q": prefix_of(many)})
    browser.get(page)
    await until(lambda: bool(browser.find_elements("id", f"cluster-{many[0]}")), "the first page")
    browser.execute_script(
        "var real = window.fetch, seen = window.reading = {started: 0, open: 0, most: 0,"
        " ended: 0};"
        " window.fetch = function () {"
        "   seen.started += 1; seen.open += 1; seen.most = Math.max(seen.most, seen.open);"
        "   return real.apply(window, arguments)"
        "     .finally(function () { seen.open -= 1; seen.ended += 1; }); };"
    )

    def reading() -> dict[str, int]:
        seen: dict[str, int] = browser.execute_script("return window.reading")
        return seen

    # A refresh through the counting fetch has ended: every one from here is counted.
    await until(lambda: reading()["ended"] >= 1, "a counted refresh")
    async with locked_tasks(pg_url, many[0]):

        async def tab_waiting() -> bool:
            return await waiting_on(pg_url, many[0]) >= 1

        await until(tab_waiting, "the tab's refresh waiting")
        waiting = reading()
        assert waiting["open"] == 1, waiting
        # Three of the tab's periods: a tab that did not wait would have started more.
        await asyncio.sleep(3)
        assert reading() == waiting
        assert await waiting_on(pg_url, many[0]) == 1
        threads = [get_in_background(page) for _ in range(OVERVIEWS_AT_ONCE - 1)]

        async def all_reading() -> bool:
            return await waiting_on(pg_url, many[0]) == OVERVIEWS_AT_ONCE

        await until(all_reading, f"{OVERVIEWS_AT_ONCE} overview reads waiting")
        began = time.monotonic()
        busy = await fetch(page)
        assert busy.status == 503, busy.text()
        assert time.monotonic() - began < PATIENCE / 2
        assert f"already reading {OVERVIEWS_AT_ONCE} overview pages" in busy.text()
        assert busy.headers["retry-after"] == "1"
        assert await waiting_on(pg_url, many[0]) == OVERVIEWS_AT_ONCE
    for thread, replies in threads:
        await asyncio.to_thread(thread.join, PATIENCE)
        assert [r.status for r in replies] == [200]
    # The waiting refresh ends, and the tab goes on refreshing.
    await asyncio.to_thread(
        WebDriverWait(browser, PATIENCE).until,
        lambda b: reading()["ended"] >= waiting["ended"] + 2,
    )
    assert reading()["most"] == 1, reading()
