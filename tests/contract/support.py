"""What the contract suite runs against: one cluster of store instances per test.

A :class:`Cluster` opens instances of one store implementation that share one cluster
(``PgStore``: a fresh schema on the suite's server; ``InMemoryStore``: one
``InMemoryDatabase``), and does to them what a test needs beyond the pinned API: end a
leader's lock session (a real ``pg_terminate_backend`` for ``PgStore``), start the cluster
at a given epoch (the wrap), recover in another process. Tests assert only through the
``Store`` and ``StoreQueries`` API.

What a store cannot promise is a :class:`Capability` it does not declare; a test that needs
one says so with ``@pytest.mark.needs(Capability.X)`` and is generated only for the stores
that declare it (see conftest.py), so the gap shows by name in the test ids instead of as
a skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from abc import ABC, abstractmethod
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, ClassVar, Protocol, cast

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from cronoq_store import (
    PgStore,
    PgStoreConfig,
    Recovered,
    Store,
    StoreQueries,
    TaskId,
    TaskRecord,
    TimeBase,
)
from cronoq_store._domain import UNIX_EPOCH
from cronoq_store._store import Committable
from cronoq_store.testing import InMemoryDatabase, InMemoryStore

from ..pgharness import admin_execute, terminate_backends
from ..support import (
    ROOT,
    START_BASE,
)
from ..waits import bounded, until_value


class Capability(Enum):
    """A promise that not every store can keep."""

    DURABLE = "durable"
    """The state outlives the process that wrote it: another process recovers it."""


class ContractStore(Store, StoreQueries, Committable, Protocol):
    """What every store under contract offers: the scheduler's two protocols and the group
    committer's, its epoch, its bound on a batch's bytes (settable), and close()."""

    max_commit_bytes: int

    @property
    def epoch(self) -> int | None: ...

    async def close(self) -> None: ...


class Cluster(ABC):
    """Instances of one store implementation sharing one cluster; all closed at the end."""

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[Capability]]
    #: How long a leader may take to step down once its lock session ended.
    step_down_bound: ClassVar[float]

    def __init__(self) -> None:
        self._opened: list[ContractStore] = []

    async def open(self, *, retention: float = 3600.0) -> ContractStore:
        """A new instance on this cluster; ``retention`` in float seconds."""
        store = await self._open(retention)
        self._opened.append(store)
        return store

    async def close(self) -> None:
        for store in self._opened:
            await bounded(store.close(), "close() of a store")

    @abstractmethod
    async def _open(self, retention: float) -> ContractStore: ...

    @abstractmethod
    async def end_lock_session(self, store: ContractStore) -> None:
        """End ``store``'s leader lock session from outside, as a crash or an admin would."""

    @abstractmethod
    async def move_epoch(self) -> None:
        """Move the stored epoch on by one behind the leader's back, as a leader elected
        some other way would (a host process leading through its own liveness)."""

    @abstractmethod
    async def start_at_epoch(self, epoch: int) -> None:
        """Set the stored epoch, before any instance is opened (a cluster that has seen
        that many leaders: 32766 of them take too long to elect)."""

    async def recover_in_new_process(self, base: TimeBase) -> dict[str, Any]:
        """What a new process recovers, as :func:`summary` gives it (``DURABLE`` only)."""
        raise NotImplementedError(f"{self.name} does not declare {Capability.DURABLE}")


# A new process opens the cluster's schema and prints what it recovers (the URL, with its
# password, travels in the environment, never on a command line).
_RECOVER_ELSEWHERE = """
import asyncio, json, os, sys
from cronoq_store import PgStore, PgStoreConfig, TimeBase
from tests.contract.support import summary

async def main():
    base = TimeBase(int(sys.argv[2]), int(sys.argv[3]))
    config = PgStoreConfig(schema=sys.argv[1])
    url = os.environ["CRONOQ_CONTRACT_URL"]
    async with await PgStore.connect(url, config, migrate=False) as store:
        print(json.dumps(summary(await store.recover(base))))

asyncio.run(main())
"""


