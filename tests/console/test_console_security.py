"""The console as something exposed: who may read it, what its responses let a browser do,
what it refuses to start with, and what a role that can only read needs. The real command
in a subprocess, over HTTP; one page in chromium with basic-auth credentials."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
import zipfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from sqlalchemy.engine import URL

from cronoq_store import PgStore, task_id
from cronoq_store._cli import ExitCode
from cronoq_store._console.security import PASSWORD_ENV, TOKEN_ENV, USER_ENV
from cronoq_store._domain import Mutation

from ..pgharness import admin_execute
from ..support import FAILED, ROOT, START_BASE, changed, submitted
from ..waits import PATIENCE
from .conftest import (
    Console,
    basic,
    fetch,
    refused_start,
    start_console,
    stop_console,
    without_credentials,
)

TOKEN = "t0ken-" + uuid.uuid4().hex
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "console.example"])
def test_a_non_loopback_bind_refuses_to_start_without_authentication(
    pg_url: URL, host: str
) -> None:
    done = refused_start(pg_url, "--host", host, "--port", "0", env=without_credentials())
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert f"refusing to serve {host} without authentication: set ${TOKEN_ENV}" in done.stderr
    assert pg_url.password
    assert pg_url.password not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({TOKEN_ENV: "short"}, f"${TOKEN_ENV} is shorter than 16 characters"),
        ({USER_ENV: "ops"}, f"set both ${USER_ENV} and ${PASSWORD_ENV}, or neither"),
        ({USER_ENV: "ops", PASSWORD_ENV: "x" * 8}, f"${PASSWORD_ENV} is shorter"),
    ],
)
def test_weak_or_half_given_credentials_refuse_to_start(
    pg_url: URL, extra: dict[str, str], reason: str
) -> None:
    done = refused_start(
        pg_url, "--host", "0.0.0.0", "--port", "0", env=without_credentials(**extra)
    )
    assert done.returncode == ExitCode.USAGE, done.stderr
    assert reason in done.stderr


def test_there_is_no_credential_option(pg_url: URL) -> None:
    """The command line is visible to every user of the machine (ps)."""
    done = refused_start(pg_url, "--help", env=without_credentials())
    assert done.returncode == 0
    assert "--token" not in done.stdout
    assert "--password" not in done.stdout
    assert TOKEN_ENV in done.stdout


async def test_with_credentials_every_request_must_carry_them(
    pg_url: URL, migrated: str, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    env = without_credentials(**{TOKEN_ENV: TOKEN, USER_ENV: "ops", PASSWORD_ENV: "pa55-" + TOKEN})
    console = start_console(pg_url, tmp_path, "--refresh", "1", host="0.0.0.0", env=env)
    # (It refreshes: the browser below checks that a refresh carries the credentials too.)
    try:
        paths = ["/", f"/clusters/{migrated}", "/static/console.js", "/?format=json", "/nope"]
        for path in paths:
            for headers in (
                {},
                {"Authorization": "Bearer wrong-" + TOKEN},
                {"Authorization": "Bearer " + TOKEN[:-1]},
                basic("ops", "wrong"),
                basic("ops", "pa55-" + TOKEN[:-1]),
                {"Authorization": "Basic not-base64!"},
                {"Authorization": TOKEN},
            ):
                reply = await fetch(console.base + path, headers)
                assert reply.status == 401, (path, headers)
                assert reply.headers["www-authenticate"].startswith("Basic ")
                assert "frame-ancestors 'none'" in reply.headers["content-security-policy"]
                assert migrated not in reply.text()
        for headers in (
            {"Authorization": "Bearer " + TOKEN},
            basic("anyone", TOKEN),
            basic("ops", "pa55-" + TOKEN),
        ):
            assert (await fetch(console.base + "/", headers)).status == 200
        # Authenticated, any Host is fine (the credentials are the check, not the name).
        named = await fetch(console.base + "/", {"Host": "console.example", **basic("x", TOKEN)})
        assert named.status == 200

        # A browser with the credentials in the address: the page, and its refreshes.
        port = console.base.rsplit(":", 1)[1]

        def look() -> None:
            browser.get(f"http://ops:{'pa55-' + TOKEN}@127.0.0.1:{port}/")
            WebDriverWait(browser, PATIENCE).until(
                lambda b: b.find_element(By.ID, "refreshed").text.startswith("refreshed ")
            )
            assert browser.find_element(By.CSS_SELECTOR, f"#cluster-{migrated}")

        await asyncio.to_thread(look)
    finally:
        stop_console(console)
    assert TOKEN not in console.stderr()


async def test_without_credentials_only_loopback_host_names_are_served(
    console_at: Console,
) -> None:
    """A page elsewhere that rebinds its own name to 127.0.0.1 reads nothing."""
    for host in ("evil.example", "evil.example:80", "127.0.0.1.nip.io", "10.0.0.1"):
        reply = await fetch(console_at.base + "/", {"Host": host})
        assert reply.status == 421, host
    port = console_at.base.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert (await fetch(console_at.base + "/", {"Host": host})).status == 200, host


class _Inline(HTMLParser):
    """Everything a page has that a no-inline policy would have to allow."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "script":
            self._in_script = True
            if not names.get("src"):
                self.found.append("inline <script>")
        if tag == "style":
            self.found.append("<style>")
        self.found += [f"{tag} {n}=" for n in names if n.startswith("on") or n == "style"]
        if (names.get("href") or "").lower().startswith("javascript:"):
            self.found.append("javascript: link")

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.found.append("script body")


