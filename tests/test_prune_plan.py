"""A prune batch deletes its victims by key, whatever the table's size: its deletion costs
what the batch holds, not what the table holds.

Deleting by ``id IN (victims)`` was planned as a hash join over a sequential scan of every
task for a large batch (64,000 victims, on 100,000 tasks as on a million), so each batch
of a prune read the whole table again (105 ms of such a batch's 420 on a million, the
same for every batch while the table shrank). The plan is read from the server: EXPLAIN of the
store's own statement, on a table of 100,000 old finished tasks and 2,000 live ones that
depend on some of them, with a batch the size a prune grows to.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
from sqlalchemy.engine import URL

from benchmarks.common import compile_for_asyncpg
from benchmarks.prune import _seed_statement
from cronoq_store import _statements as st
from cronoq_store._queries import PRUNE_BATCH_MAX

from .pgharness import asyncpg_dsn
from .support import open_store

FINISHED = 100_000
LIVE = 2_000


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, the init plans and subplans too."""
    yield plan
    for child in plan.get("Plans", ()):
        yield from nodes(child)


async def test_a_prune_batch_deletes_by_key_not_by_reading_the_whole_table(
    pg_url: URL, schema: str
) -> None:
    async with open_store(pg_url, schema):
        pass  # migrated
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        seed = compile_for_asyncpg(_seed_statement(FINISHED, LIVE, time.time_ns()), schema)
        await conn.execute(seed.sql, *seed.args({}))
        await conn.execute(f'VACUUM ANALYZE "{schema}".cronoq_tasks')
        incarnation = await conn.fetchval(
            f"SELECT '\"{schema}\".cronoq_leader'::regclass::oid::bigint"
        )
        batch = compile_for_asyncpg(st.prune_batch, schema)
        params = {
            "cutoff": time.time_ns() - 3600 * 10**9,
            "batch": PRUNE_BATCH_MAX,
            "incarnation": incarnation,
        }
        explaining = conn.transaction()
        await explaining.start()
        try:  # EXPLAIN ANALYZE deletes the batch: rolled back, the table stays whole
            explained = await conn.fetchval(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + batch.sql, *batch.args(params)
            )
        finally:
            await explaining.rollback()
        left = await conn.fetchval(f'SELECT count(*) FROM "{schema}".cronoq_tasks')
    finally:
        await conn.close()
    plan = json.loads(explained)[0]["Plan"]
    # The deleted rows are found through the primary key, one lookup per victim. (Which
    # victims, the oldest finished tasks, is the planner's to find: by the index on
    # (updated_unix_ns, id) or, when most of the table is prunable, a scan of it.)
    targets = [
        n
        for n in nodes(plan)
        if n.get("Alias") == "cronoq_tasks" and n["Node Type"] != "ModifyTable"
    ]
    assert [(n["Node Type"], n.get("Index Name")) for n in targets] == [
        ("Index Scan", "pk_cronoq_tasks")
    ]
    assert targets[0]["Actual Rows"] == PRUNE_BATCH_MAX
    deletion = [n for n in nodes(plan) if n.get("Operation") == "Delete"]
    assert [n["Actual Rows"] for n in deletion] == [PRUNE_BATCH_MAX]
    assert left == FINISHED + LIVE, "the explained batch was not rolled back"
