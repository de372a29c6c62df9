"""A store writes only into the cluster it was opened on: the fence names the cluster's
incarnation (its leader table's OID) beside the epoch.

A schema dropped and migrated again, two schemas renamed into each other's place, a schema
restored from a logical dump: each is another cluster, which may store the very epoch the
old leader holds. The old leader's commits there are refused with ``ClusterReplacedError``,
it steps down on its own (releasing its lock, so ``health`` tells the truth), and a store
opened on the new cluster leads it with the next epoch. Everything runs on the suite's real
server; the operators' steps are the real commands (``cronoq-store``, ``pg_dump``,
``pg_restore``, SQL by hand).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import (
    ClusterReplacedError,
    FencedError,
    Mutation,
    PgStore,
    StatusChanged,
    TaskStatus,
    task_id,
)
from cronoq_store._cli import ExitCode
from cronoq_store._commit_path import BatchWriter, GroupMember, Outcome, Written, fold, write_group
from cronoq_store._door import CommitConnection
from cronoq_store._migrations import upgrade
from cronoq_store.testing import EmbeddedPostgres
from cronoq_store.testing._server import _free_port
from cronoq_store.testing._unprivileged import run_as

from .pgharness import WITHOUT_INSTANCE, admin_execute, asyncpg_dsn, without_instance
from .support import PROCESS_BASE, cronoq, named_config, pg_client, stored_ids, submitted_in
from .waits import PATIENCE, until


async def lock_session_pids(url: URL, name: str) -> list[int]:
    """The sessions of instance ``name``'s lock session (its ``application_name``)."""
    rows = await admin_execute(
        url,
        f"SELECT pid FROM pg_stat_activity WHERE {WITHOUT_INSTANCE} = $1",
        f"{name} leader",
    )
    return [r[0] for r in rows]


async def health_of(url: URL, schema: str) -> tuple[int, dict[str, object]]:
    """``cronoq-store health --json``: its exit code and document."""
    ran = await cronoq("--schema", schema, "health", "--json", url=url)
    return ran.returncode, json.loads(ran.stdout)


async def steps_down_and_lets_go(store: PgStore, url: URL) -> None:
    """Wait until ``store`` no longer leads and its lock session is closed."""
    await asyncio.wait_for(store.leadership_lost(), PATIENCE)
    assert not store.is_leader
    name = store.config.application_name

    async def let_go() -> bool:
        return await lock_session_pids(url, name) == []

    await until(let_go, f"{name}'s lock session to close")


