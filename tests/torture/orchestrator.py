"""One torture run: a server, three store instances in processes, faults, then the checker.

The run owns its PostgreSQL (an :class:`~cronoq_store.testing.EmbeddedPostgres` with
``track_commit_timestamp = on``), so it may crash and restart it at will while the suite's
shared server stays healthy. Each instance reaches the server through its own two proxies
(pool and lock session) run by this process's event loop.

Roles: the instances' pools connect as the superuser; their lock sessions as
``torture_lock``, which may only take the lock and bump the epoch. With ``guards`` (the
default) the server ends a transaction idle for ``commit_timeout``
(``idle_in_transaction_session_timeout`` on the pool's role): what the store's pool
sessions should ask for, so that a transaction left open by a frozen or partitioned leader
does not hold the leader row (see docs/reliability.md). ``CRONOQ_TORTURE_GUARDS=0`` runs
without it.

Environment: ``CRONOQ_TORTURE_PROFILE`` (``short``, the default, or ``long``),
``CRONOQ_TORTURE_SEED`` (else a random seed, printed), ``CRONOQ_TORTURE_GUARDS``,
``CRONOQ_TORTURE_DIR`` (keep journals, logs and ``report.json`` there),
``CRONOQ_TORTURE_BATCHES_IN_FLIGHT`` (each term's committer's ``max_batches_in_flight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from cronoq_store import _migrations as migrations
from cronoq_store._statements import LOCK_NS_LEADER
from cronoq_store._urls import async_url
from cronoq_store.testing import EmbeddedPostgres, StopMode

from ..pgharness import admin_execute, terminate_backends, without_instance
from ..support import ROOT
from . import audit
from .checker import Report, check
from .faults import FaultInjector, InstanceLinks, Timing, restart_server
from .journal import count_acked, read_history
from .worker import WorkerConfig

__all__ = ["LONG", "PROFILES", "SHORT", "Profile", "profile_from_env", "run_torture"]

SCHEMA = "torture"
LOCK_ROLE = "torture_lock"
NAMES = ("w1", "w2", "w3")
#: Bounds on waiting for the cluster: a first leader, a process to exit, an admin query.
_FIRST_LEADER = 60.0
_REAP = 10.0
_ADMIN = 5.0
#: How long the run lets the cluster settle after the last fault, before stopping it.
_SETTLE = 4.0
#: How long a worker may outlive the run's planned end (the last fault, settling, stop).
_WORKER_GRACE = 300.0


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    #: Faults are injected for this long...
    duration: float
    #: ... and then, until these are reached, up to ``max_duration`` in all.
    min_changes: int
    min_acked: int
    max_duration: float
    #: Pause between two faults, drawn uniformly (seconds).
    gap: tuple[float, float]
    timing: Timing
    submitters: int
    max_batch: int
    max_pause: float
    live_cap: int
    guards: bool = True


_TIMING = Timing(lock_poll=0.1, keepalive=0.3, session_timeout=1.5, commit_timeout=1.0)

SHORT = Profile(
    name="short",
    duration=60.0,
    min_changes=0,
    min_acked=0,
    max_duration=60.0,
    gap=(0.8, 2.0),
    timing=_TIMING,
    submitters=4,
    max_batch=8,
    max_pause=0.05,
    live_cap=150,
)
LONG = Profile(
    name="long",
    duration=900.0,
    min_changes=200,
    min_acked=100_000,
    max_duration=2700.0,
    gap=(0.8, 2.0),
    timing=_TIMING,
    submitters=4,
    max_batch=8,
    max_pause=0.05,
    live_cap=150,
)
PROFILES = {p.name: p for p in (SHORT, LONG)}


def profile_from_env() -> Profile:
    name = os.environ.get("CRONOQ_TORTURE_PROFILE", "short")
    try:
        profile = PROFILES[name]
    except KeyError:
        raise ValueError(f"CRONOQ_TORTURE_PROFILE: expected one of {sorted(PROFILES)}") from None
    if os.environ.get("CRONOQ_TORTURE_GUARDS", "1") == "0":
        profile = replace(profile, guards=False)
    return profile


def seed_from_env() -> int:
    configured = os.environ.get("CRONOQ_TORTURE_SEED")
    return int(configured) if configured else secrets.randbelow(2**32)


class _Instances:
    """The store instances' processes, their proxies, and the server they share (the
    :class:`~tests.torture.faults.Cluster` the injector works on)."""

    def __init__(
        self,
        server: EmbeddedPostgres,
        workdir: Path,
        profile: Profile,
        seed: int,
        lock_password: str,
        schema_oid: int,
    ) -> None:
        self.server = server
        self.admin = server.url()
        self.workdir = workdir
        self.profile = profile
        self.seed = seed
        self.lock_password = lock_password
        self.schema_oid = schema_oid
        self._links = {name: InstanceLinks(self.admin) for name in NAMES}
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._generation = dict.fromkeys(NAMES, 0)
        self._journal_offsets: dict[Path, int] = {}
        self.acked = 0
        #: Workers that exited other than by this run's SIGKILL or SIGTERM, with why.
        self.crashes: list[str] = []
        #: No worker runs past this, even if this process dies without stopping them.
        self.deadline = time.time() + profile.max_duration + _WORKER_GRACE

    @property
    def names(self) -> Sequence[str]:
        return NAMES

    def links(self, name: str) -> InstanceLinks:
        return self._links[name]

    def pid(self, name: str) -> int | None:
        process = self._processes.get(name)
        return None if process is None or process.returncode is not None else process.pid

    def journals(self) -> list[Path]:
        return sorted((self.workdir / "journals").glob("*.jsonl"))

    async def start(self) -> None:
        (self.workdir / "journals").mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        for links in self._links.values():
            await links.start()
        for name in NAMES:
            await self.respawn(name)

    async def respawn(self, name: str) -> None:
        self._check_exit(name, expected=-signal.SIGKILL)
        self._generation[name] += 1
        generation = self._generation[name]
        tag = f"{name}.{generation}"
        links = self._links[name]
        config = WorkerConfig(
            name=name,
            url=_render(links.pool.url(self.admin)),
            lock_url=_render(
                links.lock.url(self.admin).set(username=LOCK_ROLE, password=self.lock_password)
            ),
            schema=SCHEMA,
            journal=str(self.workdir / "journals" / f"{tag}.jsonl"),
            seed=random.Random(f"{self.seed}:{tag}").getrandbits(48),
            deadline=self.deadline,
            lock_poll=self.profile.timing.lock_poll,
            keepalive=self.profile.timing.keepalive,
            session_timeout=self.profile.timing.session_timeout,
            commit_timeout=self.profile.timing.commit_timeout,
            submitters=self.profile.submitters,
            max_batch=self.profile.max_batch,
            max_pause=self.profile.max_pause,
            live_cap=self.profile.live_cap,
        )
        config_path = self.workdir / "logs" / f"{tag}.json"
        config.dump(config_path)
        with (self.workdir / "logs" / f"{tag}.log").open("wb") as log:
            self._processes[name] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.torture.worker",
                str(config_path),
                cwd=ROOT,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def _check_exit(self, name: str, expected: int) -> None:
        """Record a crash if ``name``'s process has exited otherwise than ``expected``."""
        process = self._processes.get(name)
        if process is None or process.returncode in (None, expected):
            return
        log = self.workdir / "logs" / f"{name}.{self._generation[name]}.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        self.crashes.append(
            f"{name} (pid {process.pid}) exited with {process.returncode}: " + " | ".join(tail)
        )

    async def reap(self, name: str) -> None:
        process = self._processes[name]
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), _REAP)

    async def leader(self) -> str | None:
        try:
            rows = await asyncio.wait_for(
                admin_execute(
                    self.admin,
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a "
                    "USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
                    "AND l.classid::bigint = $1 AND l.objid::bigint = $2 AND l.objsubid = 2",
                    LOCK_NS_LEADER,
                    self.schema_oid & 0xFFFFFFFF,
                ),
                _ADMIN,
            )
        except Exception:  # the server may be down: nobody can tell
            return None
        return without_instance(rows[0][0]).removesuffix(" leader") if rows else None

    async def terminate(self, application_name: str) -> int:
        try:
            return await asyncio.wait_for(terminate_backends(self.admin, application_name), _ADMIN)
        except Exception:  # the server may be down: nobody can tell
            return 0

    async def restart_server(self, mode: StopMode, down: float) -> float:
        return await restart_server(self.server, mode, down)

    async def epoch(self) -> int:
        try:
            rows = await asyncio.wait_for(
                admin_execute(self.admin, f'SELECT epoch FROM "{SCHEMA}".cronoq_leader'), _ADMIN
            )
        except Exception:  # the server may be down: nobody can tell
            return 0
        return int(rows[0][0])

    def count_acked(self) -> int:
        """Mutations acknowledged so far (reads only what was appended since last time)."""
        for path in self.journals():
            acked, offset = count_acked(path, self._journal_offsets.get(path, 0))
            self.acked += acked
            self._journal_offsets[path] = offset
        return self.acked

    async def stop(self) -> None:
        """Stop every instance cleanly (SIGTERM, exit status 0), killing any that does not
        exit in time; a worker that had died on its own, or did not stop, is a crash."""
        for name in NAMES:
            self._check_exit(name, expected=-signal.SIGKILL)
        running = {n: p for n, p in self._processes.items() if p.returncode is None}
        for process in running.values():
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for name, process in running.items():
            try:
                await asyncio.wait_for(process.wait(), _REAP * 2)
            except asyncio.TimeoutError:
                self.crashes.append(f"{name} (pid {process.pid}) did not stop on SIGTERM")
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            else:
                self._check_exit(name, expected=0)
        for links in self._links.values():
            await links.close()


