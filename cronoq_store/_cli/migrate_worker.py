"""``python -P -m cronoq_store._cli.migrate_worker``: one process of ``migrate --all``'s pool
(:mod:`cronoq_store._cli.fleet_migrate`).

It reads schema names on stdin, one a line, migrates each to head in turn, and answers each
with one JSON line on stdout: ``schema``, ``before`` and ``after`` (revisions in words),
``seconds``, ``code`` (the single-schema command's exit code), ``message``, and ``gone``:
whether the schema held no cluster any more (dropped since the parent listed it), in
which case nothing ran and nothing was created. One
process runs one Alembic command at a time, as Alembic's module globals require; a process
that lives for many schemas pays the interpreter's start (about a second of CPU) once, not
once per cluster. The URL comes from ``$CRONOQ_DATABASE_URL``, never the command line;
the store's log lines (a lock it waits for) go to stderr, where the parent prints them
after the schema's name. End of input ends it.

Not imported by the CLI's package: run as ``__main__`` it must not be imported twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from .. import _door as door
from .._errors import StoreError
from .._migrations import ClusterGone, upgrade
from .._urls import URL_ENV, scrub
from . import database, output
from .app import Options
from .exits import CliError, ExitCode, code_of

__all__ = ["main", "migrate_schema"]


async def migrate_schema(
    url: str,
    schema: str,
    trusted_triggers: frozenset[str],
    lock_timeout: float,
    engine: AsyncEngine,
) -> dict[str, Any]:
    """Migrate ``schema`` to head as ``cronoq-store --schema SCHEMA migrate`` does (the
    trust check first, a newer schema refused with 5), and say how it went."""
    started = time.monotonic()
    options = Options(url=url, schema=schema, trusted_triggers=trusted_triggers)
    before = after = "?"
    code, message, gone = ExitCode.OK, "", False
    try:
        async with door.translated(f"migrating schema {schema!r}", passing=(CliError,)):
            async with database.database(options, engine) as conn:
                status = await database.revision(conn, schema)
            before = ", ".join(status.current) or "nothing"
            if status.unknown:
                database.refuse_unless_at_head(status)
            await upgrade(
                engine,
                schema,
                trusted_triggers=trusted_triggers,
                lock_timeout=lock_timeout,
                must_exist=True,
            )
            async with database.database(options, engine) as conn:
                status = await database.revision(conn, schema)
            after = ", ".join(status.current) or "nothing"
    except CliError as exc:
        code, message = exc.code, str(exc)
    except ClusterGone as exc:
        gone, message = True, str(exc)
    except StoreError as exc:
        code, message = code_of(exc), str(exc)
    except Exception as exc:  # the answer says it; the next schema still runs
        code, message = ExitCode.FAILED, f"unexpected {type(exc).__name__}: {exc}"
    return {
        "schema": schema,
        "before": before,
        "after": after,
        "seconds": round(time.monotonic() - started, 3),
        "code": int(code),
        "message": scrub(message, [url]),
        "gone": gone,
    }


async def _serve(url: str, trusted_triggers: frozenset[str], lock_timeout: float) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    engine = database.engine(url)
    try:
        while line := await reader.readline():
            schema = line.decode().strip()
            answer = await migrate_schema(url, schema, trusted_triggers, lock_timeout, engine)
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cronoq_store._cli.migrate_worker")
    parser.add_argument("--trusted-trigger", action="append", default=[])
    parser.add_argument("--lock-timeout", type=float, required=True)
    args = parser.parse_args(argv)
    url = os.environ[URL_ENV]
    try:
        with output.store_log_on_stderr():
            asyncio.run(_serve(url, frozenset(args.trusted_trigger), args.lock_timeout))
    except KeyboardInterrupt:
        # The parent's second signal (or the parent's death): the statement was cancelled
        # and the server rolls the transaction back. No traceback to forward: 130 says it.
        sys.exit(130)


if __name__ == "__main__":
    main()
