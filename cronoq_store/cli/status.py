"""``cronoq-store status``: the revision, the leader and its lock, task counts, quarantined
rows and recurring schedules, in one look."""

from __future__ import annotations

from datetime import timezone

import click
from rich.console import Console
from rich.table import Table

from .. import statements as st
from ..codec import QUARANTINE_PREFIX
from ..urls import redact
from . import database, output
from .app import Options
from .exits import run

__all__ = ["status"]


@click.command()
@click.pass_obj
def status(options: Options) -> None:
    """Revision, leader, lock holder, task counts, quarantined rows and recurring schedules."""
    run(options.url, _status(options, output.console()))


async def _status(options: Options, console: Console) -> None:
    async with database.database(options) as conn:
        revision = await database.revision(conn, options.schema)
        output.print_facts(
            console,
            ("database", redact(options.database_url())),
            ("schema", options.schema),
            ("revision", f"{', '.join(revision.current) or '-'} ({revision.describe()})"),
            ("head", f"{revision.head} (this build)"),
        )
        database.refuse_unless_at_head(revision)
        oid = (await conn.execute(st.schema_oid, {"schema": options.schema})).scalar_one()
        epoch, max_id = (await conn.execute(st.leader_state)).one()
        # The store passes the OID as a signed int4; pg_locks shows it unsigned.
        keys = {"k1": st.LOCK_NS_LEADER, "k2": oid & 0xFFFFFFFF}
        holder = (await conn.execute(st.leader_lock_holder, keys)).first()
        counts = (await conn.execute(st.task_counts)).all()
        quarantined = (
            await conn.execute(st.quarantined_count, {"prefix": QUARANTINE_PREFIX})
        ).scalar_one()
        schedules = (await conn.execute(st.schedule_summaries)).all()

    lock = f"advisory lock ({keys['k1']}, {keys['k2']})"
    if holder is None:
        leader_facts = [("leader", f"none: no session holds the {lock}")]
    elif holder.backend_start is None:
        # Another role's session, and this one may not see its details.
        leader_facts = [
            ("leader", f"pid {holder.pid} (details hidden: grant this role pg_read_all_stats)"),
            ("", f"holds the {lock}"),
        ]
    else:
        since = holder.backend_start.astimezone(timezone.utc)
        leader_facts = [
            (
                "leader",
                f"pid {holder.pid}, {holder.application_name or '(no application_name)'!r}, "
                f"from {holder.client_addr or 'a local socket'}",
            ),
            ("", f"session since {since:%Y-%m-%d %H:%M:%S} UTC ({output.ago(since)})"),
            ("", f"holds the {lock}"),
        ]
    output.print_facts(
        console,
        ("epoch", f"{epoch}" + (" (no leader yet)" if epoch == 0 else "")),
        ("max id", output.task_id(max_id) if max_id else "0 (no task issued)"),
        *leader_facts,
        ("quarantined", f"{quarantined:,} rows"),
    )

    counts_table = Table(title="tasks by pool and status", title_justify="left")
    for name in ("pool", "state", "status"):
        counts_table.add_column(name)
    counts_table.add_column("count", justify="right")
    for row in counts:
        counts_table.add_row(
            row.pool, "finished" if row.terminal else "live", row.status, f"{row.n:,}"
        )
    if counts:
        console.print(counts_table)
    else:
        console.print("no tasks")

    if schedules:
        recurring_table = Table(title="recurring schedules", title_justify="left")
        for name in ("name", "schedule", "next run", "last task"):
            recurring_table.add_column(name)
        for row in schedules:
            recurring_table.add_row(
                row.name,
                output.describe_schedule(row.schedule),
                "-" if row.next_unix_ns is None else output.utc(row.next_unix_ns),
                "-" if row.last_task_id is None else str(row.last_task_id),
            )
        console.print(recurring_table)
    else:
        console.print("no recurring schedules")
