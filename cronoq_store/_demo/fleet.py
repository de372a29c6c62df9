"""The demo's fleet variant (``cronoq-store demo --fleet``): host processes share many
clusters, one is killed, the others take its clusters over, and nothing acknowledged is lost.

1. The clusters are enrolled in a throwaway host group (its own control schema).
2. Several host processes (:mod:`cronoq_store._demo.roles`, role ``host``: real processes,
   each a :class:`~cronoq_store._host.host.PgHost`) share them, each leading its share and
   acknowledging submissions to every cluster it leads. Every acknowledgement is appended
   to the process's file with its cluster, epoch and process the moment it returns.
3. One process is killed with ``SIGKILL``. The others take its clusters over, each with the
   cluster's next epoch, recover them and write again; the takeover is timed from the kill
   to the last of its clusters led again with its state recovered.
4. Every acknowledged write must be in its cluster's table, and, for the killed process's
   clusters, in the recovery of the term that took each over; no epoch of a cluster may be
   acknowledged by two processes (:func:`find_fleet_lost`, :func:`epochs_of_two`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from .. import _catalog as catalog
from .._door import engine_arguments
from .._errors import StoreError
from .._host.host import PgHost, PgHostConfig
from .._schema import schema_options
from .._terminal_safe import visible
from .orchestrator import Child, DemoError, drop_schema, server_for, server_line, step
from .roles import URL_ENV
from .verdict import find_lost

__all__ = ["FleetAck", "FleetReport", "epochs_of_two", "find_fleet_lost", "parse_fleet_acks"]

_START_TIMEOUT = 60.0
_TAKEOVER_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class FleetAck:
    """One acknowledged write of a host process: ``kind`` as the demo's (``T`` accepted,
    ``R`` started, ``S`` succeeded), in ``schema`` under ``epoch`` by ``process``."""

    kind: str
    task: int
    schema: str
    epoch: int
    process: int


def parse_fleet_acks(text: str) -> list[FleetAck]:
    """A host process's acknowledgements; a torn last line was never complete, so it was
    not an acknowledgement anyone saw."""
    acks = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        kind, task, schema, epoch, process = line.split()
        acks.append(FleetAck(kind, int(task), schema, int(epoch), int(process)))
    return acks


def find_fleet_lost(
    acks: Iterable[FleetAck],
    stored: Mapping[str, Mapping[int, str]],
    recovered: Mapping[str, tuple[int, Mapping[int, str]]],
) -> list[FleetAck]:
    """Acknowledged writes missing from their cluster's table (``stored``: schema -> id ->
    status), or, for a cluster taken over (``recovered``: schema -> the epoch that took it
    over and its recovery), acknowledged before that epoch and missing from its recovery."""
    lost = []
    for ack in acks:
        table = stored.get(ack.schema, {})
        epoch, recovery = recovered.get(ack.schema, (0, table))
        view = recovery if ack.epoch < epoch else table
        if find_lost([(ack.kind, ack.task)], view, table):
            lost.append(ack)
    return lost


def epochs_of_two(acks: Iterable[FleetAck]) -> list[tuple[str, int]]:
    """The ``(schema, epoch)`` pairs acknowledged by more than one process."""
    by: dict[tuple[str, int], set[int]] = defaultdict(set)
    for ack in acks:
        by[(ack.schema, ack.epoch)].add(ack.process)
    return sorted(key for key, processes in by.items() if len(processes) > 1)


@dataclass
class FleetReport:
    """What happened, for the account; ``failures`` is empty when the demo proved its point."""

    server: str
    group: str
    clusters: int
    processes: int
    #: Clusters each process led before the kill, by process name.
    split: dict[str, int] = field(default_factory=dict)
    victim: str = ""
    victim_clusters: int = 0
    takers: list[str] = field(default_factory=list)
    epochs_before: tuple[int, int] = (0, 0)
    epochs_after: tuple[int, int] = (0, 0)
    takeover_seconds: float = 0.0
    window: float = 0.0
    acked_tasks: int = 0
    acked_writes: int = 0
    recovered: int = 0
    lost: list[FleetAck] = field(default_factory=list)
    double: list[tuple[str, int]] = field(default_factory=list)
    resumed: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def throughput(self) -> float:
        return self.acked_writes / self.window if self.window > 0 else 0.0


def judge(report: FleetReport) -> None:
    """Add to ``report.failures`` every promise the run broke."""
    if report.acked_writes == 0:
        report.failures.append("no write was acknowledged")
    if report.lost:
        shown = ", ".join(f"{a.kind} {a.task} in {a.schema}" for a in report.lost[:5])
        more = ", ..." if len(report.lost) > 5 else ""
        report.failures.append(f"{len(report.lost)} acknowledged writes lost ({shown}{more})")
    if report.double:
        shown = ", ".join(f"{schema} epoch {epoch}" for schema, epoch in report.double[:5])
        report.failures.append(f"epochs acknowledged by two processes: {shown}")
    if not report.resumed:
        report.failures.append("a cluster of the killed process took no write after the takeover")


def _span(epochs: tuple[int, int]) -> str:
    low, high = epochs
    return f"{low}" if low == high else f"{low} to {high}"


def render(report: FleetReport, console: Console) -> None:
    """The account, as the standalone demo's."""
    account = Table(
        title="the account", title_justify="left", show_header=False, box=None, padding=(0, 2)
    )
    account.add_column(style="bold")
    account.add_column()
    split = ", ".join(f"{name} {n}" for name, n in sorted(report.split.items()))
    rows = [
        ("clusters", f"{report.clusters} led by {report.processes} processes ({split})"),
        (
            "takeover",
            f"{report.victim_clusters} clusters of {report.victim} led again by "
            f"{', '.join(report.takers)} in {report.takeover_seconds:.2f} s from SIGKILL "
            f"(epochs {_span(report.epochs_before)} -> {_span(report.epochs_after)})",
        ),
        (
            "acknowledged",
            f"{report.acked_tasks:,} tasks; {report.acked_writes:,} writes with status "
            f"changes, in {report.window:.1f} s",
        ),
        ("throughput", f"{report.throughput:,.0f} acks/s across {report.clusters} clusters"),
        ("recovered", f"{report.recovered:,} tasks of the killed process's clusters"),
        ("lost", f"{len(report.lost):,}"),
        ("epochs", f"{len(report.double):,} acknowledged by two processes"),
    ]
    for name, value in rows:
        account.add_row(name, value)
    console.print(account)
    if report.ok:
        console.print(
            "[green]OK[/green]: every acknowledged write survived the crash, and every "
            "cluster of the killed process is led again"
        )
    else:
        for failure in report.failures:
            console.print(f"[red]FAILED[/red]: {escape(visible(failure))}")


