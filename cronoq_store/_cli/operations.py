"""What the operator's commands read and do to a cluster, each defined once: the CLI's
commands (``health``, ``handover``, ``prune``) and the console (:mod:`cronoq_store._console`)
both call these, so the two can never give different verdicts, end a session on different
checks, or count a different prune."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any, NamedTuple

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _listing_statements as ls
from .. import _queries as queries
from .. import _statements as st
from .._domain import EPOCH_MAX, I64_MAX, SPEC_FIELDS, Priority, SpecField, SpecKind, unhandled
from .._migrations import RevisionStatus
from .._queries import ClusterFacts, ListedTask
from .._results import LockHolder
from . import database, hosted, output
from .exits import CliError, ExitCode

__all__ = [
    "MATCHES_SHOWN",
    "PUBLIC_CONNECT_WARNING",
    "TERMS_SHOWN",
    "Handover",
    "Health",
    "Outcome",
    "PrunePlan",
    "SpecFact",
    "TaskFilters",
    "TaskSpecView",
    "batch_transactions",
    "end_leader_session",
    "find_tasks",
    "finished_page",
    "fresh_facts",
    "handover_document",
    "health_document",
    "json_or_text",
    "leader_lock",
    "leaderless_words",
    "live_page",
    "migration_lock_warning",
    "mode_document",
    "plan_prune",
    "prune_batches",
    "prune_cluster",
    "read_health",
    "read_spec",
    "recent_terms",
    "schema_facts",
    "terms_document",
    "verdict",
    "wait_for_new_leader",
]

#: How often a handover looks for the new leader while it waits.
_POLL = 0.1

#: Why a database where PUBLIC may connect is worth a line (docs/reliability.md).
PUBLIC_CONNECT_WARNING = (
    "every role may connect to this database (CONNECT is granted to PUBLIC), so any of them "
    "can hold the leader lock: instances refuse to lead here unless allow_untrusted_connect; "
    "run REVOKE CONNECT ON DATABASE ... FROM PUBLIC"
)


async def leader_lock(conn: AsyncConnection, schema: str) -> tuple[int, int]:
    """The keys of ``schema``'s leader lock: the store's namespace and the schema's OID."""
    oid = (await conn.execute(st.schema_oid, {"schema": schema})).scalar_one()
    return (st.LOCK_NS_LEADER, oid)


@dataclass(frozen=True)
class TaskFilters:
    """The filters of a list of tasks (``tasks finished``, ``tasks live``, the console's
    pages); empty tuples mean any. The time window (on ``updated``) narrows finished tasks
    only: it is a range of their index."""

    pools: tuple[str, ...] = ()
    statuses: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    since_ns: int | None = None
    until_ns: int | None = None

    def params(self) -> dict[str, Any]:
        return {
            "pools": list(self.pools),
            "statuses": list(self.statuses),
            "kinds": list(self.kinds),
            "tenants": list(self.tenants),
            "keys": list(self.keys),
            "since": -(2**63) if self.since_ns is None else self.since_ns,
            "until": I64_MAX if self.until_ns is None else self.until_ns,
        }


def _bounded(found: int, matching: int, bound: int, counted: str) -> dict[str, Any]:
    """A page's count: exact, or "at least" when the count stopped at its bound."""
    return {
        "matching": matching,
        # At the bound, further tasks were not examined: a minimum.
        "matching_at_least": found >= bound,
        "counted": counted,
    }