def _render(url: URL) -> str:
    return url.render_as_string(hide_password=False)


async def _prepare(admin: URL, profile: Profile) -> tuple[str, int]:
    """Migrate the schema, install the audit, create the lock role; returns its password
    and the schema's OID."""
    engine = create_async_engine(async_url(admin), poolclass=NullPool)
    try:
        await migrations.upgrade(engine, SCHEMA)
    finally:
        await engine.dispose()
    await audit.install(admin, SCHEMA)
    password = secrets.token_urlsafe(18)  # URL-safe characters only: fine inside quotes
    statements = [
        f"CREATE ROLE {LOCK_ROLE} LOGIN PASSWORD '{password}'",
        f'GRANT CONNECT ON DATABASE "{admin.database or "postgres"}" TO {LOCK_ROLE}',
        f'GRANT USAGE ON SCHEMA "{SCHEMA}" TO {LOCK_ROLE}',
        f'GRANT SELECT, UPDATE ON "{SCHEMA}".cronoq_leader TO {LOCK_ROLE}',
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{SCHEMA}".cronoq_leader_history TO {LOCK_ROLE}',
    ]
    if profile.guards:
        statements.append(
            "ALTER ROLE postgres SET idle_in_transaction_session_timeout = "
            f"'{round(profile.timing.commit_timeout * 1000)}ms'"
        )
    for statement in statements:
        await admin_execute(admin, statement)
    rows = await admin_execute(admin, "SELECT $1::regnamespace::oid::bigint", SCHEMA)
    return password, int(rows[0][0])


