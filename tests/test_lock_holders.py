"""Who holds the leader lock, against a real server with real roles.

Any role that can connect can take the leader's advisory lock (``pg_locks`` shows the keys to
everyone). Such a holder is never reported as a leader: ``PgStore.health()``, ``cronoq-store
health`` (exit 7) and ``status`` name it, and a standby waiting behind it warns, rate-limited.
A store refuses to lead where ``PUBLIC`` or a login role it does not trust has ``CONNECT``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import URL

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store._cli import ExitCode
from cronoq_store._errors import MigrationError

from .pgharness import admin_execute, asyncpg_dsn
from .support import Role, create_role, drop_role, leadership_of, named_config, run_cli
from .waits import bounded, holds_for, until, until_value

FORGED = "cronoq-store leader"


async def take_lock(url: URL, key: tuple[int, int]) -> asyncpg.Connection:
    """A session that takes the leader lock as any client can, with a forged name."""
    conn = await asyncpg.connect(asyncpg_dsn(url), server_settings={"application_name": FORGED})
    assert await conn.fetchval("SELECT pg_try_advisory_lock($1, $2)", *key)
    return conn


async def assert_reported_foreign(
    store: PgStore, pg_url: URL, schema: str, pid: int, role: str
) -> None:
    """Every view names the holder and none calls it the leader."""
    health = await store.health()
    assert not health.has_leader
    foreign = health.foreign_holder
    assert foreign is not None
    assert (foreign.pid, foreign.role, foreign.application_name) == (pid, role, FORGED)
    assert not foreign.store_instance
    assert foreign.since is not None

    result = await run_cli(pg_url, schema, "health")
    assert result.exit_code == ExitCode.FOREIGN_HOLDER, result.output
    assert "healthy:" not in result.output.replace("unhealthy:", "")
    assert f"backend pid {pid}, role {role!r}, application_name {FORGED!r}" in result.output
    assert "not a store instance" in result.output
    assert re.search(r"session since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", result.output)

    document = json.loads((await run_cli(pg_url, schema, "health", "--json")).output)
    assert document["healthy"] is False
    assert document["leader"] is None
    assert document["lock_holder"]["pid"] == pid
    assert document["lock_holder"]["role"] == role
    assert document["lock_holder"]["store_instance"] is False

    status = await run_cli(pg_url, schema, "status")
    assert status.exit_code == 0, status.output
    assert re.search(r"^leader\s+none: ", status.output, re.MULTILINE), status.output
    assert f"backend pid {pid}, role {role!r}" in status.output
    assert "not a store instance" in status.output
    status_doc = json.loads((await run_cli(pg_url, schema, "status", "--json")).output)
    assert status_doc["leader"] is None
    assert status_doc["lock_holder"]["pid"] == pid


async def test_a_role_with_only_connect_holding_the_lock_is_named_never_a_leader(
    pg_url: URL, migrated: str, intruder: Role
) -> None:
    trusting = named_config(migrated, "holders-a", trusted_roles=frozenset({intruder.name}))
    async with await PgStore.connect(pg_url, trusting) as store:
        held = await take_lock(intruder.url, store.leader_lock)
        try:
            pid = held.get_server_pid()
            await assert_reported_foreign(store, pg_url, migrated, pid, intruder.name)
        finally:
            await held.close()
        # Once it lets go, an instance leads and is reported healthy.
        epoch = await bounded(store.acquire_leadership(), "leadership once the holder let go")
        health = await store.health()
        assert health.has_leader
        assert health.holder is not None
        assert health.holder.store_instance
        result = await run_cli(pg_url, migrated, "health")
        assert result.exit_code == ExitCode.OK, result.output
        assert f"epoch {epoch}" in result.output


async def test_a_session_of_the_stores_own_role_that_never_moved_the_epoch_is_foreign(
    pg_url: URL, migrated: str
) -> None:
    """The same role as the store (so its role is trusted), holding the lock after a
    genuine leader let go: the leader row records the leader's session, not this one."""
    async with await PgStore.connect(pg_url, named_config(migrated, "holders-b")) as store:
        await store.acquire_leadership()
        assert (await store.health()).has_leader
        await store.release_leadership()
        held = await take_lock(pg_url, store.leader_lock)
        try:
            await assert_reported_foreign(
                store, pg_url, migrated, held.get_server_pid(), pg_url.username or ""
            )
        finally:
            await held.close()