async def finished_page(
    conn: AsyncConnection, filters: TaskFilters, before: tuple[int, int] | None, limit: int
) -> dict[str, Any]:
    """A page of finished tasks, newest first, strictly older than the cursor ``before``
    (``(updated_unix_ns, id)``), and how many match: the console's list and ``tasks
    finished``. Examines at most :data:`~cronoq_store._listing_statements.SCAN` tasks; when
    the filters match fewer than a page there, ``scan_stopped`` says so and ``next`` looks
    on from the last one examined. Ends its transaction."""
    params = filters.params()
    page_params = {**params, "limit": limit + 1, "scan": ls.SCAN}
    top = (I64_MAX, I64_MAX) if before is None else before
    cursor = {"before_updated": top[0], "before_id": top[1]}
    if before is None:
        rows = (await conn.execute(ls.finished_first_page, page_params)).all()
    else:
        rows = (await conn.execute(ls.finished_next_page, {**page_params, **cursor})).all()
    boundary = None
    if len(rows) <= limit:
        # Fewer matches than a page: the end of the window, or the scan's bound.
        boundary = (
            await conn.execute(ls.scan_boundary, {**params, **cursor, "scan": ls.SCAN})
        ).first()
    examined, matching = (
        await conn.execute(ls.finished_count, {**params, "bound": ls.SAMPLE})
    ).one()
    await conn.rollback()
    last = None
    if len(rows) > limit:
        last = (rows[limit - 1].updated_unix_ns, rows[limit - 1].id)
    elif boundary is not None:
        last = (boundary.updated_unix_ns, boundary.id)
    return {
        "tasks": [output.task_document(*queries.listed_task(row)) for row in rows[:limit]],
        "next": None if last is None else f"{last[0]}.{last[1]}",
        # The page examined its bound of tasks without filling up: older ones may match.
        "scan_stopped": len(rows) <= limit and boundary is not None,
        "scan": ls.SCAN,
        **_bounded(examined, matching, ls.SAMPLE, f"the newest {ls.SAMPLE:,} of the window"),
    }


async def live_page(
    conn: AsyncConnection, filters: TaskFilters, after: int | None, limit: int
) -> dict[str, Any]:
    """A page of live tasks, oldest first (in id order), after the id ``after``, each with
    its age, and how many match: the console's live page and ``tasks live``. Bounded as
    :func:`finished_page` is. Ends its transaction."""
    params = {**filters.params(), "after": -1 if after is None else after}
    rows = (await conn.execute(ls.live_page, {**params, "limit": limit + 1, "scan": ls.SCAN})).all()
    boundary = None
    if len(rows) <= limit:
        boundary = (await conn.execute(ls.live_scan_boundary, {**params, "scan": ls.SCAN})).first()
    examined, matching = (
        await conn.execute(ls.live_count, {**params, "bound": ls.LIVE_SAMPLE})
    ).one()
    await conn.rollback()
    last = None
    if len(rows) > limit:
        last = rows[limit - 1].id
    elif boundary is not None:
        last = boundary.id
    now = datetime.now(timezone.utc).timestamp()
    tasks = []
    for row in rows[:limit]:
        doc = output.task_document(*queries.listed_task(row[:-1]))
        doc["arrival"] = output.rfc3339(row.arrival)
        doc["age_seconds"] = max(0.0, round(now - row.arrival / 1e9, 3))
        tasks.append(doc)
    return {
        "tasks": tasks,
        "next": None if last is None else str(last),
        "scan_stopped": len(rows) <= limit and boundary is not None,
        "scan": ls.SCAN,
        **_bounded(examined, matching, ls.LIVE_SAMPLE, f"the oldest {ls.LIVE_SAMPLE:,} live tasks"),
    }


#: The tasks a bare number lists at most when it names tasks of several epochs.
MATCHES_SHOWN = 100


async def find_tasks(conn: AsyncConnection, ref: output.IdRef | str) -> list[ListedTask]:
    """What ``tasks show`` and the console's task look-up find for ``ref``: the newest task
    with a key, the task with an id, or every task (in id order, :data:`MATCHES_SHOWN` and
    one more at most) a bare number names in any epoch, for the caller to list rather than
    guess."""
    if isinstance(ref, str):
        found = await queries.get_listed_task(conn, queries.lookup_params(ref))
        return [] if found is None else [found]
    return await queries.get_listed_tasks(conn, ref.ids, MATCHES_SHOWN + 1)


def json_or_text(text: str | None) -> Any:
    """A JSON column as its value, or as the stored text when it does not decode."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return {"undecodable": text}


@dataclass(frozen=True, slots=True)
class SpecFact:
    """One line of what ``tasks show`` and the console's task page show of a task's spec."""

    label: str
    words: str
    """The line as ``tasks show`` prints it."""
    style: str
    """How the console's page draws it (``task.html``): ``words``; ``arrival`` (with the
    seq); ``retry`` (the words and the stored JSON); ``json`` (the stored JSON, ``value``);
    ``deps`` (a table of its own)."""
    value: Any = None

    @property
    def slug(self) -> str:
        """Its element's id on the console's page, after ``task-``."""
        return self.label.replace(" ", "-")


@dataclass(frozen=True, slots=True)
class TaskSpecView:
    """A task's spec as its pages show it: the JSON and the lines drawn of it, apart, so that
    what only a page draws never reaches the JSON."""

    document: dict[str, Any]
    """What ``tasks show --json`` and the console's ``?format=json`` give as ``spec``."""
    facts: tuple[SpecFact, ...]
    """The lines ``tasks show`` prints and the console's task page draws, in their order."""


