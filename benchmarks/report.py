"""The results as a markdown table, a PNG plot and the one-line key figures.

``python -m benchmarks.report DIR`` renders ``DIR/results.md`` and ``DIR/results.png`` again
from ``DIR/results.json`` (also a partial one, left by an interrupted run).
"""

from __future__ import annotations

import json
import operator
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

_VARIANTS = ("store", "raw", "copy", "pgqueuer", "procrastinate")
_LABELS = {
    "store": "PgStore.commit",
    "raw": "raw asyncpg, same SQL",
    "copy": "asyncpg COPY",
    "pgqueuer": "pgqueuer enqueue",
    "procrastinate": "procrastinate batch_defer",
}


def _rate(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def _spread(summary: dict[str, float], fmt: Any = _rate) -> str:
    """Median with the min-max range."""
    return f"{fmt(summary['median'])} ({fmt(summary['min'])}-{fmt(summary['max'])})"


def _ratio(summary: dict[str, float]) -> str:
    return _spread(summary, lambda v: f"{v:.2f}")


def _seconds(summary: dict[str, float] | None) -> str:
    return "-" if summary is None else _spread(summary, lambda v: f"{v:.2f} s")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _commit(section: dict[str, Any]) -> list[str]:
    lines = [
        "### Commit of submission batches (mutations/s, median (min-max))",
        "",
    ]
    rows = []
    for size, r in section["submissions"].items():
        v = r["variants"]
        rows.append(
            [size]
            + [_spread(v[name]) for name in _VARIANTS]
            + [
                _ratio(r["store_vs_raw"]),
                _ratio(r["store_vs_copy"]),
                _ratio(r["store_vs_pgqueuer"]),
            ]
        )
    lines += _table(
        ["batch"] + [_LABELS[n] for n in _VARIANTS] + ["store/raw", "store/COPY", "store/pgqueuer"],
        rows,
    )
    lines += ["### Commit of status-transition batches (mutations/s)", ""]
    rows = [
        [
            size,
            _spread(r["variants"]["store"]),
            _spread(r["variants"]["raw"]),
            _ratio(r["store_vs_raw"]),
        ]
        for size, r in section["transitions"].items()
    ]
    return lines + _table(["batch", _LABELS["store"], _LABELS["raw"], "store/raw"], rows)


def _group_commit(section: dict[str, Any]) -> list[str]:
    # "batched": one caller committing the same mutations in batches of the submitter
    # count back to back (absent from runs before that variant existed).
    batched = any("batched" in r["variants"] for r in _counts(section).values())
    # "bare": the floor, a future per submitter and one committing loop (later runs).
    bare = any("bare" in r["variants"] for r in _counts(section).values())
    rows = []
    for n, r in _counts(section).items():
        v = r["variants"]
        rows.append(
            [
                n,
                _spread(v["group"]),
                _spread(v["single"]),
                *([_spread(v["batched"]) if "batched" in v else "-"] if batched else []),
                *([_spread(v["bare"]) if "bare" in v else "-"] if bare else []),
                _ratio(r["group_vs_single"]),
                *(
                    [_ratio(r["group_vs_batched"]) if "group_vs_batched" in r else "-"]
                    if batched
                    else []
                ),
                *([_ratio(r["group_vs_bare"]) if "group_vs_bare" in r else "-"] if bare else []),
                f"{r['mean_batch_mutations']['median']:.0f}",
                f"{r['latency_p99_seconds']['median'] * 1000:.1f} ms",
            ]
        )
    header = [
        "submitters",
        "GroupCommitter",
        "one transaction per submission",
        *(["one caller, batches of N"] if batched else []),
        *(["bare futures and one loop (floor)"] if bare else []),
        "group/single",
        *(["group/batched"] if batched else []),
        *(["group/floor"] if bare else []),
        "mean batch",
        "p99 latency",
    ]
    return [
        "### Group commit: concurrent one-mutation submitters (mutations/s)",
        "",
        *_table(header, rows),
    ]


def _counts(section: dict[str, Any]) -> dict[str, Any]:
    """The entries of a section keyed by a number (submitters, tasks), in order."""
    return {k: v for k, v in section.items() if k.isdigit()}


def _recovery(section: dict[str, Any]) -> list[str]:
    rows = []
    for size, r in _counts(section).items():
        store, raw = r["variants"]["store"], r["variants"]["raw"]
        rows.append(
            [
                f"{int(size):,}",
                f"{r['loaded']['tasks']:,} + {r['loaded']['terminal']:,}",
                _seconds(store["seconds"]),
                _seconds(raw["seconds"]),
                _ratio(r["store_vs_raw"]),
                f"{store['peak_rss_mib']['median']:.0f} MiB",
                f"{raw['peak_rss_mib']['median']:.0f} MiB",
            ]
        )
    return [
        "### Recovery",
        "",
        *_table(
            [
                "live tasks",
                "loaded (live + finished)",
                "PgStore.recover",
                "raw asyncpg, same decoding",
                "speed store/raw",
                "peak RSS store",
                "peak RSS raw",
            ],
            rows,
        ),
    ]


def _takeover(section: dict[str, Any]) -> list[str]:
    names = {
        "sigkill": "leader SIGKILLed",
        "stall": "leader's network stalled",
        "stall_idle_session_timeout": "stalled, lock role with idle_session_timeout",
    }
    rows = [
        [
            label,
            _seconds(section[key]["takeover_seconds"])
            + (
                f", {section[key]['no_takeover_within_cap']} of {section[key]['repeats']} "
                f"not within {section['cap_seconds']:.0f} s"
                if section[key]["no_takeover_within_cap"]
                else ""
            ),
            _seconds(section[key]["step_down_seconds"]),
        ]
        for key, label in names.items()
    ]
    return [
        "### Takeover",
        "",
        f"keepalive {section['keepalive']} s, session_timeout {section['session_timeout']} s, "
        f"lock_poll {section['lock_poll']} s, idle_session_timeout "
        f"{section['idle_session_timeout']} s.",
        "",
        *_table(["scenario", "standby leads after", "old leader steps down after"], rows),
    ]


def _prune(section: dict[str, Any]) -> list[str]:
    v = section["variants"]
    return [
        "### Prune (rows deleted/s)",
        "",
        f"{section['finished']:,} old finished tasks, {section['live_with_dependencies']:,} "
        f"of them depended on by live tasks; batches of {section['batch']} first, then "
        "sized by time.",
        "",
        *_table(
            [
                "PgStore.prune (protected)",
                "raw delete, unprotected",
                "raw asyncpg, the store's statements (floor)",
                "finished tasks kept",
            ],
            [
                [
                    _spread(v["store"]),
                    _spread(v["raw_unprotected"]),
                    _spread(v["raw_store_sql"]) if "raw_store_sql" in v else "-",
                    str(section["protected_kept"]),
                ]
            ],
        ),
        *_large_prune(section.get("large_batch")),
        *_many_finished(section.get("large_finished")),
    ]


def _many_finished(many: dict[str, Any] | None) -> list[str]:
    """The prune of a table of (by default) 1M finished tasks: one run of each side."""
    if not many:
        return []
    v = many["variants"]
    rows = [
        [
            label,
            f"{_rate(v[name]['rows_per_second'])}",
            f"{v[name]['batches']:,}",
            _seconds(v[name].get("seconds_per_batch")),
            f"{v[name]['kept']:,}",
        ]
        for name, label in (
            ("store", "PgStore.prune (protected)"),
            ("raw_unprotected", "raw"),
            ("raw_store_sql", "raw asyncpg, the store's statements (floor)"),
        )
        if name in v
    ]
    return [
        f"Prune of {many['finished']:,} finished tasks, {many['live_with_dependencies']:,} of "
        f"them depended on by live tasks (one run each; each side seeded in "
        f"{max(many.get('seed_seconds', {}).values(), default=0):.0f} s):",
        "",
        *_table(["", "rows deleted/s", "batches", "seconds per batch", "finished kept"], rows),
    ]


def _large_prune(large: dict[str, Any] | None) -> list[str]:
    if large is None:
        return []
    seconds = large["seconds_per_batch"]

    def shown(value: float | None) -> str:
        if value is None:
            return f"> {large['timeout_seconds']:.0f} s (timed out)"
        return f"{value:.2f} s ({1000 / value:,.0f} rows/s)"

    return [
        f"One batch of 1,000 on {large['finished']:,} finished tasks with "
        f"{large['live_with_dependencies']:,} live tasks depending on them (median of 3):",
        "",
        *_table(
            ["store's statement"],
            [[shown(seconds["store"])]],
        ),
    ]


def _scale(section: dict[str, Any]) -> list[str]:
    batch = section.get("batch", {})
    rows = []
    for size, r in _counts(section.get("sizes", {})).items():
        for kind in ("commit", "transitions"):
            if kind in r:
                v = r[kind]["variants"]
                rows.append(
                    [
                        f"{int(size):,}",
                        f"{kind}, batches of {batch.get(kind, '?')}",
                        _spread(v["large"]),
                        _spread(v["empty"]),
                        _ratio(r[kind]["large_vs_empty"]),
                    ]
                )
    seeded = ", ".join(
        f"{int(n):,} rows in {s:.0f} s" for n, s in section.get("seed_seconds", {}).items()
    )
    return [
        "### How cost grows with the table (mutations/s)",
        "",
        *([f"Seeded: {seeded}.", ""] if seeded else []),
        *_table(
            ["rows in the table", "what", "into that table", "into an empty table", "ratio"],
            rows,
        ),
    ]


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


_INDEX_DDL = re.compile(r"CREATE (UNIQUE )?INDEX (\S+) ON \S+ USING (.*)$")


def _index_changes(indexes: list[str], current: list[str]) -> str:
    """A design's indexes as what differs from the current design's (``-`` a name dropped,
    ``+`` a definition added), given as ``pg_indexes.indexdef`` lines; anything else (or
    the current design itself) is listed as it is."""
    ours = [m for m in map(_INDEX_DDL.match, indexes) if m]
    theirs = [m for m in map(_INDEX_DDL.match, current) if m]
    if len(ours) < len(indexes) or len(theirs) < len(current) or indexes == current:
        return ", ".join(m[2] for m in ours) if len(ours) == len(indexes) else ", ".join(indexes)

    def definition(m: re.Match[str]) -> str:
        return (m[1] or "").lower() + m[3]

    defined, kept = {definition(m) for m in ours}, {definition(m) for m in theirs}
    dropped = [f"- {m[2]}" for m in theirs if definition(m) not in defined]
    added = [f"+ {definition(m)}" for m in ours if definition(m) not in kept]
    return ", ".join(dropped + added) or "the same"


def _indexes(section: dict[str, Any]) -> list[str]:
    designs = section.get("designs", {})
    current = designs.get("current", {}).get("indexes", [])
    queries = list(dict.fromkeys(q for d in designs.values() for q in d.get("queries_ms", {})))
    rows = []
    for name, d in designs.items():
        timings = d.get("queries_ms", {})
        rows.append(
            [
                name,
                _index_changes(d.get("indexes", []), current),
                _spread(d["transitions"]) if "transitions" in d else "-",
                _ratio(d["vs_current"]) if "vs_current" in d else "-",
                f"{d['hot_fraction']:.0%}" if "hot_fraction" in d else "-",
                f"{d['wal_bytes_per_update']:,.0f}" if "wal_bytes_per_update" in d else "-",
                *(_ms(timings[q]) if q in timings else "-" for q in queries),
            ]
        )
    rows_note = f" on {section['rows']:,} rows" if "rows" in section else ""
    return [
        "### Index designs: status transitions, and the queries that use the indexes "
        f"(ms{rows_note})",
        "",
        *_table(
            [
                "design",
                "indexes (against current)",
                "transitions/s",
                "vs current",
                "HOT updates",
                "WAL bytes per update",
                *queries,
            ],
            rows,
        ),
    ]


def _console(section: dict[str, Any]) -> list[str]:
    target = section["target_ms"]
    pages = [
        [
            name,
            f"`{page['target']}`"[:70],
            _ms(page["ms"]["median"]),
            _ms(page["ms"]["max"]),
            "met" if page["ms"]["max"] <= target else "missed",
        ]
        for name, page in section["pages"].items()
    ]
    plans = [[name, ", ".join(plan["scans"])] for name, plan in section["plans"].items()]
    return [
        f"### The console's pages on {section['rows']:,} rows (ms, server-side)",
        "",
        f"Seeded in {section['seed_seconds']:.0f} s; the tasks table and its indexes: "
        f"{section['table_bytes'] / 2**30:.1f} GiB. Target: every page within {target:.0f} ms.",
        "",
        *_table(["page", "request", "median", "slowest", "target"], pages),
        "",
        *_table(["statement", "what its plan reads"], plans),
    ]


def _fleet(section: dict[str, Any]) -> list[str]:
    """The fleet's phases, as far as its run got (each phase adds its results when done)."""
    lines = [
        f"### The fleet: {section['clusters']:,} clusters, {section['processes']} host processes",
        "",
        f"Each cluster: {section['live']:,} live and {section['finished']:,} finished tasks; "
        f"a pool of {section['pool']} per process; keepalive {section['keepalive']} s, "
        f"session_timeout {section['session_timeout']} s, lock_poll {section['lock_poll']} s; "
        f"each led cluster commits one task every {section['commit_every']} s.",
        "",
    ]
    rows: list[list[str]] = []
    seed = section.get("seed")
    if seed:
        rows.append(
            [
                "enrolled (migrated) and seeded",
                f"{seed['seconds']:.1f} s in {seed['processes']} processes",
                f"enroll {seed['enroll_seconds_summed']:.0f} s, COPY "
                f"{seed['copy_seconds_summed']:.0f} s, summed over processes",
            ]
        )
    opened = section.get("open")
    if opened:
        rows.append(
            [
                "every cluster led and recovered, from process start (`fleet_open_s`)",
                f"{opened['seconds']:.1f} s",
                f"first lead after {_seconds(opened['first_lead_seconds'])}; recovered other "
                f"than seeded: {opened['recovered_other_than_seeded']}",
            ]
        )
    template = section.get("template_recovered", {})
    if "open_floor_seconds" in template:
        rows.append(
            [
                "its floor: one cluster's recovery on raw asyncpg, times the clusters, over "
                "the cores (`fleet_open_floor_s`)",
                f"{template['open_floor_seconds']:.1f} s",
                f"one cluster: store {_seconds(template['recover_seconds'])}, raw "
                f"{_seconds(template['raw_recover_seconds'])}",
            ]
        )
    for key, label, target in (
        ("backends", "server sessions per process, leading its share", "<= pool + 3"),
        ("standby", "server sessions of a process leading nothing", "<= 3"),
        ("after", "server sessions per survivor after the kill", "<= pool + 3"),
    ):
        found = section.get(key)
        if found:
            memory = found.get("server_memory") or {}
            rss = ", ".join(f"{v:.0f}" for v in found["client_rss_mib"].values())
            rows.append(
                [
                    label,
                    f"{found['max']} (target {target})",
                    f"per process {sorted(found['per_process'].values())}; server backend "
                    f"RSS {memory.get('rss_mib', 0):.1f} MiB, USS {memory.get('uss_mib', 0):.1f} "
                    f"MiB (mean); client RSS {rss} MiB",
                ]
            )
    join = section.get("join")
    if join:
        rows.append(
            [
                "one process joins: moves settled",
                f"{join['settled_seconds']:.1f} s",
                f"spread {join['spread']}, unowned {join['unowned']}",
            ]
        )
    kill = section.get("kill")
    if kill:
        rows.append(
            [
                "one process SIGKILLed: each of its clusters owned again (`fleet_takeover_s`)",
                f"{kill['takeover_seconds']:.2f} s",
                f"{kill['victim_clusters']} clusters, recovered after "
                f"{kill['recovered_seconds']:.2f} s; settled after "
                f"{kill['settled_seconds']:.1f} s, spread {kill['spread']}",
            ]
        )
    cutoff = section.get("cutoff")
    if cutoff:
        rows.append(
            [
                "one process cut off (proxy stalled): its clusters owned again (`fleet_cutoff_s`)",
                f"{cutoff['takeover_seconds']:.2f} s",
                f"{cutoff['victim_clusters']} clusters, "
                f"{cutoff['not_taken_over']} not taken over within "
                f"{cutoff['cap_seconds']:.0f} s",
            ]
        )
    lost = section.get("lost")
    if lost:
        rows.append(
            [
                "acknowledged commits lost across the join, the kill and the cut-off",
                str(lost["lost"]),
                f"of {lost['acknowledged']:,} in {lost['clusters']:,} clusters",
            ]
        )
    commit = section.get("commit")
    if commit:
        wide, narrow = commit["wide_clusters"], commit["narrow_clusters"]
        rows.append(
            [
                f"{commit['submitters']:,} one-mutation submitters through one process, over "
                f"{wide:,} clusters vs over {narrow}",
                _ratio(commit["wide_vs_narrow"]),
                f"{_spread(commit['wide_per_s'])} vs {_spread(commit['narrow_per_s'])} "
                f"mutations/s; that process led all in {commit['one_process_open_seconds']:.1f} s",
            ]
        )
        if "floor_wide_vs_narrow" in commit:
            rows.append(
                [
                    f"the floor: the same commits' statements on raw asyncpg sessions, over "
                    f"{wide:,} clusters vs over {narrow}",
                    _ratio(commit["floor_wide_vs_floor_narrow"]),
                    f"{_spread(commit['floor_wide_per_s'])} vs "
                    f"{_spread(commit['floor_narrow_per_s'])} mutations/s; raw over {wide:,} "
                    f"vs the store over {narrow}: {commit['floor_wide_vs_narrow']:.2f}",
                ]
            )
    if "error" in section:
        rows.append(["the run stopped", "-", section["error"]])
    return [*lines, *_table(["what", "measured", "details"], rows)]


_SECTIONS = {
    "commit": _commit,
    "group_commit": _group_commit,
    "recovery": _recovery,
    "takeover": _takeover,
    "prune": _prune,
    "scale": _scale,
    "indexes": _indexes,
    "console": _console,
    "fleet": _fleet,
}


def _label(n: int) -> str:
    """A count as a key figure names it: 100, 20k, 1m, 10m."""
    if n >= 1_000_000 and n % 1_000_000 == 0:
        return f"{n // 1_000_000}m"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


# --- the targets of issue #15 ------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
}


