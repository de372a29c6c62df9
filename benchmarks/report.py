"""The results as a markdown table, a PNG plot and the one-line key figures.

``python -m benchmarks.report DIR`` renders ``DIR/results.md`` and ``DIR/results.png`` again
from ``DIR/results.json`` (also a partial one, left by an interrupted run).
"""

from __future__ import annotations

import json
import sys
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
    rows = [
        [
            n,
            _spread(r["variants"]["group"]),
            _spread(r["variants"]["single"]),
            _ratio(r["group_vs_single"]),
            f"{r['mean_batch_mutations']['median']:.0f}",
            f"{r['latency_p99_seconds']['median'] * 1000:.1f} ms",
        ]
        for n, r in section.items()
        if n.isdigit()
    ]
    return [
        "### Group commit: concurrent one-mutation submitters (mutations/s)",
        "",
        *_table(
            [
                "submitters",
                "GroupCommitter",
                "one transaction per submission",
                "ratio",
                "mean batch",
                "p99 latency",
            ],
            rows,
        ),
    ]


def _recovery(section: dict[str, Any]) -> list[str]:
    rows = []
    for size, r in section.items():
        if not size.isdigit():
            continue
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
        f"of them depended on by live tasks; batches of {section['batch']}.",
        "",
        *_table(
            ["PgStore.prune (protected)", "raw delete, unprotected", "finished tasks kept"],
            [[_spread(v["store"]), _spread(v["raw_unprotected"]), str(section["protected_kept"])]],
        ),
        *_large_prune(section["large_batch"]),
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


_SECTIONS = {
    "commit": _commit,
    "group_commit": _group_commit,
    "recovery": _recovery,
    "takeover": _takeover,
    "prune": _prune,
}


def _targets(sections: dict[str, Any]) -> list[str]:
    rows: list[list[str]] = []

    def check(name: str, value: float, ok: bool, wanted: str) -> None:
        rows.append([name, wanted, f"{value:.2f}", "met" if ok else "missed"])

    commit = sections.get("commit")
    if commit:
        for size, r in commit["submissions"].items():
            ratio = r["store_vs_raw"]["median"]
            if int(size) >= 100:
                check(f"commit b{size} vs raw", ratio, ratio >= 0.95, ">= 0.95")
            elif int(size) == 1:
                check("commit b1 vs raw", ratio, ratio >= 0.8, ">= 0.80")
            if int(size) >= 1000:
                pgq = r["store_vs_pgqueuer"]["median"]
                check(f"commit b{size} vs pgqueuer", pgq, pgq > 1.0, "> 1.00")
    group = sections.get("group_commit", {}).get("64")
    if group:
        ratio = group["group_vs_single"]["median"]
        check("group commit 64 vs single", ratio, ratio >= 20, ">= 20")
    for size, r in sections.get("recovery", {}).items():
        if size.isdigit():
            ratio = r["store_vs_raw"]["median"]
            check(f"recovery {int(size):,} vs raw", ratio, ratio >= 0.8, ">= 0.80")
            rss = r["variants"]["store"]["peak_rss_mib"]["max"]
            if int(size) >= 1_000_000:
                rows.append(
                    [
                        "peak RSS at 1M",
                        "<= 2048 MiB",
                        f"{rss:.0f}",
                        "met" if rss <= 2048 else "missed",
                    ]
                )
    return [
        "### Targets (medians of paired ratios)",
        "",
        *_table(["target", "wanted", "measured", ""], rows),
    ]


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    libs = ", ".join(f"{k} {v}" for k, v in machine["libraries"].items() if v)
    lines = [
        f"## Results ({results['profile']} profile, {results['elapsed_seconds']:.0f} s)",
        "",
        f"{machine['nproc']} cores, {machine['memory_gib']} GiB, Python {machine['python']}, "
        f"{results['server']['version'].split(' on ')[0]}; {libs}; revision "
        f"{machine['revision']}; load average {results['load_average']['before'][0]:.2f} "
        f"before, {results['load_average']['after'][0]:.2f} after.",
        "",
    ]
    lines += _targets(results["sections"])
    for name, section in results["sections"].items():
        lines += _SECTIONS[name](section)
    return "\n".join(lines) + "\n"


