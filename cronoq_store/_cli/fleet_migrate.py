"""``cronoq-store migrate --all`` (or ``--schemas``): every selected cluster to head, in
``--jobs`` worker processes.

Why processes: Alembic keeps the running command in module globals, so one process runs
one migration at a time (:func:`cronoq_store._migrations.run_command`); several processes
run several. Each worker (:mod:`cronoq_store._cli.migrate_worker`) migrates the schemas
the parent hands it one at a time, so the interpreter starts once per worker, not once per
cluster. The URL reaches it in its environment (never on its command line, which any local
user can read); its stderr is printed line by line after the schema it is on.

Resumable: each schema's migration is one transaction, and a schema at head is not
handed to a worker, so a second run does only what the first left. Interrupted (SIGINT or
SIGTERM), the parent hands out nothing more and waits for the migrations running, each
ending committed or rolled back; a second signal asks the workers to stop (SIGINT: each
cancels its statements and the server rolls its transaction back), a third kills them.
Workers run in sessions of their own, so a terminal's Ctrl-C reaches the parent alone; on
Linux each also gets SIGINT if the parent dies, so that no migration runs on with nobody
watching.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import click
from sqlalchemy.ext.asyncio import AsyncEngine

from .. import _door as door
from .._errors import MigrationError, StoreError
from .._migrations import RevisionStatus
from .._terminal_safe import visible
from .._urls import URL_ENV, scrub
from . import database, fleet
from .app import SCHEMA_ENV, Options
from .exits import CliError, ExitCode, code_of, silence_stdout, worst

__all__ = ["Outcome", "migrate_clusters"]

#: Why a cluster's migration did not run: the run was interrupted, or stopped at a failure.
_NOT_STARTED = "not started"
#: Why a cluster's migration did not run: its schema was dropped since the listing. Not a
#: failure: nothing is left for a next run to do.
_GONE = "the schema is gone since the listing"
#: Seconds the parent waits for a worker it killed to be gone.
_REAP = 10.0


class Outcome(Enum):
    """How one cluster's part of the run ended."""

    MIGRATED = "migrated"
    CURRENT = "already current"
    FAILED = "failed"
    REFUSED = "refused"
    #: Not started (interrupted, or ``--fail-fast`` after a failure), or stopped by a
    #: second signal before it committed: the next run does it.
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class _Done:
    schema: str
    outcome: Outcome
    before: str = "-"
    after: str = "-"
    seconds: float = 0.0
    code: ExitCode = ExitCode.OK
    message: str = ""


class _Run:
    """The state the signal handler and the workers share."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.finished = 0
        self.signals: list[int] = []
        self.failed = False
        self.children: set[asyncio.subprocess.Process] = set()
        #: Whether standard output was closed (``| head -1``, a pager quit early).
        self.reader_gone = False

    @property
    def stopping(self) -> bool:
        return bool(self.signals) or self.reader_gone

    def say(self, text: str) -> None:
        """Print a line on standard output while anyone reads it. The first write to a
        closed one stops the run as a first signal would: nothing more starts, and the
        migrations running end committed or rolled back (a broken pipe is no reason to kill
        them, nor to say the server cannot be reached)."""
        if self.reader_gone:
            return
        try:
            click.echo(text)
        except BrokenPipeError:
            self.reader_gone = True
            silence_stdout()
            click.echo(
                "standard output closed: starting no more migrations; waiting for those "
                f"running in {len(self.children)} worker(s) to commit or roll back",
                err=True,
            )

    def on_signal(self, signum: int) -> None:
        self.signals.append(signum)
        name = signal.Signals(signum).name
        if len(self.signals) + self.reader_gone == 1:
            click.echo(
                f"{name}: starting no more migrations; waiting for those running in "
                f"{len(self.children)} worker(s) to commit or roll back (signal again to "
                "cancel them)",
                err=True,
            )
            return
        stop = signal.SIGINT if len(self.signals) + self.reader_gone == 2 else signal.SIGKILL
        click.echo(
            f"{name}: sending {stop.name} to the {len(self.children)} worker(s)",
            err=True,
        )
        for child in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(stop)


def _die_with_parent() -> None:
    """In a worker, before it runs Python: SIGINT when the parent dies (Linux'
    ``PR_SET_PDEATHSIG``); elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGINT), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _signals_handled(run: _Run) -> Iterator[None]:
    """SIGINT and SIGTERM go to ``run`` while it lasts (only the main thread may set
    handlers: elsewhere, as in a test's runner, signals keep their effect)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, run.on_signal, signum)
    try:
        yield
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def _revision(options: Options, schema: str, engine: AsyncEngine) -> RevisionStatus:
    """Where the schema stands, read through the CLI's opening (the trust check first)."""
    one = Options(
        url=options.url,
        schema=schema,
        trusted_triggers=options.trusted_triggers,
        lock_wait=options.lock_wait,
    )
    async with database.database(one, engine) as conn:
        return await database.revision(conn, schema)


