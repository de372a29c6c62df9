"""What each page shows, read from the database as one document: the page renders it and
``?format=json`` returns it, so the two never disagree. Built from the CLI's own pieces: its
connection (``cli.database``: the trust check, the revision check), the store's health
facts and the verdict ``cronoq-store health`` gives (``cli.operations``), and its task and
holder documents (``cli.output``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _door as door
from .. import _listing_statements as cs
from .. import _queries as queries
from .._cli import database, operations, output
from .._cli.exits import CliError
from .._cli.hosted import HostRows
from .._codec import QUARANTINE_PREFIX
from .._domain import LIVE_STATUS_NAMES, TaskId, TaskStatus, clean_text
from .._errors import MigrationError, StoreError
from .._migrations import RevisionStatus, head_revision
from .._urls import redact, scrub
from .source import ClusterNotFound, ClusterPage, Source

__all__ = [
    "CLUSTERS_SHOWN",
    "FINISHED_STATUSES",
    "LIVE_STATUSES",
    "NAME_BYTES",
    "PAGE_SIZE",
    "ClusterNotFound",
    "TaskAmbiguous",
    "TaskNotFound",
    "chart_end",
    "charts",
    "cluster",
    "live",
    "overview",
    "task",
]

#: Finished tasks per page.
PAGE_SIZE = 50
#: Clusters per overview page. Each is a dozen round trips (the health facts, the counts);
#: the trust check of the whole page is one statement, as it scans catalogs that grow with
#: every schema.
CLUSTERS_SHOWN = 50
#: The longest name a schema can have, in bytes (PostgreSQL's ``NAMEDATALEN`` less one).
NAME_BYTES = 63
#: Recurring schedules the cluster page lists at most (a page of them: rendering is most
#: of a page's time).
SCHEDULES_SHOWN = 100
#: Dependencies whose targets a task's page looks up at most.
DEPS_SHOWN = 100
FINISHED_STATUSES = tuple(s.value for s in TaskStatus if s.is_terminal)
LIVE_STATUSES = tuple(sorted(LIVE_STATUS_NAMES))


_NS = 10**9
_MINUTE_NS = 60 * _NS


@dataclass(frozen=True)
class Window:
    """A chart's span: ``buckets`` of ``bucket_seconds`` each, ending where the charts end,
    and how many finished tasks of each bucket are examined at most (``cap``)."""

    name: str
    buckets: int
    bucket_seconds: int
    cap: int

    @property
    def span_ns(self) -> int:
        """The whole window, in ns."""
        return self.buckets * self.bucket_seconds * _NS


#: The last hour a minute at a time. 60 buckets of 500: 30,000 finished tasks at most.
HOUR = Window("hour", 60, 60, 500)
#: The last day a quarter of an hour at a time: 96 points draw a day's shape, where 1,440
#: minutes would cost 1,440 index descents and leave each minute a sample too small to
#: split by status. 96 buckets of 300: 28,800 finished tasks at most.
DAY = Window("day", 96, 900, 300)


class TaskNotFound(LookupError):
    """No task with that id or key: a 404."""


class TaskAmbiguous(LookupError):
    """A bare number that names tasks of several epochs: the page lists them."""

    def __init__(self, ref: output.IdRef, found: Sequence[queries.ListedTask]) -> None:
        super().__init__(ref.text)
        self.ref = ref
        self.found = found

    def document(self, schema: str) -> dict[str, Any]:
        shown = self.found[: operations.MATCHES_SHOWN]
        return {
            "schema": schema,
            "ambiguous": self.ref.text,
            "matches": [output.task_document(*listed) for listed in shown],
            "more": len(self.found) > len(shown),
        }


def _revision_document(revision: RevisionStatus) -> dict[str, Any]:
    return {
        "revision": list(revision.current),
        "head": revision.head,
        "at_head": revision.at_head,
        "revision_state": revision.describe(),
    }


async def _summary(
    conn: AsyncConnection, source: Source, schema: str, hosts: HostRows | None = None
) -> tuple[dict[str, Any], Sequence[Any]]:
    """One cluster's line of the overview, and its live counts by pool and status.
    ``hosts``: the control rows of the overview's page, read once for all of it."""
    health = await operations.read_health(conn, schema, source.control_schema, hosts=hosts)
    revision, facts, holder = health.revision, health.facts, health.holder
    doc: dict[str, Any] = {
        "schema": schema,
        **_revision_document(revision),
        "stored_epoch": None if facts is None else facts.stored_epoch,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
        # "mode", and for a hosted cluster "host": its owner, as `status --json` says.
        **operations.mode_document(health.host, holder),
        # The very document `cronoq-store --schema SCHEMA health --json` prints, and the
        # exit code it gives.
        "health": operations.health_document(schema, health),
        "health_exit_code": int(health.code),
    }
    if not revision.at_head:
        # A schema this build cannot read: its tables may not be what the statements expect.
        return doc, []
    counts, live = await _counts(conn, schema)
    doc.update(counts)
    return doc, live


