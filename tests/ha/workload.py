"""The store under load on the HA stack while faults move, kill or cut off the primary.

Three store instances run as the torture test's workers (:mod:`tests.torture.worker`: each
in a process of its own, competing for leadership, committing continuously through
``GroupCommitter`` while it leads, journaling every acknowledgement after the ack), with
the torture audit's triggers recording every committed row version and epoch. Routing:

- ``w1``: pool and lock session through the multi-host URL (``target_session_attrs``);
- ``w2``: pool through PgBouncer (``pool_mode = transaction``, in front of HAProxy) with
  ``PgStoreConfig(prepared_statements=False)``, lock session direct through HAProxy
  (``lock_url``: a session advisory lock cannot live behind transaction pooling);
- ``w3``: pool and lock session through HAProxy.

Faults, each on the current primary and each followed by the stack healing (a primary and
a streaming synchronous standby; a node the fault took down rejoins meanwhile) before the
next:

- ``switchover``: ``patronictl switchover``; Patroni demotes the primary (its PostgreSQL is
  restarted as a standby, ending every session) once the synchronous standby is promoted.
- ``kill_postmaster``: SIGKILL of the primary's postmaster. Patroni, alive and holding the
  leader key, restarts PostgreSQL on the same node (crash recovery): no failover.
- ``kill_node``: SIGKILL of the primary's Patroni and postmaster, as if the machine died.
  Its leader key expires after ``ttl`` and the synchronous standby is promoted; the node
  then comes back (Patroni rewinds or re-clones it) as a standby.
- ``cut_etcd``: the primary's Patroni loses etcd (its proxy resets and refuses). After
  ``retry_timeout`` it demotes its PostgreSQL (25006 and "during recovery" for whoever is
  still connected); once the key expires the synchronous standby is promoted. Healed after.
- ``restart_cluster``: every node stopped (primary last) and started again.
- ``restart_pgbouncer``: SIGKILL of PgBouncer, started again at once, while ``w2`` leads
  (the run hands leadership over until it does): ``w2``'s pool connections all drop, its
  lock session (direct) does not; the same leader must commit again within
  ``retry.COMMIT_BACKOFF``'s cap plus :data:`SLACK`.

Then the torture checker proves, from journals, audit and tables: no acknowledged mutation
lost, no write under a stale epoch, one acknowledging instance per epoch. Per fault the run
measures ``writable_to_recovered``: from the new primary accepting a write (a probe that
assigns a transaction id, which a standby refuses) to the new store leader having recovered,
and checks it against :func:`takeover_bound`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from cronoq_store import _migrations as migrations
from cronoq_store._retry import COMMIT_BACKOFF
from cronoq_store._urls import async_url

from ..pgbouncer import PgBouncer, store_connect_query, store_settings
from ..pgharness import admin_execute, asyncpg_dsn
from ..support import ROOT
from ..torture import audit
from ..torture.checker import Report, check, percentile
from ..torture.faults import Timing
from ..torture.journal import Ack, History, read_history
from ..torture.worker import WorkerConfig
from .stack import HaStack, Sync

__all__ = [
    "FAULTS",
    "LONG",
    "PROFILES",
    "SHORT",
    "HaProfile",
    "HaRun",
    "profile_from_env",
    "run_ha",
    "takeover_bound",
]

SCHEMA = "ha"
FAULTS = (
    "switchover",
    "kill_postmaster",
    "kill_node",
    "cut_etcd",
    "restart_cluster",
    "restart_pgbouncer",
)
#: Faults after which the same store leader goes on (its lock session does not go through
#: what the fault hit); every other one ends every session on the primary: a takeover.
NO_TAKEOVER = frozenset({"restart_pgbouncer"})
#: The longest pause before a failed batch is retried (the committer's default backoff), so
#: the longest a leader whose lock survived waits to commit again.
_RETRY_MAX = COMMIT_BACKOFF.cap
#: Scheduling slack (seconds): nine server processes, three Patroni, three workers, etcd
#: and HAProxy share two cores.
SLACK = 2.0
#: Connections and transactions a takeover makes before it recovers, each costing what a
#: probe of the new primary costs: the lock session's connection (the multi-host URL tries
#: up to every node, a standby included, before the primary), the pool's, and the epoch bump.
_TAKEOVER_CONNECTS = len(("n1", "n2", "n3")) + 2
#: Connections and transactions PgBouncer's restart costs its leader before it commits: a
#: client connection to PgBouncer, PgBouncer's to the primary (through HAProxy, with its
#: ``connect_query``), and the commit.
_BOUNCER_CONNECTS = 3
#: Writes that measure what a new connection and transaction cost right now.
_PROBES = 3
#: How long the run waits for the store to acknowledge again after a fault healed.
_PROGRESS = 60.0
_REAP = 20.0


#: The store's settings in every run: a failover ends every session at once, so what matters
#: is how soon standbys try again (lock_poll) and how fast a dead lock session is noticed.
_TIMING = Timing(lock_poll=0.2, keepalive=0.5, session_timeout=3.0, commit_timeout=2.0)


@dataclass(frozen=True, slots=True)
class HaProfile:
    name: str
    #: The faults, in order.
    faults: tuple[str, ...]
    sync: Sync = "on"
    timing: Timing = _TIMING
    submitters: int = 4
    max_batch: int = 8
    max_pause: float = 0.05
    live_cap: int = 150
    #: Whether a failover may lose acknowledged commits (asynchronous replication), and with
    #: them epoch bumps: the checker's properties 1 to 3 are then measured, not asserted.
    loss_allowed: bool = False


#: Lighter load than the long profiles: two cores also run three servers and their Patroni.
SHORT = HaProfile(name="short", faults=FAULTS * 2, submitters=3, max_pause=0.1)
LONG = HaProfile(name="long", faults=FAULTS * 6)
#: Asynchronous replication: what a failover can lose is measured, not forbidden.
ASYNC = HaProfile(name="async", faults=FAULTS * 3, sync="off", loss_allowed=True)
#: ``synchronous_mode_strict``: no commit without a synchronous standby.
STRICT = HaProfile(name="strict", faults=FAULTS * 3, sync="strict")
PROFILES = {p.name: p for p in (SHORT, LONG, ASYNC, STRICT)}


def profile_from_env() -> HaProfile:
    """``CRONOQ_HA_PROFILE`` (``short``, the default; ``long``, ``async``, ``strict``), with
    ``CRONOQ_HA_FAULTS`` (comma-separated kinds) in place of the profile's faults if set."""
    name = os.environ.get("CRONOQ_HA_PROFILE", "short")
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"CRONOQ_HA_PROFILE: expected one of {sorted(PROFILES)}") from None
    faults = os.environ.get("CRONOQ_HA_FAULTS")
    if faults:
        kinds = tuple(k.strip() for k in faults.split(",") if k.strip())
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown:
            raise ValueError(f"CRONOQ_HA_FAULTS: unknown {unknown}; expected some of {FAULTS}")
        profile = replace(profile, faults=kinds)
    return profile