@pytest.fixture
async def other_schema(pg_url: URL) -> AsyncIterator[str]:
    """A second schema for a test that needs two clusters; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# --- a schema dropped and migrated again -----------------------------------------------------


async def test_a_schema_dropped_and_migrated_again_refuses_the_old_leader_which_steps_down(
    pg_url: URL, migrated: str
) -> None:
    """The issue's case: an idle leader, its schema dropped by hand and migrated again with
    the command line; a new instance takes epoch 1 again, in the new cluster."""
    old_name, new_name = f"old-{migrated}", f"new-{migrated}"
    async with await PgStore.connect(pg_url, named_config(migrated, old_name)) as a:
        epoch = await a.acquire_leadership()
        await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 0)], [])
        await admin_execute(pg_url, f'DROP SCHEMA "{migrated}" CASCADE')
        ran = await cronoq("--schema", migrated, "migrate", url=pg_url)
        assert ran.returncode == 0, ran.stderr

        async with await PgStore.connect(pg_url, named_config(migrated, new_name)) as b:
            assert b.incarnation != a.incarnation
            assert await asyncio.wait_for(b.acquire_leadership(), PATIENCE) == epoch
            theirs = submitted_in(epoch, 0)  # the same id as the old cluster's first task
            await b.commit(epoch, PROCESS_BASE, [theirs], [])

            with pytest.raises(ClusterReplacedError) as refused:
                await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 1)], [])
            assert (refused.value.schema, refused.value.incarnation) == (migrated, a.incarnation)
            assert refused.value.found in (None, b.incarnation)
            assert not refused.value.is_transient
            with pytest.raises(ClusterReplacedError):
                await a.commit(
                    epoch, PROCESS_BASE, [StatusChanged(theirs.id, TaskStatus.CANCELLED, 0, 1)], []
                )
            await steps_down_and_lets_go(a, pg_url)
            assert b.is_leader

            record = await b.get_task(theirs.id)
            assert record is not None
            assert record.status is None
            assert await stored_ids(pg_url, migrated) == [theirs.id]
            code, health = await health_of(pg_url, migrated)
            assert code == ExitCode.OK, health
            leader = health["leader"]
            assert isinstance(leader, dict)
            assert without_instance(leader["application_name"]) == f"{new_name} leader"
            assert health["lock_holder"] == leader
            mine = await b.health()
            assert (mine.incarnation, mine.stored_incarnation) == (b.incarnation, b.incarnation)
            stale = await a.health()
            assert stale.cluster_replaced
            assert stale.stored_incarnation == b.incarnation

        # Its cluster is gone for good: it never leads what stands there now.
        with pytest.raises(ClusterReplacedError):
            await asyncio.wait_for(a.acquire_leadership(), PATIENCE)
        assert await lock_session_pids(pg_url, old_name) == []


async def test_a_cluster_replaced_in_one_transaction_steps_its_idle_leader_down_by_itself(
    pg_url: URL, engine: AsyncEngine, migrated: str
) -> None:
    """No commit needed: the keeper reads the leader row, finds another cluster's and steps
    down, naming both incarnations in every later refusal."""
    async with await PgStore.connect(pg_url, named_config(migrated, f"idle-{migrated}")) as a:
        epoch = await a.acquire_leadership()
        async with engine.connect() as conn:
            await conn.begin()
            await conn.exec_driver_sql(f'DROP SCHEMA "{migrated}" CASCADE')
            await upgrade(conn, migrated)
            await conn.commit()
        await steps_down_and_lets_go(a, pg_url)
        found = (await admin_execute(pg_url, f'SELECT tableoid FROM "{migrated}".cronoq_leader'))[
            0
        ][0]
        with pytest.raises(ClusterReplacedError) as refused:
            await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 0)], [])
        assert (refused.value.incarnation, refused.value.found) == (a.incarnation, found)
        assert str(a.incarnation) in str(refused.value)
        assert str(found) in str(refused.value)
        assert await stored_ids(pg_url, migrated) == []


async def test_after_a_forced_downgrade_and_migrate_health_names_the_new_leader(
    pg_url: URL, migrated: str
) -> None:
    """``downgrade base --force`` drops the tables under an idle leader, ``migrate`` makes
    them again: the old leader notices, steps down and lets the lock go, so a new instance
    leads and ``health`` names it, a store instance."""
    async with await PgStore.connect(pg_url, named_config(migrated, f"dgm-a-{migrated}")) as a:
        await a.acquire_leadership()
        forced = await cronoq(
            "--schema", migrated, "downgrade", "base", "--yes", "--force", url=pg_url
        )
        assert forced.returncode == 0, forced.stderr
        ran = await cronoq("--schema", migrated, "migrate", url=pg_url)
        assert ran.returncode == 0, ran.stderr
        await steps_down_and_lets_go(a, pg_url)
        async with await PgStore.connect(pg_url, named_config(migrated, f"dgm-b-{migrated}")) as b:
            await asyncio.wait_for(b.acquire_leadership(), PATIENCE)
            code, health = await health_of(pg_url, migrated)
            assert code == ExitCode.OK, health
            leader = health["leader"]
            assert isinstance(leader, dict)
            assert without_instance(leader["application_name"]) == f"dgm-b-{migrated} leader"
            assert health["reasons"] == []


async def test_a_lock_held_on_the_leader_table_for_long_does_not_depose_an_idle_leader(
    pg_url: URL, migrated: str
) -> None:
    """A migration (or any DDL) may hold the leader table exclusively for longer than
    ``session_timeout``. The keeper's read of the row waits for it at most a moment
    (``lock_timeout``): the session answered, the term goes on."""
    name = f"held-{migrated}"
    async with await PgStore.connect(pg_url, named_config(migrated, name)) as a:
        epoch = await a.acquire_leadership()
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            await blocker.execute("BEGIN")
            await blocker.execute(f'LOCK TABLE "{migrated}".cronoq_leader IN ACCESS EXCLUSIVE MODE')
            with pytest.raises(asyncio.TimeoutError):  # three session timeouts, still leading
                await asyncio.wait_for(
                    asyncio.shield(a.leadership_lost()), 3 * a.config.session_timeout
                )
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        assert (a.is_leader, a.epoch) == (True, epoch)
        await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 0)], [])
        assert len(await lock_session_pids(pg_url, name)) == 1


# --- two schemas renamed into each other's place ---------------------------------------------


async def swap(url: URL, first: str, second: str) -> None:
    """Rename ``first`` and ``second`` into each other's place, in one transaction."""
    spare = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(
            f'BEGIN; ALTER SCHEMA "{first}" RENAME TO "{spare}"; '
            f'ALTER SCHEMA "{second}" RENAME TO "{first}"; '
            f'ALTER SCHEMA "{spare}" RENAME TO "{second}"; COMMIT'
        )
    finally:
        await conn.close()


