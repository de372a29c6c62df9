"""Where the group committer ends a batch, and which batches in flight a batch must wait
for: so that every submitter gets the answer, and the rows end as, committing the same
submissions one at a time in the order accepted would give.

One commit folds its batch by the rules of :mod:`cronoq_store._folding`: updates before
inserts, a new task inserted in its latest state, outputs after both. So a batch may merge
submissions only where no later one changes how an earlier one is answered. :class:`Merge`
ends a batch (cuts) before a submission that

* finishes a task (a terminal ``StatusChanged``) that may hold a key an earlier submission
  of the batch gives a task. Serially that key was still held when it was claimed, or the
  claiming task was live and checked; merged, the update frees the key first, and a task
  inserted finished is not checked. A task may hold such a key unless the committer
  committed its ``Submitted`` with another key or none (:func:`learn`): a task stored
  before it started (recovered from an earlier term), sent again, or still in flight
  may hold any key;
* submits a task an earlier submission moved: serially there was no row to move yet (when
  the task was not stored), merged the task is inserted in the state the transition gave;
* makes a task succeed after an earlier submission gave it an output: serially the output
  was dropped (only a succeeded task keeps one), merged it is stored.

Every other merge gives the serial outcome. A submission that fails alone fails the merged
batch too (an id or key another task holds, two tasks under one id, two live tasks under one
key, a value out of range): the batch is then bisected in order until only the failing
submissions fail, which is the serial answer. The rules hold between pairs of submissions,
on facts that stay true (a committed task keeps its key), so every run of a batch that a
bisection commits obeys them too.

Two batches commute when no row either writes can be seen by the other: then whichever
commits first, the rows are the same, and the later one may commit beside the earlier
(:class:`Footprint`). A batch must wait for an earlier one still in flight when they share

* a task: its mutations land in submission order (a ``StatusChanged`` whose ``Submitted``
  is in an earlier, uncommitted batch would find no row to move), and so do its outputs;
* a recurring schedule: its changes apply in order;
* anything, when it holds a barrier (an empty submission returns once everything
  submitted before it is settled);
* a key, as far as the committer can tell: a new task's key may be freed by a terminal
  transition of a task whose key the batch does not carry (a task of an earlier term), so
  a batch that gives a live task a key waits for every earlier batch that finishes a task
  or gives out a key it gives, and a batch that finishes a task waits for every earlier
  batch that gives out a key (serially, that batch met the key still held).

Keys and schedule names are compared as stored (:func:`~cronoq_store._domain.clean_text`):
two names that differ only where PostgreSQL cannot store a character are one row.
Both rules are conservative: they may cut or order submissions that would merge or
commute, never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ._domain import TaskId, TaskStatus, clean_text
from ._mutations import (
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
)

__all__ = ["Footprint", "Merge", "footprint", "learn"]

_SUCCEEDED = TaskStatus.SUCCEEDED


def learn(known: dict[int, str | None], mutations: Iterable[Mutation]) -> None:
    """Record in ``known`` what the committed ``mutations`` tell of their tasks' keys.

    A task whose ``Submitted`` committed is stored with its key (or none) for good: ids are
    never issued twice, and a stored id refuses another task. A task committed finished is
    forgotten, so ``known`` holds no more tasks than are live: it holds no key any more, and
    forgetting it only makes a later cut more cautious."""
    for m in mutations:
        if isinstance(m, Submitted):
            key = m.spec.key
            known[m.id] = None if key is None else clean_text(key)
        elif isinstance(m, StatusChanged) and m.status.is_terminal:
            known.pop(m.id, None)


class Merge:
    """The submissions of the batch being cut, as far as the answer of a later one merged
    with them depends on them; ``known``: the keys :func:`learn` recorded (read, not kept
    up to date by this batch)."""

    __slots__ = ("_claimed", "_known", "_moved", "_outputs")

    def __init__(self, known: Mapping[int, str | None]) -> None:
        self._known = known
        self._claimed: set[str] = set()  # keys given to tasks
        self._moved: set[int] = set()  # tasks with a transition
        self._outputs: set[int] = set()  # tasks given an output

    def take(self, mutations: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]]) -> bool:
        """Add a submission to the batch, or return ``False`` (and add nothing) where its
        merged outcome, or an earlier one's, could differ from committing them one at a
        time: the batch ends before it. The first submission is always taken."""
        claimed, moved, given = self._claimed, self._moved, self._outputs
        if claimed or moved or given:
            known = self._known
            for m in mutations:
                if isinstance(m, Submitted):
                    if m.id in moved:
                        return False
                elif isinstance(m, StatusChanged) and m.status.is_terminal:
                    id = m.id
                    if claimed and (id not in known or known[id] in claimed):
                        return False
                    if m.status is _SUCCEEDED and id in given:
                        return False
        for m in mutations:
            if isinstance(m, Submitted):
                if m.spec.key is not None:
                    claimed.add(clean_text(m.spec.key))
            elif isinstance(m, StatusChanged):
                moved.add(m.id)
        if outputs:
            given.update(id for id, _ in outputs)
        return True


@dataclass(slots=True)
class Footprint:
    """What a batch touches that orders it against other batches."""

    #: Tasks it submits, moves or gives an output.
    ids: set[int] = field(default_factory=set)
    #: Keys it gives to new live tasks.
    keys: set[str] = field(default_factory=set)
    #: Whether it finishes a task (and so may free a key it does not name).
    finishes: bool = False
    #: Recurring schedules it changes.
    schedules: set[str] = field(default_factory=set)
    #: Whether it holds a barrier (an empty submission): it follows every earlier batch.
    barrier: bool = False

    def follows(self, earlier: Footprint) -> bool:
        """Whether this batch must wait for ``earlier``, submitted before it, to settle."""
        if self.barrier:
            return True
        if not self.ids.isdisjoint(earlier.ids):
            return True
        if not self.schedules.isdisjoint(earlier.schedules):
            return True
        if self.keys and (earlier.finishes or not self.keys.isdisjoint(earlier.keys)):
            return True
        return self.finishes and bool(earlier.keys)


def footprint(
    mutations: Iterable[Mutation],
    outputs: Sequence[tuple[TaskId, bytes]] = (),
    *,
    barrier: bool = False,
) -> Footprint:
    """The footprint of a batch of ``mutations`` and ``outputs`` (``barrier``: it holds an
    empty submission)."""
    found = Footprint(barrier=barrier)
    ids = found.ids
    for mutation in mutations:
        match mutation:
            case Submitted(id=id, spec=spec):
                ids.add(id)
                if spec.key is not None:
                    found.keys.add(clean_text(spec.key))
            case StatusChanged(id=id, status=status):
                ids.add(id)
                if status.is_terminal:
                    found.finishes = True
            case RecurringUpsert(spec=spec):
                found.schedules.add(clean_text(spec.name))
            case RecurringRemove(name=name) | RecurringNext(name=name):
                found.schedules.add(clean_text(name))
    ids.update(id for id, _ in outputs)
    return found
