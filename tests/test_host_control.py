"""The host's control schema (issue 31): its migrations, refusals, and every statement the
host runs on it, against the real server.

Each test uses its own control schema (the ``schema`` fixture's name, dropped afterwards),
as a deployment may name its own instead of ``cronoq_host``.
"""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import Executable, Row
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from cronoq_store import LockHeldError, MigrationError
from cronoq_store import _statements as st
from cronoq_store._host import control as c
from cronoq_store._migrations import head_revision, run_command
from cronoq_store._migrations import script_location as cluster_scripts
from cronoq_store._urls import async_url

from .pgharness import admin_execute, asyncpg_dsn
from .support import ROOT, create_role, drop_role, python_run
from .waits import bounded


async def run(
    conn: AsyncConnection, control: str, statement: Executable, /, **params: Any
) -> list[Row[Any]]:
    """``statement`` on the control schema ``control``, its rows."""
    result = await conn.execute(statement, params, execution_options=c.control_options(control))
    return list(result.all()) if result.returns_rows else []


@pytest.fixture
async def control(engine: AsyncEngine, schema: str) -> str:
    """A control schema at head."""
    await c.prepare_control(engine, schema)
    return schema


async def tables_of(url: URL, schema: str) -> set[str]:
    rows = await admin_execute(
        url, "SELECT relname FROM pg_class WHERE relnamespace = to_regnamespace($1)", schema
    )
    return {r[0] for r in rows}


async def version_of(url: URL, schema: str) -> list[str]:
    rows = await admin_execute(url, f'SELECT version_num FROM "{schema}".{c.HOST_VERSION_TABLE}')
    return [r[0] for r in rows]


# --- migrations -------------------------------------------------------------------------


async def test_prepare_creates_the_schema_and_a_second_run_is_a_no_op(
    engine: AsyncEngine, schema: str, pg_url: URL
) -> None:
    await c.prepare_control(engine, schema)
    await c.prepare_control(engine, schema)
    assert {"processes", "clusters", "process_ids", c.HOST_VERSION_TABLE} <= await tables_of(
        pg_url, schema
    )
    assert await version_of(pg_url, schema) == [c.control_head()]
    rows = await admin_execute(
        pg_url,
        "SELECT data_type, maximum_value, cycle_option FROM information_schema.sequences "
        "WHERE sequence_schema = $1 AND sequence_name = 'process_ids'",
        schema,
    )
    assert [tuple(r) for r in rows] == [("integer", "2147483647", "NO")]


async def test_the_cluster_migrations_do_not_see_the_host_revisions() -> None:
    """Alembic reads ``<script_location>/versions`` only: the host's revisions live in
    ``host/versions`` and each directory sees its own."""
    cluster = {s.revision for s in ScriptDirectory(str(cluster_scripts())).walk_revisions()}
    host = {s.revision for s in ScriptDirectory(str(c.script_location())).walk_revisions()}
    assert c.script_location() == cluster_scripts() / "host"
    assert host == {"h0001_control", "h0002_moving"}
    assert not cluster & host
    assert head_revision() in cluster


def test_the_control_migrations_run_only_from_code(schema: str) -> None:
    """Alembic run on ``alembic/host`` without ``prepare_control``'s connection (its lock
    and trust checks) is refused."""
    config = Config()
    config.set_main_option("script_location", str(c.script_location()))
    config.attributes["schema"] = schema
    with pytest.raises(MigrationError, match="migrated from code"):
        run_command(command.upgrade, config, "head")


async def test_two_prepares_at_once_on_two_engines_both_succeed(
    engine: AsyncEngine, pg_url: URL, schema: str
) -> None:
    other = create_async_engine(async_url(pg_url))
    try:
        await asyncio.gather(c.prepare_control(engine, schema), c.prepare_control(other, schema))
    finally:
        await other.dispose()
    assert await version_of(pg_url, schema) == [c.control_head()]


