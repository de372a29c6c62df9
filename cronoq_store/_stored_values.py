"""What the store hands back: the values a new leader recovers, a task's record, health.

The store builds these from rows it has already decoded and checked, so they carry no
validation of their own (the values they hold are :mod:`cronoq_store._domain`'s).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ._domain import Priority, RecurringSpec, TaskId, TaskSpec, TaskStatus

# Recovery: what a new leader loads. The store builds these from rows it has already
# decoded and checked, so they carry no validation of their own.


@dataclass(frozen=True, slots=True)
class RecoveredTask:
    """A live task. ``arrival`` is engine time (ns); ``attempt`` is 0 until it first runs."""

    id: TaskId
    seq: int
    arrival: int
    spec: TaskSpec
    attempt: int


@dataclass(frozen=True, slots=True)
class RecoveredTerminal:
    """A finished task, kept for key deduplication and dependencies; ``at`` is engine time
    (ns) of its last transition."""

    id: TaskId
    key: str | None
    status: TaskStatus
    at: int


@dataclass(frozen=True, slots=True)
class RecoveredRecurring:
    """A schedule with its next occurrence (engine time, ns) and the task it last submitted."""

    spec: RecurringSpec
    next: int | None
    last: TaskId | None


@dataclass(slots=True)
class Recovered:
    """Everything a new leader needs to resume. ``next_id`` is one more than the largest task
    id ever issued, and at least 1 (the high-water mark cannot tell "no id issued" from "id 0
    issued", so id 0 counts as issued): no id below it may be issued again. A leader issues
    ids from ``max(next_id, task_id(epoch, 0))`` upward: the epoch prefix until the epoch
    wraps to 1, then ids continue above every id ever issued. Reusing an id for a different
    task fails the commit with ``IdCollisionError``."""

    next_id: int
    tasks: list[RecoveredTask] = field(default_factory=list)
    terminal: list[RecoveredTerminal] = field(default_factory=list)
    recurring: list[RecoveredRecurring] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """A task as stored, for look-ups. ``status`` is ``None`` while the task is queued;
    ``output`` is set only for tasks that succeeded; ``updated`` is a tz-aware UTC datetime."""

    id: TaskId
    key: str | None
    pool: str
    kind: str
    priority: Priority
    tenant: str | None
    status: TaskStatus | None
    attempt: int
    message: str | None
    output: bytes | None
    updated: datetime


@dataclass(frozen=True, slots=True)
class LockHolder:
    """The session holding a cluster's leader lock, as ``pg_stat_activity`` shows it.
    ``application_name``, ``client_addr`` and ``since`` are ``None`` when the reading role
    may not see another role's sessions (grant it ``pg_read_all_stats``); ``client_addr`` is
    also ``None`` for a local socket."""

    pid: int
    application_name: str | None
    client_addr: str | None
    #: When the holder's session started (tz-aware UTC).
    since: datetime | None
    #: The holder's role (``pg_stat_activity.usename``).
    role: str | None = None
    #: Whether the holder is a store instance: the lock session the leader row records as
    #: having taken the current epoch, or one taking it now. Any role that can connect can
    #: take the lock; such a foreign holder stops every instance from leading, and is never
    #: a leader (docs/reliability.md, "Who holds the lock").
    store_instance: bool = True


@dataclass(frozen=True, slots=True)
class Health:
    """What ``PgStore.health()`` reads in one transaction, for a readiness endpoint: facts,
    never a verdict raised as an error."""

    #: Whether this instance holds the leader lock, and its epoch while it does.
    is_leader: bool
    epoch: int | None
    #: The epoch in the leader row: the latest leader's, whoever that is.
    stored_epoch: int
    #: Who holds the leader lock now, a store instance or not (``holder.store_instance``);
    #: ``None`` when no session holds it.
    holder: LockHolder | None
    #: The revisions the schema's version table records, and this build's head.
    revision: tuple[str, ...]
    head: str
    #: Seconds since this instance's last successful commit; ``None`` before the first.
    last_commit_age: float | None
    #: ``PUBLIC`` and the login roles the store does not trust that may connect: any could
    #: hold the leader lock. While any is listed, instances refuse to lead (unless
    #: ``allow_untrusted_connect``).
    untrusted_connect: tuple[str, ...] = ()
    #: The session holding the schema's migration lock, if one does: every migration of the
    #: schema (an instance opening on a schema behind its head, ``cronoq-store migrate``,
    #: Alembic) waits for it, and gives up after its bound. Its ``store_instance`` is
    #: ``False``: the lock does not tell instances from other sessions.
    migration_lock: LockHolder | None = None

    @property
    def at_head(self) -> bool:
        """Whether the schema is at this build's head revision."""
        return self.revision == (self.head,)

    @property
    def has_leader(self) -> bool:
        """Whether a store instance holds the leader lock (a foreign holder is no leader)."""
        return self.holder is not None and self.holder.store_instance

    @property
    def foreign_holder(self) -> LockHolder | None:
        """The holder of the leader lock when it is not a store instance: nobody can lead
        until it lets go (``cronoq-store handover`` can end it)."""
        if self.holder is None or self.holder.store_instance:
            return None
        return self.holder
