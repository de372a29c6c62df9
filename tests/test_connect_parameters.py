"""Every libpq connection parameter is honoured as libpq reads it, or refused by name.

Each honoured parameter is checked against the real server, on every entry point that
dials from a URL: ``PgStore.connect`` (its pool and its lock session), a ``lock_url``,
``from_engine`` on an engine made from ``engine_arguments``, the CLI and Alembic's env.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store import engine_arguments
from cronoq_store._cli import cli
from cronoq_store._cli.exits import ExitCode
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskId, TaskSpec, TimeBase
from cronoq_store._errors import UnsupportedParameterError
from cronoq_store._statements import SEARCH_PATH
from cronoq_store._store import PgStore
from cronoq_store._urls import URL_ENV, resolve
from cronoq_store.testing import EmbeddedPostgres
from cronoq_store.testing._server import find_bin_dir

from .pgharness import WITHOUT_INSTANCE, ServerUnderTest, admin_execute
from .support import ROOT, leadership_of

#: Every variable libpq reads, cleared for each test (the machine's own must not leak in).
PG_VARIABLES = [name for name in os.environ if name.startswith("PG")]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in PG_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    # No ~/.pg_service.conf or ~/.pgpass of the machine's user is read.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("PGSYSCONFDIR", str(tmp_path / "sysconf"))


@pytest.fixture
def server(pg_server: ServerUnderTest) -> EmbeddedPostgres:
    if pg_server.kind != "embedded":
        pytest.skip(f"only the embedded server exposes its socket and password ({pg_server.kind})")
    embedded: EmbeddedPostgres = pg_server.server  # type: ignore[attr-defined]
    return embedded


@pytest.fixture
async def schema_name(server: EmbeddedPostgres) -> AsyncIterator[str]:
    name = f"p_{uuid.uuid4().hex[:12]}"
    yield name
    await admin_execute(server.url(), f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def service_file(path: Path, server: EmbeddedPostgres, name: str = "cq", **extra: object) -> Path:
    """A pg_service.conf whose service ``name`` reaches ``server`` over TCP."""
    lines = [
        "# the store's test server",
        f"[{name}]",
        "host=127.0.0.1",
        f"port={server.port}",
        "user=postgres",
        f"password={server.password}",
        "dbname=postgres",
        *(f"{key}={value}" for key, value in extra.items()),
        "",
        "[other]",
        "host=192.0.2.1",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


async def sessions(server: EmbeddedPostgres, prefix: str) -> list[str]:
    """``application_name`` of every session whose name starts with ``prefix``."""
    rows = await admin_execute(
        server.url(),
        "SELECT application_name FROM pg_stat_activity WHERE starts_with(application_name, $1)",
        prefix,
    )
    return sorted(row[0] for row in rows)


def instance_of(store: PgStore) -> str:
    """The id at the end of ``store``'s lock session's ``application_name``."""
    return leadership_of(store).instance


async def lead_once(store: PgStore, task: int = 1) -> None:
    epoch = await store.acquire_leadership()
    await store.commit(epoch, TimeBase.now(), [Submitted(TaskId(task), 1, 0, TaskSpec(b"x"))], [])


def run_cli(url: str | None, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    arguments = ["--url", url, *args] if url is not None else list(args)
    result = CliRunner().invoke(cli, arguments, env={"COLUMNS": "250", **(env or {})})
    return result.exit_code, result.stdout + result.stderr


def run_alembic(url: str, schema: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    command = [sys.executable, "-m", "alembic", "-x", f"url={url}", "-x", f"schema={schema}"]
    return subprocess.run(
        [*command, "upgrade", "head"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# --- the service file ------------------------------------------------------------------------


@pytest.mark.parametrize("found_by", ["servicefile", "PGSERVICEFILE", "home", "PGSYSCONFDIR"])
async def test_a_service_names_the_server_wherever_libpq_finds_it(
    server: EmbeddedPostgres,
    schema_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    found_by: str,
) -> None:
    """libpq's order: ``servicefile``, else ``$PGSERVICEFILE``, else ``~/.pg_service.conf``;
    then ``$PGSYSCONFDIR/pg_service.conf`` when the first has no such service."""
    url = "postgresql://?service=cq"
    if found_by == "servicefile":
        path = service_file(tmp_path / "mine.conf", server)
        url += f"&servicefile={quote(str(path))}"
        # Not read: the parameter comes first.
        service_file(tmp_path / "env.conf", server, port=1)
        monkeypatch.setenv("PGSERVICEFILE", str(tmp_path / "env.conf"))
    elif found_by == "PGSERVICEFILE":
        monkeypatch.setenv("PGSERVICEFILE", str(service_file(tmp_path / "env.conf", server)))
        service_file(tmp_path / "home" / ".pg_service.conf", server, port=1)
    elif found_by == "home":
        service_file(tmp_path / "home" / ".pg_service.conf", server)
        service_file(tmp_path / "sysconf" / "pg_service.conf", server, port=1)
    else:
        # The user's file exists but has no such service: the system's is read.
        service_file(tmp_path / "home" / ".pg_service.conf", server, name="elsewhere", port=1)
        service_file(tmp_path / "sysconf" / "pg_service.conf", server)
    name = f"svc-{found_by}"
    config = PgStoreConfig(schema=schema_name, application_name=name)
    async with await PgStore.connect(url, config) as store:
        await lead_once(store)
        assert set(await sessions(server, name)) == {name, f"{name} leader {instance_of(store)}"}


async def test_the_urls_values_override_the_services(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path
) -> None:
    path = service_file(tmp_path / "s.conf", server, port=1, application_name="from-service")
    url = (
        f"postgresql://127.0.0.1:{server.port}/postgres?service=cq&servicefile={quote(str(path))}"
        "&application_name=from-url"
    )
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
        names = await sessions(server, "from-")
    assert set(names) == {"from-url", f"from-url leader {instance_of(store)}"}


async def test_pgservice_names_the_service(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGSERVICEFILE", str(service_file(tmp_path / "s.conf", server)))
    monkeypatch.setenv("PGSERVICE", "cq")
    async with await PgStore.connect("postgresql://", PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)


async def test_a_missing_service_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "none.conf"
    url = f"postgresql://?service=nowhere&servicefile={quote(str(path))}"
    with pytest.raises(ValueError, match="service 'nowhere' not found"):
        await PgStore.connect(url)
    code, out = await asyncio.to_thread(run_cli, url, "status")
    assert code == ExitCode.USAGE, out
    assert "nowhere" in out


# --- sockets, the environment, options, timeouts, keepalives ---------------------------------


async def test_a_percent_encoded_socket_directory_is_a_host(
    server: EmbeddedPostgres, schema_name: str
) -> None:
    url = f"postgresql://postgres@{quote(str(server.socket_dir), safe='')}:{server.port}/postgres"
    config = PgStoreConfig(schema=schema_name, application_name="socket-host")
    async with await PgStore.connect(url, config) as store:
        await lead_once(store)
        rows = await admin_execute(
            server.url(),
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE starts_with(application_name, 'socket-host') AND client_port = -1",
        )
        # Every session (the pool's and the lock session) came through the socket.
        assert rows[0][0] == len(await sessions(server, "socket-host")) >= 2


async def test_the_pg_environment_is_read_as_libpq_reads_it(
    server: EmbeddedPostgres, schema_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGHOST", str(server.socket_dir))
    monkeypatch.setenv("PGPORT", str(server.port))
    monkeypatch.setenv("PGUSER", "postgres")
    monkeypatch.setenv("PGDATABASE", "postgres")
    monkeypatch.setenv("PGAPPNAME", "from-env")
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=4242kB")
    monkeypatch.setenv("PGTZ", "Pacific/Chatham")
    async with await PgStore.connect("postgresql://", PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
        async with store.engine.connect() as conn:
            work_mem, zone = (
                await conn.execute(
                    text("SELECT current_setting('work_mem'), current_setting('TimeZone')")
                )
            ).one()
        assert (work_mem, zone) == ("4242kB", "Pacific/Chatham")
        assert set(await sessions(server, "from-env")) == {
            "from-env",
            f"from-env leader {instance_of(store)}",
        }


async def test_options_reach_every_session_and_the_stores_own_settings_win(
    server: EmbeddedPostgres, schema_name: str
) -> None:
    options = quote("-c work_mem=4343kB -c search_path=public", safe="")
    url = f"postgresql://postgres:{server.password}@127.0.0.1:{server.port}/postgres?options={options}"
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
        async with store.engine.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT current_setting('work_mem'), current_setting('search_path')")
                )
            ).one()
    # search_path is the store's (no schema another role can write is on it).
    assert tuple(row) == ("4343kB", SEARCH_PATH)


async def test_connect_timeout_bounds_each_entry_point(silent_server: int) -> None:
    url = f"postgresql://u:pw@127.0.0.1:{silent_server}/db?connect_timeout=2"
    dialled, arguments = engine_arguments(url)
    engine = create_async_engine(dialled, connect_args=arguments)
    started = time.monotonic()
    try:
        with pytest.raises((TimeoutError, asyncio.TimeoutError)):
            async with engine.connect():
                pass
    finally:
        await engine.dispose()
    # libpq's bound (at least two seconds), not asyncpg's default of 60 s; the upper
    # bound leaves a loaded machine room and still tells the two apart.
    assert 1.5 < time.monotonic() - started < 30
    started = time.monotonic()
    code, out = await asyncio.to_thread(run_cli, url, "status")
    assert code == ExitCode.UNREACHABLE, out
    assert time.monotonic() - started < 30


async def test_keepalives_and_tcp_user_timeout_are_set_on_the_socket(
    server: EmbeddedPostgres,
) -> None:
    base = f"postgresql://postgres:{server.password}@127.0.0.1:{server.port}/postgres"

    async def socket_options(query: str) -> tuple[int, ...]:
        dialled, arguments = engine_arguments(f"{base}?{query}" if query else base)
        engine = create_async_engine(dialled, connect_args=arguments)
        try:
            async with engine.connect() as conn:
                raw: Any = (await conn.get_raw_connection()).driver_connection
                sock = raw._transport.get_extra_info("socket")
                return tuple(
                    sock.getsockopt(level, option)
                    for level, option in (
                        (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                    )
                )
        finally:
            await engine.dispose()

    given = await socket_options(
        "keepalives_idle=17&keepalives_interval=3&keepalives_count=4&tcp_user_timeout=9000"
    )
    assert given == (1, 17, 3, 4, 9000)
    # libpq turns keepalives on by default; keepalives=0 turns them off.
    assert (await socket_options(""))[0] == 1
    assert (await socket_options("keepalives=0"))[0] == 0


async def test_a_password_file_is_read_as_libpq_reads_it(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path
) -> None:
    passfile = tmp_path / "pgpass"
    passfile.write_text(
        f"# comment\n127.0.0.1:{server.port}:other:postgres:wrong\n"
        f"127.0.0.1:*:postgres:postgres:{server.password.replace(':', chr(92) + ':')}\n"
    )
    passfile.chmod(0o600)
    url = f"postgresql://postgres@127.0.0.1:{server.port}/postgres?passfile={quote(str(passfile))}"
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
    # A file others can read is ignored, as libpq ignores it: no password is sent.
    passfile.chmod(0o644)
    code, out = await asyncio.to_thread(run_cli, url, "--schema", schema_name, "status")
    assert code == ExitCode.UNREACHABLE, out
    assert "password" in out


async def test_a_host_list_in_the_url_is_tried_in_order(
    server: EmbeddedPostgres, schema_name: str, silent_server: int
) -> None:
    """libpq's multi-host URL: a host that does not answer within connect_timeout, then the
    server; the store's sessions reach the second."""
    url = (
        f"postgresql://postgres:{server.password}@127.0.0.1:{silent_server},"
        f"127.0.0.1:{server.port}/postgres?connect_timeout=2"
    )
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)