async def test_prepares_in_two_processes_serialize_on_the_migration_lock(
    engine: AsyncEngine, pg_url: URL, schema: str
) -> None:
    """Held by a third session, the migration lock keeps a prepare here and one in another
    process waiting; let go, both finish, one of them having migrated."""
    holder = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await holder.execute(
            "SELECT pg_advisory_lock($1::int, hashtext($2))", st.LOCK_NS_MIGRATE, schema
        )
        here = asyncio.create_task(c.prepare_control(engine, schema))
        script = textwrap.dedent(
            f"""
            import asyncio, os
            from sqlalchemy.ext.asyncio import create_async_engine
            from cronoq_store._host.control import prepare_control
            from cronoq_store._urls import async_url

            async def main():
                engine = create_async_engine(async_url(os.environ["CRONOQ_DATABASE_URL"]))
                try:
                    await prepare_control(engine, {schema!r})
                finally:
                    await engine.dispose()

            asyncio.run(main())
            """
        )
        there = asyncio.create_task(python_run("-c", script, url=pg_url))
        for _ in range(300):
            waiting = await admin_execute(
                pg_url,
                "SELECT count(*) FROM pg_stat_activity WHERE pid NOT IN ($1, pg_backend_pid()) AND "
                "(query LIKE '%pg_try_advisory_xact_lock%' OR query LIKE '%pg_sleep%')",
                holder.get_server_pid(),
            )
            if waiting[0][0] >= 2:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the two prepares never both waited for the migration lock")
        assert not here.done()
        await holder.execute(
            "SELECT pg_advisory_unlock($1::int, hashtext($2))", st.LOCK_NS_MIGRATE, schema
        )
        await bounded(here, "the prepare in this process")
        done = await there
        assert done.returncode == 0, done.stderr
    finally:
        await holder.close()
    assert await version_of(pg_url, schema) == [c.control_head()]


async def test_a_prepare_at_head_takes_no_lock(
    engine: AsyncEngine, pg_url: URL, control: str, schema: str
) -> None:
    holder = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        lock = "SELECT pg_advisory_lock($1::int, hashtext($2))"
        await holder.execute(lock, st.LOCK_NS_MIGRATE, control)
        await c.prepare_control(engine, control, lock_timeout=1.0)
        # A schema that needs migrating does wait for that lock, and gives up at the bound
        # (the first one dropped: a database has one control schema).
        await admin_execute(pg_url, f'DROP SCHEMA "{control}" CASCADE')
        fresh = f"{schema}_fresh"
        await holder.execute(lock, st.LOCK_NS_MIGRATE, fresh)
        try:
            with pytest.raises(LockHeldError, match="migration lock of control schema"):
                await c.prepare_control(engine, fresh, lock_timeout=0.5)
        finally:
            await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
    finally:
        await holder.close()


@pytest.fixture
async def stranger(pg_url: URL, schema: str) -> AsyncIterator[str]:
    role = await create_role(pg_url, f"{schema}_stranger")
    try:
        yield role.name
    finally:
        await drop_role(pg_url, role.name)


async def test_a_control_schema_another_role_owns_is_refused(
    engine: AsyncEngine, pg_url: URL, schema: str, stranger: str
) -> None:
    await admin_execute(pg_url, f'CREATE SCHEMA "{schema}" AUTHORIZATION {stranger}')
    with pytest.raises(MigrationError, match=rf"schema {schema} owned by {stranger}"):
        await c.prepare_control(engine, schema)
    assert await tables_of(pg_url, schema) == set()


async def test_create_on_the_control_schema_for_another_role_is_refused(
    engine: AsyncEngine, pg_url: URL, control: str, stranger: str
) -> None:
    await admin_execute(pg_url, f'GRANT CREATE ON SCHEMA "{control}" TO {stranger}')
    with pytest.raises(MigrationError, match=rf"CREATE on schema {control} granted to {stranger}"):
        await c.prepare_control(engine, control)


async def test_a_trigger_on_a_control_table_is_refused(
    engine: AsyncEngine, pg_url: URL, control: str
) -> None:
    await admin_execute(
        pg_url,
        f'CREATE FUNCTION "{control}".noop() RETURNS trigger LANGUAGE plpgsql '
        "AS $$BEGIN RETURN NEW; END$$",
    )
    await admin_execute(
        pg_url,
        f'CREATE TRIGGER planted BEFORE UPDATE ON "{control}".clusters '
        f'FOR EACH ROW EXECUTE FUNCTION "{control}".noop()',
    )
    with pytest.raises(MigrationError, match=rf"trigger planted on {control}\.clusters"):
        await c.prepare_control(engine, control)


async def test_a_control_schema_a_newer_build_migrated_is_refused(
    engine: AsyncEngine, pg_url: URL, control: str
) -> None:
    await admin_execute(
        pg_url, f"UPDATE \"{control}\".{c.HOST_VERSION_TABLE} SET version_num = 'h9999_future'"
    )
    with pytest.raises(MigrationError, match=r"h9999_future.*upgrade cronoq-store"):
        await c.prepare_control(engine, control)


# --- statements ---------------------------------------------------------------------------


async def join(engine: AsyncEngine, schema: str, group: str = "g", instance: str = "i") -> int:
    """A process row as the host registers it (without its lock), its id."""
    async with engine.begin() as conn:
        (row,) = await run(conn, schema, c.next_process_id)
        await run(
            conn,
            schema,
            c.insert_process,
            process_id=row.process_id,
            group=group,
            instance=instance,
        )
    return int(row.process_id)


