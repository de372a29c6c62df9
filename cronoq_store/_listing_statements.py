"""The operators' reads of tasks, for the console's pages and the ``tasks`` commands alike,
composed with SQLAlchemy Core over the schema-less tables (the cluster's schema applied at
execution, as everywhere): read-only, and each one bounded by an index or by a ``LIMIT`` on
the rows it examines, so a page stays fast on a big cluster.

Finished tasks are read through ``ix_cronoq_tasks_finished_updated`` (``updated_unix_ns,
id`` where ``terminal``), newest first; live tasks through ``ix_cronoq_tasks_live`` (``id``
where ``NOT terminal``): newest first for the counts, oldest first (in id order, the order
they were issued) for the list. Nothing walks a whole index: counts look at the newest
:data:`SAMPLE` finished or :data:`LIVE_SAMPLE` live tasks (the list's count: the oldest
:data:`LIVE_SAMPLE`) and say "at least" when they stop (the live total is then the
planner's estimate, and said to be one); a page examines at most :data:`SCAN` tasks and,
when its filters match fewer than a page there, says how far it looked and offers to look
further from there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    Select,
    Table,
    Text,
    and_,
    bindparam,
    cast,
    func,
    or_,
    select,
    true,
    tuple_,
)
from sqlalchemy.dialects.postgresql import JSONB, OID

from ._domain import SPEC_FIELDS, TaskStatus
from ._schema import RECORD_COLUMNS, leader_history, recurring, tasks

__all__ = [
    "LIVE_SAMPLE",
    "SAMPLE",
    "SCAN",
    "finished_count",
    "finished_first_page",
    "finished_next_page",
    "finished_per_bucket",
    "finished_sample",
    "live_count",
    "live_counts",
    "live_estimate",
    "live_page",
    "live_scan_boundary",
    "oldest_live",
    "recent_terms",
    "scan_boundary",
    "schedules",
    "task_spec",
]

#: How many finished tasks (newest first) a count examines at most.
SAMPLE = 10_000
#: How many live tasks (newest first) the live counts examine at most.
LIVE_SAMPLE = 50_000
#: How many finished tasks a page examines at most for the rows its filters match.
SCAN = 50_000

_live = (
    select(tasks.c.pool, tasks.c.status, tasks.c.updated_unix_ns)
    .where(~tasks.c.terminal)
    .order_by(tasks.c.id.desc())
    .limit(bindparam("bound", type_=BigInteger))
    .subquery("live")
)

#: Among the newest ``bound`` live tasks (by id): how many of each pool and status, and the
#: newest update of each.
live_counts = (
    select(
        _live.c.pool,
        _live.c.status,
        func.count().label("n"),
        func.max(_live.c.updated_unix_ns).label("newest"),
    )
    .group_by(_live.c.pool, _live.c.status)
    .order_by(_live.c.pool, _live.c.status)
)

_catalog = MetaData(schema="pg_catalog")
_pg_class = Table(
    "pg_class",
    _catalog,
    Column("relname", Text),
    Column("relnamespace", OID),
    Column("reltuples", Float),
)
_pg_namespace = Table("pg_namespace", _catalog, Column("oid", OID), Column("nspname", Text))

#: The planner's estimate of the live tasks (the entries of ``ix_cronoq_tasks_live`` when
#: it was last vacuumed or analysed; -1 if never), for when the live counts stop at their
#: bound: no row is read.
live_estimate = (
    select(_pg_class.c.reltuples)
    .select_from(_pg_class.join(_pg_namespace, _pg_namespace.c.oid == _pg_class.c.relnamespace))
    .where(
        _pg_class.c.relname == "ix_cronoq_tasks_live",
        _pg_namespace.c.nspname == bindparam("schema", type_=Text),
    )
)

_newest = (
    select(tasks.c.status, tasks.c.message, tasks.c.updated_unix_ns)
    .where(tasks.c.terminal)
    .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
    .limit(bindparam("sample", type_=BigInteger))
    .subquery("newest")
)

#: Among the newest ``sample`` finished tasks: how many of each status, how many of the
#: failed ones recovery quarantined (their message starts with ``prefix``), and the newest
#: update of each.
finished_sample = (
    select(
        _newest.c.status,
        func.count().label("n"),
        func.max(_newest.c.updated_unix_ns).label("newest"),
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

_pools = bindparam("pools", type_=ARRAY(Text))
_statuses = bindparam("statuses", type_=ARRAY(Text))
_kinds = bindparam("kinds", type_=ARRAY(Text))
_tenants = bindparam("tenants", type_=ARRAY(Text))
_keys = bindparam("keys", type_=ARRAY(Text))


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
        or_(func.cardinality(_keys) == 0, table.c.key == func.any(_keys)),
    ]


#: A page's rows, as ``rows.task_record`` takes them (no JSON column among them); the last,
#: ``updated_unix_ns``, is also the cursor's first half, to the nanosecond.
_page_columns = [tasks.c[name] for name in RECORD_COLUMNS]

_cursor = tuple_(
    bindparam("before_updated", type_=BigInteger), bindparam("before_id", type_=BigInteger)
)


def _after_cursor(table: Any) -> list[Any]:
    """Strictly older than the cursor. The row comparison alone would not start the index
    scan at the cursor (a backward scan positions on the window's scalar upper bound and
    walks down to it: half the index for a page halfway down), so the cursor's time is
    also given as a scalar bound, which does."""
    return [
        table.c.updated_unix_ns <= bindparam("before_updated", type_=BigInteger),
        tuple_(table.c.updated_unix_ns, table.c.id) < _cursor,
    ]


def _scanned(after_cursor: bool) -> Select[Any]:
    """The newest ``scan`` finished tasks of the window (strictly older than the cursor
    ``(before_updated, before_id)`` if ``after_cursor``): one range of the index."""
    where = _window(tasks)
    if after_cursor:
        where += _after_cursor(tasks)
    return (
        select(*_page_columns)
        .where(*where)
        .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
        .limit(bindparam("scan", type_=BigInteger))
    )


def _finished_page(after_cursor: bool) -> Select[Any]:
    examined = _scanned(after_cursor).subquery("examined")
    return (
        select(*(examined.c[name] for name in RECORD_COLUMNS))
        .where(*_chosen(examined))
        .order_by(examined.c.updated_unix_ns.desc(), examined.c.id.desc())
        .limit(bindparam("limit", type_=BigInteger))
    )


#: The newest ``limit`` finished tasks that pass the filters among the ``scan`` newest of
#: the window: the index is read only until a page is full or ``scan`` rows were examined.
finished_first_page = _finished_page(after_cursor=False)
#: The same, strictly older than the cursor ``(before_updated, before_id)``: keyset paging.
finished_next_page = _finished_page(after_cursor=True)

#: The cursor of the last task a page examined when it stopped at ``scan`` rows (none if the
#: window ends sooner): where the next page looks on from. The index alone answers.
scan_boundary = (
    select(tasks.c.updated_unix_ns, tasks.c.id)
    .where(*_window(tasks), *_after_cursor(tasks))
    .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
    .offset(bindparam("scan", type_=BigInteger) - 1)
    .limit(1)
)

_examined = (
    select(tasks.c.pool, tasks.c.status, tasks.c.kind, tasks.c.tenant, tasks.c.key)
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
#: Live tasks after the cursor ``after`` (an id; -1 for the first page), oldest first: one
#: range of ``ix_cronoq_tasks_live``, the id a scalar bound that starts the scan there.
_live_after = [~tasks.c.terminal, tasks.c.id > bindparam("after", type_=BigInteger)]

_live_examined = (
    select(*_page_columns, tasks.c.arrival_unix_ns.label("arrival"))
    .where(*_live_after)
    .order_by(tasks.c.id)
    .limit(bindparam("scan", type_=BigInteger))
    .subquery("examined")
)

#: The oldest ``limit`` live tasks after ``after`` that pass the filters among the ``scan``
#: oldest there: the record's columns, then ``arrival`` (Unix ns) for the task's age.
live_page = (
    select(*(_live_examined.c[name] for name in RECORD_COLUMNS), _live_examined.c.arrival)
    .where(*_chosen(_live_examined))
    .order_by(_live_examined.c.id)
    .limit(bindparam("limit", type_=BigInteger))
)

#: The id of the last live task a page examined when it stopped at ``scan`` rows (none if
#: the live tasks end sooner): where the next page looks on from. The index alone answers.
live_scan_boundary = (
    select(tasks.c.id)
    .where(*_live_after)
    .order_by(tasks.c.id)
    .offset(bindparam("scan", type_=BigInteger) - 1)
    .limit(1)
)

_live_counted = (
    select(tasks.c.pool, tasks.c.status, tasks.c.kind, tasks.c.tenant, tasks.c.key)
    .where(~tasks.c.terminal)
    .order_by(tasks.c.id)
    .limit(bindparam("bound", type_=BigInteger))
    .subquery("examined")
)

#: Among the oldest ``bound`` live tasks: how many were examined, and how many of them pass
#: the filters (bounded by the rows it reads, as :data:`finished_count` is).
live_count = select(
    func.count().label("examined"),
    func.count().filter(and_(*_chosen(_live_counted))).label("matching"),
)


def _as_shown(name: str) -> Any:
    """A spec column as a task's page reads it: JSON as its text (shown as stored, even when
    a hand-written row holds something no decoder accepts), bytes as their size."""
    column = tasks.c[name]
    if isinstance(column.type, JSONB):
        return cast(column, Text).label(name)
    if isinstance(column.type, LargeBinary):
        return func.octet_length(column).label(f"{name}_size")
    return column


#: What a task's page shows beyond its record: when it arrived, whether it finished, and the
#: columns of every spec field shown apart from the record (``SPEC_FIELDS``' labels).
task_spec = select(
    tasks.c.seq,
    tasks.c.arrival_unix_ns,
    tasks.c.terminal,
    *(_as_shown(c) for f in SPEC_FIELDS if f.label is not None for c in f.columns),
).where(tasks.c.id == bindparam("id", type_=BigInteger))

_last = tasks.alias("last")

#: Recurring schedules by name after ``after`` (``limit`` of them), each with its next run
#: and its last task's state, one primary-key look-up per schedule.
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
    .where(recurring.c.name > bindparam("after", type_=Text))
    .order_by(recurring.c.name)
    .limit(bindparam("limit", type_=BigInteger))
)


#: The newest ``:limit`` terms of the leadership history, newest first (its index on
#: ``began_at``, backwards).
recent_terms = (
    select(
        leader_history.c.epoch,
        leader_history.c.began_at,
        leader_history.c.lock_seen_held_at,
        leader_history.c.pid,
        leader_history.c.role,
        leader_history.c.application_name,
        leader_history.c.client_addr,
    )
    .order_by(leader_history.c.began_at.desc())
    .limit(bindparam("limit", type_=BigInteger))
)


_bucket = (
    func.generate_series(0, bindparam("buckets", type_=Integer) - 1)
    .table_valued("i")
    .render_derived(name="bucket")
)
_bucket_start = bindparam("start", type_=BigInteger) + _bucket.c.i * bindparam(
    "width", type_=BigInteger
)
_in_bucket = (
    select(tasks.c.status, tasks.c.updated_unix_ns)
    .where(
        tasks.c.terminal,
        tasks.c.updated_unix_ns >= _bucket_start,
        tasks.c.updated_unix_ns < _bucket_start + bindparam("width", type_=BigInteger),
    )
    .order_by(tasks.c.updated_unix_ns.desc(), tasks.c.id.desc())
    .limit(bindparam("cap", type_=BigInteger))
    .lateral("examined")
)

#: Finished tasks in each of ``buckets`` consecutive ranges of ``width`` ns of
#: ``updated_unix_ns`` from ``start`` (bucket ``i`` from ``start + i * width``): for each
#: bucket and status, how many among the newest ``cap`` finished tasks of the bucket, and
#: the oldest update among them. One range of ``ix_cronoq_tasks_finished_updated`` per
#: bucket, read backwards and stopped at ``cap``: ``buckets * cap`` rows at most, however
#: many tasks a bucket holds. A bucket with ``cap`` tasks examined may hold more.
finished_per_bucket = (
    select(
        _bucket.c.i.label("bucket"),
        _in_bucket.c.status,
        func.count().label("n"),
        func.min(_in_bucket.c.updated_unix_ns).label("oldest"),
    )
    .select_from(_bucket.join(_in_bucket, true()))
    .group_by(_bucket.c.i, _in_bucket.c.status)
    .order_by(_bucket.c.i, _in_bucket.c.status)
)

#: The live task issued first (the lowest id, as the live list is ordered) and when it
#: arrived: the first entry of ``ix_cronoq_tasks_live``.
oldest_live = (
    select(tasks.c.id, tasks.c.arrival_unix_ns)
    .where(~tasks.c.terminal)
    .order_by(tasks.c.id)
    .limit(1)
)