async def test_two_schemas_renamed_into_each_others_place_refuse_both_old_leaders(
    pg_url: URL, engine: AsyncEngine, migrated: str, other_schema: str
) -> None:
    await upgrade(engine, other_schema)
    async with (
        await PgStore.connect(pg_url, named_config(migrated, f"sw-a-{migrated}")) as a,
        await PgStore.connect(pg_url, named_config(other_schema, f"sw-c-{other_schema}")) as c,
    ):
        epoch = await a.acquire_leadership()
        assert await c.acquire_leadership() == epoch  # both clusters at epoch 1
        await c.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 7)], [])
        await swap(pg_url, migrated, other_schema)

        for old, new_schema in ((a, migrated), (c, other_schema)):
            with pytest.raises(ClusterReplacedError) as refused:
                await old.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 99)], [])
            assert refused.value.schema == new_schema
            await steps_down_and_lets_go(old, pg_url)
        # Nothing of theirs landed in either cluster.
        assert await stored_ids(pg_url, migrated) == [task_id(epoch, 7)]
        assert await stored_ids(pg_url, other_schema) == []

        # A store opened on a name now finds the cluster that moved there, and leads it.
        async with await PgStore.connect(pg_url, named_config(migrated, f"sw-d-{migrated}")) as d:
            assert d.incarnation == c.incarnation
            assert await asyncio.wait_for(d.acquire_leadership(), PATIENCE) == epoch + 1
            recovered = await d.recover(PROCESS_BASE)
            assert [t.id for t in recovered.tasks] == [task_id(epoch, 7)]


async def test_a_rename_in_the_middle_of_a_commit_transaction_writes_nothing_anywhere(
    pg_url: URL, engine: AsyncEngine, migrated: str, other_schema: str
) -> None:
    """A transaction's epoch check holds the leader row, but not the schema's name: each
    later statement looks its table up again. A mixed batch waits on a row lock after its
    check, the schemas swap meanwhile, and its insert would land in the other cluster: the
    check sent with the COMMIT refuses it, and nothing of it is stored in either."""
    await upgrade(engine, other_schema)
    await admin_execute(pg_url, f'UPDATE "{other_schema}".cronoq_leader SET epoch = 1')
    name = f"mid-{migrated}"
    async with await PgStore.connect(pg_url, named_config(migrated, name)) as a:
        epoch = await a.acquire_leadership()
        stored = submitted_in(epoch, 0)
        await a.commit(epoch, PROCESS_BASE, [stored], [])
        blocker = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            await blocker.execute("BEGIN")
            await blocker.execute(
                f'SELECT 1 FROM "{migrated}".cronoq_tasks WHERE id = $1 FOR UPDATE', stored.id
            )
            mixed: list[Mutation] = [
                StatusChanged(stored.id, TaskStatus.RUNNING, 1, 5),
                submitted_in(epoch, 1),
            ]
            committing = asyncio.ensure_future(a.commit(epoch, PROCESS_BASE, mixed, []))

            async def waiting_on_the_row() -> bool:
                rows = await admin_execute(
                    pg_url,
                    "SELECT 1 FROM pg_stat_activity WHERE application_name = $1 "
                    "AND wait_event_type = 'Lock'",
                    name,
                )
                return bool(rows)

            await until(waiting_on_the_row, "the commit to wait on the row")
            await swap(pg_url, migrated, other_schema)
            await blocker.execute("ROLLBACK")
        finally:
            await blocker.close()
        with pytest.raises(ClusterReplacedError):
            await asyncio.wait_for(committing, PATIENCE)
        assert await stored_ids(pg_url, migrated) == []  # the other cluster: nothing
        assert await stored_ids(pg_url, other_schema) == [stored.id]  # a's own: as it was
        rows = await admin_execute(
            pg_url, f'SELECT status FROM "{other_schema}".cronoq_tasks WHERE id = $1', stored.id
        )
        assert rows[0][0] == "queued"
        await steps_down_and_lets_go(a, pg_url)


