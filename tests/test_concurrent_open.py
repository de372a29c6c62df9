"""Any number of stores opening at once in one process: same loop, several loops, sync code.

Alembic's migration context is module-global; each schema must still end with exactly its
own tables at this build's head, whichever runs overlapped (in this process, and with
``alembic upgrade`` in others).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from alembic import command
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from cronoq_store._config import PgStoreConfig
from cronoq_store._errors import MigrationError
from cronoq_store._migrations import alembic_config, head_revision, held_async, run_command
from cronoq_store._schema import VERSION_TABLE
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import ROOT

TABLES = {
    "cronoq_leader",
    "cronoq_leader_history",
    "cronoq_tasks",
    "cronoq_recurring",
    VERSION_TABLE,
}


@pytest.fixture
async def schemas(pg_url: URL) -> AsyncIterator[list[str]]:
    """Five fresh schema names, dropped afterwards."""
    names = [f"c_{uuid.uuid4().hex[:10]}" for _ in range(5)]
    yield names
    for name in names:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
async def rounds(pg_url: URL) -> AsyncIterator[list[list[str]]]:
    """Three rounds of five fresh schema names (a race shows in some rounds only)."""
    names = [[f"c_{uuid.uuid4().hex[:10]}" for _ in range(5)] for _ in range(3)]
    yield names
    for name in (n for part in names for n in part):
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


async def assert_each_has_its_own_tables(pg_url: URL, schemas: list[str]) -> None:
    for schema in schemas:
        rows = await admin_execute(
            pg_url,
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1",
            schema,
        )
        assert {r[0] for r in rows} == TABLES, schema
        version = await admin_execute(pg_url, f'SELECT version_num FROM "{schema}".{VERSION_TABLE}')
        assert [r[0] for r in version] == [head_revision()], schema


async def open_and_close(url: URL, schema: str) -> int:
    async with await PgStore.connect(url, PgStoreConfig(schema=schema)) as store:
        return store.leader_lock[1]


def mixed(schemas: list[str]) -> list[str]:
    """Eight opens over five schemas: some alone, some shared."""
    a, b, c, d, e = schemas
    return [a, b, a, c, d, b, e, a]


async def test_eight_stores_open_at_once_in_one_loop(pg_url: URL, schemas: list[str]) -> None:
    oids = await asyncio.gather(*(open_and_close(pg_url, s) for s in mixed(schemas)))
    await assert_each_has_its_own_tables(pg_url, schemas)
    by_schema = dict(zip(mixed(schemas), oids, strict=True))
    assert len(set(by_schema.values())) == len(schemas)  # each store found its own schema


async def test_stores_open_while_alembic_upgrades_the_same_schemas(
    pg_url: URL, schemas: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CRONOQ_DATABASE_URL"}
    url = pg_url.render_as_string(hide_password=False)

    async def alembic(schema: str) -> tuple[int | None, bytes]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "alembic",
            "-x",
            f"url={url}",
            "-x",
            f"schema={schema}",
            "upgrade",
            "head",
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        return proc.returncode, out

    upgrades, _ = await asyncio.gather(
        asyncio.gather(*(alembic(s) for s in schemas[:3])),
        asyncio.gather(*(open_and_close(pg_url, s) for s in mixed(schemas))),
    )
    for code, out in upgrades:
        assert code == 0, out.decode()
    await assert_each_has_its_own_tables(pg_url, schemas)


def test_stores_open_at_once_on_several_loops_in_several_threads(
    pg_url: URL, schemas: list[str]
) -> None:
    failures: list[BaseException] = []
    opens = mixed(schemas)

    def on_its_own_loop(part: list[str]) -> None:
        async def run() -> None:
            await asyncio.gather(*(open_and_close(pg_url, s) for s in part))

        try:
            asyncio.run(run())
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=on_its_own_loop, args=(opens[i::3],)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    asyncio.run(assert_each_has_its_own_tables(pg_url, schemas))


def in_threads(work: list[Callable[[], None]]) -> list[BaseException | None]:
    """Run each callable in its own thread, all at once; what each raised, if anything."""
    outcomes: list[BaseException | None] = [None] * len(work)
    start = threading.Barrier(len(work))

    def run(i: int) -> None:
        start.wait()
        try:
            work[i]()
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return outcomes


def alembic_upgrade(pg_url: URL, schema: str, *, raw: bool) -> Callable[[], None]:
    """``alembic.command.upgrade`` of ``schema`` on an engine of its own, raw or through
    :func:`run_command`; the engine is made beforehand, so that the threads' calls overlap."""
    engine = create_async_engine(async_url(pg_url), poolclass=NullPool)
    cfg = alembic_config(schema, engine)

    def run() -> None:
        try:
            if raw:
                command.upgrade(cfg, "head")
            else:
                run_command(command.upgrade, cfg, "head")
        finally:
            asyncio.run(engine.dispose())

    return run


