"""Hosts in a test's own process, each with its own host session and pool: their settings,
a host serving its clusters, a commit on a hosted store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.engine import URL

from cronoq_store import PgStoreConfig, TaskSpec
from cronoq_store._domain import Submitted, TimeBase, task_id
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig

from ..pgharness import admin_execute
from ..waits import until_value
from .conftest import Fleet

STORE = PgStoreConfig(lock_poll=0.1, keepalive=0.3, session_timeout=2.0, commit_timeout=10.0)


def config(fleet: Fleet, name: str, **settings: object) -> PgHostConfig:
    store = PgStoreConfig(
        application_name=name,
        lock_poll=STORE.lock_poll,
        keepalive=STORE.keepalive,
        session_timeout=STORE.session_timeout,
        commit_timeout=STORE.commit_timeout,
    )
    return PgHostConfig(
        store=store,
        control_schema=fleet.control,
        group=fleet.group,
        max_connections=3,
        join_settle=0.3,
        **settings,  # type: ignore[arg-type]
    )


class Served:
    """A host serving its clusters; what ``lead`` saw, per cluster."""

    def __init__(self, host: PgHost) -> None:
        self.host = host
        self.gained: list[tuple[str, int]] = []
        self.stores: list[HostedStore] = []
        self.task: asyncio.Task[None] | None = None

    async def lead(self, store: HostedStore) -> None:
        assert store.epoch is not None
        self.gained.append((store.config.schema, store.epoch))
        self.stores.append(store)
        await store.leadership_lost()


@asynccontextmanager
async def serving(
    url: URL, cfg: PgHostConfig, enroll: tuple[str, ...] | list[str] = ()
) -> AsyncIterator[Served]:
    host = await PgHost.connect(url, cfg)
    served = Served(host)
    try:
        if enroll:
            await host.enroll(list(enroll))
        served.task = asyncio.ensure_future(host.serve(served.lead))
        yield served
    finally:
        await host.close()
        if served.task is not None:
            await asyncio.wait({served.task})


async def enrolled(fleet: Fleet, schemas: list[str]) -> None:
    """Enroll ``schemas`` (migrated) from a host that serves nothing, then closed."""
    host = await PgHost.connect(fleet.url, config(fleet, "enroller"))
    try:
        await host.enroll(schemas)
    finally:
        await host.close()


async def commit_one(store: HostedStore, n: int, epoch: int | None = None) -> None:
    """Commit task ``n`` under ``epoch`` (the store's current one by default)."""
    epoch = store.epoch if epoch is None else epoch
    assert epoch is not None
    base = TimeBase.now()
    spec = TaskSpec(b"hosted %d" % n)
    await store.commit(epoch, base, [Submitted(task_id(epoch, n), n, base.engine_ns, spec)], [])


async def serving_until_it_waits_on_a_lock(
    fleet: Fleet, host: PgHost, name: str, what: str
) -> asyncio.Future[None]:
    """``host`` serving (each lead waits for its term's end), returned once its session
    named ``name`` waits on a lock a test holds (``what`` says which, for the failure)."""

    async def lead(store: HostedStore) -> None:
        await store.leadership_lost()

    serving = asyncio.ensure_future(host.serve(lead))
    await until_value(
        lambda: admin_execute(
            fleet.url,
            "SELECT count(*) AS n FROM pg_stat_activity "
            "WHERE application_name LIKE $1 AND wait_event_type = 'Lock'",
            f"{name} leader %",
        ),
        lambda rows: rows[0]["n"] == 1,
        what,
    )
    return serving
