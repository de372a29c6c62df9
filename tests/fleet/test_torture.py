"""The torture test's fleet profile: host processes leading many clusters while processes
are SIGKILLed, added, frozen and their sessions ended at random; nothing acknowledged is
lost, no deposed term writes, no epoch has two processes (``tests/fleet/torture.py``).

The short profile runs in the default suite; ``CRONOQ_TORTURE_PROFILE=long`` runs the long
one (``nox -s torture_long`` runs both torture tests that way). A run is seeded: the seed
(printed, and in the failure message) fixes the fault schedule, not the interleaving.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cronoq_store._domain import task_id

from ..torture.orchestrator import seed_from_env
from .conftest import Fleet
from .torture import FleetReport, Write, check, profile_from_env, run


@pytest.mark.slow
async def test_acknowledged_work_survives_a_fleet_under_faults_and_deposed_terms_never_write(
    fleet: Fleet, tmp_path: Path
) -> None:
    profile, seed = profile_from_env(), seed_from_env()
    workdir = Path(os.environ.get("CRONOQ_TORTURE_DIR") or tmp_path)

    report = await run(profile, seed, fleet, workdir)
    print(report.summary())

    assert not report.violations, report.failure()
    # The run exercised what it claims to prove.
    kinds = {f.kind for f in report.faults}
    assert {"kill", "add", "freeze"} <= kinds, report.failure()
    assert report.takeovers >= profile.clusters // 2, report.failure()
    # A frozen process's commits after its clusters moved: what property 2 is about.
    assert report.terms_fenced_by_database, report.failure()
    assert report.acked_mutations > 0, report.failure()


def test_the_checker_reports_a_lost_ack_a_stale_write_and_an_epoch_of_two_processes() -> None:
    """The checker on a made-up run: each property broken once, and a sound run clean."""
    first, second = task_id(1, 1), task_id(2, 1)
    found = [
        {"k": "lead", "w": "p1", "schema": "c", "epoch": 1, "process": 1},
        {"k": "ack", "w": "p1", "schema": "c", "epoch": 1, "process": 1, "m": [[first, 0, "q"]]},
        {"k": "lead", "w": "p2", "schema": "c", "epoch": 2, "process": 2},
        {"k": "ack", "w": "p2", "schema": "c", "epoch": 2, "process": 2, "m": [[second, 0, "q"]]},
    ]
    rows = {"c": {first: ("queued", 0), second: ("queued", 0)}}
    takes = {("c", 1): ["p1 leader 0a1b2c3d"], ("c", 2): ["p2 leader 4e5f6a7b"]}
    writes = [
        Write("c", first, "queued", 0, None, "INSERT", 1, "p1", 1),
        Write("c", second, "queued", 0, None, "INSERT", 2, "p2", 2),
    ]

    def violations(**changed: Any) -> list[int]:
        report = FleetReport("short", 0, 1, 0.0, [])
        given = {"found": found, "rows": rows, "writes": writes, "takes": takes, **changed}
        check(report, given["found"], given["rows"], given["writes"], given["takes"])
        return sorted(v.prop for v in report.violations)

    assert violations() == []
    assert violations(rows={"c": {second: ("queued", 0)}}) == [1]
    # Epoch 1's write committed after epoch 2 was stored (a fence that did not hold it).
    late = Write("c", first, "queued", 0, None, "INSERT", 1, "p1", 2)
    assert violations(writes=[late, writes[1]]) == [2]
    # Epoch 2 acknowledged by p1 too, which did not take it.
    stray = {"k": "ack", "w": "p1", "schema": "c", "epoch": 2, "process": 1, "m": []}
    assert violations(found=[*found, stray]) == [3]
