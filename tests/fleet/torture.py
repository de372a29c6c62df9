"""The torture test's fleet profile: host processes leading many clusters, faults at random.

Host processes (``python -m tests.fleet.torture_worker``, real OS processes) share a host
group's clusters and commit to every cluster they lead, all along. Meanwhile the run, one
fault at a time: SIGKILLs a process, starts a new one, ends a process's host session or its
pool sessions (``pg_terminate_backend``), or freezes a process (``SIGSTOP``) until the
server ended its silent host session and the others claimed its clusters, then lets it run
again while it still believes it leads them. At the end every cluster must be led again, and
the checker proves from the journals, the rows and an audit inside the database:

1. **Nothing acknowledged is lost**: every mutation of a journalled acknowledgement is in
   its cluster's ``cronoq_tasks`` as itself or a later state of its task.
2. **No stale write**: every committed row version was written under the epoch stored when
   its statement ran and still stored when its transaction reached its commit.
3. **One process per epoch**: each epoch of each cluster was taken by one process (its host
   session bumped it), and only that process wrote (audit) and acknowledged (journals) in it.

The audit (``install``) is three triggers per cluster and a deferred constraint trigger on
the audit's own table. ``writes`` holds each row version of ``cronoq_tasks`` with the epoch
its statement saw; ``commits`` holds, per writing transaction and cluster (a host's commit
bus writes several clusters' commits in one transaction), the epoch read again at its
``COMMIT`` (deferred triggers run there, each statement with a fresh snapshot under READ
COMMITTED); ``epochs`` holds each epoch bump with the session that made it. A write whose
epoch moved before its commit is what a broken fence lets through, and the second reading
catches it without commit timestamps, so the suite's shared server serves as it is.

Profiles: ``short`` (the suite's: 12 clusters, 3 processes, about 8 faults) and ``long``
(``CRONOQ_TORTURE_PROFILE=long``: 48 clusters, up to 6 processes, 10 minutes of faults).
``CRONOQ_TORTURE_SEED`` replays a fault schedule; ``CRONOQ_TORTURE_DIR`` keeps journals,
worker logs and ``fleet-report.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from cronoq_store import _migrations as migrations
from cronoq_store._domain import TaskId, epoch_of
from cronoq_store._host.host import PgHost
from cronoq_store._urls import async_url

from ..pgharness import admin_execute
from ..support import ROOT
from ..waits import until
from .conftest import Fleet
from .processes import records
from .torture_worker import TRIGGERS, host_config
from .worker import WORKER_URL

__all__ = ["LONG", "SHORT", "FleetProfile", "FleetReport", "profile_from_env", "run"]

Record = dict[str, Any]

#: How long a process may take to exit on SIGTERM (it hands every cluster over first).
_STOP = 30.0
#: How long every cluster may take to be led and acknowledged again after the last fault.
_SETTLE = 60.0
#: Violations of each property shown in full; the rest are counted.
_SHOWN = 5

_RANK = {"q": 0, "r": 1, "s": 3}
_CODE = {"queued": "q", "running": "r", "succeeded": "s"}
_MESSAGE = re.compile(r"e(\d+) (\S+)")
#: How the store's epoch check in the database words a refusal.
_DB_FENCE = "the stored epoch is"

KINDS = ("kill", "add", "host_session", "pool_sessions", "freeze")


@dataclass(frozen=True, slots=True)
class FleetProfile:
    name: str
    clusters: int
    #: Processes at the start; kills and additions keep the live ones within the bounds.
    processes: int
    min_live: int
    max_live: int
    #: Faults are injected for this long (seconds), one at a time...
    duration: float
    #: ... with a pause drawn uniformly from this range before each.
    gap: tuple[float, float]


SHORT = FleetProfile(
    name="short",
    clusters=12,
    processes=3,
    min_live=2,
    max_live=4,
    duration=9.0,
    gap=(0.8, 1.6),
)
LONG = FleetProfile(
    name="long",
    clusters=48,
    processes=4,
    min_live=2,
    max_live=6,
    duration=600.0,
    gap=(1.0, 3.0),
)
PROFILES = {p.name: p for p in (SHORT, LONG)}


def profile_from_env() -> FleetProfile:
    name = os.environ.get("CRONOQ_TORTURE_PROFILE", "short")
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"CRONOQ_TORTURE_PROFILE: expected one of {sorted(PROFILES)}") from None


# --- the audit ------------------------------------------------------------------------


def _audit_ddl(audit: str, clusters: Sequence[str]) -> list[str]:
    a = f'"{audit}"'
    statements = [
        f"CREATE SCHEMA {a}",
        f"""CREATE TABLE {a}.writes (
            cluster text NOT NULL,
            id bigint NOT NULL,
            status text NOT NULL,
            attempt int NOT NULL,
            message text,
            op text NOT NULL,
            seen_epoch int,
            app text NOT NULL DEFAULT current_setting('application_name'),
            xid xid8 NOT NULL DEFAULT pg_current_xact_id())""",
        f"""CREATE TABLE {a}.commits (
            xid xid8 NOT NULL, cluster text NOT NULL, epoch int, PRIMARY KEY (xid, cluster))""",
        f"""CREATE TABLE {a}.epochs (
            cluster text NOT NULL,
            epoch int NOT NULL,
            app text NOT NULL DEFAULT current_setting('application_name'))""",
        f"""CREATE FUNCTION {a}.record_tasks() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            DECLARE seen int;
            BEGIN
                EXECUTE format('SELECT epoch FROM %I.cronoq_leader WHERE id = 1',
                               TG_TABLE_SCHEMA) INTO seen;
                INSERT INTO {a}.writes (cluster, id, status, attempt, message, op, seen_epoch)
                SELECT TG_TABLE_SCHEMA, n.id, n.status, n.attempt, n.message, TG_OP, seen
                FROM new_rows n;
                RETURN NULL;
            END $$""",
        f"""CREATE FUNCTION {a}.record_commit() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            DECLARE stored int;
            BEGIN
                EXECUTE format('SELECT epoch FROM %I.cronoq_leader WHERE id = 1', NEW.cluster)
                    INTO stored;
                INSERT INTO {a}.commits (xid, cluster, epoch)
                VALUES (pg_current_xact_id(), NEW.cluster, stored)
                ON CONFLICT (xid, cluster) DO NOTHING;
                RETURN NULL;
            END $$""",
        f"""CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON {a}.writes
            DEFERRABLE INITIALLY DEFERRED
            FOR EACH ROW EXECUTE FUNCTION {a}.record_commit()""",
        f"""CREATE FUNCTION {a}.record_epoch() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            BEGIN
                IF OLD.epoch IS DISTINCT FROM NEW.epoch THEN
                    INSERT INTO {a}.epochs (cluster, epoch) VALUES (TG_TABLE_SCHEMA, NEW.epoch);
                END IF;
                RETURN NULL;
            END $$""",
    ]
    for cluster in clusters:
        c = f'"{cluster}"'
        statements += [
            f"""CREATE TRIGGER fleet_audit_insert AFTER INSERT ON {c}.cronoq_tasks
                REFERENCING NEW TABLE AS new_rows
                FOR EACH STATEMENT EXECUTE FUNCTION {a}.record_tasks()""",
            f"""CREATE TRIGGER fleet_audit_update AFTER UPDATE ON {c}.cronoq_tasks
                REFERENCING NEW TABLE AS new_rows
                FOR EACH STATEMENT EXECUTE FUNCTION {a}.record_tasks()""",
            f"""CREATE TRIGGER fleet_audit_epoch AFTER UPDATE OF epoch ON {c}.cronoq_leader
                FOR EACH ROW EXECUTE FUNCTION {a}.record_epoch()""",
        ]
    assert {"fleet_audit_insert", "fleet_audit_update", "fleet_audit_epoch"} == TRIGGERS
    return statements


async def install(url: URL, audit: str, clusters: Sequence[str]) -> None:
    """Install the audit on the migrated ``clusters`` (``url``: a superuser, which owns the
    functions: a store trusts a trigger only if its function's owner is trusted)."""
    for statement in _audit_ddl(audit, clusters):
        await admin_execute(url, statement)


@dataclass(frozen=True, slots=True)
class Write:
    """One committed version of a task row, with the epoch its statement saw and the one
    stored at its transaction's commit."""

    cluster: str
    id: int
    status: str
    attempt: int
    message: str | None
    op: str
    seen_epoch: int | None
    app: str
    commit_epoch: int | None


async def fetch_writes(url: URL, audit: str) -> list[Write]:
    rows = await admin_execute(
        url,
        f"SELECT w.cluster, w.id, w.status, w.attempt, w.message, w.op, w.seen_epoch, w.app, "
        f'c.epoch FROM "{audit}".writes w LEFT JOIN "{audit}".commits c USING (xid, cluster)',
    )
    return [Write(*r) for r in rows]


async def fetch_takes(url: URL, audit: str) -> dict[tuple[str, int], list[str]]:
    """The sessions that bumped each ``(cluster, epoch)``: one each, in a sound run."""
    rows = await admin_execute(url, f'SELECT cluster, epoch, app FROM "{audit}".epochs')
    takes: dict[tuple[str, int], list[str]] = defaultdict(list)
    for r in rows:
        takes[(r["cluster"], r["epoch"])].append(r["app"])
    return takes


def worker_of(app: str) -> str:
    """The process that a session belongs to: pool sessions are named after it, its host
    session ``"<name> leader <instance id>"``."""
    return app.split(" leader ", 1)[0]


# --- the processes and the faults -------------------------------------------------------


@dataclass(slots=True)
class Fault:
    kind: str
    target: str
    started: float
    ended: float = 0.0
    #: What the fault did: sessions ended, or nothing to do.
    detail: str = ""


class _Processes:
    """The run's host processes: started, killed, frozen and stopped by name."""

    def __init__(self, fleet: Fleet, workdir: Path) -> None:
        self.fleet = fleet
        self.workdir = workdir
        self.running: dict[str, asyncio.subprocess.Process] = {}
        #: Processes stopped by SIGSTOP now: no other fault picks them.
        self.frozen: set[str] = set()
        #: Processes that exited other than by this run's SIGKILL or SIGTERM, with why.
        self.crashes: list[str] = []
        self.started = 0
        # What the journals said so far, read on from each file's offset (a long run's
        # journals grow to tens of megabytes): each cluster's latest acknowledgement, the
        # ids each process led under, the processes that journalled their start.
        self._offsets: dict[Path, int] = {}
        self.last_ack: dict[str, float] = {}
        self._ids: dict[str, set[int]] = defaultdict(set)
        self._serving: set[str] = set()

    def scan(self) -> None:
        """Read the journals' complete lines written since the last scan."""
        for path in self.journals():
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                r = json.loads(line)
                if r["k"] == "ack":
                    self.last_ack[r["schema"]] = max(r["t"], self.last_ack.get(r["schema"], 0.0))
                elif r["k"] == "lead":
                    self._ids[r["w"]].add(r["process"])
                elif r["k"] == "start":
                    self._serving.add(r["w"])

    def journals(self) -> list[Path]:
        return sorted((self.workdir / "journals").glob("*.jsonl"))

    async def add(self) -> str:
        self.started += 1
        name = f"p{self.started}"
        (self.workdir / "journals").mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
        env["PYTHONPATH"] = str(ROOT)
        url = self.fleet.url.update_query_dict({"application_name": name})
        env[WORKER_URL] = url.render_as_string(hide_password=False)
        with (self.workdir / "logs" / f"{name}.log").open("wb") as log:
            self.running[name] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.fleet.torture_worker",
                self.fleet.control,
                self.fleet.group,
                name,
                str(self.workdir / "journals" / f"{name}.jsonl"),
                cwd=ROOT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        return name

    def check_exits(self) -> None:
        """Record as a crash each process that exited on its own."""
        for name, process in list(self.running.items()):
            if process.returncode is not None:
                del self.running[name]
                self.crashes.append(f"{name} exited with {process.returncode}: {self.tail(name)}")

    def tail(self, name: str) -> str:
        log = self.workdir / "logs" / f"{name}.log"
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])

    async def kill(self, name: str) -> None:
        process = self.running.pop(name)
        process.send_signal(signal.SIGKILL)
        await process.wait()

    def process_ids(self, name: str) -> set[int]:
        """The ids under which ``name`` journalled leading a cluster."""
        self.scan()
        return set(self._ids[name])

    def serving(self, name: str) -> bool:
        """Whether ``name`` journalled its start: its SIGTERM handler is in place."""
        self.scan()
        return name in self._serving

    async def stop(self) -> None:
        """SIGTERM every running process (each hands its clusters over and exits 0); one
        that does not exit in time is killed and counted as a crash. A process still
        starting is waited for first: before its handler is in place, SIGTERM kills it."""
        self.check_exits()
        for name in self.running:
            with contextlib.suppress(AssertionError):  # SIGTERM it anyway: a crash then
                await until(partial(self.serving, name), f"{name} serving", _STOP, every=0.1)
        for process in self.running.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for name, process in self.running.items():
            try:
                await asyncio.wait_for(process.wait(), _STOP)
            except asyncio.TimeoutError:
                self.crashes.append(f"{name} did not stop on SIGTERM within {_STOP:g} s")
                process.kill()
                await process.wait()
                continue
            if process.returncode != 0:
                self.crashes.append(f"{name} exited with {process.returncode}: {self.tail(name)}")
        self.running.clear()


