"""A commit's path below the store: its batch folded into the column-wise parameters of a few
statements, its size bounded, and the way it is written.

Folding (:func:`fold`) is pure (no I/O), so its rules can be tested on their own:

- a task's states are totally ordered (:func:`level`, then the transition's time): attempt
  first, then queued < running < retrying < terminal, and a terminal state is final. A
  transition applies only if it moves the task forward; one that does not (a duplicate, a
  late retry, a tie) changes nothing, its message included;
- a task submitted in the batch is inserted once, carrying its latest state, so a task that
  is born and finishes in one batch is written once. The same ``Submitted`` again is a
  no-op; a different task under the same id raises :class:`~cronoq_store._errors.IdCollisionError`;
- a task stored by an earlier batch gets one forward-only update (``update_status_fenced``). So
  does a task submitted in the batch with transitions, but only when it turns out to be
  stored already (a submission sent again): the insert then signals it and the writer
  writes the batch again with those updates first (see :mod:`cronoq_store._commit_path`);
- a message carries forward until a later transition brings its own; the update carries the
  position of the transition that brought it, so the statement keeps the stored message
  when that transition is not ahead of the stored state;
- recurring changes keep their batch order.

These rules make the stored result independent of how mutations were split into batches and
of batches delivered again after their first delivery, the database applying the same order
in each statement, provided first deliveries come in the order the mutations were emitted. A
batch first delivered after a later one is applied as if emitted last: its transitions that
are not ahead change nothing, messages included, and the first finished state delivered
stays (the store cannot tell that from a history that went backwards itself).
Every string, inside JSON values too, goes through ``clean_text`` (NUL and lone surrogates
become U+FFFD): PostgreSQL cannot store them, and one bad string would fail the whole batch.

The parameter names of the returned dictionaries are the bind names of the statements in
:mod:`cronoq_store._statements`; new tasks are rows made by :mod:`cronoq_store._schema`.

A batch's size: how many bytes it puts on the wire, estimated from above, cheaply, per
mutation.

PostgreSQL refuses a protocol message over 1 GiB - 1 and any single value over 1 GiB, and
it refuses them by closing the connection: to a client that is indistinguishable from an
outage, so a batch that large would be retried forever. The group committer builds batches
under a byte bound with :func:`mutation_size` and :func:`output_size`, and
``PgStore.commit`` refuses, before sending anything, a batch over :data:`MAX_COMMIT_BYTES`
by :func:`batch_size`: the same estimate on both sides.

The estimate is an upper bound of what the commit's statements carry: bytes as they are,
text as UTF-8 after cleaning (at most 4 bytes per character, NUL becoming U+FFFD), JSON
strings escaped (at most 6 bytes per character), plus a fixed allowance per row for the
other columns and the array framing. It never encodes anything.

The commit path: which way a folded batch is written, on the connection the door lends
(:class:`~cronoq_store._door.CommitConnection`: the statements of
:mod:`cronoq_store._statements`, compiled once per schema, the transaction's messages, the
COPY), and what the writer found turned into errors.

A commit is the store's hot path and mostly round trips and client CPU: SQLAlchemy's
per-execution work (parameter processing, result wrapping, a greenlet switch per call)
cost more than the server's at small batches. So the commit's statements, still Core
constructs composed in :mod:`cronoq_store._statements`, are compiled for the engine's
dialect with the cluster's schema (``schema_translate_map``, rendered once:
:class:`~cronoq_store._door.CompiledStatement`), and executed with asyncpg's
prepared-statement cache, on a connection :class:`~cronoq_store._door.HeldConnection`
checks out.
Reads keep the SQLAlchemy path.

A batch that only inserts new tasks (fewer than :data:`COPY_MIN_ROWS`), or only changes
statuses, is one statement: the epoch check lives in a CTE of the write, so no BEGIN or
COMMIT travels (on a borrowed session, the statement runs between the ``BEGIN`` that sets
the store's settings and ``COMMIT``). Every other batch runs in one transaction in the
contract's order: epoch check, updates, inserts, outputs, recurring. Its ``BEGIN`` travels
with the epoch check in one message (the check's parameters are integers we render ourselves). From
:data:`COPY_MIN_ROWS` new tasks on, the inserts travel by binary COPY straight into the
tasks table: a few more round trips than one statement, much less work per row on both
sides. COPY has no conflict rule, so it is optimistic: a batch whose COPY meets a stored
id or a taken live key (a batch sent again, an id collision, a key held) rolls back and is
written again by the insert below, whose conflict rule tells these apart. The common batch
(new tasks) pays only the COPY.

An insert that finds one of its ids stored fails when the stored row is a different task, or
is the same task and the batch's transitions of it are ahead (see ``statements._insert_from``),
which rolls back everything the batch wrote. The writer then names the ids held by other
tasks (``statements.colliding_ids``) and reports them instead of the epoch; if there are
none, it writes the batch again in one transaction with those transitions in the update,
before the insert. It does the same when such a batch fails on the unique index of live
keys: a task it sends again may still hold, in the store, a key that a new task of the batch
takes once the update has finished the old holder; a key still refused then is really held.
That costs nothing to the common batch: a submission is sent again together with a
transition only when an unacknowledged batch is retried.

Whichever row meets the server first, an id held by another task wins over a held key: a
refusal on the live-key index is followed by the same look-up of colliding ids, and only a
batch without one reports its keys, every key taken (``statements.key_holders`` and
``folding.taken_keys``, the rule the in-memory store applies too).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, ClassVar, Protocol

from sqlalchemy import ClauseElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine

from . import _statements as st
from ._codec import clean_text, encode_recurring, unix_converter
from ._domain import (
    CronSchedule,
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
    level,
    unhandled,
)
from ._door import (
    ClusterMoved,
    CommitConnection,
    CompiledStatement,
    HeldConnection,
    InsertRefused,
    Opening,
    RowsStatement,
    closing_message,
    executing,
    refused_statement,
    row_count,
)
from ._errors import (
    BatchTooLargeError,
    IdCollisionError,
    KeyTakenError,
)
from ._schema import (
    INSERT_COLUMNS,
    INSERT_POSITION,
    UPDATE_PARAMS,
    StatusUpdates,
    insert_row,
    same_task,
    set_state,
    tasks,
    transposed,
)

__all__ = [
    "COPY_MIN_ROWS",
    "MAX_COMMIT_BYTES",
    "BatchWriter",
    "Carrier",
    "CommitPath",
    "Fence",
    "FoldedBatch",
    "GroupMember",
    "RecurringAction",
    "Written",
    "batch_size",
    "check_batch_size",
    "fold",
    "mutation_size",
    "output_size",
    "taken_keys",
    "write_group",
]


class RecurringAction(Enum):
    """Which recurring statement a change runs."""

    UPSERT = "upsert"
    REMOVE = "remove"
    NEXT = "next"


@dataclass(slots=True)
class _Transition:
    """A task's state after the transitions of one batch that moved it forward, and the
    position (``level``, ``at``) of the one that brought its message."""

    status: str
    terminal: bool
    attempt: int
    at: int
    level: int
    message: str | None
    message_level: int | None
    message_at: int | None

    def ahead_of(self, other: _Transition) -> bool:
        return not other.terminal and (self.level, self.at) > (other.level, other.at)


#: Marks a field of :class:`FoldedBatch` that the commit writes (see ``FoldedBatch.writes``).
_WRITE = {"write": True}


@dataclass(slots=True)
class FoldedBatch:
    """What one commit writes. The fields marked as writes are in the order the
    transaction writes them; :meth:`writes` names those that hold something, so that the
    writer's choices follow from the fields and a new kind of write cannot be skipped."""

    #: ``update_status_fenced`` parameters: one row per task not submitted in the batch.
    updates: dict[str, list[Any]] = field(metadata=_WRITE)
    #: The same for tasks submitted in the batch that have transitions, whose insert rows
    #: carry them: needed only where such a task turns out to be stored already (see
    #: :meth:`resubmitted`).
    inserted_updates: dict[str, list[Any]]
    #: New tasks, one row each in ``rows.INSERT_COLUMNS`` order (what COPY takes).
    insert_rows: list[list[Any]] = field(metadata=_WRITE)
    #: ``store_outputs`` parameters: one row per task (the last output given wins).
    outputs: dict[str, list[Any]] = field(metadata=_WRITE)
    #: Recurring changes in batch order.
    recurring: list[tuple[RecurringAction, dict[str, Any]]] = field(
        default_factory=list, metadata=_WRITE
    )

    #: The write fields, in the order the transaction writes them.
    WRITES: ClassVar[tuple[str, ...]]

    def writes(self) -> tuple[str, ...]:
        """The write fields that hold something, in :attr:`WRITES` order. A field holds a
        list of rows, or parameter columns (a dict of equally long lists)."""
        return tuple(name for name in self.WRITES if _count(getattr(self, name)))

    def resubmitted(self) -> FoldedBatch:
        """This batch with ``inserted_updates`` moved into its updates: for a batch that
        turned out to send tasks stored already, so that their transitions move the stored
        rows."""
        extra = self.inserted_updates
        updates = {name: v + extra[name] for name, v in self.updates.items()}
        return replace(self, updates=updates, inserted_updates={name: [] for name in extra})

    @property
    def inserts(self) -> dict[str, list[Any]]:
        """``insert_tasks`` parameters: the rows transposed, one array per column."""
        return transposed(self.insert_rows)

    @property
    def update_count(self) -> int:
        return len(self.updates["ids"])

    @property
    def insert_count(self) -> int:
        return len(self.insert_rows)

    @property
    def output_count(self) -> int:
        return len(self.outputs["ids"])


