"""Values and helpers the tests share, each defined once.

Fixtures live in conftest.py; this module holds what a test calls or reads: the time bases,
the mutations tests commit, the command-line runners, the roles and locks a test sets up
from outside the store. It imports no test module, so any test module can import it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
from click.testing import CliRunner, Result
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.engine import URL

from cronoq_store import PgStore, PgStoreConfig
from cronoq_store._cli import cli
from cronoq_store._domain import (
    Dependency,
    FixedStart,
    MissPolicy,
    Mutation,
    Priority,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)
from cronoq_store._leadership import Leadership
from cronoq_store._migrations import _scripts, head_revision, script_location
from cronoq_store._store import SupportsCommit
from cronoq_store._urls import URL_ENV
from cronoq_store.testing import find_bin_dir

from .pgharness import admin_execute, asyncpg_dsn, without_instance
from .waits import bounded, until

#: The checkout: the working directory and ``PYTHONPATH`` of the processes tests start.
ROOT = Path(__file__).resolve().parent.parent

# Time bases: which one a test uses says what its engine times mean.

#: This process's clocks, as a store in production pairs them.
PROCESS_BASE = TimeBase.now()
#: Engine time 0 is the moment the suite was imported: an engine time is "ns from now".
START_BASE = TimeBase(engine_ns=0, unix_ns=time.time_ns())
#: A fixed wall clock for pure tests, whose values must not move between runs.
FIXED_BASE = TimeBase(engine_ns=0, unix_ns=1_700_000_000 * 10**9)
#: :data:`FIXED_BASE`'s wall clock paired with engine time 1,000, not 0: a conversion that
#: leaves the engine side of the pair out gives another value.
SHIFTED_BASE = TimeBase(engine_ns=1_000, unix_ns=FIXED_BASE.unix_ns)
#: The wall-clock time (Unix ns) at which a pure test's rows are written: after every
#: engine time of :data:`FIXED_BASE` a test uses, and told apart from them.
FIXED_NOW = 1_800_000_000 * 10**9
#: Engine time 0 is 1000 s before the suite was imported: a task finished at a small engine
#: time is old enough for ``prune(1)``.
OLD_BASE = TimeBase(engine_ns=0, unix_ns=START_BASE.unix_ns - 1000 * 10**9)

#: The ranges of PostgreSQL's BIGINT and INTEGER, which the store's columns are, written out
#: here so that a test does not take them from the code it checks.
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

HOUR = 3600 * 10**9
DAY = 24 * HOUR

# Settings that make failover quick enough to test: a lost lock session is noticed within
# about a second.
LOCK_POLL, KEEPALIVE, SESSION_TIMEOUT = 0.05, 0.2, 1.0


def ha_config(
    schema: str, name: str = "cronoq-store", *, keepalive: float = KEEPALIVE
) -> PgStoreConfig:
    """A store's configuration with quick failover, its sessions named ``name``."""
    return PgStoreConfig(
        schema=schema,
        application_name=name,
        lock_poll=LOCK_POLL,
        keepalive=keepalive,
        session_timeout=SESSION_TIMEOUT,
    )


def instance_config(schema: str, name: str, keepalive: float = KEEPALIVE) -> PgStoreConfig:
    """:func:`ha_config` for instance ``name`` of the cluster in ``schema``."""
    return ha_config(schema, f"{name}-{schema}", keepalive=keepalive)


def named_config(schema: str, name: str, **settings: Any) -> PgStoreConfig:
    """A store's configuration, its sessions named ``name`` so a test can find them: it polls
    for the lock every 50 ms and notices a lost lock session within 2 s, quick for a test
    yet roomy on a loaded machine; ``settings`` are the rest."""
    return PgStoreConfig(
        schema=schema,
        application_name=name,
        lock_poll=0.05,
        keepalive=0.2,
        session_timeout=2.0,
        **settings,
    )


#: What the ``make_leadership`` fixture gives: ``(name="a", url=None, **settings)``.
LeadershipFactory = Callable[..., Leadership]


# Mutations. Task ids are either small integers (one store, no epochs involved) or
# ``task_id(epoch, n)`` (ids a leader of that epoch would mint).


