"""``cronoq-store dev-server``: a throwaway PostgreSQL to try every command on.

It runs :class:`~cronoq_store.testing.EmbeddedPostgres` (the ``embedded`` extra) until
Ctrl-C or SIGTERM, then removes it, data and all. The URL it prints is the server's unix
socket, where the superuser needs no password: nothing secret is printed, and the TCP port
(password-protected, loopback only) is not needed.
"""

from __future__ import annotations

import shlex
import signal
import threading
from types import FrameType

import click

from .._urls import URL_ENV
from .exits import CliError, ExitCode

__all__ = ["dev_server"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: The cluster schema the hint names: the one every example of the docs uses.
EXAMPLE_SCHEMA = "cluster_a"


@click.command("dev-server")
def dev_server() -> None:
    """Run a throwaway PostgreSQL and print its URL; Ctrl-C (or SIGTERM) stops it and deletes
    everything it stored. Needs cronoq-store[embedded]."""
    from ..testing._server import EmbeddedPostgres

    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    # Installed before the server starts: a signal while it starts still removes it.
    previous = {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS}
    try:
        try:
            server = EmbeddedPostgres()
        except RuntimeError as exc:  # no binaries: the extra is missing
            CliError(str(exc), ExitCode.FAILED).exit(None)
        try:
            if not stopping.is_set():
                server.start()
                url = server.socket_url().render_as_string(hide_password=False)
                click.echo(f"PostgreSQL running in {server.base_dir} until Ctrl-C, then removed")
                click.echo(f"URL: {url}")
                click.echo(f"export {URL_ENV}={shlex.quote(url)}")
                click.echo(
                    f"then: cronoq-store --schema {EXAMPLE_SCHEMA} migrate && "
                    f"cronoq-store --schema {EXAMPLE_SCHEMA} status"
                )
            while not stopping.wait(1.0):
                pass
        except RuntimeError as exc:  # initdb or pg_ctl failed: their output says why
            CliError(str(exc), ExitCode.FAILED).exit(None)
        finally:
            server.destroy()
        click.echo("PostgreSQL stopped and removed", err=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
