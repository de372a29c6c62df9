"""Faults for the torture test: on loopback only, each bounded in time, each undone.

The toolkit:

- :class:`InstanceLinks`: the two :class:`~tests.tcpproxy.TcpProxy` in front of one store
  instance, one for its pool and one for its leader-lock session, so a fault can hit either
  (a lock session partitioned while commits still flow is the case fencing exists for);
- :func:`sigkill`, :func:`sigstop` / :func:`sigcont`: the instance's process dies, or
  freezes (as in a long GC pause or a stalled VM) with its sockets left open;
- :func:`restart_server`: ``pg_ctl stop -m fast`` or ``-m immediate`` (a crash, as clients
  see it), down for a while, then start again on the same port;
- backend termination (``pg_terminate_backend``) of an instance's lock or pool sessions.

The proxy cannot make the server see a dead peer: its own kernel answers the server's TCP
keepalives. So for a partition the injector plays the server's part too: after a delay of
at most ``session_timeout`` it terminates the partitioned lock session, as the server's
keepalive (or ``tcp_user_timeout``) would, sooner than the store's own backstop (the lock
session's ``idle_session_timeout``). A commit transaction left open behind the partition
is left to the server's idle-in-transaction limit, if one is set (the guards).

:class:`FaultInjector` draws faults from a seeded RNG and records each as a :class:`Fault`:
what, on whom, when, and, for a fault that takes leadership away, when the lock became
free to take (``freed_at``), from which the checker measures takeovers.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from sqlalchemy.engine import URL

from cronoq_store.testing import EmbeddedPostgres, StopMode

from ..tcpproxy import TcpProxy

__all__ = [
    "LOCK_IDLE_FACTOR",
    "Cluster",
    "Fault",
    "FaultInjector",
    "InstanceLinks",
    "Timing",
    "lock_app",
    "restart_server",
    "sigcont",
    "sigkill",
    "sigstop",
]


#: The store's lock session asks the server to end it once idle for this many
#: ``session_timeout`` (``idle_session_timeout``, cronoq_store._leadership): what frees the
#: lock of a leader that is frozen, or cut off behind a path whose kernel still answers.
LOCK_IDLE_FACTOR = 1.5


def lock_app(worker: str) -> str:
    """``application_name`` of a worker's leader-lock session without its instance id (its
    pool's is its name)."""
    return f"{worker} leader"


class InstanceLinks:
    """The proxies between one store instance and the server: pool, and lock session."""

    def __init__(self, server: URL) -> None:
        self.pool = TcpProxy.to(server)
        self.lock = TcpProxy.to(server)

    async def start(self) -> InstanceLinks:
        await self.pool.start()
        await self.lock.start()
        return self

    async def close(self) -> None:
        await self.pool.close()
        await self.lock.close()

    def forward(self) -> None:
        self.pool.forward()
        self.lock.forward()


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def sigstop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def sigcont(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


async def restart_server(server: EmbeddedPostgres, mode: StopMode, down: float) -> float:
    """Stop the server (``pg_ctl -m mode``), keep it down ``down`` seconds, start it again;
    returns when it accepts connections again (wall clock). ``pg_ctl -w -t 60`` bounds both."""
    await asyncio.to_thread(server.stop, mode)
    try:
        await asyncio.sleep(down)
    finally:
        await asyncio.to_thread(server.start)
    return time.time()


@dataclass(frozen=True, slots=True)
class Timing:
    """The store settings every instance runs with (seconds)."""

    lock_poll: float
    keepalive: float
    session_timeout: float
    commit_timeout: float


@dataclass
class Fault:
    """One injected fault. Times are wall clock (``time.time()``)."""

    kind: str
    #: The instance it hit, or ``"server"``.
    target: str
    #: Whether ``target`` was leading when the fault was chosen.
    on_leader: bool
    started: float
    ended: float = 0.0
    #: When the leader lock became free to take, if this fault takes leadership away.
    freed_at: float | None = None
    #: Whether ``freed_at`` is exact (a kill, a reset, a termination, a release, a server
    #: back up), not an upper bound (a server-side idle limit, counted from an earlier ping).
    freed_exactly: bool = False
    #: How long, by design, the lock may stay out of reach after this fault (the checker's
    #: bound adds ``lock_poll``, recovery and slack): ``session_timeout`` unless set.
    allowance: float | None = None
    detail: dict[str, float | str] = field(default_factory=dict)

    def describe(self) -> str:
        params = " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.detail.items()
        )
        role = "leader" if self.on_leader else "standby" if self.target != "server" else ""
        return f"{self.kind} on {self.target} {role} {params}".replace("  ", " ").strip()


