"""No password in any output: every surface, driven with every URL form, against the server.

A role with a password made of characters that need percent-encoding logs in through each
URL form the store accepts (user info plain or encoded, ``?password=``, several hosts), with
the right password, a wrong one and an unreachable host, so that reprs, errors and their
chains, log records and their extras, the CLI's stdout and stderr and Alembic's output are
all produced; none may contain the password in any spelling.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._cli import cli
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import Submitted, TaskId, TaskSpec, TimeBase
from cronoq_store._errors import StoreError, UnavailableError
from cronoq_store._store import PgStore
from cronoq_store._urls import URL_ENV, redact, scrub

from .pgharness import admin_execute
from .support import ROOT, texts_of, unused_port
from .waits import bounded, until

#: Characters that percent-encoding changes, so every spelling of the secret differs.
SPECIAL = "p@ss:w/rd?&=+ %#"


@dataclass(frozen=True)
class Role:
    name: str
    password: str


@pytest.fixture(scope="module")
def roles(pg_server: object) -> Iterator[dict[str, Role]]:
    """Two superuser roles: one with a URL-safe password, one with a password that is not."""
    url: URL = pg_server.url  # type: ignore[attr-defined]
    made = {
        "safe": Role(f"cq_safe_{uuid.uuid4().hex[:8]}", f"Plain{uuid.uuid4().hex[:12]}"),
        "special": Role(f"cq_spec_{uuid.uuid4().hex[:8]}", f"{uuid.uuid4().hex[:8]}{SPECIAL}"),
    }
    for role in made.values():
        quoted = role.password.replace("'", "''")
        asyncio.run(
            admin_execute(url, f"CREATE ROLE {role.name} LOGIN SUPERUSER PASSWORD '{quoted}'")
        )
    try:
        yield made
    finally:
        for role in made.values():
            asyncio.run(admin_execute(url, f"DROP ROLE IF EXISTS {role.name}"))


def spellings(secret: str) -> set[str]:
    return {secret, quote(secret, safe=""), quote_plus(secret), quote(secret)}


FORMS = ["userinfo", "userinfo-encoded", "asyncpg-driver", "postgres-scheme", "query", "multihost"]
VARIANTS = ["right", "wrong-password", "unreachable"]


def build(form: str, role: Role, password: str, host: str, port: int, db: str) -> str:
    enc = quote(password, safe="")
    if form == "userinfo":
        return f"postgresql://{role.name}:{password}@{host}:{port}/{db}"
    if form == "userinfo-encoded":
        return f"postgresql://{role.name}:{enc}@{host}:{port}/{db}"
    if form == "asyncpg-driver":
        return f"postgresql+asyncpg://{role.name}:{enc}@{host}:{port}/{db}"
    if form == "postgres-scheme":
        return f"postgres://{role.name}:{enc}@{host}:{port}/{db}"
    if form == "query":
        return f"postgresql://{role.name}@{host}:{port}/{db}?password={enc}"
    assert form == "multihost"
    dead = unused_port()
    return f"postgresql://{role.name}@/{db}?host={host}:{dead}&host={host}:{port}&password={enc}"


class Records(logging.Handler):
    """Every record of every logger, with all its attributes (extras included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())
        self.texts += [repr(v) for v in vars(record).values()]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def cli_outputs(url: str, schema: str) -> list[str]:
    """Every command, the URL given as --url and as the environment variable."""
    runner = CliRunner()
    outputs = []
    commands = [
        ["status"],
        ["migrate"],
        ["tasks", "show", "1"],
        ["tasks", "finished"],
        ["prune", "--older-than", "1d", "--dry-run"],
        ["demo", "--url", url, "--seconds", "0.5"],
    ]
    for args in commands:
        result = runner.invoke(
            cli, ["--url", url, "--schema", schema, *args], env={"COLUMNS": "250"}
        )
        outputs += [result.stdout, result.stderr, texts_of(result.exception or Exception())]
    by_env = runner.invoke(cli, ["--schema", schema, "status"], env={URL_ENV: url})
    return [*outputs, by_env.stdout, by_env.stderr]