async def test_every_page_forbids_inline_script_and_framing_and_has_none(
    pg_url: URL, store: PgStore, console_at: Console
) -> None:
    schema = store.config.schema
    batch: list[Mutation] = [submitted(1, key="k"), changed(1, FAILED, message="m")]
    batch += [submitted(task_id(1, 5)), submitted(task_id(2, 5))]  # #5 of two epochs
    await store.commit(0, START_BASE, batch, [])
    pages = {
        "/": 200,
        f"/clusters/{schema}": 200,
        f"/clusters/{schema}?pool=default&status=failed": 200,
        f"/clusters/{schema}/task?id=1": 200,
        f"/clusters/{schema}/task?key=k": 200,
        f"/clusters/{schema}/task?id=2": 404,
        f"/clusters/{schema}?status=running": 400,
        f"/clusters/{schema}?before=x": 400,
        f"/clusters/{schema}?since=yesterday": 400,
        f"/clusters/{schema}/task?id=99999999999999999999": 400,
        f"/clusters/{schema}/task?id=0/1": 200,
        f"/clusters/{schema}/task?id=5": 300,
        f"/clusters/{schema}/task?id=1/1": 404,
        f"/clusters/{schema}/live": 200,
        f"/clusters/{schema}/live?pool=default&status=queued&key=k": 200,
        f"/clusters/{schema}/live?status=failed": 400,
        f"/clusters/{schema}/live?after=x": 400,
        f"/clusters/{schema}/live?since=2026-01-01T00:00": 400,
        f"/clusters/{schema}x/live": 404,
        f"/clusters/{schema}/charts": 200,
        f"/clusters/{schema}/charts?end=2026-01-01T00:00": 200,
        f"/clusters/{schema}/charts?end=soon": 400,
        # Within the range of a time, but not the day before it.
        f"/clusters/{schema}/charts?end=1677-09-21T12:00": 400,
        f"/clusters/{schema}x/charts": 404,
        "/clusters/pg_catalog": 404,
        "/clusters/information_schema": 404,
        "/clusters/public": 404,  # exists, holds no cluster
        "/clusters/" + "a" * 64: 404,
        '/clusters/x";drop': 404,
        f"/clusters/{schema}x": 404,
    }
    for path, status in pages.items():
        reply = await fetch(console_at.base + path)
        assert reply.status == status, (path, reply.text())
        policy = reply.headers["content-security-policy"]
        # Written out: the charts' library needs no exception to it, and gets none.
        assert policy == POLICY, path
        assert "script-src 'self'" in policy
        assert "unsafe-inline" not in policy
        assert "frame-ancestors 'none'" in policy
        assert reply.headers["x-frame-options"] == "DENY"
        assert reply.headers["x-content-type-options"] == "nosniff"
        parser = _Inline()
        parser.feed(reply.text())
        assert parser.found == [], path
        assert pg_url.password
        assert pg_url.password not in reply.text()
        as_json = await fetch(
            console_at.base + path + ("&" if "?" in path else "?") + "format=json"
        )
        assert as_json.status == status
        assert as_json.headers["content-type"] == "application/json"
        assert pg_url.password not in as_json.text()
    # Read-only: nothing but GET.
    for method in ("POST", "PUT", "DELETE"):
        assert (await fetch(console_at.base + "/", method=method)).status == 405, method
    assert str(pg_url.password) not in console_at.stderr()


