"""The store at run time needs rows, not DDL: it runs as a least-privileged role.

Two roles, as docs/reliability.md prescribes:

- the **owner** runs the migrations: it owns the cluster's schema and tables (it needs
  ``CREATE`` on the database once, to create the schema);
- the **runtime** role runs the store with ``migrate=False``: ``USAGE`` on the schema,
  ``SELECT, INSERT, UPDATE, DELETE`` on ``cronoq_tasks`` and ``cronoq_recurring``,
  ``SELECT, UPDATE`` on ``cronoq_leader``, ``SELECT`` on ``cronoq_alembic_version``, and
  nothing else: no DDL, no ownership, no superuser, never ``TRIGGER`` or ``CREATE`` on the
  schema (the owner's migrations refuse a schema where another role holds either);
- ``GRANT runtime TO owner``: the runtime role trusts a schema owned by a role that can act
  as it anyway (code the owner plants gains it nothing), and refuses any other owner.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._commit_path import COPY_MIN_ROWS, fold
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    IntervalSchedule,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskSpec,
    TaskStatus,
    task_id,
)
from cronoq_store._errors import MigrationError, StoreError
from cronoq_store._migrations import downgrade, upgrade
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import PROCESS_BASE


@dataclass(frozen=True)
class Roles:
    owner: URL
    runtime: URL


def runtime_grants(schema: str, role: str) -> list[str]:
    """Everything the runtime role is given (run by the owner)."""
    return [
        f'GRANT USAGE ON SCHEMA "{schema}" TO {role}',
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{schema}".cronoq_tasks, '
        f'"{schema}".cronoq_recurring TO {role}',
        f'GRANT SELECT, UPDATE ON "{schema}".cronoq_leader TO {role}',
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{schema}".cronoq_leader_history TO {role}',
        # Read by connect(migrate=False), which checks the revision instead of migrating.
        f'GRANT SELECT ON "{schema}".cronoq_alembic_version TO {role}',
    ]


@pytest.fixture
async def roles(pg_url: URL, schema: str) -> AsyncIterator[Roles]:
    """An owner that has migrated ``schema``, and a runtime role granted what it needs."""
    owner, runtime = f"{schema}_owner", f"{schema}_app"
    owner_pw, runtime_pw = secrets.token_urlsafe(18), secrets.token_urlsafe(18)
    database = pg_url.database or "postgres"
    try:
        await admin_execute(pg_url, f"CREATE ROLE {owner} LOGIN PASSWORD '{owner_pw}'")
    except asyncpg.InsufficientPrivilegeError:
        pytest.skip("needs a server where the suite may create roles")
    try:
        await admin_execute(pg_url, f"CREATE ROLE {runtime} LOGIN PASSWORD '{runtime_pw}'")
        # The database lets only the store's roles connect (docs/reliability.md).
        await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{database}" TO {owner}, {runtime}')
        await admin_execute(pg_url, f'GRANT CREATE ON DATABASE "{database}" TO {owner}')
        urls = Roles(
            owner=pg_url.set(username=owner, password=owner_pw),
            runtime=pg_url.set(username=runtime, password=runtime_pw),
        )
        engine = create_async_engine(async_url(urls.owner))
        try:
            await upgrade(engine, schema)
        finally:
            await engine.dispose()
        for grant in runtime_grants(schema, runtime):
            await admin_execute(urls.owner, grant)
        # The runtime role trusts the owner's schema only if the owner can act as it anyway.
        await admin_execute(pg_url, f"GRANT {runtime} TO {owner}")
        yield urls
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        for role in (runtime, owner):
            await admin_execute(pg_url, f"DROP OWNED BY {role}")
            await admin_execute(pg_url, f"DROP ROLE {role}")


def config(schema: str) -> PgStoreConfig:
    return PgStoreConfig(schema=schema, lock_poll=0.05, keepalive=0.2, session_timeout=1.0)


async def test_migrations_belong_to_the_owner_and_migrating_as_runtime_is_refused(
    roles: Roles, schema: str
) -> None:
    rows = await admin_execute(
        roles.owner,
        "SELECT n.nspowner::regrole::text, array_agg(DISTINCT c.relowner::regrole::text) "
        "FROM pg_namespace n JOIN pg_class c ON c.relnamespace = n.oid "
        "WHERE n.nspname = $1 GROUP BY 1",
        schema,
    )
    assert [(r[0], r[1]) for r in rows] == [(roles.owner.username, [roles.owner.username])]
    # At head, connect() has nothing to migrate: it reads the revision, as migrate=False
    # does, and needs no DDL right.
    async with await PgStore.connect(roles.runtime, config(schema)) as store:
        assert (await store.health()).at_head
    # Behind head, connect() migrates first, which the runtime role may not do: a clear,
    # final error.
    owner = create_async_engine(async_url(roles.owner))
    try:
        await downgrade(owner, schema, "-1")
    finally:
        await owner.dispose()
    with pytest.raises(StoreError) as info:
        await PgStore.connect(roles.runtime, config(schema))
    assert not info.value.is_transient
    # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists;
    # with it, the refusal of tables owned by another role would stop the migration next.
    assert "migrating schema" in str(info.value)
    assert "permission denied for database" in str(info.value)


async def test_every_store_operation_works_as_the_runtime_role(roles: Roles, schema: str) -> None:
    store = await PgStore.connect(roles.runtime, config(schema), migrate=False)
    try:
        epoch = await store.acquire_leadership()
        first, second = task_id(epoch, 0), task_id(epoch, 1)
        schedule = RecurringSpec(
            "nightly", IntervalSchedule(timedelta(hours=24)), TaskSpec(b"template")
        )
        await store.commit(
            epoch,
            PROCESS_BASE,
            [
                Submitted(first, 0, PROCESS_BASE.engine_ns, TaskSpec(b"one", key="k1")),
                Submitted(second, 1, PROCESS_BASE.engine_ns, TaskSpec(b"two")),
                StatusChanged(first, TaskStatus.RUNNING, 1, PROCESS_BASE.engine_ns),
                RecurringUpsert(schedule),
                RecurringNext("nightly", PROCESS_BASE.engine_ns, first),
            ],
            [],
        )
        await store.commit(
            epoch,
            PROCESS_BASE,
            [StatusChanged(first, TaskStatus.SUCCEEDED, 1, PROCESS_BASE.engine_ns, "done")],
            [(first, b"output")],
        )
        recovered = await store.recover(PROCESS_BASE)
        assert [t.id for t in recovered.tasks] == [second]
        assert [t.id for t in recovered.terminal] == [first]
        assert [r.spec.name for r in recovered.recurring] == ["nightly"]
        assert await store.load_output(first) == b"output"
        record = await store.get_task("k1")
        assert record is not None
        assert record.status is TaskStatus.SUCCEEDED
        assert [r.id for r in await store.list_finished()] == [first]
        await store.commit(epoch, PROCESS_BASE, [RecurringRemove("nightly")], [])
        large = [
            Submitted(task_id(epoch, n), n, PROCESS_BASE.engine_ns, TaskSpec(b"bulk"))
            for n in range(2, 2 + COPY_MIN_ROWS)
        ]
        await store.commit(epoch, PROCESS_BASE, large, [])  # by COPY
        assert len((await store.recover(PROCESS_BASE)).tasks) == 1 + COPY_MIN_ROWS
        assert await store.prune(0) == 1
        await store.release_leadership()
        assert await store.acquire_leadership() == epoch + 1
    finally:
        await store.close()


async def test_the_history_migration_grants_it_to_whoever_may_bump_the_epoch(
    roles: Roles, schema: str
) -> None:
    """A deployment granted before revision 0008 goes on taking over after the owner
    migrates: the migration gives the runtime role the history's rows, as it has the
    leader row's, and a reader of the leader row (here PUBLIC, as a console's reader) may
    read it; the owner grants nothing new."""
    await admin_execute(roles.owner, f'GRANT SELECT ON "{schema}".cronoq_leader TO PUBLIC')
    owner = create_async_engine(async_url(roles.owner))
    try:
        await downgrade(owner, schema, "0007_leader_holder")
        await upgrade(owner, schema)
    finally:
        await owner.dispose()
    async with await PgStore.connect(roles.runtime, config(schema), migrate=False) as store:
        epoch = await store.acquire_leadership()
    rows = await admin_execute(
        roles.owner, f'SELECT epoch, role FROM "{schema}".cronoq_leader_history'
    )
    assert [(r[0], r[1]) for r in rows] == [(epoch, roles.runtime.username)]
    trigger = await admin_execute(
        roles.owner,
        "SELECT has_table_privilege($1, $2, 'TRIGGER'), has_table_privilege($1, $2, 'DELETE')",
        roles.runtime.username,
        f'"{schema}".cronoq_leader_history',
    )
    assert tuple(trigger[0]) == (False, True)
    public = await admin_execute(
        roles.owner,
        "SELECT a.privilege_type FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a "
        "WHERE c.oid = $1::regclass AND a.grantee = 0",
        f'"{schema}".cronoq_leader_history',
    )
    assert [r[0] for r in public] == ["SELECT"]


async def test_the_runtime_role_cannot_change_the_schema(roles: Roles, schema: str) -> None:
    engine = create_async_engine(async_url(roles.runtime))
    try:
        for ddl in (
            f'CREATE TABLE "{schema}".planted (x int)',
            f'ALTER TABLE "{schema}".cronoq_tasks ADD COLUMN planted int',
            f'CREATE FUNCTION "{schema}".planted() RETURNS trigger LANGUAGE plpgsql '
            "AS $$ BEGIN RETURN NEW; END $$",
            f'TRUNCATE "{schema}".cronoq_tasks',
            f'DELETE FROM "{schema}".cronoq_leader',
        ):
            async with engine.connect() as conn:
                with pytest.raises(DBAPIError, match=r"permission denied|must be owner"):
                    await conn.execute(text(ddl))
    finally:
        await engine.dispose()


async def test_large_batches_need_no_temporary_privilege(
    roles: Roles, schema: str, pg_url: URL
) -> None:
    database = pg_url.database
    await admin_execute(pg_url, f'REVOKE TEMPORARY ON DATABASE "{database}" FROM PUBLIC')
    try:
        async with await PgStore.connect(roles.runtime, config(schema), migrate=False) as store:
            epoch = await store.acquire_leadership()
            large = [
                Submitted(task_id(epoch, n), n, PROCESS_BASE.engine_ns, TaskSpec(b"bulk"))
                for n in range(COPY_MIN_ROWS + 1)
            ]
            assert store._commits.writer.path(fold(large, PROCESS_BASE, 0)) == "copy"
            await store.commit(epoch, PROCESS_BASE, large, [])
            assert len((await store.recover(PROCESS_BASE)).tasks) == len(large)
    finally:
        await admin_execute(pg_url, f'GRANT TEMPORARY ON DATABASE "{database}" TO PUBLIC')


async def test_the_runtime_role_refuses_an_owner_that_cannot_act_as_it(
    roles: Roles, schema: str, pg_url: URL
) -> None:
    owner, runtime = roles.owner.username, roles.runtime.username
    await admin_execute(pg_url, f"REVOKE {runtime} FROM {owner}")
    with pytest.raises(MigrationError) as info:
        await PgStore.connect(roles.runtime, config(schema), migrate=False)
    assert f"schema {schema} owned by {owner}" in str(info.value)
    assert f"table {schema}.cronoq_tasks owned by {owner}" in str(info.value)


@pytest.mark.parametrize(
    "grant",
    [
        "TRIGGER ON {schema}.cronoq_tasks",
        "ALL ON {schema}.cronoq_leader",
        "CREATE ON SCHEMA {schema}",
    ],
)
async def test_the_owner_refuses_a_schema_where_the_runtime_role_could_plant_code(
    roles: Roles, schema: str, grant: str
) -> None:
    runtime = roles.runtime.username
    await admin_execute(roles.owner, f"GRANT {grant.format(schema=schema)} TO {runtime}")
    privilege = "CREATE" if "SCHEMA" in grant else "TRIGGER"
    with pytest.raises(MigrationError, match=f"{privilege} on .* granted to {runtime}"):
        await PgStore.connect(roles.owner, config(schema))
    # The runtime role itself is trusted by the runtime role: its own store still opens.
    async with await PgStore.connect(roles.runtime, config(schema), migrate=False) as store:
        assert await store.get_task(task_id(1, 0)) is None
