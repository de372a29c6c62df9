"""``cronoq-store handover``: move store leadership to a standby instance without moving the
primary, by ending the leader lock holder's session (``pg_terminate_backend``: the role needs
``pg_signal_backend``, or to be the holder's role or a superuser). The deposed instance steps
down (its lock session is gone, and any commit it still sends is fenced); a standby takes the
lock and bumps the epoch, which this command waits for, up to ``--timeout``."""

from __future__ import annotations

import asyncio
import sys
import time

import click
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._domain import LockHolder as LockHolder
from .._queries import ClusterFacts as ClusterFacts
from . import database, output
from .app import Options
from .exits import CliError, ExitCode, run
from .status import holder_facts

__all__ = ["handover"]

#: How often the command looks for the new leader while it waits.
_POLL = 0.1


@click.command()
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (needed without a tty).")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds to wait for a standby to lead.",
)
@click.pass_obj
def handover(options: Options, yes: bool, timeout: float) -> None:
    """End the leader's lock session and wait until a standby leads; print the new epoch."""
    run(options.url, _handover(options, yes, timeout, output.console()))


async def _handover(options: Options, yes: bool, timeout: float, console: Console) -> None:
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        oid = (await conn.execute(lock_st.schema_oid, {"schema": options.schema})).scalar_one()
        lock = (lock_st.LOCK_NS_LEADER, oid)
        before = await _facts(conn, lock)
        holder = before.holder
        if holder is None:
            raise CliError(
                "no instance holds the leader lock: nothing to hand over", ExitCode.NO_LEADER
            )
        output.print_facts(
            console,
            ("epoch", str(before.stored_epoch)),
            *holder_facts(holder, f"advisory lock ({lock[0]}, {lock[1] & 0xFFFFFFFF})"),
        )
        if not yes:
            if not sys.stdin.isatty():
                raise CliError(
                    "refusing to end the leader's session without confirmation: no terminal "
                    "to ask on; pass --yes",
                    ExitCode.USAGE,
                )
            if not click.confirm(f"End session pid {holder.pid} so that a standby leads?"):
                raise CliError("handover cancelled", ExitCode.FAILED)
        current = (await _facts(conn, lock)).holder
        if current is None or current.pid != holder.pid:
            raise CliError("the leader lock changed hands meanwhile: look again", ExitCode.FAILED)
        ended = (await conn.execute(catalog.terminate_backend, {"pid": holder.pid})).scalar()
        await conn.rollback()
        if not ended:
            raise CliError(f"session pid {holder.pid} could not be ended", ExitCode.FAILED)
        console.print(f"ended session pid {holder.pid}; waiting up to {timeout:g} s for a standby")
        after = await _new_leader(conn, lock, before, holder, timeout)
    new = after.holder
    assert new is not None
    console.print(
        f"new leader: pid {new.pid} ({new.application_name or 'details hidden'}), "
        f"epoch {after.stored_epoch}"
    )


async def _facts(conn: AsyncConnection, lock: tuple[int, int]) -> ClusterFacts:
    facts = await queries.cluster_facts(conn, lock)
    # pg_stat_activity is read once per transaction: end it so the next look is fresh.
    await conn.rollback()
    return facts


async def _new_leader(
    conn: AsyncConnection,
    lock: tuple[int, int],
    before: ClusterFacts,
    old: LockHolder,
    timeout: float,
) -> ClusterFacts:
    """Once another session holds the lock and the epoch moved (a leader bumps it after
    taking the lock), the facts; exit 6 if that does not happen within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        facts = await _facts(conn, lock)
        holder = facts.holder
        moved = facts.stored_epoch != before.stored_epoch
        if holder is not None and holder.pid != old.pid and moved:
            return facts
        if time.monotonic() >= deadline:
            raise CliError(
                f"no standby leads after {timeout:g} s (epoch {facts.stored_epoch}): is one "
                "running?",
                ExitCode.NO_LEADER,
            )
        await asyncio.sleep(_POLL)
