"""An in-memory ``Store`` for applications' unit tests: ``PgStore``'s rules without a server.

:class:`InMemoryStore` implements :class:`~cronoq_store.protocols.Store` and
:class:`~cronoq_store.protocols.StoreQueries` with the semantics an application can observe
through them (tests/contract runs one suite against both stores): batch folding and
forward-only transitions (:func:`cronoq_store.folding.level`), idempotent commits, outputs
kept only for tasks that succeeded, unique live keys, id collisions, fencing, epochs that
wrap 32767 -> 1, recovery, look-ups, pruning, and NUL stored as U+FFFD
(:func:`cronoq_store.domain.clean_text`). Instances built on one :class:`InMemoryDatabase`
form one cluster: one leads, the others wait in :meth:`InMemoryStore.acquire_leadership`
until it releases, closes, or loses its lock session (:meth:`InMemoryStore.end_lock_session`).

What it cannot honour, by design:

- durability: the state lives as long as the :class:`InMemoryDatabase` object, in one
  process; nothing survives it, and another process cannot see it;
- the database's failures: no commit ever times out or raises ``UnavailableError``, no
  session dies unless a test ends it, and rows are never corrupt (so nothing is quarantined
  unless a recovery's time base puts a stored time outside 64 bits);
- concurrency beyond one event loop: use the instances of one database from one loop (one
  commit is applied in one step, with no await in between, which is what a transaction
  gives ``PgStore``);
- logs and figures: it writes none of ``PgStore``'s warnings, and costs nothing like it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum
from types import TracebackType

from ..codec import (
    QUARANTINE_PREFIX,
    decode_recurring,
    duration_to_ns,
    encode_recurring,
    ns_to_duration,
    unix_converter,
)
from ..domain import (
    EPOCH_MAX,
    EPOCH_MIN,
    I64_MAX,
    I64_MIN,
    QUEUED,
    UNIX_EPOCH,
    Dependency,
    Mutation,
    Recovered,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskSpec,
    TaskStatus,
    TimeBase,
    clean_text,
)
from ..errors import BatchTooLargeError, FencedError, IdCollisionError, KeyTakenError, StoreError
from ..folding import level
from ..sizing import MAX_COMMIT_BYTES, batch_size

__all__ = ["InMemoryDatabase", "InMemoryStore"]

logger = logging.getLogger("cronoq_store")

_SUCCEEDED = TaskStatus.SUCCEEDED.value
_REASON_CHARS = 500


@dataclass(slots=True)
class _Task:
    """One task as ``cronoq_tasks`` stores it: strings cleaned, times in Unix ns, durations
    as their stored nanoseconds give them back (``spec.deadline`` and
    ``spec.fixed_start.at`` hold Unix ns here, not engine time)."""

    id: int
    seq: int
    arrival: int
    spec: TaskSpec
    status: str = QUEUED
    terminal: bool = False
    attempt: int = 0
    updated: int = 0
    message: str | None = None
    output: bytes | None = None

    def same_task(self, other: _Task) -> bool:
        """Whether ``other`` is this task sent again (the state aside), as the insert's
        conflict check decides: every stored column but the state columns is equal."""
        return (self.seq, self.arrival, self.spec) == (other.seq, other.arrival, other.spec)

    @property
    def position(self) -> tuple[int, int]:
        return level(self.status, self.terminal, self.attempt), self.updated


@dataclass(slots=True)
class _Transition:
    """A task's latest state after the transitions of one batch that moved it forward, and
    the position of the one that brought its message (as ``folding`` folds them)."""

    status: str
    terminal: bool
    attempt: int
    at: int
    level: int
    message: str | None
    message_position: tuple[int, int] | None

    def ahead_of(self, position: tuple[int, int], terminal: bool) -> bool:
        return not terminal and (self.level, self.at) > position

    def message_over(self, stored: _Task) -> str | None:
        """The message after this transition moved ``stored``: its own, or an earlier one
        of the batch if that one is ahead of the stored state, else the stored one."""
        position = self.message_position
        if position is None:
            return stored.message
        if position == (self.level, self.at) or position > stored.position:
            return self.message
        return stored.message


class _Action(Enum):
    UPSERT = "upsert"
    REMOVE = "remove"
    NEXT = "next"


@dataclass(slots=True)
class _Schedule:
    """One row of ``cronoq_recurring``: the spec as the JSON ``PgStore`` stores (in a
    folded ``NEXT`` change, only ``next`` and ``last`` count: what to record)."""

    spec_json: str
    payload: bytes
    next: int | None = None
    last: int | None = None


@dataclass(slots=True)
class _Folded:
    """One batch, folded: what the commit writes, in the order it writes it."""

    transitions: dict[int, _Transition] = field(default_factory=dict)
    inserts: dict[int, _Task] = field(default_factory=dict)
    recurring: list[tuple[_Action, str, _Schedule]] = field(default_factory=list)
    outputs: dict[int, bytes] = field(default_factory=dict)


class InMemoryDatabase:
    """The state the :class:`InMemoryStore` instances of one cluster share: the tasks, the
    schedules, the stored epoch and id high-water mark, and the leader lock.

    ``epoch`` is the stored epoch to start from, 0 (no leader yet) by default; a test of the
    wrap starts at ``EPOCH_MAX - 1``.
    """

    def __init__(self, *, epoch: int = 0) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= EPOCH_MAX:
            raise ValueError(f"epoch: must be an integer in 0..{EPOCH_MAX}, got {epoch!r}")
        self._epoch = epoch
        self._max_id = 0  # as cronoq_leader.max_id: 0 until a batch records one
        self._tasks: dict[int, _Task] = {}
        self._live_keys: dict[str, int] = {}  # the unique index on live keys
        self._schedules: dict[str, _Schedule] = {}
        self._holder: InMemoryStore | None = None
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def epoch(self) -> int:
        """The stored fencing epoch (0 before the first leader)."""
        return self._epoch

    def _take_lock(self, store: InMemoryStore) -> int:
        self._holder = store
        self._epoch = EPOCH_MIN if self._epoch >= EPOCH_MAX else self._epoch + 1
        return self._epoch

    def _free_lock(self, store: InMemoryStore) -> None:
        if self._holder is store:
            self._holder = None
        self._wake()

    def _wake(self) -> None:
        """Let every waiting acquisition look again (at the lock, or at its store closing)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _next_id(self) -> int:
        recorded = self._max_id + 1 if self._max_id > 0 else 0
        return max(recorded, max(self._tasks, default=-1) + 1)

    def _write(self, batch: _Folded) -> None:
        """Apply ``batch`` whole, or raise with nothing applied: ids held by other tasks
        first (``IdCollisionError``), then live keys (``KeyTakenError``). Transitions of stored
        tasks come first, so a key they release can be taken by a task inserted after."""
        tasks = self._tasks
        colliding = sorted(
            id
            for id, row in batch.inserts.items()
            if (stored := tasks.get(id)) is not None and not stored.same_task(row)
        )
        if colliding:
            raise IdCollisionError(colliding)
        moved: list[tuple[_Task, _Transition]] = []
        released: set[str] = set()
        for id, t in batch.transitions.items():
            stored = tasks.get(id)
            if stored is None or not t.ahead_of(stored.position, stored.terminal):
                continue  # new (its row carries it), missing (pruned?), or not ahead
            moved.append((stored, t))
            if t.terminal and stored.spec.key is not None:
                released.add(stored.spec.key)
        new = [row for id, row in batch.inserts.items() if id not in tasks]
        taken: dict[str, int] = {}
        for row in new:
            key = row.spec.key
            if key is None or row.terminal:
                continue
            holder = taken.get(key)
            if holder is None and key not in released:
                holder = self._live_keys.get(key)
            if holder is not None:
                raise KeyTakenError([key])
            taken[key] = row.id

        for stored, t in moved:
            message = t.message_over(stored)
            stored.status, stored.terminal, stored.attempt = t.status, t.terminal, t.attempt
            stored.updated, stored.message = t.at, message
            if t.terminal and stored.spec.key is not None:
                self._live_keys.pop(stored.spec.key, None)
        for row in new:
            tasks[row.id] = row
            if row.spec.key is not None and not row.terminal:
                self._live_keys[row.spec.key] = row.id
        if batch.inserts:
            self._max_id = max(self._max_id, max(batch.inserts))
        for id, output in batch.outputs.items():
            done = tasks.get(id)
            if done is not None and done.status == _SUCCEEDED:
                done.output = output
        for action, name, schedule in batch.recurring:
            if action is _Action.UPSERT:
                kept = self._schedules.get(name)
                if kept is not None:
                    schedule.next, schedule.last = kept.next, kept.last
                self._schedules[name] = schedule
            elif action is _Action.REMOVE:
                self._schedules.pop(name, None)
            elif (kept := self._schedules.get(name)) is not None:
                kept.next, kept.last = schedule.next, schedule.last

    def _quarantine(self, row: _Task, reason: str, now: int) -> None:
        row.status, row.terminal, row.updated = TaskStatus.FAILED.value, True, now
        row.message = f"{QUARANTINE_PREFIX} {reason}"
        if row.spec.key is not None and self._live_keys.get(row.spec.key) == row.id:
            del self._live_keys[row.spec.key]