def submitted(
    id: int,
    payload: bytes | TaskSpec = b"p",
    *,
    seq: int | None = None,
    arrival: int = 1,
    **spec: Any,
) -> Submitted:
    """Task ``id``, submitted with ``seq`` (default: the id) at engine time ``arrival``; its
    spec has ``payload`` and the ``spec`` fields given, or, when ``payload`` is a whole spec
    already, is that spec with the ``spec`` fields given replaced."""
    whole = replace(payload, **spec) if isinstance(payload, TaskSpec) else TaskSpec(payload, **spec)
    return Submitted(TaskId(id), seq=id if seq is None else seq, arrival=arrival, spec=whole)


def changed(
    id: int, status: TaskStatus, at: int = 0, *, attempt: int = 1, message: str | None = None
) -> StatusChanged:
    """Task ``id`` moved to ``status`` at engine time ``at`` (before a start base's zero
    when negative: ``at=-HOUR`` is an hour ago)."""
    return StatusChanged(TaskId(id), status, attempt=attempt, at=at, message=message)


_seq = itertools.count(1)


def submitted_in(
    epoch: int,
    n: int,
    payload: bytes | None = None,
    *,
    key: str | None = None,
    deps: Sequence[Dependency] = (),
) -> Submitted:
    """Task ``n`` of ``epoch``, submitted now with the next sequence number of this process;
    its payload names it unless given."""
    spec = TaskSpec(b"payload %d" % n if payload is None else payload, key=key, deps=deps)
    return Submitted(task_id(epoch, n), next(_seq), PROCESS_BASE.engine_ns, spec)


def changed_in(epoch: int, n: int, status: TaskStatus, attempt: int = 1) -> StatusChanged:
    """Task ``n`` of ``epoch`` moved to ``status`` now."""
    return StatusChanged(task_id(epoch, n), status, attempt, PROCESS_BASE.engine_ns)


# Stores and what a test does to a cluster from outside them.


@asynccontextmanager
async def open_store(url: URL, schema: str, **config: Any) -> AsyncIterator[PgStore]:
    store = await PgStore.connect(url, PgStoreConfig(schema=schema, **config))
    try:
        yield store
    finally:
        await store.close()


def full(url: URL) -> str:
    """``url`` with its password, as a command line or a child process needs it."""
    return url.render_as_string(hide_password=False)


