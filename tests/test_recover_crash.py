"""A server crash during ``recover()`` is reported as the lost connection it is.

The server really stops (``immediate``: a crash as clients see it) while recovery reads its
cursor a partition at a time. The rollback that follows fails too, on a connection that is
gone: the error must name the lost connection, be transient, and not be the rollback's.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import _recovery as recovery
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskSpec, task_id
from cronoq_store._errors import UnavailableError
from cronoq_store._schema import LiveTasks
from cronoq_store._store import PgStore
from cronoq_store._urls import async_url

from .pgharness import ServerUnderTest
from .support import PROCESS_BASE


@pytest.mark.parametrize("shared", [False, True], ids=["connect", "from_engine"])
async def test_a_crash_during_recover_reports_the_lost_connection(
    pg_url: URL,
    migrated: str,
    stoppable: ServerUnderTest,
    monkeypatch: pytest.MonkeyPatch,
    shared: bool,
) -> None:
    config = PgStoreConfig(schema=migrated, commit_timeout=10.0)
    if shared:
        engine = create_async_engine(async_url(pg_url))
        store = await PgStore.from_engine(engine, config)
    else:
        store = await PgStore.connect(pg_url, config)
    try:
        epoch = await store.acquire_leadership()
        batch = [Submitted(task_id(epoch, n), n, 0, TaskSpec(b"p")) for n in range(40)]
        await store.commit(epoch, PROCESS_BASE, batch, [])
        await store.release_leadership()

        class CrashingDecoder(LiveTasks):
            """Stops the server once the first partition is decoded."""

            def decode(self, *row: Any) -> Any:
                if row[0] == task_id(epoch, 5):
                    stoppable.stop("immediate")
                return super().decode(*row)

        monkeypatch.setattr(recovery, "RECOVERY_PARTITION", 10)
        monkeypatch.setattr(recovery, "LiveTasks", CrashingDecoder)
        with pytest.raises(UnavailableError) as raised:
            await store.recover(PROCESS_BASE)
        message = str(raised.value)
        assert message.startswith("recovering failed: ")
        assert "rollback" not in message.lower()
        assert "connection" in message.lower(), message
        assert raised.value.is_transient
    finally:
        if not stoppable.server.running:  # type: ignore[attr-defined]
            stoppable.start()
        await store.close()
        if shared:
            await engine.dispose()