async def _terminate(url: URL, condition: str, value: str) -> int:
    rows = await admin_execute(
        url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE {condition} AND pid <> pg_backend_pid()",
        value,
    )
    return sum(1 for r in rows if r[0])


class _Injector:
    """Draws and injects the faults: every kind once first (shuffled), then at random among
    those the live processes allow."""

    def __init__(self, profile: FleetProfile, processes: _Processes, rng: random.Random) -> None:
        self.profile = profile
        self.processes = processes
        self.rng = rng
        self.log: list[Fault] = []
        # Each kind once first, the freeze before the others: a frozen process's deposed
        # commits, once it runs again, need time to reach the database's epoch check before
        # the run ends (drawn last on a loaded machine, it was thawed as the run stopped).
        others = [k for k in KINDS if k != "freeze"]
        rng.shuffle(others)
        self._first = ["freeze", *others]

        self._thaws: set[asyncio.Task[None]] = set()

    def _targets(self) -> list[str]:
        return sorted(set(self.processes.running) - self.processes.frozen)

    def _allowed(self, kind: str) -> bool:
        if kind == "add":
            return len(self.processes.running) < self.profile.max_live
        if kind in ("kill", "freeze"):
            return len(self._targets()) > self.profile.min_live
        return bool(self._targets())

    def _draw(self) -> str | None:
        first = [k for k in self._first if self._allowed(k)]
        if first:
            self._first.remove(first[0])
            return first[0]
        allowed = [k for k in KINDS if self._allowed(k)]
        return self.rng.choice(allowed) if allowed else None

    async def inject(self) -> None:
        self.processes.check_exits()
        kind = self._draw()
        if kind is None:
            return
        if kind == "add":
            fault = Fault(kind, "", time.time())
            fault.target = await self.processes.add()
        else:
            targets = self._targets()
            if kind == "freeze":
                # A process that leads clusters: once it runs again, commits of its deposed
                # terms reach the epoch check in the database.
                targets = [t for t in targets if self.processes.process_ids(t)] or targets
            target = self.rng.choice(targets)
            fault = Fault(kind, target, time.time())
            await self._hurt(fault)
        fault.ended = time.time()
        self.log.append(fault)

    async def thawed(self) -> None:
        """Wait until every frozen process runs again."""
        if self._thaws:
            await asyncio.wait(set(self._thaws))

    async def _hurt(self, fault: Fault) -> None:
        url = self.processes.fleet.url
        name = fault.target
        if fault.kind == "kill":
            await self.processes.kill(name)
        elif fault.kind == "host_session":
            ended = await _terminate(url, "application_name LIKE $1", f"{name} leader %")
            fault.detail = f"{ended} ended"
        elif fault.kind == "pool_sessions":
            ended = await _terminate(url, "application_name = $1", name)
            fault.detail = f"{ended} ended"
        else:
            process = self.processes.running[name]
            process.send_signal(signal.SIGSTOP)
            self.processes.frozen.add(name)
            thaw = asyncio.ensure_future(self._thaw(name, process))
            self._thaws.add(thaw)
            thaw.add_done_callback(self._thaws.discard)

    async def _thaw(self, name: str, process: asyncio.subprocess.Process) -> None:
        """Let a frozen process run again once every cluster it led is led by another
        process (the server ended its silent host session, the others claimed), or after
        ``_SETTLE``; meanwhile the injector goes on with other faults on other processes."""
        fleet = self.processes.fleet
        ids = self.processes.process_ids(name)

        async def moved() -> bool:
            owners = await fleet.owners()
            return not ids & set(owners.values()) and None not in owners.values()

        try:
            with contextlib.suppress(AssertionError):  # thawed anyway: the run goes on
                await until(moved, f"{name}'s clusters led by others", _SETTLE, every=0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
            self.processes.frozen.discard(name)


# --- the checker ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Violation:
    #: The property broken (1 to 3), or 0 for the harness (a crash, a cluster never led).
    prop: int
    summary: str


@dataclass
class FleetReport:
    """Figures and violations of one run."""

    profile: str
    seed: int
    clusters: int
    started: float
    faults: list[Fault]
    processes: int = 0
    #: When every cluster had an acknowledged commit, and when the run stopped.
    all_led: float = 0.0
    ended: float = 0.0
    acked_commits: int = 0
    acked_mutations: int = 0
    lost: int = 0
    audit_writes: int = 0
    stale_writes: int = 0
    epochs_taken: int = 0
    double_ack_epochs: int = 0
    #: Terms that led a cluster after its first (the takeovers).
    takeovers: int = 0
    fenced_commits: int = 0
    #: Terms whose commits the epoch check in the database refused (not the local check).
    terms_fenced_by_database: int = 0
    transient_errors: int = 0
    violations: list[Violation] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "seed": self.seed,
            "duration_s": round(self.ended - self.started, 1),
            "all_led_after_s": round(self.all_led - self.started, 1),
            "clusters": self.clusters,
            "processes_started": self.processes,
            "faults": len(self.faults),
            "faults_by_kind": dict(Counter(f.kind for f in self.faults).most_common()),
            "acked_commits": self.acked_commits,
            "acked_mutations": self.acked_mutations,
            "lost": self.lost,
            "audit_writes": self.audit_writes,
            "stale_writes": self.stale_writes,
            "epochs_taken": self.epochs_taken,
            "takeovers": self.takeovers,
            "double_ack_epochs": self.double_ack_epochs,
            "fenced_commits": self.fenced_commits,
            "terms_fenced_by_database": self.terms_fenced_by_database,
            "transient_errors": self.transient_errors,
            "violations": len(self.violations),
        }

    def summary(self) -> str:
        f = self.figures()
        return "\n".join(
            [
                f"fleet torture run: profile={self.profile} seed={self.seed} "
                f"duration={f['duration_s']} s, {self.clusters} clusters, "
                f"{self.processes} processes started, every cluster acknowledging after "
                f"{f['all_led_after_s']} s",
                f"faults injected: {f['faults']} "
                + ", ".join(f"{k} {v}" for k, v in f["faults_by_kind"].items()),
                f"acknowledged: {f['acked_commits']} commits, {f['acked_mutations']} "
                f"mutations; lost: {f['lost']}",
                f"stale writes: {f['stale_writes']} of {f['audit_writes']} committed row "
                f"versions; commits refused after losing a cluster: {f['fenced_commits']} "
                f"(terms stopped by the epoch check in the database: "
                f"{f['terms_fenced_by_database']})",
                f"epochs taken: {f['epochs_taken']} ({f['takeovers']} takeovers); "
                f"epochs acknowledged or taken by two processes: {f['double_ack_epochs']}",
                f"commits failed by ended sessions (retried): {f['transient_errors']}",
                f"violations: {f['violations']}",
            ]
        )

    def failure(self) -> str:
        lines = [
            self.summary(),
            "",
            f"reproduce the fault schedule: CRONOQ_TORTURE_SEED={self.seed} "
            f"CRONOQ_TORTURE_PROFILE={self.profile} "
            "python -m pytest -p no:cacheprovider tests/fleet/test_torture.py",
            "faults:",
            *(
                f"  {f.started - self.started:8.3f} s {f.kind} {f.target} {f.detail}".rstrip()
                for f in self.faults
            ),
        ]
        shown: Counter[int] = Counter()
        for v in sorted(self.violations, key=lambda v: v.prop):
            shown[v.prop] += 1
            if shown[v.prop] <= _SHOWN:
                lines.append(f"{f'property {v.prop}' if v.prop else 'harness'}: {v.summary}")
        for prop, n in sorted(shown.items()):
            if n > _SHOWN:
                lines.append(f"... and {n - _SHOWN} more violations of property {prop}")
        return "\n".join(lines)


