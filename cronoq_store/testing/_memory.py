"""An in-memory ``Store`` for applications' unit tests: ``PgStore``'s rules without a server.

:class:`InMemoryStore` implements :class:`~cronoq_store._store.Store` and
:class:`~cronoq_store._store.StoreQueries` with the semantics an application can observe
through them (tests/contract runs one suite against both stores): the library's own batch
folding (it applies the :class:`~cronoq_store._commit_path.FoldedBatch` that
:func:`cronoq_store._commit_path.fold` makes, and keeps rows as the insert writes them, decoded by
:mod:`cronoq_store._schema` as ``PgStore``'s are), forward-only transitions (the rule
``statements.update_status_fenced`` applies in SQL, mirrored once by ``_update_status``),
idempotent commits, outputs kept only for tasks that succeeded, unique live keys, id
collisions, fencing, epochs that wrap 32767 -> 1, recovery, look-ups, pruning, and NUL
stored as U+FFFD (:func:`cronoq_store._domain.clean_text`). Instances built on one
:class:`InMemoryDatabase` form one cluster: one leads, the others wait in
:meth:`InMemoryStore.acquire_leadership` until it releases, closes, or loses its lock
session (:meth:`InMemoryStore.end_lock_session`).

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .._codec import QUARANTINE_PREFIX, decode_deps, engine_time, quarantine_reason
from .._commit_path import (
    MAX_COMMIT_BYTES,
    FoldedBatch,
    RecurringAction,
    batch_size,
    check_batch_size,
    fold,
    taken_keys,
)
from .._domain import (
    EPOCH_MAX,
    EPOCH_MIN,
    Mutation,
    TaskId,
    TaskRef,
    TaskStatus,
    TimeBase,
    check_seconds,
    check_task_id,
    level,
    unhandled,
)
from .._errors import (
    FencedError,
    IdCollisionError,
    KeyTakenError,
    StoreError,
)
from .._queries import finished_params, lookup_params, prune_cutoff
from .._recovery import next_id
from .._results import Recovered, RecoveredTerminal, TaskRecord
from .._schema import (
    INSERT_POSITION,
    LIVE_COLUMNS,
    RECORD_COLUMNS,
    STATE_COLUMNS,
    LiveTasks,
    StatusUpdates,
    recurring_schedule,
    same_task,
    set_state,
    task_record,
)
from ..telemetry import DISABLED, Telemetry

__all__ = ["InMemoryDatabase", "InMemoryStore"]

logger = logging.getLogger("cronoq_store")

_SUCCEEDED = TaskStatus.SUCCEEDED.value


#: Where each column sits in a stored row: a row is an insert row (``rows.INSERT_COLUMNS``
#: order), as ``folding.fold`` makes it; the output is kept beside it.
_P = INSERT_POSITION
_ID, _KEY, _DEPS, _POOL = _P["id"], _P["key"], _P["deps"], _P["pool"]
_STATUS, _TERMINAL, _ATTEMPT, _UPDATED, _MESSAGE = (_P[name] for name in STATE_COLUMNS)
_LIVE = tuple(_P[name] for name in LIVE_COLUMNS)
_RECORD = tuple(_P.get(name) for name in RECORD_COLUMNS)  # None: the output
#: A row's state columns (``rows.STATE_COLUMNS``), as a transition leaves them.
_State = tuple[str, bool, int, int, str | None]


@dataclass(slots=True)
class _Schedule:
    """One row of ``cronoq_recurring``: the spec as the JSON ``PgStore`` stores."""

    spec_json: str
    payload: bytes
    next: int | None = None
    last: int | None = None


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
        self._max_id = 0  # as cronoq_leader.max_id: the largest id pruned, 0 until one is
        self._tasks: dict[int, list[Any]] = {}  # rows by id
        self._outputs: dict[int, bytes] = {}
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

    def _write(self, batch: FoldedBatch) -> None:
        """Apply what ``folding.fold`` made of a batch whole, or raise with nothing applied:
        ids held by other tasks first (``IdCollisionError``), then live keys (``KeyTakenError``).

        The writes go in ``PgStore``'s order: transitions of stored tasks first (so a key
        they release can be taken by a task inserted after), then new tasks, outputs and
        schedules. A task sent again with transitions gets them as an update, as the writer's
        second attempt gives them (``FoldedBatch.resubmitted``); a task stored already is
        otherwise left as it is (``statements.insert_tasks``' conflict rule)."""
        tasks = self._tasks
        colliding = sorted(
            row[_ID]
            for row in batch.insert_rows
            if (stored := tasks.get(row[_ID])) is not None and not same_task(stored, row)
        )
        if colliding:
            raise IdCollisionError(colliding)
        taken = taken_keys(batch, tasks, self._live_keys)
        if taken:
            raise KeyTakenError(taken)
        moved: list[tuple[list[Any], _State]] = []
        updates = StatusUpdates.of(batch.resubmitted().updates)
        for i, id in enumerate(updates.ids):
            stored = tasks.get(id)
            state = None if stored is None else _update_status(stored, updates, i)
            if stored is not None and state is not None:  # else new, missing or not ahead
                moved.append((stored, state))
        new = [row for row in batch.insert_rows if row[_ID] not in tasks]
        for stored, state in moved:
            set_state(stored, *state)
            if stored[_TERMINAL] and stored[_KEY] is not None:
                self._live_keys.pop(stored[_KEY], None)
        for row in new:
            tasks[row[_ID]] = row
            if row[_KEY] is not None and not row[_TERMINAL]:
                self._live_keys[row[_KEY]] = row[_ID]
        for id, output in zip(batch.outputs["ids"], batch.outputs["outputs"], strict=True):
            done = tasks.get(id)
            if done is not None and done[_STATUS] == _SUCCEEDED:
                self._outputs[id] = output
        for action, params in batch.recurring:
            name = params["schedule"]
            kept = self._schedules.get(name)
            match action:
                case RecurringAction.UPSERT:
                    schedule = _Schedule(params["spec_json"], params["payload"])
                    if kept is not None:
                        schedule.next, schedule.last = kept.next, kept.last
                    self._schedules[name] = schedule
                case RecurringAction.REMOVE:
                    self._schedules.pop(name, None)
                case RecurringAction.NEXT:
                    if kept is not None:
                        kept.next, kept.last = params["next"], params["last"]
                case _:
                    unhandled(action, "recurring action")

    def _quarantine(self, row: list[Any], reason: str, now: int) -> None:
        set_state(
            row, TaskStatus.FAILED.value, True, row[_ATTEMPT], now, f"{QUARANTINE_PREFIX} {reason}"
        )
        if row[_KEY] is not None and self._live_keys.get(row[_KEY]) == row[_ID]:
            del self._live_keys[row[_KEY]]


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
        check_seconds("retention", retention)
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

    @property
    def telemetry(self) -> Telemetry:
        """As ``PgStore.telemetry``: an in-memory store records nowhere (``DISABLED``)."""
        return DISABLED

    async def ping(self) -> None:
        """As ``PgStore.ping``: the database always answers while the store is open."""
        self._check_open("pinging the database")

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
        """Whether this instance leads now."""
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

        Raises ``FencedError`` if ``epoch`` is not the stored one or leadership was lost
        before, and applies nothing then; only a fence of this instance's current term
        marks leadership lost (a late commit of an earlier term leaves the current one
        going), as ``PgStore`` does. Raises ``BatchTooLargeError``
        over :attr:`max_commit_bytes`, ``IdCollisionError`` for a different task under a
        stored id or an id of the batch, ``KeyTakenError`` for a key a live task holds, and
        ``ValueError`` naming the field for an engine time that leaves BIGINT through
        ``base``; in each case nothing of the batch is applied.
        """
        await self._commit_measured(epoch, base, batch, outputs, batch_size(batch, outputs))

    async def _commit_measured(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
        size: int,
    ) -> None:
        """:meth:`commit`, the batch's size already measured by the caller (``size``)."""
        self._check_open("committing a batch")
        if self._fenced or (self._has_led and self._epoch is None):
            raise FencedError("leadership was lost: this instance must not write any more")
        if self._epoch is not None and epoch != self._epoch:
            raise FencedError(
                f"fenced: epoch {epoch} is not this instance's term (epoch {self._epoch}): "
                "nothing was written, and the current term goes on"
            )
        check_batch_size(batch, outputs, self.max_commit_bytes, size)
        folded = fold(batch, base, time.time_ns(), outputs)
        await asyncio.sleep(0)  # a commit is a round trip: others run meanwhile
        current = self._db._epoch
        if current != epoch:
            if self._epoch is None or current != self._epoch:  # the current term is over
                self._fenced = True
                self._step_down()  # PgStore's keeper then closes its lock session
            raise FencedError(f"fenced: the stored epoch is {current}, this commit's is {epoch}")
        self._db._write(folded)

    async def recover(self, base: TimeBase) -> Recovered:
        """Live tasks, finished ones within ``retention`` or depended on by a live task,
        schedules, and the next id to issue, engine times through ``base``.

        A live row that the store's decoding refuses (a stored time outside
        64 bits through ``base``) is quarantined (marked failed with the reason) and
        reported as finished, as ``PgStore`` does with any row it cannot decode.
        """
        self._check_open("recovering")
        await asyncio.sleep(0)
        db = self._db
        now = time.time_ns()
        recovered = Recovered(next_id=next_id(db._max_id, max(db._tasks, default=None)))
        decode = LiveTasks(base).decode
        for id in sorted(id for id, row in db._tasks.items() if not row[_TERMINAL]):
            row = db._tasks[id]
            try:
                recovered.tasks.append(decode(*(row[i] for i in _LIVE)))
            except ValueError as exc:
                reason = quarantine_reason(exc)
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
                if row[_TERMINAL]
                and (row[_UPDATED] >= cutoff or row[_ID] in targets or row[_KEY] in targets)
            ),
            key=lambda row: (row[_UPDATED], row[_ID]),
        )
        recovered.terminal = [
            RecoveredTerminal(
                TaskId(row[_ID]),
                row[_KEY],
                TaskStatus(row[_STATUS]),
                engine_time(base, row[_UPDATED]),
            )
            for row in finished
        ]
        for name in sorted(db._schedules):
            s = db._schedules[name]
            try:
                recovered.recurring.append(
                    recurring_schedule(base, name, s.spec_json, s.payload, s.next, s.last)
                )
            except ValueError as exc:  # left in place, not scheduled
                logger.error(
                    "skipping undecodable recurring schedule",
                    extra={"schedule": name, "error": str(exc)},
                )
        return recovered

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of task ``id`` if it succeeded, else ``None``."""
        check_task_id("id", id)
        self._check_open("loading an output")
        return self._db._outputs.get(id)

    # --- queries ----------------------------------------------------------------------------

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref`` (an int), or the newest task with key ``ref`` (a str)."""
        params = lookup_params(ref)
        self._check_open("looking up a task")
        tasks = self._db._tasks
        if isinstance(ref, str):
            key = params["key"]
            newest = max((id for id, row in tasks.items() if row[_KEY] == key), default=None)
            return None if newest is None else self._record(newest)
        return self._record(ref) if ref in tasks else None

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks in id order with ids above ``after``, at most ``limit``: those in
        one of ``pools`` (any if empty) with one of ``statuses`` (any if empty)."""
        params = finished_params(pools, statuses, after, limit)
        self._check_open("listing finished tasks")
        wanted_pools, wanted_statuses = set(params["pools"]), set(params["statuses"])
        page = sorted(
            id
            for id, row in self._db._tasks.items()
            if row[_TERMINAL]
            and id > params["after"]
            and (not wanted_pools or row[_POOL] in wanted_pools)
            and (not wanted_statuses or row[_STATUS] in wanted_statuses)
        )[: params["limit"]]
        return [self._record(id) for id in page]

    async def prune(
        self, older_than: float, *, progress: Callable[[int], None] | None = None
    ) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago, except
        those a live task depends on (by id or key); returns how many were deleted.

        Deleted in one step: ``progress``, if given, is called once with the total.
        """
        cutoff = prune_cutoff(older_than)
        self._check_open("pruning finished tasks")
        db = self._db
        # Ids and keys that live tasks depend on (``statements.prune_batch``'s refs).
        protected = {
            d.target
            for row in db._tasks.values()
            if not row[_TERMINAL]
            for d in decode_deps(row[_DEPS])
        }
        victims = [
            id
            for id, row in db._tasks.items()
            if row[_TERMINAL]
            and row[_UPDATED] < cutoff
            and id not in protected
            and (row[_KEY] is None or row[_KEY] not in protected)
        ]
        # As ``statements.prune_batch``: the largest id deleted is recorded with the deletion.
        db._max_id = max([db._max_id, *victims])
        for id in victims:
            del db._tasks[id]
            db._outputs.pop(id, None)
        if progress is not None:
            progress(len(victims))
        return len(victims)

    def _record(self, id: int) -> TaskRecord:
        row, output = self._db._tasks[id], self._db._outputs.get(id)
        columns: list[Any] = [output if i is None else row[i] for i in _RECORD]
        return task_record(*columns)

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise StoreError(f"{action} failed: the store is closed")


