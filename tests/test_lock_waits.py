"""A held lock is named, and no wait is silent: against a real server, with real sessions
holding the locks the store waits for.

Any role that may connect can take a schema's migration lock (``pg_advisory_lock(0x63726f6d,
hashtext(schema))``) or hold the cluster's tables or leader row in an open transaction.
Opening a store on a schema at head takes no lock at all. A wait that is not the call's
purpose (opening a store on a schema behind head, migrating, pruning, a command) says whom it
waits for and gives up after its bound with ``LockHeldError`` (exit 9) naming them; a wait
that is (a standby's, a takeover's) goes on, saying why. ``health`` and ``status`` name the
migration lock's holder.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import LockHeldError, PgStore
from cronoq_store._cli import ExitCode
from cronoq_store._migrations import head_revision, upgrade
from cronoq_store._statements import LOCK_NS_MIGRATE

from .pgharness import admin_execute, asyncpg_dsn
from .support import (
    LeaderRowHold,
    Role,
    full,
    named_config,
    older_revisions,
    python_run,
    revision_of,
    run,
    run_cli,
)
from .waits import PATIENCE, bounded, holds_for, until_value

#: A revision below head whose upgrade changes the cluster's tables.
BEHIND = list(older_revisions())[-1]
APP = "cronoq-intruder"


@asynccontextmanager
async def session_of(role: Role) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(asyncpg_dsn(role.url), server_settings={"application_name": APP})
    try:
        yield conn
    finally:
        await conn.close()


async def hold_migration_lock(conn: asyncpg.Connection, schema: str) -> None:
    """What any role that may connect can do, for as long as its session lasts."""
    await conn.execute("SELECT pg_advisory_lock($1, hashtext($2))", LOCK_NS_MIGRATE, schema)


# --- the migration lock ----------------------------------------------------------------------


async def test_a_schema_at_head_opens_whoever_holds_its_migration_lock_and_health_names_them(
    pg_url: URL, migrated: str, intruder: Role
) -> None:
    async with session_of(intruder) as held:
        await hold_migration_lock(held, migrated)
        pid = held.get_server_pid()
        opening = PgStore.connect(pg_url, named_config(migrated, "waits-a"))
        async with await bounded(opening, "opening beside a held migration lock") as store:
            await bounded(store.migrate(), "migrating beside a held migration lock")
            seen = (await store.health()).migration_lock
            assert seen is not None
            assert (seen.pid, seen.role, seen.application_name) == (pid, intruder.name, APP)

        health = await run_cli(pg_url, migrated, "health")
        assert health.exit_code == ExitCode.NO_LEADER, health.output
        assert f"warning: the migration lock is held by backend pid {pid}, role " in health.stdout
        assert f"application_name {APP!r}" in health.stdout
        document = json.loads((await run_cli(pg_url, migrated, "health", "--json")).stdout)
        assert document["migration_lock"]["pid"] == pid
        assert document["migration_lock"]["role"] == intruder.name
        assert any("migration lock" in w for w in document["warnings"])

        status = await run_cli(pg_url, migrated, "status")
        assert status.exit_code == 0, status.output
        assert f"the migration lock is held by backend pid {pid}" in status.stdout
        status_doc = json.loads((await run_cli(pg_url, migrated, "status", "--json")).stdout)
        assert status_doc["migration_lock"]["application_name"] == APP

        migrate = await run_cli(pg_url, migrated, "migrate")
        assert migrate.exit_code == 0, migrate.output
        assert "already at" in migrate.stdout


async def test_a_schema_behind_head_waits_saying_who_holds_the_lock_then_gives_up(
    engine: AsyncEngine,
    pg_url: URL,
    schema: str,
    intruder: Role,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await upgrade(engine, schema, BEHIND)
    async with session_of(intruder) as held:
        await hold_migration_lock(held, schema)
        pid = held.get_server_pid()
        limited = named_config(schema, "waits-b", migration_lock_timeout=2.0)
        with (
            caplog.at_level(logging.INFO, logger="cronoq_store"),
            pytest.raises(LockHeldError) as refused,
        ):
            await bounded(PgStore.connect(pg_url, limited), "opening giving up")
        message = str(refused.value)
        assert f"the migration lock of schema {schema!r} after 2 s" in message
        assert f"pid {pid} (role {intruder.name!r}, application {APP!r}" in message
        assert refused.value.is_transient
        assert [h.pid for h in refused.value.holders] == [pid]
        said = [r for r in caplog.records if r.getMessage().startswith("waiting for the migr")]
        assert said, [r.getMessage() for r in caplog.records]
        assert f"pid {pid} (role {intruder.name!r}" in said[0].getMessage()
        assert await revision_of(pg_url, schema) == BEHIND  # nothing changed

        command = await run_cli(pg_url, schema, "migrate", "--lock-timeout", "2")
        assert command.exit_code == ExitCode.LOCK_HELD, command.output
        assert int(ExitCode.LOCK_HELD) == 9  # documented
        first, *_, last = command.stderr.splitlines()
        assert first.startswith(f"waiting for the migration lock of schema {schema!r}, held by")
        assert last.startswith("Error: gave up waiting for the migration lock")
        assert f"pid {pid} (role {intruder.name!r}" in last

        alembic = await python_run(
            "-m",
            "alembic",
            "-x",
            f"schema={schema}",
            "-x",
            "lock_timeout=2",
            "upgrade",
            "head",
            url=pg_url,
            timeout=90,
        )
        assert alembic.returncode != 0
        out, err = alembic.stdout, alembic.stderr
        assert f"[cronoq_store] waiting for the migration lock of schema {schema!r}" in err
        assert f"FAILED: gave up waiting for the migration lock of schema {schema!r}" in out
        assert await revision_of(pg_url, schema) == BEHIND

    # Let go: the same calls migrate.
    async with await PgStore.connect(pg_url, named_config(schema, "waits-b")) as store:
        assert (await store.health()).at_head


async def test_two_instances_opening_behind_head_at_once_take_turns(
    engine: AsyncEngine, pg_url: URL, schema: str, intruder: Role
) -> None:
    """A rolling upgrade: two instances of the new build open at once on the old schema;
    the second waits for the first's upgrade (held here a while, as a large table's would
    be) and finds the schema at head."""
    await upgrade(engine, schema, BEHIND)
    async with session_of(intruder) as held:
        await hold_migration_lock(held, schema)
        opening = [
            asyncio.ensure_future(PgStore.connect(pg_url, named_config(schema, f"waits-c{n}")))
            for n in range(2)
        ]
        await holds_for(
            lambda: not any(task.done() for task in opening),
            "both openings waiting for the held lock",
            1.0,
        )
    stores = await bounded(asyncio.gather(*opening), "both openings once the lock is free")
    for store in stores:
        await store.close()
    assert await revision_of(pg_url, schema) == head_revision()


# --- the cluster's tables, during a migration --------------------------------------------------


async def test_a_migration_behind_a_long_transaction_never_stops_reads_and_names_it(
    engine: AsyncEngine, pg_url: URL, schema: str, intruder: Role
) -> None:
    """A migration's DDL queued behind a long transaction would queue every commit behind
    it. It waits an attempt at a time instead: a read with a 5 s lock_timeout passes while
    it waits; past its bound it names the transaction; once that ends it migrates."""
    await upgrade(engine, schema, BEHIND)
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {intruder.name}")
    await admin_execute(pg_url, f"GRANT SELECT ON {schema}.cronoq_leader TO {intruder.name}")
    async with session_of(intruder) as reading:
        transaction = reading.transaction()
        await transaction.start()
        await reading.execute(f"SELECT epoch FROM {schema}.cronoq_leader")
        pid = reading.get_server_pid()
        migrating = asyncio.ensure_future(upgrade(engine, schema, lock_timeout=6.0))
        reader = await asyncpg.connect(asyncpg_dsn(pg_url), server_settings={"lock_timeout": "5s"})
        reads = 0
        try:
            # Reads all through the migration's wait, until it gives up.
            while not migrating.done() or reads == 0:
                await reader.fetchval(f'SELECT epoch FROM "{schema}".cronoq_leader')
                reads += 1
                await asyncio.sleep(0.5)
        finally:
            await reader.close()
        with pytest.raises(LockHeldError) as refused:
            await bounded(migrating, "the migration giving up")
        assert f"the tables of schema {schema!r}" in str(refused.value)
        assert f"pid {pid} (role {intruder.name!r}, application {APP!r}" in str(refused.value)
        await transaction.rollback()
    assert await revision_of(pg_url, schema) == BEHIND
    await bounded(upgrade(engine, schema), "the migration once the transaction ended")
    assert await revision_of(pg_url, schema) == head_revision()


# --- the leader table, for a prune and a takeover ------------------------------------------------


async def test_a_prune_behind_the_leader_row_gives_up_naming_its_holder(
    pg_url: URL, migrated: str
) -> None:
    async with await PgStore.connect(
        pg_url, named_config(migrated, "waits-d", commit_timeout=2.0)
    ) as s:
        async with LeaderRowHold(pg_url, migrated) as held:
            with pytest.raises(LockHeldError) as refused:
                await bounded(s.prune(0), "the prune giving up")
            message = str(refused.value)
            assert f"waiting for the leader table of schema {migrated!r}" in message
            assert f"pid {held.pid} (role {pg_url.username!r}, application" in message
        assert await bounded(s.prune(0), "the prune once the row is free") == 0


async def test_a_command_behind_a_table_lock_exits_9_naming_it(pg_url: URL, migrated: str) -> None:
    """``status`` reads the cluster's tables: behind a session holding them exclusively
    (a migration's DDL, a hand's ``LOCK TABLE``), it gives up after its ``--lock-wait``
    (30 s unless given, by option or ``$CRONOQ_LOCK_WAIT``), naming it."""
    held = await asyncpg.connect(asyncpg_dsn(pg_url), server_settings={"application_name": APP})
    try:
        await held.execute("BEGIN")
        await held.execute(f'LOCK TABLE "{migrated}".cronoq_tasks IN ACCESS EXCLUSIVE MODE')
        by_option = run_cli(pg_url, migrated, "status", "--lock-wait", "2")
        by_environment = run(
            "--url", full(pg_url), "--schema", migrated, "status", env={"CRONOQ_LOCK_WAIT": "1.5"}
        )
        for command, bound in ((by_option, "2"), (by_environment, "1.5")):
            result = await bounded(command, f"status giving up after {bound} s")
            assert result.exit_code == ExitCode.LOCK_HELD, result.output
            assert f"gave up after {bound} s waiting for a lock on the tables of schema " in (
                result.stderr
            )
            assert f"{migrated!r}, held by pid {held.get_server_pid()} (role" in result.stderr
    finally:
        await held.close()


async def test_a_takeover_behind_the_leader_row_keeps_trying_and_says_who_holds_it(
    pg_url: URL, migrated: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Taking over is the call's purpose: it never gives up, and says why it waits."""
    async with await PgStore.connect(pg_url, named_config(migrated, "waits-e")) as store:
        held = LeaderRowHold(pg_url, migrated)
        await held.lock()
        pid = held.pid
        taking = asyncio.ensure_future(store.acquire_leadership())
        try:
            with caplog.at_level(logging.INFO, logger="cronoq_store"):
                said = await until_value(
                    lambda: [r for r in caplog.records if f"pid {pid} (role" in str(vars(r))],
                    bool,
                    "the takeover naming the row's holder",
                )
            assert "taking over leadership gave up after 1 s waiting for the leader" in str(
                vars(said[0])
            )
            assert not taking.done()
            await held.release()
            assert await bounded(taking, "the takeover once the row is free") == 1
        finally:
            await held.release()
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)