def _verdict(summary: dict[str, float], op: str, threshold: float) -> str:
    """Met or missed by the median; says so when the rounds' range crosses the threshold."""
    ok = _OPS[op]
    verdict = "met" if ok(summary["median"], threshold) else "missed"
    if ok(summary["min"], threshold) != ok(summary["max"], threshold):
        verdict += " (range crosses)"
    return verdict


def targets(sections: dict[str, Any]) -> list[tuple[str, str, dict[str, float], str]]:
    """Every target of issue #15 that the run measured: (target, wanted, measured summary,
    unit); a target whose section did not run is left out."""
    rows: list[tuple[str, str, dict[str, float], str]] = []
    commit = sections.get("commit", {})
    submissions = commit.get("submissions", {})
    for size, r in submissions.items():
        n = int(size)
        if n == 1 or n >= 100:
            wanted = ">= 0.80" if n == 1 else ">= 0.95"
            rows.append(
                (
                    f"commit of submissions, batch {n:,}, vs raw asyncpg",
                    wanted,
                    r["store_vs_raw"],
                    "x",
                )
            )
    for size, r in submissions.items():
        n = int(size)
        rows.append(
            (
                f"commit batch {n:,} vs pgqueuer's enqueue",
                "> 1" if n < 1000 else ">= 1.5",
                r["store_vs_pgqueuer"],
                "x",
            )
        )
    for size, r in submissions.items():
        if int(size) >= 100:
            rows.append(
                (
                    f"commit batch {int(size):,} vs the COPY bound",
                    ">= 0.80",
                    r["store_vs_copy"],
                    "x",
                )
            )
    for size, r in commit.get("transitions", {}).items():
        if int(size) >= 100:
            rows.append(
                (
                    f"status transitions, batch {int(size):,}, vs raw",
                    ">= 0.95",
                    r["store_vs_raw"],
                    "x",
                )
            )
    group = sections.get("group_commit", {}).get("64")
    if group:
        rows.append(
            (
                "group commit, 64 submitters, vs one transaction each",
                ">= 20",
                group["group_vs_single"],
                "x",
            )
        )
        if "group_vs_batched" in group:
            rows.append(
                (
                    "group commit, 64 submitters, vs one caller's batches of 64",
                    ">= 0.90",
                    group["group_vs_batched"],
                    "x",
                )
            )
    for size, r in _counts(sections.get("scale", {}).get("sizes", {})).items():
        n = int(size)
        where = "" if n >= 10_000_000 else " (target set at 10M)"
        for kind in ("commit", "transitions"):
            if kind in r:
                rows.append(
                    (
                        f"{kind} with {n:,} rows in the table vs empty{where}",
                        ">= 0.80",
                        r[kind]["large_vs_empty"],
                        "x",
                    )
                )
    for size, r in _counts(sections.get("recovery", {})).items():
        n = int(size)
        where = "" if n >= 1_000_000 else " (target set at 1M)"
        rows.append(
            (
                f"recovery of {n:,} live tasks vs raw, same decoding{where}",
                ">= 1.00",
                r["store_vs_raw"],
                "x",
            )
        )
        if n >= 1_000_000:
            rows.append(
                (
                    f"peak RSS, recovery of {n:,}",
                    "<= 1024",
                    r["variants"]["store"]["peak_rss_mib"],
                    " MiB",
                )
            )
    return rows