def takeover_bound(timing: Timing, recovery: float, probe: float) -> float:
    """How long after the new primary accepts writes the new store leader has recovered, at
    most: every session of the store died with the old primary (or its demotion), so a
    standby's next acquisition attempt comes after at most its reconnect pause (never over
    ``lock_poll``: ``retry.acquisition_backoff``) plus one ``lock_poll`` of waiting on the
    lock; then it recovers; plus :data:`SLACK`, plus :data:`_TAKEOVER_CONNECTS` times
    ``probe``, what one new connection and transaction on the new primary was seen to cost
    (on a quiet machine a few milliseconds; on a loaded one, what the store pays too)."""
    return 2 * timing.lock_poll + recovery + SLACK + _TAKEOVER_CONNECTS * probe


@dataclass
class FaultRecord:
    kind: str
    #: The primary it hit, and the primary afterwards.
    old: str
    new: str = ""
    started: float = 0.0
    #: When the new primary first accepted a write.
    writable_at: float = math.nan
    #: What a new connection and write there cost then (:func:`_probe_seconds`).
    probe_seconds: float = math.nan
    #: When the first store leader of a later epoch had recovered (and its epoch).
    recovered_at: float = math.nan
    epoch: int = 0
    recovery_seconds: float = math.nan
    #: When the stack was healthy again (every node streaming).
    healed_at: float = math.nan

    @property
    def writable_to_recovered(self) -> float:
        return self.recovered_at - self.writable_at

    @property
    def outage(self) -> float:
        """From the fault to the store having recovered on the new primary."""
        return self.recovered_at - self.started