async def test_a_genuine_leader_is_healthy_right_after_a_takeover(
    pg_url: URL, migrated: str
) -> None:
    async with (
        await PgStore.connect(pg_url, named_config(migrated, "holders-c")) as a,
        await PgStore.connect(pg_url, named_config(migrated, "holders-d")) as b,
    ):
        first = await a.acquire_leadership()
        standby = asyncio.ensure_future(b.acquire_leadership())
        await holds_for(lambda: not standby.done(), "b waiting while a leads", 0.3)
        assert (await b.health()).has_leader  # a leads; b waits without warning
        await a.release_leadership()
        assert await bounded(standby, "b's takeover") == first + 1
        for store in (a, b):
            health = await store.health()
            assert health.has_leader
            assert health.holder is not None
            assert health.holder.application_name == f"holders-d leader {health.holder.instance}"
            assert health.holder.store_instance
            assert health.foreign_holder is None
        result = await run_cli(pg_url, migrated, "health")
        assert result.exit_code == ExitCode.OK, result.output
        assert "holders-d leader " in result.output


async def test_a_takeover_waiting_to_move_the_epoch_is_not_reported_foreign(
    pg_url: URL, migrated: str
) -> None:
    """Between taking the lock and committing its epoch, a new leader waits for the old
    leader's commits (here: a transaction holding the leader row FOR SHARE): it holds the
    lock and the row does not record it yet, and it is still no intruder."""
    async with (
        await PgStore.connect(pg_url, named_config(migrated, "holders-e")) as a,
        await PgStore.connect(pg_url, named_config(migrated, "holders-f")) as b,
    ):
        first = await a.acquire_leadership()
        in_flight = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            transaction = in_flight.transaction()
            await transaction.start()
            await in_flight.execute(
                f'SELECT epoch FROM "{migrated}".cronoq_leader WHERE id = 1 FOR SHARE'
            )
            await a.release_leadership()
            taking_over = asyncio.ensure_future(b.acquire_leadership())
            rows = await until_value(
                lambda: admin_execute(
                    pg_url,
                    "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid "
                    "WHERE starts_with(a.application_name, 'holders-f leader ') "
                    "AND NOT l.granted",
                ),
                bool,
                "the takeover waiting for the leader row",
            )
            health = await a.health()
            assert health.holder is not None
            assert health.holder.pid == rows[0][0]
            assert health.holder.store_instance
            assert health.has_leader
            result = await run_cli(pg_url, migrated, "health")
            assert result.exit_code == ExitCode.OK, result.output
            assert not taking_over.done()
            await transaction.rollback()
        finally:
            await in_flight.close()
        assert await bounded(taking_over, "the takeover once the row is free") == first + 1


async def test_a_standby_behind_a_foreign_holder_warns_once_naming_it(
    pg_url: URL, migrated: str, intruder: Role, caplog: pytest.LogCaptureFixture
) -> None:
    """The standby's lock session runs as a lock role with the least it needs (``SELECT,
    UPDATE`` on the leader row, the rows of the leadership history): looking at the holder
    needs no more."""
    lock = await create_role(pg_url, f"{migrated}_lock")
    for grant in (
        f"USAGE ON SCHEMA {migrated}",
        f"SELECT, UPDATE ON {migrated}.cronoq_leader",
        f"SELECT, INSERT, UPDATE, DELETE ON {migrated}.cronoq_leader_history",
    ):
        await admin_execute(pg_url, f"GRANT {grant} TO {lock.name}")
    try:
        await standby_warns_once(pg_url, migrated, intruder, lock, caplog)
    finally:
        await drop_role(pg_url, lock.name)


