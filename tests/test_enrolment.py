"""A cluster enrolled in a host group is never led by a standalone ``PgStore`` beside its
host: the enrolment marker (``cronoq_leader.host_group``, revision 0009) and the statements a
host runs on it, each on a real server.

A host enrols a cluster in a transaction that first tries the leader lock, as
:func:`enroll` does here: the statements are the store's, the transaction is how the host
(``PgHost``) runs them. A standalone on an enrolled cluster is refused with
``ClusterHostedError`` and takes no epoch, also when it waited for the lock as a standby; a
downgrade of an enrolled cluster is refused unless forced, and forced it fences the host."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from cronoq_store import ClusterHostedError, PgStore, PgStoreConfig
from cronoq_store import _statements as st
from cronoq_store._cli import ExitCode
from cronoq_store._migrations import head_revision
from cronoq_store._schema import schema_options

from .pgharness import admin_execute, asyncpg_dsn
from .support import cronoq, python_run, revision_of
from .waits import bounded, until

GROUP = "default"


def config(schema: str, name: str) -> PgStoreConfig:
    return PgStoreConfig(schema=schema, application_name=name, lock_poll=0.05)


@dataclass(frozen=True)
class Enrolment:
    """What a host's enrolment transaction found: whether it took the leader lock (the try
    fails while a standalone leads, or a downgrade runs), and the epoch ``enroll_cluster``
    returned (``None``: nothing enrolled)."""

    took_lock: bool
    epoch: int | None


async def run(conn: AsyncConnection, cluster: str, statement: Any, **params: Any) -> Any:
    """``statement`` in the cluster in schema ``cluster``, the first column of its first row."""
    result = await conn.execute(
        statement, params or None, execution_options=schema_options(cluster)
    )
    row = result.first()
    return None if row is None else row[0]


async def enroll(engine: AsyncEngine, schema: str, incarnation: int, group: str) -> Enrolment:
    """Enrol the cluster in ``group`` as a host does: in one transaction, the leader lock
    tried first (``pg_try_advisory_xact_lock``), then ``enroll_cluster``."""
    async with engine.begin() as conn:
        oid = await run(conn, schema, st.schema_oid, schema=schema)
        took = await run(
            conn, schema, st.try_leader_lock_for_transaction, k1=st.LOCK_NS_LEADER, k2=oid
        )
        if not took:
            return Enrolment(False, None)
        epoch = await run(conn, schema, st.enroll_cluster, incarnation=incarnation, group=group)
        return Enrolment(True, epoch)


async def unenroll(engine: AsyncEngine, schema: str, group: str) -> int | None:
    async with engine.begin() as conn:
        epoch: int | None = await run(conn, schema, st.unenroll_cluster, group=group)
        return epoch


async def leader_row(url: URL, schema: str) -> dict[str, Any]:
    rows = await admin_execute(
        url,
        f'SELECT epoch, host_group, holder_pid, holder_epoch FROM "{schema}".cronoq_leader',
    )
    return dict(rows[0])


async def terms(url: URL, schema: str) -> int:
    rows = await admin_execute(url, f'SELECT count(*) FROM "{schema}".cronoq_leader_history')
    return int(rows[0][0])


async def leader_lock_pids(url: URL, schema: str) -> list[int]:
    rows = await admin_execute(
        url,
        "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.classid = $1 AND l.objid = $2::regnamespace::oid AND l.objsubid = 2",
        st.LOCK_NS_LEADER,
        schema,
    )
    return [r[0] for r in rows]


async def test_a_standalone_store_is_refused_an_enrolled_cluster_and_takes_no_epoch(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 0)
    async with await PgStore.connect(pg_url, config(migrated, f"en-{migrated}")) as store:
        with pytest.raises(ClusterHostedError) as refused:
            await bounded(store.acquire_leadership(), "the refusal")
        assert (refused.value.schema, refused.value.group) == (migrated, GROUP)
        assert str(refused.value) == (
            f"acquiring leadership failed: schema {migrated!r} is enrolled in host group "
            "'default': lead it with PgHost, or remove it from the host group first"
        )
        assert not refused.value.is_transient
        assert not store.is_leader
        # No epoch taken, no term recorded, and the lock let go.
        row = await leader_row(pg_url, migrated)
        assert (row["epoch"], row["host_group"], row["holder_epoch"]) == (0, GROUP, None)
        assert await terms(pg_url, migrated) == 0
        assert await leader_lock_pids(pg_url, migrated) == []

        # Out of the group, the same store leads it as any standalone cluster.
        assert await unenroll(engine, migrated, GROUP) == 0
        assert await bounded(store.acquire_leadership(), "the standalone's takeover") == 1
        assert (await leader_row(pg_url, migrated))["host_group"] is None


async def test_a_standby_that_gets_the_lock_of_a_cluster_enrolled_meanwhile_is_refused(
    pg_url: URL, migrated: str
) -> None:
    """The leader releases; a host enrols the cluster before the standby's next poll (here
    by hand, under the leader, as that gap is too short to aim at); the standby then takes
    the lock, finds the cluster enrolled, and lets it go without an epoch."""
    async with (
        await PgStore.connect(pg_url, config(migrated, f"ena-{migrated}")) as leader,
        await PgStore.connect(pg_url, config(migrated, f"enb-{migrated}")) as standby,
    ):
        assert await leader.acquire_leadership() == 1
        waiting = asyncio.ensure_future(standby.acquire_leadership())

        async def polling() -> bool:
            sessions = await admin_execute(
                pg_url,
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1",
                f"enb-{migrated} leader %",
            )
            return int(sessions[0][0]) == 1 and not waiting.done()

        await until(polling, "the standby waiting for the lock")
        await admin_execute(
            pg_url, f"UPDATE \"{migrated}\".cronoq_leader SET host_group = '{GROUP}'"
        )
        await leader.release_leadership()
        with pytest.raises(ClusterHostedError, match="enrolled in host group 'default'"):
            await bounded(waiting, "the standby's refusal")
        assert not standby.is_leader
        assert (await leader_row(pg_url, migrated))["epoch"] == 1
        assert await terms(pg_url, migrated) == 1
        assert await leader_lock_pids(pg_url, migrated) == []


async def test_enrolment_tries_the_lock_and_fails_while_a_standalone_leads(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    async with await PgStore.connect(pg_url, config(migrated, f"enc-{migrated}")) as leader:
        assert await leader.acquire_leadership() == 1
        assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(False, None)
        assert (await leader_row(pg_url, migrated))["host_group"] is None
        await leader.release_leadership()

    async def enrolled() -> bool:
        return await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 1)

    # The released lock session ends on the server a moment after the release returns.
    await until(enrolled, "the enrolment once the standalone let go")
    # Again in the same group: nothing changes; in another group, or in another cluster
    # (an incarnation that is not the schema's now), nothing is enrolled.
    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 1)
    assert await enroll(engine, migrated, incarnation, "other") == Enrolment(True, None)
    assert await enroll(engine, migrated, incarnation + 1, GROUP) == Enrolment(True, None)
    assert (await leader_row(pg_url, migrated))["host_group"] == GROUP
    # Only the group it is in takes it out.
    assert await unenroll(engine, migrated, "other") is None
    assert (await leader_row(pg_url, migrated))["host_group"] == GROUP
    assert await unenroll(engine, migrated, GROUP) == 1
    assert (await leader_row(pg_url, migrated))["host_group"] is None


async def test_the_hosted_bump_takes_only_its_groups_cluster_and_the_standalone_none(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    async def bump(statement: Any, **params: Any) -> tuple[int | None, int]:
        async with engine.begin() as conn:
            pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one()
            return await run(conn, migrated, statement, **params), pid

    # A standalone cluster: the host's bump finds nothing, the standalone's bumps.
    assert (await bump(st.take_hosted_epoch, incarnation=incarnation, group=GROUP))[0] is None
    assert (await bump(st.take_epoch, incarnation=incarnation))[0] == 1

    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 1)
    # Enrolled: the standalone's bump finds nothing, nor the host's of another group or of
    # another cluster; the host of its group takes the next epoch and is recorded.
    assert (await bump(st.take_epoch, incarnation=incarnation))[0] is None
    assert (await bump(st.take_hosted_epoch, incarnation=incarnation, group="other"))[0] is None
    assert (await bump(st.take_hosted_epoch, incarnation=incarnation + 1, group=GROUP))[0] is None
    assert (await leader_row(pg_url, migrated))["epoch"] == 1
    epoch, pid = await bump(st.take_hosted_epoch, incarnation=incarnation, group=GROUP)
    assert epoch == 2
    row = await leader_row(pg_url, migrated)
    assert (row["epoch"], row["holder_epoch"], row["holder_pid"]) == (2, 2, pid)

    async with engine.connect() as conn:
        read = await conn.execute(st.leader_enrolment, execution_options=schema_options(migrated))
        assert tuple(read.one()) == (2, incarnation, GROUP)


async def test_a_downgrade_of_an_enrolled_cluster_is_refused_naming_its_group_and_forced_fences(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 0)
    before = head_revision()
    for target in ("0008_leader_history", "base"):
        refused = await cronoq("--schema", migrated, "downgrade", target, "--yes", url=pg_url)
        assert refused.returncode == ExitCode.FAILED, (target, refused.stderr)
        assert f"schema {migrated!r} is enrolled in host group 'default'" in refused.stderr
        assert "--force" in refused.stderr
    by_alembic = await python_run(
        "-m", "alembic", "-x", f"schema={migrated}", "downgrade", "-1", url=pg_url
    )
    assert by_alembic.returncode != 0
    assert "enrolled in host group 'default'" in by_alembic.stderr
    assert await revision_of(pg_url, migrated) == before
    assert (await leader_row(pg_url, migrated))["host_group"] == GROUP

    forced = await cronoq(
        "--schema", migrated, "downgrade", "0008_leader_history", "--yes", "--force", url=pg_url
    )
    assert forced.returncode == 0, forced.stderr
    assert await revision_of(pg_url, migrated) == "0008_leader_history"
    # The host is fenced: the epoch moved before the column went.
    rows = await admin_execute(pg_url, f'SELECT epoch FROM "{migrated}".cronoq_leader')
    assert rows[0]["epoch"] == 1


async def test_a_downgrade_of_a_standalone_cluster_is_not_refused_for_the_marker(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    """Enrolled and removed again: the cluster is standalone, and the guard lets it go."""
    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 0)
    assert await unenroll(engine, migrated, GROUP) == 0
    done = await cronoq(
        "--schema", migrated, "downgrade", "0008_leader_history", "--yes", url=pg_url
    )
    assert done.returncode == 0, done.stderr
    assert await revision_of(pg_url, migrated) == "0008_leader_history"
    # The marker is gone with its revision.
    with pytest.raises(asyncpg.UndefinedColumnError):
        await leader_row(pg_url, migrated)


async def test_the_offline_downgrade_script_stops_on_an_enrolled_cluster(
    pg_url: URL, engine: AsyncEngine, migrated: str, incarnation: int
) -> None:
    script = await cronoq(
        "--schema", migrated, "downgrade", "--sql", f"{head_revision()}:base", url=pg_url
    )
    assert script.returncode == 0, script.stderr
    assert await enroll(engine, migrated, incarnation, GROUP) == Enrolment(True, 0)
    with pytest.raises(asyncpg.ObjectInUseError, match="is enrolled in host group 'default'"):
        await run_script(pg_url, script.stdout)
    assert await revision_of(pg_url, migrated) == head_revision()
    assert await unenroll(engine, migrated, GROUP) == 0
    # Standalone again: the same script runs.
    await run_script(pg_url, script.stdout)
    rows = await admin_execute(
        pg_url, "SELECT tablename FROM pg_tables WHERE schemaname = $1", migrated
    )
    assert [r[0] for r in rows] == ["cronoq_alembic_version"]


async def run_script(url: URL, script: str) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.execute(script)
    finally:
        await conn.close()