FoldedBatch.WRITES = tuple(f.name for f in fields(FoldedBatch) if f.metadata.get("write"))

_ID, _KEY, _TERMINAL = INSERT_POSITION["id"], INSERT_POSITION["key"], INSERT_POSITION["terminal"]


def taken_keys(
    batch: FoldedBatch, stored_ids: Container[int], live_holders: Mapping[str, int]
) -> list[str]:
    """Every key that ``batch`` gives a new live task while another live task holds it, sorted:
    what ``KeyTakenError.keys`` lists, in both stores.

    ``stored_ids`` holds (at least) which of the batch's ids are stored, ``live_holders`` the
    id of the stored live task holding each of its keys. A key is taken when its holder is
    not finished by the batch (its updates run before its inserts; a transition to a
    finished state always moves a live task) or when an earlier new task of the batch takes
    it. Ids held by other tasks are checked before, and win (``IdCollisionError``).
    """
    updates = batch.resubmitted().updates
    finished = {id for id, done in zip(updates["ids"], updates["terminals"], strict=True) if done}
    given: set[str] = set()
    taken: set[str] = set()
    for row in batch.insert_rows:
        key = row[_KEY]
        if key is None or row[_TERMINAL] or row[_ID] in stored_ids:
            continue
        holder = live_holders.get(key)
        if key in given or (holder is not None and holder not in finished):
            taken.add(key)
        given.add(key)
    return sorted(taken)


def _count(value: list[Any] | dict[str, list[Any]]) -> int:
    """Rows in a write field: a list's length, or a parameter column's."""
    if isinstance(value, dict):
        return len(next(iter(value.values()), ()))
    return len(value)


