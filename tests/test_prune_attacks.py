"""Prune against rows a hand, a bug or an old version may have left: odd keys, NULL keys,
dependencies that are not an array, ids at BIGINT's bounds, a dependency named twice. The
dry run (``cronoq-store prune --dry-run``) counts exactly what a real prune then deletes,
the tasks a live task depends on (by id or by key) all stay, and the leader row's
``max_id`` ends at the largest id deleted (never lower, an empty prune included), so the
next term never mints an id a pruned task had.
"""

from __future__ import annotations

import asyncio
import json
import time

from sqlalchemy.engine import URL

from cronoq_store._store import PgStore

from .pgharness import admin_execute
from .support import full, open_store, run

I64_MAX = 2**63 - 1
I64_MIN = -(2**63)
ODD_KEY = "a b\"'\\ü%_\t{}[],:"


async def _insert(pg_url: URL, schema: str, rows: list[tuple[int, str | None, bool, str]]) -> None:
    """Tasks ``(id, key, finished, deps JSON)``: the finished ones two days old."""
    now = time.time_ns()
    old = now - 2 * 86400 * 10**9
    for id, key, finished, deps in rows:
        await admin_execute(
            pg_url,
            f'INSERT INTO "{schema}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, '
            "priority, key, payload, status, terminal, attempt, updated_unix_ns, deps) "
            "VALUES ($1, 1, $2, 'p', '', 0, $3, '\\x00'::bytea, $4, $5, 0, $6, $7::jsonb)",
            id,
            old,
            key,
            "succeeded" if finished else "queued",
            finished,
            old if finished else now,
            deps,
        )


async def _ids(pg_url: URL, schema: str) -> set[int]:
    rows = await admin_execute(pg_url, f'SELECT id FROM "{schema}".cronoq_tasks')
    return {r["id"] for r in rows}


async def _max_id(pg_url: URL, schema: str) -> int:
    rows = await admin_execute(pg_url, f'SELECT max_id FROM "{schema}".cronoq_leader')
    value: int = rows[0]["max_id"]
    return value


SEED: list[tuple[int, str | None, bool, str]] = [
    # Finished, two days old.
    (1, None, True, "[]"),  # a live task depends on it by id
    (2, ODD_KEY, True, "[]"),  # by its odd key
    (3, None, True, "[]"),  # nobody: pruned
    (4, "k4", True, "[]"),  # named only by deps that are not an array: pruned
    (5, "dup", True, "[]"),  # two finished tasks of one key: both protected by it
    (6, "dup", True, "[]"),
    (7, None, True, "[]"),  # named only by a finished task: pruned
    (8, None, True, '[{"id": 7}]'),  # finished: protects nothing, pruned
    (11, None, True, "[]"),  # by id, with a null key beside it
    (I64_MAX, None, True, "[]"),  # by id twice, at BIGINT's top
    (I64_MIN, None, True, "[]"),  # nobody: pruned
    # Live.
    (100, None, False, '[{"id": 1}]'),
    (101, None, False, json.dumps([{"key": ODD_KEY}])),
    (102, None, False, '{"id": 4, "key": "k4"}'),
    (103, None, False, f'[{{"id": {I64_MAX}}}, {{"id": {I64_MAX}}}]'),
    (104, None, False, '[{"key": "dup"}, {"key": "dup"}]'),
    (105, None, False, '[{"id": 11, "key": null}]'),
]
PRUNED = {3, 4, 7, 8, I64_MIN}


async def test_the_dry_run_counts_what_prune_deletes_and_protects_every_dependency(
    pg_url: URL, store: PgStore
) -> None:
    schema = store.config.schema
    await _insert(pg_url, schema, SEED)
    command = ("--url", full(pg_url), "--schema", schema, "prune", "--older-than", "1d", "--json")

    dry = await run(*command, "--dry-run")
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.stdout)
    assert (planned["prunable"], planned["protected"]) == (len(PRUNED), 6)

    real = await run(*command)
    assert real.exit_code == 0, real.output
    assert json.loads(real.stdout)["deleted"] == len(PRUNED)
    assert await _ids(pg_url, schema) == {id for id, *_ in SEED} - PRUNED
    assert await _max_id(pg_url, schema) == 8, "max_id is the largest id deleted"


async def test_prune_records_the_largest_id_deleted_and_never_lowers_it(
    pg_url: URL, store: PgStore
) -> None:
    schema = store.config.schema
    await _insert(pg_url, schema, SEED)
    assert await store.prune(86400) == len(PRUNED)
    assert await _max_id(pg_url, schema) == 8

    # A prune with nothing to delete leaves it; so does one whose ids are all lower.
    assert await store.prune(86400) == 0
    assert await _max_id(pg_url, schema) == 8
    await admin_execute(pg_url, f'UPDATE "{schema}".cronoq_leader SET max_id = 1000')
    await _insert(pg_url, schema, [(9, None, True, "[]")])
    assert await store.prune(86400) == 1
    assert await _max_id(pg_url, schema) == 1000


async def test_two_prunes_at_once_delete_every_victim_once_and_nothing_protected(
    pg_url: URL, migrated: str
) -> None:
    """Two store instances prune one cluster at the same time, over several batches each:
    every unprotected old task is gone, every protected one stays, and the totals they
    report add up to what was deleted (no batch counted twice, none stopping the other's
    loop early with work left)."""
    schema = migrated
    victims = 5000
    await _insert(pg_url, schema, SEED)
    now = time.time_ns()
    await admin_execute(
        pg_url,
        f'INSERT INTO "{schema}".cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, '
        "priority, payload, status, terminal, attempt, updated_unix_ns) "
        f"SELECT 1000 + n, n, {now}, 'p', '', 0, '\\x00'::bytea, 'succeeded', true, 0, "
        f"{now} - 2 * 86400 * 1000000000::bigint - n FROM generate_series(1, {victims}) AS n",
    )
    async with open_store(pg_url, schema) as one, open_store(pg_url, schema) as two:
        totals = await asyncio.gather(one.prune(86400), two.prune(86400))
    assert sum(totals) == victims + len(PRUNED)
    assert await _ids(pg_url, schema) == {id for id, *_ in SEED} - PRUNED
    assert await _max_id(pg_url, schema) == 1000 + victims