Floor = dict[str, float] | None


def _flush_ratio(commit: dict[str, Any], side: str) -> dict[str, float] | None:
    """A side's commits of one mutation a second over the disk's flushes a second."""
    flush, one = commit.get("fdatasync_per_s"), commit.get("submissions", {}).get("1")
    if not flush or not one or side not in one["variants"]:
        return None
    return {k: one["variants"][side][k] / flush for k in ("median", "min", "max")}


def targets_32(sections: dict[str, Any]) -> list[tuple[str, str, dict[str, float], Floor]]:
    """Every target of issue #32 that the run measured: (target, wanted, measured summary,
    floor), the floor being the same work with the store taken out, measured in the same
    run (``None`` where the baseline itself is that)."""
    rows: list[tuple[str, str, dict[str, float], Floor]] = []
    commit = sections.get("commit", {})
    submissions = commit.get("submissions", {})
    for size, r in submissions.items():
        rows.append(
            (
                f"commit, batch {int(size):,}, vs raw asyncpg",
                ">= 0.95",
                r["store_vs_raw"],
                # From COPY on: the raw SQL on a connection of SQLAlchemy's engine.
                r.get("raw_engine_vs_raw"),
            )
        )
    for size, r in submissions.items():
        n = int(size)
        wanted = ">= 1.05" if n <= 100 else ">= 1.5" if n < 10_000 else ">= 2"
        rows.append(
            (
                f"commit, batch {n:,}, vs pgqueuer",
                wanted,
                r["store_vs_pgqueuer"],
                r.get("raw_vs_pgqueuer"),
            )
        )
    for size, r in commit.get("transitions", {}).items():
        if int(size) >= 100:
            rows.append(
                (f"transitions, batch {int(size):,}, vs raw", ">= 0.95", r["store_vs_raw"], None)
            )
    flush = _flush_ratio(commit, "store")
    if flush is not None:
        rows.append(
            (
                "commit, batch 1, vs the disk's flushes",
                ">= 0.35",
                flush,
                _flush_ratio(commit, "raw"),
            )
        )
    for count, wanted in (("64", ">= 0.9"), ("256", ">= 0.8")):
        group = sections.get("group_commit", {}).get(count)
        if group and "group_vs_batched" in group:
            rows.append(
                (
                    f"GroupCommitter, {count} submitters, vs one caller's batches of {count}",
                    wanted,
                    group["group_vs_batched"],
                    group.get("bare_vs_batched"),
                )
            )
    group = sections.get("group_commit", {}).get("64")
    if group and "batched" in group["variants"]:
        one_batch = 64 / group["variants"]["batched"]["median"]
        p99 = group["latency_p99_seconds"]
        rows.append(
            (
                "GroupCommitter p99 at 64 submitters, in commits of one batch of 64",
                "<= 2",
                {k: p99[k] / one_batch for k in ("median", "min", "max")},
                None,
            )
        )
    callers = sections.get("callers")
    if callers:
        rows.append(
            (
                "64 callers vs raw asyncpg on 64 connections",
                ">= 0.9",
                callers["callers_vs_raw"],
                callers.get("store_sql_vs_raw"),
            )
        )
        rows.append(
            (
                "64 callers on from_engine vs raw asyncpg on 64 connections",
                ">= 0.8",
                callers["engine_vs_raw"],
                callers.get("engine_floor_vs_raw"),
            )
        )
    takeover = sections.get("takeover", {})
    killed = takeover.get("sigkill")
    if killed and killed.get("takeover_seconds"):
        rows.append(
            (
                "takeover after SIGKILL, seconds",
                f"<= {takeover['lock_poll']:g}",
                killed["takeover_seconds"],
                None,
            )
        )
    prune = sections.get("prune")
    if prune:
        rows.append(
            (
                f"prune of {prune['finished']:,} vs raw unprotected delete",
                ">= 0.8",
                prune["store_vs_raw"],
                prune.get("store_sql_vs_raw"),
            )
        )
        many = prune.get("large_finished")
        if many:

            def one(value: float) -> dict[str, float]:
                return {"median": value, "min": value, "max": value}

            floor = many.get("store_sql_vs_raw")
            rows.append(
                (
                    f"prune of {many['finished']:,} vs raw unprotected delete (one run)",
                    ">= 0.8",
                    one(many["store_vs_raw"]),
                    None if floor is None else one(floor),
                )
            )
    return rows