def pg_client(program: str, url: URL, *args: str) -> str:
    """Run PostgreSQL's client ``program`` (pg_dump, pg_restore) of the embedded binaries
    against ``url``'s database and return what it printed; the password travels in the
    environment."""
    conninfo = f"host={url.host} port={url.port} user={url.username} dbname={url.database}"
    result = subprocess.run(
        [str(find_bin_dir() / program), "--dbname", conninfo, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PGPASSWORD": url.password or ""},
    )
    assert result.returncode == 0, f"{program} failed: {result.stderr}"
    return result.stdout


def unused_port() -> int:
    """A local TCP port nothing listens on (nothing did a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass(frozen=True)
class Role:
    name: str
    url: URL


async def create_role(pg_url: URL, name: str, *, connect: bool = True) -> Role:
    password = secrets.token_urlsafe(18)
    await admin_execute(pg_url, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    if connect:
        await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{pg_url.database}" TO {name}')
    return Role(name, pg_url.set(username=name, password=password))


async def drop_role(pg_url: URL, name: str) -> None:
    await admin_execute(pg_url, f"DROP OWNED BY {name}")
    await admin_execute(pg_url, f"DROP ROLE {name}")


async def stored_ids(url: URL, schema: str) -> list[int]:
    """The ids the cluster in ``schema`` holds, in order, read as an admin."""
    rows = await admin_execute(url, f'SELECT id FROM "{schema}".cronoq_tasks ORDER BY id')
    return [r["id"] for r in rows]


async def execute(store: PgStore, sql: str, **params: Any) -> list[Any]:
    """Raw SQL on ``store``'s engine, in a transaction that commits, ``{s}`` being its
    schema: what the columns hold, and rows the store would never write (corrupt ones)."""
    async with store.engine.begin() as conn:
        stmt = text(sql.replace("{s}", f'"{store.config.schema}"'))
        result = await conn.execute(stmt, params)
        return list(result.all()) if result.returns_rows else []


async def revision_of(url: URL, schema: str) -> str:
    """The schema revision the cluster in ``schema`` records."""
    rows = await admin_execute(url, f'SELECT version_num FROM "{schema}".cronoq_alembic_version')
    return str(rows[0][0])


async def bump_epoch(url: URL, schema: str) -> int:
    """What a new leader does to the leader row: the old epoch is fenced from now on."""
    rows = await admin_execute(
        url, f'UPDATE "{schema}".cronoq_leader SET epoch = epoch + 1 WHERE id = 1 RETURNING epoch'
    )
    return int(rows[0]["epoch"])


class LeaderRowHold:
    """An admin transaction holding the leader row ``FOR UPDATE``: commits and prunes wait
    behind it. ``async with`` holds the row for the block; :meth:`lock` takes it at a point
    of the test's choosing (a fixture then calls :meth:`release`)."""

    def __init__(self, url: URL, schema: str) -> None:
        self.url = url
        self.schema = schema
        self.conn: asyncpg.Connection | None = None
        self.tx: Any = None

    async def lock(self) -> None:
        self.conn = await asyncpg.connect(asyncpg_dsn(self.url))
        self.tx = self.conn.transaction()
        await self.tx.start()
        await self.conn.execute(
            f'SELECT 1 FROM "{self.schema}".cronoq_leader WHERE id = 1 FOR UPDATE'
        )

    async def __aenter__(self) -> LeaderRowHold:
        await self.lock()
        return self

    @property
    def pid(self) -> int:
        """The holding session's server pid, which a wait's message names."""
        assert self.conn is not None, "the row is not held"
        pid: int = self.conn.get_server_pid()
        return pid

    async def waited_on(self, work: asyncio.Future[Any], what: str) -> None:
        """Until a session waits for the row held here; ``work`` ending first fails: it
        did not wait."""
        conn = self.conn
        assert conn is not None, "the row is not held"

        async def blocked() -> bool:
            # This session's transaction holds the lock, and the server reads
            # pg_stat_activity once per transaction: without a fresh look, every check
            # would see the sessions as they were at the first.
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            waiting = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                conn.get_server_pid(),
            )
            return work.done() or bool(waiting)

        await until(blocked, what)
        assert not work.done(), f"{what}: it ended without waiting ({work})"

    async def execute(self, sql: str) -> None:
        assert self.conn is not None
        await self.conn.execute(sql)

    async def release(self, commit: bool = False) -> None:
        """End the transaction (once); waiting commits proceed."""
        if self.conn is None:
            return
        try:
            if commit:
                await self.tx.commit()
            else:
                await self.tx.rollback()
        finally:
            await self.conn.close()
            self.conn = None

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


def app_name(schema: str) -> str:
    """A name of the test's own, so terminating backends hits no other test's sessions."""
    return f"gc-{schema}"


async def waiting_on_lock(url: URL, application_name: str) -> bool:
    rows = await admin_execute(
        url,
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = $1 AND wait_event_type = 'Lock'",
        application_name,
    )
    return int(rows[0][0]) > 0


async def settles(url: URL, name: str, task: asyncio.Task[object]) -> None:
    """Until the sessions of ``name`` wait on a lock, or ``task`` is done (it did not wait)."""

    async def settled() -> bool:
        return task.done() or await waiting_on_lock(url, name)

    await until(settled, f"{name} waiting on a lock or finished", every=0.01)


async def lock_waited(url: URL, application_name: str) -> None:
    """Until a session named ``application_name`` waits on a lock: what ends it then ends
    a statement that waits, not one still on its way."""
    await until(lambda: waiting_on_lock(url, application_name), f"{application_name} waiting")


def leader_app(schema: str, name: str) -> str:
    """The ``application_name`` of instance ``name``'s lock session."""
    return f"{instance_config(schema, name).application_name} leader"


