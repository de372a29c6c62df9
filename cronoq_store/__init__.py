"""cronoq-store: the PostgreSQL store of the cronoq scheduler, with active-passive HA.

Every state transition is committed in batches, one transaction per batch, before
submitters are acknowledged. Each scheduler cluster lives in its own PostgreSQL schema; one
instance leads (a session advisory lock plus a fencing epoch checked in every commit), and
standbys take over, recover the state, and fence the deposed leader out.
"""

from __future__ import annotations

from .committer_stats import CommitterStats
from .config import PgStoreConfig
from .domain import (
    EPOCH_MAX,
    EPOCH_MIN,
    CronSchedule,
    Dependency,
    DependencyCondition,
    FixedStart,
    Health,
    IntervalSchedule,
    LockHolder,
    MissPolicy,
    Mutation,
    Priority,
    Recovered,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    Schedule,
    StatusChanged,
    Submitted,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskSpec,
    TaskStatus,
    TimeBase,
    epoch_of,
    task_id,
)
from .errors import (
    BatchTooLargeError,
    CommitterClosedError,
    FencedError,
    IdCollisionError,
    KeyTakenError,
    MigrationError,
    SchemaGoneError,
    StoreError,
    UnavailableError,
)
from .group_commit import GroupCommitter
from .protocols import Store, StoreQueries
from .store import PgStore

__all__ = [
    "EPOCH_MAX",
    "EPOCH_MIN",
    "BatchTooLargeError",
    "CommitterClosedError",
    "CommitterStats",
    "CronSchedule",
    "Dependency",
    "DependencyCondition",
    "FencedError",
    "FixedStart",
    "GroupCommitter",
    "Health",
    "IdCollisionError",
    "IntervalSchedule",
    "KeyTakenError",
    "LockHolder",
    "MigrationError",
    "MissPolicy",
    "Mutation",
    "PgStore",
    "PgStoreConfig",
    "Priority",
    "Recovered",
    "RecoveredRecurring",
    "RecoveredTask",
    "RecoveredTerminal",
    "RecurringNext",
    "RecurringRemove",
    "RecurringSpec",
    "RecurringUpsert",
    "RetryPolicy",
    "Schedule",
    "SchemaGoneError",
    "StatusChanged",
    "Store",
    "StoreError",
    "StoreQueries",
    "Submitted",
    "TaskId",
    "TaskRecord",
    "TaskRef",
    "TaskSpec",
    "TaskStatus",
    "TimeBase",
    "UnavailableError",
    "epoch_of",
    "task_id",
]