async def test_a_schema_swapped_away_and_back_between_a_commits_statements_loses_no_task(
    pg_url: URL, engine: AsyncEngine, migrated: str, other_schema: str
) -> None:
    """The closing check sees only where the schema's name leads at the end: a name that
    leads to another cluster while a mixed batch inserts its new tasks, and back before
    the COMMIT, passes it. The insert's own check (its fenced form) finds the other
    cluster: the commit is refused, with nothing written, rather than acknowledged with
    its new tasks stored nowhere (or in the other cluster)."""
    await upgrade(engine, other_schema)
    await admin_execute(pg_url, f'UPDATE "{other_schema}".cronoq_leader SET epoch = 1')
    async with await PgStore.connect(pg_url, named_config(migrated, f"back-{migrated}")) as a:
        epoch = await a.acquire_leadership()
        stored = submitted_in(epoch, 0)
        await a.commit(epoch, PROCESS_BASE, [stored], [])
        writers = a._commits.writer._writers
        update, insert = writers["updates"], writers["insert_rows"]

        async def then_swapped(*args: Any) -> None:
            await update(*args)
            await swap(pg_url, migrated, other_schema)

        async def then_swapped_back(*args: Any) -> None:
            try:
                await insert(*args)
            finally:
                await swap(pg_url, migrated, other_schema)

        writers["updates"], writers["insert_rows"] = then_swapped, then_swapped_back
        # Two new tasks: an insert this session never prepared, so the server looks its
        # tables up by name (a statement prepared before keeps the tables it found).
        new = [submitted_in(epoch, 1), submitted_in(epoch, 2)]
        mixed: list[Mutation] = [StatusChanged(stored.id, TaskStatus.RUNNING, 1, 5), *new]
        assert a._commits.writer.path(fold(mixed, PROCESS_BASE, 0)) == "transaction"
        with pytest.raises(ClusterReplacedError):
            await a.commit(epoch, PROCESS_BASE, mixed, [])
        assert await stored_ids(pg_url, migrated) == [stored.id]  # back in its place
        assert await stored_ids(pg_url, other_schema) == []
        rows = await admin_execute(
            pg_url, f'SELECT status FROM "{migrated}".cronoq_tasks WHERE id = $1', stored.id
        )
        assert rows[0][0] == "queued"  # the update was rolled back with the rest
        await steps_down_and_lets_go(a, pg_url)