def _words(status: RevisionStatus) -> str:
    return ", ".join(status.current) or "nothing"


async def _check(options: Options, schema: str, engine: AsyncEngine) -> _Done | None:
    """The cluster's outcome when no worker need see it (refused, at head, unreadable,
    gone); ``None`` when it is to be migrated."""
    started = time.monotonic()
    try:
        async with door.translated(f"reading schema {schema!r}", passing=(CliError,)):
            status = await _revision(options, schema, engine)
    except CliError as exc:
        return _Done(schema, Outcome.FAILED, code=exc.code, message=scrub(str(exc), [options.url]))
    except MigrationError as exc:
        return _Done(schema, Outcome.REFUSED, code=ExitCode.FAILED, message=f"refused: {exc}")
    except StoreError as exc:
        return _Done(
            schema, Outcome.FAILED, code=code_of(exc), message=scrub(str(exc), [options.url])
        )
    except Exception as exc:  # one cluster's failure never ends the run
        return _Done(
            schema, Outcome.FAILED, code=ExitCode.FAILED, message=fleet.unexpected(exc, options.url)
        )
    before = _words(status)
    if status.at_head:
        return _Done(schema, Outcome.CURRENT, before, before, time.monotonic() - started)
    if not status.current:
        return _Done(schema, Outcome.SKIPPED, message=_GONE)
    return None


#: How a worker starts: with nothing from the working directory on ``sys.path``. ``python
#: -m`` puts that directory first, so a module there (a stray ``argparse.py`` in a shared
#: directory such as /tmp) would run with the URL and its password in the environment.
#: Python 3.11's ``-P`` keeps it off; before 3.11 the ``-c`` program removes the entry
#: (``''``, the working directory) before it imports anything but ``sys``. Not ``-I``: it
#: also ignores ``PYTHONPATH`` and the user's site directory, where the package may be.
_WORKER_COMMAND: tuple[str, ...] = (
    (sys.executable, "-P", "-m", "cronoq_store._cli.migrate_worker")
    if sys.version_info >= (3, 11)
    else (
        sys.executable,
        "-c",
        "import sys; del sys.path[0]; "
        "from cronoq_store._cli.migrate_worker import main; main(sys.argv[1:])",
    )
)


def _forwarded(line: str) -> str:
    """A line of a worker's stderr made safe for a terminal: :func:`visible`'s rule, but
    for backslashes, which the worker's log lines have doubled already (again would show
    each as two pairs)."""
    if line.isascii() and line.isprintable():
        return line
    return "".join(char if char == "\\" else visible(char) for char in line)


