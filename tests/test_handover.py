"""A handover hands over: ``cronoq-store handover`` ends the leader's lock session, and a
waiting standby leads next, because the instance removed waits before it competes again.
The command tells instances apart by the id each lock session shows, never by pid, and
exits 0 only when another instance leads. Against a real server, with store instances that
run the loop an application runs: acquire leadership, lead until it is lost, acquire again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any
from unittest.mock import ANY

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import LockHolder, PgStore, PgStoreConfig
from cronoq_store._cli import ExitCode
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import create_role, drop_role, full, run
from .waits import PATIENCE, bounded, until

#: A standby polls at the default pace, and a removed leader hears of its loss at once
#: (its keeper's next ping): without a cool-down it competes again before the standby's
#: next poll.
LOCK_POLL, KEEPALIVE, SESSION_TIMEOUT = 0.5, 0.1, 2.0
#: One instance's name, shared by every instance as a deployment's are: only their ids
#: tell them apart.
NAME = "handover-twin"
#: A lone instance's poll in the test of a handover nobody takes: its cool-down (2 x
#: lock_poll + 1 s) outlasts the command's 1 s wait by seconds, so the command's last look,
#: however late a loaded machine runs it, comes before the instance competes again.
LONE_POLL, LONE_SESSION_TIMEOUT = 2.0, 5.0

Terms = list[tuple[str, int]]


def twin(schema: str, name: str = NAME) -> PgStoreConfig:
    return PgStoreConfig(
        schema=schema,
        application_name=name,
        lock_poll=LOCK_POLL,
        keepalive=KEEPALIVE,
        session_timeout=SESSION_TIMEOUT,
    )


def leads(store: PgStore) -> Callable[[], bool]:
    return lambda: store.is_leader


async def lead_until_lost(store: PgStore, name: str, terms: Terms) -> None:
    """An application's loop: lead, and once leadership is lost, compete for it again."""
    while True:
        epoch = await store.acquire_leadership()
        terms.append((name, epoch))
        await store.leadership_lost()


async def lead_until_asked(store: PgStore, name: str, terms: Terms, asked: asyncio.Event) -> None:
    """An application's loop that hands over on request: release, then compete again."""
    while True:
        epoch = await store.acquire_leadership()
        terms.append((name, epoch))
        await asked.wait()
        asked.clear()
        await store.release_leadership()


@asynccontextmanager
async def looping(*loops: Awaitable[None]) -> AsyncIterator[None]:
    tasks = [asyncio.ensure_future(loop) for loop in loops]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            assert task.cancelled(), task  # a loop that failed fails the test


async def lock_sessions(pg_url: URL, name: str = NAME) -> int:
    """How many lock sessions of instances named ``name`` are open (leading or waiting)."""
    rows = await admin_execute(
        pg_url,
        "SELECT count(*) FROM pg_stat_activity WHERE starts_with(application_name, $1)",
        f"{name} leader",
    )
    return int(rows[0][0])


def one_leads(stores: dict[str, PgStore]) -> tuple[str, str]:
    """The names of the instance that leads and of the other one."""
    (leader,) = [name for name, store in stores.items() if store.is_leader]
    (other,) = [name for name in stores if name != leader]
    return leader, other


async def both_compete(pg_url: URL, stores: dict[str, PgStore]) -> bool:
    """Whether one instance leads and the other waits for the lock on its lock session."""
    return sum(s.is_leader for s in stores.values()) == 1 and await lock_sessions(pg_url) == 2


async def lock_holder(store: PgStore) -> LockHolder:
    """The lock session of ``store``, which leads."""
    holder = (await store.health()).holder
    assert holder is not None
    return holder


async def instance_of(store: PgStore) -> str:
    """The id of ``store``, which leads, as its lock session shows it."""
    instance = (await lock_holder(store)).instance
    assert instance is not None
    return instance


async def test_handover_moves_leadership_to_the_waiting_standby_every_time(
    pg_url: URL, migrated: str
) -> None:
    url, terms = full(pg_url), Terms()
    async with (
        await PgStore.connect(pg_url, twin(migrated)) as a,
        await PgStore.connect(pg_url, twin(migrated)) as b,
    ):
        stores = {"a": a, "b": b}
        async with looping(*(lead_until_lost(s, n, terms) for n, s in stores.items())):
            for turn in range(1, 6):
                await until(
                    lambda: both_compete(pg_url, stores),
                    f"one instance leading and the other waiting for the lock (turn {turn})",
                )
                leading, waiting = one_leads(stores)
                ended = await lock_holder(stores[leading])
                result = await run("--url", url, "--schema", migrated, "handover", "--yes")
                standby = stores[waiting]
                await until(
                    leads(standby),
                    f"the standby {waiting} leading after handover {turn} (terms: {terms})",
                )
                assert result.exit_code == ExitCode.OK, result.output
                removed = ended.instance
                new = (await standby.health()).holder
                assert new is not None
                assert new.instance not in (None, removed)
                assert f"(instance {removed}); waiting up to 30 s" in result.stdout
                assert result.stdout.endswith(
                    f"new leader: instance {new.instance}, not {removed}: backend pid "
                    f"{new.pid} ({NAME} leader {new.instance}), epoch {standby.epoch}\n"
                )
    names = [name for name, _ in terms]
    assert names == [names[0], names[1]] * 3, terms  # never the instance just removed
    assert [epoch for _, epoch in terms] == list(range(terms[0][1], terms[0][1] + 6))


