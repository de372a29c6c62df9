"""The ``cronoq-store`` group: its global options (URL, schema, trusted triggers), which
every command receives as :class:`Options`.

The global options may come before the command or after it (``cronoq-store status --url
URL --schema a``), so a script can append them to any command line; the last one given
wins, then the environment (``$CRONOQ_DATABASE_URL``, ``$CRONOQ_SCHEMA``,
``$CRONOQ_LOCK_WAIT``), then ``public`` for the schema and :data:`LOCK_WAIT` for the wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from .._config import trusted_trigger_names, validate_schema_name
from .._terminal_safe import visible
from .._urls import URL_ENV
from .exits import EPILOG

__all__ = ["LOCK_WAIT", "LOCK_WAIT_ENV", "SCHEMA_ENV", "Options", "cli", "number_option"]

#: The environment variable that names the cluster's schema when ``--schema`` is not given.
SCHEMA_ENV = "CRONOQ_SCHEMA"
#: Seconds a command waits for a lock another session holds on the cluster's tables (a
#: migration holds them for its whole transaction) unless ``--lock-wait`` says otherwise;
#: past it the command exits 9, naming the holders. The same as a commit's default bound.
LOCK_WAIT = 30.0
#: The environment variable read for ``--lock-wait``: a monitoring probe with a deadline of
#: its own sets it once rather than on every command line.
LOCK_WAIT_ENV = "CRONOQ_LOCK_WAIT"
#: The group's options that may also follow the command.
_GLOBAL_OPTIONS = frozenset({"--url", "--schema", "--trusted-trigger", "--lock-wait"})


_Command = TypeVar("_Command", bound=Callable[..., Any])


def number_option(
    name: str, kind: click.IntRange | click.FloatRange, default: float, help: str
) -> Callable[[_Command], _Command]:
    """An option that takes a number within ``kind``'s range, its default shown in
    ``--help``."""
    return click.option(name, type=kind, default=default, show_default=True, help=help)


@dataclass(frozen=True, slots=True)
class Options:
    """The global options, as the commands get them (``@click.pass_obj``)."""

    url: str | None
    schema: str
    #: Triggers the operator allows on the cluster's tables (``PgStoreConfig.trusted_triggers``).
    trusted_triggers: frozenset[str] = frozenset()
    #: Whether the operator named the schema (option or environment), rather than the
    #: ``public`` default: only a defaulted schema is checked for clusters elsewhere.
    schema_chosen: bool = True
    #: Whether ``--schema`` was on the command line: it names one cluster, and a command
    #: over many (``--all``, ``--schemas``) refuses it rather than guess which was meant.
    schema_typed: bool = False
    #: Seconds each statement waits for a lock another session holds (``--lock-wait``).
    lock_wait: float = LOCK_WAIT

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


def hoist_global_options(args: Sequence[str]) -> list[str]:
    """``args`` with every global option (``--url``, ``--schema``, ``--trusted-trigger``,
    ``--lock-wait``, as ``--opt VALUE`` or ``--opt=VALUE``) moved before the command, in
    order, so that the group parses it wherever it was written; nothing after ``--``
    moves."""
    moved: list[str] = []
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == "--":
            rest.append(arg)
            rest.extend(items)
        elif arg in _GLOBAL_OPTIONS:
            moved.append(arg)
            value = next(items, None)
            if value is not None:
                moved.append(value)
        elif arg.split("=", 1)[0] in _GLOBAL_OPTIONS:
            moved.append(arg)
        else:
            rest.append(arg)
    return moved + rest


@contextmanager
def _visible_errors() -> Iterator[None]:
    """Click's errors quote what the operator typed: made safe for a terminal
    (:func:`~cronoq_store._terminal_safe.visible`) before click prints them."""
    try:
        yield
    except (_VisibleUsageError, _VisibleError):
        raise  # a nested command's, made safe already
    except click.UsageError as exc:
        raise _VisibleUsageError(visible(exc.format_message()), exc.ctx) from None
    except click.ClickException as exc:
        raise _VisibleError(visible(exc.format_message())) from None


class _VisibleUsageError(click.UsageError):
    """A usage error whose text went through ``visible`` once already."""


class _VisibleError(click.ClickException):
    """Any other click error whose text went through ``visible`` once already."""


class _Group(click.Group):
    """The group: global options parsed after the command as well as before it, and every
    usage error printed through the terminal-safe rule."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(args))

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        with _visible_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _visible_errors():
            return super().invoke(ctx)


@click.group(
    cls=_Group,
    epilog=EPILOG,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--url",
    envvar=URL_ENV,
    show_envvar=True,
    metavar="URL",
    help="Database URL, postgresql://user:password@host/db (the password is never printed); "
    "may also follow the command.",
)
@click.option(
    "--schema",
    envvar=SCHEMA_ENV,
    show_envvar=True,
    default="public",
    show_default=True,
    callback=_check_schema,
    help="The cluster's schema; may also follow the command. Without it (and without "
    f"${SCHEMA_ENV}), a database whose clusters are all in other schemas is a usage error "
    "that names them.",
)
@click.option(
    "--trusted-trigger",
    "trusted_triggers",
    multiple=True,
    metavar="NAME",
    callback=_check_triggers,
    help="A trigger allowed on the cluster's tables, such as an audit (repeatable); it must "
    "have no WHEN clause and run a trusted role's function. May also follow the command.",
)
@click.option(
    "--lock-wait",
    envvar=LOCK_WAIT_ENV,
    show_envvar=True,
    type=click.FloatRange(min=0, min_open=True),
    default=LOCK_WAIT,
    show_default=True,
    metavar="SECONDS",
    help="Seconds a statement waits for a lock another session holds on the cluster's "
    "tables, then exit 9 naming the holders (migrate's and downgrade's migration waits "
    "--lock-timeout instead). May also follow the command.",
)
@click.version_option(package_name="cronoq-store")
@click.pass_context
def cli(
    ctx: click.Context,
    url: str | None,
    schema: str,
    trusted_triggers: frozenset[str],
    lock_wait: float,
) -> None:
    """Migrate, inspect and prune the PostgreSQL schema of a cronoq scheduler cluster."""
    source = ctx.get_parameter_source("schema")
    ctx.obj = Options(
        url=url,
        schema=schema,
        trusted_triggers=trusted_triggers,
        schema_chosen=source is not ParameterSource.DEFAULT,
        schema_typed=source is ParameterSource.COMMANDLINE,
        lock_wait=lock_wait,
    )