def key_figures(results: dict[str, Any]) -> str:
    """``name=value`` pairs of the headline ratios, for the last line of the run."""
    sections = results["sections"]
    figures: dict[str, float] = {}
    for size, r in sections.get("commit", {}).get("submissions", {}).items():
        figures[f"commit_b{size}_vs_raw"] = r["store_vs_raw"]["median"]
    for size, r in sections.get("commit", {}).get("submissions", {}).items():
        if int(size) >= 1000:
            figures[f"vs_pgqueuer_b{size}"] = r["store_vs_pgqueuer"]["median"]
    group = sections.get("group_commit", {}).get("64")
    if group:
        figures["groupcommit_64_vs_single"] = group["group_vs_single"]["median"]
    for size, r in sections.get("recovery", {}).items():
        if size.isdigit():
            label = (
                f"{int(size) // 1000}k" if int(size) < 1_000_000 else f"{int(size) // 1_000_000}m"
            )
            figures[f"recovery_{label}_vs_raw"] = r["store_vs_raw"]["median"]
            figures[f"recovery_{label}_rss_mib"] = r["variants"]["store"]["peak_rss_mib"]["max"]
    return " ".join(
        f"{k}={v:.0f}" if k.endswith("_mib") else f"{k}={v:.2f}" for k, v in figures.items()
    )


def _errorbars(ax: Any, xs: list[int], summaries: list[dict[str, float]], label: str) -> None:
    medians = [s["median"] for s in summaries]
    lower = [s["median"] - s["min"] for s in summaries]
    upper = [s["max"] - s["median"] for s in summaries]
    ax.errorbar(xs, medians, yerr=[lower, upper], marker="o", capsize=3, label=label)


def plot(results: dict[str, Any], path: Path) -> None:
    """Throughput against batch size and submitters, and recovery time; bars are min-max."""
    sections = results["sections"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (submit_ax, transition_ax), (group_ax, recovery_ax) = axes
    commit = sections.get("commit")
    if commit:
        sizes = [int(s) for s in commit["submissions"]]
        for name in _VARIANTS:
            _errorbars(
                submit_ax,
                sizes,
                [r["variants"][name] for r in commit["submissions"].values()],
                _LABELS[name],
            )
        submit_ax.set_title("Commit of submission batches")
        sizes = [int(s) for s in commit["transitions"]]
        for name in ("store", "raw"):
            _errorbars(
                transition_ax,
                sizes,
                [r["variants"][name] for r in commit["transitions"].values()],
                _LABELS[name],
            )
        transition_ax.set_title("Commit of status-transition batches")
        for ax in (submit_ax, transition_ax):
            ax.set(
                xscale="log", yscale="log", xlabel="batch size (mutations)", ylabel="mutations/s"
            )
            ax.legend(fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
    group = sections.get("group_commit")
    if group:
        counts = [int(n) for n in group]
        for name, label in (("group", "GroupCommitter"), ("single", "one transaction each")):
            _errorbars(group_ax, counts, [r["variants"][name] for r in group.values()], label)
        group_ax.set(
            xscale="log",
            yscale="log",
            xlabel="concurrent submitters",
            ylabel="mutations/s",
            title="Group commit, one-mutation submissions",
        )
        group_ax.legend(fontsize=8)
        group_ax.grid(True, which="both", alpha=0.3)
    recovery = {k: v for k, v in sections.get("recovery", {}).items() if k.isdigit()}
    if recovery:
        labels = [f"{int(s):,}" for s in recovery]
        xs = range(len(labels))
        for offset, name, label in (
            (-0.2, "store", "PgStore.recover"),
            (0.2, "raw", "raw asyncpg"),
        ):
            summaries = [r["variants"][name]["tasks_per_second"] for r in recovery.values()]
            recovery_ax.bar(
                [x + offset for x in xs],
                [s["median"] for s in summaries],
                width=0.4,
                yerr=[
                    [s["median"] - s["min"] for s in summaries],
                    [s["max"] - s["median"] for s in summaries],
                ],
                capsize=3,
                label=label,
            )
            for x, r, s in zip(xs, recovery.values(), summaries, strict=True):
                rss = r["variants"][name]["peak_rss_mib"]["median"]
                recovery_ax.annotate(
                    f"peak RSS\n{rss:.0f} MiB",
                    (x + offset, s["median"] / 2),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        recovery_ax.set_xticks(list(xs), labels)
        recovery_ax.set(
            xlabel="live tasks", ylabel="live tasks loaded per second", title="Recovery"
        )
        recovery_ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(
        f"cronoq-store, {results['machine']['nproc']} cores, "
        f"{results['server']['version'].split(',')[0]}, {results['profile']} profile"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    out = Path((argv if argv is not None else sys.argv[1:])[0])
    results = json.loads((out / "results.json").read_text())
    (out / "results.md").write_text(markdown(results))
    plot(results, out / "results.png")
    print(key_figures(results))


if __name__ == "__main__":
    main()