class Cluster(Protocol):
    """What the injector needs from whoever runs the store instances and the server."""

    @property
    def names(self) -> Sequence[str]: ...

    def links(self, name: str) -> InstanceLinks: ...

    def pid(self, name: str) -> int | None: ...

    async def leader(self) -> str | None:
        """The instance holding the leader lock now, if the server can tell."""
        ...

    async def respawn(self, name: str) -> None:
        """Start a new process for ``name`` (after its previous one died)."""
        ...

    async def reap(self, name: str) -> None:
        """Wait (bounded) for ``name``'s process to exit."""
        ...

    async def terminate(self, application_name: str) -> int:
        """``pg_terminate_backend`` every session with ``application_name``."""
        ...

    async def restart_server(self, mode: StopMode, down: float) -> float: ...


_Action = Callable[[Fault], Awaitable[None]]


class FaultInjector:
    """Injects one fault at a time, drawn from ``rng``; every fault undoes itself.

    ``guards``: the server ends a transaction idle for ``commit_timeout`` (a role setting
    the orchestrator made), so a transaction that a frozen or partitioned leader left open
    does not hold the leader row; without it, that row stays locked, and the next leader's
    epoch bump waits, until the old leader wakes up or its session is ended.
    """

    #: Faults aimed at the leader, and their weights.
    LEADER_FAULTS: ClassVar[dict[str, int]] = {
        "kill": 4,
        "cut": 2,
        "terminate_lock": 3,
        "isolate_lock": 3,
        "partition": 2,
        "pause": 2,
        "handover": 1,
        "delay": 1,
        "stall_pool": 1,
        "terminate_pool": 1,
    }
    #: Faults aimed at a standby or at the server.
    OTHER_FAULTS: ClassVar[dict[str, int]] = {
        "kill_standby": 1,
        "cut_standby": 1,
        "restart_fast": 1,
        "restart_immediate": 1,
    }

    def __init__(
        self, cluster: Cluster, rng: random.Random, timing: Timing, *, guards: bool
    ) -> None:
        self.cluster = cluster
        self.rng = rng
        self.timing = timing
        self.guards = guards
        self.log: list[Fault] = []
        self._first_round = [*self.LEADER_FAULTS, *self.OTHER_FAULTS]
        self._early_drop_due = True
        rng.shuffle(self._first_round)
        self._actions: dict[str, _Action] = {
            "kill": self._kill,
            "kill_standby": self._kill,
            "cut": self._cut,
            "cut_standby": self._cut,
            "terminate_lock": self._terminate_lock,
            "isolate_lock": self._isolate_lock,
            "partition": self._partition,
            "pause": self._pause,
            "handover": self._handover,
            "delay": self._delay,
            "stall_pool": self._stall_pool,
            "terminate_pool": self._terminate_pool,
            "restart_fast": self._restart,
            "restart_immediate": self._restart,
        }

    async def inject(self) -> Fault:
        """Choose a fault, inject it, and return once it is undone.

        Every kind comes once first, in a shuffled order (so even a short run covers the
        whole matrix); then one in four hits a standby or the server, the rest the leader,
        by weight. A leader fault waits its turn while no instance leads.
        """
        leader = await self.cluster.leader()
        kind = self._unplayed(leader is not None)
        if kind is None:
            leading = leader is not None and self.rng.random() < 0.75
            pool = self.LEADER_FAULTS if leading else self.OTHER_FAULTS
            kind = self.rng.choices(list(pool), weights=list(pool.values()))[0]
        if kind.startswith("restart"):
            target = "server"
        elif kind.endswith("standby"):
            standbys = [n for n in self.cluster.names if n != leader]
            target = self.rng.choice(standbys)
        else:
            assert leader is not None
            target = leader
        fault = Fault(kind, target, on_leader=target == leader, started=time.time())
        self.log.append(fault)
        try:
            await self._actions[kind](fault)
        finally:
            fault.ended = time.time()
        return fault

    # --- the faults -------------------------------------------------------------------------

    async def _kill(self, fault: Fault) -> None:
        """SIGKILL: the kernel closes its sockets, so the server frees the lock at once."""
        pid = self.cluster.pid(fault.target)
        if pid is None:
            return
        sigkill(pid)
        self._freed_now(fault, fault.started)
        await self.cluster.reap(fault.target)
        down = fault.detail["down"] = self.rng.uniform(0.2, 1.0)
        await asyncio.sleep(down)
        await self.cluster.respawn(fault.target)

    async def _cut(self, fault: Fault) -> None:
        """Reset every connection of the instance and refuse new ones for a while."""
        links = self.cluster.links(fault.target)
        links.pool.cut()
        links.lock.cut()
        self._freed_now(fault, fault.started)
        try:
            await asyncio.sleep(self._detail(fault, "hold", 0.2, 1.0))
        finally:
            links.forward()

    async def _terminate_lock(self, fault: Fault) -> None:
        """The server ends the leader's lock session; its pool keeps working."""
        if await self.cluster.terminate(lock_app(fault.target)):
            self._freed_now(fault, time.time())

    async def _isolate_lock(self, fault: Fault) -> None:
        """Only the lock session is partitioned: the leader's commits still reach the server.

        The server drops the session after ``x`` <= ``session_timeout``; when ``x`` is short,
        a standby leads while the old leader still believes it does, and only the epoch
        check stands between its commits and the database.
        """
        links = self.cluster.links(fault.target)
        links.lock.stall()
        try:
            await asyncio.sleep(self._server_drop(fault))
            self._freed(fault, lock_dropped=time.time(), open_transaction_ends=fault.started)
            await self.cluster.terminate(lock_app(fault.target))
            await asyncio.sleep(self._detail(fault, "hold", 0.0, 1.0))
        finally:
            links.lock.forward()

    async def _partition(self, fault: Fault) -> None:
        """The instance is cut off entirely. The server drops its lock session after ``x``;
        a commit transaction it had open stays, holding the leader row (and so the next
        leader's epoch bump) until the guards' idle limit ends it, or else until the
        partition heals."""
        links = self.cluster.links(fault.target)
        links.pool.stall()
        links.lock.stall()
        try:
            await asyncio.sleep(self._server_drop(fault))
            dropped = time.time()
            await self.cluster.terminate(lock_app(fault.target))
            await asyncio.sleep(self._detail(fault, "hold", 0.0, 1.0))
        finally:
            links.forward()
        self._freed(fault, lock_dropped=dropped, open_transaction_ends=time.time())

    async def _pause(self, fault: Fault) -> None:
        """SIGSTOP for longer than ``session_timeout``, then SIGCONT: a frozen leader whose
        sockets stay open, so only the server's idle limits can free the lock: the store's
        own on its lock session (``LOCK_IDLE_FACTOR`` x ``session_timeout``), and the
        guards' on a commit transaction it left open. A standby takes over; the old leader
        wakes up still believing it leads, and its next commit must be fenced."""
        pid = self.cluster.pid(fault.target)
        if pid is None:
            return
        fault.allowance = LOCK_IDLE_FACTOR * self.timing.session_timeout
        sigstop(pid)
        try:
            frozen = self.timing.session_timeout * self.rng.uniform(1.2, 3.0)
            fault.detail["frozen"] = frozen
            await asyncio.sleep(frozen)
        finally:
            sigcont(pid)
        # Awake, the leader finds its session silent for longer than session_timeout and
        # steps down, if the server has not freed its lock before.
        woke = time.time()
        self._freed(fault, lock_dropped=woke, open_transaction_ends=woke)

    async def _handover(self, fault: Fault) -> None:
        """The leader is asked to release leadership (a rolling restart's first step)."""
        pid = self.cluster.pid(fault.target)
        if pid is not None:
            os.kill(pid, signal.SIGUSR1)
            self._freed_now(fault, fault.started)

    async def _delay(self, fault: Fault) -> None:
        """A slow link: every byte both ways arrives late, but within ``session_timeout``."""
        links = self.cluster.links(fault.target)
        latency = self._detail(fault, "latency", 0.02, 0.2)
        links.pool.delay(latency)
        links.lock.delay(latency)
        try:
            await asyncio.sleep(self._detail(fault, "hold", 1.0, 3.0))
        finally:
            links.forward()

    async def _stall_pool(self, fault: Fault) -> None:
        """Commits hang (past ``commit_timeout`` at times) while the lock session is fine."""
        links = self.cluster.links(fault.target)
        links.pool.stall()
        try:
            ct = self.timing.commit_timeout
            await asyncio.sleep(self._detail(fault, "hold", 0.3 * ct, 1.5 * ct))
        finally:
            links.pool.forward()

    async def _terminate_pool(self, fault: Fault) -> None:
        """The server ends the leader's pool sessions, commits in flight included."""
        fault.detail["terminated"] = str(await self.cluster.terminate(fault.target))

    async def _restart(self, fault: Fault) -> None:
        mode: StopMode = "immediate" if fault.kind == "restart_immediate" else "fast"
        down = self._detail(fault, "down", 0.1, 4.0)
        fault.freed_at = await self.cluster.restart_server(mode, down)
        fault.freed_exactly = True

    # --- helpers ----------------------------------------------------------------------------

    def _unplayed(self, have_leader: bool) -> str | None:
        """The next kind not injected yet that can be injected now, if any."""
        for kind in self._first_round:
            if have_leader or kind not in self.LEADER_FAULTS:
                self._first_round.remove(kind)
                return kind
        return None

    def _detail(self, fault: Fault, name: str, low: float, high: float) -> float:
        value = self.rng.uniform(low, high)
        fault.detail[name] = value
        return value

    def _freed_now(self, fault: Fault, at: float) -> None:
        """Record that the leader's lock became free at ``at`` exactly."""
        if fault.on_leader:
            fault.freed_at = at
            fault.freed_exactly = True

    def _freed(self, fault: Fault, *, lock_dropped: float, open_transaction_ends: float) -> None:
        """Record when a stalled or frozen leader's lock became free to take, at the latest:
        its lock session ends when dropped, or once idle for ``LOCK_IDLE_FACTOR`` x
        ``session_timeout`` (the store's own limit), whichever comes first; and a commit
        transaction it may have left open holds the leader row until it ends, or until
        idle for ``commit_timeout`` with the guards. Both limits count from the last query,
        before the fault began: the times recorded are upper bounds."""
        if not fault.on_leader:
            return
        t = self.timing
        lock = min(lock_dropped, fault.started + LOCK_IDLE_FACTOR * t.session_timeout)
        row = open_transaction_ends
        if self.guards:
            row = min(row, fault.started + t.commit_timeout)
        fault.freed_at = max(lock, row)

    def _server_drop(self, fault: Fault) -> float:
        """How long the server takes to give up on a partitioned session: at most
        ``session_timeout``, often less (then a standby leads before the old leader's own
        timeout has told it to step down). The run's first ``isolate_lock`` always drops
        early, so that every run has a deposed leader still committing through its pool,
        which only the epoch check in the database can stop."""
        st = self.timing.session_timeout
        high = st
        if fault.kind == "isolate_lock" and self._early_drop_due:
            self._early_drop_due = False
            high = 0.4 * st
        return self._detail(fault, "server_drop", 0.1 * st, high)
