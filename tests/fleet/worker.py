"""One host process of the fleet tests, in a process of its own.

Run as ``python -m tests.fleet.worker URL CONTROL GROUP NAME JOURNAL [OPTIONS]``. The
process serves the host group ``GROUP`` of the control schema ``CONTROL``; for each cluster
it gains it recovers, then commits one new task at a time and journals each acknowledged
one (``schema``, ``epoch``, this process's id, the task id, ``s`` when its commit was sent)
*after* the acknowledgement, so the journal never claims more than the store acknowledged.
``SIGTERM`` closes the host (hands every cluster over) and exits 0.

Options, for tests that cut a process off (``tests/fleet/test_cutoff.py``):

- ``--commit-timeout SECONDS``: commits (and the application's ``handover_grace``) wait
  that long, so a commit sent into a stalled path is still waiting when the path resumes,
  and the database, not a local timeout, answers it;
- ``--late``: journal each step-down (``down``, with the term's reason) as the host marks
  it, then try one more commit under the ended term's epoch and journal what it got
  (``late``): a deposed term must never be acknowledged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from cronoq_store import FencedError, PgStoreConfig, StoreError, TaskSpec
from cronoq_store._domain import Submitted, TimeBase, task_id
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig

from ..torture.journal import Journal

#: Where a worker finds its URL: not on its command line, which any local user can read.
WORKER_URL = "FLEET_WORKER_URL"

#: Fast settings: a lost session is noticed within 3 s, a free lock within 0.2 s.
STORE = PgStoreConfig(lock_poll=0.2, keepalive=0.5, session_timeout=3.0, commit_timeout=10.0)


def host_config(group: str, control: str, commit_timeout: float | None = None) -> PgHostConfig:
    config = PgHostConfig(
        store=STORE, control_schema=control, group=group, max_connections=3, join_settle=0.5
    )
    if commit_timeout is None:
        return config
    return replace(
        config,
        store=replace(STORE, commit_timeout=commit_timeout),
        handover_grace=commit_timeout,
    )


async def _commit_one(store: HostedStore, epoch: int, base: TimeBase, n: int) -> None:
    spec = TaskSpec(b"fleet %d" % n)
    await store.commit(epoch, base, [Submitted(task_id(epoch, n), n, base.engine_ns, spec)], [])


async def _lead(store: HostedStore, journal: Journal, process_id: int, late: bool) -> None:
    base = TimeBase.now()
    recovered = await store.recover(base)
    epoch = store.epoch
    schema = store.config.schema
    if epoch is None:  # the term ended while recovering (handed over to balance the group)
        journal.write("gone", schema=schema, process=process_id)
        return
    journal.write("lead", schema=schema, epoch=epoch, process=process_id)
    n = 0
    lost = asyncio.ensure_future(store.leadership_lost())
    if late:

        def down(done: asyncio.Future[None]) -> None:
            if not done.cancelled():
                reason = getattr(store._leadership, "reason", None)
                journal.write("down", schema=schema, epoch=epoch, process=process_id, why=reason)

        lost.add_done_callback(down)
    try:
        while not lost.done():
            n += 1
            sent = time.time()
            try:
                await _commit_one(store, epoch, base, n)
            except FencedError:
                journal.write("fenced", schema=schema, epoch=epoch, process=process_id, s=sent)
                break
            except StoreError as error:
                journal.write("error", schema=schema, epoch=epoch, error=str(error), s=sent)
                await asyncio.sleep(0.1)
                continue
            journal.write(
                "ack", schema=schema, epoch=epoch, process=process_id, id=task_id(epoch, n), s=sent
            )
            await asyncio.wait({lost}, timeout=0.05)
        if late:
            await lost
            n += 1
            try:
                await _commit_one(store, epoch, base, n)
            except StoreError as error:
                got = type(error).__name__
            else:
                got = "ack"
            journal.write("late", schema=schema, epoch=epoch, process=process_id, got=got)
    finally:
        lost.cancel()
    del recovered


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.fleet.worker")
    for name in ("control", "group", "name", "journal"):
        parser.add_argument(name)
    parser.add_argument("--commit-timeout", type=float, default=None)
    parser.add_argument("--late", action="store_true")
    return parser.parse_args(argv)


async def main(argv: list[str]) -> int:
    args = _arguments(argv)
    journal = Journal(Path(args.journal), args.name)
    host = await PgHost.connect(
        os.environ[WORKER_URL], host_config(args.group, args.control, args.commit_timeout)
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def lead(store: HostedStore) -> None:
        await _lead(store, journal, host.process_id or 0, args.late)

    serving = asyncio.ensure_future(host.serve(lead))
    await stop.wait()
    await host.close()
    await serving
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