async def test_every_value_honoured_as_libpq_would_connects(
    server: EmbeddedPostgres, schema_name: str
) -> None:
    """The values asyncpg implements as libpq does, all at once, against the server; none is
    refused and the sessions work."""
    query = (
        "client_encoding=UTF8&gssencmode=disable&channel_binding=disable&sslcompression=0"
        "&sslcertmode=allow&sslsni=1&sslmode=disable&min_protocol_version=3.0"
        "&max_protocol_version=latest&replication=false&gssdelegation=0&krbsrvname=postgres"
        "&target_session_attrs=read-write&load_balance_hosts=random"
        "&fallback_application_name=honoured-all"
    )
    url = f"postgresql://postgres:{server.password}@127.0.0.1:{server.port}/postgres?{query}"
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
        assert f"honoured-all leader {instance_of(store)}" in await sessions(server, "honoured")
    code, out = await asyncio.to_thread(run_cli, url, "--schema", schema_name, "status")
    assert code == ExitCode.OK, out


def test_load_balance_hosts_random_shuffles_the_hosts_for_each_connection() -> None:
    hosts = ",".join(f"%2Fnone%2F{i}" for i in range(4))
    read = resolve(f"postgresql://u@{hosts}/db?load_balance_hosts=random")
    orders = {tuple(read.asyncpg_arguments()["host"]) for _ in range(200)}
    assert len(orders) > 1
    assert all(sorted(order) == [f"/none/{i}" for i in range(4)] for order in orders)
    fixed = resolve(f"postgresql://u@{hosts}/db")
    assert {tuple(fixed.asyncpg_arguments()["host"]) for _ in range(20)} == {
        tuple(f"/none/{i}" for i in range(4))
    }


