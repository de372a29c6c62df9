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

import pytest

from ..torture.orchestrator import seed_from_env
from .conftest import Fleet
from .torture import profile_from_env, run

pytestmark = pytest.mark.slow


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
