"""A commit batch folded into the column-wise parameters of a few statements, and its size.

Pure (no SQLAlchemy, no I/O), so the folding rules can be tested on their own:

- a task's states are totally ordered (:func:`level`, then the transition's time): attempt
  first, then queued < running < retrying < terminal, and a terminal state is final. A
  transition applies only if it moves the task forward; one that does not (a duplicate, a
  late retry, a tie) changes nothing, its message included;
- a task submitted in the batch is inserted once, carrying its latest state, so a task that
  is born and finishes in one batch is written once. The same ``Submitted`` again is a
  no-op; a different task under the same id raises :class:`~cronoq_store._errors.IdCollisionError`;
- a task stored by an earlier batch gets one forward-only update (``update_status``). So
  does a task submitted in the batch with transitions, but only when it turns out to be
  stored already (a submission sent again): the insert then signals it and the writer
  writes the batch again with those updates first (see :mod:`cronoq_store._writer`);
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
:mod:`cronoq_store._statements`; new tasks are rows made by :mod:`cronoq_store._rows`.

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
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, ClassVar

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
from ._errors import BatchTooLargeError, IdCollisionError
from ._rows import (
    INSERT_POSITION,
    StatusUpdates,
    insert_row,
    same_task,
    set_state,
    transposed,
)

__all__ = [
    "MAX_COMMIT_BYTES",
    "FoldedBatch",
    "RecurringAction",
    "batch_size",
    "check_batch_size",
    "fold",
    "mutation_size",
    "output_size",
    "taken_keys",
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

    #: ``update_status`` parameters: one row per task not submitted in the batch.
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
    """``update_status`` parameters of transitions of distinct tasks: what
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
    """``update_status`` parameters, one row per task."""
    if not transitions:  # most batches: no transitions, or only of tasks stored before
        return StatusUpdates().params()
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
    if spec.deps:
        size += _JSON_ITEM * len(spec.deps)
        for dep in spec.deps:
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


def mutation_size(mutation: Mutation) -> int:
    """Upper bound of the bytes ``mutation`` adds to a commit."""
    match mutation:
        case Submitted(spec=spec):
            # Short text columns at 4 bytes per character: measuring them costs more than
            # the slack does.
            text = len(spec.kind) + len(spec.pool)
            if spec.key is not None:
                text += len(spec.key)
            if spec.tenant is not None:
                text += len(spec.tenant)
            return _TASK_ROW + len(spec.payload) + 4 * text + _json_columns(spec)
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
    batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]], limit: int
) -> int:
    """:func:`batch_size` of ``batch`` and ``outputs``; ``BatchTooLargeError``, before
    anything is sent, when that is over ``limit`` bytes: the check of both stores."""
    size = batch_size(batch, outputs)
    if size > limit:
        raise BatchTooLargeError(
            f"committing a batch failed: its {len(batch)} mutations and {len(outputs)} "
            f"outputs take up to {size} bytes, over the {limit} bytes one commit may send "
            "(PostgreSQL refuses a message over 1 GiB); commit them in smaller batches"
        )
    return size
