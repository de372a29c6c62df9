"""The failover torture test: three store instances in processes, faults at random.

The short profile (about 70 s) runs in the default suite; the long one (at least 200
leadership changes and 100,000 acknowledged mutations) runs with
``CRONOQ_TORTURE_PROFILE=long``. A run is seeded: the seed (printed, and in the failure
message) fixes the fault schedule and every instance's choices; timing is real, so a seed
replays the same faults, not the same interleaving. See tests/torture/ and
docs/reliability.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cronoq_store.testing import find_bin_dir

from .torture.orchestrator import profile_from_env, run_torture, seed_from_env

pytestmark = pytest.mark.slow


async def test_acknowledged_work_survives_faults_and_deposed_leaders_never_write(
    tmp_path: Path,
) -> None:
    try:
        find_bin_dir()
    except RuntimeError as exc:
        pytest.skip(f"the torture test runs its own PostgreSQL: {exc}")
    profile, seed = profile_from_env(), seed_from_env()
    workdir = Path(os.environ.get("CRONOQ_TORTURE_DIR") or tmp_path)

    report = await run_torture(profile, seed, workdir)
    print(report.summary())

    assert not report.violations, report.failure()
    # The run exercised what it claims to prove.
    assert report.takeovers, f"no fault caused a takeover\n{report.summary()}"
    assert report.terms_fenced_by_database, (
        f"no deposed leader reached the epoch check\n{report.summary()}"
    )
    assert report.leadership_changes >= profile.min_changes, report.summary()
    assert report.acked_mutations >= profile.min_acked, report.summary()
