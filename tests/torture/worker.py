"""One store instance of the torture test, in a process of its own.

Run as ``python -m tests.torture.worker CONFIG.json``. The instance competes for leadership
of the cluster's schema; while it leads, submitters commit new tasks and status transitions
through a :class:`~cronoq_store._committer.GroupCommitter`, continuously, and every
acknowledged submission is recorded in the instance's journal *after* the ack (so a journal
never claims more than the store acknowledged). Each transition's message names the epoch
and the instance that committed it (``e<epoch> <name>``), so the checker can tell, row by
row, which term wrote what.

Signals: ``SIGTERM`` stops the instance cleanly (drain, release, exit 0); ``SIGUSR1`` makes
the leader hand leadership over (release, then compete again after a pause).

Every task follows one lifecycle whose states are totally ordered by ``(attempt, rank)``:
queued (attempt 0) -> running (1) -> retrying (1) -> running (2) -> ... -> succeeded or
failed. A new leader knows only the attempt of a recovered live task, so it resumes it as
``running`` in the next attempt: strictly later than anything the previous leader wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from cronoq_store._committer import DEFAULT_BATCHES_IN_FLIGHT, GroupCommitter
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    Mutation,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store._errors import CommitterClosedError, FencedError, StoreError
from cronoq_store._results import Recovered
from cronoq_store._store import PgStore

from . import audit
from .journal import Journal

__all__ = ["WorkerConfig", "epoch_message", "main"]

#: Batches each term's committer keeps in flight (``CRONOQ_TORTURE_BATCHES_IN_FLIGHT``,
#: inherited from the orchestrator's environment).
_BATCHES_IN_FLIGHT = int(
    os.environ.get("CRONOQ_TORTURE_BATCHES_IN_FLIGHT", str(DEFAULT_BATCHES_IN_FLIGHT))
)

_T = TypeVar("_T")

#: Pause before competing again after a voluntary handover, in ``lock_poll`` units.
_HANDOVER_PAUSE = 3
#: Pause between attempts to open the store while the database is unreachable.
_CONNECT_RETRY = 0.3
#: Attempts after which a task that keeps failing is given up as failed.
_MAX_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything one worker process needs; written as JSON by the orchestrator."""

    name: str
    #: Pool URL and lock-session URL (each through the instance's own proxy).
    url: str
    lock_url: str
    schema: str
    journal: str
    #: Seeds this process's choices (the orchestrator derives it from the run's seed).
    seed: int
    #: Wall-clock time after which the worker stops on its own, whatever happens.
    deadline: float
    lock_poll: float
    keepalive: float
    session_timeout: float
    commit_timeout: float
    #: Concurrent submitters while leading.
    submitters: int
    #: Mutations per submission, at most.
    max_batch: int
    #: Longest pause of a submitter between two submissions, in seconds.
    max_pause: float
    #: Live tasks a submitter keeps, at most.
    live_cap: int
    #: ``False`` when ``url`` goes through a transaction-pooling PgBouncer (tests/ha).
    prepared_statements: bool = True

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> WorkerConfig:
        return cls(**json.loads(path.read_text()))

    def store_config(self) -> PgStoreConfig:
        return PgStoreConfig(
            schema=self.schema,
            lock_poll=self.lock_poll,
            keepalive=self.keepalive,
            session_timeout=self.session_timeout,
            commit_timeout=self.commit_timeout,
            max_connections=4,
            application_name=self.name,
            trusted_triggers=audit.TRIGGERS,
            prepared_statements=self.prepared_statements,
        )


def epoch_message(epoch: int, worker: str) -> str:
    """The message of every transition committed by ``worker`` in ``epoch``."""
    return f"e{epoch} {worker}"