def _json_words(value: object) -> str:
    """A decoded JSON column on one line; ``-`` for none or an empty one."""
    return json.dumps(value, ensure_ascii=False) if value else "-"


def _shown(f: SpecField, row: Any) -> tuple[str, object, SpecFact]:
    """A spec field of a ``task_spec`` row: its member of the document, its value there,
    and its line on a task's page."""
    assert f.label is not None
    name, column, label = f.name, f.columns[0], f.label
    if f.kind is SpecKind.BYTES:  # read as its size (``_listing_statements.task_spec``)
        size = row[f"{column}_size"]
        return f"{column}_size", size, SpecFact(label, f"{size:,} bytes", "words")
    value: Any = row[column]
    match f.kind:
        case SpecKind.TEXT | SpecKind.OPTIONAL_TEXT:
            return name, value, SpecFact(label, value or "-", "words")
        case SpecKind.PRIORITY:
            shown = Priority.from_stored(value).name.lower()
            return name, shown, SpecFact(label, shown, "words")
        case SpecKind.ENGINE_TIME:
            moment = output.rfc3339(value)
            return name, moment, SpecFact(label, output.moment_words(moment), "words")
        case SpecKind.DURATION:
            return column, value, SpecFact(label, output.duration_words(value), "words")
        case SpecKind.FIXED_START:
            at, tolerance, on_miss = (row[c] for c in f.columns)
            if at is None:
                return name, None, SpecFact(label, "-", "words")
            fixed = {"at": output.rfc3339(at), "tolerance_ns": tolerance, "on_miss": on_miss}
            words = (
                f"{output.moment_words(fixed['at'])}, tolerance "
                f"{output.duration_words(tolerance)}, on miss {on_miss}"
            )
            return name, fixed, SpecFact(label, words, "words")
        case SpecKind.RETRY:
            retry = json_or_text(value)
            return column, retry, SpecFact(label, output.retry_words(retry), "retry", retry)
        case SpecKind.DEPS:
            deps = json_or_text(value)
            return column, deps, SpecFact(label, _json_words(deps), "deps", deps)
        case SpecKind.RESOURCES | SpecKind.STRINGS:
            stored = json_or_text(value)
            return column, stored, SpecFact(label, _json_words(stored), "json", stored)
        case SpecKind.BYTES:
            raise AssertionError("read as its size, above")
        case _:
            unhandled(f.kind, "spec kind")


#: The spec fields a task's page shows apart from its record, in declaration order.
_SHOWN = tuple(f for f in SPEC_FIELDS if f.label is not None)


async def read_spec(conn: AsyncConnection, task_id: int) -> tuple[TaskSpecView, Any]:
    """A task's spec as ``tasks show --json`` and the console's task page show it (times
    as RFC 3339, durations in ns, JSON columns decoded), and its dependencies as stored.

    Derived from ``SPEC_FIELDS``: each field shown apart from the record, in declaration
    order, with the sizes of bytes last in the document, and the task's arrival after the
    payload (TaskSpec's first field) among the facts, where the pages have always put them.
    The dependencies are returned apart, for the console's table of their targets."""
    row = (await conn.execute(ls.task_spec, {"id": task_id})).one()._mapping
    arrival = output.rfc3339(row["arrival_unix_ns"])
    members: dict[str, Any] = {}
    sizes: dict[str, Any] = {}
    facts: list[SpecFact] = []
    deps: Any = None
    for f in _SHOWN:
        member, value, fact = _shown(f, row)
        if f.kind is SpecKind.DEPS:
            deps = value
        else:
            (sizes if f.kind is SpecKind.BYTES else members)[member] = value
        facts.append(fact)
    facts.insert(1, SpecFact("arrival", output.moment_words(arrival), "arrival"))
    document = {"seq": row["seq"], "arrival": arrival, "finished": row["terminal"]}
    return TaskSpecView({**document, **members, **sizes}, tuple(facts)), deps


#: How many terms of the leadership history ``status`` and the console's cluster page show.
TERMS_SHOWN = 10


