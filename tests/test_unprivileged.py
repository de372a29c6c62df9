"""The harness starts PostgreSQL, Patroni and PgBouncer as ``embedded_postgres`` when it runs as
root; on a fresh machine what they run lives under root's home at mode 700, reached through
symlinks (a venv's ``bin/python``). These tests build that shape in a scratch directory and
check that the user then reaches the program, and nothing more: every directory on the way
is traversable, none becomes listable."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cronoq_store.testing._unprivileged import (
    SYSTEM_USER,
    check_runs_as_system_user,
    open_for_traversal,
    run_as,
    system_user_entry,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="only root starts servers as another user"
)


@pytest.fixture
def closed_home() -> Iterator[Path]:
    """``home`` (mode 700) holds the real program; ``venv/bin/python`` links to it."""
    system_user_entry()
    top = Path(tempfile.mkdtemp(prefix="cronoq-unpriv-"))  # mode 700, as mkdtemp makes it
    try:
        real = top / "home" / "pyenv" / "bin"
        real.mkdir(parents=True)
        (top / "home").chmod(0o700)
        program = real / "python3.11"
        program.write_text("#!/bin/sh\necho reached\n")
        program.chmod(0o755)
        venv = top / "venv" / "bin"
        venv.mkdir(parents=True)
        (top / "venv").chmod(0o700)
        (venv / "python").symlink_to(program)
        yield top
    finally:
        shutil.rmtree(top)


def _as_user(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=False, **run_as())


def test_the_user_reaches_a_program_behind_a_symlink_into_a_closed_home(closed_home: Path) -> None:
    link = closed_home / "venv" / "bin" / "python"
    with pytest.raises(PermissionError):
        _as_user(str(link))

    open_for_traversal(link)

    assert _as_user(str(link)).stdout == "reached\n"
    check_runs_as_system_user([str(link)])


def test_directories_on_the_way_gain_traversal_and_nothing_else(closed_home: Path) -> None:
    link = closed_home / "venv" / "bin" / "python"
    on_the_way = [closed_home, closed_home / "home", closed_home / "venv"]
    before = {d: stat.S_IMODE(d.stat().st_mode) for d in on_the_way}

    open_for_traversal(link)

    for directory, mode in before.items():
        assert stat.S_IMODE(directory.stat().st_mode) == mode | stat.S_IXOTH
        listing = _as_user("ls", str(directory))
        assert listing.returncode != 0, f"{SYSTEM_USER} can list {directory}"


def test_the_child_has_the_users_group_not_roots(closed_home: Path) -> None:
    """``Popen(user=)`` alone keeps gid 0: the group bits of root's directories would apply."""
    entry = system_user_entry()
    ids = _as_user("id", "-G").stdout.split()
    assert ids == [str(entry.pw_gid)]


def test_a_file_others_cannot_read_is_named_not_widened(closed_home: Path) -> None:
    secret = closed_home / "home" / "pyenv" / "bin" / "python3.11"
    secret.chmod(0o700)
    refusal = r"pyenv/bin/python3\.11 is not readable by other users"
    with pytest.raises(PermissionError, match=refusal):
        open_for_traversal(closed_home / "venv" / "bin" / "python")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o700
