"""The console as an operator runs it: the real ``cronoq-store console`` command in a
subprocess against the suite's PostgreSQL, seeded through the store, and Debian's chromium
driven by Selenium (``chromium`` and ``chromium-driver``; no browser is downloaded)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from sqlalchemy.engine import URL

from cronoq_store._console.security import PASSWORD_ENV, TOKEN_ENV, USER_ENV
from cronoq_store._urls import URL_ENV

from ..support import unused_port
from ..waits import PATIENCE

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: The flags chromium needs as root in a container, and those that keep it off the network.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
)


@dataclass
class Console:
    """A running ``cronoq-store console``: its base URL and its process (stderr captured)."""

    base: str
    process: subprocess.Popen[bytes]
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Reply:
    status: int
    #: By lower-case name.
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body.decode("ascii"))  # ASCII: every oddity escaped

    def text(self) -> str:
        return self.body.decode()


def get(url: str, headers: Mapping[str, str] | None = None, method: str = "GET") -> Reply:
    """One request, whatever its status."""
    request = urllib.request.Request(url, headers=dict(headers or {}), method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Reply(response.status, _lower(response.headers.items()), response.read())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, _lower(exc.headers.items()), exc.read())


def _lower(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers}


async def fetch(url: str, headers: Mapping[str, str] | None = None, method: str = "GET") -> Reply:
    """:func:`get` off the event loop (a store may be leading on it meanwhile)."""
    return await asyncio.to_thread(get, url, headers, method)


def console_command(url: URL, *args: str) -> list[str]:
    full = url.render_as_string(hide_password=False)
    return [sys.executable, "-m", "cronoq_store._cli", "--url", full, "console", *args]


def start_console(
    url: URL,
    tmp_path: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
) -> Console:
    """Start the command and wait until it answers (any HTTP status) on its port."""
    port = unused_port()
    log = tmp_path / f"console-{port}.log"
    environment = {k: v for k, v in os.environ.items() if k != URL_ENV}
    environment.update(env or {})
    with log.open("wb") as sink:
        process = subprocess.Popen(
            console_command(url, "--host", host, "--port", str(port), *args),
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '127.0.0.1') else host}:{port}"
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"console exited {process.returncode}: {log.read_text()}")
        try:
            urllib.request.urlopen(base + "/static/console.css", timeout=2).close()
            break
        except urllib.error.HTTPError:
            break  # it answers (e.g. 401)
        except OSError:
            time.sleep(0.1)
    else:
        process.kill()
        raise AssertionError(f"console did not answer: {log.read_text()}")
    return Console(base, process, log)


def stop_console(console: Console) -> None:
    console.process.terminate()
    try:
        console.process.wait(10)
    except subprocess.TimeoutExpired:
        console.process.kill()
        console.process.wait()


@pytest.fixture
def console_at(pg_url: URL, tmp_path: Path) -> Iterator[Console]:
    """The console on loopback; its pages do not refresh during a test (a refresh swaps the
    elements a test holds), except where a test asks for it (``refreshing``)."""
    console = start_console(pg_url, tmp_path, "--refresh", "3600")
    try:
        yield console
    finally:
        stop_console(console)


@pytest.fixture
def refreshing(pg_url: URL, tmp_path: Path) -> Iterator[Console]:
    """The console on loopback, its pages refreshing every second."""
    console = start_console(pg_url, tmp_path, "--refresh", "1")
    try:
        yield console
    finally:
        stop_console(console)


@pytest.fixture(scope="module")
def chromium() -> Iterator[webdriver.Chrome]:
    """One browser per module (starting one takes about a second)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="cronoq-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture
def browser(chromium: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The module's browser, left on a blank page with its log read out after each test: a
    page of an earlier test's console, polling a server that has stopped, would otherwise
    log its refused connections into the next test."""
    try:
        yield chromium
    finally:
        chromium.get("about:blank")
        chromium.get_log("browser")  # type: ignore[no-untyped-call]


def shots(tmp_path: Path) -> Path:
    """Where screenshots go: ``CRONOQ_CONSOLE_SCREENSHOTS`` if set, else the test's own folder."""
    where = os.environ.get("CRONOQ_CONSOLE_SCREENSHOTS")
    path = Path(where) if where else tmp_path
    path.mkdir(parents=True, exist_ok=True)
    return path


def text_of(browser: webdriver.Chrome, css: str) -> str:
    """The element's text, looked up again if a refresh replaced it meanwhile."""
    for _ in range(10):
        try:
            text: str = browser.find_element(By.CSS_SELECTOR, css).text
            return text
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{css} kept being replaced")


def refused_start(url: URL, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        console_command(url, *args), capture_output=True, text=True, timeout=60, env=env
    )


def without_credentials(**extra: str) -> dict[str, str]:
    """This environment less the console's credentials, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, USER_ENV, PASSWORD_ENV)}
    env.update(extra)
    return env


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def logs(browser: webdriver.Chrome) -> list[dict[str, Any]]:
    """The browser's console messages since the last call."""
    entries: list[dict[str, Any]] = browser.get_log("browser")  # type: ignore[no-untyped-call]
    return entries
