"""The values the store and its committer return: what a new leader recovers, a task's record,
health, lock holders and the instance id in a lock session's name, and a committer's counts.

The store builds them from rows it has already decoded and checked, so they carry no
validation of their own (the values they hold are :mod:`cronoq_store._domain`'s). A
committer's counts are bumped at each event in a :class:`Tally`, kept apart from its control
flow, and frozen into a :class:`CommitterStats` on demand (percentiles over a bounded window
of recent latencies, sorted only when asked for).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ._domain import Priority, RecurringSpec, TaskId, TaskSpec, TaskStatus

__all__ = [
    "APPLICATION_NAME_BYTES",
    "CommitterStats",
    "Health",
    "LockHolder",
    "Recovered",
    "RecoveredRecurring",
    "RecoveredTask",
    "RecoveredTerminal",
    "Tally",
    "TaskRecord",
    "instance_of",
    "lock_session_name",
]


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

    @property
    def instance(self) -> str | None:
        """The id of the store instance whose lock session this is, from its
        ``application_name`` (``"<application_name> leader <instance>"``); ``None`` when
        that is hidden from the reading role, or names no instance (a session that is not a
        store instance, or an instance of a build before instance ids)."""
        return instance_of(self.application_name)


# --- who an instance is, as the server shows it ----------------------------------------------

#: The most bytes of ``application_name`` the server keeps (NAMEDATALEN - 1): it cuts the rest.
APPLICATION_NAME_BYTES = 63
#: A lock session's name; its group is the instance id, 8 lowercase hex digits drawn at
#: random when a store opens.
_LOCK_SESSION = re.compile(r".* leader ([0-9a-f]{8})", re.S)


def lock_session_name(application_name: str, instance: str) -> str:
    """The ``application_name`` of instance ``instance``'s lock session:
    ``"<application_name> leader <instance>"``, whole within the server's 63 bytes.

    Every instance of a deployment usually shares one ``application_name``; the id is what
    tells them apart (``cronoq-store handover`` compares it, never the pid, which changes
    with every session of one instance). The server writes each byte outside printable
    ASCII as ``\\xNN`` (PostgreSQL 16 and later) and then cuts the name to 63 bytes, which
    could cut the id off: so the name is escaped that way here and the application's part
    shortened, an escape never split, until the whole name fits.
    """
    suffix = f" leader {instance}"
    room = APPLICATION_NAME_BYTES - len(suffix)
    kept: list[str] = []
    for char in application_name:
        piece = (
            char
            if " " <= char <= "~"
            else "".join(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogatepass"))
        )
        if len(piece) > room:
            break
        kept.append(piece)
        room -= len(piece)
    return "".join(kept) + suffix


def instance_of(application_name: str | None) -> str | None:
    """The instance id in a lock session's ``application_name`` (:func:`lock_session_name`),
    or ``None``."""
    if application_name is None:
        return None
    found = _LOCK_SESSION.fullmatch(application_name)
    return None if found is None else found.group(1)


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
    #: The cluster this instance was opened on (``PgStore.incarnation``, its leader table's
    #: OID), and the one the schema holds now (``None`` when its tables are gone).
    incarnation: int | None = None
    stored_incarnation: int | None = None
    #: The session holding the schema's migration lock, if one does: every migration of the
    #: schema (an instance opening on a schema behind its head, ``cronoq-store migrate``,
    #: Alembic) waits for it, and gives up after its bound. Its ``store_instance`` is
    #: ``False``: the lock does not tell instances from other sessions.
    migration_lock: LockHolder | None = None
    #: The host group (``PgHostConfig.group``) the cluster is enrolled in, ``None`` for a
    #: standalone cluster. A host leads an enrolled cluster without its leader lock, so a
    #: ``PgStore``'s ``has_leader`` is false there whoever leads: ``cronoq-store health``
    #: names the owner, and so does a ``HostedStore``'s ``holder`` (``HostedStore.health``).
    hosted_by: str | None = None

    @property
    def at_head(self) -> bool:
        """Whether the schema is at this build's head revision."""
        return self.revision == (self.head,)

    @property
    def cluster_replaced(self) -> bool:
        """Whether the schema no longer holds the cluster this instance was opened on (it
        was dropped, made again, renamed or restored from a dump, or its tables are gone):
        this instance never writes there again; open a new store."""
        return self.stored_incarnation != self.incarnation

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