def _targets_32(sections: dict[str, Any]) -> list[str]:
    def shown(summary: dict[str, float]) -> str:
        return f"{summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f})"

    rows = []
    for name, wanted, summary, floor in targets_32(sections):
        op, threshold = wanted.split()
        rows.append(
            [
                name,
                wanted,
                shown(summary),
                "-" if floor is None else shown(floor),
                _verdict(summary, op, float(threshold)),
            ]
        )
    if not rows:
        return []
    return [
        "### Targets of issue #32, each with its floor (the same work, the store taken out)",
        "",
        *_table(["target", "wanted", "measured", "floor", "verdict"], rows),
    ]


def _targets(sections: dict[str, Any]) -> list[str]:
    def value(v: float, unit: str) -> str:
        return f"{v:,.0f}{unit}" if unit == " MiB" else f"{v:.2f}"

    rows = []
    for name, wanted, summary, unit in targets(sections):
        op, threshold = wanted.split()
        rows.append(
            [
                name,
                wanted + ("" if unit == "x" else unit),
                f"{value(summary['median'], unit)} "
                f"({value(summary['min'], unit)}-{value(summary['max'], unit)})",
                _verdict(summary, op, float(threshold)),
            ]
        )
    return [
        "### Targets of issue #15 (medians of paired ratios, min-max of the rounds)",
        "",
        *_table(["target", "wanted", "measured", "verdict"], rows),
    ]