def check(
    report: FleetReport,
    found: Sequence[Record],
    rows: dict[str, dict[int, tuple[str, int]]],
    writes: Sequence[Write],
    takes: dict[tuple[str, int], list[str]],
) -> None:
    """Check a finished run: ``found``, the journals' records; ``rows``, each cluster's
    ``cronoq_tasks`` as ``id -> (status, attempt)``; ``writes`` and ``takes``, the audit."""
    acks = [r for r in found if r["k"] == "ack"]
    fenced = [r for r in found if r["k"] == "fenced"]
    report.acked_commits = len(acks)
    report.acked_mutations = sum(len(r["m"]) for r in acks)
    report.fenced_commits = len(fenced)
    report.terms_fenced_by_database = len(
        {(r["w"], r["schema"], r["epoch"]) for r in fenced if _DB_FENCE in r["error"]}
    )
    report.transient_errors = sum(1 for r in found if r["k"] == "error")
    report.audit_writes = len(writes)
    report.epochs_taken = sum(len(apps) for apps in takes.values())
    report.takeovers = report.epochs_taken - len({cluster for cluster, _ in takes})
    _check_acks(report, acks, rows)
    _check_writes(report, writes, takes)
    _check_one_per_epoch(report, found, takes)


def _check_acks(
    report: FleetReport, acks: Sequence[Record], rows: dict[str, dict[int, tuple[str, int]]]
) -> None:
    """Property 1: each acknowledged mutation is stored, as itself or a later state."""
    for ack in acks:
        stored_rows = rows.get(ack["schema"], {})
        for task, attempt, code in ack["m"]:
            row = stored_rows.get(task)
            if row is None:
                problem = "missing from cronoq_tasks"
            else:
                status, stored_attempt = row
                stored_code = _CODE.get(status, "?")
                if code == "s":  # finished: the task never changes again
                    ok = (stored_attempt, stored_code) == (attempt, code)
                else:
                    ok = (stored_attempt, _RANK.get(stored_code, -1)) >= (attempt, _RANK[code])
                if ok:
                    continue
                problem = f"stored as {status} (attempt {stored_attempt})"
            report.lost += 1
            report.violations.append(
                Violation(
                    1,
                    f"{ack['schema']} task {task}: acknowledged as {code!r} attempt {attempt} "
                    f"by {ack['w']} in epoch {ack['epoch']}, but {problem}",
                )
            )