async def recent_terms(
    conn: AsyncConnection, revision: RevisionStatus, led: bool, limit: int = TERMS_SHOWN
) -> list[dict[str, Any]] | None:
    """The newest ``limit`` terms of the leadership history, newest first
    (:func:`terms_document`); ``None`` for a schema not at this build's head, whose history
    may not exist yet (a rolling upgrade before the migration)."""
    if not revision.at_head:
        return None
    rows = (await conn.execute(ls.recent_terms, {"limit": limit + 1})).all()
    return terms_document(rows, limit, led)


def terms_document(rows: Sequence[Any], limit: int, led: bool) -> list[dict[str, Any]]:
    """Terms newest first, each with how long it lasted at most (until the next began) and
    how long the cluster had no leader before it at most: from the taker's last look at a
    lock still held to the moment it took the epoch. Unknown (``None``) when the taker got
    the lock at its first try, so never saw it held. ``previous_recorded`` is false where
    the epoch before is missing (taken by a build that kept no history, or pruned).

    ``led``: whether a store instance holds the leader lock now. The newest term is
    ``leading`` only then: a term that ended with no successor (its instance released the
    lock or died, none took over) has no recorded end, and is not shown as going on."""
    terms = []
    for i, row in enumerate(rows[:limit]):
        newer = rows[i - 1] if i > 0 else None
        older = rows[i + 1] if i + 1 < len(rows) else None
        held = row.lock_seen_held_at
        terms.append(
            {
                "epoch": row.epoch,
                "began_at": output.rfc3339(row.began_at),
                "pid": row.pid,
                "role": row.role,
                "application_name": row.application_name,
                "client_addr": row.client_addr,
                "lock_seen_held_at": output.rfc3339(held),
                "leaderless_at_most_s": None
                if held is None
                else max(0.0, round((row.began_at - held).total_seconds(), 3)),
                "lasted_at_most_s": None
                if newer is None
                else round((newer.began_at - row.began_at).total_seconds(), 3),
                "leading": newer is None and led,
                "previous_recorded": older is not None and _follows(older.epoch, row.epoch),
            }
        )
    return terms


def _follows(before: int, epoch: int) -> bool:
    """Whether ``epoch`` is the one taken right after ``before`` (it wraps to 1)."""
    return epoch == before + 1 or (epoch == 1 and before == EPOCH_MAX)


def leaderless_words(term: dict[str, Any]) -> str:
    """How long the cluster had no leader before a term, in words."""
    seconds = term["leaderless_at_most_s"]
    if seconds is None:
        return "unknown (the lock was free at its first try)"
    return f"at most {output.duration_words(round(seconds * 1e9))}"


def verdict(
    revision: RevisionStatus, facts: ClusterFacts | None, holder: LockHolder | None
) -> tuple[ExitCode, list[str]]:
    """The exit code ``health`` gives (the gravest reason's) and every reason, in words."""
    codes: list[ExitCode] = []
    reasons: list[str] = []
    if not revision.at_head:
        codes.append(ExitCode.NEWER_DATABASE if revision.unknown else ExitCode.NOT_MIGRATED)
        reasons.append(
            f"schema {revision.schema} is {revision.describe()} (this build's head is "
            f"{revision.head})"
        )
    if holder is None:
        codes.append(ExitCode.NO_LEADER)
        reasons.append("no instance holds the leader lock")
    elif facts is None:
        reasons.append(
            f"backend pid {holder.pid} ({holder.application_name or 'details hidden'}) holds the "
            f"leader lock, but schema {revision.schema} is not migrated: it cannot lead it"
        )
    elif not holder.store_instance:
        codes.append(ExitCode.FOREIGN_HOLDER)
        reasons.append(output.describe_foreign(holder))
    return (codes[0] if codes else ExitCode.OK), reasons


class Health(NamedTuple):
    """What ``health`` reads of a schema, and its verdict."""

    revision: RevisionStatus
    facts: ClusterFacts | None
    holder: LockHolder | None
    public_connect: bool
    code: ExitCode
    reasons: list[str]
    #: Who holds the schema's migration lock, if a session does.
    migration_lock: LockHolder | None = None
    #: A hosted cluster's control row and owner; ``None`` for a standalone cluster.
    host: hosted.HostFacts | None = None
    #: What the hosted verdict warns of (an epoch moved outside the host group).
    host_warnings: tuple[str, ...] = ()

    @property
    def warnings(self) -> list[str]:
        """What ``health`` says whatever its exit code: facts that do not make the cluster
        unhealthy now, but stop something later."""
        said = [] if self.migration_lock is None else [migration_lock_warning(self.migration_lock)]
        said += self.host_warnings
        return said + ([PUBLIC_CONNECT_WARNING] if self.public_connect else [])


