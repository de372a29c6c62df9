"""``cronoq-store status``: the revision, the leader and its lock, task counts, quarantined
rows and recurring schedules, in one look."""

from __future__ import annotations

import click
from rich.console import Console

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._codec import QUARANTINE_PREFIX
from .._stored_values import LockHolder
from .._urls import redact
from . import database, output
from .app import Options
from .exits import run

__all__ = ["holder_facts", "status"]


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@click.pass_obj
def status(options: Options, as_json: bool) -> None:
    """Revision, leader, lock holder, task counts, quarantined rows and recurring schedules."""
    run(options.url, _status(options, as_json, output.console()))


async def _status(options: Options, as_json: bool, console: Console) -> None:
    """What ``cronoq-store status`` shows. Long for a reason: one read of each fact, then the
    lines in the order the operator reads them; split into helpers, that order would be
    spread over them."""
    async with database.database(options) as conn:
        revision = await database.revision(conn, options.schema)
        if not as_json:
            output.print_facts(
                console,
                ("database", redact(options.database_url())),
                ("schema", options.schema),
                ("revision", f"{', '.join(revision.current) or '-'} ({revision.describe()})"),
                ("head", f"{revision.head} (this build)"),
            )
        database.refuse_unless_at_head(revision)
        oid = (await conn.execute(lock_st.schema_oid, {"schema": options.schema})).scalar_one()
        lock = (lock_st.LOCK_NS_LEADER, oid)
        facts = await queries.cluster_facts(conn, lock)
        epoch, max_id = (await conn.execute(catalog.leader_state)).one()
        counts = (await conn.execute(catalog.task_counts)).all()
        quarantined = (
            await conn.execute(catalog.quarantined_count, {"prefix": QUARANTINE_PREFIX})
        ).scalar_one()
        schedules = (await conn.execute(catalog.schedule_summaries)).all()

    # The store passes the OID as a signed int4; pg_locks shows it unsigned.
    keys = (lock_st.LOCK_NS_LEADER, oid & 0xFFFFFFFF)
    if as_json:
        output.emit_json(
            {
                "database": redact(options.database_url()),
                "schema": options.schema,
                "revision": list(revision.current),
                "head": revision.head,
                "epoch": epoch,
                "incarnation": facts.incarnation,
                "max_id": max_id,
                "lock": list(keys),
                "leader": output.holder_document(output.leader_of(facts.holder)),
                "lock_holder": output.holder_document(facts.holder),
                "quarantined": quarantined,
                "tasks": [
                    {
                        "pool": row.pool,
                        "state": "finished" if row.terminal else "live",
                        "status": row.status,
                        "count": row.n,
                    }
                    for row in counts
                ],
                "recurring": [
                    {
                        "name": row.name,
                        "schedule": output.describe_schedule(row.schedule),
                        "next_run": output.rfc3339(row.next_unix_ns),
                        "last_task_id": row.last_task_id,
                    }
                    for row in schedules
                ],
            }
        )
        return

    output.print_facts(
        console,
        ("epoch", f"{epoch}" + (" (no leader yet)" if epoch == 0 else "")),
        (
            "incarnation",
            f"{facts.incarnation} (the leader table's OID: another after a re-creation)",
        ),
        ("max id", output.task_id(max_id) if max_id else "0 (no task issued)"),
        *holder_facts(facts.holder, f"advisory lock ({keys[0]}, {keys[1]})"),
        ("quarantined", f"{quarantined:,} rows"),
    )
    if counts:
        output.print_table(
            console,
            "tasks by pool and status",
            ("pool", "state", "status", "count"),
            (
                (row.pool, "finished" if row.terminal else "live", row.status, f"{row.n:,}")
                for row in counts
            ),
            right=("count",),
        )
    else:
        console.print("no tasks")
    if schedules:
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
                for row in schedules
            ),
            wrap="schedule",
        )
    else:
        console.print("no recurring schedules")


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
        ("", f"session since {holder.since:%Y-%m-%d %H:%M:%S} UTC ({output.ago(holder.since)})"),
        ("", f"holds the {lock}"),
    ]
