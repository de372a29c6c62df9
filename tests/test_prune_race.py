"""Prune against commits in flight: a dependency added by a commit that has not finished yet
still protects its target.

The commit under test is held open after the leader row lock and before its insert
completes: an admin transaction inserts, uncommitted, a row with the id the commit is about
to insert, so the commit's ``ON CONFLICT (id)`` waits for that transaction. Prune runs
meanwhile; the test sees it wait (``pg_stat_activity``), lets the commit go, and checks
that the finished task the new one depends on was not deleted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Dependency, TaskSpec, TaskStatus, TimeBase, task_id
from cronoq_store._mutations import Mutation, StatusChanged, Submitted
from cronoq_store._store import PgStore
from cronoq_store._writer import COPY_MIN_ROWS

from .pgharness import admin_execute, asyncpg_dsn
from .waits import bounded, until

BASE = TimeBase.now()
_seq = itertools.count(1)


def submitted(
    epoch: int, n: int, key: str | None = None, deps: Sequence[Dependency] = ()
) -> Submitted:
    spec = TaskSpec(b"p%d" % n, key=key, deps=deps)
    return Submitted(task_id(epoch, n), next(_seq), BASE.engine_ns, spec)


@asynccontextmanager
async def open_store(url: URL, schema: str, name: str) -> AsyncIterator[PgStore]:
    store = await PgStore.connect(url, PgStoreConfig(schema=schema, application_name=name))
    try:
        yield store
    finally:
        await store.close()


async def waiting_on_lock(url: URL, application_name: str) -> bool:
    rows = await admin_execute(
        url,
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = $1 AND wait_event_type = 'Lock'",
        application_name,
    )
    return int(rows[0][0]) > 0


async def settles(url: URL, name: str, task: asyncio.Task[object]) -> None:
    """Until the sessions of ``name`` wait on a lock, or ``task`` is done (it did not wait)."""

    async def settled() -> bool:
        return task.done() or await waiting_on_lock(url, name)

    await until(settled, f"{name} waiting on a lock or finished", every=0.01)


@pytest.mark.parametrize(
    ("path", "by_key"),
    [
        ("one statement", False),
        ("one statement", True),
        ("transaction", False),
        ("copy", True),
    ],
)
async def test_prune_waits_for_a_commit_that_adds_a_dependency(
    pg_url: URL, schema: str, path: str, by_key: bool
) -> None:
    committer, pruner = f"c-{schema}", f"p-{schema}"
    async with (
        open_store(pg_url, schema, committer) as store,
        open_store(pg_url, schema, pruner) as other,
    ):
        epoch = await store.acquire_leadership()
        done = task_id(epoch, 1)
        live = task_id(epoch, 2)
        await store.commit(
            epoch,
            BASE,
            [
                submitted(epoch, 1, key="target"),
                StatusChanged(done, TaskStatus.SUCCEEDED, 1, BASE.engine_ns),
                submitted(epoch, 2),
            ],
            [],
        )
        dependent = task_id(epoch, 3)
        target = Dependency("target" if by_key else done)
        batch: list[Mutation] = [submitted(epoch, 3, deps=[target])]
        if path == "transaction":
            batch.append(StatusChanged(live, TaskStatus.RUNNING, 1, BASE.engine_ns))
        elif path == "copy":
            batch += [submitted(epoch, 10 + n) for n in range(COPY_MIN_ROWS)]

        # An uncommitted row with the dependent's id: the commit's insert waits on it.
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        tx = blocker.transaction()
        await tx.start()
        try:
            await blocker.execute(
                "CREATE TEMPORARY TABLE copy ON COMMIT DROP AS "
                f'SELECT * FROM "{schema}".cronoq_tasks WHERE id = {done}; '
                f"UPDATE copy SET id = {dependent}, key = NULL; "
                f'INSERT INTO "{schema}".cronoq_tasks SELECT * FROM copy'
            )
            commit = asyncio.create_task(store.commit(epoch, BASE, batch, []))
            await settles(pg_url, committer, commit)
            assert not commit.done(), "the commit was not held open"
            prune = asyncio.create_task(other.prune(0))
            await settles(pg_url, pruner, prune)
            waited = not prune.done()
            await tx.rollback()
            await bounded(commit, "the commit once the blocker rolled back")
            pruned = await bounded(prune, "the prune once the commit is done")
        finally:
            await blocker.close()

    rows = await admin_execute(pg_url, f'SELECT id, terminal FROM "{schema}".cronoq_tasks')
    stored = {r["id"]: r["terminal"] for r in rows}
    assert stored.get(dependent) is False, "the dependent task was not stored"
    assert done in stored, "prune deleted a task that a committed live task depends on"
    assert waited, "prune did not wait for the commit in flight"
    assert pruned == 0
