"""``cronoq-store health``: a probe for orchestrators. Exit 0 only when the schema is at this
build's head and some instance holds the leader lock; otherwise the exit code says which
(5 newer database, 4 not at head, 7 the lock held by a session that is not a store
instance, 6 no leader) and each reason is one line."""

from __future__ import annotations

import click
from rich.console import Console

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._domain import LockHolder as LockHolder
from .._migrations import RevisionStatus as RevisionStatus
from .._queries import ClusterFacts as ClusterFacts
from . import database, output
from .app import Options
from .exits import ExitCode, run

__all__ = ["health"]


@click.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document (keys in docs/operations.md)."
)
@click.pass_obj
def health(options: Options, as_json: bool) -> None:
    """Exit 0 if the schema is at this build's head and an instance leads, else 4, 5, 6 or 7."""
    code = run(options.url, _health(options, as_json, output.console()))
    if code is not ExitCode.OK:
        raise click.exceptions.Exit(int(code))


async def _health(options: Options, as_json: bool, console: Console) -> ExitCode:
    facts: ClusterFacts | None = None
    holder: LockHolder | None = None
    async with database.database(options) as conn:
        public = bool((await conn.execute(catalog.public_may_connect)).scalar())
        revision = await database.revision(conn, options.schema)
        if revision.exists:
            oid = (await conn.execute(lock_st.schema_oid, {"schema": options.schema})).scalar_one()
            lock = (lock_st.LOCK_NS_LEADER, oid)
            if revision.current:
                # Migrated at some revision: the leader row and the lock are there to read.
                facts = await queries.cluster_facts(conn, lock)
                holder = facts.holder
            else:
                # No leader row, but a leader may still hold the lock (its tables were
                # dropped under it): say so rather than "no instance holds the lock".
                holder = await queries.leader_lock_holder(conn, lock)
    code, reasons = _verdict(revision, facts, holder)
    warnings = [_PUBLIC_CONNECT] if public else []
    if as_json:
        output.emit_json(
            {
                "healthy": code is ExitCode.OK,
                "schema": options.schema,
                "revision": list(revision.current),
                "head": revision.head,
                "at_head": revision.at_head,
                "stored_epoch": None if facts is None else facts.stored_epoch,
                "leader": output.holder_document(output.leader_of(holder)),
                "lock_holder": output.holder_document(holder),
                "reasons": reasons,
                "warnings": warnings,
            }
        )
        return code
    if holder is not None and facts is not None and code is ExitCode.OK:
        console.print(
            f"healthy: schema {options.schema} at {revision.head}, leader pid {holder.pid} "
            f"({holder.application_name or 'details hidden'}), epoch {facts.stored_epoch}"
        )
    else:
        for reason in reasons:
            console.print(f"unhealthy: {reason}")
    for warning in warnings:
        console.print(f"warning: {warning}")
    return code


#: Why a database where PUBLIC may connect is worth a line (docs/reliability.md).
_PUBLIC_CONNECT = (
    "every role may connect to this database (CONNECT is granted to PUBLIC), so any of them "
    "can hold the leader lock: instances refuse to lead here unless allow_untrusted_connect; "
    "run REVOKE CONNECT ON DATABASE ... FROM PUBLIC"
)


def _verdict(
    revision: RevisionStatus, facts: ClusterFacts | None, holder: LockHolder | None
) -> tuple[ExitCode, list[str]]:
    """The exit code (the gravest reason's) and every reason, in words."""
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
            f"pid {holder.pid} ({holder.application_name or 'details hidden'}) holds the "
            f"leader lock, but schema {revision.schema} is not migrated: it cannot lead it"
        )
    elif not holder.store_instance:
        codes.append(ExitCode.FOREIGN_HOLDER)
        reasons.append(output.describe_foreign(holder))
    return (codes[0] if codes else ExitCode.OK), reasons