@dataclass(frozen=True, slots=True)
class CommitterStats:
    """A snapshot of a committer's counters; latencies are seconds, ``None`` before any ack.

    Latency runs from the call to ``submit`` (backpressure wait included) to the ack, over
    the last ``latency_window`` acknowledged submissions.
    """

    #: Submissions accepted into the queue.
    submissions: int
    #: Submissions acknowledged: their mutations are durable.
    acknowledged: int
    #: Submissions that received an error.
    failed_submissions: int
    #: Submissions cancelled by their submitter before a batch took them: never committed.
    dropped: int
    #: Mutations acknowledged (outputs not counted).
    mutations: int
    #: Transactions that committed.
    commits: int
    #: Commit attempts that failed transiently and were retried.
    retries: int
    #: Batches split in two because a non-transient error failed them, or a stuck one.
    splits: int
    #: Batches that kept failing transiently while the database answered (stuck): split,
    #: or, a single submission, failed with the last error.
    stuck_batches: int
    #: Pings that found the database not answering: the failing batch was retried.
    unanswered_pings: int
    #: Submissions accepted and not yet settled (queued or in flight), and their size.
    pending_submissions: int
    pending_mutations: int
    #: Mutations and submissions per committed transaction.
    mean_batch_mutations: float
    mean_batch_submissions: float
    latency_p50: float | None
    latency_p99: float | None
    latency_max: float | None


class Tally:
    """A committer's running counts and the latencies of its last acknowledged submissions."""

    __slots__ = (
        "acknowledged",
        "commits",
        "committed_submissions",
        "dropped",
        "failed",
        "latencies",
        "mutations",
        "retries",
        "splits",
        "stuck",
        "submissions",
        "unanswered_pings",
    )

    def __init__(self, latency_window: int) -> None:
        self.submissions = 0
        self.acknowledged = 0
        self.failed = 0
        self.dropped = 0
        self.mutations = 0
        self.commits = 0
        self.committed_submissions = 0
        self.retries = 0
        self.splits = 0
        self.stuck = 0
        self.unanswered_pings = 0
        self.latencies: deque[float] = deque(maxlen=latency_window)

    def acknowledge(self, mutations: int, latencies: Sequence[float]) -> None:
        """Submissions holding ``mutations`` in all are durable, each ``latencies[i]``
        seconds after its submit (one call per committed batch)."""
        self.acknowledged += len(latencies)
        self.mutations += mutations
        self.latencies.extend(latencies)

    def commit(self, submissions: int) -> None:
        """One transaction holding ``submissions`` committed."""
        self.commits += 1
        self.committed_submissions += submissions

    def snapshot(self, pending_submissions: int, pending_mutations: int) -> CommitterStats:
        ordered = sorted(self.latencies)
        commits = self.commits
        return CommitterStats(
            submissions=self.submissions,
            acknowledged=self.acknowledged,
            failed_submissions=self.failed,
            dropped=self.dropped,
            mutations=self.mutations,
            commits=commits,
            retries=self.retries,
            splits=self.splits,
            stuck_batches=self.stuck,
            unanswered_pings=self.unanswered_pings,
            pending_submissions=pending_submissions,
            pending_mutations=pending_mutations,
            mean_batch_mutations=self.mutations / commits if commits else 0.0,
            mean_batch_submissions=self.committed_submissions / commits if commits else 0.0,
            latency_p50=_percentile(ordered, 0.50),
            latency_p99=_percentile(ordered, 0.99),
            latency_max=ordered[-1] if ordered else None,
        )


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted sequence."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