# --- application_name and the lock session ---------------------------------------------------


@pytest.mark.parametrize("name", ["orders-api", "x" * 80, "caf\u00e9 \u2615 scheduler"])
async def test_the_urls_application_name_prefixes_the_lock_sessions_name(
    server: EmbeddedPostgres, schema_name: str, name: str
) -> None:
    url = (
        f"postgresql://postgres:{server.password}@127.0.0.1:{server.port}/postgres"
        f"?application_name={quote(name)}"
    )
    async with await PgStore.connect(url, PgStoreConfig(schema=schema_name)) as store:
        await lead_once(store)
        rows = await admin_execute(
            server.url(),
            f"SELECT application_name, {WITHOUT_INSTANCE} FROM pg_stat_activity "
            "WHERE application_name LIKE $1",
            f"% leader {instance_of(store)}",
        )
    assert len(rows) == 1, rows
    full, without = rows[0]
    assert full.endswith(f" leader {instance_of(store)}")
    assert without.endswith(" leader")
    ascii_prefix = name.encode("ascii", "backslashreplace").decode()[:10]
    assert full.startswith(ascii_prefix[:8]) or "\\x" in full, full


# --- refused by name, everywhere -------------------------------------------------------------

REFUSED = [
    ("hostaddr=127.0.0.1", "hostaddr"),
    ("require_auth=scram-sha-256", "require_auth"),
    ("requirepeer=postgres", "requirepeer"),
    ("sslcrldir=/etc/ssl", "sslcrldir"),
    ("replication=database", "replication"),
    ("min_protocol_version=3.2", "min_protocol_version"),
    ("client_encoding=LATIN1", "client_encoding"),
    ("oauth_issuer=https://example.invalid", "oauth_issuer"),
    ("gssdelegation=1", "gssdelegation"),
    ("no_such_parameter=1", "no_such_parameter"),
]


