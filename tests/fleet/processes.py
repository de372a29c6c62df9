"""Host processes of the fleet tests as OS processes (``tests/fleet/worker.py``), and what
a test reads of them: their journals, the rows their terms wrote, who holds what."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy.engine import URL

from ..pgharness import admin_execute
from ..support import ROOT
from .conftest import Fleet
from .worker import WORKER_URL

Record = dict[str, object]


async def start_worker(
    url: URL, fleet: Fleet, name: str, journal: Path, options: Sequence[str] = ()
) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
    env["PYTHONPATH"] = str(ROOT)
    named = url.update_query_dict({"application_name": name})
    env[WORKER_URL] = named.render_as_string(hide_password=False)
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fleet.worker",
        fleet.control,
        fleet.group,
        name,
        str(journal),
        *options,
        cwd=ROOT,
        env=env,
    )


def records(*journals: Path) -> list[Record]:
    found = []
    for path in journals:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:  # a line still being written
                continue
    return found


def of(found: list[Record], kind: str, **match: object) -> list[Record]:
    return [r for r in found if r["k"] == kind and all(r.get(k) == v for k, v in match.items())]


def num(record: Record, key: str) -> float:
    value = record[key]
    assert isinstance(value, int | float)
    return float(value)


async def epoch_rows(url: URL, terms: dict[str, int]) -> dict[str, set[int]]:
    """Each schema's stored task ids issued under the given term's epoch."""
    found = {}
    for schema, epoch in terms.items():
        rows = await admin_execute(
            url,
            f'SELECT id FROM "{schema}".cronoq_tasks WHERE id >= $1 AND id < $2',
            epoch << 48,
            (epoch + 1) << 48,
        )
        found[schema] = {int(r["id"]) for r in rows}
    return found


async def diagnosis(fleet: Fleet, schemas: Sequence[str]) -> str:
    """Who holds what on ``schemas``' tables, every session's state, and their control rows:
    what a failed wait for a takeover shows."""
    locks = await admin_execute(
        fleet.url,
        "SELECT l.pid, n.nspname || '.' || c.relname AS rel, l.mode, l.granted, a.state, "
        "a.wait_event_type, a.wait_event, a.application_name, a.backend_xid, "
        "now() - a.state_change AS since, left(a.query, 160) AS query "
        "FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE n.nspname = ANY($1)",
        list(schemas),
    )
    sessions = await admin_execute(
        fleet.url,
        "SELECT pid, application_name, state, wait_event_type, wait_event, backend_xid, "
        "now() - state_change AS since, left(query, 160) AS query FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    rows = await admin_execute(
        fleet.url,
        f'SELECT * FROM "{fleet.control}".clusters WHERE schema_name = ANY($1)',
        list(schemas),
    )
    shown = [("locks", locks), ("sessions", sessions), ("control rows", rows)]
    return "\n".join(f"{name}:\n" + "\n".join(str(dict(r)) for r in found) for name, found in shown)


async def claimed_at(url: URL, schema: str, epoch: int) -> float:
    """When the first epoch after ``epoch`` was taken (server clock, epoch seconds)."""
    rows = await admin_execute(
        url,
        f'SELECT extract(epoch FROM min(began_at)) AS at FROM "{schema}".cronoq_leader_history '
        "WHERE epoch > $1",
        epoch,
    )
    return float(rows[0]["at"])
