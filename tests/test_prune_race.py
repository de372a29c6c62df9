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

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._domain import Dependency, Mutation, StatusChanged, TaskStatus, task_id

from .pgharness import admin_execute, asyncpg_dsn
from .support import PROCESS_BASE, open_store, settles, submitted_in
from .waits import bounded


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
        open_store(pg_url, schema, application_name=committer) as store,
        open_store(pg_url, schema, application_name=pruner) as other,
    ):
        epoch = await store.acquire_leadership()
        done = task_id(epoch, 1)
        live = task_id(epoch, 2)
        await store.commit(
            epoch,
            PROCESS_BASE,
            [
                submitted_in(epoch, 1, key="target"),
                StatusChanged(done, TaskStatus.SUCCEEDED, 1, PROCESS_BASE.engine_ns),
                submitted_in(epoch, 2),
            ],
            [],
        )
        dependent = task_id(epoch, 3)
        target = Dependency("target" if by_key else done)
        batch: list[Mutation] = [submitted_in(epoch, 3, deps=[target])]
        if path == "transaction":
            batch.append(StatusChanged(live, TaskStatus.RUNNING, 1, PROCESS_BASE.engine_ns))
        elif path == "copy":
            batch += [submitted_in(epoch, 10 + n) for n in range(COPY_MIN_ROWS)]

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
            commit = asyncio.create_task(store.commit(epoch, PROCESS_BASE, batch, []))
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