def alembic_outputs(url: str, schema: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "alembic",
            "-x",
            f"url={url}",
            "-x",
            f"schema={schema}",
            "upgrade",
            "head",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return [result.stdout, result.stderr]


@pytest.fixture
async def cleanup(pg_url: URL) -> AsyncIterator[list[str]]:
    schemas: list[str] = []
    yield schemas
    for name in schemas:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
async def test_no_surface_shows_a_password(
    pg_url: URL,
    roles: dict[str, Role],
    records: Records,
    cleanup: list[str],
    form: str,
    variant: str,
) -> None:
    role = roles["safe" if form == "userinfo" else "special"]
    password = f"wrong-{role.password}" if variant == "wrong-password" else role.password
    port = unused_port() if variant == "unreachable" else pg_url.port or 5432
    url = build(form, role, password, str(pg_url.host), port, str(pg_url.database))
    schema = f"s_{uuid.uuid4().hex[:10]}"
    cleanup.append(schema)
    seen: list[str] = []
    config = PgStoreConfig(schema=schema, lock_poll=0.05, keepalive=0.5, session_timeout=2.0)

    if variant == "right":
        async with await PgStore.connect(url, config) as store:
            seen += [repr(store), str(store), str(store.engine.url), repr(store.engine)]
            await store.acquire_leadership()
        # The store's warnings: a lock session that cannot connect, a read-only server.
        dead_lock = build(form, role, password, str(pg_url.host), unused_port(), "x")
        async with await PgStore.connect(url, config, lock_url=dead_lock) as store:
            acquiring = asyncio.create_task(store.acquire_leadership())
            try:
                await until(
                    lambda: (
                        any("cannot acquire leadership for now" in t for t in records.texts)
                        or acquiring.done()
                    ),
                    "the warning of a lock session that cannot connect",
                )
                assert not acquiring.done(), "leadership acquired without a lock session"
            finally:
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquiring
        # The application's own engine keeps its URL as given (a ?password= stays in the
        # query): the store's reprs and warnings must mask it all the same.
        raw = create_async_engine(make_url(url).set(drivername="postgresql+asyncpg"))
        try:
            async with await PgStore.from_engine(raw, config, migrate=False) as store:
                seen += [repr(store), str(store)]
                await bounded(store.acquire_leadership(), "leadership on the application's engine")
        finally:
            await raw.dispose()
        # A read-only failure on the store's own pool (one session, made read-only) is
        # taken for a demoted primary: the warning that drops the pool names the URL. (On an
        # application's pool the store sets read-write for its own transactions.)
        one = dataclasses.replace(config, max_connections=1)
        async with await PgStore.connect(url, one, migrate=False) as store:
            seen += [repr(store)]
            async with store.engine.connect() as session:
                await session.exec_driver_sql("SET default_transaction_read_only = on")
                await session.commit()
            with pytest.raises(UnavailableError) as caught:
                await store.commit(
                    0, TimeBase.now(), [Submitted(TaskId(1), 1, 0, TaskSpec(b"x"))], []
                )
            seen.append(texts_of(caught.value))
        assert any("no longer accepts writes" in t for t in records.texts)
        assert any("cannot acquire leadership for now" in t for t in records.texts)
    else:
        with pytest.raises(StoreError) as refused:
            await PgStore.connect(url, config)
        seen.append(texts_of(refused.value))
        expected = "password authentication failed" if variant == "wrong-password" else ""
        assert expected in str(refused.value)

    seen += await asyncio.to_thread(cli_outputs, url, schema)
    seen += await asyncio.to_thread(alembic_outputs, url, schema)
    seen += records.texts
    everything = "\n".join(seen)
    assert role.name in everything  # the surfaces were produced and name the user
    for secret in spellings(password):
        assert secret not in everything, f"{secret!r} shown"


@pytest.mark.parametrize(
    "url",
    [
        "host=db.example user=ops password='dsn {secret}' dbname=app",
        "host=db.example password={secret} dbname=app",
        "postgresql://ops:{secret}@db.example:notaport/app",
        "postgresql://ops@db.example/app?sslpassword={secret}&sslcompression=1",
        "mysql://ops:{secret}@db.example/app",
        # An unencoded "@" then "/" or "?" in the password: SQLAlchemy cuts it at the first
        # "@" and would dial the rest as a host, a part of the password sent as one.
        "postgresql://ops:{secret}@evil.example/{secret}@db.example/app",
        "postgresql://ops:{secret}@evil.example?{secret}@db.example/app",
        "postgresql://ops:{secret}@db.example:99999/app",
        # No scheme at all: user info typed as in a URL, still a password.
        "ops:{secret}@db.example/app",
        "//ops:{secret}@db.example/app",
        "ops:{secret}@db.example:5432",
    ],
)
async def test_refused_url_forms_show_no_password(url: str, records: Records) -> None:
    """A URL the store cannot use is refused with a clear error that masks the password."""
    secret = f"Hx{uuid.uuid4().hex[:10]}"
    typed = url.format(secret=secret)
    with pytest.raises(ValueError, match="URL") as caught:
        await PgStore.connect(typed)
    seen = [
        texts_of(caught.value),
        redact(typed),
        *await asyncio.to_thread(cli_outputs, typed, "public"),
    ]
    seen += await asyncio.to_thread(alembic_outputs, typed, "public")
    everything = "\n".join(seen + records.texts)
    assert "***" in everything
    assert secret not in everything


@pytest.mark.parametrize(
    ("text", "known", "shown"),
    [
        # The examples: a one-letter password masks itself, not every letter.
        (
            "cannot connect to postgresql://u:o@127.0.0.1:1/cronoq",
            "postgresql://u:o@127.0.0.1:1/cronoq",
            "cannot connect to postgresql://u:***@127.0.0.1:1/cronoq",
        ),
        (
            "cannot connect to postgresql://u:***@127.0.0.1:1/cronoq",
            "postgresql://u:o@127.0.0.1:1/cronoq",
            "cannot connect to postgresql://u:***@127.0.0.1:1/cronoq",
        ),
        (
            "the tree sees postgresql://u@h/db?password=e here",
            "postgresql://u@h/db?password=e",
            "the tree sees postgresql://u@h/db?password=*** here",
        ),
        # A password that is a word of the message, a percent-encoded one, in a repr.
        (
            "role postgres: URL('postgresql://postgres:postgres@db:5432/postgres')",
            "postgresql://postgres:postgres@db:5432/postgres",
            "role postgres: URL('postgresql://postgres:***@db:5432/postgres')",
        ),
        (
            "auth failed for a/b@c: postgresql://ops:a%2Fb%40c@db/app?password=q%26r&x=1",
            "postgresql://ops:a%2Fb%40c@db/app?password=q%26r&x=1",
            "auth failed for a/b@c: postgresql://ops:***@db/app?password=***&x=1",
        ),
        # Several hosts, IPv6, an unencoded "@", a password SQLAlchemy cannot delimit.
        (
            '"postgresql://ops:h1@h1:5432,[::1]:5433/app" failed',
            "postgresql://ops:h1@h1:5432,[::1]:5433/app",
            '"postgresql://ops:***@h1:5432,[::1]:5433/app" failed',
        ),
        (
            "dial postgresql://ops:db@t@db/app now (db)",
            "postgresql://ops:db@t@db/app",
            "dial postgresql://ops:***@db/app now (db)",
        ),
        (
            "dial postgresql://ops:p@ss w/rd?&=+ %#@db/app now",
            "postgresql://ops:p@ss w/rd?&=+ %#@db/app",
            "dial postgresql://ops:***@db/app now",
        ),
        # Keyword DSNs: quoted, escaped, spaced; secret-named parameters of every kind.
        (
            "dsn host=db password='a \\'b c' user=ops sslpassword=k\\ ey dbname=app",
            None,
            "dsn host=db password=*** user=ops sslpassword=*** dbname=app",
        ),
        (
            "PGPASSWORD = pass passfile=/home/ops/.pgpass",
            "postgresql://ops:pass@db/app",
            "PGPASSWORD = *** passfile=/home/ops/.pgpass",
        ),
        # A password with an unencoded "@" then "/" or "?": masked to the user info's end.
        (
            "cannot connect to postgresql://u:a@evil/b@db:5432/app: refused",
            None,
            "cannot connect to postgresql://u:***@db:5432/app: refused",
        ),
        (
            "cannot connect to postgresql://u:a@evil?b@db/app: refused",
            None,
            "cannot connect to postgresql://u:***@db/app: refused",
        ),
        (
            "at postgresql://u:s@db/app?application_name=me@host, ask ops@example.com/x",
            None,
            "at postgresql://u:***@db/app?application_name=me@host, ask ops@example.com/x",
        ),
        # Nothing secret: left alone, byte for byte.
        (
            "sslmode=verify-full sslrootcert=/etc/ca.crt: cannot connect to host db",
            "postgresql://u:cannot@db/app",
            "sslmode=verify-full sslrootcert=/etc/ca.crt: cannot connect to host db",
        ),
    ],
)
def test_scrub_masks_secrets_where_they_stand_and_nothing_else(
    text: str, known: str | None, shown: str
) -> None:
    assert scrub(text, [known]) == shown


_PROSE = st.text(
    st.characters(whitelist_categories=("L", "N", "Zs"), whitelist_characters=".,;()!-'\""),
    max_size=40,
)
_SECRET = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1)