#: The quick profile's whole run must stay within this (issue #15).
QUICK_BUDGET_SECONDS = 120.0


def timing(results: dict[str, Any]) -> str:
    """How long each section took, and whether a quick run kept within its budget."""
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("section_seconds", {}).items())
    total = results.get("elapsed_seconds", 0.0)
    line = f"took {total:.0f} s ({sections or 'no section'})"
    if results["profile"] == "quick" and total > QUICK_BUDGET_SECONDS:
        line += f": over the quick profile's budget of {QUICK_BUDGET_SECONDS:.0f} s"
    return line


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    libs = ", ".join(f"{k} {v}" for k, v in machine["libraries"].items() if v)
    load = results.get("load_average", {})
    after = f"{load['after'][0]:.2f}" if "after" in load else "?"
    server = results.get("server", {}).get("version", "PostgreSQL ?").split(" on ")[0]
    lines = [
        f"## Results ({results['profile']} profile, {results.get('elapsed_seconds', 0):.0f} s, "
        f"{results.get('loop', 'asyncio')} event loop)",
        "",
        f"{machine['nproc']} cores, {machine['memory_gib']} GiB, Python {machine['python']}, "
        f"{server}; {libs}; revision {machine['revision']}; load average "
        f"{load.get('before', [0])[0]:.2f} before, {after} after; {timing(results)}.",
        "",
    ]
    lines += _targets(results["sections"])
    lines += _targets_32(results["sections"])
    for name, section in results["sections"].items():
        if name in _SECTIONS:
            lines += _SECTIONS[name](section)
    return "\n".join(lines) + "\n"