def fold(
    batch: Sequence[Mutation],
    base: TimeBase,
    now_unix_ns: int,
    outputs: Sequence[tuple[TaskId, bytes]] = (),
) -> FoldedBatch:
    """Fold ``batch`` and ``outputs``; new tasks without a transition get ``now_unix_ns`` as
    their update time. Engine times are converted to Unix ns through ``base``; one that
    leaves BIGINT raises ``ValueError`` naming the field (only its submission then fails).

    Long for a reason: one ``match`` over the batch with each case inline, since a call per
    mutation costs the fold 5-10% (measured on 5000 transitions)."""
    to_unix = unix_converter(base)
    distinct = _distinct_transitions(batch)
    if distinct is not None:
        # Transitions of distinct tasks (most status batches): nothing to fold, so their
        # columns are built directly, as the loop below would build them.
        last_output = dict(outputs)
        return FoldedBatch(
            updates=_transition_params(distinct, to_unix),
            inserted_updates=_update_params({}),
            insert_rows=[],
            outputs={"ids": list(last_output), "outputs": list(last_output.values())},
        )
    rows: list[list[Any]] = []  # one list per row is much cheaper than 25 column appends
    inserted: dict[int, int] = {}
    transitions: dict[int, _Transition] = {}  # insertion-ordered: first transition's order
    recurring: list[tuple[RecurringAction, dict[str, Any]]] = []

    for m in batch:
        match m:
            case StatusChanged():  # inline: a call per transition costs the fold 5-10%
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
                    None if message is None else lvl,
                    None if message is None else at,
                )
                earlier = transitions.get(m.id)
                if earlier is None:
                    transitions[m.id] = later
                elif later.ahead_of(earlier):
                    if message is None:
                        later.message = earlier.message
                        later.message_level = earlier.message_level
                        later.message_at = earlier.message_at
                    transitions[m.id] = later
            case Submitted():
                row = insert_row(m, to_unix, now_unix_ns)
                i = inserted.get(m.id)
                if i is None:
                    inserted[m.id] = len(rows)
                    rows.append(row)
                elif not same_task(rows[i], row):
                    raise IdCollisionError([m.id], in_batch=True)
            case RecurringUpsert(spec=spec):
                upsert = {
                    "schedule": clean_text(spec.name),
                    "spec_json": encode_recurring(base, spec),
                    "payload": spec.template.payload,
                }
                recurring.append((RecurringAction.UPSERT, upsert))
            case RecurringRemove(name=name):
                recurring.append((RecurringAction.REMOVE, {"schedule": clean_text(name)}))
            case RecurringNext(name=name, next=next_, last=last):
                advance = {
                    "schedule": clean_text(name),
                    "next": None if next_ is None else to_unix(next_, "next"),
                    "last": last,
                }
                recurring.append((RecurringAction.NEXT, advance))
            case _:
                unhandled(m)

    stored: dict[int, _Transition] = {}
    resubmitted: dict[int, _Transition] = {}
    for id, t in transitions.items():
        i = inserted.get(id)
        if i is None:
            stored[id] = t
            continue
        resubmitted[id] = t
        set_state(rows[i], t.status, t.terminal, t.attempt, t.at, t.message)
    last_output = dict(outputs)
    return FoldedBatch(
        updates=_update_params(stored),
        inserted_updates=_update_params(resubmitted),
        insert_rows=rows,
        outputs={"ids": list(last_output), "outputs": list(last_output.values())},
        recurring=recurring,
    )


def _distinct_transitions(batch: Sequence[Mutation]) -> list[StatusChanged] | None:
    """``batch`` if it holds only transitions, of distinct tasks; else ``None``."""
    found: list[StatusChanged] = []
    for m in batch:
        if type(m) is not StatusChanged:
            return None
        found.append(m)
    return found if len({m.id for m in found}) == len(found) else None


def _transition_params(
    batch: Sequence[StatusChanged], to_unix: Callable[[int, str], int]
) -> dict[str, list[Any]]:
    """``update_status_fenced`` parameters of transitions of distinct tasks: what
    :func:`_update_params` makes of them, without a ``_Transition`` per row."""
    u = StatusUpdates()
    ids, statuses, terminals, attempts = u.ids, u.statuses, u.terminals, u.attempts
    updated, levels, messages = u.updated, u.levels, u.messages
    message_levels, message_ats = u.message_levels, u.message_ats
    for m in batch:
        status = m.status
        name, terminal = status.value, status.is_terminal
        at = to_unix(m.at, "at")
        lvl = level(name, terminal, m.attempt)
        ids.append(m.id)
        statuses.append(name)
        terminals.append(terminal)
        attempts.append(m.attempt)
        updated.append(at)
        levels.append(lvl)
        if m.message is None:
            messages.append(None)
            message_levels.append(None)
            message_ats.append(None)
        else:
            messages.append(clean_text(m.message))
            message_levels.append(lvl)
            message_ats.append(at)
    return u.params()


def _update_params(transitions: dict[int, _Transition]) -> dict[str, list[Any]]:
    """``update_status_fenced`` parameters, one row per task."""
    if not transitions:  # most batches: no transitions, or only of tasks stored before
        return {name: [] for name in UPDATE_PARAMS}
    latest = transitions.values()
    return StatusUpdates(
        ids=list(transitions),
        statuses=[t.status for t in latest],
        terminals=[t.terminal for t in latest],
        attempts=[t.attempt for t in latest],
        updated=[t.at for t in latest],
        levels=[t.level for t in latest],
        messages=[t.message for t in latest],
        message_levels=[t.message_level for t in latest],
        message_ats=[t.message_at for t in latest],
    ).params()


#: The largest batch ``PgStore.commit`` sends: half of PostgreSQL's 1 GiB - 1 limit on a
#: protocol message and on any one value, so that neither the estimate's slack nor the
#: server's own copies of a value can reach it.
MAX_COMMIT_BYTES = 512 * 2**20

# Fixed allowances, in bytes: the columns of a new task's row that are not measured below
# (ids, times, flags, each with a 4-byte length in its array), a status transition's row, an
# output's id and framing, and a recurring change's parameters and statement.
_TASK_ROW = 320
_TRANSITION_ROW = 96
_OUTPUT_ROW = 32
_RECURRING_ROW = 256
# Per element of a JSON array or object: punctuation, field names, numbers.
_JSON_ITEM = 64


def _text(value: str | None) -> int:
    """UTF-8 bytes of ``value`` as stored: ASCII exactly (a NUL becomes 3 bytes), else at
    most 4 per character."""
    if value is None:
        return 0
    if value.isascii():
        return len(value) + 2 * value.count("\x00")
    return 4 * len(value)


def _json_strings(values: Collection[str]) -> int:
    """An upper bound for ``values`` as JSON strings (escapes included)."""
    return 6 * sum(map(len, values)) + _JSON_ITEM * len(values)


def _json_columns(spec: TaskSpec) -> int:
    """The spec's JSON columns: dependencies, resources, tags, labels, retry policy."""
    size = 0
    deps = spec.deps
    if deps:
        size += _JSON_ITEM * len(deps)
        for dep in deps:
            # isinstance, not a type check: a key of a str subclass is sent as a key too.
            if isinstance(dep.target, str):
                size += 6 * len(dep.target)
    if spec.resources:
        size += _json_strings(spec.resources.keys())
    if spec.tags:
        size += _json_strings(spec.tags)
    if spec.labels:
        size += _json_strings(spec.labels)
    if spec.retry is not None:
        size += 2 * _JSON_ITEM
    return size


def _task_size(spec: TaskSpec) -> int:
    """Upper bound of the bytes a new task of ``spec`` adds to a commit: its row's fixed
    allowance, the payload, its short text columns at 4 bytes per character (measuring them
    costs more than the slack does) and its JSON columns (dependencies, resources, tags,
    labels, retry policy).

    Straight-line for a reason: ``PgStore.commit`` measures every new task of a batch, and
    this ran a fifth of the store's client CPU beyond raw asyncpg's at batch 1,000 as a
    ``match`` case with a call per spec (0.46 us per task)."""
    key, tenant = spec.key, spec.tenant
    text = len(spec.kind) + len(spec.pool)
    if key is not None:
        text += len(key)
    if tenant is not None:
        text += len(tenant)
    size = _TASK_ROW + len(spec.payload) + 4 * text
    return size + _json_columns(spec)