@settings(max_examples=300, deadline=None)
@given(before=_PROSE, after=_PROSE, password=_SECRET)
def test_only_the_secret_of_a_url_in_prose_is_masked(
    before: str, after: str, password: str
) -> None:
    """Whatever the password (one letter, a word of the text, any character) and the prose
    around it, the URL's password is masked and every other character stays."""
    encoded = quote(password, safe="")
    for url, shown in [
        (
            f"postgresql://ops:{encoded}@db.example:5432/app",
            "postgresql://ops:***@db.example:5432/app",
        ),
        (
            f"postgresql://ops@db/app?password={encoded}&x=1",
            "postgresql://ops@db/app?password=***&x=1",
        ),
    ]:
        text = f"{before} {url} {after}"
        assert scrub(text, [url]) == f"{before} {shown} {after}"
        assert scrub(text) == f"{before} {shown} {after}"
        assert scrub(f"{before} {after}", [url]) == f"{before} {after}"
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    dsn = f"{before} host=db password='{escaped}' dbname=app {after}"
    assert scrub(dsn) == f"{before} host=db password=*** dbname=app {after}"


@pytest.mark.parametrize("password", ["o", "e", "postgres", "127", "cronoq"])
def test_a_short_password_does_not_mark_its_letters_in_the_cli_or_alembic(password: str) -> None:
    """The issue's CLI example, and Alembic's: nothing but the password is masked."""
    port = unused_port()
    for url, shown in [
        (
            f"postgresql://postgres:{password}@127.0.0.1:{port}/cronoq",
            f"postgresql://postgres:***@127.0.0.1:{port}/cronoq",
        ),
        (
            f"postgresql://postgres@127.0.0.1:{port}/cronoq?password={password}",
            f"postgresql://postgres@127.0.0.1:{port}/cronoq?password=***",
        ),
    ]:
        result = CliRunner().invoke(cli, ["--url", url, "status"], env={"COLUMNS": "250"})
        assert result.exit_code == 3, result.stderr
        assert result.stderr.startswith(f"Error: cannot connect to {shown}: "), result.stderr
        assert result.stderr.count("***") == 1, result.stderr
        stdout, _ = alembic_outputs(url, "public")
        assert stdout.startswith(f"FAILED: cannot connect to {shown} ("), stdout
        assert stdout.count("***") == 1, stdout