async def test_a_schema_swapped_away_and_back_around_a_commits_update_moves_nothing(
    pg_url: URL, engine: AsyncEngine, migrated: str, other_schema: str
) -> None:
    """The same around the transitions of a commit transaction: its update, the fenced
    one, finds the other cluster and the commit is refused with nothing written, instead
    of moving that cluster's task of the same id and committing the rest here."""
    await upgrade(engine, other_schema)
    await admin_execute(pg_url, f'UPDATE "{other_schema}".cronoq_leader SET epoch = 1')
    async with await PgStore.connect(pg_url, named_config(migrated, f"upd-{migrated}")) as a:
        epoch = await a.acquire_leadership()
        stored = submitted_in(epoch, 0)
        await a.commit(epoch, PROCESS_BASE, [stored], [])
        # The same task in the other cluster, which a misdirected update would move.
        async with await PgStore.connect(pg_url, named_config(other_schema, "o")) as b:
            await b.commit(1, PROCESS_BASE, [stored], [])
        writers = a._commits.writer._writers
        update = writers["updates"]

        async def swapped_around(*args: Any) -> None:
            await swap(pg_url, migrated, other_schema)
            try:
                await update(*args)
            finally:
                await swap(pg_url, migrated, other_schema)

        writers["updates"] = swapped_around
        mixed: list[Mutation] = [
            StatusChanged(stored.id, TaskStatus.RUNNING, 1, 5),
            submitted_in(epoch, 1),
        ]
        with pytest.raises(ClusterReplacedError):
            await a.commit(epoch, PROCESS_BASE, mixed, [])
        for schema in (migrated, other_schema):
            rows = await admin_execute(
                pg_url, f'SELECT id, status FROM "{schema}".cronoq_tasks ORDER BY id'
            )
            assert [tuple(r) for r in rows] == [(stored.id, "queued")]
        await steps_down_and_lets_go(a, pg_url)


@pytest.mark.parametrize("prepared", [0, 64], ids=["together", "staged"])
async def test_a_schema_swapped_away_and_back_under_a_shared_transaction_lands_each_task_once(
    pg_url: URL, engine: AsyncEngine, migrated: str, other_schema: str, prepared: int
) -> None:
    """The same on the host's commit bus, whose transaction several clusters' commits share:
    the transaction in which a member's insert met the other cluster commits nothing, and
    the commits are written again (the name leads back by then): every task lands once, in
    its own cluster (the closing checks alone let the update land, the new tasks nowhere)."""
    third = f"t_{uuid.uuid4().hex[:12]}"
    schemas = (migrated, other_schema, third)
    driver = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        incarnations = {}
        for schema in schemas[1:]:
            await upgrade(engine, schema)
        for schema in schemas:
            await driver.execute(f'UPDATE "{schema}".cronoq_leader SET epoch = 1')
            incarnations[schema] = await driver.fetchval(
                f'SELECT tableoid::int8 FROM "{schema}".cronoq_leader'
            )
        dialect = asyncpg_dialect()  # type: ignore[no-untyped-call]
        writers = {schema: BatchWriter(dialect, schema) for schema in (migrated, third)}
        conn = CommitConnection(driver)
        stored = {schema: submitted_in(1, 0) for schema in writers}
        for schema, writer in writers.items():
            written = await writer.write(
                conn, 1, incarnations[schema], fold([stored[schema]], PROCESS_BASE, 0)
            )
            assert written.fence == (1, incarnations[schema])
        own = writers[migrated]._writers
        update, insert = own["updates"], own["insert_rows"]
        swaps = 0

        async def then_swapped(*args: Any) -> None:
            nonlocal swaps
            await update(*args)
            if swaps == 0:
                swaps += 1
                await swap(pg_url, migrated, other_schema)

        async def then_swapped_back(*args: Any) -> None:
            nonlocal swaps
            try:
                await insert(*args)
            finally:
                if swaps == 1:
                    swaps += 1
                    await swap(pg_url, migrated, other_schema)

        own["updates"], own["insert_rows"] = then_swapped, then_swapped_back
        members = [
            GroupMember(
                writer,
                1,
                incarnations[schema],
                fold(
                    [
                        StatusChanged(stored[schema].id, TaskStatus.RUNNING, 1, 5),
                        submitted_in(1, 1),
                        submitted_in(1, 2),
                    ],
                    PROCESS_BASE,
                    0,
                ),
            )
            for schema, writer in writers.items()
        ]
        outcomes: list[Outcome] = [None, None]
        await write_group(conn, members, outcomes, prepared=prepared)
        assert swaps == 2
        # Written again once the name led back: both landed whole.
        assert outcomes == [Written((1, incarnations[schema])) for schema in writers]
        for schema in writers:
            rows = await driver.fetch(f'SELECT id, status FROM "{schema}".cronoq_tasks ORDER BY id')
            assert [tuple(r) for r in rows] == [
                (stored[schema].id, "running"),
                (submitted_in(1, 1).id, "queued"),
                (submitted_in(1, 2).id, "queued"),
            ]
        assert await stored_ids(pg_url, other_schema) == []
    finally:
        await driver.close()
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{third}" CASCADE')


