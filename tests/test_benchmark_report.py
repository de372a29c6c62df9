"""The benchmark's renderer (``benchmarks/report.py``) on small fabricated results: a run of
every section, and runs that miss sections (an interrupted run, ``--only``), render the
markdown, the plot and the key figures without faking a figure that was not measured."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report
from benchmarks.common import flush_rate


def s(median: float, low: float | None = None, high: float | None = None) -> dict[str, float]:
    """A summary as ``benchmarks.common.summarize`` makes them."""
    low = median if low is None else low
    high = median if high is None else high
    return {"median": median, "min": low, "max": high, "q1": low, "q3": high, "n": 3}


def _commit() -> dict[str, Any]:
    def submissions(rate: float) -> dict[str, Any]:
        return {
            "rows_per_trial": 1000,
            "variants": {
                name: s(rate * f)
                for name, f in (
                    ("store", 1.0),
                    ("raw", 1.1),
                    ("copy", 1.3),
                    ("pgqueuer", 0.9),
                    ("procrastinate", 0.2),
                )
            },
            "store_vs_raw": s(0.91, 0.85, 0.97),
            "store_vs_copy": s(0.77, 0.70, 0.82),
            "store_vs_pgqueuer": s(1.6, 1.4, 1.7),
            "store_vs_procrastinate": s(5.0),
        }

    def transitions(rate: float) -> dict[str, Any]:
        return {
            "rows_per_trial": 1000,
            "variants": {"store": s(rate), "raw": s(rate * 1.02)},
            "store_vs_raw": s(0.97, 0.93, 1.01),
        }

    return {
        "submissions": {str(n): submissions(1000.0 * n**0.5) for n in (1, 10, 100, 1000, 10000)},
        "transitions": {str(n): transitions(900.0 * n**0.5) for n in (1, 100, 1000)},
        "fdatasync_per_s": 4000.0,
    }


def _group(batched: bool, counts: tuple[int, ...] = (1, 16, 64)) -> dict[str, Any]:
    def entry(n: int) -> dict[str, Any]:
        e: dict[str, Any] = {
            "variants": {"group": s(400.0 * n), "single": s(1500.0)},
            "group_vs_single": s(22.0 if n == 64 else 1.0, 19.0, 24.0),
            "mean_batch_mutations": s(float(n)),
            "latency_p99_seconds": s(0.004),
        }
        if batched:
            e["variants"]["batched"] = s(420.0 * n)
            e["group_vs_batched"] = s(0.93, 0.88, 0.97)
        return e

    return {str(n): entry(n) for n in counts}


def _recovery(sizes: tuple[int, ...]) -> dict[str, Any]:
    def entry(n: int) -> dict[str, Any]:
        def side(rss: float) -> dict[str, Any]:
            return {
                "seconds": s(n / 50_000),
                "tasks_per_second": s(50_000.0 if n < 1_000_000 else 45_000.0),
                "peak_rss_mib": s(rss, rss - 5, rss + 5),
                "rss_before_mib": s(80.0),
            }

        return {
            "populate_seconds": 1.0,
            "loaded": {"tasks": n - 1, "terminal": n // 9},
            "variants": {"store": side(n / 1000), "raw": side(n / 900)},
            "store_vs_raw": s(1.02, 0.98, 1.05),
        }

    return {str(n): entry(n) for n in sizes}


def _scale() -> dict[str, Any]:
    part = {"variants": {"large": s(900.0), "empty": s(1000.0)}, "large_vs_empty": s(0.9)}
    return {
        "batch": {"commit": 100, "transitions": 100},
        "seed_seconds": {"1000000": 12.0},
        "sizes": {"1000000": {"commit": part, "transitions": copy.deepcopy(part)}},
    }


def _takeover() -> dict[str, Any]:
    return {
        "keepalive": 0.5,
        "session_timeout": 2.0,
        "lock_poll": 0.25,
        "idle_session_timeout": 3.0,
        "cap_seconds": 6.0,
        "sigkill": {
            "takeover_seconds": s(0.2, 0.1, 0.3),
            "no_takeover_within_cap": 0,
            "step_down_seconds": None,
            "repeats": 1,
        },
        "stall": {
            "takeover_seconds": None,
            "no_takeover_within_cap": 1,
            "step_down_seconds": s(1.8),
            "repeats": 1,
        },
        "stall_idle_session_timeout": {
            "takeover_seconds": s(2.9),
            "no_takeover_within_cap": 0,
            "step_down_seconds": s(1.8),
            "repeats": 1,
        },
    }


def _prune() -> dict[str, Any]:
    return {
        "finished": 20_000,
        "live_with_dependencies": 2_000,
        "batch": 1000,
        "variants": {"store": s(100_000.0), "raw_unprotected": s(130_000.0)},
        "store_vs_raw": s(0.75, 0.7, 0.8),
        "protected_kept": [2000],
        "large_batch": None,
        "large_finished": {
            "finished": 1_000_000,
            "live_with_dependencies": 20_000,
            "batch": 1000,
            "seed_seconds": {"store": 30.0, "raw": 29.0},
            "variants": {
                side: {
                    "deleted": deleted,
                    "kept": 1_000_000 - deleted,
                    "seconds": deleted / rate,
                    "rows_per_second": rate,
                    "batches": deleted // 1000 + 1,
                    "seconds_per_batch": s(0.01, 0.005, 0.05),
                }
                for side, deleted, rate in (
                    ("store", 980_000, 90_000.0),
                    ("raw_unprotected", 1_000_000, 150_000.0),
                )
            },
            "store_vs_raw": 0.6,
        },
    }


_LIVE = "CREATE INDEX ix_live ON {}.cronoq_tasks USING btree (id) WHERE (NOT terminal)"
_DONE = "CREATE INDEX ix_done ON {}.cronoq_tasks USING btree (updated_unix_ns, id) WHERE terminal"
_BRIN = "CREATE INDEX ix_d0 ON {}.cronoq_tasks USING brin (updated_unix_ns) WHERE terminal"


def _indexes() -> dict[str, Any]:
    return {
        "rows": 100_000,
        "designs": {
            "current": {
                "indexes": [_DONE.format("bench_ix_current"), _LIVE.format("bench_ix_current")],
                "transitions": s(30_000.0),
                "vs_current": s(1.0),
            },
            "hot": {
                "indexes": [_LIVE.format("bench_ix_hot"), _BRIN.format("bench_ix_hot")],
                "transitions": s(36_000.0),
                "vs_current": s(1.2, 1.1, 1.3),
                "hot_fraction": 0.95,
                "wal_bytes_per_update": 310.0,
                "queries_ms": {"live scan": 120.0},
            },
        },
    }


def results(sections: dict[str, Any], profile: str = "quick") -> dict[str, Any]:
    return {
        "profile": profile,
        "loop": "asyncio",
        "machine": {
            "nproc": 2,
            "memory_gib": 23.5,
            "cpu": "x86_64",
            "python": "3.11.7",
            "platform": "Linux",
            "libraries": {"cronoq-store": "0.1.0", "uvloop": None},
            "revision": "abc1234",
        },
        "load_average": {"before": [0.5, 0.5, 0.5], "after": [1.0, 1.0, 1.0]},
        "server": {"version": "PostgreSQL 18.6 on x86_64-pc-linux-gnu, compiled by gcc"},
        "sections": sections,
        "section_seconds": {name: 1.0 for name in sections},
        "server_statements": {},
        "elapsed_seconds": 50.0,
    }


def every_section() -> dict[str, Any]:
    return {
        "commit": _commit(),
        "group_commit": _group(batched=True),
        "recovery": _recovery((100_000, 1_000_000)),
        "takeover": _takeover(),
        "prune": _prune(),
        "scale": _scale(),
        "indexes": _indexes(),
    }


def keys(line: str) -> dict[str, str]:
    return dict(pair.split("=") for pair in line.split())


def test_every_section_renders_with_every_key_figure(tmp_path: Path) -> None:
    run = results(every_section(), profile="full")
    figures = keys(report.key_figures(run))
    for n in (1, 10, 100, 1000, 10000):
        assert f"commit_b{n}_vs_raw" in figures
        assert f"commit_b{n}_vs_pgqueuer" in figures
        assert (f"commit_b{n}_vs_copy" in figures) == (n >= 100)
    assert figures["commit_b1000_vs_pgqueuer"] == "1.60"
    # Commits of one a second (the store's median at batch 1, 1,000) over the disk's
    # fdatasync rate.
    assert figures["commit_b1_vs_flush"] == "0.25"
    assert set(k for k in figures if k.startswith("transitions_")) == {
        "transitions_b100_vs_raw",
        "transitions_b1000_vs_raw",
    }
    assert figures["groupcommit_64_vs_single"] == "22.00"
    assert figures["groupcommit_64_vs_batched"] == "0.93"
    # p99 4 ms against one batch of 64 at 26,880 mutations/s (2.38 ms).
    assert figures["groupcommit_64_p99_vs_batch"] == "1.68"
    assert figures["recovery_1m_vs_raw"] == "1.02"
    assert figures["recovery_1m_rss_mib"] == "1005"  # the maximum of the rounds
    assert figures["recovery_1m_per_task_vs_100k"] == "0.90"  # from the medians
    run["sections"]["recovery"]["1000000"]["per_task_vs_100000"] = s(0.95, 0.9, 1.0)
    assert keys(report.key_figures(run))["recovery_1m_per_task_vs_100k"] == "0.95"  # paired
    assert figures["scale_commit_vs_empty_at_1m"] == "0.90"
    assert figures["scale_transitions_vs_empty_at_1m"] == "0.90"
    assert figures["prune_20k_rows_per_s"] == "100000"
    assert figures["prune_1m_rows_per_s"] == "90000"
    # Paired per round, not the ratio of the medians (100,000 / 130,000 = 0.77).
    assert figures["prune_20k_vs_raw"] == "0.75"
    assert figures["prune_1m_vs_raw"] == "0.60"

    md = report.markdown(run)
    # Every target of the issue, with its range and verdict.
    assert "| commit batch 100 vs pgqueuer's enqueue | > 1 | 1.60 (1.40-1.70) | met |" in md
    assert (
        "| commit batch 1,000 vs pgqueuer's enqueue | >= 1.5 | 1.60 (1.40-1.70) "
        "| met (range crosses) |" in md
    )
    assert (
        "| commit batch 100 vs the COPY bound | >= 0.80 | 0.77 (0.70-0.82) "
        "| missed (range crosses) |" in md
    )
    assert "| group commit, 64 submitters, vs one caller's batches of 64 | >= 0.90 |" in md
    assert (
        "| peak RSS, recovery of 1,000,000 | <= 1024 MiB | 1,000 MiB (995 MiB-1,005 MiB) | met |"
        in md
    )
    assert "(target set at 10M)" in md
    assert "| PgStore.prune (protected) | 90.0k | 981 | 0.01 s (0.01 s-0.05 s) | 20,000 |" in md
    # An index design shows as what it changes against the current one.
    assert "| current | ix_done, ix_live | 30.0k" in md
    assert "| hot | - ix_done, + brin (updated_unix_ns) WHERE terminal | 36.0k" in md
    for heading in ("Group commit", "Recovery", "Takeover", "Prune", "How cost grows", "Index"):
        assert f"### {heading}" in md
    report.plot(run, tmp_path / "results.png")
    assert (tmp_path / "results.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "missing",
    [
        pytest.param(["commit"], id="no-commit"),
        pytest.param(["group_commit", "scale", "indexes"], id="interrupted"),
        pytest.param(list(every_section()), id="nothing-ran"),
    ],
)
def test_a_run_missing_sections_renders_without_their_figures(
    tmp_path: Path, missing: list[str]
) -> None:
    sections = {k: v for k, v in every_section().items() if k not in missing}
    run = results(sections)
    figures = keys(report.key_figures(run))
    prefixes = {
        "commit": ("commit_", "transitions_"),
        "group_commit": ("groupcommit_",),
        "scale": ("scale_",),
        "recovery": ("recovery_",),
        "prune": ("prune_",),
    }
    for name, starts in prefixes.items():
        present = any(k.startswith(starts) for k in figures)
        assert present == (name in sections), name
    md = report.markdown(run)
    assert ("### Commit of submission batches" in md) == ("commit" in sections)
    assert ("### Group commit" in md) == ("group_commit" in sections)
    report.plot(run, tmp_path / "results.png")
    assert (tmp_path / "results.png").exists()


def test_results_of_older_runs_render(tmp_path: Path) -> None:
    """A group-commit section from before the batched variant, a quick profile with one
    recovery size and an unknown section: rendered, the missing figures left out."""
    run = results(
        {
            "group_commit": _group(batched=False, counts=(64,)),
            "recovery": _recovery((100_000,)),
            "telemetry": {"anything": 1},
        }
    )
    figures = keys(report.key_figures(run))
    assert "groupcommit_64_vs_single" in figures
    assert "groupcommit_64_vs_batched" not in figures
    assert "groupcommit_64_p99_vs_batch" not in figures
    assert not any("per_task" in k or k.startswith("recovery_1m") for k in figures)
    md = report.markdown(run)
    assert "group/batched" not in md
    assert "peak RSS, recovery" not in md  # the RSS target is set at 1M
    report.plot(run, tmp_path / "results.png")


def test_timing_says_when_a_quick_run_is_over_its_budget() -> None:
    run = results({"commit": _commit()})
    run["section_seconds"] = {"commit": 20.0, "scale": 90.0}
    run["elapsed_seconds"] = 115.0
    assert report.timing(run) == "took 115 s (commit 20 s, scale 90 s)"
    run["elapsed_seconds"] = 125.0
    assert report.timing(run).endswith(": over the quick profile's budget of 120 s")
    run["profile"] = "full"
    assert "budget" not in report.timing(run)


def _fleet() -> dict[str, Any]:
    backends = {
        "per_process": {"w0": 9, "w1": 10},
        "max": 10,
        "server_memory": {"rss_mib": 40.0, "uss_mib": 6.0, "n": 19},
        "client_rss_mib": {"w0": 120.0, "w1": 118.0},
    }
    return {
        "prefix": "fleet_abc123",
        "clusters": 1000,
        "processes": 4,
        "pool": 8,
        "live": 100,
        "finished": 1000,
        "keepalive": 1.0,
        "session_timeout": 10.0,
        "lock_poll": 0.5,
        "commit_every": 2.0,
        "template_recovered": {
            "schema": "fleet_abc123_template",
            "live": 100,
            "finished": 1000,
            "recover_seconds": s(0.05),
            "raw_recover_seconds": s(0.04),
            "open_floor_seconds": 20.0,
        },
        "seed": {
            "seconds": 80.0,
            "processes": 3,
            "enroll_seconds_summed": 150.0,
            "copy_seconds_summed": 60.0,
        },
        "open": {
            "seconds": 21.5,
            "connected_seconds": s(0.4),
            "first_lead_seconds": s(2.6),
            "recovered_other_than_seeded": 0,
        },
        "backends": backends,
        "standby": {**backends, "per_process": {"idle": 2}, "max": 2},
        "join": {"settled_seconds": 6.0, "spread": 1, "unowned": 0},
        "kill": {
            "victim_clusters": 200,
            "takeover_seconds": 3.1,
            "recovered_seconds": 4.0,
            "settled_seconds": 5.0,
            "spread": 0,
            "unowned": 0,
        },
        "cutoff": {
            "victim_clusters": 160,
            "takeover_seconds": 12.5,
            "not_taken_over": 1,
            "cap_seconds": 40.0,
            "sessions_left": [],
        },
        "exit_codes": {"w1": 0, "w2": 0},
        "lost": {"acknowledged": 20_000, "lost": 0, "clusters": 1000},
        "commit": {
            "submitters": 4000,
            "wide_clusters": 1000,
            "narrow_clusters": 10,
            "one_process_open_seconds": 30.0,
            "wide_per_s": s(5000.0),
            "narrow_per_s": s(20000.0),
            "wide_vs_narrow": s(0.25, 0.2, 0.3),
        },
    }


def test_the_fleet_renders_its_keys_as_far_as_it_got() -> None:
    figures = keys(report.key_figures(results({"fleet": _fleet()})))
    assert figures == {
        "fleet_backends_per_process": "10",
        "fleet_standby_backends": "2",
        "fleet_open_s": "21.50",
        "fleet_open_floor_s": "20.00",
        "fleet_takeover_s": "3.10",
        "fleet_balance_spread": "1",
        "fleet_cutoff_s": "12.50",
        "fleet_cutoff_stuck": "1",
        "fleet_commit_1000_vs_10": "0.25",
        "fleet_commit_1000_per_s": "5000",
        "fleet_commit_10_per_s": "20000",
        "fleet_lost": "0",
    }
    md = report.markdown(results({"fleet": _fleet()}))
    assert "### The fleet: 1,000 clusters, 4 host processes" in md
    assert "| acknowledged commits lost across the join, the kill and the cut-off | 0 |" in md
    assert "over the cores (`fleet_open_floor_s`) | 20.0 s | one cluster: store 0.05 s" in md
    partial = {k: v for k, v in _fleet().items() if k not in ("kill", "cutoff", "lost", "commit")}
    partial["error"] = "RuntimeError: fleet: no takeover within 600 s"
    figures = keys(report.key_figures(results({"fleet": partial})))
    assert "fleet_takeover_s" not in figures
    assert "fleet_lost" not in figures
    assert "fleet_open_s" in figures
    assert "| the run stopped | - | RuntimeError: fleet: no takeover within 600 s |" in (
        report.markdown(results({"fleet": partial}))
    )


def test_the_flush_rate_counts_flushes_of_one_block() -> None:
    """Some flushes, and no more than a fast disk makes."""
    rate = flush_rate(0.2)
    assert 0 < rate <= 1_000_000


def test_each_target_of_the_performance_issue_shows_its_floor_beside_it() -> None:
    sections = every_section()
    group = sections["group_commit"]["64"]
    group["variants"]["bare"] = s(25_000.0)
    group["group_vs_bare"] = s(0.85, 0.8, 0.9)
    group["bare_vs_batched"] = s(0.88, 0.84, 0.93)
    sections["callers"] = {
        "variants": {},
        "callers_vs_one": s(2.0),
        "callers_vs_raw": s(0.91, 0.9, 0.95),
        "engine_vs_raw": s(0.42, 0.4, 0.45),
        "engine_floor_vs_raw": s(0.44, 0.41, 0.47),
        "store_sql_vs_raw": s(0.8, 0.75, 0.85),
    }
    sections["prune"]["store_sql_vs_raw"] = s(0.78, 0.76, 0.8)
    sections["prune"]["large_finished"]["store_sql_vs_raw"] = 0.62
    sections["commit"]["submissions"]["10"]["raw_vs_pgqueuer"] = s(0.9, 0.88, 0.92)
    sections["commit"]["submissions"]["1000"]["raw_engine_vs_raw"] = s(0.91, 0.87, 0.96)
    run = results(sections, profile="full")
    md = report.markdown(run)
    assert "### Targets of issue #32, each with its floor" in md
    assert (
        "| GroupCommitter, 64 submitters, vs one caller's batches of 64 | >= 0.9 "
        "| 0.93 (0.88-0.97) | 0.88 (0.84-0.93) | met (range crosses) |" in md
    )
    assert (
        "| 64 callers on from_engine vs raw asyncpg on 64 connections | >= 0.8 "
        "| 0.42 (0.40-0.45) | 0.44 (0.41-0.47) | missed |" in md
    )
    assert (
        "| 64 callers vs raw asyncpg on 64 connections | >= 0.9 | 0.91 (0.90-0.95) "
        "| 0.80 (0.75-0.85) | met |" in md
    )
    assert (
        "| prune of 20,000 vs raw unprotected delete | >= 0.8 | 0.75 (0.70-0.80) "
        "| 0.78 (0.76-0.80) |" in md
    )
    assert (
        "| prune of 1,000,000 vs raw unprotected delete (one run) | >= 0.8 "
        "| 0.60 (0.60-0.60) | 0.62 (0.62-0.62) | missed |" in md
    )
    pgqueuer_10 = next(line for line in md.splitlines() if "| commit, batch 10, vs pgq" in line)
    assert pgqueuer_10.endswith("| 1.60 (1.40-1.70) | 0.90 (0.88-0.92) | met |")
    figures = keys(report.key_figures(run))
    assert figures["groupcommit_64_vs_bare"] == "0.85"
    assert figures["groupcommit_64_bare_vs_batched"] == "0.88"
    assert figures["commit_64_engine_floor_vs_raw_64"] == "0.44"
    assert figures["commit_64_callers_floor_vs_raw_64"] == "0.80"
    assert figures["prune_20k_floor_vs_raw"] == "0.78"
    assert figures["prune_1m_floor_vs_raw"] == "0.62"
    # The raw SQL on a connection of SQLAlchemy's engine, from COPY on only.
    raw_1000 = next(line for line in md.splitlines() if "| commit, batch 1,000, vs raw" in line)
    assert "| 0.91 (0.87-0.96) |" in raw_1000
    raw_10 = next(line for line in md.splitlines() if "| commit, batch 10, vs raw" in line)
    assert raw_10.split(" | ")[3] == "-"
    assert figures["commit_b1000_engine_floor_vs_raw"] == "0.91"
    assert "commit_b10_engine_floor_vs_raw" not in figures
    # A run before the floors existed shows none, and fakes none.
    old = report.markdown(results(every_section(), profile="full"))
    assert "| 0.93 (0.88-0.97) | - |" in old
