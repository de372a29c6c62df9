"""Batches that can never commit: bounded by bytes and refused when too large, on a real
server.

The 1 GiB message limit of PostgreSQL is not allocated here: the committer's and the
store's byte bounds are parameters, lowered to a few hundred KiB.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from sqlalchemy.engine import URL

from cronoq_store.config import PgStoreConfig
from cronoq_store.domain import Mutation, Submitted, TaskId, TaskSpec, TimeBase, task_id
from cronoq_store.errors import BatchTooLargeError
from cronoq_store.group_commit import GroupCommitter
from cronoq_store.sizing import batch_size
from cronoq_store.store import PgStore

from .pgharness import admin_execute

BASE = TimeBase.now()
_seq = itertools.count(1)
POISON = b"poison"


def submitted(epoch: int, n: int, payload: bytes | None = None) -> Submitted:
    spec = TaskSpec(b"payload %d" % n if payload is None else payload)
    return Submitted(task_id(epoch, n), next(_seq), BASE.engine_ns, spec)


async def stored_ids(url: URL, schema: str) -> set[int]:
    rows = await admin_execute(url, f'SELECT id FROM "{schema}".cronoq_tasks')
    return {r["id"] for r in rows}


@asynccontextmanager
async def open_store(url: URL, schema: str, **config: Any) -> AsyncIterator[PgStore]:
    store = await PgStore.connect(url, PgStoreConfig(schema=schema, **config))
    try:
        yield store
    finally:
        await store.close()


class Recording:
    """The real store, with the size of every batch it was asked to commit recorded."""

    def __init__(self, store: PgStore) -> None:
        self.store = store
        self.sizes: list[int] = []

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        self.sizes.append(batch_size(batch, outputs))
        await self.store.commit(epoch, base, batch, outputs)


async def test_concurrent_large_submissions_are_batched_under_the_byte_bound(
    pg_url: URL, schema: str
) -> None:
    """17 submissions of 256 KiB each, all at once, under a 1 MiB bound: each batch stays
    under it (today they merge into one batch 17 times the size of each)."""
    bound = 2**20
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        recording = Recording(store)
        subs = [[submitted(epoch, n, bytes(256 * 1024))] for n in range(17)]
        async with GroupCommitter(recording, epoch, BASE, max_batch_bytes=bound) as committer:
            await asyncio.wait_for(asyncio.gather(*(committer.submit(s) for s in subs)), 60)
        assert await stored_ids(pg_url, schema) == {s[0].id for s in subs}
        assert max(recording.sizes) <= bound
        assert committer.stats().commits == len(recording.sizes) >= 5


async def test_a_batch_too_large_for_the_server_is_refused_before_it_is_sent(
    pg_url: URL, schema: str
) -> None:
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        store.max_commit_bytes = 2**20
        big = submitted(epoch, 1, bytes(2**20))
        with pytest.raises(BatchTooLargeError, match="over the 1048576 bytes") as refused:
            await store.commit(epoch, BASE, [big], [])
        assert not refused.value.is_transient
        # Outputs count too: a task's output of 1 MiB cannot ride on a 1 MiB commit.
        small = submitted(epoch, 2)
        with pytest.raises(BatchTooLargeError):
            await store.commit(epoch, BASE, [small], [(small.id, bytes(2**20))])
        assert await stored_ids(pg_url, schema) == set()


async def test_a_submission_too_large_to_commit_fails_at_once_and_alone(
    pg_url: URL, schema: str
) -> None:
    async with open_store(pg_url, schema) as store:
        epoch = await store.acquire_leadership()
        store.max_commit_bytes = 2**20
        subs = [[submitted(epoch, n)] for n in range(10)]
        subs[4] = [submitted(epoch, 4, bytes(2**20))]
        committer = GroupCommitter(store, epoch, BASE, max_batch_bytes=2**19)
        async with committer:
            outcomes = await asyncio.wait_for(
                asyncio.gather(*(committer.submit(s) for s in subs), return_exceptions=True), 30
            )
        assert isinstance(outcomes[4], BatchTooLargeError)
        assert [o for i, o in enumerate(outcomes) if i != 4] == [None] * 9
        stats = committer.stats()
        assert (stats.retries, stats.failed_submissions) == (0, 1)  # failed at its only try
        expected = {s[0].id for i, s in enumerate(subs) if i != 4}
        assert await stored_ids(pg_url, schema) == expected