def _writer(write: Write) -> tuple[int, str | None]:
    """The epoch and process that wrote a row version: from the message every transition
    carries, else (a new task) from its epoch-prefixed id."""
    if write.message is not None:
        match = _MESSAGE.fullmatch(write.message)
        if match:
            return int(match.group(1)), match.group(2)
    return epoch_of(TaskId(write.id)), None


def _check_writes(
    report: FleetReport, writes: Sequence[Write], takes: dict[tuple[str, int], list[str]]
) -> None:
    """Properties 2 and 3 from the audit: each row version was written under the epoch
    stored while its statement ran and at its commit, by the process that took it."""
    for write in writes:
        epoch, named = _writer(write)
        what = f"{write.cluster} task {write.id} {write.op} to {write.status}"
        if write.seen_epoch != epoch or write.commit_epoch != epoch:
            report.stale_writes += 1
            report.violations.append(
                Violation(
                    2,
                    f"{what}: written by epoch {epoch} (by {write.app!r}) while the stored "
                    f"epoch was {write.seen_epoch}, and {write.commit_epoch} at its commit",
                )
            )
        takers = {worker_of(app) for app in takes.get((write.cluster, epoch), [])}
        writer = worker_of(write.app)
        if takers != {writer} or named not in (None, writer):
            report.violations.append(
                Violation(
                    3,
                    f"{what}: written in epoch {epoch} by {write.app!r} (message {named!r}), "
                    f"which did not take it ({sorted(takers)} did)",
                )
            )