async def _counts(conn: AsyncConnection, schema: str) -> tuple[dict[str, Any], Sequence[Any]]:
    """The summary's leader state and its live and finished counts (a cluster at head)."""
    epoch, max_id = (await conn.execute(catalog.leader_state)).one()
    live = (await conn.execute(cs.live_counts, {"bound": cs.LIVE_SAMPLE})).all()
    finished = (
        await conn.execute(cs.finished_sample, {"sample": cs.SAMPLE, "prefix": QUARANTINE_PREFIX})
    ).all()
    live_examined, live_at_least, estimate = await _live_total(conn, schema, live)
    await conn.rollback()
    by_status: dict[str, int] = {}
    for row in live:
        by_status[row.status] = by_status.get(row.status, 0) + row.n
    examined = sum(row.n for row in finished)
    # The store keeps no commit time: the newest update among what the counts examined is
    # the last change a commit recorded (or an earlier one, when the live counts stopped).
    newest = max((row.newest for row in (*live, *finished)), default=None)
    return (
        {
            "epoch": epoch,
            "max_id": max_id,
            "newest_change": output.rfc3339(newest),
            "newest_change_age_seconds": None if newest is None else _age(newest),
            "newest_change_at_most": live_at_least,
            "live": [{"status": s, "count": n} for s, n in sorted(by_status.items())],
            "live_examined": live_examined,
            "live_sample": cs.LIVE_SAMPLE,
            "live_at_least": live_at_least,
            "live_estimate": estimate,
            "finished": {
                "statuses": [{"status": row.status, "count": row.n} for row in finished],
                "examined": examined,
                "sample": cs.SAMPLE,
                # At the bound, older finished tasks were not looked at: counts are minimums.
                "at_least": examined >= cs.SAMPLE,
            },
            "quarantined": sum(row.quarantined for row in finished),
        },
        live,
    )


async def _live_total(
    conn: AsyncConnection, schema: str, live: Sequence[Any]
) -> tuple[int, bool, int | None]:
    """How many live tasks the live counts examined, whether they stopped at their bound,
    and then the planner's estimate of the total (``None`` when it has none): at the
    bound, older live tasks were not looked at, so the counts are minimums."""
    examined = sum(row.n for row in live)
    at_least = examined >= cs.LIVE_SAMPLE
    estimate = None
    if at_least:
        found = (await conn.execute(cs.live_estimate, {"schema": schema})).scalar()
        estimate = None if found is None or found < 0 else round(found)
    return examined, at_least, estimate


def _age(unix_ns: int) -> float:
    now = datetime.now(timezone.utc).timestamp()
    return max(0.0, round(now - unix_ns / 1e9, 3))


def _search_refusal(search: str) -> str | None:
    """Why no schema name can hold ``search``, or ``None`` when one can."""
    if "\0" in search:
        return "no schema name holds a NUL character: nothing matches"
    size = len(search.encode("utf-8", "replace"))
    if size > NAME_BYTES:
        return (
            f"a schema name is at most {NAME_BYTES} bytes long and this search is {size:,}: "
            "nothing matches"
        )
    return None


