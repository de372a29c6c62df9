"""What a failure looks like to the operator: one line on stderr, password masked, what it
quotes made safe for a terminal (:func:`cronoq_store._terminal_safe.visible`), and an exit
code a script can act on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from enum import IntEnum
from typing import Any, NoReturn, TypeVar

import click

from .. import _door as door
from .._errors import LockHeldError, StoreError
from .._terminal_safe import visible
from .._urls import scrub

__all__ = ["EPILOG", "CliError", "ExitCode", "run"]

_T = TypeVar("_T")


class ExitCode(IntEnum):
    """What a script can tell from the exit status; listed in ``--help``."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NOT_MIGRATED = 4
    NEWER_DATABASE = 5
    NO_LEADER = 6
    FOREIGN_HOLDER = 7
    NOT_HANDED_OVER = 8
    LOCK_HELD = 9
    AMBIGUOUS = 10


#: The exit codes, as ``--help`` lists them.
EPILOG = f"""\b
Exit codes:
  {ExitCode.OK:d}  success
  {ExitCode.FAILED:d}  the operation failed (task not found, migration refused, demo lost data)
  {ExitCode.USAGE:d}  usage error
  {ExitCode.UNREACHABLE:d}  cannot connect: wrong URL, host, password or database, or the
     server is unavailable
  {ExitCode.NOT_MIGRATED:d}  the schema is missing or not migrated to this build's head
     (run `cronoq-store migrate`)
  {ExitCode.NEWER_DATABASE:d}  the schema was migrated by a newer cronoq-store: upgrade it
  {ExitCode.NO_LEADER:d}  (health, handover) no instance holds the leader lock; (handover)
     none took it within --timeout
  {ExitCode.FOREIGN_HOLDER:d}  (health) a session that is not a store instance holds the
     leader lock: no instance can lead until it lets go
  {ExitCode.NOT_HANDED_OVER:d}  (handover) the instance whose session it ended leads again,
     or the new leader shows no instance id to tell
  {ExitCode.LOCK_HELD:d}  a lock the command needs stayed held by another session past its
     bound (migrate, downgrade: --lock-timeout; others: 30 s); the holders are named
  {ExitCode.AMBIGUOUS:d}  (tasks show) a bare number names tasks of several epochs: they
     are listed; give EPOCH/N
"""


class CliError(Exception):
    """A failure to report as one line (``Error: ...``) and exit with ``code``."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code

    def exit(self, url: str | None) -> NoReturn:
        """Print the message, the URL's password masked, and leave with the exit code."""
        click.echo(f"Error: {visible(scrub(str(self), [url]))}", err=True)
        raise click.exceptions.Exit(int(self.code))


def run(url: str | None, work: Coroutine[Any, Any, _T]) -> _T:
    """Run a command's coroutine; every failure leaves as one line, ``url`` masked in it,
    with its exit code."""
    try:
        with door.translated("the command", passing=(click.ClickException, CliError)):
            return asyncio.run(work)
    except click.ClickException:
        raise  # usage errors: click prints them and exits with 2
    except CliError as exc:
        exc.exit(url)
    except StoreError as error:
        code = ExitCode.UNREACHABLE if error.is_transient else ExitCode.FAILED
        if isinstance(error, LockHeldError):
            code = ExitCode.LOCK_HELD
        CliError(str(error), code).exit(url)