async def test_handover_without_a_standby_says_that_none_took_it(
    pg_url: URL, migrated: str
) -> None:
    url, terms = full(pg_url), Terms()
    lone = replace(twin(migrated), lock_poll=LONE_POLL, session_timeout=LONE_SESSION_TIMEOUT)
    async with (
        await PgStore.connect(pg_url, lone) as alone,
        looping(lead_until_lost(alone, "alone", terms)),
    ):
        await until(lambda: alone.is_leader, "the lone instance leading")
        first, ended = alone.epoch, await lock_holder(alone)
        assert first is not None

        # The command waits less than the cool-down: nobody can lead before it gives up.
        cool_down = 2 * LONE_POLL + 1
        assert cool_down > 1
        nobody = await run(
            "--url", url, "--schema", migrated, "handover", "--yes", "--timeout", "1"
        )
        gave_up = time.monotonic()
        assert nobody.exit_code == ExitCode.NO_LEADER, nobody.output
        removed = ended.instance
        assert (
            f"Error: no instance took the leader lock within 1 s (epoch {first}): no standby "
            f"took over, and instance {removed}, whose session was ended, waits 2 x "
            "lock_poll + 1 s before it competes again\n"
        ) == nobody.stderr

        # A lone instance still leads again, once its cool-down is over.
        await until(
            lambda: alone.is_leader,
            "the lone instance leading again after its cool-down",
            within=cool_down + LONE_SESSION_TIMEOUT + PATIENCE,
        )
        print(f"lone instance led again {time.monotonic() - gave_up:.2f} s after the command")
        assert terms == [("alone", first), ("alone", first + 1)]
        assert await instance_of(alone) == removed

        # Waiting longer than the cool-down, the command sees it take the lock back.
        back = await run("--url", url, "--schema", migrated, "handover", "--yes")
        assert back.exit_code == ExitCode.NOT_HANDED_OVER, back.output
        assert int(ExitCode.NOT_HANDED_OVER) == 8  # documented
        assert back.stderr.startswith(
            f"Error: instance {removed}, whose session was ended, leads again at epoch "
            f"{first + 2} (backend pid "
        )
        assert "no other instance took the lock; is a standby running" in back.stderr
        assert "new leader" not in back.stdout


async def test_handover_json_names_the_instances_it_compared(pg_url: URL, migrated: str) -> None:
    url, terms = full(pg_url), Terms()
    async with (
        await PgStore.connect(pg_url, twin(migrated)) as a,
        await PgStore.connect(pg_url, twin(migrated)) as b,
    ):
        stores = {"a": a, "b": b}
        loops = {n: asyncio.ensure_future(lead_until_lost(s, n, terms)) for n, s in stores.items()}
        try:
            await until(lambda: both_compete(pg_url, stores), "an instance waiting for the lock")
            leading, waiting = one_leads(stores)
            epoch, ended = stores[leading].epoch, await lock_holder(stores[leading])
            moved = await run("--url", url, "--schema", migrated, "handover", "--yes", "--json")
            assert moved.exit_code == ExitCode.OK, moved.output
            removed = ended.instance
            assert removed is not None
            doc = json.loads(moved.stdout)
            new = await instance_of(stores[waiting])
            assert doc == {
                "handed_over": True,
                "outcome": "handed_over",
                "message": ANY,
                "schema": migrated,
                "previous_epoch": epoch,
                "stored_epoch": stores[waiting].epoch,
                "ended": holder(removed),
                "leader": holder(new),
            }
            assert doc["message"].startswith(f"new leader: instance {new}, not {removed}: ")

            # The standby stops: the instance removed leads after its cool-down, alone.
            loops.pop(waiting).cancel()
            await stores[waiting].release_leadership()
            await until(lambda: stores[leading].is_leader, f"{leading} leading again")
            again = stores[leading].epoch
            back = await run("--url", url, "--schema", migrated, "handover", "--yes", "--json")
            assert back.exit_code == ExitCode.NOT_HANDED_OVER, back.output
            assert back.stderr == ""
            doc = json.loads(back.stdout)
            assert doc == {
                "handed_over": False,
                "outcome": "taken_back",
                "message": ANY,
                "schema": migrated,
                "previous_epoch": again,
                "stored_epoch": stores[leading].epoch,
                "ended": holder(removed),
                "leader": holder(removed),
            }
            assert again is not None
            assert doc["stored_epoch"] == again + 1
            assert doc["message"].startswith(f"instance {removed}, whose session was ended, ")
        finally:
            for loop in loops.values():
                loop.cancel()
            await asyncio.gather(*loops.values(), return_exceptions=True)