@pytest.mark.parametrize(("query", "named"), REFUSED)
async def test_a_parameter_asyncpg_cannot_honour_is_refused_by_name_everywhere(
    query: str, named: str
) -> None:
    secret = f"Hx{uuid.uuid4().hex[:8]}"
    url = f"postgresql://ops:{secret}@127.0.0.1:1/app?{query}"
    with pytest.raises(UnsupportedParameterError) as refused:
        await PgStore.connect(url)
    assert named in refused.value.names
    assert named in str(refused.value)
    assert secret not in str(refused.value)
    code, out = await asyncio.to_thread(run_cli, url, "status")
    assert code == ExitCode.USAGE, out
    assert named in out
    assert secret not in out


async def test_a_refused_parameter_from_the_environment_or_a_service_is_named_with_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGREQUIREAUTH", "password")
    with pytest.raises(UnsupportedParameterError, match=r"require_auth \(from \$PGREQUIREAUTH\)"):
        resolve("postgresql://u@h/db")
    code, out = await asyncio.to_thread(run_cli, "postgresql://u@h/db", "status")
    assert code == ExitCode.USAGE, out
    assert "require_auth" in out
    monkeypatch.delenv("PGREQUIREAUTH")
    path = tmp_path / "s.conf"
    path.write_text("[cq]\nhost=h\nhostaddr=192.0.2.1\n")
    with pytest.raises(UnsupportedParameterError, match=r"hostaddr \(from service 'cq'"):
        resolve(f"postgresql://?service=cq&servicefile={quote(str(path))}")