def key_figures(results: dict[str, Any]) -> str:
    """``name=value`` pairs of the headline figures, for the last line of the run: every
    target of issue #15 that the run measured (a section that did not run adds none). Sizes
    are part of the names where profiles differ (``recovery_100k_...``,
    ``scale_commit_vs_empty_at_1m``)."""
    sections = results["sections"]
    figures: dict[str, float] = {}
    commit = sections.get("commit", {})
    submissions = commit.get("submissions", {})
    for size, r in submissions.items():
        figures[f"commit_b{size}_vs_raw"] = r["store_vs_raw"]["median"]
        if "raw_engine_vs_raw" in r:
            # The floor: the raw SQL on a connection SQLAlchemy's dialect set up.
            figures[f"commit_b{size}_engine_floor_vs_raw"] = r["raw_engine_vs_raw"]["median"]
    for size, r in submissions.items():
        figures[f"commit_b{size}_vs_pgqueuer"] = r["store_vs_pgqueuer"]["median"]
    for size, r in submissions.items():
        if int(size) >= 100:
            figures[f"commit_b{size}_vs_copy"] = r["store_vs_copy"]["median"]
    for size, r in commit.get("transitions", {}).items():
        if int(size) >= 100:
            figures[f"transitions_b{size}_vs_raw"] = r["store_vs_raw"]["median"]
    flush = commit.get("fdatasync_per_s")
    if flush and "1" in submissions:
        # Commits of one mutation a second against the disk's flushes a second: each
        # commit is one round trip and one WAL flush.
        figures["commit_b1_vs_flush"] = submissions["1"]["variants"]["store"]["median"] / flush
    group = sections.get("group_commit", {}).get("64")
    if group:
        figures["groupcommit_64_vs_single"] = group["group_vs_single"]["median"]
        if "group_vs_batched" in group:
            figures["groupcommit_64_vs_batched"] = group["group_vs_batched"]["median"]
        figures["groupcommit_64_per_s"] = group["variants"]["group"]["median"]
        figures["groupcommit_64_p99_ms"] = group["latency_p99_seconds"]["median"] * 1000
        batched = group["variants"].get("batched")
        if batched:
            # Against one commit of a batch of 64 by one caller: 64 over its rate.
            one_batch = 64 / batched["median"]
            figures["groupcommit_64_p99_vs_batch"] = (
                group["latency_p99_seconds"]["median"] / one_batch
            )
    group = sections.get("group_commit", {}).get("256")
    if group and "group_vs_batched" in group:
        figures["groupcommit_256_vs_batched"] = group["group_vs_batched"]["median"]
    for n, group in sections.get("group_commit", {}).items():
        if n in ("64", "256") and "group_vs_bare" in group:
            # The floor: asyncio's own cost per awaiting submitter (benchmarks.group_commit).
            figures[f"groupcommit_{n}_vs_bare"] = group["group_vs_bare"]["median"]
            figures[f"groupcommit_{n}_bare_vs_batched"] = group["bare_vs_batched"]["median"]
    callers = sections.get("callers")
    if callers:
        figures["commit_64_callers_vs_one"] = callers["callers_vs_one"]["median"]
        figures["commit_64_callers_vs_raw_64"] = callers["callers_vs_raw"]["median"]
        figures["commit_64_engine_callers_vs_raw_64"] = callers["engine_vs_raw"]["median"]
        if "store_sql_vs_raw" in callers:
            # The floor: raw asyncpg sending the store's own fenced insert.
            figures["commit_64_callers_floor_vs_raw_64"] = callers["store_sql_vs_raw"]["median"]
        if "engine_floor_vs_raw" in callers:
            # The floor: the application's engine alone running the plain insert.
            figures["commit_64_engine_floor_vs_raw_64"] = callers["engine_floor_vs_raw"]["median"]
    recovery = _counts(sections.get("recovery", {}))
    for size, r in recovery.items():
        label = _label(int(size))
        figures[f"recovery_{label}_vs_raw"] = r["store_vs_raw"]["median"]
        figures[f"recovery_{label}_rss_mib"] = r["variants"]["store"]["peak_rss_mib"]["max"]
    if len(recovery) >= 2:
        smallest, largest = min(recovery, key=int), max(recovery, key=int)
        # Paired per round where the section pairs them, else the ratio of the medians.
        per_task = recovery[largest].get(f"per_task_vs_{smallest}")
        figures[f"recovery_{_label(int(largest))}_per_task_vs_{_label(int(smallest))}"] = (
            per_task["median"]
            if per_task
            else recovery[largest]["variants"]["store"]["tasks_per_second"]["median"]
            / recovery[smallest]["variants"]["store"]["tasks_per_second"]["median"]
        )
    scale = _counts(sections.get("scale", {}).get("sizes", {}))
    if scale:
        largest = max(scale, key=int)
        for kind in ("commit", "transitions"):
            if kind in scale[largest]:
                figures[f"scale_{kind}_vs_empty_at_{_label(int(largest))}"] = scale[largest][kind][
                    "large_vs_empty"
                ]["median"]
    prune = sections.get("prune")
    if prune:
        label = _label(prune["finished"])
        figures[f"prune_{label}_rows_per_s"] = prune["variants"]["store"]["median"]
        if "store_vs_raw" in prune:
            figures[f"prune_{label}_vs_raw"] = prune["store_vs_raw"]["median"]
        if "store_sql_vs_raw" in prune:
            figures[f"prune_{label}_floor_vs_raw"] = prune["store_sql_vs_raw"]["median"]
        many = prune.get("large_finished")
        if many and "rows_per_second" in many["variants"].get("store", {}):
            label = _label(many["finished"])
            figures[f"prune_{label}_rows_per_s"] = many["variants"]["store"]["rows_per_second"]
            figures[f"prune_{label}_vs_raw"] = many["store_vs_raw"]
            if "store_sql_vs_raw" in many:
                figures[f"prune_{label}_floor_vs_raw"] = many["store_sql_vs_raw"]
    figures.update(_fleet_figures(sections.get("fleet")))
    return " ".join(
        f"{k}={v}"
        if isinstance(v, int)
        else f"{k}={v:.0f}"
        if k.endswith(("_mib", "_per_s"))
        else f"{k}={v:.2f}"
        for k, v in figures.items()
    )