def _update_status(row: list[Any], updates: StatusUpdates, i: int) -> _State | None:
    """The state transition ``i`` of ``update_status_fenced`` gives a stored row, or ``None`` where
    it does not move it. Mirrors the SQL of :mod:`cronoq_store._statements`: ``_forward``
    (a terminal row is final, a live one moves when the transition's ``(level, at)`` is
    greater than its own, ``_level`` in SQL being :func:`~cronoq_store._domain.level`) and
    ``_transition_values``' message (none keeps the stored one, the moving transition's own
    comes with it, an earlier one's only if that transition is ahead of the stored row)."""
    if row[_TERMINAL]:
        return None
    stored = (level(row[_STATUS], False, row[_ATTEMPT]), row[_UPDATED])
    at = updates.updated[i]
    moved = (updates.levels[i], at)
    if moved <= stored:
        return None
    status, terminal, attempt = updates.statuses[i], updates.terminals[i], updates.attempts[i]
    message_level, message_at = updates.message_levels[i], updates.message_ats[i]
    if message_level is None or message_at is None:
        return status, terminal, attempt, at, row[_MESSAGE]
    brought = (message_level, message_at)
    kept = brought != moved and brought <= stored
    return status, terminal, attempt, at, row[_MESSAGE] if kept else updates.messages[i]