def test_alembic_says_why_it_cannot_connect_in_one_masked_line(pg_url: URL) -> None:
    secret = f"Hx{uuid.uuid4().hex[:10]}"
    wrong = pg_url.set(password=secret).render_as_string(hide_password=False)
    refused = f"postgresql://ops@127.0.0.1:{unused_port()}/app?password={secret}"
    for url, why in ((wrong, "password authentication failed"), (refused, "Connect call failed")):
        stdout, stderr = alembic_outputs(url, "public")
        assert "Traceback" not in stderr
        assert stdout.startswith(f"FAILED: cannot connect to {redact(url)} (")
        assert why in stdout
        assert secret not in stdout + stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # A password that is also a word of the URL masks only the password.
        ("postgresql://postgres:postgres@db/app", "postgresql://postgres:***@db/app"),
        (
            "postgresql://ops@db/app?password=pw&sslpassword=k",
            "postgresql://ops@db/app?password=***&sslpassword=***",
        ),
        (
            "postgresql://ops@/app?host=a:1&host=b:2&password=pw",
            "postgresql://ops@/app?host=a%3A1&host=b%3A2&password=***",
        ),
        ("postgresql://ops:s3cr@t@db/app", "postgresql://ops:***@db/app"),
        ("host=db user=ops password='a b' dbname=app", "host=db user=ops password=*** dbname=app"),
    ],
)
def test_redact_masks_the_password_and_nothing_else(url: str, shown: str) -> None:
    assert redact(url) == shown