async def test_a_schema_behind_this_build_is_shown_not_read(
    pg_url: URL, store: PgStore, console_at: Console
) -> None:
    schema = store.config.schema
    await admin_execute(
        pg_url, f"UPDATE \"{schema}\".cronoq_alembic_version SET version_num = '9999_future'"
    )
    (cluster,) = [
        c
        for c in (await fetch(console_at.base + "/?format=json")).json()["clusters"]
        if c["schema"] == schema
    ]
    assert cluster["revision_state"] == "newer than this build"
    assert cluster["health_exit_code"] == ExitCode.NEWER_DATABASE
    assert "live" not in cluster
    assert (await fetch(f"{console_at.base}/clusters/{schema}/task?id=1")).status == 409
    assert (await fetch(f"{console_at.base}/clusters/{schema}/charts")).status == 409


async def test_a_role_that_can_only_read_sees_every_page(
    pg_url: URL, store: PgStore, tmp_path: Path
) -> None:
    """The grants docs/console.md lists: USAGE on the schema, SELECT on its tables."""
    schema = store.config.schema
    await store.commit(0, START_BASE, [submitted(1, key="k"), changed(1, FAILED, message="m")], [])
    role, password = f"ro_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await admin_execute(pg_url, f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
    try:
        await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{pg_url.database}" TO {role}')
        await admin_execute(pg_url, f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await admin_execute(pg_url, f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
        reader = pg_url.set(username=role, password=password)
        console = start_console(reader, tmp_path)
        try:
            doc = (await fetch(console.base + "/?format=json")).json()
            (cluster,) = [c for c in doc["clusters"] if c["schema"] == schema]
            assert cluster["at_head"]
            assert cluster["live"] == []
            assert cluster["finished"]["statuses"] == [{"status": "failed", "count": 1}]
            page = (await fetch(f"{console.base}/clusters/{schema}?format=json")).json()
            assert [t["key"] for t in page["finished"]["tasks"]] == ["k"]
            task = await fetch(f"{console.base}/clusters/{schema}/task?key=k&format=json")
            assert task.json()["message"] == "m"
            live = (await fetch(f"{console.base}/clusters/{schema}/live?format=json")).json()
            assert live["live"]["tasks"] == []
            charts = await fetch(f"{console.base}/clusters/{schema}/charts?format=json")
            assert charts.status == 200, charts.text()
            assert charts.json()["backlog"]["live"] == 0
            assert password not in console.stderr()
        finally:
            stop_console(console)
        # Without SELECT, the cluster's page says so instead of failing obscurely.
        await admin_execute(pg_url, f'REVOKE SELECT ON ALL TABLES IN SCHEMA "{schema}" FROM {role}')
        console = start_console(reader, tmp_path)
        try:
            reply = await fetch(f"{console.base}/clusters/{schema}")
            assert reply.status == 500
            assert "permission denied for table cronoq_alembic_version" in reply.text()
            assert password not in reply.text()
            # The overview still shows, with the reason beside that schema.
            overview = await fetch(console.base + "/?format=json")
            assert overview.status == 200
            (refused,) = [c for c in overview.json()["clusters"] if c["schema"] == schema]
            assert "permission denied" in refused["refused"]
        finally:
            stop_console(console)
    finally:
        await admin_execute(pg_url, f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {role}')
        await admin_execute(pg_url, f'REVOKE ALL ON SCHEMA "{schema}" FROM {role}')
        await admin_execute(pg_url, f'REVOKE ALL ON DATABASE "{pg_url.database}" FROM {role}')
        await admin_execute(pg_url, f"DROP ROLE {role}")


@pytest.mark.slow
def test_the_wheel_ships_the_templates_and_static_files(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(dist),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    with zipfile.ZipFile(next(dist.glob("cronoq_store-*.whl"))) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith("METADATA"))).decode()
    console = ROOT / "cronoq_store/_console"
    shipped = {p.relative_to(ROOT).as_posix() for p in console.rglob("*") if p.is_file()}
    shipped = {p for p in shipped if "__pycache__" not in p}
    # The directory read is the console's: its templates, its script and the vendored
    # chart library with its licence are among what must ship.
    vendored = "cronoq_store/_console/static/vendor/uplot-1.6.32/"
    for needed in (
        "cronoq_store/_console/templates/charts.html",
        "cronoq_store/_console/static/charts.js",
        vendored + "uPlot.iife.min.js",
        vendored + "uPlot.min.css",
        vendored + "LICENSE",
    ):
        assert needed in shipped, needed
    assert shipped - names == set()
    assert "Provides-Extra: console" in metadata