def test_alembic_commands_in_threads_through_run_command_take_turns(
    pg_url: URL, rounds: list[list[str]]
) -> None:
    """Alembic called from code in several threads, while stores open in others: every
    schema ends with its own tables. Alembic's module-global context is one for every
    thread: calls not serialized by run_command could otherwise return normally having
    migrated one schema several times and the others never."""
    for schemas in rounds:
        a, b, c, d, e = schemas
        upgrades = [alembic_upgrade(pg_url, s, raw=False) for s in (a, b, c, d)]
        stores = [opener(pg_url, [a, d]), opener(pg_url, [e])]
        assert in_threads([*upgrades, *stores]) == [None] * 6
        asyncio.run(assert_each_has_its_own_tables(pg_url, schemas))


def opener(url: URL, schemas: list[str]) -> Callable[[], None]:
    """Open and close stores of ``schemas`` at once, on a loop of the calling thread."""

    async def open_all() -> None:
        await asyncio.gather(*(open_and_close(url, s) for s in schemas))

    return lambda: asyncio.run(open_all())


def test_raw_alembic_commands_in_threads_migrate_their_own_schema_or_say_why_not(
    pg_url: URL, rounds: list[list[str]]
) -> None:
    """Raw ``command.upgrade`` calls at once in threads: Alembic's module-global context can
    point at another thread's run; such a run must fail clearly, never return as if done."""
    for schemas in rounds:
        outcomes = in_threads([alembic_upgrade(pg_url, s, raw=True) for s in schemas])
        done = [s for s, outcome in zip(schemas, outcomes, strict=True) if outcome is None]
        for outcome in outcomes:
            if outcome is not None:
                # Leaving, Alembic removes proxies: should another refused run have removed
                # them just before, Alembic's KeyError carries our MigrationError.
                refused = outcome if isinstance(outcome, MigrationError) else outcome.__context__
                assert isinstance(refused, MigrationError), repr(outcome)
                assert "run_command" in str(refused)
        asyncio.run(assert_each_has_its_own_tables(pg_url, done))
        rows = asyncio.run(
            admin_execute(
                pg_url,
                "SELECT nspname::text FROM pg_namespace WHERE nspname = ANY($1::text[])",
                schemas,
            )
        )
        assert sorted(r[0] for r in rows) == sorted(done)  # a refused run created nothing


async def test_sync_alembic_inside_a_running_loop_takes_its_turn(
    pg_url: URL, schemas: list[str]
) -> None:
    """``command.upgrade`` called synchronously (through :func:`run_command`) in a coroutine
    (Alembic then migrates on a loop of its own in a worker thread) while another thread's
    loop opens stores."""
    failures: list[BaseException] = []

    def other_loop() -> None:
        async def run() -> None:
            await asyncio.gather(*(open_and_close(pg_url, s) for s in mixed(schemas)))

        try:
            asyncio.run(run())
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=other_loop)
    thread.start()
    engine = create_async_engine(async_url(pg_url), poolclass=NullPool)
    try:
        for schema in schemas:
            run_command(command.upgrade, alembic_config(schema, engine), "head")  # blocks
    finally:
        thread.join(timeout=120)
        await engine.dispose()
    assert failures == []
    await assert_each_has_its_own_tables(pg_url, schemas)


async def test_sync_alembic_on_the_loop_of_a_running_migration_is_refused(
    engine: AsyncEngine, schema: str
) -> None:
    """Waiting would block the very loop that must finish the other run: a clear error."""
    async with held_async():
        with pytest.raises(MigrationError, match=r"await cronoq_store\.upgrade"):
            command.upgrade(alembic_config(schema, engine), "head")