def migration_lock_warning(holder: LockHolder) -> str:
    """A held migration lock, in words (``health``, ``status``)."""
    return (
        f"the migration lock is held by {output.describe_session(holder)}: every migration "
        "of this schema (`cronoq-store migrate`, Alembic, an instance opening on a schema "
        "behind its head) waits for it"
    )


async def schema_facts(
    conn: AsyncConnection, revision: RevisionStatus
) -> tuple[ClusterFacts | None, LockHolder | None]:
    """The leadership facts a schema at any revision holds (``None`` without a leader
    table), and the leader lock's holder. Read by the leader table's columns, not by the
    revision, so that a schema older or newer than this build's head reads as well as it
    can."""
    if not revision.exists:
        return None, None
    lock = await leader_lock(conn, revision.schema)
    columns = await queries.leader_columns(conn, revision.schema)
    if "epoch" not in columns:
        # No leader row, but a leader may still hold the lock (its tables were dropped
        # under it): say so rather than "no instance holds the lock".
        return None, await queries.leader_lock_holder(conn, lock)
    recorded = columns >= queries.HOLDER_COLUMNS
    facts = await queries.cluster_facts(conn, lock, recorded=recorded)
    return facts, facts.holder


async def read_health(
    conn: AsyncConnection,
    schema: str,
    control_schema: str = hosted.DEFAULT_CONTROL_SCHEMA,
    vetted: set[str] | None = None,
    hosts: hosted.HostRows | None = None,
) -> Health:
    """Where ``schema`` stands, who holds its leader lock and its migration lock, and the
    verdict; for a cluster a host group leads, its owner read in ``control_schema`` and the
    hosted verdict (:func:`~cronoq_store._cli.hosted.hosted_verdict`). ``hosts``: the
    control rows read already for many clusters at once (the console's overview), taken
    instead of reading this one's."""
    public = bool((await conn.execute(catalog.public_may_connect)).scalar())
    revision = await database.revision(conn, schema)
    facts, holder = await schema_facts(conn, revision)
    migrating = await queries.migration_lock_holder(conn, schema)
    group = hosted.host_group(facts)
    await conn.rollback()
    if group is not None:
        host = (
            await hosted.read_host(conn, schema, group, control_schema, vetted)
            if hosts is None
            else hosts.facts(schema, group)
        )
        code, reasons, warned = hosted.hosted_verdict(revision, facts, holder, host)
        return Health(
            revision, facts, holder, public, code, reasons, migrating, host, tuple(warned)
        )
    code, reasons = verdict(revision, facts, holder)
    return Health(revision, facts, holder, public, code, reasons, migrating)


def health_document(schema: str, health: Health) -> dict[str, Any]:
    """``cronoq-store health --json``'s document (keys in docs/operations.md)."""
    revision, facts, holder = health.revision, health.facts, health.holder
    return {
        "healthy": health.code is ExitCode.OK,
        "schema": schema,
        "revision": list(revision.current),
        "head": revision.head,
        "at_head": revision.at_head,
        "revision_state": revision.describe(),
        "stored_epoch": None if facts is None else facts.stored_epoch,
        "incarnation": None if facts is None else facts.incarnation,
        "leader": output.holder_document(output.leader_of(holder)),
        "lock_holder": output.holder_document(holder),
        "migration_lock": output.session_document(health.migration_lock),
        "reasons": health.reasons,
        "warnings": health.warnings,
        **mode_document(health.host, holder),
    }


def mode_document(host: hosted.HostFacts | None, holder: LockHolder | None) -> dict[str, Any]:
    """``"mode"`` of ``status --json`` and ``health --json``, and for a hosted cluster
    ``"host"`` (:func:`~cronoq_store._cli.hosted.host_document`)."""
    if host is None:
        return {"mode": "standalone"}
    return {"mode": "hosted", "host": hosted.host_document(host, holder)}