async def probe(engine: AsyncEngine, schema: str, ids: list[int]) -> list[int]:
    """The probe as the host runs it: in a transaction rolled back."""
    async with engine.connect() as conn:
        dead = [r.process_id for r in await run(conn, schema, c.probe_dead, ids=ids)]
        await conn.rollback()
    return dead


async def test_registration_records_the_session(
    engine: AsyncEngine, pg_url: URL, control: str
) -> None:
    first = await join(engine, control, instance="one")
    second = await join(engine, control, instance="two")
    assert second > first > 0
    rows = await admin_execute(
        pg_url,
        f"SELECT host_group, instance, backend_pid > 0, role = current_user, state, left_at "
        f'FROM "{control}".processes ORDER BY process_id',
    )
    assert [tuple(r) for r in rows] == [
        ("g", "one", True, True, "member", None),
        ("g", "two", True, True, "member", None),
    ]


async def test_the_probe_sees_a_lock_holder_alive_and_a_terminated_one_dead(
    engine: AsyncEngine, pg_url: URL, control: str
) -> None:
    me, other, never = [await join(engine, control) for _ in range(3)]
    lock = "SELECT pg_advisory_lock($1::int, $2::int)"
    mine = await asyncpg.connect(asyncpg_dsn(pg_url))
    holder = await asyncpg.connect(asyncpg_dsn(pg_url))
    try:
        await mine.execute(lock, c.LOCK_NS_HOST, me)
        await holder.execute(lock, c.LOCK_NS_HOST, other)
        assert await probe(engine, control, [other, never]) == [never]
        # Why the caller skips its own id: its own session's try on the lock it holds is
        # granted, which reads as dead.
        async with mine.transaction():
            found = await mine.fetch(
                "SELECT pg_try_advisory_xact_lock_shared($1::int, $2::int)", c.LOCK_NS_HOST, me
            )
            assert found[0][0] is True
        await admin_execute(pg_url, "SELECT pg_terminate_backend($1)", holder.get_server_pid())
        for _ in range(100):
            if await probe(engine, control, [other, never]) == [other, never]:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("a terminated holder's process never read as dead")
        # A try on a live process's key takes nothing: the holder is not disturbed.
        assert await probe(engine, control, [me]) == []
    finally:
        await mine.close()
        holder.terminate()


async def test_live_members_mark_left_and_orphans(engine: AsyncEngine, control: str) -> None:
    a, b = await join(engine, control), await join(engine, control)
    elsewhere = await join(engine, control, group="other")
    async with engine.begin() as conn:
        for name in ("s1", "s2", "s3"):
            await run(conn, control, c.enroll, group="g", schema=name, incarnation=7)
        await run(conn, control, c.set_owner, group="g", schema="s1", me=a, epoch=1)
        await run(conn, control, c.set_owner, group="g", schema="s2", me=b, epoch=1)
        members = await run(conn, control, c.live_members, group="g")
        assert [tuple(r) for r in members] == [(a, "member"), (b, "member")]
        assert [r.process_id for r in await run(conn, control, c.mark_left, ids=[b])] == [b]
        assert await run(conn, control, c.mark_left, ids=[b]) == []
        orphaned = await run(conn, control, c.orphan_clusters, ids=[b])
        assert [tuple(r) for r in orphaned] == [("g", "s2")]
        members = await run(conn, control, c.live_members, group="g")
        assert [r.process_id for r in members] == [a]
        counts = await run(conn, control, c.owner_counts, group="g")
        assert [tuple(r) for r in counts] == [(None, 2), (a, 1)]
        others = await run(conn, control, c.live_members, group="other")
        assert [r.process_id for r in others] == [elsewhere]


async def test_claimable_skips_rows_another_transaction_locked(
    engine: AsyncEngine, control: str
) -> None:
    async with engine.begin() as conn:
        for name in ("a", "b", "c", "d"):
            await run(conn, control, c.enroll, group="g", schema=name, incarnation=7)
        await run(conn, control, c.set_owner, group="g", schema="d", me=99, epoch=3)
        await run(conn, control, c.release_cluster, group="g", schema="d", me=5)
    async with engine.connect() as first, engine.connect() as second:
        taken = await run(first, control, c.claimable, group="g", dead=[], limit=1)
        assert [r.schema_name for r in taken] == ["a"]
        rest = await run(second, control, c.claimable, group="g", dead=[], limit=10)
        assert [r.schema_name for r in rest] == ["b", "c"]
        await second.rollback()
        with_dead = await run(second, control, c.claimable, group="g", dead=[99], limit=10)
        assert [(r.schema_name, r.owner) for r in with_dead] == [
            ("b", None),
            ("c", None),
            ("d", 99),
        ]
        await first.rollback()
        await second.rollback()


