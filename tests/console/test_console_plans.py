"""Every statement the console runs, EXPLAINed on a seeded table: each reads the tasks
through an index (never a sequential scan of ``cronoq_tasks``), with the planner's custom
plans and with the generic plan a prepared statement settles on after five runs."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import ClauseElement

from benchmarks import console as console_benchmark
from benchmarks.console import plan_nodes
from cronoq_store import _listing_statements as cs
from cronoq_store._codec import QUARANTINE_PREFIX
from cronoq_store._domain import I64_MAX
from cronoq_store._statements import TERMS_KEPT

from .conftest import Console, fetch

TASKS = 60_000
#: One task in 50 is live.
LIVE_EVERY = 50
SCHEDULES = 2_000

FILTERS = {
    "pools": ["etl"],
    "statuses": ["failed"],
    "kinds": [],
    "tenants": ["acme"],
    "keys": [],
    "since": -(2**63),
    "until": I64_MAX,
}
ANY = {**FILTERS, "pools": [], "statuses": [], "tenants": []}
WINDOW = {**ANY, "since": 1_000 * 10**9, "until": 2_000 * 10**9}

NOBODY = {**ANY, "tenants": ["nobody"]}
#: A cursor halfway down the finished tasks (task n is updated at n seconds).
MIDDLE = {"before_updated": TASKS // 2 * 10**9, "before_id": TASKS // 2}
TOP = {"before_updated": I64_MAX, "before_id": I64_MAX}

CASES: dict[str, tuple[ClauseElement, dict[str, Any], str]] = {
    "live counts": (cs.live_counts, {"bound": cs.LIVE_SAMPLE}, "ix_cronoq_tasks_live"),
    "finished sample": (
        cs.finished_sample,
        {"sample": cs.SAMPLE, "prefix": QUARANTINE_PREFIX},
        "ix_cronoq_tasks_finished_updated",
    ),
    "first page, filtered": (
        cs.finished_first_page,
        {**FILTERS, "limit": 51, "scan": cs.SCAN},
        "ix_cronoq_tasks_finished_updated",
    ),
    "first page, any": (
        cs.finished_first_page,
        {**ANY, "limit": 51, "scan": cs.SCAN},
        "ix_cronoq_tasks_finished_updated",
    ),
    # A filter that matches no row: unbounded, the planner reads the whole table instead.
    "first page, matching nothing": (
        cs.finished_first_page,
        {**NOBODY, "limit": 51, "scan": cs.SCAN},
        "ix_cronoq_tasks_finished_updated",
    ),
    "next page, in a window": (
        cs.finished_next_page,
        {**WINDOW, "limit": 51, "scan": cs.SCAN, "before_updated": 1_500 * 10**9, "before_id": 1},
        "ix_cronoq_tasks_finished_updated",
    ),
    "next page, halfway down, matching nothing": (
        cs.finished_next_page,
        {**NOBODY, "limit": 51, "scan": cs.SCAN, **MIDDLE},
        "ix_cronoq_tasks_finished_updated",
    ),
    "scan boundary": (
        cs.scan_boundary,
        {**ANY, "scan": cs.SCAN, **TOP},
        "ix_cronoq_tasks_finished_updated",
    ),
    "bounded count": (
        cs.finished_count,
        {**FILTERS, "bound": cs.SAMPLE},
        "ix_cronoq_tasks_finished_updated",
    ),
    "live page, filtered": (
        cs.live_page,
        {**FILTERS, "statuses": ["queued"], "after": -1, "limit": 51, "scan": cs.SCAN},
        "ix_cronoq_tasks_live",
    ),
    "live page, matching nothing, halfway": (
        cs.live_page,
        {**NOBODY, "after": TASKS // 2, "limit": 51, "scan": cs.SCAN},
        "ix_cronoq_tasks_live",
    ),
    "live scan boundary": (
        cs.live_scan_boundary,
        {"after": -1, "scan": cs.SCAN},
        "ix_cronoq_tasks_live",
    ),
    "live count": (cs.live_count, {**FILTERS, "bound": cs.LIVE_SAMPLE}, "ix_cronoq_tasks_live"),
    "task spec": (cs.task_spec, {"id": 12345}, "pk_cronoq_tasks"),
    "schedules": (cs.schedules, {"limit": 101, "after": ""}, "pk_cronoq_tasks"),
    # The charts: one bounded range of the index per bucket (the day's 96 of 900 s, over
    # the seeded tasks' first 86,400 s), and the first live task.
    "finished per bucket": (
        cs.finished_per_bucket,
        {"buckets": 96, "width": 900 * 10**9, "start": 0, "cap": 300},
        "ix_cronoq_tasks_finished_updated",
    ),
    # Days that overlap no task, at either end of what a BIGINT of ns holds: the same
    # ranges, however few rows the planner expects in them.
    "finished per bucket, the last day a time holds": (
        cs.finished_per_bucket,
        {
            "buckets": 96,
            "width": 900 * 10**9,
            "start": I64_MAX // (60 * 10**9) * (60 * 10**9) - 86_400 * 10**9,
            "cap": 300,
        },
        "ix_cronoq_tasks_finished_updated",
    ),
    "finished per bucket, the first day a time holds": (
        cs.finished_per_bucket,
        {"buckets": 96, "width": 900 * 10**9, "start": -(2**63) + 60 * 10**9, "cap": 300},
        "ix_cronoq_tasks_finished_updated",
    ),
    "oldest live": (cs.oldest_live, {}, "ix_cronoq_tasks_live"),
    # The history at its bound: the newest terms by its index, never a sort of all of them.
    "leadership history": (
        cs.recent_terms,
        {"limit": 11},
        "ix_cronoq_leader_history_began_at",
    ),
}
#: Statements that read no task: the planner's estimate of the live tasks, from pg_class.
CATALOG_ONLY = {"live_estimate"}


def test_every_console_statement_has_a_case() -> None:
    """A statement added to the console without a case here fails, not passes unchecked."""
    statements = {name for name in cs.__all__ if not name.isupper()}
    covered = {
        name for name, value in vars(cs).items() if any(value is c[0] for c in CASES.values())
    }
    assert statements - CATALOG_ONLY == covered


async def explain(
    conn: AsyncConnection,
    stmt: ClauseElement,
    params: dict[str, Any],
    schema: str,
    *,
    analyze: bool = False,
) -> dict[str, Any]:
    """The benchmark's EXPLAIN, on this connection's own driver session (its settings)."""
    raw = (await conn.get_raw_connection()).driver_connection
    assert raw is not None
    return await console_benchmark.explain(raw, stmt, params, schema, analyze=analyze)


@pytest.fixture
async def seeded(engine: AsyncEngine, migrated: str) -> str:
    s = f'"{migrated}"'
    async with engine.begin() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        assert raw is not None
        await raw.execute(
            f"""
            INSERT INTO {s}.cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority, key,
                payload, status, terminal, attempt, updated_unix_ns, tenant, message)
            SELECT n, n, n * 1000000000::bigint,
                   (ARRAY['etl', 'web', 'billing'])[n % 3 + 1], 'k' || (n % 7), 0,
                   CASE WHEN n % 4 = 0 THEN 'key-' || n END, '\\x00'::bytea,
                   CASE WHEN n % {LIVE_EVERY} = 0 THEN 'queued'
                        WHEN n % 5 = 0 THEN 'failed' ELSE 'succeeded' END,
                   n % {LIVE_EVERY} <> 0, 1, n * 1000000000::bigint,
                   CASE WHEN n % 2 = 0 THEN 'acme' END, 'm'
            FROM generate_series(1, {TASKS}) AS n
            """
        )
        await raw.execute(
            f"""
            INSERT INTO {s}.cronoq_recurring (name, spec, template_payload, next_unix_ns,
                last_task_id)
            SELECT 'r' || n, '{{"schedule": {{"type": "interval", "every_ns": 1000000000}}}}',
                   '\\x00'::bytea, n, n * 17
            FROM generate_series(1, {SCHEDULES}) AS n
            """
        )
        await raw.execute(
            f"""
            INSERT INTO {s}.cronoq_leader_history (epoch, began_at, pid)
            SELECT n, now() - make_interval(mins => {TERMS_KEPT} - n), n
            FROM generate_series(1, {TERMS_KEPT}) AS n
            """
        )
        await raw.execute(f"ANALYZE {s}.cronoq_tasks")
        await raw.execute(f"ANALYZE {s}.cronoq_recurring")
        await raw.execute(f"ANALYZE {s}.cronoq_leader_history")
    return migrated


async def test_a_page_deep_in_the_keyset_order_starts_at_its_cursor(
    engine: AsyncEngine, seeded: str
) -> None:
    """A page halfway down reads the index from its cursor, not from the newest entry down
    to it: a handful of buffers, not half the index (a row comparison alone does not start a
    backward scan; on 10M rows that walk took 225 ms)."""
    params = {**ANY, "limit": 51, "scan": cs.SCAN, **MIDDLE}
    async with engine.connect() as conn:
        plan = await explain(conn, cs.finished_next_page, params, seeded, analyze=True)
        await conn.rollback()
    assert plan["Actual Rows"] == 51
    blocks = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
    # The index alone has (TASKS / 2) / ~400 = 75 leaf pages above the cursor.
    assert blocks < 20, blocks


@pytest.mark.parametrize("mode", ["auto", "force_generic_plan"])
async def test_every_console_statement_reads_the_tasks_through_an_index(
    engine: AsyncEngine, seeded: str, mode: str
) -> None:
    async with engine.connect() as conn:
        await conn.exec_driver_sql(f"SET plan_cache_mode = {mode}")
        for name, (stmt, params, index) in CASES.items():
            plan = await explain(conn, stmt, params, seeded)
            seq = [n for n in plan_nodes(plan) if n["Node Type"] == "Seq Scan"]
            assert [n for n in seq if n["Relation Name"] == "cronoq_tasks"] == [], (name, mode)
            used = {n.get("Index Name") for n in plan_nodes(plan)}
            assert index in used, (name, mode, used)
        await conn.rollback()


async def test_a_filter_that_matches_little_is_searched_a_bound_at_a_time(
    engine: AsyncEngine, seeded: str, console_at: Console
) -> None:
    """More finished tasks than a page examines: a filter that matches none of them shows
    an empty page that says how far it looked and offers to look further from there, and
    looking further finds what lies beyond, and then the end."""
    async with engine.begin() as conn:
        # The one task of tenant "rare" is among the oldest, beyond the first SCAN.
        await conn.exec_driver_sql(
            f"UPDATE \"{seeded}\".cronoq_tasks SET tenant = 'rare' WHERE id = 7"
        )
    cluster = f"{console_at.base}/clusters/{seeded}"
    for tenant, beyond in (("nobody", []), ("rare", [7])):
        first = (await fetch(f"{cluster}?tenant={tenant}&format=json")).json()["finished"]
        assert (first["tasks"], first["scan_stopped"]) == ([], True), tenant
        assert first["next_url"] is not None
        html = (await fetch(f"{cluster}?tenant={tenant}")).text()
        assert f"looked at {cs.SCAN:,} finished tasks from here and found none" in html
        assert "look further" in html
        further = (await fetch(cluster + first["next_url"])).json()["finished"]
        assert [t["id"] for t in further["tasks"]] == beyond, tenant
        assert (further["scan_stopped"], further["next"]) == (False, None)


async def test_a_live_page_deep_in_the_id_order_starts_at_its_cursor(
    engine: AsyncEngine, seeded: str
) -> None:
    """A live page after a cursor halfway down reads the live index from there: its id is
    a scalar bound of the index scan, so the page's cost does not grow with its depth."""
    params = {**ANY, "after": TASKS // 2, "limit": 51, "scan": cs.SCAN}
    async with engine.connect() as conn:
        plan = await explain(conn, cs.live_page, params, seeded, analyze=True)
        await conn.rollback()
    assert plan["Actual Rows"] == 51
    scans = [n for n in plan_nodes(plan) if n.get("Index Name") == "ix_cronoq_tasks_live"]
    assert [n["Actual Rows"] for n in scans] == [51]


async def test_the_live_page_says_at_least_past_its_bound_and_looks_further(
    engine: AsyncEngine, migrated: str, console_at: Console
) -> None:
    """More live tasks than a page examines or the count looks at: the page says "at least"
    and how far it looked, and "look further" finds the match beyond."""
    many = cs.SCAN + 10
    async with engine.begin() as conn:
        await conn.exec_driver_sql(
            f"""
            INSERT INTO "{migrated}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind,
                priority, payload, status, terminal, attempt, updated_unix_ns)
            SELECT n, n, n, CASE WHEN n IN (5, {many}) THEN 'rare' ELSE 'bulk' END, '', 0,
                   '\\x00'::bytea, 'queued', false, 0, n
            FROM generate_series(1, {many}) AS n
            """
        )
    live = f"{console_at.base}/clusters/{migrated}/live"
    first = (await fetch(f"{live}?pool=rare&format=json")).json()["live"]
    assert [t["id"] for t in first["tasks"]] == [5]
    assert (first["scan_stopped"], first["matching"], first["matching_at_least"]) == (True, 1, True)
    html = (await fetch(f"{live}?pool=rare")).text()
    assert f"at least 1 matching (counted among the oldest {cs.LIVE_SAMPLE:,} live tasks)" in html
    assert f"looked at {cs.SCAN:,} live tasks from here and found only these" in html
    assert "look further" in html
    further = (await fetch(live + first["next_url"])).json()["live"]
    assert [t["id"] for t in further["tasks"]] == [many]
    assert (further["scan_stopped"], further["next"]) == (False, None)
    every = (await fetch(f"{live}?format=json")).json()["live"]
    assert len(every["tasks"]) == 50
    assert (every["matching"], every["matching_at_least"]) == (cs.LIVE_SAMPLE, True)


async def test_the_charts_read_at_most_their_bound_of_each_bucket(
    engine: AsyncEngine, seeded: str
) -> None:
    """Each bucket's index range is read backwards and stopped at its cap: 60 quarter hours
    of 900 seeded tasks each (18 of them live, which the partial index leaves out) yield
    their newest 300 apiece, and the index scan reads no more in any of its 60 loops."""
    params = {"buckets": 60, "width": 900 * 10**9, "start": 0, "cap": 300}
    async with engine.connect() as conn:
        plan = await explain(conn, cs.finished_per_bucket, params, seeded, analyze=True)
        await conn.rollback()
    (scan,) = [
        n for n in plan_nodes(plan) if n.get("Index Name") == "ix_cronoq_tasks_finished_updated"
    ]
    # Rows per loop, averaged: 300 each, since none may exceed its LIMIT of 300.
    assert (scan["Actual Loops"], scan["Actual Rows"]) == (60, 300)
    # Newest first in each bucket, one loop a bucket of generate_series.
    assert scan["Scan Direction"] == "Backward"
    loops = [n for n in plan_nodes(plan) if n["Node Type"] == "Nested Loop"]
    assert len(loops) == 1
    assert [n["Node Type"] for n in loops[0]["Plans"]] == ["Function Scan", "Limit"]
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                cs.finished_per_bucket,
                params,
                execution_options={"schema_translate_map": {None: seeded}},
            )
        ).all()
        await conn.rollback()
    per_bucket: dict[int, int] = {}
    for row in rows:
        per_bucket[row.bucket] = per_bucket.get(row.bucket, 0) + row.n
    assert per_bucket == dict.fromkeys(range(60), 300)
    # The newest 300 finished of the last bucket (tasks 53,100 to 53,999, updated at their
    # number of seconds): 53,694 to 53,999, less the six live ones among them.
    assert min(row.oldest for row in rows if row.bucket == 59) == 53_694 * 10**9