def mutation_size(mutation: Mutation) -> int:
    """Upper bound of the bytes ``mutation`` adds to a commit."""
    if type(mutation) is Submitted:  # nearly every mutation: no pattern match
        return _task_size(mutation.spec)
    match mutation:
        case Submitted(spec=spec):  # a subclass
            return _task_size(spec)
        case StatusChanged(message=message):
            return _TRANSITION_ROW + _text(message)
        case RecurringUpsert(spec=recurring):
            template = recurring.template
            # The template is stored as JSON (its payload in a column of its own), so its
            # text fields count as JSON strings, and so do a cron schedule's.
            strings = [template.kind, template.pool, template.key or "", template.tenant or ""]
            match recurring.schedule:
                case CronSchedule(expr=expr, timezone=zone):
                    strings += (expr, zone)
                case IntervalSchedule():
                    pass
                case schedule:
                    unhandled(schedule, "schedule")
            return (
                _RECURRING_ROW
                + _text(recurring.name)
                + len(template.payload)
                + _json_strings(strings)
                + _json_columns(template)
            )
        case RecurringRemove(name=name) | RecurringNext(name=name):
            return _RECURRING_ROW + _text(name)
        case _:
            unhandled(mutation)


def output_size(output: tuple[TaskId, bytes]) -> int:
    """Upper bound of the bytes one ``(id, output)`` pair adds to a commit."""
    return _OUTPUT_ROW + len(output[1])


def batch_size(batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]]) -> int:
    """Upper bound of the bytes a commit of ``batch`` and ``outputs`` sends."""
    return sum(map(mutation_size, batch)) + sum(map(output_size, outputs))


def check_batch_size(
    batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]], limit: int, size: int
) -> None:
    """``BatchTooLargeError``, before anything is sent, when ``size`` (the
    :func:`batch_size` of ``batch`` and ``outputs``) is over ``limit`` bytes: the check of
    both stores."""
    if size > limit:
        raise BatchTooLargeError(
            f"committing a batch failed: its {len(batch)} mutations and {len(outputs)} "
            f"outputs take up to {size} bytes, over the {limit} bytes one commit may send "
            "(PostgreSQL refuses a message over 1 GiB); commit them in smaller batches"
        )


logger = logging.getLogger("cronoq_store")

#: New tasks per batch from which they travel by COPY rather than as array parameters of
#: one statement: the crossover measured on 2 cores (see docs/performance.md).
COPY_MIN_ROWS = 32


#: The leader row as a commit found it: the stored epoch and the cluster's incarnation (the
#: leader table's OID), each ``None`` without a leader row.
Fence = tuple[int | None, int | None]
_NO_FENCE: Fence = (None, None)

# The incarnation a failed closing check names (statements.incarnation_kept): its own text,
# which the server quotes in its message whatever the message's language.


class _WriteFenced(ClusterMoved):
    """A transaction's fenced write (its update, or its insert of new tasks) found
    ``fence``, not the one the transaction checked (and holds): the schema's name led to
    another cluster then, and the write wrote nothing. The transaction must not commit;
    the writer answers ``fence`` as found. A :class:`~cronoq_store._door.ClusterMoved`, so
    that a transaction several clusters' commits share is rolled back, and its commits
    written again (:func:`write_group`: this one alone, where it is refused again)."""

    def __init__(self, fence: Fence) -> None:
        super().__init__(fence[1])
        self.fence = fence


def _check_fence(found: Any, fenced: Mapping[str, int | None]) -> None:
    """Raise :class:`_WriteFenced` unless a fenced write inside a transaction found the
    epoch and incarnation (``found``, its first row) the transaction checked."""
    fence: Fence = _NO_FENCE if found is None else (found[0], found[1])
    if fence != (fenced["epoch"], fenced["incarnation"]):
        raise _WriteFenced(fence)