_LOST = re.compile(r" in epoch (\d+), but ")
_TORTURE_ONLY = ("faults injected", "takeovers after a fault", "  lock free", "unprovoked")


@dataclass
class HaRun:
    profile: HaProfile
    report: Report
    faults: list[FaultRecord] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duration: float = 0.0
    #: Server-log errors the store's sessions met on a demoted primary (25006, "during
    #: recovery"), per instance.
    read_only_errors: dict[str, int] = field(default_factory=dict)
    #: Epochs a new leader took again after a failover lost their bump (asynchronous).
    epochs_reused: list[int] = field(default_factory=list)

    def lost_by_epoch(self) -> dict[int, int]:
        """Acknowledged mutations the checker found lost, by the epoch that acknowledged."""
        lost: dict[int, int] = {}
        for v in self.report.violations:
            match = _LOST.search(v.summary) if v.prop == 1 else None
            if match:
                lost[int(match.group(1))] = lost.get(int(match.group(1)), 0) + 1
        return lost

    def figures(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, Any]] = {}
        for kind in dict.fromkeys(f.kind for f in self.faults):
            mine = [f for f in self.faults if f.kind == kind]
            reaction = [f.writable_to_recovered for f in mine]
            outage = [f.outage for f in mine]
            by_kind[kind] = {
                "n": len(mine),
                "writable_to_recovered_p50_s": round(percentile(reaction, 0.5), 3),
                "writable_to_recovered_max_s": round(max(reaction), 3),
                "fault_to_recovered_p50_s": round(percentile(outage, 0.5), 3),
                "fault_to_recovered_max_s": round(max(outage), 3),
            }
        t = self.profile.timing
        return {
            "profile": self.profile.name,
            "sync": self.profile.sync,
            "duration_s": round(self.duration, 1),
            "store_timing": asdict(t),
            "bound_s": (
                f"2 x {t.lock_poll} + recovery + {SLACK} + {_TAKEOVER_CONNECTS} x probe "
                f"(PgBouncer: {_RETRY_MAX} + {SLACK} + {_BOUNCER_CONNECTS} x probe)"
            ),
            "faults": by_kind,
            "read_only_errors": self.read_only_errors,
            "epochs_reused": self.epochs_reused,
            "lost_by_epoch": self.lost_by_epoch(),
            "fault_log": [
                {
                    "kind": f.kind,
                    "old": f.old,
                    "new": f.new,
                    "at_s": round(f.started - self.report.started, 3),
                    "epoch": f.epoch,
                    "writable_to_recovered_s": round(f.writable_to_recovered, 3),
                    "probe_s": round(f.probe_seconds, 3),
                }
                for f in self.faults
            ],
            "checker": self.report.figures(),
            "problems": self.problems,
        }

    def summary(self) -> str:
        # The checker's own fault and takeover lines count the torture test's faults: the
        # figures per Patroni fault below replace them.
        checker = [
            line
            for line in self.report.summary().splitlines()
            if not line.startswith(_TORTURE_ONLY)
        ]
        lines = [
            f"HA run: profile={self.profile.name} sync={self.profile.sync} "
            f"duration={self.duration:.1f} s seed={self.report.seed}",
            *checker,
        ]
        for kind, f in self.figures()["faults"].items():
            lines.append(
                f"  {kind}: n={f['n']} new primary writable -> store recovered p50 "
                f"{f['writable_to_recovered_p50_s']} s max {f['writable_to_recovered_max_s']} s;"
                f" fault -> recovered p50 {f['fault_to_recovered_p50_s']} s "
                f"max {f['fault_to_recovered_max_s']} s"
            )
        lines.append(f"  errors on a read-only server, per instance: {self.read_only_errors}")
        if self.epochs_reused or self.report.lost:
            lines.append(
                f"  epochs taken again after a failover lost their bump: {self.epochs_reused}; "
                f"lost acknowledged mutations by epoch: {self.lost_by_epoch()}"
            )
        lines += [
            f"  fault {f.kind}: {f.old} -> {f.new}, epoch {f.epoch}"
            for f in self.faults
            if f.epoch in self.lost_by_epoch() or f.epoch in self.epochs_reused
        ]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