async def fresh_facts(conn: AsyncConnection, lock: tuple[int, int]) -> ClusterFacts:
    """The cluster's leadership facts, the transaction ended after them: pg_stat_activity
    is read once per transaction, so the next look sees what changed meanwhile."""
    facts = await queries.cluster_facts(conn, lock)
    await conn.rollback()
    return facts


async def end_leader_session(conn: AsyncConnection, lock: tuple[int, int], pid: int) -> None:
    """End session ``pid`` if it still holds the leader lock (a handover's one write);
    exit 1 if the lock changed hands meanwhile, if this role cannot see which instance
    holds it (it could not tell whether another one takes over), or if the session could
    not be ended."""
    current = (await fresh_facts(conn, lock)).holder
    if current is None or current.pid != pid:
        raise CliError("the leader lock changed hands meanwhile: look again", ExitCode.FAILED)
    if current.store_instance and current.since is None:
        raise CliError(
            f"this role cannot see which instance holds the leader lock (session pid {pid}), "
            "so it could not tell whether another instance takes over: grant it "
            "pg_read_all_stats; nothing was ended",
            ExitCode.FAILED,
        )
    ended = (await conn.execute(catalog.terminate_backend, {"pid": pid})).scalar()
    await conn.rollback()
    if not ended:
        raise CliError(f"session pid {pid} could not be ended", ExitCode.FAILED)


class Outcome(Enum):
    """Where the leader lock went after a handover ended its holder's session."""

    #: Another store instance (another instance id) took a new epoch.
    HANDED_OVER = "handed_over"
    #: The instance whose session was ended took a new epoch again.
    TAKEN_BACK = "taken_back"
    #: A new epoch was taken by a session that shows no instance id (a build before them).
    UNTOLD = "unknown"
    #: No store instance took a new epoch within the timeout.
    NO_LEADER = "no_leader"


class Handover(NamedTuple):
    """How a handover ended: the session it ended, the facts before and at the end, and
    where the lock went, told by instance id (:attr:`LockHolder.instance`), never by pid:
    one instance's next lock session has a new pid."""

    outcome: Outcome
    ended: LockHolder
    before: ClusterFacts
    after: ClusterFacts
    timeout: float

    @property
    def code(self) -> ExitCode:
        """The exit code: 0 only when another instance leads."""
        match self.outcome:
            case Outcome.HANDED_OVER:
                return ExitCode.OK
            case Outcome.NO_LEADER:
                return ExitCode.NO_LEADER
            case Outcome.TAKEN_BACK | Outcome.UNTOLD:
                return ExitCode.NOT_HANDED_OVER
            case _:
                unhandled(self.outcome, "handover outcome")

    def message(self) -> str:
        """The outcome in one line, naming the instances compared."""
        ended, new = _instance(self.ended), self.after.holder
        epoch = self.after.stored_epoch
        if self.outcome is Outcome.NO_LEADER or new is None:
            waits = (
                f", and {ended}, whose session was ended, waits 2 x lock_poll + 1 s before it "
                "competes again"
                if self.ended.store_instance
                else ""
            )
            return (
                f"no instance took the leader lock within {self.timeout:g} s (epoch "
                f"{epoch}): no standby took over{waits}"
            )
        if self.outcome is Outcome.TAKEN_BACK:
            return (
                f"{ended}, whose session was ended, leads again at epoch {epoch} (backend pid "
                f"{new.pid}): no other instance took the lock; is a standby running, and can "
                "it reach the database?"
            )
        if self.outcome is Outcome.UNTOLD:
            return (
                f"backend pid {new.pid} leads at epoch {epoch} but shows no instance id (a "
                f"build before instance ids): cannot tell whether it is {ended} again"
            )
        other = "" if self.ended.instance is None else f", not {self.ended.instance}"
        return (
            f"new leader: {_instance(new)}{other}: backend pid {new.pid} "
            f"({new.application_name}), epoch {epoch}"
        )

    def check(self) -> ClusterFacts:
        """The facts at the end when another instance leads; else the outcome as an error."""
        if self.outcome is not Outcome.HANDED_OVER:
            raise CliError(self.message(), self.code)
        return self.after


def _instance(holder: LockHolder) -> str:
    """A lock holder as its instance (``instance 3f9a2c1b``), or its session when it shows
    no instance id."""
    if holder.instance is not None:
        return f"instance {holder.instance}"
    return f"the instance of session pid {holder.pid}"


