"""``cronoq-store console``: every cluster of the database in the browser, read-only
(:mod:`cronoq_store._console`; the ``console`` extra).

It binds 127.0.0.1 unless told otherwise; any other address needs credentials from the
environment (``$CRONOQ_CONSOLE_TOKEN``, or ``$CRONOQ_CONSOLE_USER`` and
``$CRONOQ_CONSOLE_PASSWORD``), and with them every request must carry them.
"""

from __future__ import annotations

import click

from .._urls import redact
from . import hosted
from .app import Options, number_option
from .exits import CliError, ExitCode

__all__ = ["console"]


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@number_option("--port", click.IntRange(0, 65535), 8040, "Port to bind.")
@number_option("--refresh", click.IntRange(1, 3600), 5, "Seconds between the pages' refreshes.")
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Offer a handover and a prune on the cluster pages (needs credentials in the "
    "environment, even on loopback).",
)
@hosted.control_schema_option
@click.pass_obj
def console(
    options: Options,
    host: str,
    port: int,
    refresh: int,
    allow_actions: bool,
    control_schema: str,
) -> None:
    """Serve the operator's console: every cluster schema of the database, live.

    Binding anything but loopback needs $CRONOQ_CONSOLE_TOKEN, or $CRONOQ_CONSOLE_USER and
    $CRONOQ_CONSOLE_PASSWORD (never options: the command line is visible to every user)."""
    try:
        import uvicorn

        from .._console.app import console_app
        from .._console.security import TOKEN_ENV, credentials_from, is_loopback
    except ImportError as exc:
        raise CliError(
            f"the console needs the console extra ({exc.name} is missing): "
            "pip install 'cronoq-store[console]'",
            ExitCode.USAGE,
        ) from None
    url = options.database_url()
    try:
        credentials = credentials_from()
    except ValueError as exc:
        CliError(str(exc), ExitCode.USAGE).exit(url)
    if credentials is None and not is_loopback(host):
        CliError(
            f"refusing to serve {host} without authentication: set ${TOKEN_ENV} (or a user "
            "and password in the environment), or bind 127.0.0.1",
            ExitCode.USAGE,
        ).exit(url)
    if allow_actions and credentials is None:
        CliError(
            f"refusing --allow-actions without authentication: set ${TOKEN_ENV} (or a user "
            "and password in the environment); every local user can reach loopback",
            ExitCode.USAGE,
        ).exit(url)
    app = console_app(
        url,
        credentials,
        options.trusted_triggers,
        refresh_seconds=refresh,
        allow_actions=allow_actions,
        control_schema=control_schema,
    )
    shown = f"[{host}]" if ":" in host else host
    click.echo(
        f"console of {redact(url)} at http://{shown}:{port}/ "
        f"({'authentication required' if credentials else 'loopback only, no authentication'}"
        f"{', actions allowed' if allow_actions else ', read-only'})",
        err=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="info", server_header=False)