class _Term:
    """One leadership term: the live tasks of each submitter and how they move on."""

    def __init__(
        self,
        config: WorkerConfig,
        epoch: int,
        recovered: Recovered,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.epoch = epoch
        self.rng = rng
        self.message = epoch_message(epoch, config.name)
        first = task_id(epoch, 0)
        self.next_n = max(0, recovered.next_id - first) if recovered.next_id > first else 0
        # task id -> (attempt, state code); "?" is a recovered task of unknown live status.
        self.live: list[dict[int, tuple[int, str]]] = [{} for _ in range(config.submitters)]
        for task in recovered.tasks:
            state = (0, "q") if task.attempt == 0 else (task.attempt, "?")
            self.live[task.id % config.submitters][task.id] = state

    def batch(self, submitter: int) -> tuple[list[Mutation], list[tuple[int, int, str]]]:
        """The next submission of ``submitter``: mutations and what each makes of its task."""
        live = self.live[submitter]
        rng = self.rng
        mutations: list[Mutation] = []
        states: list[tuple[int, int, str]] = []
        touched: set[int] = set()
        now = time.monotonic_ns()
        for _ in range(rng.randint(1, self.config.max_batch)):
            candidates = len(live) - len(touched)
            if len(live) < self.config.live_cap and (candidates <= 0 or rng.random() < 0.35):
                new = task_id(self.epoch, self.next_n)
                self.next_n += 1
                spec = TaskSpec(rng.randbytes(16), kind="torture", pool=f"p{submitter}")
                mutations.append(Submitted(new, self.next_n, now, spec))
                states.append((new, 0, "q"))
                live[new] = (0, "q")
                if rng.random() < 0.8:  # else it may start in this very batch (folded)
                    touched.add(new)
                continue
            if candidates <= 0:
                break
            victim = rng.choice([t for t in live if t not in touched])
            touched.add(victim)
            attempt, status = self._advance(*live[victim])
            mutations.append(
                StatusChanged(TaskId(victim), status, attempt, now, message=self.message)
            )
            code = _CODES[status]
            states.append((victim, attempt, code))
            if status.is_terminal:
                del live[victim]
            else:
                live[victim] = (attempt, code)
        return mutations, states

    def _advance(self, attempt: int, code: str) -> tuple[int, TaskStatus]:
        if code in ("q", "?", "y"):
            return attempt + 1, TaskStatus.RUNNING
        roll = self.rng.random()
        if roll < 0.5 or attempt >= _MAX_ATTEMPTS:
            return attempt, TaskStatus.SUCCEEDED if roll < 0.9 else TaskStatus.FAILED
        if roll < 0.6:
            return attempt, TaskStatus.FAILED
        return attempt, TaskStatus.RETRYING


_CODES = {
    TaskStatus.RUNNING: "r",
    TaskStatus.RETRYING: "y",
    TaskStatus.SUCCEEDED: "s",
    TaskStatus.FAILED: "f",
}


class Worker:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.journal = Journal(Path(config.journal), config.name)
        self.rng = random.Random(config.seed)
        self.stopping = asyncio.Event()
        self.handover = asyncio.Event()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stopping.set)
        loop.add_signal_handler(signal.SIGUSR1, self.handover.set)
        self.journal.write("start", pid=os.getpid())
        watchdog = asyncio.ensure_future(self._watch_orchestrator())
        try:
            store = await self._connect()
            if store is None:
                return
            try:
                await self._compete(store)
            finally:
                await store.close()
        finally:
            watchdog.cancel()
            self.journal.write("stop")
            self.journal.close()

    async def _watch_orchestrator(self) -> None:
        """Stop once the orchestrator is gone or the run's deadline has passed: a worker
        never outlives the run that started it."""
        parent = os.getppid()
        while not await self._stopped_within(1.0):
            if os.getppid() != parent or time.time() >= self.config.deadline:
                self.stopping.set()

    async def _connect(self) -> PgStore | None:
        """Open the store (migrating, as every instance does), retrying while unreachable."""
        while not self.stopping.is_set():
            try:
                return await PgStore.connect(
                    self.config.url,
                    self.config.store_config(),
                    lock_url=self.config.lock_url,
                )
            except StoreError as exc:
                if not exc.is_transient:
                    raise
                self.journal.write("unavailable", during="connect", error=str(exc))
            await self._stopped_within(_CONNECT_RETRY)
        return None

    async def _compete(self, store: PgStore) -> None:
        while not self.stopping.is_set():
            self.handover.clear()
            asked = time.time()
            epoch = await self._unless_stopping(store.acquire_leadership())
            if epoch is None:
                return
            self.journal.write("lead", e=epoch, pid=os.getpid(), asked=asked)
            reason = await self._lead(store, epoch)
            self.journal.write("stepdown", e=epoch, reason=reason)
            await store.release_leadership()
            if reason == "handover":
                await self._stopped_within(_HANDOVER_PAUSE * self.config.lock_poll)

    async def _lead(self, store: PgStore, epoch: int) -> str:
        """Lead one term; returns why it ended."""
        started = time.monotonic()
        base = TimeBase.now()
        while True:
            if not store.is_leader:
                return "lost while recovering"
            try:
                recovered = await self._unless_stopping(store.recover(base))
            except StoreError as exc:
                if not exc.is_transient:
                    raise
                self.journal.write("unavailable", during="recover", e=epoch, error=str(exc))
                await asyncio.sleep(self.config.lock_poll)
                continue
            if recovered is None:
                return "stopped"
            break
        self.journal.write(
            "recovered", e=epoch, seconds=time.monotonic() - started, live=len(recovered.tasks)
        )
        term = _Term(self.config, epoch, recovered, self.rng)
        committer = GroupCommitter(store, epoch, base, max_batches_in_flight=_BATCHES_IN_FLIGHT)
        try:
            submitters = [
                asyncio.ensure_future(self._submit(committer, term, i))
                for i in range(self.config.submitters)
            ]
            ends = {
                asyncio.ensure_future(store.leadership_lost()): "leadership lost",
                asyncio.ensure_future(self.stopping.wait()): "stopped",
                asyncio.ensure_future(self.handover.wait()): "handover",
            }
            done, _ = await asyncio.wait([*ends, *submitters], return_when=asyncio.FIRST_COMPLETED)
            reason = next((ends[f] for f in ends if f in done), None)
            if reason is None:
                reason = next(f.result() for f in submitters if f in done)
            if reason in ("leadership lost", "fenced"):
                # A deposed leader that does not give up: its submitters go on until the
                # store refuses them (locally, or by the epoch check in the database).
                await asyncio.wait(submitters, timeout=3 * self.config.commit_timeout)
            for future in [*ends, *submitters]:
                future.cancel()
            await asyncio.wait([*ends, *submitters])
        finally:
            # Draining commits what is queued unless leadership is gone (then it is fenced).
            await committer.close(drain=True, timeout=self.config.commit_timeout * 3)
        return reason

    async def _submit(self, committer: GroupCommitter, term: _Term, index: int) -> str:
        """Submit continuously; returns why it stopped (never on success)."""
        while True:
            mutations, states = term.batch(index)
            sent = time.time()
            try:
                await committer.submit(mutations)
            except FencedError as exc:
                self.journal.write("fenced", e=term.epoch, error=str(exc))
                return "fenced"
            except CommitterClosedError:
                return "committer closed"
            except StoreError as exc:
                self.journal.write("error", e=term.epoch, error=repr(exc))
                return "error"
            self.journal.write("ack", e=term.epoch, sent=sent, m=states)
            await asyncio.sleep(term.rng.uniform(0, self.config.max_pause))

    async def _unless_stopping(self, work: Awaitable[_T]) -> _T | None:
        """``await work`` unless a stop comes first (then ``None``, and ``work`` is cancelled)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StoreError):
            await task
        return None

    async def _stopped_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.stopping.wait(), seconds)
        except asyncio.TimeoutError:
            return False
        return True


def main() -> None:
    config = WorkerConfig.load(Path(sys.argv[1]))
    asyncio.run(Worker(config).run())


if __name__ == "__main__":
    main()