# --- every write of a store that never led -----------------------------------------------------


async def test_every_write_path_recovery_and_prune_refuse_another_cluster(
    pg_url: URL, engine: AsyncEngine, migrated: str
) -> None:
    """A store may commit without the lock (a host process leading through its own
    liveness): its epoch check alone fences it. Each write path (one insert, many inserts,
    updates, a transaction, COPY), recovery and prune find the same epoch in a cluster made
    again, and refuse it in SQL, with nothing written."""
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = 1')
    paths = ("insert one", "insert many", "update", "transaction", "copy", "recover", "prune")
    stores = {
        path: await PgStore.connect(
            pg_url, named_config(migrated, f"{path.replace(' ', '')}-{migrated}")
        )
        for path in paths
    }
    try:
        first = stores["update"]
        queued = [submitted_in(1, n) for n in range(3)]
        await first.commit(1, PROCESS_BASE, queued, [])
        incarnation = first.incarnation
        await admin_execute(pg_url, f'DROP SCHEMA "{migrated}" CASCADE')
        await upgrade(engine, migrated)
        await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = 1')
        batches: dict[str, list[Mutation]] = {
            "insert one": [submitted_in(1, 10)],
            "insert many": [submitted_in(1, 11), submitted_in(1, 12)],
            "update": [StatusChanged(queued[0].id, TaskStatus.RUNNING, 1, 5)],
            "transaction": [
                submitted_in(1, 20),
                StatusChanged(queued[1].id, TaskStatus.RUNNING, 1, 5),
            ],
            "copy": [submitted_in(1, n) for n in range(100, 140)],
        }
        for path, batch in batches.items():
            store = stores[path]
            assert store._commits.writer.path(fold(batch, PROCESS_BASE, 0)) == path.split()[0]
            with pytest.raises(ClusterReplacedError) as refused:
                await store.commit(1, PROCESS_BASE, batch, [])
            assert refused.value.incarnation == incarnation, path
            assert refused.value.found is not None
            assert refused.value.found != incarnation
            with pytest.raises(FencedError):  # and from then on, at once
                await store.commit(1, PROCESS_BASE, [submitted_in(1, 999)], [])
        with pytest.raises(ClusterReplacedError):
            await stores["recover"].recover(PROCESS_BASE)
        with pytest.raises(ClusterReplacedError):
            await stores["prune"].prune(1)
        assert await stored_ids(pg_url, migrated) == []
        rows = await admin_execute(pg_url, f'SELECT epoch, max_id FROM "{migrated}".cronoq_leader')
        assert tuple(rows[0]) == (1, 0)
    finally:
        for store in stores.values():
            await store.close()


# --- a logical restore --------------------------------------------------------------------------


