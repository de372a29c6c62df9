"""``cronoq-store status``: the revision, the leader and its lock, task counts, quarantined
rows and recurring schedules, in one look."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import click
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _queries as queries
from .. import _statements as st
from .._codec import QUARANTINE_PREFIX
from .._results import LockHolder
from .._urls import redact
from . import database, fleet, hosted, operations, output
from .app import Options
from .exits import ExitCode, run

__all__ = ["holder_facts", "status"]


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@fleet.selection_options
@fleet.jobs_option(2, "read")
@hosted.control_schema_option
@click.pass_obj
def status(
    options: Options,
    as_json: bool,
    every: bool,
    glob: str | None,
    jobs: int,
    control_schema: str,
) -> None:
    """Revision, leader, lock holder, task counts, quarantined rows and recurring schedules.

    A cluster a host group leads (PgHost) shows its mode, and as its leader the host
    process that owns it, live while that process's lock is held.

    With --all or --schemas: one line per cluster (revision, epoch, leader; no task
    counts) and a summary; with --json, one JSON object per line and the summary last.
    The exit code is the gravest cluster's.
    """
    chosen = fleet.selection(options, every, glob)
    # The control schema's trust check, once for every hosted cluster of the run.
    vetted: set[str] = set()
    if chosen is not None:
        code = run(
            options.url,
            fleet.over_clusters(
                options,
                chosen,
                jobs,
                as_json,
                lambda conn, schema: fleet.read_status(conn, schema, control_schema, vetted),
                "at head",
            ),
        )
        if code is not ExitCode.OK:
            raise click.exceptions.Exit(int(code))
        return
    run(options.url, _status(options, as_json, output.console(), control_schema))


class _Contents(NamedTuple):
    """What only a schema at this build's head can be asked: its tables as this build
    reads them."""

    epoch: int
    max_id: int
    counts: Sequence[Any]
    quarantined: int
    schedules: Sequence[Any]


async def _contents(conn: AsyncConnection) -> _Contents:
    epoch, max_id = (await conn.execute(catalog.leader_state)).one()
    counts = (await conn.execute(catalog.task_counts)).all()
    quarantined = (
        await conn.execute(catalog.quarantined_count, {"prefix": QUARANTINE_PREFIX})
    ).scalar_one()
    schedules = (await conn.execute(catalog.schedule_summaries)).all()
    return _Contents(epoch, max_id, counts, quarantined, schedules)


async def _status(options: Options, as_json: bool, console: Console, control_schema: str) -> None:
    """What ``cronoq-store status`` shows. Long for a reason: one read of each fact, then the
    lines in the order the operator reads them; split into helpers, that order would be
    spread over them.

    A schema not at this build's head is no failure to read: what every revision holds (the
    revision, the epoch, the leader lock and its holder, the migration lock) is shown, then
    the command exits 4 (behind, missing) or 5 (newer), naming the fix."""
    schema = options.schema
    async with database.database(options) as conn:
        revision = await database.revision(conn, schema)
        facts, holder = await operations.schema_facts(conn, revision)
        migrating = await queries.migration_lock_holder(conn, schema)
        oid = (await conn.execute(st.schema_oid, {"schema": schema})).scalar_one()
        contents = await _contents(conn) if revision.at_head else None
        group = hosted.host_group(facts)
        await conn.rollback()
        host = None
        if group is not None:
            host = await hosted.read_host(conn, schema, group, control_schema)
        led = (output.leader_of(holder) if host is None else host.live_owner) is not None
        terms = await operations.recent_terms(conn, revision, led)
        await conn.rollback()

    # The store passes the OID as a signed int4; pg_locks shows it unsigned.
    keys = None if oid is None else (st.LOCK_NS_LEADER, oid & 0xFFFFFFFF)
    epoch = None if facts is None else facts.stored_epoch
    if as_json:
        document: dict[str, object] = {
            "database": redact(options.database_url()),
            "schema": schema,
            "revision": list(revision.current),
            "head": revision.head,
            "at_head": revision.at_head,
            "revision_state": revision.describe(),
            "epoch": epoch if contents is None else contents.epoch,
            "incarnation": None if facts is None else facts.incarnation,
            "lock": None if keys is None else list(keys),
            "leader": output.holder_document(output.leader_of(holder)),
            "lock_holder": output.holder_document(holder),
            "migration_lock": output.session_document(migrating),
            "leadership_history": terms,
            **operations.mode_document(host, holder),
        }
        if contents is not None:
            document.update(_contents_document(contents))
        output.emit_json(document)
        database.refuse_unless_at_head(revision)
        return

    lock = "advisory lock" if keys is None else f"advisory lock ({keys[0]}, {keys[1]})"
    if contents is not None:
        epoch = contents.epoch
    epoch_line = [] if epoch is None else [("epoch", str(epoch))]
    if epoch == 0:
        epoch_line = [("epoch", "0 (no leader yet)")]
    max_id = None if contents is None else contents.max_id
    output.print_facts(
        console,
        ("database", redact(options.database_url())),
        ("schema", schema),
        ("revision", f"{', '.join(revision.current) or '-'} ({revision.describe()})"),
        ("head", f"{revision.head} (this build)"),
        *epoch_line,
        *(
            []
            if facts is None or facts.incarnation is None
            else [
                (
                    "incarnation",
                    f"{facts.incarnation} (the leader table's OID: another after a re-creation)",
                )
            ]
        ),
        *(
            []
            if max_id is None
            else [("max id", output.task_id(max_id) if max_id else "0 (no task issued)")]
        ),
        *(
            []
            if not revision.exists
            else holder_facts(holder, lock)
            if host is None
            else hosted.status_facts(host, holder, lock)
        ),
        *(
            []
            if migrating is None
            else [("migrations", operations.migration_lock_warning(migrating))]
        ),
        *([] if contents is None else [("quarantined", f"{contents.quarantined:,} rows")]),
    )
    if revision.exists:
        _print_terms(console, terms)
    database.refuse_unless_at_head(revision)
    assert contents is not None
    if contents.counts:
        output.print_table(
            console,
            "tasks by pool and status",
            ("pool", "state", "status", "count"),
            (
                (row.pool, "finished" if row.terminal else "live", row.status, f"{row.n:,}")
                for row in contents.counts
            ),
            right=("count",),
        )
    else:
        console.print("no tasks")
    if contents.schedules:
        output.print_table(
            console,
            "recurring schedules",
            ("name", "schedule", "next run", "last task"),
            (
                (
                    row.name,
                    output.describe_schedule(row.schedule),
                    "-" if row.next_unix_ns is None else output.utc(row.next_unix_ns),
                    "-" if row.last_task_id is None else str(row.last_task_id),
                )
                for row in contents.schedules
            ),
            wrap="schedule",
        )
    else:
        console.print("no recurring schedules")


def _print_terms(console: Console, terms: list[dict[str, Any]] | None) -> None:
    """The leadership history as a timeline, newest term first, with how long the cluster
    had no leader before each."""
    if terms is None:
        console.print(
            "leadership history: no history recorded (the schema is not at this build's "
            "head: it is kept from revision 0008_leader_history on)"
        )
        return
    if not terms:
        console.print("leadership history: no takeover recorded yet")
        return
    output.print_table(
        console,
        f"leadership history (the last {len(terms)} terms, newest first)",
        ("epoch", "began", "instance", "lasted", "no leader before it"),
        (
            (
                str(term["epoch"]),
                output.moment_words(term["began_at"]),
                f"pid {term['pid']}, role {term['role'] or '-'}, "
                f"{term['application_name'] or '(no application_name)'!r}, "
                f"from {term['client_addr'] or 'a local socket'}",
                _lasted(term),
                operations.leaderless_words(term)
                + ("" if term["previous_recorded"] else "; the epoch before is not recorded"),
            )
            for term in terms
        ),
        right=("epoch",),
        wrap="instance",
    )


def _contents_document(contents: _Contents) -> dict[str, object]:
    """The keys of ``status --json`` that only a schema at head has."""
    return {
        "max_id": contents.max_id,
        "quarantined": contents.quarantined,
        "tasks": [
            {
                "pool": row.pool,
                "state": "finished" if row.terminal else "live",
                "status": row.status,
                "count": row.n,
            }
            for row in contents.counts
        ],
        "recurring": [
            {
                "name": row.name,
                "schedule": output.describe_schedule(row.schedule),
                "next_run": output.rfc3339(row.next_unix_ns),
                "last_task_id": row.last_task_id,
            }
            for row in contents.schedules
        ],
    }


def holder_facts(holder: LockHolder | None, lock: str) -> list[tuple[str, str]]:
    """The leader lock's holder as label-and-value lines (``status``, ``handover``)."""
    if holder is None:
        return [("leader", f"none: no session holds the {lock}")]
    if not holder.store_instance:
        return [
            ("leader", f"none: the {lock} is held by a session that is not a store instance"),
            ("lock holder", output.describe_foreign(holder)),
        ]
    if holder.since is None:
        # Another role's session, and this one may not see its details.
        return [
            (
                "leader",
                f"backend pid {holder.pid} (details hidden: grant this role pg_read_all_stats)",
            ),
            ("", f"holds the {lock}"),
        ]
    # The instance id tells instances apart; the pid changes with each of one's sessions.
    instance = "" if holder.instance is None else f"instance {holder.instance}, "
    return [
        (
            "leader",
            f"{instance}backend pid {holder.pid}, "
            f"{holder.application_name or '(no application_name)'!r}, "
            f"from {holder.client_addr or 'a local socket'}",
        ),
        ("", f"session since {output.moment_words(holder.since)}"),
        ("", f"holds the {lock}"),
    ]


def _lasted(term: dict[str, Any]) -> str:
    """How long a term lasted: at most until the next began; the newest is ``leading``, or,
    with no leader now, ended at a time the history does not hold."""
    if term["lasted_at_most_s"] is not None:
        return f"at most {output.duration_words(round(term['lasted_at_most_s'] * 1e9))}"
    return "leading" if term["leading"] else "ended (when is not recorded; no leader now)"