def _outcome(ended: LockHolder, new: LockHolder) -> Outcome:
    """Whether ``new``, a store instance that took a new epoch after the session of
    ``ended`` was ended, is another instance."""
    if new.instance is not None:
        return Outcome.TAKEN_BACK if new.instance == ended.instance else Outcome.HANDED_OVER
    # Without an id on the new leader, only an ended foreign holder (no instance at all)
    # tells it apart: any store instance leading then is another one.
    return Outcome.UNTOLD if ended.store_instance else Outcome.HANDED_OVER


async def wait_for_new_leader(
    conn: AsyncConnection,
    lock: tuple[int, int],
    before: ClusterFacts,
    old: LockHolder,
    timeout: float,
) -> Handover:
    """Wait, up to ``timeout``, until a store instance holds the lock and has moved the
    epoch (a leader bumps it after taking the lock); then, or at the timeout, say where
    the lock went."""
    deadline = time.monotonic() + timeout
    while True:
        facts = await fresh_facts(conn, lock)
        holder = facts.holder
        moved = facts.stored_epoch != before.stored_epoch
        if holder is not None and holder.store_instance and holder.pid != old.pid and moved:
            return Handover(_outcome(old, holder), old, before, facts, timeout)
        if time.monotonic() >= deadline:
            return Handover(Outcome.NO_LEADER, old, before, facts, timeout)
        await asyncio.sleep(_POLL)


def handover_document(schema: str, handover: Handover) -> dict[str, Any]:
    """``cronoq-store handover --json``'s document (keys in docs/operations.md)."""
    return {
        "handed_over": handover.outcome is Outcome.HANDED_OVER,
        "outcome": handover.outcome.value,
        "message": handover.message(),
        "schema": schema,
        "previous_epoch": handover.before.stored_epoch,
        "stored_epoch": handover.after.stored_epoch,
        "ended": output.holder_document(handover.ended),
        "leader": output.holder_document(output.leader_of(handover.after.holder)),
    }


class PrunePlan(NamedTuple):
    """A prune's dry run: its cutoff (Unix ns, on the server's clock), how many finished
    tasks it would delete, and how many older ones it keeps because live tasks depend on
    them."""

    cutoff_ns: int
    victims: int
    protected: int


async def plan_prune(conn: AsyncConnection, older_than: int) -> PrunePlan:
    """The dry run of a prune of finished tasks older than ``older_than`` seconds on the
    server's clock (what ``PgStore.prune`` counts from)."""
    cutoff_ns = await queries.server_prune_cutoff(conn, older_than)
    old = (await conn.execute(catalog.finished_before_count, {"cutoff": cutoff_ns})).scalar_one()
    victims = (
        await conn.execute(catalog.prunable_count, {"cutoff": cutoff_ns, "batch": I64_MAX})
    ).scalar_one()
    await conn.rollback()
    return PrunePlan(cutoff_ns, victims, max(0, old - victims))


async def prune_cluster(conn: AsyncConnection, schema: str) -> tuple[str, int]:
    """The cluster a prune of ``schema`` deletes in: its name and its incarnation now, read
    before the first batch, so that no batch deletes in a cluster made again meanwhile
    (``queries.prune``). The read's transaction is ended, for the batches' own."""
    incarnation = await queries.incarnation(conn, schema)
    await conn.rollback()
    return schema, incarnation


def batch_transactions(
    conn: AsyncConnection,
) -> Callable[[Callable[[AsyncConnection], Awaitable[int]]], Awaitable[int]]:
    """``conn``, one transaction per prune batch, for the store's loop (``queries.prune``)."""

    async def in_transaction(batch: Callable[[AsyncConnection], Awaitable[int]]) -> int:
        async with conn.begin():
            return await batch(conn)

    return in_transaction


async def prune_batches(
    conn: AsyncConnection,
    cluster: tuple[str, int],
    cutoff_ns: int,
    progress: Callable[[int], None],
    lock_wait: float,
) -> int:
    """Prune on ``conn`` with the store's own loop, one transaction per batch, only in
    ``cluster`` (:func:`prune_cluster`), each batch waiting at most ``lock_wait`` seconds
    for the leader table (the command's ``--lock-wait``); returns how many were deleted."""
    return await queries.prune(
        batch_transactions(conn),
        cutoff_ns,
        progress,
        cluster=cluster,
        lock_wait=lock_wait,
        waiter=f"pruning (a command waits {lock_wait:g} s at most)",
    )
