"""What each page shows, read from the database as one document: the page renders it and
``?format=json`` returns it, so the two never disagree. Built from the CLI's own pieces: its
connection (``cli.database``: the trust check, the revision check), the store's health
facts and the verdict ``cronoq-store health`` gives (``cli.operations``), and its task and
holder documents (``cli.output``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _listing_statements as cs
from .. import _queries as queries
from .._cli import database, operations, output
from .._cli.exits import CliError
from .._codec import QUARANTINE_PREFIX
from .._domain import LIVE_STATUS_NAMES, TaskId, TaskStatus
from .._driver import translate_error
from .._errors import MigrationError
from .._migrations import RevisionStatus, head_revision
from .._urls import redact, scrub
from .source import ClusterNotFound, Source

__all__ = [
    "FINISHED_STATUSES",
    "LIVE_STATUSES",
    "PAGE_SIZE",
    "ClusterNotFound",
    "TaskAmbiguous",
    "TaskNotFound",
    "cluster",
    "live",
    "overview",
    "task",
]

#: Finished tasks per page.
PAGE_SIZE = 50
#: Recurring schedules the cluster page lists at most (a page of them: rendering is most
#: of a page's time).
SCHEDULES_SHOWN = 100
#: Dependencies whose targets a task's page looks up at most.
DEPS_SHOWN = 100
FINISHED_STATUSES = tuple(s.value for s in TaskStatus if s.is_terminal)
LIVE_STATUSES = tuple(sorted(LIVE_STATUS_NAMES))


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


async def _summary(conn: AsyncConnection, schema: str) -> tuple[dict[str, Any], Sequence[Any]]:
    """One cluster's line of the overview, and its live counts by pool and status."""
    health = await operations.read_health(conn, schema)
    revision, facts, holder = health.revision, health.facts, health.holder
    doc: dict[str, Any] = {
        "schema": schema,
        **_revision_document(revision),
        "stored_epoch": None if facts is None else facts.stored_epoch,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
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
    live_examined = sum(row.n for row in live)
    # At the bound, older live tasks were not looked at: counts are minimums, and the
    # total is the planner's estimate.
    live_at_least = live_examined >= cs.LIVE_SAMPLE
    estimate = None
    if live_at_least:
        found = (await conn.execute(cs.live_estimate, {"schema": schema})).scalar()
        estimate = None if found is None or found < 0 else round(found)
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


def _age(unix_ns: int) -> float:
    now = datetime.now(timezone.utc).timestamp()
    return max(0.0, round(now - unix_ns / 1e9, 3))


async def overview(source: Source) -> dict[str, Any]:
    """Every cluster of the database, one summary each; a schema the trust check refuses, or
    this role cannot read, is listed with the reason."""
    clusters = []
    url = source.url
    for schema in await source.cluster_schemas():
        try:
            async with source.connect(schema) as conn:
                clusters.append((await _summary(conn, schema))[0])
        except MigrationError as exc:  # the trust check
            clusters.append({"schema": schema, "refused": str(exc)})
        except CliError:
            raise  # cannot connect: the whole page says so
        except Exception as exc:  # e.g. no SELECT on this schema: the others still show
            error = translate_error(exc, f"reading schema {schema}")
            if error.is_transient:
                raise error from exc
            clusters.append({"schema": schema, "refused": scrub(str(error), [url])})
    return {"database": redact(url), "head": head_revision(), "clusters": clusters}


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
        summary, live = await _summary(conn, schema)
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
        "leadership_history": operations.terms_document(rows, operations.TERMS_SHOWN),
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


async def task(source: Source, schema: str, ref: output.IdRef | str) -> dict[str, Any]:
    """A task's page: the ``tasks show --json`` document, its spec as stored, and each
    dependency with its target's state; :class:`TaskAmbiguous` for a bare number that names
    tasks of several epochs."""
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
    doc["spec"] = spec
    doc["deps"] = targets
    doc["deps_total"] = len(deps) if isinstance(deps, list) else None
    doc["deps_raw"] = None if isinstance(deps, list) else deps
    return doc


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
