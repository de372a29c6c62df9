"""What a host refuses before it does anything: a database that refuses this process (not
one that is down) or is not encoded in UTF8, an application's engine whose sessions could
not carry the host's lock, and work asked of a host already closed."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import MigrationError, MultiDatabaseHost, PgStore, PgStoreConfig, StoreError
from cronoq_store._errors import UnsupportedParameterError
from cronoq_store._host import control
from cronoq_store._host.host import PgHost
from cronoq_store._urls import async_url

from ..pgharness import admin_execute
from .conftest import Fleet
from .hosts import config


async def sessions_named(fleet: Fleet, name: str) -> int:
    rows = await admin_execute(
        fleet.url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
        "AND pid <> pg_backend_pid()",
        name,
    )
    return int(rows[0][0])


async def test_a_database_that_refuses_the_process_is_raised_not_retried(fleet: Fleet) -> None:
    """A down database is tried again; one that refuses (a wrong password, a control schema
    a newer build migrated) only an operator mends, so connect raises what PgHost's does."""
    wrong = fleet.url.set(password="not-the-password")
    with pytest.raises(StoreError) as single:
        await PgHost.connect(wrong, config(fleet, "wrong"))
    with pytest.raises(StoreError) as multi:
        await MultiDatabaseHost.connect({"east": wrong}, config(fleet, "wrong"))
    assert type(multi.value) is type(single.value)
    assert "not-the-password" not in str(multi.value)
    async with await PgHost.connect(fleet.url, config(fleet, "made")):
        pass
    await admin_execute(
        fleet.url,
        f"UPDATE \"{fleet.control}\".{control.HOST_VERSION_TABLE} SET version_num = 'h9999_x'",
    )
    with pytest.raises(MigrationError, match="h9999_x"):
        await MultiDatabaseHost.connect({"east": fleet.url}, config(fleet, "newer"))


async def test_a_closed_host_enrolls_nothing_and_leaves_no_session(fleet: Fleet) -> None:
    """A closed host's pool is disposed: an enrolment then would open a new one, which no
    one closes, and enroll a cluster no process of this host will lead. Serving would
    return at once, leading nothing: it says why instead."""
    (schema,) = fleet.clusters(1)

    async def lead(*_: object) -> None:
        raise AssertionError("a closed host leads nothing")

    multi = await MultiDatabaseHost.connect({"east": fleet.url}, config(fleet, "closed"))
    await multi.close()
    with pytest.raises(StoreError, match="closed"):
        await multi.enroll(schema, "east")
    with pytest.raises(StoreError, match="closed"):
        await multi.serve(lead)
    single = await PgHost.connect(fleet.url, config(fleet, "closed"))
    await single.close()
    with pytest.raises(StoreError, match="closed"):
        await single.enroll(schema)
    with pytest.raises(StoreError, match="closed"):
        await single.remove(schema)
    with pytest.raises(StoreError, match="closed"):
        await single.serve(lead)
    assert await sessions_named(fleet, "closed") == 0
    enrolled = await admin_execute(
        fleet.url, f'SELECT 1 FROM "{fleet.control}".clusters WHERE schema_name = $1', schema
    )
    assert enrolled == []


async def test_an_engine_whose_sessions_cannot_hold_the_hosts_lock_is_refused(
    fleet: Fleet,
) -> None:
    """As for PgStore.from_engine: without prepared statements (a transaction-pooling
    PgBouncer) the host session, which holds the lock every hosted cluster's fence rests
    on, needs a direct lock_url; a ``service`` asyncpg would ignore dials elsewhere."""
    cfg = config(fleet, "pooled")
    pooled = replace(cfg, store=replace(cfg.store, prepared_statements=False))
    app = create_async_engine(async_url(fleet.url), pool_size=1, max_overflow=0)
    elsewhere = create_async_engine(
        async_url(fleet.url).update_query_dict({"service": "elsewhere"}), pool_size=1
    )
    try:
        with pytest.raises(ValueError, match="lock_url"):
            await PgHost.from_engine(app, pooled)
        with pytest.raises(UnsupportedParameterError):
            await PgStore.from_engine(elsewhere, PgStoreConfig(schema=f"{fleet.prefix}_s"))
        with pytest.raises(UnsupportedParameterError):
            await PgHost.from_engine(elsewhere, cfg)
    finally:
        await app.dispose()
        await elsewhere.dispose()


async def test_a_database_not_encoded_in_utf8_is_refused_before_the_control_schema(
    fleet: Fleet,
) -> None:
    """As a store refuses one: in LATIN1 a hosted cluster could store no task named '日本'.
    Neither opening makes the control schema there, nor leaves a session behind."""
    name = f"{fleet.prefix}_latin1"
    await admin_execute(
        fleet.url,
        f"CREATE DATABASE {name} ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    latin1 = fleet.url.set(database=name)
    app = create_async_engine(async_url(latin1), pool_size=1, max_overflow=0)
    try:
        with pytest.raises(StoreError, match="encoded in LATIN1: cronoq-store needs a UTF8"):
            await PgHost.connect(latin1, config(fleet, "latin1"))
        with pytest.raises(StoreError, match="encoded in LATIN1: cronoq-store needs a UTF8"):
            await PgHost.from_engine(app, config(fleet, "latin1"))
        with pytest.raises(StoreError, match="LATIN1"):
            await MultiDatabaseHost.connect({"west": latin1}, config(fleet, "latin1"))
        rows = await admin_execute(
            latin1, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", fleet.control
        )
        assert rows[0][0] == 0
    finally:
        await app.dispose()
        await admin_execute(fleet.url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
