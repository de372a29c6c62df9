"""Operators cannot destroy a live cluster by accident: a downgrade refuses while an instance
holds the leader lock (``cronoq-store downgrade``, Alembic's own command, the offline
script), and to base once the cluster issued ids, unless forced; it holds the lock until its
COMMIT, so a standby waits behind it; a leader whose tables a forced downgrade (or a hand)
drops steps down with ``SchemaGoneError``, and nothing is acknowledged after the drop.

The commands run as real processes (``python -m cronoq_store._cli``, ``python -m alembic``);
the leaders are stores in this process, with real sessions on the server."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import time

import asyncpg
import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import (
    FencedError,
    GroupCommitter,
    PgStore,
    PgStoreConfig,
    SchemaGoneError,
)
from cronoq_store._cli import ExitCode
from cronoq_store._migrations import downgrade, head_revision, upgrade
from cronoq_store._statements import LOCK_NS_LEADER

from .pgharness import admin_execute, asyncpg_dsn
from .support import PROCESS_BASE, cronoq, python_run, submitted_in
from .waits import bounded, holds_for, until


def config(schema: str, name: str) -> PgStoreConfig:
    return PgStoreConfig(schema=schema, application_name=name, lock_poll=0.05)


async def alembic(*args: str, url: URL) -> subprocess.CompletedProcess[str]:
    return await python_run("-m", "alembic", *args, url=url)


async def task_rows(url: URL, schema: str) -> int:
    return int((await admin_execute(url, f'SELECT count(*) FROM "{schema}".cronoq_tasks'))[0][0])


async def tables(url: URL, schema: str) -> set[str]:
    rows = await admin_execute(url, "SELECT tablename FROM pg_tables WHERE schemaname = $1", schema)
    return {r[0] for r in rows}


async def leader_lock_pids(url: URL, schema: str) -> list[int]:
    rows = await admin_execute(
        url,
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.classid = $1 AND l.objid = $2::regnamespace::oid AND l.objsubid = 2",
        LOCK_NS_LEADER,
        schema,
    )
    return [r[0] for r in rows]


async def test_downgrade_refuses_under_a_live_leader_naming_it_and_forced_fences_it(
    pg_url: URL, migrated: str
) -> None:
    async with await PgStore.connect(pg_url, config(migrated, f"dg-{migrated}")) as leader:
        epoch = await leader.acquire_leadership()
        await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1)], [])
        (pid,) = await leader_lock_pids(pg_url, migrated)

        for target in ("base", "0005_task_tenant"):
            refused = await cronoq("--schema", migrated, "downgrade", target, "--yes", url=pg_url)
            assert refused.returncode == ExitCode.FAILED, (target, refused.stderr)
            assert f"an instance leads schema {migrated!r}" in refused.stderr
            assert f"pid {pid}, application 'dg-{migrated} leader " in refused.stderr
            assert "--force" in refused.stderr
        by_alembic = await alembic("-x", f"schema={migrated}", "downgrade", "-1", url=pg_url)
        assert by_alembic.returncode != 0
        assert f"an instance leads schema {migrated!r}" in by_alembic.stderr
        assert "-x force=true" in by_alembic.stderr
        # Nothing changed: the revision, the tables and the task are all there.
        assert await task_rows(pg_url, migrated) == 1
        assert (await leader.health()).revision == (head_revision(),)
        await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 2)], [])

        forced = await cronoq(
            "--schema", migrated, "downgrade", "0004_task_labels", "--yes", "--force", url=pg_url
        )
        assert forced.returncode == 0, forced.stderr
        # The leader was fenced by the downgrade's epoch bump: its next commit lands nowhere.
        with pytest.raises(FencedError):
            await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 3)], [])
        await bounded(leader.leadership_lost(), "the leader stepping down")
        assert await task_rows(pg_url, migrated) == 2


async def test_alembic_force_downgrades_under_a_leader(pg_url: URL, migrated: str) -> None:
    async with await PgStore.connect(pg_url, config(migrated, f"dga-{migrated}")) as leader:
        epoch = await leader.acquire_leadership()
        forced = await alembic(
            "-x", f"schema={migrated}", "-x", "force=true", "downgrade", "base", url=pg_url
        )
        assert forced.returncode == 0, forced.stderr
        assert await tables(pg_url, migrated) == {"cronoq_alembic_version"}
        with pytest.raises(SchemaGoneError):
            await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1)], [])
        assert not leader.is_leader
        await bounded(leader.leadership_lost(), "the leader stepping down")


async def test_base_refuses_a_cluster_that_issued_ids_and_a_partial_one_runs_unled(
    pg_url: URL, migrated: str
) -> None:
    async with await PgStore.connect(pg_url, config(migrated, f"dgb-{migrated}")) as store:
        epoch = await store.acquire_leadership()
        await store.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1)], [])
        await store.release_leadership()

    partial = await cronoq(
        "--schema", migrated, "downgrade", "0005_task_tenant", "--yes", url=pg_url
    )
    assert partial.returncode == 0, partial.stderr
    gone = await cronoq("--schema", migrated, "downgrade", "base", "--yes", url=pg_url)
    assert gone.returncode == ExitCode.FAILED
    assert f"schema {migrated!r} has issued task ids" in gone.stderr
    assert "issues the same ids" in gone.stderr
    assert await task_rows(pg_url, migrated) == 1
    forced = await cronoq("--schema", migrated, "downgrade", "base", "--yes", "--force", url=pg_url)
    assert forced.returncode == 0, forced.stderr
    assert await tables(pg_url, migrated) == {"cronoq_alembic_version"}


async def test_a_standby_waits_behind_a_downgrade_and_never_leads_the_void(
    pg_url: URL, engine: AsyncEngine, migrated: str
) -> None:
    async with await PgStore.connect(pg_url, config(migrated, f"dgr-{migrated}")) as standby:
        async with engine.connect() as conn:
            await conn.begin()
            await downgrade(conn, migrated, "base")
            downgrading = (await conn.execute(select(func.pg_backend_pid()))).scalar_one()
            acquiring = asyncio.ensure_future(standby.acquire_leadership())
            # The downgrade's transaction holds the leader lock: the standby polls behind it.
            await holds_for(lambda: not acquiring.done(), "the standby waiting", 1.0)
            assert await leader_lock_pids(pg_url, migrated) == [downgrading]
            await conn.commit()
        with pytest.raises(SchemaGoneError, match="run `cronoq-store migrate`"):
            await bounded(acquiring, "the standby's acquisition ending")
        assert not standby.is_leader
        assert await leader_lock_pids(pg_url, migrated) == []


async def test_a_standby_cannot_lead_after_a_partial_downgrade(
    pg_url: URL, engine: AsyncEngine, migrated: str
) -> None:
    """The leader row's columns that taking the epoch writes are gone (42703):
    SchemaGoneError, not a StoreError retried at every poll, and the lock is let go."""
    async with await PgStore.connect(pg_url, config(migrated, f"dgp-{migrated}")) as standby:
        await downgrade(engine, migrated, "0003_recurring_last_task_id")
        with pytest.raises(SchemaGoneError, match="run `cronoq-store migrate`"):
            await standby.acquire_leadership()
        assert not standby.is_leader
        assert (await standby.health()).holder is None
        with pytest.raises(FencedError):
            await standby.commit(1, PROCESS_BASE, [submitted_in(1, 2)], [])


@pytest.mark.parametrize("drop", ["forced downgrade", "by hand"])
async def test_a_leader_whose_tables_are_dropped_steps_down_and_acks_nothing_after(
    pg_url: URL, migrated: str, drop: str
) -> None:
    name = f"dgl-{migrated}"
    async with await PgStore.connect(pg_url, config(migrated, name)) as leader:
        epoch = await leader.acquire_leadership()
        counter = itertools.count()
        acks: list[float] = []

        async def submitter(committer: GroupCommitter) -> None:
            while True:
                await committer.submit([submitted_in(epoch, next(counter))])
                acks.append(time.monotonic())

        committer = GroupCommitter(leader, epoch, PROCESS_BASE)
        running = [asyncio.ensure_future(submitter(committer)) for _ in range(16)]
        try:
            await until(lambda: len(acks) >= 200, "acks before the drop")
            if drop == "by hand":
                conn = await asyncpg.connect(asyncpg_dsn(pg_url))
                try:
                    await conn.execute(
                        f'DROP TABLE "{migrated}".cronoq_leader, "{migrated}".cronoq_tasks, '
                        f'"{migrated}".cronoq_recurring, "{migrated}".cronoq_leader_history'
                    )
                    await conn.execute(f'DELETE FROM "{migrated}".cronoq_alembic_version')
                finally:
                    await conn.close()
            else:
                ran = await cronoq(
                    "--schema", migrated, "downgrade", "base", "--yes", "--force", url=pg_url
                )
                assert ran.returncode == 0, ran.stderr
            dropped = time.monotonic()
            errors = await bounded(
                asyncio.gather(*running, return_exceptions=True), "the submitters failing"
            )
            await bounded(leader.leadership_lost(), "the leader stepping down")
        finally:
            for task in running:
                task.cancel()
            await committer.close()
        assert all(isinstance(e, SchemaGoneError) for e in errors), errors
        assert "tables or columns this build uses" in str(errors[0])
        assert not leader.is_leader
        assert [t for t in acks if t > dropped] == []

        # The lock session was closed: no session of this leader holds the lock.
        async def unlocked() -> bool:
            return await leader_lock_pids(pg_url, migrated) == []

        await until(unlocked, "the lock session to close")
        # A schema migrated again gets nothing from the old leader.
        await upgrade(leader.engine, migrated)

        async def empty() -> bool:
            return await task_rows(pg_url, migrated) == 0

        await holds_for(empty, "the migrated schema without tasks", 0.5)
        with pytest.raises(FencedError):
            await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 10**6)], [])


async def test_the_offline_script_stops_under_a_live_leader(pg_url: URL, migrated: str) -> None:
    script = await cronoq(
        "--schema", migrated, "downgrade", "--sql", f"{head_revision()}:base", url=pg_url
    )
    assert script.returncode == 0, script.stderr
    async with await PgStore.connect(pg_url, config(migrated, f"dgo-{migrated}")) as leader:
        epoch = await leader.acquire_leadership()
        conn = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            with pytest.raises(asyncpg.ObjectInUseError, match="an instance leads schema"):
                await conn.execute(script.stdout)
        finally:
            await conn.close()
        assert await tables(pg_url, migrated) >= {"cronoq_leader", "cronoq_tasks"}
        await leader.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1)], [])
    # Nobody leads: the same script runs.
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await conn.execute(script.stdout)
    finally:
        await conn.close()
    assert await tables(pg_url, migrated) == {"cronoq_alembic_version"}


async def test_health_names_the_holder_of_a_schema_downgraded_under_it(
    pg_url: URL, migrated: str
) -> None:
    """The leader whose tables a forced downgrade dropped steps down by itself and lets the
    lock go, idle as it is; a session that holds the lock of the schema with no tables
    after it (no store instance: nothing records one) is named."""
    async with await PgStore.connect(pg_url, config(migrated, f"dgh-{migrated}")) as leader:
        await leader.acquire_leadership()
        forced = await cronoq(
            "--schema", migrated, "downgrade", "base", "--yes", "--force", url=pg_url
        )
        assert forced.returncode == 0, forced.stderr
        await bounded(leader.leadership_lost(), "the leader stepping down")

        async def let_go() -> bool:
            return await leader_lock_pids(pg_url, migrated) == []

        await until(let_go, "the old leader to let the lock go")
        health = await cronoq("--schema", migrated, "health", url=pg_url)
        assert health.returncode == ExitCode.NOT_MIGRATED, health.stdout
        assert "no instance holds the leader lock" in health.stdout

        holder = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            await holder.execute(
                "SELECT pg_advisory_lock($1, $2::regnamespace::oid::int)", LOCK_NS_LEADER, migrated
            )
            pid = await holder.fetchval("SELECT pg_backend_pid()")
            health = await cronoq("--schema", migrated, "health", url=pg_url)
        finally:
            await holder.close()
        assert health.returncode == ExitCode.NOT_MIGRATED, health.stdout
        assert "no instance holds the leader lock" not in health.stdout
        assert f"schema {migrated} is not migrated" in health.stdout
        assert f"backend pid {pid} (" in health.stdout
        assert "holds the leader lock" in health.stdout
