"""What each page shows, read from the database as one document: the page renders it and
``?format=json`` returns it, so the two never disagree. Built from the CLI's own pieces: its
connection (``cli.database``: the trust check, the revision check), the store's health
facts (``queries.cluster_facts``) and the verdict ``cronoq-store health`` gives, and its
task and holder documents (``cli.output``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._cli import database as database
from .._cli import output as output
from .._cli.app import Options as Options
from .._cli.exits import CliError as CliError
from .._cli.health import _verdict as health_verdict
from .._codec import QUARANTINE_PREFIX as QUARANTINE_PREFIX
from .._domain import I64_MAX as I64_MAX
from .._domain import TaskId as TaskId
from .._domain import TaskStatus as TaskStatus
from .._driver import translate_error as translate_error
from .._errors import MigrationError as MigrationError
from .._migrations import RevisionStatus as RevisionStatus
from .._migrations import head_revision as head_revision
from .._urls import redact as redact
from .._urls import scrub as scrub
from . import statements as cs

__all__ = [
    "FINISHED_STATUSES",
    "PAGE_SIZE",
    "ClusterNotFound",
    "FinishedFilters",
    "TaskNotFound",
    "cluster",
    "overview",
    "task",
]

#: Finished tasks per page.
PAGE_SIZE = 50
#: Recurring schedules the cluster page lists at most.
SCHEDULES_SHOWN = 500
#: Dependencies whose targets a task's page looks up at most.
DEPS_SHOWN = 100
FINISHED_STATUSES = tuple(s.value for s in TaskStatus if s.is_terminal)


class ClusterNotFound(LookupError):
    """No cluster in that schema (or a name no schema can have): a 404."""


class TaskNotFound(LookupError):
    """No task with that id or key: a 404."""


@dataclass(frozen=True)
class FinishedFilters:
    """The cluster page's filters over finished tasks, checked by the page's parser; empty
    tuples mean any."""

    pools: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    since_ns: int | None = None
    until_ns: int | None = None
    #: The keyset cursor: strictly older than ``(updated_unix_ns, id)``.
    before: tuple[int, int] | None = None

    def params(self) -> dict[str, Any]:
        return {
            "pools": list(self.pools),
            "statuses": list(self.statuses),
            "kinds": list(self.kinds),
            "tenants": list(self.tenants),
            "since": -(2**63) if self.since_ns is None else self.since_ns,
            "until": I64_MAX if self.until_ns is None else self.until_ns,
        }


def _options(url: str, schema: str, trusted_triggers: frozenset[str]) -> Options:
    return Options(url=url, schema=schema, trusted_triggers=trusted_triggers)


async def cluster_schemas(url: str) -> list[str]:
    """Every schema of the database holding a cluster (the CLI's own catalog query)."""
    made = database.engine(url)
    try:
        async with made.connect() as conn:
            return list((await conn.execute(catalog.cluster_schemas)).scalars())
    finally:
        await made.dispose()


def _revision_document(revision: RevisionStatus) -> dict[str, Any]:
    return {
        "revision": list(revision.current),
        "head": revision.head,
        "at_head": revision.at_head,
        "revision_state": revision.describe(),
    }


async def _summary(conn: AsyncConnection, schema: str) -> dict[str, Any]:
    """One cluster's line of the overview."""
    revision = await database.revision(conn, schema)
    facts = None
    if revision.current:
        oid = (await conn.execute(lock_st.schema_oid, {"schema": schema})).scalar_one()
        facts = await queries.cluster_facts(conn, (lock_st.LOCK_NS_LEADER, oid))
    holder = None if facts is None else facts.holder
    code, reasons = health_verdict(revision, facts, holder)
    doc: dict[str, Any] = {
        "schema": schema,
        **_revision_document(revision),
        "stored_epoch": None if facts is None else facts.stored_epoch,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
        # What `cronoq-store health --json` says of this schema.
        "health": {"healthy": code == 0, "exit_code": int(code), "reasons": reasons},
    }
    if not revision.at_head:
        # A schema this build cannot read: its tables may not be what the statements expect.
        return doc
    epoch, max_id = (await conn.execute(catalog.leader_state)).one()
    newest = (await conn.execute(cs.newest_change)).scalar()
    live = (await conn.execute(cs.live_counts)).all()
    finished = (
        await conn.execute(cs.finished_sample, {"sample": cs.SAMPLE, "prefix": QUARANTINE_PREFIX})
    ).all()
    await conn.rollback()
    by_status: dict[str, int] = {}
    for row in live:
        by_status[row.status] = by_status.get(row.status, 0) + row.n
    examined = sum(row.n for row in finished)
    doc.update(
        {
            "epoch": epoch,
            "max_id": max_id,
            "newest_change": output.rfc3339(newest),
            "newest_change_age_seconds": None if newest is None else _age(newest),
            "live": [{"status": s, "count": n} for s, n in sorted(by_status.items())],
            "finished": {
                "statuses": [{"status": row.status, "count": row.n} for row in finished],
                "examined": examined,
                "sample": cs.SAMPLE,
                # At the bound, older finished tasks were not looked at: counts are minimums.
                "at_least": examined >= cs.SAMPLE,
            },
            "quarantined": sum(row.quarantined for row in finished),
        }
    )
    return doc


def _age(unix_ns: int) -> float:
    now = datetime.now(timezone.utc).timestamp()
    return max(0.0, round(now - unix_ns / 1e9, 3))


async def overview(url: str, trusted_triggers: frozenset[str]) -> dict[str, Any]:
    """Every cluster of the database, one summary each; a schema the trust check refuses, or
    this role cannot read, is listed with the reason."""
    clusters = []
    for schema in await cluster_schemas(url):
        try:
            async with database.database(_options(url, schema, trusted_triggers)) as conn:
                clusters.append(await _summary(conn, schema))
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


async def known(url: str, schema: str) -> None:
    """``ClusterNotFound`` unless ``schema`` holds a cluster."""
    if schema not in await cluster_schemas(url):
        raise ClusterNotFound(schema)


async def cluster(
    url: str, schema: str, trusted_triggers: frozenset[str], filters: FinishedFilters
) -> dict[str, Any]:
    """A cluster's page: its summary, live tasks by pool and status, a page of finished
    tasks (newest first) and its recurring schedules."""
    await known(url, schema)
    async with database.database(_options(url, schema, trusted_triggers)) as conn:
        summary = await _summary(conn, schema)
        if not summary["at_head"]:
            return {"schema": schema, "summary": summary}
        params = filters.params()
        page_params = {**params, "limit": PAGE_SIZE + 1}
        if filters.before is None:
            rows = (await conn.execute(cs.finished_first_page, page_params)).all()
        else:
            page_params["before_updated"], page_params["before_id"] = filters.before
            rows = (await conn.execute(cs.finished_next_page, page_params)).all()
        examined, matching = (
            await conn.execute(cs.finished_count, {**params, "bound": cs.SAMPLE})
        ).one()
        live = (await conn.execute(cs.live_counts)).all()
        recurring = (await conn.execute(cs.schedules, {"limit": SCHEDULES_SHOWN + 1})).all()
        await conn.rollback()
    page = rows[:PAGE_SIZE]
    last = page[-1] if len(rows) > PAGE_SIZE else None
    return {
        "schema": schema,
        "summary": summary,
        "live": [{"pool": r.pool, "status": r.status, "count": r.n} for r in live],
        "finished": {
            "tasks": [output.task_document(*queries.listed_task(row)) for row in page],
            "next": None if last is None else f"{last.updated_unix_ns}.{last.id}",
            "matching": matching,
            # At the bound, older tasks of the window were not examined: a minimum.
            "matching_at_least": examined >= cs.SAMPLE,
        },
        "recurring": [
            {
                "name": r.name,
                "schedule": output.describe_schedule(r.schedule),
                "next_run": output.rfc3339(r.next_unix_ns),
                "last_task_id": r.last_task_id,
                "last_status": r.last_status,
                "last_updated": output.rfc3339(r.last_updated),
            }
            for r in recurring[:SCHEDULES_SHOWN]
        ],
        "recurring_more": len(recurring) > SCHEDULES_SHOWN,
    }


def _json_or_text(text: str | None) -> Any:
    """A JSON column as its value, or as the stored text when it does not decode."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {"undecodable": text}


async def task(
    url: str, schema: str, trusted_triggers: frozenset[str], ref: TaskId | str
) -> dict[str, Any]:
    """A task's page: the ``tasks show --json`` document, its spec as stored, and each
    dependency with its target's state."""
    await known(url, schema)
    async with database.database(_options(url, schema, trusted_triggers)) as conn:
        await database.require_head(conn, schema)
        listed = await queries.get_listed_task(conn, queries.lookup_params(ref))
        if listed is None:
            raise TaskNotFound(str(ref))
        record = listed.record
        spec = (await conn.execute(cs.task_spec, {"id": record.id})).one()
        deps = _json_or_text(spec.deps)
        targets = []
        for dep in deps[:DEPS_SHOWN] if isinstance(deps, list) else []:
            targets.append(await _target(conn, dep))
        await conn.rollback()
    doc = output.task_document(*listed)
    doc["spec"] = {
        "seq": spec.seq,
        "arrival": output.rfc3339(spec.arrival_unix_ns),
        "finished": spec.terminal,
        "deadline": output.rfc3339(spec.deadline_unix_ns),
        "fixed_start": None
        if spec.fixed_at_unix_ns is None
        else {
            "at": output.rfc3339(spec.fixed_at_unix_ns),
            "tolerance_ns": spec.fixed_tolerance_ns,
            "on_miss": spec.fixed_on_miss,
        },
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": _json_or_text(spec.retry),
        "resources": _json_or_text(spec.resources),
        "tags": _json_or_text(spec.tags),
        "labels": _json_or_text(spec.labels),
        "payload_size": spec.payload_size,
    }
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
