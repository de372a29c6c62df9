"""``cronoq-store handover``: move store leadership to another instance without moving the
primary, by ending the leader lock holder's session (``pg_terminate_backend``: the role needs
``pg_signal_backend``, or to be the holder's role or a superuser). The deposed instance steps
down (its lock session is gone, and any commit it still sends is fenced) and waits before it
competes again (``cronoq_store._leadership.cool_down``), so a waiting standby takes the lock
and bumps the epoch. This command waits for that, up to ``--timeout``, and tells instances
apart by the instance id their lock sessions show, never by pid: exit 0 only when another
instance leads, 8 when the one it removed leads again, 6 when none took the lock."""

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
    help="Seconds to wait for another instance to lead.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead of text."
)
@click.pass_obj
def handover(options: Options, yes: bool, timeout: float, as_json: bool) -> None:
    """End the leader's lock session and wait until another instance leads: exit 0 only
    then, 8 if the same instance leads again, 6 if none does within --timeout."""
    code = run(options.url, _handover(options, yes, timeout, as_json, output.console()))
    if code is not ExitCode.OK:
        raise click.exceptions.Exit(int(code))


async def _handover(
    options: Options, yes: bool, timeout: float, as_json: bool, console: Console
) -> ExitCode:
    async with database.database(options) as conn:
        await database.require_head(conn, options.schema)
        lock = await operations.leader_lock(conn, options.schema)
        before = await operations.fresh_facts(conn, lock)
        holder = before.holder
        if holder is None:
            raise CliError(
                "no instance holds the leader lock: nothing to hand over", ExitCode.NO_LEADER
            )
        if not as_json:
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
            # On stderr with --json: stdout holds the document alone.
            asked = f"End session pid {holder.pid} so that another instance leads?"
            if not click.confirm(asked, err=as_json):
                raise CliError("handover cancelled", ExitCode.FAILED)
        await operations.end_leader_session(conn, lock, holder.pid)
        if not as_json:
            who = "" if holder.instance is None else f" (instance {holder.instance})"
            console.print(
                f"ended session pid {holder.pid}{who}; waiting up to {timeout:g} s for "
                "another instance to lead"
            )
        result = await operations.wait_for_new_leader(conn, lock, before, holder, timeout)
    if as_json:
        output.emit_json(operations.handover_document(options.schema, result))
        return result.code
    result.check()
    console.print(result.message())
    return result.code