def _check_one_per_epoch(
    report: FleetReport, found: Sequence[Record], takes: dict[tuple[str, int], list[str]]
) -> None:
    """Property 3 from the journals and the audit: each epoch was bumped once, by one
    process's host session, and only that process (one registration of it) led and
    acknowledged in it."""
    holders: dict[tuple[str, int], set[tuple[str, int]]] = defaultdict(set)
    for r in found:
        if r["k"] in ("lead", "ack"):
            holders[(r["schema"], r["epoch"])].add((r["w"], r["process"]))
    for key in sorted(set(holders) | set(takes)):
        takers = takes.get(key, [])
        workers = {worker_of(app) for app in takers}
        if len(takers) > 1 or len(holders[key]) > 1 or {w for w, _ in holders[key]} - workers:
            report.double_ack_epochs += 1
            report.violations.append(
                Violation(
                    3,
                    f"{key[0]} epoch {key[1]}: taken by {sorted(takers)}, led or acknowledged "
                    f"by {sorted(holders[key])}",
                )
            )


# --- the run --------------------------------------------------------------------------


async def _stored_rows(url: URL, clusters: Sequence[str]) -> dict[str, dict[int, tuple[str, int]]]:
    stored = {}
    for cluster in clusters:
        rows = await admin_execute(url, f'SELECT id, status, attempt FROM "{cluster}".cronoq_tasks')
        stored[cluster] = {r[0]: (r[1], r[2]) for r in rows}
    return stored


