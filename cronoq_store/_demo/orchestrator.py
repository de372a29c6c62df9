"""The demo's orchestrator: it plays the operator, starting, killing and judging the roles.

Each role is a real process (:mod:`cronoq_store._demo.roles`), so the crash is a real
``SIGKILL``. Children talk to the orchestrator in JSON lines on stdout and take orders on
stdin; the database URL reaches them in the environment, never in ``argv``, which any user
can read with ``ps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import DropSchema

from .. import _catalog as catalog
from .._door import engine_arguments
from .._errors import StoreError
from .._migrations import upgrade
from .._schema import schema_options
from .._terminal_safe import visible
from .._urls import redact
from .roles import URL_ENV, ZOMBIE_KIND, ZOMBIE_MESSAGE
from .verdict import DemoReport, find_lost, judge, parse_acks, render

__all__ = ["Child", "DemoError", "drop_schema", "run_demo", "server_for", "server_line", "step"]

_START_TIMEOUT = 60.0
_TAKEOVER_TIMEOUT = 30.0


class DemoError(StoreError):
    """The demo could not run to the end (a process died, a server did not start...)."""


async def run_demo(
    url: str | URL | None, *, submitters: int, seconds: float, console: Console
) -> DemoReport:
    """Run the demo on ``url`` (in a throwaway schema, dropped afterwards) or, without one,
    on an embedded PostgreSQL; print the steps and the account to ``console``."""
    async with server_for(url) as (where, kind):
        return await _run_on(where, kind, submitters, seconds, console)


@contextlib.asynccontextmanager
async def server_for(url: str | URL | None) -> AsyncIterator[tuple[URL, str | None]]:
    """The server a demo runs on, and its kind: ``url``'s, or (without one) an embedded
    PostgreSQL, destroyed afterwards."""
    if url is not None:
        yield (make_url(url) if isinstance(url, str) else url), None
        return
    from ..testing._server import EmbeddedPostgres

    try:
        server = EmbeddedPostgres()
    except RuntimeError as exc:
        raise DemoError(f"{exc}; or pass --url to run the demo on another server") from None
    try:
        try:
            await asyncio.to_thread(server.start)
        except RuntimeError as exc:
            raise DemoError(f"the embedded PostgreSQL did not start: {exc}") from None
        yield server.url(), "embedded"
    finally:
        await asyncio.to_thread(server.destroy)


async def server_line(engine: AsyncEngine, url: URL, kind: str | None) -> str:
    """``PostgreSQL <version> at <url>``, the password masked: the demo's first line."""
    async with engine.connect() as conn:
        version = await conn.scalar(catalog.server_version)
    where = f"{kind} " if kind else ""
    return f"{where}PostgreSQL {version} at {redact(url)}"