class PgCluster(Cluster):
    name = "pg"
    capabilities = frozenset({Capability.DURABLE})
    # The keeper pings every keepalive and steps down within session_timeout of silence.
    _LOCK_POLL, _KEEPALIVE, _SESSION_TIMEOUT = 0.05, 0.2, 1.0
    step_down_bound = _SESSION_TIMEOUT + 2 * _KEEPALIVE

    def __init__(self, pg_url: URL, engine: AsyncEngine, schema: str) -> None:
        super().__init__()
        self._url, self._engine, self._schema = pg_url, engine, schema

    async def _open(self, retention: float) -> ContractStore:
        config = PgStoreConfig(
            schema=self._schema,
            retention=retention,
            lock_poll=self._LOCK_POLL,
            keepalive=self._KEEPALIVE,
            session_timeout=self._SESSION_TIMEOUT,
            application_name=f"contract-{self._schema}-{len(self._opened)}",
        )
        return await PgStore.from_engine(self._engine, config, migrate=False)

    async def close(self) -> None:
        """Close every instance, then check that none left anything behind: no connection
        checked out of its pool, and no server session of its own (each instance's lock
        session is named after it) still open."""
        await super().close()
        for store in self._opened:
            pool: Any = cast(PgStore, store).engine.sync_engine.pool
            assert pool.checkedout() == 0, f"{pool.checkedout()} connection(s) left checked out"
        prefix = f"contract-{self._schema}-"

        async def left_open() -> list[dict[str, Any]]:
            rows = await admin_execute(
                self._url,
                "SELECT pid, application_name, state FROM pg_stat_activity "
                "WHERE starts_with(application_name, $1)",
                prefix,
            )
            return [dict(r) for r in rows]

        # The server ends a closed session asynchronously.
        left: list[dict[str, Any]] = await until_value(
            left_open, lambda rows: not rows, "the server to end every session"
        )
        assert not left

    async def end_lock_session(self, store: ContractStore) -> None:
        name = f"{cast(PgStore, store).config.application_name} leader"
        assert await terminate_backends(self._url, name) == 1

    async def move_epoch(self) -> None:
        await admin_execute(
            self._url, f'UPDATE "{self._schema}".cronoq_leader SET epoch = epoch + 1'
        )

    async def start_at_epoch(self, epoch: int) -> None:
        assert not self._opened
        await admin_execute(self._url, f'UPDATE "{self._schema}".cronoq_leader SET epoch = {epoch}')

    async def recover_in_new_process(self, base: TimeBase) -> dict[str, Any]:
        env = {
            **os.environ,
            "CRONOQ_CONTRACT_URL": self._url.render_as_string(hide_password=False),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _RECOVER_ELSEWHERE,
            self._schema,
            str(base.engine_ns),
            str(base.unix_ns),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err.decode()
        result: dict[str, Any] = json.loads(out)
        return result


class MemoryCluster(Cluster):
    name = "memory"
    capabilities = frozenset()  # not DURABLE: the state lives in one InMemoryDatabase object
    step_down_bound = 0.1  # it notices at once

    def __init__(self) -> None:
        super().__init__()
        self._database = InMemoryDatabase()

    async def _open(self, retention: float) -> ContractStore:
        return InMemoryStore(self._database, retention=retention)

    async def end_lock_session(self, store: ContractStore) -> None:
        cast(InMemoryStore, store).end_lock_session()

    async def move_epoch(self) -> None:
        self._database._epoch += 1

    async def start_at_epoch(self, epoch: int) -> None:
        assert not self._opened
        self._database = InMemoryDatabase(epoch=epoch)


# --- building and reading what tests commit -------------------------------------------------


def when(at: int) -> datetime:
    """``TaskRecord.updated`` of a transition at engine time ``at`` through ``START_BASE``."""
    return UNIX_EPOCH + timedelta(microseconds=START_BASE.to_unix(at) // 1000)


def state(record: TaskRecord | None) -> tuple[Any, ...] | None:
    """A task's state as the scheduler sees it: status, attempt, message, time."""
    if record is None:
        return None
    return (record.status, record.attempt, record.message, record.updated)


async def states(store: StoreQueries, ids: range | list[int]) -> list[tuple[Any, ...] | None]:
    return [state(await store.get_task(TaskId(i))) for i in ids]


def summary(recovered: Recovered) -> dict[str, Any]:
    """What recovery found, as JSON-able values (compared across processes)."""
    return {
        "next_id": recovered.next_id,
        "tasks": [[t.id, t.seq, t.arrival, t.attempt, t.spec.key] for t in recovered.tasks],
        "terminal": [[t.id, t.key, t.status.value, t.at] for t in recovered.terminal],
        "recurring": [[r.spec.name, r.next, r.last] for r in recovered.recurring],
    }


async def observe(store: ContractStore, ids: range | list[int]) -> tuple[Any, ...]:
    """Everything the API shows of tasks ``ids`` and of the cluster: records, outputs,
    the finished list, and what a recovery finds."""
    records = [await store.get_task(TaskId(i)) for i in ids]
    outputs = [await store.load_output(TaskId(i)) for i in ids]
    finished = await store.list_finished(limit=10_000)
    return records, outputs, finished, summary(await store.recover(START_BASE))