class InMemoryStore:
    """A ``Store`` and ``StoreQueries`` over an :class:`InMemoryDatabase`, for unit tests.

    ``retention`` (float seconds) is ``PgStoreConfig.retention``: how long finished tasks
    are recovered. Use it as an async context manager, or call :meth:`close`. See the module
    docstring for what it does not honour.
    """

    #: As ``PgStore.max_commit_bytes``: a batch estimated larger fails with
    #: ``BatchTooLargeError`` before anything is applied.
    max_commit_bytes: int = MAX_COMMIT_BYTES

    def __init__(
        self, database: InMemoryDatabase | None = None, *, retention: float = 3600.0
    ) -> None:
        if (
            isinstance(retention, bool)
            or not isinstance(retention, (int, float))
            or not math.isfinite(retention)
            or retention <= 0
        ):
            raise ValueError(f"retention must be a positive number of seconds, got {retention!r}")
        self._db = InMemoryDatabase() if database is None else database
        self._retention = retention
        self._epoch: int | None = None
        self._has_led = False
        self._fenced = False
        self._closed = False
        self._lost = asyncio.Event()
        self._acquiring = asyncio.Lock()

    @property
    def database(self) -> InMemoryDatabase:
        """The state this instance shares with the others of its cluster."""
        return self._db

    async def close(self) -> None:
        """Give up leadership and stop any acquisition in progress; the data stays in the
        database for the other instances."""
        if self._closed:
            return
        self._closed = True
        self._step_down()  # which also wakes this instance's acquisition, to give up

    async def __aenter__(self) -> InMemoryStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"InMemoryStore(epoch={self._epoch}, tasks={len(self._db._tasks)})"

    # --- leadership -------------------------------------------------------------------------

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch.

        Acquiring while leading starts a new term with a new epoch, as ``PgStore`` does.
        """
        async with self._acquiring:
            self._check_open("acquiring leadership")
            if self._db._holder is self:
                self._step_down()
            while self._db._holder is not None:
                waiter = asyncio.get_running_loop().create_future()
                self._db._waiters.append(waiter)
                await waiter
                self._check_open("acquiring leadership")
            self._epoch = self._db._take_lock(self)
            self._has_led, self._fenced = True, False
            self._lost.clear()
            return self._epoch

    async def release_leadership(self) -> None:
        """Release the leader lock; commits fail with ``FencedError`` from now on."""
        self._step_down()

    def end_lock_session(self, *, noticed: bool = True) -> None:
        """What a terminated backend or a partition does to ``PgStore``'s lock session: the
        lock is free for a standby at once.

        With ``noticed`` (the default) this instance steps down at once, as ``PgStore``'s
        keeper does within ``session_timeout``. With ``noticed=False`` it goes on believing
        it leads, as a partitioned leader does until its keeper notices: its commits are
        fenced by the epoch check once a standby took over, and that marks leadership lost
        (or call this again with ``noticed=True``).
        """
        if noticed:
            self._step_down()
        else:
            self._db._free_lock(self)

    async def leadership_lost(self) -> None:
        """Return once leadership held by this instance is lost (or released)."""
        await self._lost.wait()

    @property
    def is_leader(self) -> bool:
        return self._epoch is not None

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads, else ``None``."""
        return self._epoch

    def _step_down(self) -> None:
        """Stop leading, and free the lock if this instance holds it."""
        self._epoch = None
        self._lost.set()
        self._db._free_lock(self)

    # --- commits ----------------------------------------------------------------------------

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        """Apply ``batch`` and ``outputs`` as one transaction would; idempotent.

        Raises ``FencedError`` if ``epoch`` is not the stored one (leadership is then marked
        lost and nothing is applied) or leadership was lost before, ``BatchTooLargeError``
        over :attr:`max_commit_bytes`, ``IdCollisionError`` for a different task under a
        stored id or an id of the batch, ``KeyTakenError`` for a key a live task holds, and
        ``ValueError`` naming the field for an engine time that leaves BIGINT through
        ``base``; in each case nothing of the batch is applied.
        """
        self._check_open("committing a batch")
        if self._fenced or (self._has_led and self._epoch is None):
            raise FencedError("leadership was lost: this instance must not write any more")
        size = batch_size(batch, outputs)
        if size > self.max_commit_bytes:
            raise BatchTooLargeError(
                f"committing a batch failed: its {len(batch)} mutations and {len(outputs)} "
                f"outputs take up to {size} bytes, over the {self.max_commit_bytes} bytes "
                "one commit may send; commit them in smaller batches"
            )
        folded = _fold(batch, base, time.time_ns(), outputs)
        await asyncio.sleep(0)  # a commit is a round trip: others run meanwhile
        current = self._db._epoch
        if current != epoch:
            self._fenced = True
            self._step_down()  # PgStore's keeper then closes the lock session, if it has one
            raise FencedError(f"fenced: the stored epoch is {current}, this instance's is {epoch}")
        self._db._write(folded)

    async def recover(self, base: TimeBase) -> Recovered:
        """Live tasks, finished ones within ``retention`` or depended on by a live task,
        schedules, and the next id to issue, engine times through ``base``.

        A live task whose stored times leave 64 bits through ``base`` is quarantined (marked
        failed with the reason) and reported as finished, as ``PgStore`` does with any row
        it cannot decode.
        """
        self._check_open("recovering")
        await asyncio.sleep(0)
        db = self._db
        now = time.time_ns()
        recovered = Recovered(next_id=db._next_id())
        for id in sorted(id for id, row in db._tasks.items() if not row.terminal):
            row = db._tasks[id]
            try:
                recovered.tasks.append(_recovered_task(base, row))
            except ValueError as exc:
                reason = clean_text(str(exc))[:_REASON_CHARS]
                logger.error(
                    "quarantining undecodable task row", extra={"task_id": id, "error": reason}
                )
                db._quarantine(row, reason, now)
        targets = {d.target for t in recovered.tasks for d in t.spec.deps}  # ids and keys
        cutoff = now - round(self._retention * 1e9)
        finished = sorted(
            (
                row
                for row in db._tasks.values()
                if row.terminal
                and (row.updated >= cutoff or row.id in targets or row.spec.key in targets)
            ),
            key=lambda row: (row.updated, row.id),
        )
        recovered.terminal = [
            RecoveredTerminal(
                TaskId(row.id), row.spec.key, TaskStatus(row.status), base.from_unix(row.updated)
            )
            for row in finished
        ]
        for name in sorted(db._schedules):
            schedule = db._schedules[name]
            try:
                spec = decode_recurring(base, name, schedule.spec_json, schedule.payload)
                next_ = None if schedule.next is None else _engine_time(base, schedule.next)
            except ValueError as exc:  # left in place, not scheduled
                logger.error(
                    "skipping undecodable recurring schedule",
                    extra={"schedule": name, "error": str(exc)},
                )
                continue
            last = None if schedule.last is None else TaskId(schedule.last)
            recovered.recurring.append(RecoveredRecurring(spec, next_, last))
        return recovered

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of task ``id`` if it succeeded, else ``None``."""
        self._check_open("loading an output")
        row = self._db._tasks.get(id)
        return row.output if row is not None and row.status == _SUCCEEDED else None

    # --- queries ----------------------------------------------------------------------------

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref`` (an int), or the newest task with key ``ref`` (a str)."""
        self._check_open("looking up a task")
        tasks = self._db._tasks
        if isinstance(ref, str):
            key = clean_text(ref)
            newest = max((id for id, row in tasks.items() if row.spec.key == key), default=None)
            return None if newest is None else _record(tasks[newest])
        row = tasks.get(int(ref))
        return None if row is None else _record(row)

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks in id order with ids above ``after``, at most ``limit``: those in
        one of ``pools`` (any if empty) with one of ``statuses`` (any if empty)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: must be a non-negative integer, got {limit!r}")
        self._check_open("listing finished tasks")
        wanted_pools = {clean_text(p) for p in pools}
        wanted_statuses = {s.value for s in statuses}
        low = -1 if after is None else after
        page = sorted(
            id
            for id, row in self._db._tasks.items()
            if row.terminal
            and id > low
            and (not wanted_pools or row.spec.pool in wanted_pools)
            and (not wanted_statuses or row.status in wanted_statuses)
        )[:limit]
        return [_record(self._db._tasks[id]) for id in page]

    async def prune(
        self, older_than: float, *, progress: Callable[[int], None] | None = None
    ) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago, except
        those a live task depends on (by id or key); returns how many were deleted.

        Deleted in one step: ``progress``, if given, is called once with the total.
        """
        if (
            isinstance(older_than, bool)
            or not isinstance(older_than, (int, float))
            or not math.isfinite(older_than)
            or older_than < 0
        ):
            raise ValueError(
                f"older_than: must be a non-negative number of seconds, got {older_than!r}"
            )
        self._check_open("pruning finished tasks")
        tasks = self._db._tasks
        cutoff = time.time_ns() - round(older_than * 1e9)
        # Ids and keys that live tasks depend on.
        protected = {d.target for row in tasks.values() if not row.terminal for d in row.spec.deps}
        victims = [
            id
            for id, row in tasks.items()
            if row.terminal
            and row.updated < cutoff
            and id not in protected
            and (row.spec.key is None or row.spec.key not in protected)
        ]
        for id in victims:
            del tasks[id]
        if progress is not None:
            progress(len(victims))
        return len(victims)

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise StoreError(f"{action} failed: the store is closed")


def _fold(
    batch: Sequence[Mutation],
    base: TimeBase,
    now: int,
    outputs: Sequence[tuple[TaskId, bytes]],
) -> _Folded:
    """``batch`` as the writes of one commit, by ``folding.fold``'s rules: a transition
    counts only if it moves the task forward, a message carries forward, a new task is
    inserted once with its latest state (queued at ``now`` without one), the same
    ``Submitted`` again is a no-op and a different one under its id a collision."""
    folded = _Folded(outputs=dict(outputs))
    to_unix = unix_converter(base)
    for m in batch:
        if isinstance(m, StatusChanged):
            status = m.status
            at = to_unix(m.at, "at")
            lvl = level(status.value, status.is_terminal, m.attempt)
            message = None if m.message is None else clean_text(m.message)
            later = _Transition(
                status.value,
                status.is_terminal,
                m.attempt,
                at,
                lvl,
                message,
                None if message is None else (lvl, at),
            )
            earlier = folded.transitions.get(m.id)
            if earlier is None:
                folded.transitions[m.id] = later
            elif later.ahead_of((earlier.level, earlier.at), earlier.terminal):
                if message is None:
                    later.message, later.message_position = (
                        earlier.message,
                        earlier.message_position,
                    )
                folded.transitions[m.id] = later
        elif isinstance(m, Submitted):
            row = _Task(m.id, m.seq, to_unix(m.arrival, "arrival"), _stored_spec(m.spec, to_unix))
            row.updated = now
            earlier_row = folded.inserts.get(m.id)
            if earlier_row is None:
                folded.inserts[m.id] = row
            elif not earlier_row.same_task(row):
                raise IdCollisionError([m.id], in_batch=True)
        elif isinstance(m, RecurringUpsert):
            spec = m.spec
            schedule = _Schedule(encode_recurring(base, spec), spec.template.payload)
            folded.recurring.append((_Action.UPSERT, clean_text(spec.name), schedule))
        elif isinstance(m, RecurringRemove):
            folded.recurring.append((_Action.REMOVE, clean_text(m.name), _Schedule("", b"")))
        elif isinstance(m, RecurringNext):
            next_ = None if m.next is None else to_unix(m.next, "next")
            advance = _Schedule("", b"", next_, m.last)
            folded.recurring.append((_Action.NEXT, clean_text(m.name), advance))
        else:
            raise TypeError(f"not a mutation: {type(m).__name__}")
    for id, t in folded.transitions.items():
        new = folded.inserts.get(id)
        if new is not None:
            new.status, new.terminal, new.attempt = t.status, t.terminal, t.attempt
            new.updated, new.message = t.at, t.message
    return folded


def _stored(td: timedelta) -> timedelta:
    """A duration as its stored nanoseconds give it back (capped at 2**63 - 1 ns)."""
    return ns_to_duration(duration_to_ns(td))


def _stored_retry(retry: RetryPolicy) -> RetryPolicy:
    cap = retry.max_backoff
    return replace(
        retry, backoff=_stored(retry.backoff), max_backoff=None if cap is None else _stored(cap)
    )


def _stored_spec(spec: TaskSpec, to_unix: Callable[[int, str], int]) -> TaskSpec:
    """``spec`` as stored: every string cleaned, times in Unix ns, durations as stored."""
    fixed, key, tenant = spec.fixed_start, spec.key, spec.tenant
    return replace(
        spec,
        kind=clean_text(spec.kind),
        pool=clean_text(spec.pool),
        key=None if key is None else clean_text(key),
        tenant=None if tenant is None else clean_text(tenant),
        deadline=None if spec.deadline is None else to_unix(spec.deadline, "deadline"),
        fixed_start=None
        if fixed is None
        else replace(
            fixed, at=to_unix(fixed.at, "fixed_start.at"), tolerance=_stored(fixed.tolerance)
        ),
        duration_hint=None if spec.duration_hint is None else _stored(spec.duration_hint),
        timeout=None if spec.timeout is None else _stored(spec.timeout),
        retry=None if spec.retry is None else _stored_retry(spec.retry),
        deps=tuple(
            Dependency(clean_text(d.target), d.condition) if isinstance(d.target, str) else d
            for d in spec.deps
        ),
        resources={clean_text(name): amount for name, amount in spec.resources.items()},
        tags=tuple(map(clean_text, spec.tags)),
        labels=tuple(map(clean_text, spec.labels)),
    )


def _engine_time(base: TimeBase, unix_ns: int) -> int:
    engine_ns = base.from_unix(unix_ns)
    if not I64_MIN <= engine_ns <= I64_MAX:
        raise ValueError(f"engine time {engine_ns} through {base!r} is outside -2**63..2**63-1")
    return engine_ns


def _recovered_task(base: TimeBase, row: _Task) -> RecoveredTask:
    """A live task with engine times through ``base``; ``ValueError`` if one leaves 64
    bits (the domain's own checks say which)."""
    spec, fixed = row.spec, row.spec.fixed_start
    if spec.deadline is not None or fixed is not None:
        spec = replace(
            spec,
            deadline=None if spec.deadline is None else base.from_unix(spec.deadline),
            fixed_start=None if fixed is None else replace(fixed, at=base.from_unix(fixed.at)),
        )
    return RecoveredTask(
        TaskId(row.id), row.seq, _engine_time(base, row.arrival), spec, row.attempt
    )


def _record(row: _Task) -> TaskRecord:
    spec = row.spec
    return TaskRecord(
        id=TaskId(row.id),
        key=spec.key,
        pool=spec.pool,
        kind=spec.kind,
        priority=spec.priority,
        tenant=spec.tenant,
        status=TaskStatus.from_stored(row.status),
        attempt=row.attempt,
        message=row.message,
        output=row.output,
        updated=UNIX_EPOCH + timedelta(microseconds=max(row.updated, 0) // 1000),
    )