async def lock_holders(url: URL, key: tuple[int, int]) -> list[tuple[int, str]]:
    """``(pid, application_name)`` of the sessions holding the advisory lock ``key``, a lock
    session's name without its instance id."""
    rows = await admin_execute(
        url,
        "SELECT l.pid, a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.classid::bigint = $1 AND l.objid::bigint = $2 AND l.objsubid = 2",
        key[0],
        key[1] & 0xFFFFFFFF,  # objid is an unsigned oid
    )
    return [(r[0], without_instance(r[1])) for r in rows]


async def lead(leadership: Leadership) -> int:
    """``acquire()``, bounded: a test that cannot lead fails instead of hanging."""
    return await bounded(leadership.acquire(), "the leadership")


def texts_of(exc: BaseException) -> str:
    """``str`` and ``repr`` of an exception, its arguments and its whole chain."""
    out, seen, todo = [], set(), [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        out += [str(e), repr(e), *map(repr, e.args)]
        todo += [x for x in (e.__cause__, e.__context__, getattr(e, "orig", None)) if x]
    return "\n".join(out)


async def run(*args: str, env: dict[str, str | None] | None = None) -> Result:
    """Invoke the CLI as a user would, on a wide terminal so tables do not wrap."""
    environment: dict[str, str | None] = {URL_ENV: None, "COLUMNS": "250"}
    environment.update(env or {})
    runner = CliRunner()
    return await asyncio.to_thread(
        runner.invoke, cli, list(args), env=environment, catch_exceptions=False
    )


def without_ages(text: str) -> str:
    """Printed text less how long ago each time was, which moves between two runs."""
    return re.sub(r" \((?:[^()]* ago|just now|in [^()]*)\)", "", text)


async def run_cli(url: URL, schema: str, *args: str) -> Result:
    """:func:`run` on the cluster in ``schema``."""
    return await run("--url", full(url), "--schema", schema, *args)


def cli_command(url: URL, schema: str, *args: str) -> list[str]:
    """The CLI's command line on ``schema``, for a process of its own."""
    return [
        sys.executable,
        "-m",
        "cronoq_store._cli",
        "--url",
        full(url),
        "--schema",
        schema,
        *args,
    ]


def cli_environment(**extra: str) -> dict[str, str]:
    """This environment for a CLI process, less its terminal size, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(PYTHONPATH=str(ROOT), TERM="xterm", **extra)
    return env


def older_revisions() -> Iterator[str]:
    """Every revision below this build's head, oldest first."""
    script = _scripts(str(script_location()))
    for revision in reversed(list(script.walk_revisions())):
        if revision.revision != head_revision():
            yield revision.revision


def alembic(
    *args: str, url: URL | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run Alembic's command line from the checkout (it exits non-zero on ``FAILED:``)."""
    env = {k: v for k, v in os.environ.items() if k != "CRONOQ_DATABASE_URL"}
    if url is not None:
        env["CRONOQ_DATABASE_URL"] = url.render_as_string(hide_password=False)
    return subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def python_run(
    *args: str, url: URL, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """A command line as an operator runs it, in a process of its own; killed, failing the
    test, if it outlives ``timeout``, so that no process is left behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
    env["CRONOQ_DATABASE_URL"] = url.render_as_string(hide_password=False)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{args} still running after {timeout:g} s") from None
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


async def cronoq(*args: str, url: URL) -> subprocess.CompletedProcess[str]:
    return await python_run("-m", "cronoq_store._cli", *args, url=url)


#: The public modules and the names each exports, pinned.
PUBLIC_NAMES = {
    "cronoq_store": [
        "EPOCH_MAX",
        "EPOCH_MIN",
        "Backoff",
        "BatchTooLargeError",
        "ClusterHostedError",
        "ClusterRef",
        "ClusterReplacedError",
        "CommitterClosedError",
        "CommitterStats",
        "CronSchedule",
        "Dependency",
        "DependencyCondition",
        "FencedError",
        "FixedStart",
        "GroupCommitter",
        "Health",
        "HostedStore",
        "IdCollisionError",
        "IntervalSchedule",
        "KeyTakenError",
        "LockHeldError",
        "LockHolder",
        "MigrationError",
        "MissPolicy",
        "MultiDatabaseHost",
        "Mutation",
        "PgHost",
        "PgHostConfig",
        "PgStore",
        "PgStoreConfig",
        "Priority",
        "Recovered",
        "RecoveredRecurring",
        "RecoveredTask",
        "RecoveredTerminal",
        "RecurringNext",
        "RecurringRemove",
        "RecurringSpec",
        "RecurringUpsert",
        "RetryPolicy",
        "Schedule",
        "SchemaGoneError",
        "StatusChanged",
        "Store",
        "StoreError",
        "StoreQueries",
        "Submitted",
        "TaskId",
        "TaskRecord",
        "TaskRef",
        "TaskSpec",
        "TaskStatus",
        "TimeBase",
        "UnavailableError",
        "UnsupportedParameterError",
        "downgrade",
        "engine_arguments",
        "epoch_of",
        "run_command",
        "scrub",
        "task_id",
        "upgrade",
    ],
    "cronoq_store.testing": [
        "TEST_URL_ENV",
        "EmbeddedPostgres",
        "InMemoryDatabase",
        "InMemoryStore",
        "StopMode",
        "find_bin_dir",
    ],
    "cronoq_store.autogenerate": ["STORE_TABLES", "hiding_store", "include_name", "include_object"],
    "cronoq_store.telemetry": [
        "DISABLED",
        "CommitRecord",
        "Committer",
        "Instrumentable",
        "Leader",
        "Telemetry",
        "instrument",
        "resolve",
    ],
}


ALL_PUBLIC = [(module, name) for module, names in PUBLIC_NAMES.items() for name in names]


#: A spec with every field set, none to its default, each differing from every other, so a
#: value under the wrong column shows.
FULL_SPEC = TaskSpec(
    b"payload",
    kind="kind",
    pool="pool",
    priority=Priority.HIGH,
    key="key",
    deadline=11,
    fixed_start=FixedStart(12, timedelta(seconds=2), MissPolicy.RUN),
    duration_hint=timedelta(seconds=3),
    timeout=timedelta(seconds=4),
    retry=RetryPolicy(),
    deps=[Dependency(TaskId(5))],
    resources={"gpu": 1},
    tags=["t"],
    labels=["l"],
    tenant="tenant",
)


#: A text with NUL in it, and what the store keeps of it: PostgreSQL's text and JSON take no
#: NUL, so U+FFFD stands in its place.
NUL, NUL_CLEANED = "x\0y", "x\ufffdy"
#: :data:`NUL` in every text a spec holds, its JSON columns' included, and a NUL payload
#: (bytes, which the store keeps as they are).
NUL_SPEC = TaskSpec(
    b"\0",
    kind=NUL,
    pool=NUL,
    key=NUL,
    tenant=NUL,
    tags=[NUL],
    labels=[NUL],
    deps=[Dependency(NUL)],
    resources={NUL: 2},
    retry=RetryPolicy(),
    fixed_start=FixedStart(5),
)

# What drawn histories' transitions carry (Hypothesis strategies).

#: A transition's message: none, empty, plain, or holding a NUL, which the store cleans.
MESSAGES = st.sampled_from([None, None, "", "boom", "nul\0here"])
#: A transition's status, the live ones weighted up so that tasks live through several
#: batches.
STATUSES = st.sampled_from([TaskStatus.RUNNING, TaskStatus.RETRYING] * 3 + list(TaskStatus))

# A task's statuses by their short names (a queued task's ``TaskRecord.status`` is None).
QUEUED = None
RUNNING, RETRYING = TaskStatus.RUNNING, TaskStatus.RETRYING
SUCCEEDED, FAILED = TaskStatus.SUCCEEDED, TaskStatus.FAILED
CANCELLED, SKIPPED = TaskStatus.CANCELLED, TaskStatus.SKIPPED


def leadership_of(store: PgStore) -> Leadership:
    """The standalone store's own leader election (a hosted store has none)."""
    leadership = store._leadership
    assert isinstance(leadership, Leadership)
    return leadership


class CommitMeasuredByCommit:
    """A committer's test double's ``_commit_measured`` (``Committable``): the double's own
    ``commit``, the measured size ignored, so a double that scripts or records ``commit``
    sees every batch the group committer sends."""

    async def _commit_measured(
        self: SupportsCommit,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
        size: int,
    ) -> None:
        await self.commit(epoch, base, batch, outputs)
