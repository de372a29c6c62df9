"""``PgStore.health()`` on a real server: a leader and a standby report the same cluster
facts and their own roles; not being healthy is a value, an unreadable database an error."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.engine import URL

from cronoq_store import Health, PgStore, PgStoreConfig, StoreError
from cronoq_store._migrations import head_revision

from .pgharness import admin_execute, without_instance
from .support import START_BASE


def config(schema: str, name: str) -> PgStoreConfig:
    return PgStoreConfig(schema=schema, application_name=name, lock_poll=0.05)


async def test_leader_and_standby_report_the_holder_epoch_revision_and_commit_age(
    pg_url: URL, migrated: str
) -> None:
    async with (
        await PgStore.connect(pg_url, config(migrated, "health-a")) as a,
        await PgStore.connect(pg_url, config(migrated, "health-b")) as b,
    ):
        before = await b.health()
        assert before == Health(
            is_leader=False,
            epoch=None,
            stored_epoch=0,
            holder=None,
            revision=(head_revision(),),
            head=head_revision(),
            last_commit_age=None,
            incarnation=b.incarnation,
            stored_incarnation=b.incarnation,
        )
        assert not before.cluster_replaced
        assert before.at_head
        assert not before.has_leader

        epoch = await a.acquire_leadership()
        started = datetime.now(timezone.utc)
        await a.commit(epoch, START_BASE, [], [])
        (row,) = await admin_execute(
            pg_url,
            "SELECT pid, backend_start, application_name FROM pg_stat_activity "
            "WHERE starts_with(application_name, 'health-a leader ')",
        )
        leader, standby = await a.health(), await b.health()

        assert (leader.is_leader, leader.epoch, leader.stored_epoch) == (True, epoch, epoch)
        assert (standby.is_leader, standby.epoch, standby.stored_epoch) == (False, None, epoch)
        assert leader.holder == standby.holder
        holder = leader.holder
        assert holder is not None
        assert (holder.pid, holder.application_name, holder.client_addr) == (
            row["pid"],
            row["application_name"],
            "127.0.0.1",
        )
        assert holder.application_name == f"health-a leader {holder.instance}"
        assert holder.since == row["backend_start"]
        assert holder.since is not None
        assert holder.since.utcoffset() == timedelta(0)
        assert holder.since <= started
        assert leader.last_commit_age is not None
        assert 0 <= leader.last_commit_age < 5
        assert standby.last_commit_age is None

        await a.release_leadership()
        after = await b.health()
        assert (after.has_leader, after.stored_epoch) == (False, epoch)


async def test_a_schema_behind_head_is_reported_not_raised(pg_url: URL, migrated: str) -> None:
    async with await PgStore.connect(pg_url, config(migrated, "health-c")) as store:
        await admin_execute(
            pg_url, f"UPDATE {migrated}.cronoq_alembic_version SET version_num = 'older'"
        )
        health = await store.health()
        assert health.revision == ("older",)
        assert not health.at_head


async def test_an_unreadable_database_is_a_store_error(pg_url: URL, migrated: str) -> None:
    async with await PgStore.connect(pg_url, config(migrated, "health-d")) as store:
        await admin_execute(pg_url, f"DELETE FROM {migrated}.cronoq_leader")
        with pytest.raises(StoreError, match="reading health failed"):
            await store.health()


async def test_tables_dropped_under_a_leader_report_the_holder_and_no_revision(
    pg_url: URL, migrated: str
) -> None:
    """Health says what it knows: the lock is held, by whom, and the schema is not migrated
    (before: the leader row's UndefinedTableError raised from health())."""
    async with (
        await PgStore.connect(pg_url, config(migrated, "health-e")) as leader,
        await PgStore.connect(pg_url, config(migrated, "health-f")) as standby,
    ):
        await leader.acquire_leadership()
        await admin_execute(
            pg_url,
            f"DROP TABLE {migrated}.cronoq_leader, {migrated}.cronoq_tasks, "
            f"{migrated}.cronoq_recurring",
        )
        await admin_execute(pg_url, f"DELETE FROM {migrated}.cronoq_alembic_version")
        seen = await standby.health()
        assert seen.holder is not None
        assert seen.holder.application_name is not None
        assert without_instance(seen.holder.application_name) == "health-e leader"
        assert (seen.revision, seen.stored_epoch, seen.at_head) == ((), 0, False)
        # Reported as the lock's holder, not as a leader: with its leader row gone nothing
        # records it as a store instance, and no instance can lead an unmigrated schema.
        assert not seen.holder.store_instance
        assert not seen.has_leader
        assert not seen.is_leader
