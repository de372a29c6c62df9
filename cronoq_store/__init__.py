"""cronoq-store: the PostgreSQL store of the cronoq scheduler, with active-passive HA.

Every state transition is committed in batches, one transaction per batch, before
submitters are acknowledged. Each scheduler cluster lives in its own PostgreSQL schema; one
instance leads (a session advisory lock plus a fencing epoch checked in every commit), and
standbys take over, recover the state, and fence the deposed leader out.
"""

from __future__ import annotations

from typing import get_args

from ._committer import GroupCommitter as GroupCommitter
from ._config import PgStoreConfig as PgStoreConfig
from ._domain import (
    EPOCH_MAX as EPOCH_MAX,
)
from ._domain import (
    EPOCH_MIN as EPOCH_MIN,
)
from ._domain import (
    CronSchedule as CronSchedule,
)
from ._domain import (
    Dependency as Dependency,
)
from ._domain import (
    DependencyCondition as DependencyCondition,
)
from ._domain import (
    FixedStart as FixedStart,
)
from ._domain import (
    IntervalSchedule as IntervalSchedule,
)
from ._domain import (
    MissPolicy as MissPolicy,
)
from ._domain import Mutation as Mutation
from ._domain import (
    Priority as Priority,
)
from ._domain import RecurringNext as RecurringNext
from ._domain import RecurringRemove as RecurringRemove
from ._domain import (
    RecurringSpec as RecurringSpec,
)
from ._domain import RecurringUpsert as RecurringUpsert
from ._domain import (
    RetryPolicy as RetryPolicy,
)
from ._domain import (
    Schedule as Schedule,
)
from ._domain import StatusChanged as StatusChanged
from ._domain import Submitted as Submitted
from ._domain import (
    TaskId as TaskId,
)
from ._domain import (
    TaskRef as TaskRef,
)
from ._domain import (
    TaskSpec as TaskSpec,
)
from ._domain import (
    TaskStatus as TaskStatus,
)
from ._domain import (
    TimeBase as TimeBase,
)
from ._domain import (
    epoch_of as epoch_of,
)
from ._domain import (
    task_id as task_id,
)
from ._door import engine_arguments as engine_arguments
from ._errors import (
    BatchTooLargeError as BatchTooLargeError,
)
from ._errors import (
    ClusterHostedError as ClusterHostedError,
)
from ._errors import (
    ClusterReplacedError as ClusterReplacedError,
)
from ._errors import (
    CommitterClosedError as CommitterClosedError,
)
from ._errors import (
    FencedError as FencedError,
)
from ._errors import (
    IdCollisionError as IdCollisionError,
)
from ._errors import (
    KeyTakenError as KeyTakenError,
)
from ._errors import (
    LockHeldError as LockHeldError,
)
from ._errors import (
    MigrationError as MigrationError,
)
from ._errors import (
    SchemaGoneError as SchemaGoneError,
)
from ._errors import (
    StoreError as StoreError,
)
from ._errors import (
    UnavailableError as UnavailableError,
)
from ._errors import UnsupportedParameterError as UnsupportedParameterError
from ._host.databases import ClusterRef as ClusterRef
from ._host.databases import MultiDatabaseHost as MultiDatabaseHost
from ._host.host import HostedStore as HostedStore
from ._host.host import PgHost as PgHost
from ._host.host import PgHostConfig as PgHostConfig
from ._migrations import downgrade as downgrade
from ._migrations import run_command as run_command
from ._migrations import upgrade as upgrade
from ._results import CommitterStats as CommitterStats
from ._results import Health as Health
from ._results import LockHolder as LockHolder
from ._results import Recovered as Recovered
from ._results import RecoveredRecurring as RecoveredRecurring
from ._results import RecoveredTask as RecoveredTask
from ._results import RecoveredTerminal as RecoveredTerminal
from ._results import TaskRecord as TaskRecord
from ._retry import Backoff as Backoff
from ._store import PgStore as PgStore
from ._store import Store as Store
from ._store import StoreQueries as StoreQueries
from ._urls import scrub as scrub

__all__ = [
    "EPOCH_MAX",
    "EPOCH_MIN",
    "Backoff",
    "BatchTooLargeError",
    "ClusterHostedError",
    "ClusterRef",
    "ClusterReplacedError",
    "CommitterClosedError",
    "CommitterStats",
    "CronSchedule",
    "Dependency",
    "DependencyCondition",
    "FencedError",
    "FixedStart",
    "GroupCommitter",
    "Health",
    "HostedStore",
    "IdCollisionError",
    "IntervalSchedule",
    "KeyTakenError",
    "LockHeldError",
    "LockHolder",
    "MigrationError",
    "MissPolicy",
    "MultiDatabaseHost",
    "Mutation",
    "PgHost",
    "PgHostConfig",
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
    "UnsupportedParameterError",
    "downgrade",
    "engine_arguments",
    "epoch_of",
    "run_command",
    "scrub",
    "task_id",
    "upgrade",
]


def _check_mutations_exported() -> None:
    """Refuse, at import, a mutation type the package does not export: applications build
    every one of them (a new type added to ``Mutation`` fails here until it is exported)."""
    missing = sorted(t.__name__ for t in get_args(Mutation) if t.__name__ not in __all__)
    if missing:
        raise ImportError(f"cronoq_store: mutation types not exported: {missing}")


_check_mutations_exported()
