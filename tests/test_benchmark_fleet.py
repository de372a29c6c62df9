"""The fleet benchmark (``benchmarks.fleet``) in a tiny profile: its processes start, lead,
join, die and commit, and the run reports every key of issue 31 (figures only, no speed
asserted)."""

from __future__ import annotations

import dataclasses
import os

from sqlalchemy.engine import URL

from benchmarks import fleet, report
from benchmarks.common import QUICK

from .pgharness import admin_execute

TINY = dataclasses.replace(
    QUICK,
    fleet_clusters=8,
    fleet_processes=2,
    fleet_pool=3,
    fleet_live=10,
    fleet_finished=20,
    fleet_seeders=2,
    fleet_commit_every=0.2,
    fleet_submitters=40,
    fleet_commit_seconds=0.5,
    fleet_commit_rounds=1,
    fleet_timing=(0.5, 3.0, 0.2),
)


async def test_the_fleet_section_runs_and_reports_its_keys(pg_url: URL) -> None:
    results: dict[str, object] = {}
    try:
        results = await fleet.run(pg_url, {}, TINY)
    finally:
        prefix = results.get("prefix")
        if isinstance(prefix, str):
            rows = await admin_execute(
                pg_url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"{prefix}%"
            )
            for row in rows:
                await admin_execute(pg_url, f'DROP SCHEMA "{row["nspname"]}" CASCADE')
    assert "error" not in results
    figures = dict(
        pair.split("=") for pair in report.key_figures({"sections": {"fleet": results}}).split()
    )
    assert set(figures) == {
        "fleet_backends_per_process",
        "fleet_standby_backends",
        "fleet_open_s",
        "fleet_open_floor_s",
        "fleet_takeover_s",
        "fleet_cutoff_s",
        "fleet_cutoff_stuck",
        "fleet_balance_spread",
        "fleet_commit_8_vs_2",
        "fleet_commit_8_per_s",
        "fleet_commit_2_per_s",
        "fleet_commit_floor_8_vs_2",
        "fleet_lost",
    }
    commit = results["commit"]
    assert isinstance(commit, dict)
    assert commit["floor_wide_per_s"]["min"] > 0  # the floor's commits landed
    template = results["template_recovered"]
    assert isinstance(template, dict)
    assert (template["schema"], template["live"], template["finished"]) == (
        f"{results['prefix']}_template",
        10,
        20,
    )
    # The floor is the raw recovery's median, times the clusters, over the cores.
    raw = template["raw_recover_seconds"]["median"]
    assert template["open_floor_seconds"] == raw * 8 / (os.cpu_count() or 1)
    assert figures["fleet_lost"] == "0"
    assert isinstance(results["open"], dict)
    assert results["open"]["recovered_other_than_seeded"] == 0