async def overview(
    source: Source, search: str = "", after: str = "", before: str | None = None
) -> dict[str, Any]:
    """A page of the database's clusters whose names hold ``search`` (any case), in name
    order, after the name ``after`` (or before ``before``), one summary each; a schema the
    trust check refuses, or this role cannot read, is listed with the reason. Only the
    page's clusters are read: the others are names in the catalog's answer."""
    url = source.url
    refused = _search_refusal(search)
    if refused is None:
        page = await source.cluster_page(clean_text(search), CLUSTERS_SHOWN, after, before)
    else:
        # Nothing to look up: how many clusters the database holds stays unsaid.
        page = ClusterPage((), 0, 0, None, more_after=False, more_before=False)
    clusters = []
    vetted, refusals = await source.vet(page.names)
    hosts = await source.hosts(page.names) if page.names else None
    for schema in page.names:
        if schema in refusals:
            clusters.append({"schema": schema, "refused": str(refusals[schema])})
            continue
        try:
            async with (
                door.translated(f"reading schema {schema}", passing=(CliError,)),
                source.connect(schema, vetted) as conn,
            ):
                clusters.append((await _summary(conn, source, schema, hosts))[0])
        except MigrationError as exc:  # the trust check
            clusters.append({"schema": schema, "refused": str(exc)})
        except CliError:
            raise  # cannot connect: the whole page says so
        except StoreError as error:  # e.g. no SELECT on this schema: the others still show
            if error.is_transient:
                raise
            clusters.append({"schema": schema, "refused": scrub(str(error), [url])})
    return {
        "database": redact(url),
        "head": head_revision(),
        # What was searched for: at most a name's length of it when no name can hold it.
        "search": search if refused is None else search[: NAME_BYTES + 1],
        "search_refused": refused,
        "page": {
            "size": CLUSTERS_SHOWN,
            "first": page.preceding + 1 if page.names else 0,
            "last": page.preceding + len(page.names),
            "matching": page.matching,
            "clusters": page.clusters,
            # The cursors of the next and the previous page (none from an empty page: a
            # cursor past either end).
            "after": page.names[-1] if page.names and page.more_after else None,
            "before": page.names[0] if page.names and page.more_before else None,
        },
        "clusters": clusters,
    }


async def cluster(
    source: Source,
    schema: str,
    filters: operations.TaskFilters,
    before: tuple[int, int] | None = None,
    schedules_after: str = "",
) -> dict[str, Any]:
    """A cluster's page: its summary, live tasks by pool and status, a page of finished
    tasks (newest first, strictly older than the cursor ``before``) and a page of its
    recurring schedules (by name, after ``schedules_after``)."""
    await source.known(schema)
    async with source.connect(schema) as conn:
        summary, live = await _summary(conn, source, schema)
        if not summary["at_head"]:
            # Its history may not exist yet (a rolling upgrade before the migration).
            return {"schema": schema, "summary": summary, "leadership_history": None}
        finished = await operations.finished_page(conn, filters, before, PAGE_SIZE)
        rows = (await conn.execute(cs.recent_terms, {"limit": operations.TERMS_SHOWN + 1})).all()
        recurring = (
            await conn.execute(
                cs.schedules, {"limit": SCHEDULES_SHOWN + 1, "after": schedules_after}
            )
        ).all()
        await conn.rollback()
    return {
        "schema": schema,
        "summary": summary,
        "live": [{"pool": r.pool, "status": r.status, "count": r.n} for r in live],
        "finished": finished,
        "recurring": [_schedule_document(r) for r in recurring[:SCHEDULES_SHOWN]],
        "leadership_history": operations.terms_document(
            rows, operations.TERMS_SHOWN, summary["leader"] is not None
        ),
        # The name the next page of schedules starts after.
        "recurring_next": recurring[SCHEDULES_SHOWN - 1].name
        if len(recurring) > SCHEDULES_SHOWN
        else None,
    }