async def _run_on(
    url: URL, kind: str | None, submitters: int, seconds: float, console: Console
) -> DemoReport:
    schema = f"cronoq_demo_{secrets.token_hex(4)}"
    dialled, tls = engine_arguments(url)
    engine = create_async_engine(
        dialled, poolclass=NullPool, hide_parameters=True, connect_args=tls
    )
    try:
        # A failed upgrade leaves nothing behind; from here on the schema must be dropped.
        await upgrade(engine, schema)
        try:
            report = DemoReport(
                server=await server_line(engine, url, kind),
                schema=schema,
                submitters=submitters,
            )
            step(console, "[bold]cronoq-store HA demo[/bold]")
            step(console, f"• {escape(visible(report.server))}, schema {schema}")
            with tempfile.TemporaryDirectory(prefix="cronoq-demo-") as workdir:
                await _play(url, Path(workdir), engine, report, seconds, console)
        finally:
            await drop_schema(engine, schema, console)
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
    """The demo, in order: lead, submit, kill the leader, take over, fence the zombie, check.
    Long for a reason: the story is one sequence read top to bottom."""
    acks_path = workdir / "acks"
    recovered_path = workdir / "recovered"
    env = {**os.environ, URL_ENV: url.render_as_string(hide_password=False)}
    common = ["--schema", report.schema]
    children: list[Child] = []

    async def spawn(name: str, *args: str) -> Child:
        child = await Child.spawn(name, [*args, *common], env, workdir)
        children.append(child)
        return child

    try:
        a = await spawn(
            "A", "lead", "--acks", str(acks_path), "--submitters", str(report.submitters)
        )
        report.epoch_a = (await a.expect("leading", _START_TIMEOUT))["epoch"]
        step(console, f"• A (pid {a.pid}) leads with epoch {report.epoch_a}")
        b = await spawn("B", "standby", "--recovered", str(recovered_path))
        zombie = await spawn(
            "zombie", "zombie", "--epoch", str(report.epoch_a), "--writes", str(report.submitters)
        )
        await b.expect("standby", _START_TIMEOUT)
        await zombie.expect("ready", _START_TIMEOUT)
        step(
            console,
            f"• B (pid {b.pid}) waits as standby; a zombie (pid {zombie.pid}) holds A's epoch "
            f"{report.epoch_a}",
        )

        a.send("go")
        started = (await a.expect("submitting", _START_TIMEOUT))["t"]
        step(
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
        step(console, f"• SIGKILL A mid-stream, after {report.acked_writes:,} acknowledged writes")
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
        step(
            console,
            f"• B took over with epoch {report.epoch_b} in {report.takeover_seconds:.2f} s "
            f"and recovered {report.recovered:,} tasks",
        )
        resumed = (await b.expect("resumed", _TAKEOVER_TIMEOUT))["id"]

        zombie.send("go")
        fenced = await zombie.expect("fenced", _TAKEOVER_TIMEOUT)
        report.stale_tried = fenced["tried"]
        report.stale_refused = fenced["refused"]
        step(
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
        judge(report, fenced)
    finally:
        for child in children:
            await child.stop()


async def drop_schema(engine: AsyncEngine, schema: str, console: Console) -> None:
    try:
        async with engine.begin() as conn:
            await conn.execute(DropSchema(schema, cascade=True, if_exists=True))
    except Exception as exc:  # the demo's own outcome matters more: say what is left behind
        step(console, f"could not drop the demo schema {schema}: {escape(visible(str(exc)))}")


def step(console: Console, text: str) -> None:
    """One line per step; the terminal wraps it, so a URL is never split mid-way."""
    console.print(text, soft_wrap=True)


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
        stored = {row.id: row.status for row in await conn.execute(catalog.task_statuses)}
        landed = (
            await conn.execute(
                catalog.tasks_with_kind_or_message, {"kind": ZOMBIE_KIND, "message": ZOMBIE_MESSAGE}
            )
        ).scalar_one()
    return stored, landed


class Child:
    """One role's process: its JSON events, in order, and its stderr in a log file."""

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        log: Path,
        news: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self._log = log
        self._events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        #: The latest event of each name (A's stats keep coming until it dies).
        self.last: dict[str, dict[str, Any]] = {}
        #: Every ``leading`` event, in order (a fleet's host process leads many clusters).
        self.leads: list[dict[str, Any]] = []
        #: Set at each event, for whoever watches several children at once.
        self._news = news
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def spawn(
        cls,
        name: str,
        args: list[str],
        env: dict[str, str],
        workdir: Path,
        news: asyncio.Event | None = None,
    ) -> Child:
        log = workdir / f"{name}.log"
        with log.open("wb") as stderr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "cronoq_store._demo",
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
            )
        return cls(name, proc, log, news)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            async for line in self.proc.stdout:
                event = json.loads(line)
                self.last[event["event"]] = event
                if event["event"] == "leading":
                    self.leads.append(event)
                self._events.put_nowait(event)
                if self._news is not None:
                    self._news.set()
        finally:
            self._events.put_nowait(None)
            if self._news is not None:
                self._news.set()

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