async def _until_all_acked(
    processes: _Processes, clusters: Sequence[str], since: float
) -> set[str]:
    """Wait up to ``_SETTLE`` for an acknowledgement on every cluster after ``since``;
    returns the clusters still without one."""
    deadline = time.monotonic() + _SETTLE
    while True:
        processes.scan()
        missing = {c for c in clusters if processes.last_ack.get(c, 0.0) <= since}
        if not missing or time.monotonic() >= deadline:
            return missing
        processes.check_exits()
        await asyncio.sleep(0.25)


async def _prepare(host: PgHost, url: URL, clusters: Sequence[str], audit: str) -> None:
    """Migrate ``clusters``, install the audit on them, then enroll them with ``host``:
    every write of the run is audited."""
    engine = create_async_engine(async_url(url), poolclass=NullPool)
    try:
        for cluster in clusters:
            await migrations.upgrade(engine, cluster)
    finally:
        await engine.dispose()
    await install(url, audit, clusters)
    await host.enroll(clusters, migrate=False)


async def run(profile: FleetProfile, seed: int, fleet: Fleet, workdir: Path) -> FleetReport:
    """Run ``profile`` with ``seed`` on ``fleet``, keeping journals and logs in ``workdir``."""
    rng = random.Random(seed)
    clusters = fleet.clusters(profile.clusters)
    audit = f"{fleet.prefix}_audit"
    processes = _Processes(fleet, workdir)
    injector = _Injector(profile, processes, rng)
    report = FleetReport(profile.name, seed, profile.clusters, time.time(), injector.log)
    # The control schema first, then the processes: they start (seconds on a loaded
    # machine) while the clusters are migrated, audited and enrolled.
    host = await PgHost.connect(fleet.url, host_config(fleet.group, fleet.control))
    try:
        for _ in range(profile.processes):
            await processes.add()
        try:
            await _prepare(host, fleet.url, clusters, audit)
        finally:
            await host.close()
        missing = await _until_all_acked(processes, clusters, 0.0)
        report.all_led = time.time()
        if missing:
            report.violations.append(Violation(0, f"never led at the start: {sorted(missing)}"))
        else:
            faults_end = time.monotonic() + profile.duration
            while time.monotonic() < faults_end:
                await asyncio.sleep(rng.uniform(*profile.gap))
                await asyncio.wait_for(injector.inject(), _STOP)
            await injector.thawed()
            missing = await _until_all_acked(processes, clusters, time.time())
            if missing:
                report.violations.append(
                    Violation(0, f"not led again after the last fault: {sorted(missing)}")
                )
    finally:
        await processes.stop()
    report.ended = time.time()
    report.processes = processes.started
    report.violations += [Violation(0, f"process crashed: {c}") for c in processes.crashes]
    check(
        report,
        records(*processes.journals()),
        await _stored_rows(fleet.url, clusters),
        await fetch_writes(fleet.url, audit),
        await fetch_takes(fleet.url, audit),
    )
    (workdir / "fleet-report.json").write_text(json.dumps(report.figures(), indent=2))
    return report
