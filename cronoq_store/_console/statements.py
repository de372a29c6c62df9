"""The console's statements, composed with SQLAlchemy Core over the schema-less tables (the
cluster's schema applied at execution, as everywhere): read-only, and each one bounded by an
index or by a ``LIMIT`` on the rows it examines, so a page stays fast on a big cluster.

Finished tasks are read through ``ix_cronoq_tasks_finished_updated`` (``updated_unix_ns,
id`` where ``terminal``), newest first; live tasks through ``ix_cronoq_tasks_live`` (the live
set is what every instance holds in memory, so it is never large for long). Counts over
finished tasks look at the newest :data:`SAMPLE` of them and say "at least" when they stop.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Select,
    Text,
    and_,
    bindparam,
    cast,
    func,
    or_,
    select,
    tuple_,
)

from .._domain import TaskStatus as TaskStatus
from .._rows import RECORD_COLUMNS as RECORD_COLUMNS
from .._schema import recurring as recurring
from .._schema import tasks as tasks

__all__ = [
    "SAMPLE",
    "finished_count",
    "finished_first_page",
    "finished_next_page",
    "finished_sample",
    "live_counts",
    "newest_change",
    "schedules",
    "task_spec",
]

#: How many finished tasks (newest first) a count examines at most.
SAMPLE = 10_000

#: Live tasks by pool and status.
live_counts = (
    select(tasks.c.pool, tasks.c.status, func.count().label("n"))
    .where(~tasks.c.terminal)
    .group_by(tasks.c.pool, tasks.c.status)
    .order_by(tasks.c.pool, tasks.c.status)
)

_newest = (
    select(tasks.c.status, tasks.c.message)
    .where(tasks.c.terminal)
    .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
    .limit(bindparam("sample", type_=BigInteger))
    .subquery("newest")
)

#: Among the newest ``sample`` finished tasks: how many of each status, and how many of the
#: failed ones recovery quarantined (their message starts with ``prefix``).
finished_sample = (
    select(
        _newest.c.status,
        func.count().label("n"),
        func.count()
        .filter(
            _newest.c.status == TaskStatus.FAILED.value,
            func.starts_with(_newest.c.message, bindparam("prefix", type_=Text)),
        )
        .label("quarantined"),
    )
    .group_by(_newest.c.status)
    .order_by(_newest.c.status)
)

#: The newest ``updated_unix_ns`` of any task: the last change a commit recorded (the store
#: keeps no commit time of its own). The finished side is one step down its index.
newest_change = select(
    func.greatest(
        select(func.max(tasks.c.updated_unix_ns)).where(tasks.c.terminal).scalar_subquery(),
        select(func.max(tasks.c.updated_unix_ns)).where(~tasks.c.terminal).scalar_subquery(),
    )
)

_pools = bindparam("pools", type_=ARRAY(Text))
_statuses = bindparam("statuses", type_=ARRAY(Text))
_kinds = bindparam("kinds", type_=ARRAY(Text))
_tenants = bindparam("tenants", type_=ARRAY(Text))


def _window(table: Any) -> list[Any]:
    """Finished tasks updated in the window ``since``..``until``: a range of the index."""
    return [
        table.c.terminal,
        table.c.updated_unix_ns >= bindparam("since", type_=BigInteger),
        table.c.updated_unix_ns <= bindparam("until", type_=BigInteger),
    ]


def _chosen(table: Any) -> list[Any]:
    """The filters the index does not hold, checked on the rows it yields; an empty array
    means any."""
    return [
        or_(func.cardinality(_pools) == 0, table.c.pool == func.any(_pools)),
        or_(func.cardinality(_statuses) == 0, table.c.status == func.any(_statuses)),
        or_(func.cardinality(_kinds) == 0, table.c.kind == func.any(_kinds)),
        or_(func.cardinality(_tenants) == 0, table.c.tenant == func.any(_tenants)),
    ]


#: A page's rows, as ``rows.task_record`` takes them (no JSON column among them); the last,
#: ``updated_unix_ns``, is also the cursor's first half, to the nanosecond.
_page_columns = [tasks.c[name] for name in RECORD_COLUMNS]


def _finished_page(after_cursor: bool) -> Select[Any]:
    where = [*_window(tasks), *_chosen(tasks)]
    if after_cursor:
        cursor = tuple_(
            bindparam("before_updated", type_=BigInteger), bindparam("before_id", type_=BigInteger)
        )
        where.append(tuple_(tasks.c.updated_unix_ns, tasks.c.id) < cursor)
    return (
        select(*_page_columns)
        .where(*where)
        .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
        .limit(bindparam("limit", type_=BigInteger))
    )


#: The newest finished tasks that pass the filters (``limit`` of them).
finished_first_page = _finished_page(after_cursor=False)
#: The same, strictly older than the cursor ``(before_updated, before_id)``: keyset paging.
finished_next_page = _finished_page(after_cursor=True)

_examined = (
    select(tasks.c.pool, tasks.c.status, tasks.c.kind, tasks.c.tenant)
    .where(*_window(tasks))
    .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
    .limit(bindparam("bound", type_=BigInteger))
    .subquery("examined")
)

#: Among the newest ``bound`` finished tasks of the window: how many were examined, and how
#: many of them pass the filters. Bounded by the rows it reads, not by the matches it finds:
#: a filter that matches little would otherwise walk the whole index to count to a bound.
finished_count = select(
    func.count().label("examined"),
    func.count().filter(and_(*_chosen(_examined))).label("matching"),
)
#: What a task's page shows beyond its record: its spec's columns, JSON ones as text (shown
#: as stored, even when a hand-written row holds something no decoder accepts), and sizes.
task_spec = select(
    tasks.c.seq,
    tasks.c.arrival_unix_ns,
    tasks.c.terminal,
    tasks.c.deadline_unix_ns,
    tasks.c.fixed_at_unix_ns,
    tasks.c.fixed_tolerance_ns,
    tasks.c.fixed_on_miss,
    tasks.c.duration_hint_ns,
    tasks.c.timeout_ns,
    cast(tasks.c.retry, Text).label("retry"),
    cast(tasks.c.deps, Text).label("deps"),
    cast(tasks.c.resources, Text).label("resources"),
    cast(tasks.c.tags, Text).label("tags"),
    cast(tasks.c.labels, Text).label("labels"),
    func.octet_length(tasks.c.payload).label("payload_size"),
).where(tasks.c.id == bindparam("id", type_=BigInteger))

_last = tasks.alias("last")

#: Recurring schedules by name (``limit`` of them), each with its next run and its last
#: task's state, one primary-key look-up per schedule.
schedules = (
    select(
        recurring.c.name,
        cast(recurring.c.spec["schedule"], Text).label("schedule"),
        recurring.c.next_unix_ns,
        recurring.c.last_task_id,
        _last.c.status.label("last_status"),
        _last.c.updated_unix_ns.label("last_updated"),
    )
    .select_from(recurring.outerjoin(_last, _last.c.id == recurring.c.last_task_id))
    .order_by(recurring.c.name)
    .limit(bindparam("limit", type_=BigInteger))
)