#: One write of a batch's transaction, on the door's connection (:attr:`BatchWriter._writers`).
_Write = Callable[[CommitConnection, FoldedBatch, bool, Mapping[str, int | None]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Written:
    """What ``BatchWriter.write`` found: the stored epoch and incarnation (nothing was
    written unless they are the batch's), or ids held by other tasks, or else live keys
    held by other live tasks (nothing was written)."""

    fence: Fence
    colliding: list[int] | None = None
    taken: list[str] | None = None


class BatchWriter:
    """Writes folded batches for one cluster; ``write`` says what it found.

    ``copy_min_rows``: new tasks per batch from which they travel by COPY.
    ``borrowed``: the sessions may carry settings that are not the store's (an application's
    engine, or PgBouncer handing out any server connection), so every statement runs in a
    transaction opened by these statements (:func:`~cronoq_store._statements.borrowed_transaction`,
    ``BEGIN`` first), sent with the transaction's first statement; a batch of one kind of
    write then runs its one statement in such a transaction. :attr:`borrowed_opening` is
    that opening as one message.
    """

    def __init__(
        self,
        dialect: Dialect,
        schema: str,
        *,
        copy_min_rows: int = COPY_MIN_ROWS,
        borrowed: Sequence[ClauseElement] | None = None,
    ) -> None:
        self._copy_min_rows = copy_min_rows
        self._schema = schema

        def compiled(statement: ClauseElement) -> CompiledStatement:
            return CompiledStatement.of(statement, dialect, schema)

        if not 1 <= copy_min_rows <= st.FENCED_INSERT_MAX_ROWS + 1:
            raise ValueError(
                f"copy_min_rows: 1 to {st.FENCED_INSERT_MAX_ROWS + 1}, not {copy_min_rows}: "
                "fewer new tasks travel as one statement, whose size is bounded"
            )
        self._compiled = compiled
        # insert_tasks_fenced per size, compiled at its first use.
        self._fenced_inserts: dict[int, RowsStatement] = {}
        self._update_fenced = compiled(st.update_status_fenced)
        check = compiled(st.epoch_held_for_share)
        #: The message that opens a transaction on a borrowed session, ``None`` when the
        #: sessions are the store's own.
        self.borrowed_opening: str | None = None
        if borrowed is None:
            self._sharing = Opening.of(check)
        else:
            begin, *settings = [compiled(statement) for statement in borrowed]
            self.borrowed_opening = "; ".join([begin.sql, *(s.sql for s in settings)])
            self._sharing = Opening.of(check, *settings, begin=begin.sql)
        self._held_for_share = check
        kept = compiled(st.incarnation_kept)
        self._closing = Opening.closing(kept)
        self._kept = Opening.checking(kept)
        self._stored_fence = compiled(st.epoch_for_share)
        #: A group's statements on the bus's own sessions (:func:`write_group`).
        self.staged_check = compiled(st.epoch_kept_for_share)
        self.staged_insert = compiled(st.insert_staged)
        self.staging_setup = compiled(st.create_staging).sql
        self._insert = compiled(st.insert_tasks)
        self._outputs = compiled(st.store_outputs)
        self._colliding_ids = compiled(st.colliding_ids)
        self._key_holders = compiled(st.key_holders)
        self._recurring = {
            RecurringAction.UPSERT: compiled(st.upsert_recurring),
            RecurringAction.REMOVE: compiled(st.remove_recurring),
            RecurringAction.NEXT: compiled(st.advance_recurring),
        }
        # One writer per write field of FoldedBatch: a field without one fails here, at
        # construction, instead of being skipped by every commit.
        self._writers: dict[str, _Write] = {
            "updates": self._write_updates,
            "insert_rows": self._write_inserts,
            "outputs": self._write_outputs,
            "recurring": self._write_recurring,
        }
        if set(self._writers) != set(FoldedBatch.WRITES):
            raise RuntimeError(
                f"BatchWriter writes {sorted(self._writers)}, FoldedBatch holds "
                f"{sorted(FoldedBatch.WRITES)}"
            )

    @property
    def schema(self) -> str:
        """The cluster's schema."""
        return self._schema

    @property
    def group_opening(self) -> str:
        """The message that opens a transaction several clusters' commits share: ``BEGIN``,
        with the store's settings on a borrowed session."""
        return self.borrowed_opening or "BEGIN"

    async def write(
        self, conn: CommitConnection, epoch: int, incarnation: int, batch: FoldedBatch
    ) -> Written:
        """Write ``batch`` on the door's connection ``conn`` if ``epoch`` is the stored
        epoch, ``incarnation`` the cluster's, and none of its ids is held by another task,
        else write nothing."""
        fence = (epoch, incarnation)
        if self._copied(batch):
            # Optimistic: new tasks, as nearly every batch holds. A stored id or a taken
            # live key fails the COPY (and rolls back everything): the insert below, with
            # its conflict rule, then says which it was.
            with contextlib.suppress(InsertRefused):
                return Written(await self._write(conn, fence, batch, copy=True))
        try:
            return Written(await self._write(conn, fence, batch, copy=False))
        except InsertRefused as exc:
            refusal = exc
        # Ids held by other tasks win over held keys, whichever row met the server first.
        colliding = await self._colliding(conn, batch)
        if colliding:
            return Written(_NO_FENCE, colliding)
        if batch.inserted_updates["ids"]:
            # Tasks the batch submits may be stored already with its transitions moving
            # them: write the batch again, those transitions in the update, before the
            # insert. A live key that still fails then is held by another task.
            try:
                return Written(await self._write(conn, fence, batch.resubmitted(), copy=False))
            except InsertRefused as exc:
                refusal = exc
            colliding = await self._colliding(conn, batch)
            if colliding:
                return Written(_NO_FENCE, colliding)
        if not refusal.unique:
            return Written(_NO_FENCE, colliding)  # the colliding task was gone when looked up
        return Written(_NO_FENCE, taken=await self._held_keys(conn, batch) or refusal.keys)

    async def _held_keys(self, conn: CommitConnection, batch: FoldedBatch) -> list[str]:
        """The keys of ``batch`` that other live tasks hold (:func:`folding.taken_keys`)."""
        rows = await self._fetch(conn, self._key_holders, batch.inserts)
        stored = {row[0] for row in rows}
        holders = {row[1]: row[0] for row in rows if not row[2] and row[1] is not None}
        return taken_keys(batch, stored, holders)

    async def _colliding(self, conn: CommitConnection, batch: FoldedBatch) -> list[int]:
        return [row[0] for row in await self._fetch(conn, self._colliding_ids, batch.inserts)]

    async def _fetch(
        self, conn: CommitConnection, stmt: CompiledStatement, params: Mapping[str, Any]
    ) -> Any:
        if self.borrowed_opening is None:
            return await conn.fetch(stmt, params)
        try:
            await conn.send(self.borrowed_opening)
            return await conn.fetch(stmt, params)
        finally:
            await conn.roll_back_failed()

    def path(self, batch: FoldedBatch) -> str:
        """The write path ``batch`` takes first (a batch written again after its insert
        found ids or keys stored runs in a transaction, or as one ``insert``): one
        statement (``insert`` or ``update``, when it holds one kind of write that has a
        fenced form), ``copy`` (a transaction whose new tasks travel by COPY), or
        ``transaction``."""
        return self._path(batch, batch.writes(), self._copied(batch))

    def _path(self, batch: FoldedBatch, writes: tuple[str, ...], copy: bool) -> str:
        # A large batch written again after its COPY was refused takes the transaction: the
        # fenced insert's rows are bounded.
        if (
            writes == ("insert_rows",)
            and not copy
            and batch.insert_count <= st.FENCED_INSERT_MAX_ROWS
        ):
            return "insert"
        if writes == ("updates",):
            return "update"
        return "copy" if copy else "transaction"

    async def _write(
        self, conn: CommitConnection, fence: Fence, batch: FoldedBatch, *, copy: bool
    ) -> Fence:
        """Write ``batch`` under ``fence`` (epoch, incarnation); the fence found, which is
        ``fence`` itself when the batch was written."""
        epoch, incarnation = fence
        fenced = {"epoch": epoch, "incarnation": incarnation}
        writes = batch.writes()
        path = self._path(batch, writes, copy)
        if path in ("insert", "update"):
            if self.borrowed_opening is None:
                return await self._write_one(conn, fence, batch, path)
            return await self._write_one_borrowed(conn, fence, batch, path, self.borrowed_opening)
        try:
            checked = await conn.send(self._sharing.sql(fenced))
            if row_count(checked) != 1:
                found_fence = await self._fence_moved(conn, fence)
                await conn.roll_back()
                return found_fence
            # In FoldedBatch.WRITES order: updates first, so keys they release can be
            # reused by tasks inserted after them.
            for name in writes:
                await self._writers[name](conn, batch, copy, fenced)
        except _WriteFenced as moved:
            await conn.roll_back_failed()
            return moved.fence
        except BaseException:
            await conn.roll_back_failed()
            raise
        try:
            # The schema's name may lead to another cluster by now: each write looked its
            # table up again. Checked after them, with the COMMIT, in one message.
            await conn.finish(self._closing.sql(fenced))
        except ClusterMoved as moved:
            await conn.roll_back_failed()
            # Nothing was committed. Another cluster's incarnation is named as found; no
            # leader row reads as no fence at all, never as this batch's.
            return _NO_FENCE if moved.found is None else (epoch, moved.found)
        except BaseException:
            await conn.roll_back_failed()
            raise
        return fence

    async def _write_one(
        self, conn: CommitConnection, fence: Fence, batch: FoldedBatch, path: str
    ) -> Fence:
        """``batch`` as one statement (``path`` ``insert`` or ``update``), which writes
        nothing unless ``fence`` holds; the fence found."""
        epoch, incarnation = fence
        fenced = {"epoch": epoch, "incarnation": incarnation}
        if path == "insert":
            rows = batch.insert_rows
            found = await conn.fetchrow_rows(self._fenced_insert(len(rows)), rows, fenced)
            return _NO_FENCE if found is None else (found[0], found[1])
        found = await conn.fetchrow(self._update_fenced, {**batch.updates, **fenced})
        if found is None:
            return _NO_FENCE
        if (found[0], found[1]) == fence:
            _warn_unchanged(batch.update_count, found[2])
        return found[0], found[1]

    async def _write_one_borrowed(
        self, conn: CommitConnection, fence: Fence, batch: FoldedBatch, path: str, opening: str
    ) -> Fence:
        """:meth:`_write_one` on a borrowed session: the statement needs the store's
        settings, so it runs in a transaction they open (``BEGIN`` and them, one message),
        then ``COMMIT``, or ``ROLLBACK`` when the fence did not hold. Its epoch check and
        its write look the table up once, as on the store's own sessions: no closing check
        (:meth:`write_shared` writes such a batch so inside a shared transaction too)."""
        try:
            await conn.send(opening)
            found = await self._write_one(conn, fence, batch, path)
            if found != fence:
                await conn.roll_back()
                return found
            await conn.send("COMMIT")
        except BaseException:
            await conn.roll_back_failed()
            raise
        return fence

    def _fenced_insert(self, count: int) -> RowsStatement:
        """The ``insert_tasks_fenced`` that takes ``count`` rows, for this schema."""
        size = st.fenced_insert_size(count)
        found = self._fenced_inserts.get(size)
        if found is None:
            statement = self._compiled(st.insert_tasks_fenced(size))
            found = RowsStatement.of(statement, st.fenced_row_names(size), size, st.NO_TASK_ROW)
            self._fenced_inserts[size] = found
        return found

    async def _fence_moved(self, conn: CommitConnection, fence: Fence) -> Fence:
        """The fence found once the epoch check found another epoch or cluster, to name
        them. (Read by a later statement, they could only be ours again if they moved back
        meanwhile: fenced all the same.)"""
        stored = await conn.fetchrow(self._stored_fence, {})
        found: Fence = _NO_FENCE if stored is None else (stored[0], stored[1])
        return (None, found[1]) if found == fence else found

    async def write_shared(
        self, conn: CommitConnection, epoch: int, incarnation: int, batch: FoldedBatch
    ) -> tuple[Fence, str | None]:
        """Write ``batch`` inside a transaction other clusters' commits share, opened with
        :attr:`group_opening`, if ``epoch`` is the stored epoch and ``incarnation`` the
        cluster's; else write nothing. The fence found, as :meth:`write` finds it, and the
        check that must close the transaction (``None`` for a batch written as one
        statement, whose check and write looked the table up once). An id or key that is
        another task's, or any error, fails the whole transaction: this commit alone then
        says what it was (:func:`write_group`)."""
        fence = (epoch, incarnation)
        fenced = {"epoch": epoch, "incarnation": incarnation}
        writes = batch.writes()
        copy = self._copied(batch)
        path = self._path(batch, writes, copy)
        if path in ("insert", "update"):
            return await self._write_one(conn, fence, batch, path), None
        if await conn.fetchrow(self._held_for_share, fenced) is None:
            return await self._fence_moved(conn, fence), None
        for name in writes:
            await self._writers[name](conn, batch, copy, fenced)
        return fence, self._kept.sql(fenced)

    def stages(self, batch: FoldedBatch) -> bool:
        """Whether ``batch`` goes through a group's staging table: new tasks only, too few
        for a COPY of their own, on the store's own sessions (:func:`write_group`)."""
        return (
            self.borrowed_opening is None
            and batch.writes() == ("insert_rows",)
            and not self._copied(batch)
        )

    async def write_checked(
        self, conn: CommitConnection, batch: FoldedBatch, fenced: Mapping[str, int | None]
    ) -> None:
        """``batch``'s writes, in a transaction that checked its epoch and incarnation
        (``fenced``) already."""
        copy = self._copied(batch)
        for name in batch.writes():
            await self._writers[name](conn, batch, copy, fenced)

    def closing_check(self, epoch: int, incarnation: int) -> str:
        """The check that must close a transaction this cluster's commit shared."""
        return self._kept.sql({"epoch": epoch, "incarnation": incarnation})

    # The writers of a transaction that checked ``fenced`` (the epoch and incarnation) under
    # a share lock of the leader row, and checks the incarnation again with its COMMIT.

    async def _write_updates(
        self,
        conn: CommitConnection,
        batch: FoldedBatch,
        copy: bool,
        fenced: Mapping[str, int | None],
    ) -> None:
        """The transitions, by the fenced update (the statement of batches of transitions
        alone): it moves nothing unless its own check finds ``fenced``, which the
        transaction holds (:class:`_WriteFenced` otherwise, as for the insert below)."""
        found = await conn.fetchrow(self._update_fenced, {**batch.updates, **fenced})
        _check_fence(found, fenced)
        _warn_unchanged(batch.update_count, found[2])

    async def _write_inserts(
        self,
        conn: CommitConnection,
        batch: FoldedBatch,
        copy: bool,
        fenced: Mapping[str, int | None],
    ) -> None:
        """New tasks by COPY, as one ``VALUES`` list (the fenced insert: its rows' values
        are scalar parameters, cheaper for the driver than arrays, and its statements are
        those of batches of new tasks alone), or, beyond that statement's rows (a large
        batch written again after its COPY was refused), as arrays.

        The fenced insert writes nothing unless its own check finds ``fenced``, which the
        transaction holds: it finds another fence only where the schema's name led another
        cluster's tables to it meanwhile. :class:`_WriteFenced` then, and the transaction
        is rolled back: the closing check alone would pass a name that leads back by the
        ``COMMIT``, and the batch's new tasks would be stored nowhere."""
        if copy:
            await conn.copy_into(tasks.name, batch.insert_rows, INSERT_COLUMNS, self._schema)
        elif batch.insert_count <= st.FENCED_INSERT_MAX_ROWS:
            rows = batch.insert_rows
            found = await conn.fetchrow_rows(self._fenced_insert(len(rows)), rows, fenced)
            _check_fence(found, fenced)
        else:
            await conn.execute(self._insert, batch.inserts)

    async def _write_outputs(
        self,
        conn: CommitConnection,
        batch: FoldedBatch,
        copy: bool,
        fenced: Mapping[str, int | None],
    ) -> None:
        status = await conn.execute(self._outputs, batch.outputs)
        _warn_unstored_outputs(batch.output_count, row_count(status))

    async def _write_recurring(
        self,
        conn: CommitConnection,
        batch: FoldedBatch,
        copy: bool,
        fenced: Mapping[str, int | None],
    ) -> None:
        for action, params in batch.recurring:
            await conn.execute(self._recurring[action], params)

    def _copied(self, batch: FoldedBatch) -> bool:
        return batch.insert_count >= self._copy_min_rows


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One cluster's commit, to be written in a transaction other clusters' commits share:
    its cluster's writer, the epoch and incarnation it is fenced by, and its batch."""

    writer: BatchWriter
    epoch: int
    incarnation: int
    batch: FoldedBatch


#: What a member of a group got: what :meth:`BatchWriter.write` would have found for it
#: alone, or the error it alone would raise; ``None`` while undecided.
Outcome = Written | Exception | None


async def write_group(
    conn: CommitConnection,
    members: Sequence[GroupMember],
    outcomes: list[Outcome],
    *,
    prepared: int = 0,
) -> None:
    """Write ``members`` (commits of any clusters) in as few transactions as their answers
    allow, deciding each undecided entry of ``outcomes`` (one per member, in order).

    One transaction takes every undecided member in schema order, so that it meets the
    leader tables in the order every other group and claim does and no two wait for each
    other in a circle. Each member's epoch is read ``FOR SHARE`` in it (the one-statement
    forms read it in their own statement), so a takeover of any member's cluster waits for
    the whole transaction: it lands wholly before or after. One ``COMMIT`` makes them
    durable together, one WAL flush where each alone would wait for its own.

    A member whose fence moved writes nothing and gets the fence found; the others go on.
    A member whose statement the server refuses (:func:`~cronoq_store._door.refused_statement`:
    an id or key another task's, a value out of range, a table gone) aborts the
    transaction: it is rolled back, that member is written alone, as
    :meth:`BatchWriter.write` would (naming ids and keys, or raising its own error), and
    the rest go again together. A closing check that finds another cluster (it cannot say
    whose) sends every member alone. Any other failure is the transaction's, left to
    raise: the session is lost or the failure transient, and no undecided member wrote
    anything that committed.

    With ``prepared`` (statements the session may keep for the bus), a transaction is
    first tried staged (:func:`_staged`): fewer round trips, the same answers."""
    order = sorted(range(len(members)), key=lambda i: members[i].writer.schema)
    while pending := [i for i in order if outcomes[i] is None]:
        if len(pending) == 1:
            outcomes[pending[0]] = await _alone(conn, members[pending[0]])
            return
        if prepared and await _staged(conn, members, pending, outcomes, prepared):
            return
        refused = await _together(conn, members, pending, outcomes)
        if refused is not None:
            outcomes[refused] = await _alone(conn, members[refused])


async def _alone(conn: CommitConnection, member: GroupMember) -> Written | Exception:
    """``member`` in a transaction of its own: what it found, or its own error."""
    try:
        return await member.writer.write(conn, member.epoch, member.incarnation, member.batch)
    except Exception as exc:
        if not refused_statement(exc):
            raise
        return exc


async def _together(
    conn: CommitConnection,
    members: Sequence[GroupMember],
    pending: list[int],
    outcomes: list[Outcome],
) -> int | None:
    """One transaction for the ``pending`` members: their outcomes once it committed, or
    the member whose statement the server refused (nothing committed)."""
    found: dict[int, Fence] = {}
    checks: list[str] = []
    await conn.send(members[pending[0]].writer.group_opening)
    current = pending[0]
    try:
        for current in pending:
            member = members[current]
            fence, check = await member.writer.write_shared(
                conn, member.epoch, member.incarnation, member.batch
            )
            found[current] = fence
            if check is not None:
                checks.append(check)
    except Exception as exc:
        if not refused_statement(exc):
            await conn.roll_back_failed()
            raise
        await conn.roll_back()
        return current
    except BaseException:
        await conn.roll_back_failed()
        raise
    try:
        await conn.finish(closing_message(checks))
    except ClusterMoved:
        await conn.roll_back_failed()
        for i in pending:
            outcomes[i] = await _alone(conn, members[i])
        return None
    except BaseException:
        await conn.roll_back_failed()
        raise
    for i in pending:
        outcomes[i] = Written(found[i])
    return None


#: The staging table's columns, in the order of each staged row.
_STAGED_COLUMNS = ("member", *INSERT_COLUMNS)


async def _staged(
    conn: CommitConnection,
    members: Sequence[GroupMember],
    pending: list[int],
    outcomes: list[Outcome],
    prepared: int,
) -> bool:
    """The ``pending`` members in one transaction of four round trips whatever their number:
    every epoch checked, in schema order, by statements the session holds prepared, sent
    with ``BEGIN``; the new tasks of the members that only insert a few (most commits)
    COPYed into the session's staging table together; the other members' writes, each as
    alone; then one message inserting each staged member's tasks into its cluster by its
    prepared statement, every member's closing check, and ``COMMIT``.

    ``True`` once every pending member's outcome is decided (the transaction committed).
    ``False`` when the session cannot stage (its statements are then left to
    :func:`_together`), or when the server refused any statement (a fence that moved, an
    id or key another task's, a table gone): nothing committed, and :func:`_together`
    then finds whose it was. A member's answer is so the same as with one statement each:
    these refusals are rare, and the others cost no more than before. A session that lost
    what the bus prepared on it (a transaction-pooling proxy hands out any server session)
    is never staged on again. Any other failure is raised, as by :func:`_together`."""
    group = [members[i] for i in pending]
    if any(member.writer.borrowed_opening is not None for member in group):
        return False
    stages = [member.writer.stages(member.batch) for member in group]
    statements = [member.writer.staged_check for member in group] + [
        member.writer.staged_insert for member, staged in zip(group, stages, strict=True) if staged
    ]
    try:
        names = await conn.named(statements, group[0].writer.staging_setup, prepared)
    except Exception as exc:
        if not (refused_statement(exc) or conn.lost_named(exc)):
            raise
        return False  # a member's statement refused (its table gone): alone, it says so
    if names is None:
        return False
    inserts = iter(names[len(group) :])
    # Generic plans only where every statement is the bus's: the others' (a member's
    # updates, by the driver's statements) keep the plans made for their values.
    opening = [
        "BEGIN",
        *([_GENERIC_PLANS] if all(stages) else []),
        *(
            executing(name, member.writer.staged_check, _fenced(member))
            for name, member in zip(names, group, strict=False)
        ),
    ]
    try:
        await conn.send("; ".join(opening))
        rows = [
            (k, *row)
            for k, (member, staged) in enumerate(zip(group, stages, strict=True))
            if staged
            for row in member.batch.insert_rows
        ]
        if rows:
            await conn.stage(st.staged_tasks.name, rows, _STAGED_COLUMNS)
        closing: list[str] = []
        for k, (member, staged) in enumerate(zip(group, stages, strict=True)):
            if staged:
                closing.append(executing(next(inserts), member.writer.staged_insert, {"member": k}))
            else:
                await member.writer.write_checked(conn, member.batch, _fenced(member))
        closing.extend(
            member.writer.closing_check(member.epoch, member.incarnation) for member in group
        )
        await conn.finish(closing_message(closing))
    except ClusterMoved:
        await conn.roll_back_failed()
        return False
    except Exception as exc:
        await conn.roll_back_failed()
        if not (refused_statement(exc) or conn.lost_named(exc)):
            raise
        return False
    except BaseException:
        await conn.roll_back_failed()
        raise
    for i in pending:
        outcomes[i] = Written((members[i].epoch, members[i].incarnation))
    return True


def _fenced(member: GroupMember) -> dict[str, int]:
    return {"epoch": member.epoch, "incarnation": member.incarnation}


#: Sent with a staged group's ``BEGIN``: see :data:`~cronoq_store._statements.generic_plans`.
_GENERIC_PLANS = st.generic_plans.text


class Carrier(Protocol):
    """What carries a cluster's commits in transactions shared with other clusters' (the
    host's commit bus), instead of a connection of the store's own."""

    async def carry(self, member: GroupMember) -> Written:
        """Write ``member``; what it found, as :meth:`BatchWriter.write` alone would."""
        ...


class CommitPath:
    """The store's commits: a pooled connection's driver connection (:attr:`connections`),
    the :class:`BatchWriter` (``writer``) choosing the write path, and what it found: ids or
    keys of other tasks as errors, a fence that did not hold handed back to the store, which
    alone knows its term.

    ``incarnation`` is the cluster's the store was opened on (the leader table's OID): every
    commit writes only there.
    ``borrowed``: the sessions may carry settings that are not the store's (an application's
    engine, or a transaction-pooling PgBouncer): every commit opens its transaction with
    these statements, which set the store's for that transaction alone (:class:`BatchWriter`),
    so nothing is left on the session either.

    ``hold``: keep one pooled connection checked out between commits
    (:class:`~cronoq_store._door.HeldConnection`).
    ``carrier``: where commits go instead of the pool's connections (a host's commit bus,
    which writes several clusters' commits in one transaction).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        schema: str,
        *,
        incarnation: int,
        borrowed: Sequence[ClauseElement] | None,
        hold: bool = False,
        carrier: Carrier | None = None,
    ) -> None:
        self._incarnation = incarnation
        #: The pooled connections commits run on, one of them held with ``hold``.
        self.connections = HeldConnection(engine, hold=hold)
        self.writer = BatchWriter(engine.dialect, schema, borrowed=borrowed)
        self._carrier = carrier

    async def commit(self, epoch: int, batch: FoldedBatch) -> Fence | None:
        """Write ``batch`` under ``epoch`` in the store's cluster: ``None`` once written, or
        the fence found instead (the stored epoch and the cluster's incarnation), nothing
        written and the held connection given back; what that means for the term is the
        store's to decide. ``IdCollisionError``
        or ``KeyTakenError`` if it wrote nothing because an id is another task's or a live
        key another live task's."""
        if self._carrier is None:
            written = await self.connections.run(
                lambda conn: self.writer.write(conn, epoch, self._incarnation, batch)
            )
        else:
            member = GroupMember(self.writer, epoch, self._incarnation, batch)
            written = await self._carrier.carry(member)
        if written.colliding is not None:
            raise IdCollisionError(written.colliding)
        if written.taken is not None:
            raise KeyTakenError(written.taken)
        current, found = written.fence
        if current == epoch and found in (None, self._incarnation):
            return None
        # Fenced: this term may be over, and a new one takes a fresh connection.
        await self.connections.release()
        return written.fence

    async def release(self) -> None:
        """Return the held connection to the pool (:meth:`HeldConnection.release`)."""
        await self.connections.release()


def _warn_unstored_outputs(expected: int, stored: int) -> None:
    """Outputs of tasks that are missing (pruned?) or did not succeed: not stored."""
    if stored != expected:
        logger.warning(
            "outputs for tasks missing from the store (pruned?) or not succeeded: not stored",
            extra={"expected": expected, "matched": stored},
        )


def _warn_unchanged(expected: int, moved: int) -> None:
    """Transitions of tasks not submitted in the batch that moved nothing: the task is
    missing, or a retried or late batch found it already further along. (Moved rows of
    tasks the batch submits again count too, so this can miss a case.)"""
    if moved < expected:
        logger.warning(
            "status updates that changed nothing: tasks missing from the store (pruned?) "
            "or already further along (a batch delivered again)",
            extra={"expected": expected, "matched": moved},
        )
