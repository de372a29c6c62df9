"""``cronoq-store handover``: move store leadership to a standby instance without moving the
primary, by ending the leader lock holder's session (``pg_terminate_backend``: the role needs
``pg_signal_backend``, or to be the holder's role or a superuser). The deposed instance steps
down (its lock session is gone, and any commit it still sends is fenced); a standby takes the
lock and bumps the epoch, which this command waits for, up to ``--timeout``."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from . import database, operations, output
from .app import Options
from .exits import CliError, ExitCode, run
from .status import holder_facts

__all__ = ["handover"]


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
        lock = await operations.leader_lock(conn, options.schema)
        before = await operations.fresh_facts(conn, lock)
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
        await operations.end_leader_session(conn, lock, holder.pid)
        console.print(f"ended session pid {holder.pid}; waiting up to {timeout:g} s for a standby")
        after = await operations.wait_for_new_leader(conn, lock, before, holder, timeout)
    new = after.holder
    assert new is not None
    console.print(
        f"new leader: pid {new.pid} ({new.application_name or 'details hidden'}), "
        f"epoch {after.stored_epoch}"
    )