def _fleet_figures(fleet: dict[str, Any] | None) -> dict[str, float]:
    """The fleet's keys (issue 31) as far as its run got."""
    if not fleet:
        return {}
    figures: dict[str, float] = {}
    if "backends" in fleet:
        figures["fleet_backends_per_process"] = fleet["backends"]["max"]
    if "standby" in fleet:
        figures["fleet_standby_backends"] = fleet["standby"]["max"]
    if "open" in fleet:
        figures["fleet_open_s"] = fleet["open"]["seconds"]
    if "open_floor_seconds" in fleet.get("template_recovered", {}):
        figures["fleet_open_floor_s"] = fleet["template_recovered"]["open_floor_seconds"]
    if "kill" in fleet:
        figures["fleet_takeover_s"] = fleet["kill"]["takeover_seconds"]
        figures["fleet_balance_spread"] = max(fleet["join"]["spread"], fleet["kill"]["spread"])
    if "cutoff" in fleet:
        figures["fleet_cutoff_s"] = fleet["cutoff"]["takeover_seconds"]
        figures["fleet_cutoff_stuck"] = fleet["cutoff"]["not_taken_over"]
    commit = fleet.get("commit")
    if commit:
        wide, narrow = commit["wide_clusters"], commit["narrow_clusters"]
        figures[f"fleet_commit_{wide}_vs_{narrow}"] = commit["wide_vs_narrow"]["median"]
        figures[f"fleet_commit_{wide}_per_s"] = commit["wide_per_s"]["median"]
        figures[f"fleet_commit_{narrow}_per_s"] = commit["narrow_per_s"]["median"]
        if "floor_wide_vs_narrow" in commit:
            figures[f"fleet_commit_floor_{wide}_vs_{narrow}"] = commit[
                "floor_wide_vs_floor_narrow"
            ]["median"]
    if "lost" in fleet:
        figures["fleet_lost"] = fleet["lost"]["lost"]
    return figures


# --- the plot ----------------------------------------------------------------------------------


def _errorbars(
    ax: Any, xs: Sequence[float], summaries: list[dict[str, float]], label: str, **style: Any
) -> None:
    medians = [s["median"] for s in summaries]
    lower = [s["median"] - s["min"] for s in summaries]
    upper = [s["max"] - s["median"] for s in summaries]
    ax.errorbar(xs, medians, yerr=[lower, upper], marker="o", capsize=3, label=label, **style)


def _bars(
    ax: Any,
    groups: list[str],
    series: dict[str, list[dict[str, float] | None]],
    *,
    horizontal: bool = False,
) -> None:
    """Grouped bars of medians with min-max whiskers; a missing summary leaves a gap."""
    width = 0.8 / max(1, len(series))
    for i, (label, summaries) in enumerate(series.items()):
        positions = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        shown = [(p, s) for p, s in zip(positions, summaries, strict=True) if s is not None]
        if not shown:
            continue
        ps = [p for p, _ in shown]
        medians = [s["median"] for _, s in shown]
        err = [
            [s["median"] - s["min"] for _, s in shown],
            [s["max"] - s["median"] for _, s in shown],
        ]
        if horizontal:
            ax.barh(ps, medians, height=width, xerr=err, capsize=3, label=label)
        else:
            ax.bar(ps, medians, width=width, yerr=err, capsize=3, label=label)
    if horizontal:
        ax.set_yticks(range(len(groups)), groups)
        ax.invert_yaxis()
    else:
        ax.set_xticks(range(len(groups)), groups)
        ax.margins(y=0.25)  # room above the bars for the legend


def _finish(ax: Any, title: str, *, legend: bool = True) -> None:
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if legend:
        ax.legend(fontsize=9)


def _throughput_panel(
    ax: Any, entries: dict[str, Any], variants: dict[str, str], title: str
) -> None:
    sizes = [int(s) for s in entries]
    for name, label in variants.items():
        if all(name in r["variants"] for r in entries.values()):
            _errorbars(ax, sizes, [r["variants"][name] for r in entries.values()], label)
    ax.set(xscale="log", yscale="log", xlabel="batch size (mutations)", ylabel="mutations/s")
    _finish(ax, title)


