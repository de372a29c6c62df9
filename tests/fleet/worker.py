"""One host process of the fleet tests, in a process of its own.

Run as ``python -m tests.fleet.worker URL CONTROL GROUP NAME JOURNAL``. The process serves
the host group ``GROUP`` of the control schema ``CONTROL``; for each cluster it gains it
recovers, then commits one new task at a time and journals each acknowledged one
(``schema``, ``epoch``, this process's id, the task id) *after* the acknowledgement, so
the journal never claims more than the store acknowledged.
``SIGTERM`` closes the host (hands every cluster over) and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from cronoq_store import FencedError, PgStoreConfig, StoreError, TaskSpec
from cronoq_store._domain import Submitted, TimeBase, task_id
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig

from ..torture.journal import Journal

#: Fast settings: a lost session is noticed within 3 s, a free lock within 0.2 s.
STORE = PgStoreConfig(lock_poll=0.2, keepalive=0.5, session_timeout=3.0, commit_timeout=10.0)


def host_config(group: str, control: str) -> PgHostConfig:
    return PgHostConfig(
        store=STORE, control_schema=control, group=group, max_connections=3, join_settle=0.5
    )


async def _lead(store: HostedStore, journal: Journal, process_id: int) -> None:
    base = TimeBase.now()
    recovered = await store.recover(base)
    epoch = store.epoch
    assert epoch is not None
    schema = store.config.schema
    journal.write("lead", schema=schema, epoch=epoch, process=process_id)
    n = 0
    lost = asyncio.ensure_future(store.leadership_lost())
    try:
        while not lost.done():
            n += 1
            id = task_id(epoch, n)
            spec = TaskSpec(b"fleet %d" % n)
            try:
                await store.commit(epoch, base, [Submitted(id, n, base.engine_ns, spec)], [])
            except FencedError:
                journal.write("fenced", schema=schema, epoch=epoch, process=process_id)
                return
            except StoreError as error:
                journal.write("error", schema=schema, epoch=epoch, error=str(error))
                await asyncio.sleep(0.1)
                continue
            journal.write("ack", schema=schema, epoch=epoch, process=process_id, id=id)
            await asyncio.wait({lost}, timeout=0.05)
    finally:
        lost.cancel()
    del recovered


async def main(url: str, control: str, group: str, name: str, journal_path: str) -> int:
    journal = Journal(Path(journal_path), name)
    host = await PgHost.connect(url, host_config(group, control))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def lead(store: HostedStore) -> None:
        await _lead(store, journal, host.process_id or 0)

    serving = asyncio.ensure_future(host.serve(lead))
    await stop.wait()
    await host.close()
    await serving
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(*sys.argv[1:6])))