class _Worker:
    """One worker process and the schema it is on."""

    def __init__(self, process: asyncio.subprocess.Process, url: str | None) -> None:
        self.process = process
        self.schema = "-"
        self.last = ""
        self._forwarding = asyncio.ensure_future(self._forward(url))

    @classmethod
    async def start(cls, options: Options, lock_timeout: float) -> _Worker:
        env = {k: v for k, v in os.environ.items() if k not in (URL_ENV, SCHEMA_ENV)}
        env[URL_ENV] = options.database_url()
        triggers = [
            arg for name in sorted(options.trusted_triggers) for arg in ("--trusted-trigger", name)
        ]
        process = await asyncio.create_subprocess_exec(
            *_WORKER_COMMAND,
            *triggers,
            "--lock-timeout",
            repr(lock_timeout),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        return cls(process, options.url)

    async def _forward(self, url: str | None) -> None:
        """Print the worker's stderr on ours, each line after the schema it is on."""
        stream = self.process.stderr
        assert stream is not None
        async for raw in stream:
            line = _forwarded(scrub(raw.decode("utf-8", "replace").rstrip("\n"), [url]))
            if line:
                self.last = line
                click.echo(f"{visible(self.schema)}: {line}", err=True)

    async def migrate(self, schema: str) -> dict[str, Any] | None:
        """The worker's answer for ``schema``; ``None`` if it ended without one."""
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None
        assert stdout is not None
        self.schema = schema
        try:
            stdin.write(schema.encode() + b"\n")
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            return None
        line = await stdout.readline()
        if not line:
            return None
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def close(self) -> int:
        """End of input: the worker ends once its schema is done; its exit status."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        returned = await self.process.wait()
        await self._forwarding
        return returned


async def _migrate_one(
    options: Options, schema: str, engine: AsyncEngine, run: _Run, worker: _Worker
) -> _Done:
    """``schema`` migrated by ``worker``, as the worker tells it; a worker that ended
    without answering was stopped by a signal (the next run does it) or failed."""
    started = time.monotonic()
    answer = await worker.migrate(schema)
    if answer is not None:
        code = ExitCode(answer["code"]) if answer["code"] in _CODES else ExitCode.FAILED
        said = (schema, Outcome.MIGRATED, answer["before"], answer["after"], answer["seconds"])
        if answer.get("gone"):
            return _Done(*said[:1], Outcome.SKIPPED, *said[2:], message=_GONE)
        if code is ExitCode.OK:
            return _Done(*said)
        if run.signals[1:]:  # cancelled by the second signal, rolled back
            return _Done(*said[:1], Outcome.SKIPPED, *said[2:], message="cancelled")
        return _Done(*said[:1], Outcome.FAILED, *said[2:], code, answer["message"])
    returned = await worker.close()
    try:
        after = _words(await _revision(options, schema, engine))
    except Exception:  # only a word of the line: "?" says it was not read
        after = "?"
    seconds = time.monotonic() - started
    if run.signals[1:]:
        # Stopped by the signal the parent sent before it committed: rolled back, the next
        # run does it.
        return _Done(schema, Outcome.SKIPPED, after, after, seconds, message="cancelled")
    if returned < 0:
        # A signal from elsewhere (kill -9, the OOM killer): nobody asked for it.
        message = f"the worker was killed by {_signal_name(-returned)}"
    else:
        message = worker.last.removeprefix("Error: ") or f"the worker process exited {returned}"
    return _Done(schema, Outcome.FAILED, "?", after, seconds, ExitCode.FAILED, message)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: Exit codes a worker may answer.
_CODES = frozenset(int(code) for code in ExitCode)


def _line(done: _Done, run: _Run, width: int) -> str:
    """A cluster's progress line: ``[n/N] SCHEMA  FROM -> TO  SECONDS  OUTCOME``."""
    count = f"[{run.finished}/{run.total}]"
    name = f"{visible(done.schema):<{width}}"
    if done.outcome is Outcome.CURRENT:
        return f"{count} {name}  at {done.after}  already current"
    if done.outcome is Outcome.REFUSED:
        return f"{count} {name}  {visible(done.message)}"
    if done.outcome is Outcome.SKIPPED and done.message in (_NOT_STARTED, _GONE):
        return f"{count} {name}  skipped ({done.message})"
    moved = f"{done.before} -> {done.after}  {done.seconds:.2f} s"
    if done.outcome is Outcome.MIGRATED:
        return f"{count} {name}  {moved}  ok"
    if done.outcome is Outcome.SKIPPED:
        return f"{count} {name}  {moved}  skipped ({done.message})"
    return f"{count} {name}  {moved}  failed (exit {int(done.code)}): {visible(done.message)}"


async def migrate_clusters(
    options: Options, chosen: fleet.Selection, jobs: int, lock_timeout: float, fail_fast: bool
) -> int:
    """Migrate the clusters of ``chosen`` to head, ``jobs`` at once; print a line as each
    finishes and a summary; return the exit code (the gravest failure's, or 128 + the
    signal's number after an interruption)."""
    url = options.database_url()
    started = time.monotonic()
    engine = database.engine(url, lock_wait=options.lock_wait, pool_size=jobs)
    try:
        clusters = await fleet.select(options, chosen, engine)
        run = _Run(len(clusters))
        width = max(len(visible(c.schema)) for c in clusters)
        queue: asyncio.Queue[fleet.Cluster] = asyncio.Queue()
        for cluster in clusters:
            queue.put_nowait(cluster)
        results: list[_Done] = []

        def finish(done: _Done) -> None:
            run.finished += 1
            results.append(done)
            if done.outcome in (Outcome.FAILED, Outcome.REFUSED):
                run.failed = True
            run.say(_line(done, run, width))

        async def worker() -> None:
            process: _Worker | None = None
            try:
                while not queue.empty():
                    cluster = queue.get_nowait()
                    if cluster.refusal is not None:
                        finish(
                            _Done(
                                cluster.schema,
                                Outcome.REFUSED,
                                code=ExitCode.FAILED,
                                message=cluster.refusal,
                            )
                        )
                        continue
                    if run.stopping or (fail_fast and run.failed):
                        finish(_Done(cluster.schema, Outcome.SKIPPED, message=_NOT_STARTED))
                        continue
                    checked = await _check(options, cluster.schema, engine)
                    if checked is not None:
                        finish(checked)
                        continue
                    if run.stopping:
                        finish(_Done(cluster.schema, Outcome.SKIPPED, message=_NOT_STARTED))
                        continue
                    try:
                        if process is None or process.process.returncode is not None:
                            process = await _Worker.start(options, lock_timeout)
                            run.children.add(process.process)
                        done = await _migrate_one(options, cluster.schema, engine, run, process)
                    except Exception as exc:  # one cluster's failure never ends the run
                        done = _Done(
                            cluster.schema,
                            Outcome.FAILED,
                            code=ExitCode.FAILED,
                            message=fleet.unexpected(exc, options.url),
                        )
                        if process is not None:  # out of step with us: let it end
                            await process.close()
                            run.children.discard(process.process)
                            process = None
                    finish(done)
            finally:
                if process is not None:
                    await process.close()
                    run.children.discard(process.process)

        with _signals_handled(run):
            workers = [asyncio.ensure_future(worker()) for _ in range(min(jobs, len(clusters)))]
            try:
                await asyncio.gather(*workers)
            finally:
                for task in workers:
                    task.cancel()
                await _reap(run)
    finally:
        await engine.dispose()
    by = {o: sum(1 for d in results if d.outcome is o) for o in Outcome}
    code = worst(d.code for d in results)
    interrupted = (
        f"; interrupted by {signal.Signals(run.signals[0]).name}: run the same command again "
        "to finish"
        if run.signals
        else ""
    )
    run.say(
        f"summary: {len(clusters)} cluster(s), {chosen.words()}: migrated "
        f"{by[Outcome.MIGRATED]}, already current {by[Outcome.CURRENT]}, failed "
        f"{by[Outcome.FAILED]}, refused {by[Outcome.REFUSED]}, skipped {by[Outcome.SKIPPED]} "
        f"in {time.monotonic() - started:.1f} s{interrupted}"
    )
    if run.signals:
        return 128 + run.signals[0]
    if run.reader_gone:
        return int(ExitCode.FAILED)
    if code is ExitCode.OK and any(
        d.outcome is Outcome.SKIPPED and d.message != _GONE for d in results
    ):
        code = ExitCode.FAILED
    return int(code)


async def _reap(run: _Run) -> None:
    """Leave no child behind: one still running (the workers were cancelled) is killed and
    waited for."""
    for child in list(run.children):
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(child.wait(), _REAP)
