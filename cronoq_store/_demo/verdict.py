"""The demo's verdict and its account, pure so that they can be tested to fail.

Acknowledged writes come from the file the submitters append to (:func:`parse_acks`); each
must show in B's recovery and in the table (:func:`find_lost`); the report collects what
happened and :func:`judge` lists every broken promise in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._terminal_safe import visible

__all__ = ["DemoReport", "find_lost", "judge", "parse_acks", "render"]

# What an acknowledgement promises, and which recovered or stored states keep the promise:
# T a task was accepted; R it started running; S it succeeded.
_KEPT: Mapping[str, frozenset[str] | None] = {
    "T": None,  # any state: the task exists
    "R": frozenset({"started", "running", "succeeded"}),
    "S": frozenset({"succeeded"}),
}


def parse_acks(text: str) -> list[tuple[str, int]]:
    """Acknowledged writes as ``(kind, task id)``; a torn last line was never complete, so
    it was not an acknowledgement anyone saw."""
    acks = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        kind, _, value = line.strip().partition(" ")
        acks.append((kind, int(value)))
    return acks


def find_lost(
    acks: Iterable[tuple[str, int]],
    recovered: Mapping[int, str],
    stored: Mapping[int, str],
) -> list[tuple[str, int]]:
    """Acknowledged writes that the recovery or the table does not show.

    ``recovered`` maps ids to ``queued``/``started`` (live, by attempt) or a finished status;
    ``stored`` maps ids to the table's ``status``. A task must exist in both; a start must
    show as started, running or succeeded; a success as succeeded.
    """
    lost = []
    for kind, tid in acks:
        kept = _KEPT[kind]
        for view in (recovered, stored):
            state = view.get(tid)
            if state is None or (kept is not None and state not in kept):
                lost.append((kind, tid))
                break
    return lost


@dataclass
class DemoReport:
    """What happened, for the account; ``failures`` is empty when the demo proved its point."""

    server: str
    schema: str
    submitters: int
    epoch_a: int = 0
    epoch_b: int = 0
    window: float = 0.0
    acked_tasks: int = 0
    acked_writes: int = 0
    acquire_seconds: float = 0.0
    recover_seconds: float = 0.0
    recovered: int = 0
    unacked_committed: int = 0
    lost: list[tuple[str, int]] = field(default_factory=list)
    resumed: bool = False
    stale_tried: int = 0
    stale_refused: int = 0
    stale_landed: int = 0
    commits: int = 0
    mean_batch: float = 0.0
    p99_ms: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def takeover_seconds(self) -> float:
        return self.acquire_seconds + self.recover_seconds

    @property
    def throughput(self) -> float:
        return self.acked_writes / self.window if self.window > 0 else 0.0


def render(report: DemoReport, console: Console) -> None:
    """The account: short enough to read at a glance, precise enough to check."""
    account = Table(
        title="the account", title_justify="left", show_header=False, box=None, padding=(0, 2)
    )
    account.add_column(style="bold")
    account.add_column()
    p99 = "" if report.p99_ms is None else f", p99 {report.p99_ms:.0f} ms"
    rows = [
        ("epochs", f"A led epoch {report.epoch_a}, B took over with epoch {report.epoch_b}"),
        (
            "takeover",
            f"{report.takeover_seconds:.2f} s from SIGKILL: lock {report.acquire_seconds:.2f} s"
            f" + recovery {report.recover_seconds:.2f} s",
        ),
        (
            "acknowledged",
            f"{report.acked_tasks:,} tasks; {report.acked_writes:,} writes with status "
            f"changes, in {report.window:.1f} s",
        ),
        (
            "throughput",
            f"{report.throughput:,.0f} acks/s; {report.commits:,} commits, "
            f"{report.mean_batch:.0f} submissions each{p99}",
        ),
        (
            "recovered",
            f"{report.recovered:,} tasks ({report.unacked_committed:,} committed, not yet acked)",
        ),
        ("lost", f"{len(report.lost):,}"),
        (
            "stale writes",
            f"{report.stale_refused:,} of {report.stale_tried:,} refused (FencedError), "
            f"{report.stale_landed:,} landed",
        ),
    ]
    for name, value in rows:
        account.add_row(name, value)
    console.print(account)
    if report.ok:
        console.print(
            "[green]OK[/green]: every acknowledged write survived the crash, "
            "and the zombie wrote nothing"
        )
    else:
        for failure in report.failures:
            console.print(f"[red]FAILED[/red]: {escape(visible(failure))}")


def judge(report: DemoReport, fenced: Mapping[str, Any]) -> None:
    """Add to ``report.failures`` every promise the run broke; ``fenced`` is the zombie's
    account of its stale writes."""
    if report.epoch_b == report.epoch_a:
        report.failures.append(f"B took over with A's epoch {report.epoch_a}")
    if report.lost:
        shown = ", ".join(f"{kind} {tid}" for kind, tid in report.lost[:5])
        more = ", ..." if len(report.lost) > 5 else ""
        report.failures.append(f"{len(report.lost)} acknowledged writes lost ({shown}{more})")
    if report.stale_landed:
        report.failures.append(f"{report.stale_landed} stale writes from the zombie landed")
    if report.stale_refused != report.stale_tried or fenced["acknowledged"]:
        report.failures.append(
            f"the zombie was not fenced: {fenced['acknowledged']} acknowledged, "
            f"errors {fenced['errors']}"
        )
    if not report.resumed:
        report.failures.append("B's write under its new epoch is not in the table")
