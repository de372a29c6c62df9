"""Takeover: how long a standby waits to lead after the leader process is SIGKILLed, and
after the leader's network stalls.

The leader is a child process (``python -m benchmarks.takeover SCHEMA KEEPALIVE TIMEOUT POLL``,
URLs in ``$BENCH_DSN`` and ``$BENCH_LOCK_DSN``) that prints ``leading`` once it leads and
``lost`` once it steps down. The standby is a ``PgStore`` in this process, already polling
for the lock. The clock runs from the kill (or the stall) to the standby's
``acquire_leadership()`` returning.

Stalls go through :class:`~benchmarks.proxy.StallingProxy`, which keeps both sockets open:
the server's TCP keepalives are answered by the proxy's kernel, so only something the server
itself times out can end the old leader's session. Two variants: the store as it is, and
its lock session under a role with ``idle_session_timeout`` (an ops-side remedy).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import URL, make_url

from cronoq_store import PgStoreConfig
from cronoq_store._store import PgStore

from .common import Profile, dsn, summarize
from .loops import run_loop
from .proxy import StallingProxy

_ROOT = Path(__file__).resolve().parent.parent
_SCHEMA = "bench_takeover"
_LOCK_ROLE = "bench_lock_session"
_DSN_ENV = "BENCH_DSN"
_LOCK_DSN_ENV = "BENCH_LOCK_DSN"


def _config(timing: tuple[float, float, float]) -> PgStoreConfig:
    keepalive, session_timeout, lock_poll = timing
    return PgStoreConfig(
        schema=_SCHEMA,
        keepalive=keepalive,
        session_timeout=session_timeout,
        lock_poll=lock_poll,
        trusted_roles=frozenset({_LOCK_ROLE}),
    )


class Leader:
    """The leader child process and the times at which it said each line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.said: dict[str, float] = {}
        self._said_something = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, url: URL, lock_url: URL, timing: tuple[float, float, float]) -> Leader:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.takeover",
            _SCHEMA,
            *map(str, timing),
            cwd=_ROOT,
            env={**os.environ, _DSN_ENV: dsn(url), _LOCK_DSN_ENV: dsn(lock_url)},
            stdout=asyncio.subprocess.PIPE,
        )
        leader = cls(process)
        await asyncio.wait_for(leader.wait_for("leading"), 60)
        return leader

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.said[line.decode().strip()] = time.monotonic()
            self._said_something.set()

    async def wait_for(self, line: str) -> float:
        while line not in self.said:
            if self.process.returncode is not None:
                raise RuntimeError(f"the leader exited ({self.process.returncode})")
            self._said_something.clear()
            await asyncio.wait_for(self._said_something.wait(), 60)
        return self.said[line]

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        await self.process.wait()
        await self._reader


async def _lock_role(url: URL, idle_timeout: float) -> URL:
    """A role for the lock session that the server drops after ``idle_timeout`` seconds of
    silence (the standby's polls and the leader's keepalives keep their sessions busy)."""
    password = secrets.token_urlsafe(12)
    conn = await asyncpg.connect(dsn(url))
    try:
        await conn.execute(f"CREATE ROLE {_LOCK_ROLE} LOGIN PASSWORD '{password}'")
        await conn.execute(
            f"ALTER ROLE {_LOCK_ROLE} SET idle_session_timeout = '{round(idle_timeout * 1000)}ms'"
        )
        # The server revokes CONNECT from PUBLIC, as a store requires of its database.
        await conn.execute(f'GRANT CONNECT ON DATABASE "{url.database}" TO {_LOCK_ROLE}')
        await conn.execute(f"GRANT USAGE ON SCHEMA {_SCHEMA} TO {_LOCK_ROLE}")
        # The lock role's rights, as docs/reliability.md lists them.
        await conn.execute(f"GRANT SELECT, UPDATE ON {_SCHEMA}.cronoq_leader TO {_LOCK_ROLE}")
        await conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_SCHEMA}.cronoq_leader_history"
            f" TO {_LOCK_ROLE}"
        )
    finally:
        await conn.close()
    return url.set(username=_LOCK_ROLE, password=password)


