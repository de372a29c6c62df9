"""One host process of the fleet torture test (``tests/fleet/torture.py``).

Run as ``python -m tests.fleet.torture_worker URL CONTROL GROUP NAME JOURNAL``. The process
serves the host group like ``tests/fleet/worker.py``, with the audit's triggers trusted, and
a workload that also moves tasks written by earlier terms: each commit of a term submits a
new task, starts one task it recovered queued and finishes one it recovered running. Each
transition's message names the term's epoch and this process (``e<epoch> <name>``), so the
checker tells which term wrote each row version. Every acknowledged commit is journalled
after its acknowledgement, with its mutations as ``(task id, attempt, state code)``.

``SIGTERM`` closes the host (hands every cluster over) and exits 0.
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

from cronoq_store import FencedError, StoreError, TaskSpec
from cronoq_store._domain import Mutation, StatusChanged, Submitted, TaskStatus, TimeBase, task_id
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig

from ..torture.journal import Journal
from .worker import STORE, WORKER_URL

#: The audit's triggers on every cluster (``tests/fleet/torture.py``), trusted by name.
TRIGGERS = frozenset({"fleet_audit_insert", "fleet_audit_update", "fleet_audit_epoch"})
#: Shorter than the other fleet tests': a frozen process's host session is ended by the
#: server after 1.5 x session_timeout, so a freeze of a few seconds deposes it.
SESSION_TIMEOUT = 2.0
#: The pause between two commits of one term: a dozen clusters per process stay busy
#: without starving the keeper on a loaded machine.
PAUSE = 0.05


def host_config(group: str, control: str) -> PgHostConfig:
    store = replace(STORE, session_timeout=SESSION_TIMEOUT, trusted_triggers=TRIGGERS)
    return PgHostConfig(
        store=store, control_schema=control, group=group, max_connections=3, join_settle=0.5
    )


def epoch_message(epoch: int, name: str) -> str:
    return f"e{epoch} {name}"


async def _lead(store: HostedStore, journal: Journal, name: str, process_id: int) -> None:
    base = TimeBase.now()
    recovered = await store.recover(base)
    epoch = store.epoch
    schema = store.config.schema
    if epoch is None:  # the term ended while recovering (handed over to balance the group)
        return
    journal.write("lead", schema=schema, epoch=epoch, process=process_id)
    queued = [t.id for t in recovered.tasks if t.attempt == 0]
    running = [t.id for t in recovered.tasks if t.attempt > 0]
    message = epoch_message(epoch, name)
    lost = asyncio.ensure_future(store.leadership_lost())
    n = 0
    try:
        while not lost.done():
            n += 1
            now = time.monotonic_ns()
            new = task_id(epoch, n)
            batch: list[Mutation] = [Submitted(new, n, now, TaskSpec(b"fleet %d" % n))]
            done: list[tuple[int, int, str]] = [(new, 0, "q")]
            started = queued[-1] if queued else None
            finished = running[-1] if running else None
            if started is not None:
                batch.append(StatusChanged(started, TaskStatus.RUNNING, 1, now, message))
                done.append((started, 1, "r"))
            if finished is not None:
                batch.append(StatusChanged(finished, TaskStatus.SUCCEEDED, 1, now, message))
                done.append((finished, 1, "s"))
            sent = time.time()
            try:
                await store.commit(epoch, base, batch, [])
            except FencedError as error:
                journal.write("fenced", schema=schema, epoch=epoch, error=str(error), s=sent)
                break
            except StoreError as error:  # a session ended by the test: the term goes on
                journal.write("error", schema=schema, epoch=epoch, error=str(error), s=sent)
                await asyncio.wait({lost}, timeout=0.1)
                continue
            journal.write("ack", schema=schema, epoch=epoch, process=process_id, m=done, s=sent)
            if finished is not None:
                running.pop()
            if started is not None:
                running.insert(0, queued.pop())
            await asyncio.wait({lost}, timeout=PAUSE)
    finally:
        lost.cancel()


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fleet.torture_worker")
    for name in ("control", "group", "name", "journal"):
        parser.add_argument(name)
    args = parser.parse_args(argv)
    journal = Journal(Path(args.journal), args.name)
    host = await PgHost.connect(os.environ[WORKER_URL], host_config(args.group, args.control))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def lead(store: HostedStore) -> None:
        await _lead(store, journal, args.name, host.process_id or 0)

    serving = asyncio.ensure_future(host.serve(lead))
    journal.write("start")
    await stop.wait()
    await host.close()
    await serving
    journal.write("stop")
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