async def test_a_standby_says_which_leader_it_waits_behind(
    pg_url: URL, migrated: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        await PgStore.connect(pg_url, named_config(migrated, "waits-f")) as leader,
        await PgStore.connect(pg_url, named_config(migrated, "waits-g")) as standby,
    ):
        epoch = await leader.acquire_leadership()
        health = await leader.health()
        assert health.holder is not None
        waiting = asyncio.ensure_future(standby.acquire_leadership())
        try:
            with caplog.at_level(logging.INFO, logger="cronoq_store"):
                said = await until_value(
                    lambda: [r for r in caplog.records if "the leader at epoch" in r.getMessage()],
                    bool,
                    "the standby naming the leader",
                )
            (record,) = said
            assert record.levelno == logging.INFO
            assert f"the leader at epoch {epoch} is pid {health.holder.pid}" in record.getMessage()
            assert health.holder.instance is not None
            assert f"'waits-f leader {health.holder.instance}'" in record.getMessage()
            await leader.release_leadership()
            assert await bounded(waiting, "the standby's takeover") == epoch + 1
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)


async def test_health_answers_beside_a_prune_queued_for_the_leader_table(
    pg_url: URL, migrated: str
) -> None:
    """A prune batch queues ``LOCK TABLE ... EXCLUSIVE`` on the leader table behind a
    session holding the leader row; ``health`` (the store's and the command's) reads
    without a lock that conflicts with it, so it answers while the prune still waits, not
    once the prune gives up."""
    patient = named_config(migrated, "waits-h", commit_timeout=PATIENCE)
    async with await PgStore.connect(pg_url, patient) as store:
        epoch = await store.acquire_leadership()
        async with LeaderRowHold(pg_url, migrated):
            pruning = asyncio.ensure_future(store.prune(0))
            await until_value(
                lambda: admin_execute(
                    pg_url,
                    "SELECT l.mode FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                    "WHERE a.application_name = 'waits-h' AND NOT l.granted "
                    "AND l.relation = $1::regclass",
                    f'"{migrated}".cronoq_leader',
                ),
                lambda rows: [r["mode"] for r in rows] == ["ExclusiveLock"],
                "the prune queued for the leader table",
            )
            health = await bounded(store.health(), "health beside the queued prune")
            assert not pruning.done(), "the prune stopped waiting before health answered"
            assert (health.has_leader, health.stored_epoch) == (True, epoch)
            command = await bounded(
                run_cli(pg_url, migrated, "health"), "the health command beside the queued prune"
            )
            assert command.exit_code == ExitCode.OK, command.output
            assert not pruning.done(), "the prune stopped waiting before the command answered"
        assert await bounded(pruning, "the prune once the row is free") == 0