async def _drop_lock_role(url: URL) -> None:
    """Drop the lock session's role and its rights: a role the later sections' stores do
    not trust, left with CONNECT, would make them refuse to lead."""
    conn = await asyncpg.connect(dsn(url))
    try:
        await conn.execute(f"DROP OWNED BY {_LOCK_ROLE}")
        await conn.execute(f"DROP ROLE {_LOCK_ROLE}")
    finally:
        await conn.close()


async def _scenario(
    url: URL,
    standby: PgStore,
    timing: tuple[float, float, float],
    stall: bool,
    lock_url: URL | None,
    cap: float,
) -> tuple[float | None, float | None]:
    """One takeover: start a leader, start the standby polling, fail the leader (SIGKILL, or
    stall its connections), and time the standby until it leads. Returns that time (``None``
    past ``cap``) and when the old leader stepped down (``None`` if it never said so)."""
    proxy = await StallingProxy(url.port or 5432).start() if stall else None
    through = url if proxy is None else url.set(port=proxy.port)
    lock = through if lock_url is None else lock_url.set(port=through.port)
    leader = await Leader.start(through, lock, timing)
    acquiring = asyncio.ensure_future(standby.acquire_leadership())
    try:
        # The standby polls and the leader pings; a random phase, so that the failure does
        # not always land at the same point of the standby's polling cycle.
        await asyncio.sleep(1.0 + random.uniform(0, timing[2]))
        if acquiring.done():
            raise RuntimeError("the standby led before the leader failed")
        started = time.monotonic()
        if proxy is None:
            await leader.kill()
        else:
            proxy.stall()
        done, _ = await asyncio.wait({acquiring}, timeout=cap)
        took = time.monotonic() - started if done else None
        lost = leader.said.get("lost")
    finally:
        await leader.kill()
        if proxy is not None:
            await proxy.close()  # the old sessions end for good, so the standby leads now
    await acquiring
    await standby.release_leadership()
    return took, None if lost is None else lost - started


def _summary(values: list[float | None]) -> dict[str, float] | None:
    measured = [v for v in values if v is not None]
    return summarize(measured) if measured else None


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """Takeover times per scenario, and when the stalled leader stepped down."""
    timing = profile.takeover_timing
    _, session_timeout, _ = timing
    setup = await PgStore.connect(url, _config(timing))  # migrates the schema
    await setup.close()
    idle_timeout = 1.5 * session_timeout
    lock_url = await _lock_role(url, idle_timeout)
    cap = 2 * session_timeout + 2
    standby = await PgStore.connect(url, _config(timing))
    scenarios = {
        "sigkill": (False, None, profile.kill_takeovers),
        "stall": (True, None, 1),
        "stall_idle_session_timeout": (True, lock_url, profile.stall_takeovers),
    }
    results: dict[str, Any] = {
        "keepalive": timing[0],
        "session_timeout": session_timeout,
        "lock_poll": timing[2],
        "idle_session_timeout": idle_timeout,
        "cap_seconds": cap,
    }
    try:
        for name, (stall, role_url, repeats) in scenarios.items():
            outcomes = [
                await _scenario(url, standby, timing, stall, role_url, cap) for _ in range(repeats)
            ]
            results[name] = {
                "takeover_seconds": _summary([took for took, _ in outcomes]),
                "no_takeover_within_cap": sum(took is None for took, _ in outcomes),
                "step_down_seconds": _summary([lost for _, lost in outcomes]),
                "repeats": repeats,
            }
    finally:
        await standby.close()
        await _drop_lock_role(url)
    return results


async def _lead(schema: str, keepalive: float, session_timeout: float, lock_poll: float) -> None:
    # The step-down is reported on stdout; the store's own log of it would only be noise.
    logging.getLogger("cronoq_store").addHandler(logging.NullHandler())
    config = PgStoreConfig(
        schema=schema,
        keepalive=keepalive,
        session_timeout=session_timeout,
        lock_poll=lock_poll,
        trusted_roles=frozenset({_LOCK_ROLE}),  # the leader's lock session's role
    )
    store = await PgStore.connect(
        make_url(os.environ[_DSN_ENV]), config, lock_url=make_url(os.environ[_LOCK_DSN_ENV])
    )
    await store.acquire_leadership()
    print("leading", flush=True)
    await store.leadership_lost()
    print("lost", flush=True)
    await asyncio.Event().wait()  # until killed


if __name__ == "__main__":
    run_loop(_lead(sys.argv[1], *map(float, sys.argv[2:5])))
