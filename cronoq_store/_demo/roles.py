"""The demo's roles, each in its own process (``python -m cronoq_store._demo ROLE``).

``lead`` (instance A) leads and acknowledges submissions until it is killed, recording each
acknowledgement the moment its ``await`` returns; ``standby`` (B) waits, takes over,
recovers and writes under its new epoch; ``zombie`` holds A's epoch and tries to write
after the takeover. ``host`` (the fleet variant) is one host process: it leads its share of
the demo's host group and acknowledges submissions to every cluster it leads, recording
each with its cluster and epoch. Each reports in JSON lines on stdout and ends when its
stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from .._committer import GroupCommitter
from .._config import PgStoreConfig
from .._domain import StatusChanged, Submitted, TaskSpec, TaskStatus, TimeBase, task_id
from .._errors import FencedError, StoreError
from .._host.host import HostedStore, PgHost, PgHostConfig
from .._store import PgStore

__all__ = ["URL_ENV", "ZOMBIE_KIND", "ZOMBIE_MESSAGE", "main"]

#: Where a role finds the database URL (never in ``argv``, which ``ps`` shows).
URL_ENV = "CRONOQ_DEMO_URL"
#: What marks the zombie's stale writes, for the orchestrator to look for in the table.
ZOMBIE_KIND = "zombie"
ZOMBIE_MESSAGE = "stale write by the zombie"
_POOLS = ("default", "email", "reports")
_PAYLOAD = b'{"to": "someone@example.com"}'
#: Every this many tasks, a submitter also runs the task and reports its success.
_FINISH_EVERY = 4
#: The zombie's new task ids count from here: far above anything A issues in a demo.
_ZOMBIE_FIRST = 1 << 40
_STATS_INTERVAL = 0.25


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


class _Orders:
    """Lines from the orchestrator on stdin, read by a thread so the event loop never blocks.

    ``closed`` is set at end of input: the orchestrator closed stdin, or died.
    """

    def __init__(self, stdin: IO[str]) -> None:
        loop = asyncio.get_running_loop()
        self._lines: asyncio.Queue[str] = asyncio.Queue()
        self.closed = asyncio.Event()

        def read() -> None:
            for line in stdin:
                loop.call_soon_threadsafe(self._lines.put_nowait, line.strip())
            loop.call_soon_threadsafe(self.closed.set)

        threading.Thread(target=read, name="orders", daemon=True).start()

    async def next(self) -> str:
        return await self._lines.get()


def _config(schema: str, role: str) -> PgStoreConfig:
    """Timings short enough for a demo: the standby polls the lock ten times a second."""
    return PgStoreConfig(
        schema=schema,
        lock_poll=0.1,
        keepalive=0.2,
        session_timeout=2.0,
        application_name=f"cronoq-demo {role}",
    )


async def _connect(args: argparse.Namespace, role: str) -> PgStore:
    return await PgStore.connect(os.environ[URL_ENV], _config(args.schema, role))


async def _lead(args: argparse.Namespace, orders: _Orders) -> None:
    """Instance A: lead, then acknowledge submissions until killed."""
    async with await _connect(args, "A") as store:
        epoch = await store.acquire_leadership()
        base = TimeBase.now()
        await store.recover(base)
        _emit("leading", epoch=epoch)
        await orders.next()
        acks = os.open(args.acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        async with GroupCommitter(store, epoch, base) as committer:
            numbers = itertools.count()
            workers = [
                asyncio.ensure_future(_submit_forever(committer, epoch, numbers, acks))
                for _ in range(args.submitters)
            ]
            _emit("submitting", t=time.monotonic())
            try:
                while True:
                    await asyncio.sleep(_STATS_INTERVAL)
                    for worker in workers:
                        if worker.done():
                            worker.result()  # a submitter failed: crash loudly, not quietly
                    stats = committer.stats()
                    p99 = stats.latency_p99
                    _emit(
                        "stats",
                        commits=stats.commits,
                        mean_batch=stats.mean_batch_submissions,
                        p99_ms=None if p99 is None else p99 * 1000,
                    )
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)


async def _submit_forever(
    committer: GroupCommitter, epoch: int, numbers: Iterator[int], acks: int, where: bytes = b""
) -> None:
    """One client: submit a task, and run every few to success; record each ack at once,
    followed by ``where`` (the fleet's cluster, epoch and process).

    ``os.write`` puts the record in the kernel before the next line of Python runs, so a
    SIGKILL cannot lose an acknowledgement that was recorded.
    """
    while True:
        n = next(numbers)
        tid = task_id(epoch, n)
        spec = TaskSpec(_PAYLOAD, kind="email", pool=_POOLS[n % len(_POOLS)])
        await committer.submit([Submitted(tid, n, time.monotonic_ns(), spec)])
        os.write(acks, b"T %d%s\n" % (tid, where))
        if n % _FINISH_EVERY:
            continue
        await committer.submit([StatusChanged(tid, TaskStatus.RUNNING, 1, time.monotonic_ns())])
        os.write(acks, b"R %d%s\n" % (tid, where))
        done = StatusChanged(tid, TaskStatus.SUCCEEDED, 1, time.monotonic_ns())
        await committer.submit([done], [(tid, b"sent")])
        os.write(acks, b"S %d%s\n" % (tid, where))


async def _standby(args: argparse.Namespace, orders: _Orders) -> None:
    """Instance B: wait for leadership, recover, write under the new epoch, then idle."""
    async with await _connect(args, "B") as store:
        _emit("standby")
        epoch = await store.acquire_leadership()
        acquired = time.monotonic()
        base = TimeBase.now()
        state = await store.recover(base)
        recovered = time.monotonic()
        lines = [f"{t.id} {'started' if t.attempt else 'queued'}\n" for t in state.tasks]
        lines += [f"{t.id} {t.status.value}\n" for t in state.terminal]
        await asyncio.to_thread(Path(args.recovered).write_text, "".join(lines))
        _emit("recovered", epoch=epoch, acquired=acquired, recovered=recovered)
        async with GroupCommitter(store, epoch, base) as committer:
            tid = task_id(epoch, 0)
            spec = TaskSpec(b"B resumed", kind="email")
            await committer.submit([Submitted(tid, 0, time.monotonic_ns(), spec)])
        _emit("resumed", id=tid)
        await orders.closed.wait()


async def _zombie(args: argparse.Namespace, orders: _Orders) -> None:
    """A copy of A that missed the takeover: it still commits with A's epoch."""
    async with await _connect(args, "zombie") as store:
        _emit("ready")
        await orders.next()
        now = time.monotonic_ns()
        base = TimeBase.now()

        async def stale(i: int) -> None:
            n = _ZOMBIE_FIRST + i
            new = Submitted(task_id(args.epoch, n), n, now, TaskSpec(b"stale", kind=ZOMBIE_KIND))
            # Cancel a task A had acknowledged: landing, it would undo a promise.
            cancel = StatusChanged(
                task_id(args.epoch, i), TaskStatus.CANCELLED, 1, now, ZOMBIE_MESSAGE
            )
            await committer.submit([new, cancel])

        async with GroupCommitter(store, args.epoch, base) as committer:
            outcomes = await asyncio.gather(
                *(stale(i) for i in range(args.writes)), return_exceptions=True
            )
        _emit(
            "fenced",
            tried=len(outcomes),
            refused=sum(isinstance(o, FencedError) for o in outcomes),
            acknowledged=sum(o is None for o in outcomes),
            errors=sorted(
                {repr(o) for o in outcomes if isinstance(o, Exception)}
                - {repr(o) for o in outcomes if isinstance(o, FencedError)}
            )[:3],
        )
        await orders.closed.wait()


def _host_config(args: argparse.Namespace) -> PgHostConfig:
    """The demo's timings (:func:`_config`'s), on a pool of four whatever the clusters."""
    return PgHostConfig(
        store=_config("public", f"host {args.name}"),
        control_schema=args.control,
        group=args.group,
        max_connections=4,
        join_settle=0.5,
    )


async def _host(args: argparse.Namespace, orders: _Orders) -> None:
    """One host process of the fleet variant: lead the group's share of clusters and
    acknowledge submissions to each, until killed or its stdin closes (then it hands every
    cluster over). Each lead's recovery goes to ``--recovered`` (``schema epoch id state``)."""
    acks = os.open(args.acks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    recovered_file = os.open(args.recovered, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    host = await PgHost.connect(os.environ[URL_ENV], _host_config(args))

    async def lead(store: HostedStore) -> None:
        base = TimeBase.now()
        state = await store.recover(base)
        epoch, schema = store.epoch, store.config.schema
        if epoch is None:  # handed over while recovering (the group balancing)
            return
        term = f"{schema} {epoch}"
        lines = [f"{term} {t.id} {'started' if t.attempt else 'queued'}\n" for t in state.tasks]
        lines += [f"{term} {t.id} {t.status.value}\n" for t in state.terminal]
        os.write(recovered_file, "".join(lines).encode())
        _emit("leading", schema=schema, epoch=epoch, process=host.process_id, t=time.monotonic())
        where = f" {schema} {epoch} {host.process_id}".encode()
        try:
            async with GroupCommitter(store, epoch, base) as committer:
                numbers = itertools.count()
                workers = {
                    asyncio.ensure_future(_submit_forever(committer, epoch, numbers, acks, where))
                    for _ in range(args.submitters)
                }
                lost = asyncio.ensure_future(store.leadership_lost())
                await asyncio.wait({lost, *workers}, return_when=asyncio.FIRST_COMPLETED)
                for task in (lost, *workers):
                    task.cancel()
                outcomes = await asyncio.gather(*workers, return_exceptions=True)
        except StoreError:
            if store.epoch is not None:
                raise
            return  # the term ended (handed over): its committer's errors are expected
        failed = [o for o in outcomes if isinstance(o, Exception) and not isinstance(o, StoreError)]
        if failed:
            raise failed[0]

    serving = asyncio.ensure_future(host.serve(lead))
    _emit("serving")
    try:
        await orders.closed.wait()
    finally:
        await host.close()
        await serving


_ROLES: Mapping[str, Callable[[argparse.Namespace, _Orders], Awaitable[None]]] = {
    "lead": _lead,
    "standby": _standby,
    "zombie": _zombie,
    "host": _host,
}


async def _play_role(args: argparse.Namespace) -> None:
    orders = _Orders(sys.stdin)
    work = asyncio.ensure_future(_ROLES[args.role](args, orders))
    closed = asyncio.ensure_future(orders.closed.wait())
    await asyncio.wait({work, closed}, return_when=asyncio.FIRST_COMPLETED)
    closed.cancel()
    if not work.done():
        work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work


def main(argv: list[str] | None = None) -> None:
    """Entry point of a role's process (the orchestrator starts these; people do not)."""
    parser = argparse.ArgumentParser(prog="python -m cronoq_store._demo")
    parser.add_argument("role", choices=sorted(_ROLES))
    parser.add_argument("--schema")
    parser.add_argument("--control")
    parser.add_argument("--group")
    parser.add_argument("--name")
    parser.add_argument("--acks")
    parser.add_argument("--recovered")
    parser.add_argument("--submitters", type=int, default=1)
    parser.add_argument("--epoch", type=int)
    parser.add_argument("--writes", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    asyncio.run(_play_role(args))