def _commit_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    submissions, transitions = section["submissions"], section["transitions"]

    def submitted(ax: Any) -> None:
        _throughput_panel(ax, submissions, _LABELS, "Commit of submission batches")

    def transitioned(ax: Any) -> None:
        _throughput_panel(
            ax,
            transitions,
            {k: _LABELS[k] for k in ("store", "raw")},
            "Commit of status-transition batches",
        )

    def ratios(ax: Any) -> None:
        # Each series slightly shifted along x so that the whiskers do not overlap.
        for i, (entries, key, label) in enumerate(
            (
                (submissions, "store_vs_raw", "submissions: store / raw (>= 0.95 from 100)"),
                (submissions, "store_vs_copy", "submissions: store / COPY (>= 0.8 from 100)"),
                (submissions, "store_vs_pgqueuer", "submissions: store / pgqueuer (> 1)"),
                (transitions, "store_vs_raw", "transitions: store / raw (>= 0.95 from 100)"),
            )
        ):
            shift = 1.08 ** (i - 1.5)
            _errorbars(
                ax, [int(s) * shift for s in entries], [r[key] for r in entries.values()], label
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(xscale="log", xlabel="batch size (mutations)", ylabel="paired ratio")
        _finish(ax, "Commit: the store against each baseline")

    return [submitted, transitioned, ratios]


def _group_commit_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    counts = _counts(section)

    sides = {
        "group": "GroupCommitter",
        "single": "one transaction each",
        "batched": "one caller, batches of N",
    }

    def panel(ax: Any) -> None:
        shown = {k: v for k, v in sides.items() if all(k in r["variants"] for r in counts.values())}
        if len(counts) >= 3:  # a curve over the submitter counts
            xs = [int(n) for n in counts]
            for name, label in shown.items():
                _errorbars(ax, xs, [r["variants"][name] for r in counts.values()], label)
            ax.set(xscale="log", xlabel="concurrent submitters")
        else:  # one or two counts (the quick profile): bars
            _bars(
                ax,
                [f"{int(n):,} submitter{'' if n == '1' else 's'}" for n in counts],
                {
                    label: [r["variants"][name] for r in counts.values()]
                    for name, label in shown.items()
                },
            )
        ax.set(yscale="log", ylabel="mutations/s")
        title = "Group commit, one-mutation submissions"
        if "64" in counts:
            r = counts["64"]
            title += f"\n64: {r['group_vs_single']['median']:.1f}x single"
            if "group_vs_batched" in r:
                title += f", {r['group_vs_batched']['median']:.2f}x batched"
        _finish(ax, title)

    return [panel]


def _recovery_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    sizes = _counts(section)

    def panel(ax: Any) -> None:
        _bars(
            ax,
            [f"{int(s):,}" for s in sizes],
            {
                label: [r["variants"][name]["tasks_per_second"] for r in sizes.values()]
                for name, label in (("store", "PgStore.recover"), ("raw", "raw asyncpg"))
            },
        )
        for x, r in enumerate(sizes.values()):
            rss = (
                r["variants"]["store"]["peak_rss_mib"]["max"],
                r["variants"]["raw"]["peak_rss_mib"]["max"],
            )
            ax.annotate(
                f"peak RSS, store / raw:\n{rss[0]:.0f} / {rss[1]:.0f} MiB",
                (x, 0),
                xytext=(0, 8),
                textcoords="offset points",
                ha="center",
                fontsize=9,
                color="white",
            )
        ax.set(xlabel="live tasks", ylabel="live tasks loaded per second")
        ratios = ", ".join(f"{r['store_vs_raw']['median']:.2f}" for r in sizes.values())
        _finish(ax, f"Recovery (store/raw: {ratios})")

    return [panel]


_TAKEOVERS = {
    "sigkill": "leader SIGKILLed",
    "stall": "network stalled",
    "stall_idle_session_timeout": "stalled, role with\nidle_session_timeout",
}


def _takeover_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    scenarios = {k: v for k, v in _TAKEOVERS.items() if k in section}

    def panel(ax: Any) -> None:
        _bars(
            ax,
            list(scenarios.values()),
            {
                "standby leads after": [section[k]["takeover_seconds"] for k in scenarios],
                "old leader steps down after": [section[k]["step_down_seconds"] for k in scenarios],
            },
            horizontal=True,
        )
        for y, key in enumerate(scenarios):
            if section[key]["no_takeover_within_cap"]:
                ax.annotate(
                    f"{section[key]['no_takeover_within_cap']} of {section[key]['repeats']}: "
                    f"no takeover within {section['cap_seconds']:.0f} s",
                    (0, y - 0.2),  # where the missing "standby leads after" bar would be
                    xytext=(4, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=9,
                )
        ax.set(xlabel="seconds after the failure")
        _finish(
            ax,
            f"Takeover\nsession_timeout {section['session_timeout']} s, "
            f"lock_poll {section['lock_poll']} s",
        )

    return [panel]


def _one(value: float) -> dict[str, float]:
    """A single measurement as a summary (no range)."""
    return {"median": value, "min": value, "max": value}


def _prune_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    def panel(ax: Any) -> None:
        v = section["variants"]
        groups = [
            f"{section['finished']:,} finished,\n{section['live_with_dependencies']:,} protected"
        ]
        store, raw = [v["store"]], [v["raw_unprotected"]]
        many = section.get("large_finished")
        if many:
            groups.append(
                f"{many['finished']:,} finished,\n{many['live_with_dependencies']:,} protected"
                " (one run)"
            )
            for side, name in ((store, "store"), (raw, "raw_unprotected")):
                rate = many["variants"].get(name, {}).get("rows_per_second")
                side.append(None if rate is None else _one(rate))
        _bars(ax, groups, {"PgStore.prune (protected)": store, "raw delete, unprotected": raw})
        ax.set(ylabel="rows deleted per second")
        _finish(ax, "Prune")

    return [panel]


def _scale_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    sizes = _counts(section.get("sizes", {}))

    def panel(ax: Any) -> None:
        batch = section.get("batch", {})
        _bars(
            ax,
            [f"{int(s):,} rows" for s in sizes],
            {
                f"{kind} (batch {batch.get(kind, '?')})": [
                    r[kind]["large_vs_empty"] if kind in r else None for r in sizes.values()
                ]
                for kind in ("commit", "transitions")
            },
        )
        ax.axhline(0.8, color="black", linestyle="--", linewidth=0.8, label="target 0.8")
        ax.set(ylabel="rate / rate on an empty table")
        _finish(ax, "How cost grows with the table")

    return [panel] if sizes else []


def _indexes_panels(section: dict[str, Any]) -> list[Callable[[Any], None]]:
    designs = {k: d for k, d in section.get("designs", {}).items() if "vs_current" in d}

    def panel(ax: Any) -> None:
        _bars(
            ax,
            list(designs),
            {"transitions vs current design": [d["vs_current"] for d in designs.values()]},
            horizontal=True,
        )
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set(xlabel="paired ratio of transition rates")
        _finish(ax, "Index designs: status transitions", legend=False)

    return [panel] if designs else []


_PANELS: dict[str, Callable[[dict[str, Any]], list[Callable[[Any], None]]]] = {
    "commit": _commit_panels,
    "group_commit": _group_commit_panels,
    "scale": _scale_panels,
    "recovery": _recovery_panels,
    "prune": _prune_panels,
    "takeover": _takeover_panels,
    "indexes": _indexes_panels,
}


def plot(results: dict[str, Any], path: Path) -> None:
    """One panel per figure of every section that ran (two columns); medians, with
    whiskers from the minimum to the maximum of the rounds."""
    sections = results["sections"]
    panels = [
        panel
        for name, make in _PANELS.items()
        if name in sections
        for panel in make(sections[name])
    ]
    rows = max(1, (len(panels) + 1) // 2)
    with plt.rc_context({"font.size": 11}):
        fig, axes = plt.subplots(
            rows, 2, figsize=(12, 4.6 * rows), squeeze=False, layout="constrained"
        )
        for ax, panel in zip(axes.flat, panels, strict=False):
            panel(ax)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        server = results.get("server", {}).get("version", "PostgreSQL").split(" on ")[0]
        fig.suptitle(
            f"cronoq-store, {results['machine']['nproc']} cores, {server}, "
            f"{results['profile']} profile, revision {results['machine'].get('revision')}, "
            f"{results.get('loop', 'asyncio')} loop (whiskers: min-max of the rounds)"
        )
        fig.savefig(path, dpi=100)
        plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    out = Path((argv if argv is not None else sys.argv[1:])[0])
    results = json.loads((out / "results.json").read_text())
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "results.png")
    print(key_figures(results))


if __name__ == "__main__":
    main()
