"""The ``cronoq-store`` group: its global options (URL, schema, trusted triggers), which
every command receives as :class:`Options`."""

from __future__ import annotations

from dataclasses import dataclass

import click

from ..config import trusted_trigger_names
from ..schema import validate_schema_name
from ..urls import URL_ENV
from .exits import EPILOG

__all__ = ["Options", "cli"]


@dataclass(frozen=True, slots=True)
class Options:
    """The global options, as the commands get them (``@click.pass_obj``)."""

    url: str | None
    schema: str
    #: Triggers the operator allows on the cluster's tables (``PgStoreConfig.trusted_triggers``).
    trusted_triggers: frozenset[str] = frozenset()

    def database_url(self) -> str:
        if self.url is None:
            raise click.UsageError(f"no database URL: pass --url or set ${URL_ENV}")
        return self.url


def _check_schema(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return validate_schema_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_triggers(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> frozenset[str]:
    try:
        return trusted_trigger_names(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--url",
    envvar=URL_ENV,
    show_envvar=True,
    metavar="URL",
    help="Database URL, postgresql://user:password@host/db (the password is never printed).",
)
@click.option(
    "--schema",
    default="public",
    show_default=True,
    callback=_check_schema,
    help="The cluster's schema.",
)
@click.option(
    "--trusted-trigger",
    "trusted_triggers",
    multiple=True,
    metavar="NAME",
    callback=_check_triggers,
    help="A trigger allowed on the cluster's tables, such as an audit (repeatable); it must "
    "have no WHEN clause and run a trusted role's function.",
)
@click.version_option(package_name="cronoq-store")
@click.pass_context
def cli(ctx: click.Context, url: str | None, schema: str, trusted_triggers: frozenset[str]) -> None:
    """Migrate, inspect and prune the PostgreSQL schema of a cronoq scheduler cluster."""
    ctx.obj = Options(url=url, schema=schema, trusted_triggers=trusted_triggers)