class _Workers:
    """The store instances' processes."""

    NAMES = ("w1", "w2", "w3")

    def __init__(
        self, stack: HaStack, bouncer: PgBouncer, profile: HaProfile, workdir: Path, seed: int
    ) -> None:
        self.stack = stack
        self.bouncer = bouncer
        self.profile = profile
        self.workdir = workdir
        self.seed = seed
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.crashes: list[str] = []

    def journals(self) -> list[Path]:
        return sorted((self.workdir / "journals").glob("*.jsonl"))

    async def start(self, deadline: float) -> None:
        (self.workdir / "journals").mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        routes = {
            "w1": (self.stack.multi_host_url(), self.stack.multi_host_url()),
            "w2": (self.bouncer.url(), self.stack.haproxy_url()),
            "w3": (self.stack.haproxy_url(), self.stack.haproxy_url()),
        }
        timing = self.profile.timing
        for name in self.NAMES:
            url, lock_url = (u.render_as_string(hide_password=False) for u in routes[name])
            config = WorkerConfig(
                name=name,
                url=url,
                lock_url=lock_url,
                prepared_statements=name != "w2",
                schema=SCHEMA,
                journal=str(self.workdir / "journals" / f"{name}.jsonl"),
                seed=random.Random(f"{self.seed}:{name}").getrandbits(48),
                deadline=deadline,
                lock_poll=timing.lock_poll,
                keepalive=timing.keepalive,
                session_timeout=timing.session_timeout,
                commit_timeout=timing.commit_timeout,
                submitters=self.profile.submitters,
                max_batch=self.profile.max_batch,
                max_pause=self.profile.max_pause,
                live_cap=self.profile.live_cap,
            )
            path = self.workdir / "logs" / f"{name}.json"
            config.dump(path)
            with (self.workdir / "logs" / f"{name}.log").open("wb") as log:
                self.processes[name] = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "tests.torture.worker",
                    str(path),
                    cwd=ROOT,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                )

    async def stop(self) -> None:
        """SIGTERM every worker (each drains, releases and exits 0); a worker that had
        died, exits otherwise or does not stop is a crash."""
        for name, process in self.processes.items():
            if process.returncode is not None:
                self._crashed(name, process)
                continue
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for name, process in self.processes.items():
            if process.returncode is not None:
                continue
            try:
                await asyncio.wait_for(process.wait(), _REAP)
            except asyncio.TimeoutError:
                self.crashes.append(f"{name} did not stop on SIGTERM")
                process.kill()
                await process.wait()
            else:
                if process.returncode != 0:
                    self._crashed(name, process)

    def handover(self, name: str) -> None:
        """Make ``name`` hand leadership over (it competes again after a pause)."""
        self.processes[name].send_signal(signal.SIGUSR1)

    def _crashed(self, name: str, process: asyncio.subprocess.Process) -> None:
        log = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")
        tail = " | ".join(log.strip().splitlines()[-5:])
        self.crashes.append(f"{name} exited with {process.returncode}: {tail}")


async def _prepare(url: URL) -> None:
    """Migrate the cluster's schema on the primary and install the audit there."""
    engine = create_async_engine(async_url(url), poolclass=NullPool)
    try:
        await migrations.upgrade(engine, SCHEMA)
    finally:
        await engine.dispose()
    await audit.install(url, SCHEMA)


async def _writable(url: URL) -> bool:
    """One write on the node ``url`` names: assigning a transaction id fails on a standby."""
    try:
        conn = await asyncpg.connect(asyncpg_dsn(url), timeout=1)
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False
    try:
        await conn.execute("SELECT pg_current_xact_id()")
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return False
    finally:
        with contextlib.suppress(Exception):
            await conn.close(timeout=1)
    return True


async def _writable_primary(
    stack: HaStack, accept: Callable[[str], bool], what: str
) -> tuple[str, float, float]:
    """Wait for the primary (as Patroni's ``/primary`` says) that ``accept`` takes to accept
    a write, for as long as the stack makes progress. Returns its name, when it first
    accepted one, and the slowest of :data:`_PROBES` writes on it from then on: what a new
    session's connection and first transaction cost on this machine at this moment."""
    found: list[tuple[str, float]] = []

    async def ready() -> bool:
        name = await stack.primary()
        if name is None or not accept(name) or not await _writable(stack.node_url(name)):
            return False
        found.append((name, time.time()))
        return True

    await stack.wait_for(ready, what, every=0.05)
    name, at = found[-1]
    return name, at, await _probe_seconds(stack.node_url(name))