async def test_owned_digest_changes_with_owner_and_epoch(engine: AsyncEngine, control: str) -> None:
    async with engine.begin() as conn:

        async def digest(me: int) -> tuple[int, int]:
            (row,) = await run(conn, control, c.owned_digest, group="g", me=me)
            return (row.clusters, row.epochs)

        assert await digest(1) == (0, 0)
        for name in ("a", "b"):
            await run(conn, control, c.enroll, group="g", schema=name, incarnation=7)
            await run(conn, control, c.set_owner, group="g", schema=name, me=1, epoch=5)
        both = await digest(1)
        assert both[0] == 2
        await run(conn, control, c.set_owner, group="g", schema="a", me=1, epoch=6)
        bumped = await digest(1)
        assert bumped[0] == 2
        assert bumped != both
        await run(conn, control, c.set_owner, group="g", schema="b", me=2, epoch=7)
        moved = await digest(1)
        assert moved[0] == 1
        assert moved not in (both, bumped)
        owned = await run(conn, control, c.owned_by, group="g", me=1)
        assert [(r.schema_name, r.epoch, r.incarnation) for r in owned] == [("a", 6, 7)]
        # Only the owner releases, and the release says whether it did.
        assert await run(conn, control, c.release_cluster, group="g", schema="b", me=1) == []
        released = await run(conn, control, c.release_cluster, group="g", schema="b", me=2)
        assert [r.schema_name for r in released] == ["b"]
        assert await digest(2) == (0, 0)


async def test_a_control_schema_of_the_first_revision_is_upgraded_with_its_rows(
    engine: AsyncEngine, pg_url: URL, control: str
) -> None:
    """A control schema that a build before ``h0002_moving`` made: put back as ``h0001``
    left it (its state check, its version), with a cluster enrolled. ``prepare_control``
    brings it to head, the row kept, and a move may mark it ``moving``."""
    table = f'"{control}".clusters'
    await admin_execute(pg_url, f"ALTER TABLE {table} DROP CONSTRAINT ck_clusters_state")
    await admin_execute(
        pg_url,
        f"ALTER TABLE {table} ADD CONSTRAINT ck_clusters_state "
        "CHECK (state IN ('active', 'refused'))",
    )
    await admin_execute(
        pg_url, f'UPDATE "{control}".{c.HOST_VERSION_TABLE} SET version_num = $1', "h0001_control"
    )
    async with engine.begin() as conn:
        await run(conn, control, c.enroll, group="g", schema="s", incarnation=41)
    await c.prepare_control(engine, control)
    assert await version_of(pg_url, control) == [c.control_head()]
    await admin_execute(pg_url, f"UPDATE {table} SET state = 'moving' WHERE schema_name = 's'")
    rows = await admin_execute(pg_url, f"SELECT schema_name, incarnation, state FROM {table}")
    assert [tuple(r) for r in rows] == [("s", 41, "moving")]


async def test_enrol_remove_and_refuse(engine: AsyncEngine, control: str) -> None:
    async with engine.begin() as conn:

        async def enrol(group: str, incarnation: int) -> tuple[bool, str, int]:
            (row,) = await run(
                conn, control, c.enroll, group=group, schema="s", incarnation=incarnation
            )
            return (row.inserted, row.host_group, row.incarnation)

        assert await enrol("g", 41) == (True, "g", 41)
        assert await enrol("g", 42) == (False, "g", 41)
        assert await enrol("h", 43) == (False, "g", 41)
        listed = await run(conn, control, c.enrolled, group="g")
        assert [tuple(r) for r in listed] == [("s", 41, None, None, "active")]
        await run(conn, control, c.mark_refused, group="g", schema="s", why="planted")
        assert await run(conn, control, c.owner_counts, group="g") == []
        listed = await run(conn, control, c.enrolled, group="g")
        assert [r.state for r in listed] == ["refused"]
        await run(conn, control, c.mark_active, group="g", schema="s")
        counts = await run(conn, control, c.owner_counts, group="g")
        assert [tuple(r) for r in counts] == [(None, 1)]
        await run(conn, control, c.set_owner, group="g", schema="s", me=3, epoch=1)
        removed = await run(conn, control, c.remove, group="g", schema="s")
        assert [tuple(r) for r in removed] == [("s", 3)]
        assert await run(conn, control, c.enrolled, group="g") == []


@pytest.mark.parametrize("table", sorted(c.metadata.tables))
def test_the_storage_format_documents_every_control_column(table: str) -> None:
    """docs/storage-format.md's "Control schema" is what another program reading the
    control tables relies on: a column added without its row there fails here."""
    text = (ROOT / "docs" / "storage-format.md").read_text()
    control = text[text.index("## Control schema") :]
    assert f"### `{table}`" in control
    undocumented = [
        col.name for col in c.metadata.tables[table].columns if f"`{col.name}`" not in control
    ]
    assert undocumented == []
