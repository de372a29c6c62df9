"""What a failure looks like to the operator: one line on stderr, password masked, what it
quotes made safe for a terminal (:func:`cronoq_store._terminal_safe.visible`), and an exit
code a script can act on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Coroutine, Iterable
from enum import IntEnum
from typing import Any, NoReturn, TypeVar

import click

from .. import _door as door
from .._errors import LockHeldError, StoreError
from .._terminal_safe import visible
from .._urls import scrub

__all__ = [
    "EPILOG",
    "SEVERITY",
    "CliError",
    "ExitCode",
    "code_of",
    "run",
    "silence_stdout",
    "worst",
]

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
    NO_MATCH = 11


#: The exit codes from the gravest down: a command over many clusters (``--all``,
#: ``--schemas``) exits with the first of these that any cluster gave. The numbers are not
#: an order (4, behind head, is ordinary during a rolling upgrade; 7 needs an operator now).
#: First what could not be read at all or was refused, then what no build of this version
#: can fix, then what stops leading, then what a wait or a migration clears.
SEVERITY: tuple[ExitCode, ...] = (
    ExitCode.UNREACHABLE,
    ExitCode.FAILED,
    ExitCode.NEWER_DATABASE,
    ExitCode.FOREIGN_HOLDER,
    ExitCode.NO_LEADER,
    ExitCode.NOT_HANDED_OVER,
    ExitCode.LOCK_HELD,
    ExitCode.NOT_MIGRATED,
    ExitCode.AMBIGUOUS,
    ExitCode.NO_MATCH,
    ExitCode.USAGE,
    ExitCode.OK,
)


def worst(codes: Iterable[ExitCode]) -> ExitCode:
    """The gravest of ``codes`` by :data:`SEVERITY`; ``OK`` when there are none."""
    return min(codes, key=SEVERITY.index, default=ExitCode.OK)


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
     bound (migrate, downgrade: --lock-timeout; others: --lock-wait, 30 s); the holders are named
  {ExitCode.AMBIGUOUS:d}  (tasks show) a bare number names tasks of several epochs: they
     are listed; give EPOCH/N
  {ExitCode.NO_MATCH:d}  (--all, --schemas) no schema of the database holds a cluster, or
     none matching the pattern

Over many clusters (--all, --schemas) the exit code is the gravest any cluster gave, in
this order: {" ".join(str(int(code)) for code in SEVERITY)}. An interrupted migrate exits
128 + the signal's number (130 for SIGINT, 143 for SIGTERM). A closed standard output
(`| head -1`) exits 1.
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
        with door.translated(
            "the command", passing=(click.ClickException, CliError, BrokenPipeError)
        ):
            return asyncio.run(work)
    except click.ClickException:
        raise  # usage errors: click prints them and exits with 2
    except BrokenPipeError:
        # The reader went away (`| head -1`): the server is not unreachable (3), and the
        # output was not all delivered (1).
        silence_stdout()
        CliError("standard output closed before the command ended", ExitCode.FAILED).exit(url)
    except CliError as exc:
        exc.exit(url)
    except StoreError as error:
        CliError(str(error), code_of(error)).exit(url)


def silence_stdout() -> None:
    """Point standard output at the null device once its reader has gone: what is still
    buffered, and any later line, then goes nowhere instead of failing again at exit
    (Python's advice for ``BrokenPipeError``). Not where there is no descriptor (a test's
    runner)."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)


def code_of(error: StoreError) -> ExitCode:
    """The exit code of a store error a command did not expect: 9 for a lock held past its
    bound, 3 for a transient failure (the server unavailable), else 1."""
    if isinstance(error, LockHeldError):
        return ExitCode.LOCK_HELD
    return ExitCode.UNREACHABLE if error.is_transient else ExitCode.FAILED