def ini_with_url(tmp_path: Path, url: str) -> Path:
    """This checkout's alembic.ini with ``sqlalchemy.url`` set, as an operator would write it."""
    text = (ROOT / "alembic.ini").read_text()
    text = text.replace("%(here)s/alembic", str(ROOT / "alembic"))
    assert "\nsqlalchemy.url =\n" in text
    ini = tmp_path / "alembic.ini"
    ini.write_text(text.replace("\nsqlalchemy.url =\n", f"\nsqlalchemy.url = {url}\n"))
    return ini


def test_alembic_reads_a_percent_encoded_password_from_the_ini_file_and_never_prints_it(
    pg_url: URL, roles: dict[str, Role], cleanup: list[str], tmp_path: Path
) -> None:
    """A percent-encoded password in ``sqlalchemy.url`` is not configparser interpolation:
    it logs in, and a failure says why without quoting the value (configparser's error did,
    from the first '%' on, on stdout and in the log)."""
    role = roles["special"]
    encoded = quote(role.password, safe="")
    spellings = (role.password, encoded, encoded[encoded.index("%") :])
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    for port, ok in ((pg_url.port, True), (unused_port(), False)):
        url = f"postgresql://{role.name}:{encoded}@{pg_url.host}:{port}/{pg_url.database}"
        schema = f"s_{uuid.uuid4().hex[:10]}"
        cleanup.append(schema)
        ini = str(ini_with_url(tmp_path, url))
        command = [sys.executable, "-m", "alembic", "-c", ini, "-x", f"schema={schema}"]
        result = subprocess.run(
            [*command, "upgrade", "head"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        output = result.stdout + result.stderr
        assert not [s for s in spellings if s in output], output
        assert "Traceback" not in output
        if ok:
            assert result.returncode == 0, output
            rows = asyncio.run(
                admin_execute(pg_url, f'SELECT version_num FROM "{schema}".cronoq_alembic_version')
            )
            assert len(rows) == 1
        else:
            assert result.returncode != 0
            assert result.stdout.startswith(f"FAILED: cannot connect to {redact(url)} ("), output
            assert "Connect call failed" in result.stdout