async def test_a_schema_restored_from_a_dump_is_a_new_cluster_led_with_the_next_epoch(
    pg_url: URL, migrated: str, tmp_path: Path
) -> None:
    """Back up one cluster with ``pg_dump -n``, lose it, restore it with ``pg_restore``: the
    restored schema holds the dumped epoch and tasks in a new incarnation. The old leader,
    still running, is refused there (the epoch alone would let it in) and steps down; a
    store opened on the restored schema leads it with the next epoch, recovers what was
    dumped and nothing written after, and issues ids above every id it recovered."""
    dump = tmp_path / "cluster.dump"
    async with await PgStore.connect(pg_url, named_config(migrated, f"dump-a-{migrated}")) as a:
        epoch = await a.acquire_leadership()
        dumped = [submitted_in(epoch, n) for n in range(3)]
        await a.commit(
            epoch,
            PROCESS_BASE,
            [
                *dumped,
                StatusChanged(dumped[2].id, TaskStatus.SUCCEEDED, 1, PROCESS_BASE.engine_ns + 9),
            ],
            [],
        )
        await asyncio.to_thread(
            pg_client,
            "pg_dump",
            pg_url,
            "--schema",
            migrated,
            "--format",
            "custom",
            "--file",
            str(dump),
        )
        after_dump = submitted_in(epoch, 3)
        await a.commit(epoch, PROCESS_BASE, [after_dump], [])

        await admin_execute(pg_url, f'DROP SCHEMA "{migrated}" CASCADE')
        await asyncio.to_thread(pg_client, "pg_restore", pg_url, "--exit-on-error", str(dump))
        rows = await admin_execute(pg_url, f'SELECT epoch FROM "{migrated}".cronoq_leader')
        assert rows[0][0] == epoch  # the dumped epoch: only the incarnation tells them apart

        with pytest.raises(ClusterReplacedError):
            await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 4)], [])
        await steps_down_and_lets_go(a, pg_url)

        async with await PgStore.connect(pg_url, named_config(migrated, f"dump-b-{migrated}")) as b:
            assert b.incarnation != a.incarnation
            assert await asyncio.wait_for(b.acquire_leadership(), PATIENCE) == epoch + 1
            recovered = await b.recover(PROCESS_BASE)
            assert [t.id for t in recovered.tasks] == [dumped[0].id, dumped[1].id]
            assert [t.id for t in recovered.terminal] == [dumped[2].id]
            assert recovered.next_id == dumped[2].id + 1
            new = submitted_in(epoch + 1, 0)
            await b.commit(epoch + 1, PROCESS_BASE, [new], [])
            assert await stored_ids(pg_url, migrated) == [*(d.id for d in dumped), new.id]
            assert after_dump.id not in await stored_ids(pg_url, migrated)
            code, health = await health_of(pg_url, migrated)
            assert code == ExitCode.OK, health
            assert health["stored_epoch"] == epoch + 1


async def test_a_leader_that_saw_a_restored_table_without_its_row_reports_the_cluster_replaced(
    pg_url: URL, migrated: str, tmp_path: Path
) -> None:
    """``pg_restore`` makes the tables before it loads their rows: a keeper that looks in
    between finds the leader table of a new incarnation without its row. That is the cluster
    replaced, as when it finds the table gone or the restored row: the old leader's commit
    after the restore is refused with ``ClusterReplacedError``, never plain fencing. The
    tables are restored over the schema in one transaction (``--clean``), so the keeper never
    sees the schema gone, and the rows only once it has stepped down on the empty table."""
    dump = tmp_path / "cluster.dump"
    async with await PgStore.connect(pg_url, named_config(migrated, f"rowless-{migrated}")) as a:
        epoch = await a.acquire_leadership()
        dump_args = ("--schema", migrated, "--format", "custom", "--file", str(dump))
        await asyncio.to_thread(pg_client, "pg_dump", pg_url, *dump_args)
        restore = ("pg_restore", pg_url, "--exit-on-error")
        tables = ("--clean", "--single-transaction", "--section=pre-data", str(dump))
        await asyncio.to_thread(pg_client, *restore, *tables)
        await asyncio.wait_for(a.leadership_lost(), PATIENCE)
        table = f'"{migrated}".cronoq_leader'
        rows = await admin_execute(
            pg_url, f"SELECT '{table}'::regclass::oid, count(*) FROM {table}"
        )
        assert rows[0][0] != a.incarnation  # a new incarnation's table...
        assert rows[0][1] == 0  # ...still without its row

        await asyncio.to_thread(
            pg_client, *restore, "--section=data", "--section=post-data", str(dump)
        )
        with pytest.raises(ClusterReplacedError):
            await a.commit(epoch, PROCESS_BASE, [submitted_in(epoch, 0)], [])


# --- what keeps the cluster: pg_upgrade ----------------------------------------------------------


