"""The prune benchmark's timing of one large batch (the full profile's ``large_batch``,
whose report reads as rows per second) times a batch that deletes: the store's statement
with every parameter it takes, the cluster's incarnation included.

Sent without ``:incarnation`` (NULL), the statement's deletion is planned as
``One-Time Filter: false``: nothing is read or deleted, the batch "takes" a fraction of a
millisecond, and a regression of the protection's plan could never show as a timeout.
"""

from __future__ import annotations

from sqlalchemy.engine import URL

from benchmarks.prune import _large_batch
from cronoq_store._queries import PRUNE_BATCH

from .pgharness import admin_execute


async def test_the_large_batch_benchmark_times_a_batch_that_deletes(
    pg_url: URL, schema: str
) -> None:
    timed = await _large_batch(pg_url, finished=5_000, live=100, schema=schema)
    assert timed["deleted_per_batch"] == PRUNE_BATCH
    assert timed["seconds_per_batch"]["store"] is not None
    # Each run was rolled back: the table is whole.
    rows = await admin_execute(pg_url, f'SELECT count(*) AS n FROM "{schema}".cronoq_tasks')
    assert rows[0]["n"] == 5_100