async def standby_warns_once(
    pg_url: URL, migrated: str, intruder: Role, lock: Role, caplog: pytest.LogCaptureFixture
) -> None:
    trusting = named_config(migrated, "holders-g", trusted_roles=frozenset({intruder.name}))
    async with await PgStore.connect(pg_url, trusting, lock_url=lock.url) as store:
        looks = 0
        look = leadership_of(store)._watch_holder

        async def counted(*args: Any) -> int | None:
            nonlocal looks
            looks += 1
            return await look(*args)

        leadership_of(store)._watch_holder = counted  # type: ignore[method-assign,assignment]
        held = await take_lock(intruder.url, store.leader_lock)
        try:
            with caplog.at_level(logging.WARNING, logger="cronoq_store"):
                waiting = asyncio.ensure_future(store.acquire_leadership())
                await until(lambda: looks >= 6 or waiting.done(), "six looks at the holder")
                assert not waiting.done()
            warnings = [r for r in caplog.records if "not a store instance" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
            (warning,) = warnings
            assert warning.levelno == logging.WARNING
            assert str(held.get_server_pid()) in warning.getMessage()
            assert vars(warning)["holder_pid"] == held.get_server_pid()
            assert vars(warning)["holder_role"] == intruder.name
            assert vars(warning)["holder_application_name"] == FORGED
        finally:
            await held.close()
        assert await bounded(waiting, "leadership once the holder let go") == 1


# --- what the store requires of the database ---------------------------------------------


async def test_leading_is_refused_while_public_may_connect(pg_url: URL, migrated: str) -> None:
    database = pg_url.database
    await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{database}" TO PUBLIC')
    try:
        async with await PgStore.connect(pg_url, named_config(migrated, "holders-h")) as store:
            with pytest.raises(MigrationError) as info:
                await bounded(store.acquire_leadership(), "the acquisition")
            assert not info.value.is_transient
            message = str(info.value)
            assert "CONNECT is granted to PUBLIC" in message
            assert f'REVOKE CONNECT ON DATABASE "{database}" FROM PUBLIC' in message
            assert "trusted_roles" in message
            assert not store.is_leader
            health = await store.health()
            assert (health.holder, health.stored_epoch) == (None, 0)
            assert health.untrusted_connect == ("PUBLIC",)
            result = await run_cli(pg_url, migrated, "health")
            assert result.exit_code == ExitCode.NO_LEADER, result.output
            assert "warning: every role may connect to this database" in result.output
            doc = json.loads((await run_cli(pg_url, migrated, "health", "--json")).output)
            assert len(doc["warnings"]) == 1
            assert "PUBLIC" in doc["warnings"][0]
    finally:
        await admin_execute(pg_url, f'REVOKE CONNECT ON DATABASE "{database}" FROM PUBLIC')


async def test_leading_is_refused_while_an_untrusted_login_role_may_connect(
    pg_url: URL, migrated: str, intruder: Role
) -> None:
    async with await PgStore.connect(pg_url, named_config(migrated, "holders-i")) as store:
        with pytest.raises(MigrationError, match=f"CONNECT is granted to {intruder.name}\\."):
            await bounded(store.acquire_leadership(), "the acquisition")
        health = await store.health()
        assert (health.stored_epoch, health.untrusted_connect) == (0, (intruder.name,))
    # Named by the operator, it is trusted to connect.
    trusting = named_config(migrated, "holders-j", trusted_roles=frozenset({intruder.name}))
    async with await PgStore.connect(pg_url, trusting) as store:
        assert await bounded(store.acquire_leadership(), "the acquisition") == 1
        assert (await store.health()).untrusted_connect == ()


async def test_connect_through_a_group_role_counts_and_nologin_roles_do_not(
    pg_url: URL, migrated: str, schema: str
) -> None:
    group, member = f"{schema}_group", f"{schema}_member"
    await admin_execute(pg_url, f"CREATE ROLE {group} NOLOGIN")
    try:
        await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{pg_url.database}" TO {group}')
        async with await PgStore.connect(pg_url, named_config(migrated, "holders-k")) as store:
            # A role that cannot log in cannot hold a lock.
            assert await bounded(store.acquire_leadership(), "the acquisition") == 1
            await store.release_leadership()
            await create_role(pg_url, member, connect=False)
            try:
                await admin_execute(pg_url, f"GRANT {group} TO {member}")
                with pytest.raises(MigrationError, match=f"CONNECT is granted to {member}\\."):
                    await bounded(store.acquire_leadership(), "the acquisition")
            finally:
                await drop_role(pg_url, member)
    finally:
        await drop_role(pg_url, group)


async def test_allow_untrusted_connect_leads_and_says_so(
    pg_url: URL, migrated: str, intruder: Role, caplog: pytest.LogCaptureFixture
) -> None:
    lax = named_config(migrated, "holders-l", allow_untrusted_connect=True)
    async with await PgStore.connect(pg_url, lax) as store:
        with caplog.at_level(logging.WARNING, logger="cronoq_store"):
            assert await bounded(store.acquire_leadership(), "the acquisition") == 1
    (warning,) = [r for r in caplog.records if "allow_untrusted_connect" in r.getMessage()]
    assert vars(warning)["roles"] == [intruder.name]


@pytest.mark.parametrize("names", ["monitor", [""], ["a\x00b"], ["x" * 64], [7]], ids=repr)
def test_trusted_roles_must_be_role_names(names: object) -> None:
    with pytest.raises(ValueError, match="trusted_roles"):
        PgStoreConfig(trusted_roles=names)  # type: ignore[arg-type]


async def test_an_epoch_taken_by_an_older_build_leaves_its_holder_unknown_not_foreign(
    pg_url: URL, migrated: str
) -> None:
    """Mid rolling upgrade, a build before revision 0007 takes the epoch without recording
    its session: its holder cannot be told from an intruder, and is not called foreign."""
    async with await PgStore.connect(pg_url, named_config(migrated, "holders-m")) as store:
        epoch = await store.acquire_leadership()
        await store.release_leadership()
        older = await take_lock(pg_url, store.leader_lock)
        try:
            assert (await store.health()).foreign_holder is not None  # took no epoch yet
            await older.execute(
                f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1 WHERE id = 1'
            )
            health = await store.health()
            assert health.stored_epoch == epoch + 1
            assert health.holder is not None
            assert health.holder.pid == older.get_server_pid()
            assert health.has_leader
        finally:
            await older.close()


async def test_a_role_that_may_not_write_the_leader_row_cannot_pass_for_a_takeover(
    pg_url: URL, migrated: str, intruder: Role
) -> None:
    """PostgreSQL locks a table for an UPDATE when it parses it and checks privileges only
    when it runs it: ``PREPARE ... AS UPDATE`` in an open transaction keeps the lock a
    takeover holds. A monitoring role (USAGE, SELECT) holding the leader lock and that one
    still took no epoch, and is named foreign."""
    for grant in (f"USAGE ON SCHEMA {migrated}", f"SELECT ON {migrated}.cronoq_leader"):
        await admin_execute(pg_url, f"GRANT {grant} TO {intruder.name}")
    trusting = named_config(migrated, "holders-n", trusted_roles=frozenset({intruder.name}))
    async with await PgStore.connect(pg_url, trusting) as store:
        held = await take_lock(intruder.url, store.leader_lock)
        try:
            transaction = held.transaction()
            await transaction.start()
            await held.execute(
                f'PREPARE forged AS UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1'
            )
            locks = await admin_execute(
                pg_url,
                "SELECT mode FROM pg_locks WHERE pid = $1 AND relation = $2::regclass",
                held.get_server_pid(),
                f"{migrated}.cronoq_leader",
            )
            assert [r["mode"] for r in locks] == ["RowExclusiveLock"]
            health = await store.health()
            assert health.foreign_holder is not None
            assert health.foreign_holder.pid == held.get_server_pid()
        finally:
            await held.close()


async def test_health_names_a_foreign_holder_with_a_session_timeout_shorter_than_its_second_look(
    pg_url: URL, migrated: str
) -> None:
    """``health`` reads a holder that is not a store instance again after TAKEOVER_GRACE
    (0.5 s), in one transaction: a read, whose idle limit is the store's own, not a
    ``session_timeout`` of 0.3 s."""
    short = dataclasses.replace(
        named_config(migrated, "health-short"), session_timeout=0.3, keepalive=0.1
    )
    async with await PgStore.connect(pg_url, short) as store:
        holder = await take_lock(pg_url, store.leader_lock)
        try:
            foreign = (await store.health()).foreign_holder
            assert foreign is not None
            assert foreign.pid == await holder.fetchval("SELECT pg_backend_pid()")
        finally:
            await holder.close()