async def _wait_for_leader(instances: _Instances, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await instances.leader() is not None:
            return True
        await asyncio.sleep(0.2)
    return False


async def run_torture(profile: Profile, seed: int, workdir: Path) -> Report:
    """Run ``profile`` with ``seed``, keeping journals and logs in ``workdir``."""
    rng = random.Random(seed)
    server = EmbeddedPostgres(settings={"track_commit_timestamp": "on"})
    await asyncio.to_thread(server.start)
    try:
        admin = server.url()
        lock_password, oid = await _prepare(admin, profile)
        instances = _Instances(server, workdir, profile, seed, lock_password, oid)
        injector = FaultInjector(instances, rng, profile.timing, guards=profile.guards)
        started = time.time()
        try:
            await instances.start()
            if not await _wait_for_leader(instances, _FIRST_LEADER):
                raise RuntimeError(f"no instance led within {_FIRST_LEADER} s: see {workdir}/logs")
            await _inject(profile, rng, injector, instances, started)
            await asyncio.sleep(_SETTLE)
            await _wait_for_leader(instances, _FIRST_LEADER)
        finally:
            await instances.stop()
        ended = time.time()
        history = read_history(instances.journals())
        rows = await admin_execute(
            admin, f'SELECT id, status, attempt FROM "{SCHEMA}".cronoq_tasks'
        )
        report = check(
            profile=profile.name,
            seed=seed,
            guards=profile.guards,
            timing=profile.timing,
            started=started,
            ended=ended,
            history=history,
            faults=injector.log,
            rows={r[0]: (r[1], r[2]) for r in rows},
            writes=await audit.fetch_writes(admin),
            takes=await audit.fetch_epochs(admin),
            crashes=instances.crashes,
        )
        (workdir / "report.json").write_text(json.dumps(report.figures(), indent=2))
        (workdir / "timeline.txt").write_text("\n".join(report.timeline) + "\n")
        return report
    finally:
        await asyncio.to_thread(server.destroy)


async def _inject(
    profile: Profile,
    rng: random.Random,
    injector: FaultInjector,
    instances: _Instances,
    started: float,
) -> None:
    """Inject faults for ``profile.duration``, then on until its targets are reached."""
    while True:
        elapsed = time.time() - started
        if elapsed >= profile.max_duration:
            return
        if elapsed >= profile.duration:
            changes = await instances.epoch() - 1
            if changes >= profile.min_changes and instances.count_acked() >= profile.min_acked:
                return
        await asyncio.sleep(rng.uniform(*profile.gap))
        # Bounded: every fault undoes itself within seconds; a hang is a harness bug.
        await asyncio.wait_for(injector.inject(), 120)
