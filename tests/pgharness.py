"""The suite's PostgreSQL: whichever real server is at hand, and the means to hurt it.

Chosen once per session: ``$CRONOQ_TEST_DATABASE_URL`` if set; else a testcontainers
container when a Docker engine answers; else an embedded server in a temporary directory
(:class:`cronoq_store.testing.EmbeddedPostgres`, the server applications' tests get from
the ``cronoq_store.testing`` pytest plugin).
Fault tests stop, start and restart the server and terminate backends; a server the suite
does not own (an external URL) cannot be stopped, so those tests say so and skip.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import asyncpg
import pytest
from sqlalchemy.engine import URL, make_url

from cronoq_store.testing import TEST_URL_ENV, EmbeddedPostgres, StopMode


class ServerUnderTest(Protocol):
    """What the fixtures and fault tests need of a server."""

    kind: str

    @property
    def url(self) -> URL: ...

    def stop(self, mode: StopMode = "fast") -> None: ...

    def start(self) -> None: ...

    def close(self) -> None: ...


def restart(server: ServerUnderTest, mode: StopMode = "fast") -> None:
    """Stop the server (``immediate`` is a crash as clients see it) and start it again."""
    server.stop(mode)
    server.start()


class ExternalServer:
    kind = "external"

    def __init__(self, url: str) -> None:
        self._url = make_url(url)

    @property
    def url(self) -> URL:
        return self._url

    def stop(self, mode: StopMode = "fast") -> None:
        pytest.skip(f"stopping the server needs one the suite owns (unset {TEST_URL_ENV})")

    def start(self) -> None:
        pytest.skip(f"starting the server needs one the suite owns (unset {TEST_URL_ENV})")

    def close(self) -> None:
        pass


class EmbeddedServer:
    kind = "embedded"

    def __init__(self) -> None:
        self.server = EmbeddedPostgres().start()
        self._forget_sigterm = _destroy_on_sigterm(self.server)

    @property
    def url(self) -> URL:
        return self.server.url()

    def stop(self, mode: StopMode = "fast") -> None:
        self.server.stop(mode)

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self._forget_sigterm()
        self.server.destroy()


def _destroy_on_sigterm(server: EmbeddedPostgres) -> Callable[[], None]:
    """Destroy ``server`` if this process gets SIGTERM (a cancelled CI job, a timeout).

    Python dies of SIGTERM without running finalizers or ``atexit``, and the server is a
    process of its own: it would live on, holding its port and directory. The handler
    destroys it, then lets the signal do what it did before (by default, end the process
    with it). Returns what puts the previous handler back. Nothing is installed outside
    the main thread (only it may set handlers) or where SIGTERM is ignored.
    """
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        server.destroy()
        restore()
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    return restore


class ContainerServer:
    kind = "testcontainers"

    def __init__(self) -> None:
        from testcontainers.postgres import PostgresContainer

        self.container: Any = PostgresContainer("postgres:18", driver=None).start()
        # As the store requires of its database (and EmbeddedPostgres does): only roles
        # granted CONNECT may connect.
        database = self.url.database or "postgres"
        asyncio.run(admin_execute(self.url, f'REVOKE CONNECT ON DATABASE "{database}" FROM PUBLIC'))

    @property
    def url(self) -> URL:
        return make_url(self.container.get_connection_url())

    def stop(self, mode: StopMode = "fast") -> None:
        # `docker kill` is the container's crash; `docker stop` its clean shutdown.
        wrapped = self.container.get_wrapped_container()
        if mode == "immediate":
            wrapped.kill()
        else:
            wrapped.stop()

    def start(self) -> None:
        self.container.get_wrapped_container().start()
        self.container._connect()

    def close(self) -> None:
        self.container.stop()


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def start_test_server() -> ServerUnderTest:
    url = os.environ.get(TEST_URL_ENV)
    if url:
        return ExternalServer(url)
    if _docker_answers():
        return ContainerServer()
    return EmbeddedServer()


def asyncpg_dsn(url: URL) -> str:
    """The URL as a plain DSN that asyncpg itself accepts (for raw admin sessions)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


async def admin_execute(url: URL, sql: str, *args: object) -> list[asyncpg.Record]:
    """Run one statement on a fresh raw session (never from a pool under test)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


#: A store's lock session is named ``"<application_name> leader <instance id>"``: this is
#: ``pg_stat_activity.application_name`` without the id, to match the name a test knows.
WITHOUT_INSTANCE = "regexp_replace(application_name, ' [0-9a-f]{8}$', '')"


def without_instance(application_name: str) -> str:
    """A lock session's ``application_name`` without its instance id (as
    :data:`WITHOUT_INSTANCE`)."""
    return re.sub(r" [0-9a-f]{8}\Z", "", application_name)


async def terminate_backends(url: URL, application_name: str) -> int:
    """``pg_terminate_backend`` every session with ``application_name`` (a lock session's
    name without its instance id); returns how many."""
    rows = await admin_execute(
        url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE {WITHOUT_INSTANCE} = $1 AND pid <> pg_backend_pid()",
        application_name,
    )
    return sum(1 for r in rows if r[0])


async def terminate_backend(url: URL, pid: int) -> bool:
    rows = await admin_execute(url, "SELECT pg_terminate_backend($1)", pid)
    return bool(rows[0][0])