async def _probe_seconds(url: URL) -> float:
    """The slowest of :data:`_PROBES` writes (each a new connection) on ``url``."""
    slowest = 0.0
    for _ in range(_PROBES):
        began = time.monotonic()
        await _writable(url)
        slowest = max(slowest, time.monotonic() - began)
    return slowest


class _Journals:
    """Reads the workers' journals while the run goes on."""

    def __init__(self, workers: _Workers) -> None:
        self.workers = workers

    def history(self) -> History:
        return read_history(self.workers.journals())

    async def recovered_after(
        self, at: float, epoch_above: int, timeout: float, *, any_epoch: bool = False
    ) -> tuple[int, float, float] | None:
        """``(epoch, when, recovery seconds)`` of the first recovery of an epoch above
        ``epoch_above`` (of any epoch, with ``any_epoch``: a failover that lost the last
        bump hands the same epoch out again) after ``at``, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in self.history().recoveries:
                if rec.at >= at and (any_epoch or rec.epoch > epoch_above):
                    return rec.epoch, rec.at, rec.seconds
            await asyncio.sleep(0.2)
        return None

    async def acked_after(self, at: float, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(a.at > at for a in self.history().acks):
                return True
            await asyncio.sleep(0.2)
        return False

    async def acked_by_after(self, worker: str, at: float, timeout: float) -> Ack | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ack = next((a for a in self.history().acks if a.at > at and a.worker == worker), None)
            if ack is not None:
                return ack
            await asyncio.sleep(0.1)
        return None

    def current(self) -> tuple[str, int] | None:
        """The latest leader that has recovered and acknowledged: ``(worker, epoch)``."""
        history = self.history()
        if not history.leads:
            return None
        lead = history.leads[-1]
        if any(a.epoch == lead.epoch and a.worker == lead.worker for a in history.acks):
            return lead.worker, lead.epoch
        return None

    def last_epoch(self) -> int:
        leads = self.history().leads
        return max((lead.epoch for lead in leads), default=0)


async def _lead_with(workers: _Workers, journals: _Journals, name: str) -> None:
    """Hand leadership over until ``name`` leads (and acknowledges)."""
    deadline = time.monotonic() + _PROGRESS
    while time.monotonic() < deadline:
        current = journals.current()
        if current is not None and current[0] == name:
            return
        if current is not None:
            workers.handover(current[0])
            await journals.recovered_after(time.time(), current[1], _PROGRESS)
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{name} did not come to lead within {_PROGRESS} s")


async def _inject(stack: HaStack, bouncer: PgBouncer, kind: str, record: FaultRecord) -> None:
    """Inject ``kind`` on the primary ``record.old``; returns once a primary accepts writes
    (or, for PgBouncer, once it serves again)."""
    old = record.old
    record.started = time.time()
    if kind == "restart_pgbouncer":
        await asyncio.to_thread(bouncer.restart, "kill")
        record.new = old
        record.writable_at = time.time()
        record.probe_seconds = await _probe_seconds(bouncer.url())
        return
    accept: Callable[[str], bool] = lambda name: name != old  # noqa: E731
    if kind == "switchover":
        _, new = await stack.switchover()
        accept = lambda name: name == new  # noqa: E731
    elif kind == "kill_postmaster":
        killed = stack.kill_postmaster(old)
        # Until Patroni notices, the old node's /primary still passes: only a primary with
        # another postmaster (restarted, or on another node) is the one after the fault.
        accept = lambda name: stack.node(name).postmaster_pid() not in (None, killed)  # noqa: E731
    elif kind == "kill_node":
        await stack.kill_node(old)
    elif kind == "cut_etcd":
        stack.cut_from_etcd(old)
    elif kind == "restart_cluster":
        await stack.restart_cluster()
        accept = lambda name: True  # noqa: E731
    else:
        raise ValueError(f"unknown fault {kind!r}")
    record.new, record.writable_at, record.probe_seconds = await _writable_primary(
        stack, accept, f"a primary after {kind} on {old} to accept a write"
    )
    # Undo what the fault left broken, so that the stack heals.
    if kind == "kill_node":
        stack.spawn(stack.node(old))
    elif kind == "cut_etcd":
        stack.heal_etcd(old)


async def run_ha(stack: HaStack, profile: HaProfile, workdir: Path, seed: int) -> HaRun:
    """Run ``profile`` on the started ``stack``; journals and logs stay in ``workdir``."""
    started = time.time()
    primary = await stack.wait_primary()
    await _prepare(stack.node_url(primary))
    session_timeout = profile.timing.session_timeout
    bouncer = PgBouncer(
        stack.haproxy_url(),
        connect_query=store_connect_query(session_timeout),
        settings=store_settings(session_timeout),
    )
    await asyncio.to_thread(bouncer.start)
    workers = _Workers(stack, bouncer, profile, workdir, seed)
    journals = _Journals(workers)
    run = HaRun(profile, report=Report(profile.name, seed, False, profile.timing, 0, 0, []))
    await workers.start(deadline=time.time() + 600 + 120 * len(profile.faults))
    try:
        if not await journals.acked_after(started, _PROGRESS):
            run.problems.append(f"no instance acknowledged within {_PROGRESS} s of the start")
            return run
        for kind in profile.faults:
            if kind == "restart_pgbouncer":
                await _lead_with(workers, journals, "w2")
            epoch = journals.last_epoch()
            record = FaultRecord(kind, old=await stack.wait_primary())
            run.faults.append(record)
            await _inject(stack, bouncer, kind, record)
            if kind in NO_TAKEOVER:
                ack = await journals.acked_by_after("w2", record.writable_at, _PROGRESS)
                if ack is None:
                    run.problems.append(f"{kind}: w2 acknowledged nothing within {_PROGRESS} s")
                    break
                record.epoch, record.recovered_at, record.recovery_seconds = ack.epoch, ack.at, 0
                if ack.epoch != epoch:
                    run.problems.append(f"{kind}: leadership moved ({epoch} -> {ack.epoch})")
                bound = _RETRY_MAX + SLACK + _BOUNCER_CONNECTS * record.probe_seconds
                if record.writable_to_recovered > bound:
                    run.problems.append(
                        f"{kind}: w2 committed again {record.writable_to_recovered:.3f} s after "
                        f"PgBouncer came back (bound {bound:.3f} s)"
                    )
                record.healed_at = time.time()
                continue
            found = await journals.recovered_after(
                record.started, epoch, _PROGRESS, any_epoch=profile.loss_allowed
            )
            if found is None:
                run.problems.append(f"{kind}: no new store leader recovered within {_PROGRESS} s")
                break
            record.epoch, record.recovered_at, record.recovery_seconds = found
            if record.epoch <= epoch:
                # Only a failover that lost the bump of epoch `epoch` hands it out again.
                run.epochs_reused.append(record.epoch)
            bound = takeover_bound(profile.timing, record.recovery_seconds, record.probe_seconds)
            if record.writable_to_recovered > bound:
                run.problems.append(
                    f"{kind} ({record.old} -> {record.new}): the store recovered epoch "
                    f"{record.epoch} {record.writable_to_recovered:.3f} s after the new primary "
                    f"accepted writes (bound {bound:.3f} s)"
                )
            # The next fault needs a primary and a (synchronous) standby; a node the fault
            # took down rejoins meanwhile.
            await stack.wait_healthy(standbys=1)
            record.healed_at = time.time()
            if not await journals.acked_after(record.healed_at, _PROGRESS):
                run.problems.append(f"{kind}: no acknowledgement within {_PROGRESS} s of healing")
                break
    finally:
        try:
            await workers.stop()
        finally:
            await asyncio.to_thread(bouncer.destroy)
    ended = time.time()
    for line in stack.server_log_lines("read-only transaction", "during recovery"):
        for name in _Workers.NAMES:
            if f" {name}: ERROR" in line or f" {name} leader: ERROR" in line:
                run.read_only_errors[name] = run.read_only_errors.get(name, 0) + 1
    admin = stack.node_url(await stack.wait_primary())
    rows = await admin_execute(admin, f'SELECT id, status, attempt FROM "{SCHEMA}".cronoq_tasks')
    run.report = check(
        profile=profile.name,
        seed=seed,
        # No idle-in-transaction limit set for the role (the torture test's guards): the
        # store asks for its own, except through PgBouncer.
        guards=False,
        timing=profile.timing,
        started=started,
        ended=ended,
        history=journals.history(),
        faults=[],
        rows={r[0]: (r[1], r[2]) for r in rows},
        writes=await audit.fetch_writes(admin),
        takes=await audit.fetch_epochs(admin),
        crashes=workers.crashes,
    )
    run.duration = ended - started
    (workdir / "ha-report.json").write_text(json.dumps(run.figures(), indent=2))
    return run