def _pg_upgrade(old: EmbeddedPostgres, new: EmbeddedPostgres) -> None:
    """``pg_upgrade`` from ``old``'s data directory into ``new``'s (both stopped), with the
    same binaries: what a major upgrade does to the catalogs, without a second version."""
    bin_dir = str(old.bin_dir)
    result = subprocess.run(
        [
            *(str(old.bin_dir / "pg_upgrade"), "-b", bin_dir, "-B", bin_dir),
            *("-d", str(old.data_dir), "-D", str(new.data_dir), "-U", "postgres"),
            *("-s", str(new.socket_dir), "-p", str(_free_port()), "-P", str(_free_port())),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=new.base_dir,  # pg_upgrade writes in its working directory
        **run_as(),
    )
    assert result.returncode == 0, f"pg_upgrade failed: {result.stdout}\n{result.stderr}"


async def schema_oid(url: URL, schema: str) -> int:
    return int((await admin_execute(url, "SELECT $1::regnamespace::oid::bigint", schema))[0][0])


@pytest.mark.slow
async def test_pg_upgrade_keeps_the_cluster_and_moves_the_lock_key_for_every_store(
    binaries: None,
) -> None:
    """``pg_upgrade`` keeps every table's OID (the incarnation) and gives the schema another
    OID (the lock's second key). A store opened before the upgrade leads after it, and so
    excludes a store opened after it: each acquisition reads the key again."""
    schema = "upgraded"
    old = EmbeddedPostgres()
    new = EmbeddedPostgres(port=old.port)
    new.password = old.password  # the same server to its clients: port and credentials
    stores: list[PgStore] = []
    try:
        await asyncio.to_thread(old.start)
        url = old.url()
        a = await PgStore.connect(url, named_config(schema, "upgrade-a"))
        stores.append(a)
        epoch = await a.acquire_leadership()
        first = submitted_in(epoch, 0)
        await a.commit(epoch, PROCESS_BASE, [first], [])
        key_before = await schema_oid(url, schema)

        await asyncio.to_thread(old.stop)
        await asyncio.wait_for(a.leadership_lost(), PATIENCE)
        await asyncio.to_thread(new._init)
        await asyncio.to_thread(_pg_upgrade, old, new)
        await asyncio.to_thread(new.start)
        assert await schema_oid(url, schema) != key_before  # the reason to read it again
        rows = await admin_execute(url, f'SELECT tableoid FROM "{schema}".cronoq_leader')
        assert rows[0][0] == a.incarnation

        assert await asyncio.wait_for(a.acquire_leadership(), PATIENCE) == epoch + 1
        assert a.leader_lock[1] == await schema_oid(url, schema)
        b = await PgStore.connect(url, named_config(schema, "upgrade-b"))
        stores.append(b)
        assert b.incarnation == a.incarnation
        standby = asyncio.ensure_future(b.acquire_leadership())

        async def polling() -> bool:
            """Whether the standby tried the lock (or took it: then the leader is fenced)."""
            if standby.done():
                return True
            rows = await admin_execute(
                url,
                f"SELECT 1 FROM pg_stat_activity WHERE {WITHOUT_INSTANCE} = 'upgrade-b leader' "
                "AND query LIKE '%pg_try_advisory_lock%'",
            )
            return bool(rows)

        await until(polling, "the standby to try the lock")
        # The standby waits behind the same lock while the leader commits, term unbroken.
        for n in range(20):
            await a.commit(epoch + 1, PROCESS_BASE, [submitted_in(epoch + 1, n)], [])
        assert not standby.done()
        assert a.is_leader
        await a.release_leadership()
        assert await asyncio.wait_for(standby, PATIENCE) == epoch + 2
        recovered = await b.recover(PROCESS_BASE)
        assert [t.id for t in recovered.tasks][:2] == [first.id, task_id(epoch + 1, 0)]
        assert len(recovered.tasks) == 21
    finally:
        for store in stores:
            await store.close()
        await asyncio.to_thread(new.destroy)
        await asyncio.to_thread(old.destroy)
