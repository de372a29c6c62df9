"""The mutations: the state transitions the scheduler commits, in order, one batch at a time.

Validated when built, as every domain value (:mod:`cronoq_store._domain`): a bad mutation
fails the caller that made it, not the whole batch it would have joined. Each site that
dispatches on :data:`Mutation` is a ``match`` ending in :func:`unhandled`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, TypeAlias

from ._domain import (
    I32_MAX,
    I64_MAX,
    I64_MIN,
    RecurringSpec,
    TaskId,
    TaskSpec,
    TaskStatus,
    check_engine_time,
    check_int,
    check_name,
    check_task_id,
    invalid,
)


@dataclass(frozen=True, slots=True)
class Submitted:
    """A task was accepted. ``seq`` orders submissions; ``arrival`` is engine time (ns)."""

    id: TaskId
    seq: int
    arrival: int
    spec: TaskSpec

    def __post_init__(self) -> None:
        id_, seq, arrival = self.id, self.seq, self.arrival
        if type(id_) is not int or not 0 <= id_ <= I64_MAX:
            check_task_id("id", id_)
        if type(seq) is not int or not 0 <= seq <= I64_MAX:
            check_int("seq", seq, 0, I64_MAX, "an integer in 0..2**63-1")
        if type(arrival) is not int or not I64_MIN <= arrival <= I64_MAX:
            check_engine_time("arrival", arrival)
        if type(self.spec) is not TaskSpec and not isinstance(self.spec, TaskSpec):
            raise invalid("spec", "a TaskSpec", self.spec)


@dataclass(frozen=True, slots=True)
class StatusChanged:
    """A task moved to ``status`` at engine time ``at`` (ns), in attempt ``attempt``.

    ``message`` explains the transition (an error, a reason to skip); without one the
    task keeps the message of its previous transition.
    """

    id: TaskId
    status: TaskStatus
    attempt: int
    at: int
    message: str | None = None

    def __post_init__(self) -> None:
        id_, attempt, at, message = self.id, self.attempt, self.at, self.message
        if type(id_) is not int or not 0 <= id_ <= I64_MAX:
            check_task_id("id", id_)
        if not isinstance(self.status, TaskStatus):
            raise invalid("status", "a TaskStatus", self.status)
        if type(attempt) is not int or not 0 <= attempt <= I32_MAX:
            check_int("attempt", attempt, 0, I32_MAX, "an integer in 0..2**31-1")
        if type(at) is not int or not I64_MIN <= at <= I64_MAX:
            check_engine_time("at", at)
        if message is not None and not isinstance(message, str):
            raise invalid("message", "None or a string", message)


@dataclass(frozen=True, slots=True)
class RecurringUpsert:
    """A recurring schedule was created or replaced."""

    spec: RecurringSpec


@dataclass(frozen=True, slots=True)
class RecurringRemove:
    """A recurring schedule was deleted."""

    name: str

    def __post_init__(self) -> None:
        check_name(self.name)


@dataclass(frozen=True, slots=True)
class RecurringNext:
    """A schedule advanced: its next occurrence (engine time, ns) and the task it last
    submitted, which the next occurrence chains to."""

    name: str
    next: int | None
    last: TaskId | None

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.next is not None:
            check_engine_time("next", self.next)
        if self.last is not None:
            check_task_id("last", self.last)


#: One change a batch commits: a submission, a transition or a schedule change.
Mutation: TypeAlias = Submitted | StatusChanged | RecurringUpsert | RecurringRemove | RecurringNext
"""Every mutation type. Dispatch on it with a ``match`` ending in ``typing.assert_never``:
then ``mypy --strict`` names every site a new type must be handled in."""


def unhandled(value: NoReturn, kind: str = "mutation") -> NoReturn:
    """The last case of every ``match`` on a mutation's (or a schedule's, an action's) type.

    As ``typing.assert_never``: ``mypy --strict`` refuses the call where a type is left
    unhandled ("Argument 1 to "unhandled" has incompatible type ...; expected "NoReturn""),
    so adding a type to :data:`Mutation` lists every site it needs. At run time a value of
    no known type is a ``TypeError`` naming its type (never its contents, which may be
    a payload), as it was before the dispatch was a ``match``.
    """
    raise TypeError(f"not a {kind}: {type(value).__name__}")