async def run_fleet_demo(
    url: str | URL | None,
    *,
    clusters: int,
    processes: int,
    submitters: int,
    seconds: float,
    console: Console,
) -> FleetReport:
    """Run the fleet variant on ``url`` (in throwaway schemas, dropped afterwards) or,
    without one, on an embedded PostgreSQL; print the steps and the account to
    ``console``. ``submitters`` are spread over the clusters, at least one each."""
    async with server_for(url) as (where, kind):
        dialled, tls = engine_arguments(where)
        engine = create_async_engine(
            dialled, poolclass=NullPool, hide_parameters=True, connect_args=tls
        )
        try:
            prefix = f"cronoq_demo_{secrets.token_hex(4)}"
            report = FleetReport(
                server=await server_line(engine, where, kind),
                group=prefix,
                clusters=clusters,
                processes=processes,
            )
            step(console, "[bold]cronoq-store HA demo: a fleet of host processes[/bold]")
            step(console, f"• {escape(visible(report.server))}, host group {prefix}")
            schemas = [f"{prefix}_{i:03d}" for i in range(clusters)]
            try:
                with tempfile.TemporaryDirectory(prefix="cronoq-demo-") as workdir:
                    await _play(
                        where,
                        Path(workdir),
                        engine,
                        report,
                        schemas,
                        max(1, submitters // clusters),
                        seconds,
                        console,
                    )
            finally:
                for schema in [*schemas, _control(prefix)]:
                    await drop_schema(engine, schema, console)
        finally:
            await engine.dispose()
    render(report, console)
    return report


def _control(prefix: str) -> str:
    return f"{prefix}_host"


class _Fleet:
    """The host processes and what they said: who leads each cluster, and since when."""

    def __init__(self, env: dict[str, str], workdir: Path, args: list[str]) -> None:
        self.env = env
        self.workdir = workdir
        self.args = args
        self.children: list[Child] = []
        self.news = asyncio.Event()

    async def spawn(self, name: str) -> Child:
        files = ["--acks", str(self.acks(name)), "--recovered", str(self.recoveries(name))]
        child = await Child.spawn(
            name, ["host", "--name", name, *files, *self.args], self.env, self.workdir, self.news
        )
        self.children.append(child)
        return child

    def acks(self, name: str) -> Path:
        return self.workdir / f"acks-{name}"

    def recoveries(self, name: str) -> Path:
        return self.workdir / f"recovered-{name}"

    def leaders(self) -> dict[str, tuple[int, Child, dict[str, Any]]]:
        """Each cluster's latest term: its epoch, the process leading it and its event."""
        found: dict[str, tuple[int, Child, dict[str, Any]]] = {}
        for child in self.children:
            for event in child.leads:
                schema, epoch = event["schema"], event["epoch"]
                if schema not in found or found[schema][0] < epoch:
                    found[schema] = (epoch, child, event)
        return found

    async def until(self, done: Callable[[], bool], what: str, timeout: float) -> None:
        """Wait until ``done()`` holds, woken by the children's events; a child that exits
        on its own fails the demo."""
        deadline = time.monotonic() + timeout
        while not done():
            for child in self.children:
                if child.proc.returncode not in (None, -signal.SIGKILL):
                    raise DemoError(f"{child.name} exited before {what}:\n{child.log_tail()}")
            self.news.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoError(f"waited {timeout:g} s for {what}")
            try:
                await asyncio.wait_for(self.news.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                continue

    def all_acks(self) -> list[FleetAck]:
        acks = []
        for child in self.children:
            path = self.acks(child.name)
            acks += parse_fleet_acks(path.read_text() if path.exists() else "")
        return acks

    def recovered(self, schema: str, epoch: int) -> dict[int, str]:
        """What the term ``epoch`` of ``schema`` recovered, from its process's file."""
        found = {}
        for child in self.children:
            path = self.recoveries(child.name)
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                name, term, task, state = line.split()
                if name == schema and int(term) == epoch:
                    found[int(task)] = state
        return found


async def _enroll(url: URL, prefix: str, schemas: Sequence[str]) -> None:
    config = PgHostConfig(control_schema=_control(prefix), group=prefix, max_connections=2)
    try:
        host = await PgHost.connect(url, config)
        try:
            await host.enroll(schemas)
        finally:
            await host.close()
    except StoreError as exc:
        # One control schema per database: a database that has one (an operator's host
        # group) cannot have the demo's too.
        raise DemoError(f"enrolling the demo's clusters failed: {exc}") from None


async def _play(
    url: URL,
    workdir: Path,
    engine: AsyncEngine,
    report: FleetReport,
    schemas: Sequence[str],
    submitters: int,
    seconds: float,
    console: Console,
) -> None:
    """The fleet demo, in order: enroll, lead, submit, kill one process, take over, check.
    Long for a reason: the story is one sequence read top to bottom."""
    prefix = report.group
    await _enroll(url, prefix, schemas)
    step(console, f"• {len(schemas)} clusters enrolled in the host group")
    env = {**os.environ, URL_ENV: url.render_as_string(hide_password=False)}
    args = ["--control", _control(prefix), "--group", prefix, "--submitters", str(submitters)]
    fleet = _Fleet(env, workdir, args)
    try:
        for i in range(report.processes):
            await fleet.spawn(f"p{i + 1}")
        for child in fleet.children:
            await child.expect("serving", _START_TIMEOUT)

        def balanced() -> bool:
            leaders = fleet.leaders()
            counts = Counter(child.name for _, child, _ in leaders.values())
            shares = [counts.get(c.name, 0) for c in fleet.children]
            return len(leaders) == len(schemas) and max(shares) - min(shares) <= 1

        await fleet.until(balanced, "every cluster led, shared evenly", _START_TIMEOUT)
        # Submissions start with each term: the window runs from the first one.
        started = min(event["t"] for child in fleet.children for event in child.leads)
        leaders = fleet.leaders()
        report.split = dict(Counter(child.name for _, child, _ in leaders.values()))
        pids = ", ".join(f"{c.name} pid {c.pid}" for c in fleet.children)
        step(
            console,
            f"• {report.processes} host processes ({pids}) lead the clusters, "
            f"acknowledging submissions to each for {seconds:g} s ...",
        )
        if await fleet.children[0].exits_within(seconds):
            child = fleet.children[0]
            raise DemoError(f"{child.name} exited before the kill:\n{child.log_tail()}")
        leaders = fleet.leaders()
        # The process leading the most clusters (the first of them on a tie).
        counts = Counter(child.name for _, child, _ in leaders.values())
        victim = max(fleet.children, key=lambda c: counts.get(c.name, 0))
        lost_clusters = {s: epoch for s, (epoch, child, _) in leaders.items() if child is victim}
        killed = time.monotonic()
        victim.kill()
        await victim.exits_within(_START_TIMEOUT)
        report.window = killed - started
        report.victim, report.victim_clusters = victim.name, len(lost_clusters)
        before = fleet.all_acks()
        step(
            console,
            f"• SIGKILL {victim.name} mid-stream, leading {len(lost_clusters)} clusters, after "
            f"{len(before):,} acknowledged writes",
        )

        def taken_over() -> bool:
            now = fleet.leaders()
            return all(now[s][0] > epoch for s, epoch in lost_clusters.items())

        await fleet.until(taken_over, "the killed process's clusters led again", _TAKEOVER_TIMEOUT)
        now = fleet.leaders()
        takes = {s: now[s] for s in lost_clusters}
        report.takeover_seconds = max(event["t"] for _, _, event in takes.values()) - killed
        report.takers = sorted({child.name for _, child, _ in takes.values()})
        report.epochs_before = (min(lost_clusters.values()), max(lost_clusters.values()))
        report.epochs_after = (
            min(epoch for epoch, _, _ in takes.values()),
            max(epoch for epoch, _, _ in takes.values()),
        )
        recovered = {s: (epoch, fleet.recovered(s, epoch)) for s, (epoch, _, _) in takes.items()}
        report.recovered = sum(len(r) for _, r in recovered.values())
        step(
            console,
            f"• {', '.join(report.takers)} took its clusters over in "
            f"{report.takeover_seconds:.2f} s and recovered {report.recovered:,} tasks",
        )

        def resumed() -> bool:
            acked = {(a.schema, a.epoch) for a in fleet.all_acks()}
            return all((s, epoch) in acked for s, (epoch, _, _) in takes.items())

        await fleet.until(resumed, "a write to each cluster taken over", _TAKEOVER_TIMEOUT)
        report.resumed = True
        survivors = [child for child in fleet.children if child is not victim]
        for child in survivors:
            child.close()
        for child in survivors:
            if not await child.exits_within(_START_TIMEOUT):
                raise DemoError(f"{child.name} did not exit:\n{child.log_tail()}")
        acks = fleet.all_acks()
        report.acked_writes = len(before)
        report.acked_tasks = sum(1 for a in before if a.kind == "T")
        stored = {s: await _statuses(engine, s) for s in schemas}
        report.lost = find_fleet_lost(acks, stored, recovered)
        report.double = epochs_of_two(acks)
        judge(report)
    finally:
        for child in fleet.children:
            await child.stop()


async def _statuses(engine: AsyncEngine, schema: str) -> dict[int, str]:
    db = engine.execution_options(**schema_options(schema))
    async with db.connect() as conn:
        return {row.id: row.status for row in await conn.execute(catalog.task_statuses)}