async def live(
    source: Source, schema: str, filters: operations.TaskFilters, after: int | None = None
) -> dict[str, Any]:
    """A cluster's live tasks: a page of them, oldest first, after the id ``after``; the
    document ``tasks live --json`` prints, with the schema."""
    await source.known(schema)
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        page = await operations.live_page(conn, filters, after, PAGE_SIZE)
    return {"schema": schema, "live": page}


def _schedule_document(r: Any) -> dict[str, Any]:
    """One recurring schedule's line of the cluster page."""
    return {
        "name": r.name,
        "schedule": output.describe_schedule(r.schedule),
        "next_run": output.rfc3339(r.next_unix_ns),
        "last_task_id": r.last_task_id,
        "last_status": r.last_status,
        "last_updated": output.rfc3339(r.last_updated),
    }


async def task(
    source: Source, schema: str, ref: output.IdRef | str
) -> tuple[dict[str, Any], tuple[operations.SpecFact, ...]]:
    """A task's page: the ``tasks show --json`` document, its spec as stored, and each
    dependency with its target's state; and, for the page alone, the lines it draws of the
    spec (:attr:`~cronoq_store._cli.operations.TaskSpecView.facts`). :class:`TaskAmbiguous`
    for a bare number that names tasks of several epochs."""
    await source.known(schema)
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        found = await operations.find_tasks(conn, ref)
        if not found:
            raise TaskNotFound(ref if isinstance(ref, str) else ref.text)
        if len(found) > 1:
            assert isinstance(ref, output.IdRef)
            raise TaskAmbiguous(ref, found)
        listed = found[0]
        record = listed.record
        spec, deps = await operations.read_spec(conn, record.id)
        targets = []
        for dep in deps[:DEPS_SHOWN] if isinstance(deps, list) else []:
            targets.append(await _target(conn, dep))
        await conn.rollback()
    doc = output.task_document(*listed)
    doc["spec"] = spec.document
    doc["deps"] = targets
    doc["deps_total"] = len(deps) if isinstance(deps, list) else None
    doc["deps_raw"] = None if isinstance(deps, list) else deps
    return doc, spec.facts


async def _target(conn: AsyncConnection, dep: Any) -> dict[str, Any]:
    """A dependency as stored, with the state of the task it names (by id, or the newest
    with its key), or why it could not be looked up."""
    shown: dict[str, Any] = {"stored": dep, "target": None, "problem": None}
    if not isinstance(dep, dict):
        shown["problem"] = "not an object"
        return shown
    ref: Any = dep.get("id", dep.get("key"))
    if isinstance(ref, bool) or not isinstance(ref, (int, str)):
        shown["problem"] = "names no id or key"
        return shown
    try:
        params = queries.lookup_params(ref if isinstance(ref, str) else TaskId(ref))
    except ValueError as exc:
        shown["problem"] = str(exc)
        return shown
    listed = await queries.get_listed_task(conn, params)
    if listed is None:
        shown["problem"] = "no such task (pruned, or never stored)"
    else:
        found = listed.record
        shown["target"] = {
            "id": found.id,
            "key": found.key,
            "status": listed.stored_status,
            "updated": output.rfc3339(found.updated),
        }
    return shown


