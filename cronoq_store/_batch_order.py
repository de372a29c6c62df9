"""Which batches in flight a batch must wait for, so that several batches in flight end in
the rows one batch at a time would leave.

Two batches commute when no row either writes can be seen by the other: then whichever
commits first, the rows are the same, and the later one may commit beside the earlier.
A batch must wait for an earlier one still in flight when they share

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

The rule is conservative: it may order batches that would commute, never the reverse.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._domain import TaskId
from ._mutations import (
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
)

__all__ = ["Footprint", "footprint"]


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
                    found.keys.add(spec.key)
            case StatusChanged(id=id, status=status):
                ids.add(id)
                if status.is_terminal:
                    found.finishes = True
            case RecurringUpsert(spec=spec):
                found.schedules.add(spec.name)
            case RecurringRemove(name=name) | RecurringNext(name=name):
                found.schedules.add(name)
    ids.update(id for id, _ in outputs)
    return found