def holder(instance: str) -> dict[str, Any]:
    """A ``--json`` holder document of a lock session of instance ``instance``."""
    return {
        "pid": ANY,
        "instance": instance,
        "application_name": f"{NAME} leader {instance}",
        "client_addr": ANY,
        "since": ANY,
        "role": ANY,
        "store_instance": True,
    }


async def test_a_released_leader_lets_the_waiting_standby_lead(pg_url: URL, migrated: str) -> None:
    terms: Terms = []
    asked = {"a": asyncio.Event(), "b": asyncio.Event()}
    async with (
        await PgStore.connect(pg_url, twin(migrated)) as a,
        await PgStore.connect(pg_url, twin(migrated)) as b,
    ):
        stores = {"a": a, "b": b}
        async with looping(*(lead_until_asked(s, n, terms, asked[n]) for n, s in stores.items())):
            for turn in range(1, 4):
                await until(
                    lambda: both_compete(pg_url, stores),
                    f"one instance leading and the other waiting for the lock (turn {turn})",
                )
                leading, waiting = one_leads(stores)
                # The leader releases and competes again at once, as its loop is written.
                asked[leading].set()
                await until(
                    leads(stores[waiting]),
                    f"the standby {waiting} leading after {leading} released (terms: {terms})",
                )
    names = [name for name, _ in terms]
    assert names == [names[0], names[1]] * 2, terms


async def test_each_instance_shows_its_own_id_whatever_its_application_name(
    pg_url: URL, migrated: str
) -> None:
    # Longer than the server keeps, and not ASCII: the server escapes and cuts it.
    name = "planificación-" + "x" * 80
    engine = create_async_engine(
        async_url(pg_url),
        connect_args={"server_settings": {"application_name": "the-application"}},
    )
    try:
        async with (
            await PgStore.connect(pg_url, twin(migrated, name)) as a,
            await PgStore.from_engine(engine, twin(migrated, name)) as b,
        ):
            await a.acquire_leadership()
            standby = asyncio.ensure_future(b.acquire_leadership())
            prefix = "planificaci\\xc3\\xb3n-xxx"
            rows: list[Any] = []

            async def two_lock_sessions() -> bool:
                rows[:] = await admin_execute(
                    pg_url,
                    "SELECT application_name FROM pg_stat_activity WHERE starts_with("
                    "application_name, $1) AND application_name ~ ' leader [0-9a-f]{8}$' "
                    "ORDER BY backend_start",
                    prefix,
                )
                return len(rows) == 2

            await until(two_lock_sessions, "both lock sessions open")
            shown = [row[0] for row in rows]
            ids = [seen[-8:] for seen in shown]
            for instance, seen in zip(ids, shown, strict=True):
                # Escaped as the server escapes it, shortened to keep the id within 63 bytes.
                assert seen == prefix + "x" * 23 + f" leader {instance}"
                assert len(seen) == 63
            # Which session opened first is the server's business: each instance is told
            # by the id it shows.
            leading = await instance_of(a)
            assert leading in ids, (leading, shown)
            assert ids[0] != ids[1], shown
            (waiting,) = set(ids) - {leading}

            url = full(pg_url)
            status = await run("--url", url, "--schema", migrated, "status", "--json")
            assert json.loads(status.stdout)["leader"]["instance"] == leading
            plain = await run("--url", url, "--schema", migrated, "status")
            assert f"instance {leading}, backend pid " in plain.stdout

            await a.release_leadership()
            await bounded(standby, "the standby leading once the first let go")
            assert await instance_of(b) == waiting
    finally:
        await engine.dispose()


async def test_a_role_that_cannot_see_the_instance_is_refused_before_anything_ends(
    pg_url: URL, migrated: str
) -> None:
    """``pg_signal_backend`` without ``pg_read_all_stats``: the role could end the leader's
    session but not see which instance leads afterwards, so it could not tell a handover
    from a take-back. Refused, exit 1, the leader's session untouched."""
    ops = await create_role(pg_url, f"{migrated}_ops")
    try:
        await admin_execute(pg_url, f"GRANT pg_signal_backend TO {ops.name}")
        await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {migrated} TO {ops.name}")
        await admin_execute(
            pg_url, f"GRANT SELECT ON ALL TABLES IN SCHEMA {migrated} TO {ops.name}"
        )
        config = replace(twin(migrated), trusted_roles=frozenset({ops.name}))
        async with await PgStore.connect(pg_url, config) as leader:
            await leader.acquire_leadership()
            before = await lock_holder(leader)
            refused = await run("--url", full(ops.url), "--schema", migrated, "handover", "--yes")
            assert refused.exit_code == ExitCode.FAILED, refused.output
            assert refused.stderr == (
                "Error: this role cannot see which instance holds the leader lock (session pid "
                f"{before.pid}), so it could not tell whether another instance takes over: grant "
                "it pg_read_all_stats; nothing was ended\n"
            )
            assert leader.is_leader
            assert (await lock_holder(leader)).pid == before.pid
    finally:
        await drop_role(pg_url, ops.name)