async def charts(source: Source, schema: str, end_ns: int | None = None) -> dict[str, Any]:
    """A cluster's charts: finished tasks per minute by status over the hour and the day
    that end at ``end_ns`` (floored to the minute; by default the current minute, which is
    not yet over, is left out), and the live backlog now with the age of its oldest task.

    Each bucket examines at most its window's ``cap`` newest finished tasks. A bucket that
    holds fewer is counted exactly; one that reaches the cap is *estimated*: its examined
    tasks span the time from the oldest of them to the bucket's end, and the bucket is
    taken to go on at that rate (statuses in the examined proportions). The examined
    counts stay in the document as the lower bound they are.

    The backlog is not drawn over the past: the backlog at a past moment is the tasks that
    had arrived by then and were not finished yet, and counting those means reading every
    task finished since, with no index on arrival to bound it. The page plots what it reads
    each time it refreshes instead."""
    now_ns = time.time_ns()
    end = chart_end(now_ns if end_ns is None else end_ns)
    await source.known(schema)
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        windows = {w.name: await _window(conn, w, end) for w in (HOUR, DAY)}
        live = (await conn.execute(cs.live_counts, {"bound": cs.LIVE_SAMPLE})).all()
        oldest = (await conn.execute(cs.oldest_live)).first()
        examined, at_least, estimate = await _live_total(conn, schema, live)
        await conn.rollback()
    by_status: dict[str, int] = {}
    for row in live:
        by_status[row.status] = by_status.get(row.status, 0) + row.n
    # The finished statuses in their usual order, then any other name a bucket holds (a
    # newer build's), so that every task counted is drawn.
    named = {s for w in windows.values() for b in w["buckets"] for s in b["counts"]}
    statuses = [*FINISHED_STATUSES, *sorted(named - {*FINISHED_STATUSES})]
    return {
        "schema": schema,
        "now": output.rfc3339(now_ns),
        "end": output.rfc3339(end),
        "statuses": statuses,
        **windows,
        "backlog": {
            "live": examined,
            "at_least": at_least,
            "sample": cs.LIVE_SAMPLE,
            "estimate": estimate,
            "by_status": [{"status": s, "count": n} for s, n in sorted(by_status.items())],
            "oldest": None
            if oldest is None
            else {
                "id": oldest.id,
                "arrival": output.rfc3339(oldest.arrival_unix_ns),
                "age_seconds": max(0.0, round((now_ns - oldest.arrival_unix_ns) / _NS, 3)),
            },
        },
    }


def chart_end(unix_ns: int) -> int:
    """Where charts asked to end at ``unix_ns`` end: the start of its minute, so that a
    bucket is a whole minute (or quarter hour) and the minute under way is left out."""
    return unix_ns // _MINUTE_NS * _MINUTE_NS


async def _window(conn: AsyncConnection, window: Window, end: int) -> dict[str, Any]:
    """One chart's buckets, oldest first, each with its exact counts among the tasks it
    examined and its tasks per minute (exact, or estimated past the cap)."""
    width = window.bucket_seconds * _NS
    start = end - window.span_ns
    rows = (
        await conn.execute(
            cs.finished_per_bucket,
            {"buckets": window.buckets, "width": width, "start": start, "cap": window.cap},
        )
    ).all()
    counts: list[dict[str, int]] = [{} for _ in range(window.buckets)]
    oldest: list[int | None] = [None] * window.buckets
    for row in rows:
        counts[row.bucket][row.status] = row.n
        seen = oldest[row.bucket]
        oldest[row.bucket] = row.oldest if seen is None else min(seen, row.oldest)
    minutes = window.bucket_seconds / 60
    buckets = []
    for i, found in enumerate(counts):
        bucket_start = start + i * width
        examined = sum(found.values())
        complete = examined < window.cap
        scale = 1.0
        first = oldest[i]
        if not complete and first is not None:
            # The examined tasks cover [first, bucket end); the bucket goes on at that rate.
            covered = max(bucket_start + width - first, 1)
            scale = width / covered
        buckets.append(
            {
                "start": output.rfc3339(bucket_start),
                "start_unix_s": bucket_start // _NS,
                "examined": examined,
                "complete": complete,
                "counts": found,
                "per_minute": {s: round(n * scale / minutes, 2) for s, n in found.items()},
            }
        )
    return {
        "bucket_seconds": window.bucket_seconds,
        "bucket_count": window.buckets,
        "cap": window.cap,
        "start": output.rfc3339(start),
        "end": output.rfc3339(end),
        "estimated": sum(not b["complete"] for b in buckets),
        "buckets": buckets,
    }