async def test_a_refused_lock_url_is_named_before_anything_connects(
    engine: AsyncEngine, schema: str
) -> None:
    with pytest.raises(UnsupportedParameterError, match="requirepeer"):
        await PgStore.from_engine(
            engine, PgStoreConfig(schema=schema), lock_url="postgresql://u@h/db?requirepeer=x"
        )


def test_alembic_refuses_a_parameter_by_name() -> None:
    refused = run_alembic("postgresql://ops:pw@127.0.0.1:1/app?hostaddr=127.0.0.1", "public")
    assert refused.returncode != 0
    assert "hostaddr" in refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr


# --- each entry point with a service ---------------------------------------------------------


async def test_the_cli_and_alembic_dial_the_service(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = service_file(tmp_path / "s.conf", server)
    monkeypatch.setenv("PGSERVICEFILE", str(path))
    done = await asyncio.to_thread(run_alembic, "postgresql://?service=cq", schema_name)
    assert done.returncode == 0, done.stdout + done.stderr
    code, out = await asyncio.to_thread(
        run_cli, None, "--schema", schema_name, "status", env={URL_ENV: "postgresql://?service=cq"}
    )
    assert code == ExitCode.OK, out


async def test_from_engine_on_engine_arguments_and_its_lock_session_use_the_service(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path
) -> None:
    path = service_file(tmp_path / "s.conf", server, application_name="engine-app")
    url = f"postgresql://?service=cq&servicefile={quote(str(path))}"
    dialled, arguments = engine_arguments(url)
    engine = create_async_engine(dialled, connect_args=arguments)
    try:
        config = PgStoreConfig(schema=schema_name, application_name="engine-store")
        async with await PgStore.from_engine(engine, config) as store:
            await lead_once(store)
            assert f"engine-store leader {instance_of(store)}" in await sessions(server, "engine-")
        # A lock_url is read as libpq reads it too.
        async with await PgStore.from_engine(engine, config, lock_url=url) as store:
            await lead_once(store, task=2)
            assert f"engine-app leader {instance_of(store)}" in await sessions(server, "engine-")
    finally:
        await engine.dispose()


async def test_from_engine_refuses_an_engine_that_would_ignore_its_service(
    server: EmbeddedPostgres, schema_name: str, tmp_path: Path
) -> None:
    """SQLAlchemy hands ``service`` to asyncpg, which ignores it and dials the default
    server: the store refuses such an engine by name instead of leading elsewhere."""
    path = service_file(tmp_path / "s.conf", server)
    engine = create_async_engine(
        f"postgresql+asyncpg://postgres:{server.password}@127.0.0.1:{server.port}/postgres"
        f"?service=cq&servicefile={quote(str(path))}"
    )
    try:
        with pytest.raises(UnsupportedParameterError, match="service") as refused:
            await PgStore.from_engine(engine, PgStoreConfig(schema=schema_name))
        assert "engine_arguments" in str(refused.value)
        assert server.password not in str(refused.value)
    finally:
        await engine.dispose()


# --- the same reading as libpq's own ---------------------------------------------------------


class _Option(ctypes.Structure):
    _fields_ = [
        ("keyword", ctypes.c_char_p),
        ("envvar", ctypes.c_char_p),
        ("compiled", ctypes.c_char_p),
        ("val", ctypes.c_char_p),
        ("label", ctypes.c_char_p),
        ("dispchar", ctypes.c_char_p),
        ("dispsize", ctypes.c_int),
    ]


@pytest.fixture(scope="module")
def libpq() -> Any:
    """The libpq 18 of the embedded server's build: the reference for reading a URL."""
    path = find_bin_dir().parent / "lib" / "libpq.so.5"
    lib = ctypes.CDLL(str(path))
    lib.PQconnectStart.restype = ctypes.c_void_p
    lib.PQconnectStart.argtypes = [ctypes.c_char_p]
    lib.PQconninfo.restype = ctypes.POINTER(_Option)
    lib.PQconninfo.argtypes = [ctypes.c_void_p]
    lib.PQfinish.argtypes = [ctypes.c_void_p]
    return lib


def read_by_libpq(lib: Any, url: str) -> dict[str, str]:
    """The options libpq resolved for ``url`` (the URL, the service, the environment), as
    its connection object holds them; it dials nowhere that exists."""
    conn = lib.PQconnectStart(url.encode())
    try:
        options = lib.PQconninfo(conn)
        values, i = {}, 0
        while options and options[i].keyword:
            if options[i].val is not None:
                values[options[i].keyword.decode()] = options[i].val.decode()
            i += 1
        return values
    finally:
        lib.PQfinish(conn)


LIBPQ_CASES: list[tuple[str, dict[str, str], dict[str, str]]] = [
    # (url, environment, {file under tmp_path: content})
    ("postgresql://u@%2Fnone%2Fa:5433/db?options=-c%20a%3Db", {}, {}),
    ("postgresql://u@%2Fnone%2Fa:1,%2Fnone%2Fb/db", {}, {}),
    ("postgresql://u@%2Fnone%2Fa/db?host=/none/b&port=3", {}, {}),
    (
        "postgresql://",
        {
            "PGHOST": "/none/e",
            "PGPORT": "9",
            "PGUSER": "eu",
            "PGDATABASE": "ed",
            "PGAPPNAME": "ea",
            "PGOPTIONS": "-c geqo=off",
        },
        {},
    ),
    (
        "postgresql://over@/?service=a&port=1",
        {"PGSERVICEFILE": "{tmp}/s.conf", "PGUSER": "ignored", "PGAPPNAME": "ignored"},
        {"s.conf": "[a]\nhost=/none/s\nport=7\nuser=su\napplication_name=sa\noptions=-c x=y\n"},
    ),
    (
        "postgresql:///db",
        {"PGSERVICE": "b", "PGSERVICEFILE": "{tmp}/s.conf"},
        {"s.conf": "[a]\nhost=/none/wrong\n[b]\n# in b\nhost=/none/b\nuser=bu\n"},
    ),
    (
        "postgresql://?service=c",
        {"PGSYSCONFDIR": "{tmp}/sys"},
        {
            "home/.pg_service.conf": "[other]\nhost=/none/h\n",
            "sys/pg_service.conf": "[c]\nhost=/none/sys\nport=11\ndbname=sd\n",
        },
    ),
    (
        "postgresql://?service=c",
        {"PGSYSCONFDIR": "{tmp}/sys"},
        {
            "home/.pg_service.conf": "[c]\nhost=/none/home\n",
            "sys/pg_service.conf": "[c]\nhost=/none/sys\nport=11\n",
        },
    ),
    ("postgresql://u@/db?application_name=&fallback_application_name=fb", {}, {}),
    ("postgres://u%40x@%2Fnone%2Fa/d%2Fb?dbname=q", {}, {}),
]


@pytest.mark.parametrize(("url", "environ", "files"), LIBPQ_CASES)
def test_a_url_is_read_as_libpq_reads_it(
    libpq: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    url: str,
    environ: dict[str, str],
    files: dict[str, str],
) -> None:
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    for name, value in environ.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    theirs = read_by_libpq(libpq, url)
    ours = resolve(url)
    hosts = theirs["host"].split(",") if "host" in theirs else []
    ports = [int(p or 5432) for p in theirs.get("port", "5432").split(",")]
    assert list(ours.hosts) == hosts
    assert list(ours.ports) == (ports * len(hosts) if len(ports) == 1 else ports)[: len(hosts)]
    assert ours.user == theirs["user"]
    assert ours.database == theirs["dbname"]
    assert ours.session_name("") == (
        theirs.get("application_name") or theirs.get("fallback_application_name") or ""
    )
    assert dict(ours.settings).get("options", "") == theirs.get("options", "")


def test_no_password_of_the_url_or_its_service_shows_in_what_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.conf"
    path.write_text("[cq]\nhost=h\npassword=ServicePw1\nsslpassword=ServiceKeyPw1\n")
    monkeypatch.setenv("PGSERVICEFILE", str(path))
    read = resolve("postgresql://u:UrlPw1@/db?service=cq&sslmode=require")
    assert read.password == "UrlPw1"
    assert dict(read.tls)["sslpassword"] == "ServiceKeyPw1"
    dialled, arguments = engine_arguments(read)
    shown = repr(read) + repr(arguments) + str(dialled) + repr(dialled)
    for secret in ("UrlPw1", "ServicePw1", "ServiceKeyPw1"):
        assert secret not in shown
