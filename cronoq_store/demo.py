"""The HA demo: crash a leader mid-stream and show that nothing it acknowledged is lost.

Every instance is a real process (``python -m cronoq_store.demo ROLE``), so the crash is a
real ``SIGKILL``: no ``finally`` runs, no connection is closed politely. The orchestrator
(:func:`run_demo`) plays the operator:

1. Instance A leads, recovers, and acknowledges submissions from many concurrent submitter
   coroutines through :class:`~cronoq_store.group_commit.GroupCommitter`. Each submitter
   appends every acknowledged write to a file the moment its ``await`` returns, outside the
   database: that file is what clients were promised.
2. B waits as standby; a zombie process holds A's epoch, as a partitioned copy of A would.
3. A is killed. B takes over with the next epoch and recovers; the takeover is timed from
   the kill to B leading with its state recovered. B then writes under its own epoch.
4. The zombie tries to commit with A's epoch and must be fenced.
5. Every acknowledged write must be in B's recovery and in the table, and nothing the zombie
   tried may be there.

Child processes talk to the orchestrator in JSON lines on stdout and take orders on stdin;
closing their stdin (or the orchestrator dying) ends them. The database URL reaches them in
the environment, never in ``argv``, which any user can read with ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import func, or_, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import DropSchema

from .config import PgStoreConfig
from .domain import StatusChanged, Submitted, TaskSpec, TaskStatus, TimeBase, task_id
from .errors import FencedError
from .group_commit import GroupCommitter
from .migrations import upgrade
from .schema import schema_options, tasks
from .store import PgStore
from .urls import async_url, redact

__all__ = ["DemoError", "DemoReport", "find_lost", "parse_acks", "run_demo"]

_URL_ENV = "CRONOQ_DEMO_URL"
_POOLS = ("default", "email", "reports")
_PAYLOAD = b'{"to": "someone@example.com"}'
#: Every this many tasks, a submitter also runs the task and reports its success.
_FINISH_EVERY = 4
#: The zombie's new task ids count from here: far above anything A issues in a demo.
_ZOMBIE_FIRST = 1 << 40
_ZOMBIE_KIND = "zombie"
_ZOMBIE_MESSAGE = "stale write by the zombie"
_START_TIMEOUT = 60.0
_TAKEOVER_TIMEOUT = 30.0
_STATS_INTERVAL = 0.25

# What an acknowledgement promises, and which recovered or stored states keep the promise:
# T a task was accepted; R it started running; S it succeeded.
_KEPT: Mapping[str, frozenset[str] | None] = {
    "T": None,  # any state: the task exists
    "R": frozenset({"started", "running", "succeeded"}),
    "S": frozenset({"succeeded"}),
}


class DemoError(Exception):
    """The demo could not run to the end (a process died, a server did not start...)."""


# --- the verdict, pure so that it can be tested to fail -------------------------------------


def parse_acks(text: str) -> list[tuple[str, int]]:
    """Acknowledged writes as ``(kind, task id)``; a torn last line was never complete, so
    it was not an acknowledgement anyone saw."""
    acks = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        kind, _, value = line.strip().partition(" ")
        acks.append((kind, int(value)))
    return acks


def find_lost(
    acks: Iterable[tuple[str, int]],
    recovered: Mapping[int, str],
    stored: Mapping[int, str],
) -> list[tuple[str, int]]:
    """Acknowledged writes that the recovery or the table does not show.

    ``recovered`` maps ids to ``queued``/``started`` (live, by attempt) or a finished status;
    ``stored`` maps ids to the table's ``status``. A task must exist in both; a start must
    show as started, running or succeeded; a success as succeeded.
    """
    lost = []
    for kind, tid in acks:
        kept = _KEPT[kind]
        for view in (recovered, stored):
            state = view.get(tid)
            if state is None or (kept is not None and state not in kept):
                lost.append((kind, tid))
                break
    return lost


@dataclass
class DemoReport:
    """What happened, for the account; ``failures`` is empty when the demo proved its point."""

    server: str
    schema: str
    submitters: int
    epoch_a: int = 0
    epoch_b: int = 0
    window: float = 0.0
    acked_tasks: int = 0
    acked_writes: int = 0
    acquire_seconds: float = 0.0
    recover_seconds: float = 0.0
    recovered: int = 0
    unacked_committed: int = 0
    lost: list[tuple[str, int]] = field(default_factory=list)
    resumed: bool = False
    stale_tried: int = 0
    stale_refused: int = 0
    stale_landed: int = 0
    commits: int = 0
    mean_batch: float = 0.0
    p99_ms: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def takeover_seconds(self) -> float:
        return self.acquire_seconds + self.recover_seconds

    @property
    def throughput(self) -> float:
        return self.acked_writes / self.window if self.window > 0 else 0.0


def render(report: DemoReport, console: Console) -> None:
    """The account: short enough to read at a glance, precise enough to check."""
    account = Table(
        title="the account", title_justify="left", show_header=False, box=None, padding=(0, 2)
    )
    account.add_column(style="bold")
    account.add_column()
    p99 = "" if report.p99_ms is None else f", p99 {report.p99_ms:.0f} ms"
    rows = [
        ("epochs", f"A led epoch {report.epoch_a}, B took over with epoch {report.epoch_b}"),
        (
            "takeover",
            f"{report.takeover_seconds:.2f} s from SIGKILL: lock {report.acquire_seconds:.2f} s"
            f" + recovery {report.recover_seconds:.2f} s",
        ),
        (
            "acknowledged",
            f"{report.acked_tasks:,} tasks; {report.acked_writes:,} writes with status "
            f"changes, in {report.window:.1f} s",
        ),
        (
            "throughput",
            f"{report.throughput:,.0f} acks/s; {report.commits:,} commits, "
            f"{report.mean_batch:.0f} submissions each{p99}",
        ),
        (
            "recovered",
            f"{report.recovered:,} tasks ({report.unacked_committed:,} committed, not yet acked)",
        ),
        ("lost", f"{len(report.lost):,}"),
        (
            "stale writes",
            f"{report.stale_refused:,} of {report.stale_tried:,} refused (FencedError), "
            f"{report.stale_landed:,} landed",
        ),
    ]
    for name, value in rows:
        account.add_row(name, value)
    console.print(account)
    if report.ok:
        console.print(
            "[green]OK[/green]: every acknowledged write survived the crash, "
            "and the zombie wrote nothing"
        )
    else:
        for failure in report.failures:
            console.print(f"[red]FAILED[/red]: {escape(failure)}")


# --- the orchestrator -----------------------------------------------------------------------


async def run_demo(
    url: str | URL | None, *, submitters: int, seconds: float, console: Console
) -> DemoReport:
    """Run the demo on ``url`` (in a throwaway schema, dropped afterwards) or, without one,
    on an embedded PostgreSQL; print the steps and the account to ``console``."""
    if url is not None:
        parsed = make_url(url) if isinstance(url, str) else url
        return await _run_on(parsed, None, submitters, seconds, console)
    from .testing import EmbeddedPostgres

    try:
        server = EmbeddedPostgres()
    except RuntimeError as exc:
        raise DemoError(f"{exc}; or pass --url to run the demo on another server") from None
    try:
        try:
            await asyncio.to_thread(server.start)
        except RuntimeError as exc:
            raise DemoError(f"the embedded PostgreSQL did not start: {exc}") from None
        return await _run_on(server.url(), "embedded", submitters, seconds, console)
    finally:
        await asyncio.to_thread(server.destroy)


async def _run_on(
    url: URL, kind: str | None, submitters: int, seconds: float, console: Console
) -> DemoReport:
    schema = f"cronoq_demo_{secrets.token_hex(4)}"
    engine = create_async_engine(async_url(url), poolclass=NullPool, hide_parameters=True)
    try:
        # A failed upgrade leaves nothing behind; from here on the schema must be dropped.
        await upgrade(engine, schema)
        try:
            async with engine.connect() as conn:
                version = await conn.scalar(select(func.current_setting("server_version")))
            where = f"{kind} " if kind else ""
            report = DemoReport(
                server=f"{where}PostgreSQL {version} at {redact(url)}",
                schema=schema,
                submitters=submitters,
            )
            _step(console, "[bold]cronoq-store HA demo[/bold]")
            _step(console, f"• {escape(report.server)}, schema {schema}")
            with tempfile.TemporaryDirectory(prefix="cronoq-demo-") as workdir:
                await _play(url, Path(workdir), engine, report, seconds, console)
        finally:
            await _drop_schema(engine, schema, console)
    finally:
        await engine.dispose()
    render(report, console)
    return report


async def _play(
    url: URL,
    workdir: Path,
    engine: AsyncEngine,
    report: DemoReport,
    seconds: float,
    console: Console,
) -> None:
    acks_path = workdir / "acks"
    recovered_path = workdir / "recovered"
    env = {**os.environ, _URL_ENV: url.render_as_string(hide_password=False)}
    common = ["--schema", report.schema]
    children: list[_Child] = []

    async def spawn(name: str, *args: str) -> _Child:
        child = await _Child.spawn(name, [*args, *common], env, workdir)
        children.append(child)
        return child

    try:
        a = await spawn(
            "A", "lead", "--acks", str(acks_path), "--submitters", str(report.submitters)
        )
        report.epoch_a = (await a.expect("leading", _START_TIMEOUT))["epoch"]
        _step(console, f"• A (pid {a.pid}) leads with epoch {report.epoch_a}")
        b = await spawn("B", "standby", "--recovered", str(recovered_path))
        zombie = await spawn(
            "zombie", "zombie", "--epoch", str(report.epoch_a), "--writes", str(report.submitters)
        )
        await b.expect("standby", _START_TIMEOUT)
        await zombie.expect("ready", _START_TIMEOUT)
        _step(
            console,
            f"• B (pid {b.pid}) waits as standby; a zombie (pid {zombie.pid}) holds A's epoch "
            f"{report.epoch_a}",
        )

        a.send("go")
        started = (await a.expect("submitting", _START_TIMEOUT))["t"]
        _step(
            console,
            f"• A accepts submissions from {report.submitters} concurrent submitters "
            f"for {seconds:g} s ...",
        )
        if await a.exits_within(seconds):
            raise DemoError(f"A exited before it was killed:\n{a.log_tail()}")
        killed = time.monotonic()
        a.kill()
        await a.exits_within(_START_TIMEOUT)
        report.window = killed - started
        acks = parse_acks(acks_path.read_text() if acks_path.exists() else "")
        report.acked_writes = len(acks)
        report.acked_tasks = sum(1 for kind, _ in acks if kind == "T")
        stats = a.last.get("stats", {})
        report.commits = stats.get("commits", 0)
        report.mean_batch = stats.get("mean_batch", 0.0)
        report.p99_ms = stats.get("p99_ms")
        _step(console, f"• SIGKILL A mid-stream, after {report.acked_writes:,} acknowledged writes")
        if not acks:
            report.failures.append(f"A acknowledged nothing in {seconds:g} s")

        took_over = await b.expect("recovered", _TAKEOVER_TIMEOUT)
        report.epoch_b = took_over["epoch"]
        report.acquire_seconds = took_over["acquired"] - killed
        report.recover_seconds = took_over["recovered"] - took_over["acquired"]
        recovered = _read_recovered(recovered_path)
        report.recovered = len(recovered)
        acked_ids = {tid for kind, tid in acks if kind == "T"}
        report.unacked_committed = len(recovered.keys() - acked_ids)
        _step(
            console,
            f"• B took over with epoch {report.epoch_b} in {report.takeover_seconds:.2f} s "
            f"and recovered {report.recovered:,} tasks",
        )
        resumed = (await b.expect("resumed", _TAKEOVER_TIMEOUT))["id"]

        zombie.send("go")
        fenced = await zombie.expect("fenced", _TAKEOVER_TIMEOUT)
        report.stale_tried = fenced["tried"]
        report.stale_refused = fenced["refused"]
        _step(
            console,
            f"• the zombie tried {report.stale_tried} stale writes with epoch {report.epoch_a}: "
            f"{report.stale_refused} refused",
        )
        for child in (b, zombie):
            child.close()
        for child in (b, zombie):
            if not await child.exits_within(_START_TIMEOUT):
                raise DemoError(f"{child.name} did not exit:\n{child.log_tail()}")

        stored, landed = await _read_table(engine, report.schema)
        report.lost = find_lost(acks, recovered, stored)
        report.stale_landed = landed
        report.resumed = resumed in stored
        _judge(report, fenced)
    finally:
        for child in children:
            await child.stop()


async def _drop_schema(engine: AsyncEngine, schema: str, console: Console) -> None:
    try:
        async with engine.begin() as conn:
            await conn.execute(DropSchema(schema, cascade=True, if_exists=True))
    except Exception as exc:  # the demo's own outcome matters more: say what is left behind
        _step(console, f"could not drop the demo schema {schema}: {escape(str(exc))}")


def _step(console: Console, text: str) -> None:
    """One line per step; the terminal wraps it, so a URL is never split mid-way."""
    console.print(text, soft_wrap=True)


def _judge(report: DemoReport, fenced: Mapping[str, Any]) -> None:
    if report.epoch_b == report.epoch_a:
        report.failures.append(f"B took over with A's epoch {report.epoch_a}")
    if report.lost:
        shown = ", ".join(f"{kind} {tid}" for kind, tid in report.lost[:5])
        more = ", ..." if len(report.lost) > 5 else ""
        report.failures.append(f"{len(report.lost)} acknowledged writes lost ({shown}{more})")
    if report.stale_landed:
        report.failures.append(f"{report.stale_landed} stale writes from the zombie landed")
    if report.stale_refused != report.stale_tried or fenced["acknowledged"]:
        report.failures.append(
            f"the zombie was not fenced: {fenced['acknowledged']} acknowledged, "
            f"errors {fenced['errors']}"
        )
    if not report.resumed:
        report.failures.append("B's write under its new epoch is not in the table")


def _read_recovered(path: Path) -> dict[int, str]:
    recovered = {}
    for line in path.read_text().splitlines():
        tid, state = line.split()
        recovered[int(tid)] = state
    return recovered


async def _read_table(engine: AsyncEngine, schema: str) -> tuple[dict[int, str], int]:
    """Every task's status, and how many rows carry a zombie's write."""
    db = engine.execution_options(**schema_options(schema))
    async with db.connect() as conn:
        stored = {
            row.id: row.status for row in await conn.execute(select(tasks.c.id, tasks.c.status))
        }
        landed = (
            await conn.execute(
                select(func.count()).where(
                    or_(tasks.c.kind == _ZOMBIE_KIND, tasks.c.message == _ZOMBIE_MESSAGE)
                )
            )
        ).scalar_one()
    return stored, landed


class _Child:
    """One role's process: its JSON events, in order, and its stderr in a log file."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self._log = log
        self._events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        #: The latest event of each name (A's stats keep coming until it dies).
        self.last: dict[str, dict[str, Any]] = {}
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def spawn(cls, name: str, args: list[str], env: dict[str, str], workdir: Path) -> _Child:
        log = workdir / f"{name}.log"
        with log.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "cronoq_store.demo",
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        return cls(name, proc, log)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            async for line in self.proc.stdout:
                event = json.loads(line)
                self.last[event["event"]] = event
                self._events.put_nowait(event)
        finally:
            self._events.put_nowait(None)

    async def expect(self, name: str, timeout: float) -> dict[str, Any]:
        """Wait for the event ``name``; a process that dies or stalls first fails the demo."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = await asyncio.wait_for(self._events.get(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise DemoError(
                    f"{self.name} did not report {name!r} within {timeout:g} s:\n{self.log_tail()}"
                ) from None
            if event is None:
                raise DemoError(
                    f"{self.name} exited ({await self.proc.wait()}) before reporting {name!r}:\n"
                    f"{self.log_tail()}"
                )
            if event["event"] == name:
                return event

    def send(self, order: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(order.encode() + b"\n")

    def close(self) -> None:
        """Close its stdin: the role ends and releases what it holds."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)

    async def exits_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.proc.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Make sure the process is gone and its pipes are closed."""
        if self.proc.returncode is None:
            self.kill()
        await self.proc.wait()
        await asyncio.wait({self._reader})
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# --- the roles, each in its own process ------------------------------------------------------


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
    return await PgStore.connect(os.environ[_URL_ENV], _config(args.schema, role))


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
    committer: GroupCommitter, epoch: int, numbers: Iterator[int], acks: int
) -> None:
    """One client: submit a task, and run every few to success; record each ack at once.

    ``os.write`` puts the record in the kernel before the next line of Python runs, so a
    SIGKILL cannot lose an acknowledgement that was recorded.
    """
    while True:
        n = next(numbers)
        tid = task_id(epoch, n)
        spec = TaskSpec(_PAYLOAD, kind="email", pool=_POOLS[n % len(_POOLS)])
        await committer.submit([Submitted(tid, n, time.monotonic_ns(), spec)])
        os.write(acks, b"T %d\n" % tid)
        if n % _FINISH_EVERY:
            continue
        await committer.submit([StatusChanged(tid, TaskStatus.RUNNING, 1, time.monotonic_ns())])
        os.write(acks, b"R %d\n" % tid)
        done = StatusChanged(tid, TaskStatus.SUCCEEDED, 1, time.monotonic_ns())
        await committer.submit([done], [(tid, b"sent")])
        os.write(acks, b"S %d\n" % tid)


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
            new = Submitted(task_id(args.epoch, n), n, now, TaskSpec(b"stale", kind=_ZOMBIE_KIND))
            # Cancel a task A had acknowledged: landing, it would undo a promise.
            cancel = StatusChanged(
                task_id(args.epoch, i), TaskStatus.CANCELLED, 1, now, _ZOMBIE_MESSAGE
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


_ROLES: Mapping[str, Callable[[argparse.Namespace, _Orders], Awaitable[None]]] = {
    "lead": _lead,
    "standby": _standby,
    "zombie": _zombie,
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
    parser = argparse.ArgumentParser(prog="python -m cronoq_store.demo")
    parser.add_argument("role", choices=sorted(_ROLES))
    parser.add_argument("--schema", required=True)
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


if __name__ == "__main__":
    main()
