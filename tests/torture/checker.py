"""The checker: proves, from journals, audit and tables, the four properties of a run.

1. **Nothing acknowledged is lost**: every mutation in an ack record is in ``cronoq_tasks``
   as itself or a later state of its task (states are ordered by ``(attempt, rank)``).
2. **No stale write**: every committed row version was written by the epoch stored at the
   time (the audit trigger's view inside the writing transaction) and committed before the
   next epoch was taken (commit timestamps of the write and of the bump).
3. **One instance per epoch**: each epoch was taken by one instance, and only that instance
   acknowledged (journals) and wrote (audit) in it.
4. **Bounded takeovers**: each takeover caused by a fault completed (the new leader had
   recovered) within ``session_timeout + lock_poll + recovery + SLACK`` of the fault, with
   the fault's allowance in place of ``session_timeout`` where it sets one: a frozen
   leader's lock lasts until the server's idle limit on the lock session; after a server
   restart the clock starts at the server's return (standbys retry reaching it at least
   every ``lock_poll``, so the bound holds unchanged).

A violation carries the timeline around it: faults, takeovers, step-downs, fencing, acks.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cronoq_store._domain import TaskId, epoch_of

from .audit import AuditWrite, EpochTake
from .faults import Fault, Timing
from .journal import Ack, History

__all__ = ["SLACK", "Report", "Takeover", "Violation", "check", "percentile"]

#: Scheduling slack in the takeover bound (seconds): three store processes, the server and
#: the orchestrator's proxies share two cores.
SLACK = 1.0
#: Violations of each property shown in full; the rest are counted.
_SHOWN = 5

_RANK = {"q": 0, "r": 1, "y": 2, "s": 3, "f": 3}
_CODE = {"queued": "q", "running": "r", "retrying": "y", "succeeded": "s", "failed": "f"}
_MESSAGE = re.compile(r"e(\d+) (\S+)")
#: How the store's epoch check words a refusal (its local check says "leadership was lost").
_DB_FENCE = "the stored epoch is"


@dataclass(frozen=True, slots=True)
class Violation:
    #: The property broken (1 to 4), or 0 for the harness itself (a worker's error).
    prop: int
    summary: str
    history: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Takeover:
    """A new leader after a fault (``cause``), or after an unprovoked step-down (``None``)."""

    epoch: int
    worker: str
    previous: str
    cause: Fault | None
    #: When the clock starts: the fault's injection, the server's return after a restart,
    #: or the old leader's step-down when no fault explains the takeover.
    start: float
    acquired_at: float
    recovered_at: float
    recovery_seconds: float
    bound: float

    @property
    def seconds(self) -> float:
        return self.recovered_at - self.start

    @property
    def after_freed(self) -> float | None:
        """Seconds from the lock becoming free to the new leader having recovered (the
        store's own reaction), when the fault tells exactly when that was."""
        if self.cause is None or self.cause.freed_at is None or not self.cause.freed_exactly:
            return None
        return self.recovered_at - self.cause.freed_at


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``nan`` for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Report:
    """Figures and violations of one run."""

    profile: str
    seed: int
    guards: bool
    timing: Timing
    started: float
    ended: float
    faults: list[Fault]
    acked_submissions: int = 0
    acked_mutations: int = 0
    lost: int = 0
    stale_writes: int = 0
    audit_writes: int = 0
    double_ack_epochs: int = 0
    epochs_taken: int = 0
    instance_changes: int = 0
    fenced_commits: int = 0
    #: Terms whose commits the epoch check in the database refused (not the local check).
    terms_fenced_by_database: int = 0
    aborted_terms: int = 0
    torn_lines: int = 0
    takeovers: list[Takeover] = field(default_factory=list)
    unprovoked: list[Takeover] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    #: Every fault, takeover, step-down and fencing of the run, one line each.
    timeline: list[str] = field(default_factory=list)

    @property
    def leadership_changes(self) -> int:
        return max(0, self.epochs_taken - 1)

    def figures(self) -> dict[str, Any]:
        """The run's figures as plain data (for a JSON file and the docs)."""
        seconds = [t.seconds for t in self.takeovers]
        reaction = [t.after_freed for t in self.takeovers if t.after_freed is not None]
        by_cause: dict[str, list[float]] = defaultdict(list)
        for t in self.takeovers:
            by_cause[t.cause.kind if t.cause else "unprovoked"].append(t.seconds)
        return {
            "profile": self.profile,
            "seed": self.seed,
            "guards": self.guards,
            "duration_s": round(self.ended - self.started, 1),
            "faults": len(self.faults),
            "faults_by_kind": dict(Counter(f.kind for f in self.faults).most_common()),
            "acked_submissions": self.acked_submissions,
            "acked_mutations": self.acked_mutations,
            "lost": self.lost,
            "stale_writes": self.stale_writes,
            "audit_writes": self.audit_writes,
            "double_ack_epochs": self.double_ack_epochs,
            "epochs_taken": self.epochs_taken,
            "leadership_changes": self.leadership_changes,
            "instance_changes": self.instance_changes,
            "fenced_commits": self.fenced_commits,
            "terms_fenced_by_database": self.terms_fenced_by_database,
            "aborted_terms": self.aborted_terms,
            "takeovers": len(self.takeovers),
            "takeover_p50_s": round(percentile(seconds, 0.5), 3),
            "takeover_p99_s": round(percentile(seconds, 0.99), 3),
            "takeover_max_s": round(max(seconds, default=math.nan), 3),
            "lock_free_to_recovered_p50_s": round(percentile(reaction, 0.5), 3),
            "lock_free_to_recovered_p99_s": round(percentile(reaction, 0.99), 3),
            "takeover_by_cause": {
                k: {
                    "n": len(v),
                    "p50_s": round(percentile(v, 0.5), 3),
                    "max_s": round(max(v), 3),
                }
                for k, v in sorted(by_cause.items())
            },
            "unprovoked_takeovers": len(self.unprovoked),
            "torn_journal_lines": self.torn_lines,
            "violations": len(self.violations),
        }

    def summary(self) -> str:
        f = self.figures()
        t = self.timing
        lines = [
            f"torture run: profile={self.profile} seed={self.seed} "
            f"guards={'on' if self.guards else 'off'} duration={f['duration_s']} s "
            f"(lock_poll={t.lock_poll} keepalive={t.keepalive} "
            f"session_timeout={t.session_timeout} commit_timeout={t.commit_timeout})",
            f"faults injected: {f['faults']} "
            + ", ".join(f"{k} {v}" for k, v in f["faults_by_kind"].items()),
            f"acknowledged: {f['acked_submissions']} submissions, "
            f"{f['acked_mutations']} mutations; lost: {f['lost']}",
            f"stale writes: {f['stale_writes']} of {f['audit_writes']} committed row versions; "
            f"submissions refused after losing leadership: {f['fenced_commits']} "
            f"(terms stopped by the epoch check in the database: "
            f"{f['terms_fenced_by_database']})",
            f"epochs taken: {f['epochs_taken']}; leadership changes: "
            f"{f['leadership_changes']} (between instances: {f['instance_changes']}); "
            f"terms ended before recovering: {f['aborted_terms']}; "
            f"double-acknowledging epochs: {f['double_ack_epochs']}",
            f"takeovers after a fault: {f['takeovers']}, fault -> recovered p50 "
            f"{f['takeover_p50_s']} s, p99 {f['takeover_p99_s']} s, max {f['takeover_max_s']} s",
        ]
        lines.append(
            f"  lock free -> recovered (where the fault frees it at a known instant) p50 "
            f"{f['lock_free_to_recovered_p50_s']} s, p99 {f['lock_free_to_recovered_p99_s']} s"
        )
        for cause, v in f["takeover_by_cause"].items():
            lines.append(f"  {cause}: n={v['n']} p50 {v['p50_s']} s max {v['max_s']} s")
        lines.append(f"unprovoked takeovers: {f['unprovoked_takeovers']}")
        lines.append(f"violations: {len(self.violations)}")
        return "\n".join(lines)

    def failure(self) -> str:
        """The seed, how to run it again, and the history of each violation shown."""
        lines = [
            self.summary(),
            "",
            f"reproduce the fault schedule: CRONOQ_TORTURE_SEED={self.seed} "
            f"CRONOQ_TORTURE_PROFILE={self.profile} "
            "python -m pytest -p no:cacheprovider tests/test_torture.py",
        ]
        shown: Counter[int] = Counter()
        for v in self.violations:
            shown[v.prop] += 1
            if shown[v.prop] > _SHOWN:
                continue
            label = f"property {v.prop}" if v.prop else "harness"
            lines += ["", f"{label}: {v.summary}", *(f"    {h}" for h in v.history)]
        for prop, n in sorted(shown.items()):
            if n > _SHOWN:
                lines.append(f"... and {n - _SHOWN} more violations of property {prop}")
        return "\n".join(lines)


class _Timeline:
    """Events of the run in time order, for the history around a violation."""

    def __init__(
        self, started: float, history: History, faults: Sequence[Fault], takes: Sequence[EpochTake]
    ) -> None:
        self.started = started
        events: list[tuple[float, str]] = []
        for fault in faults:
            events.append((fault.started, f"FAULT {fault.describe()}"))
            if fault.freed_at is not None:
                events.append((fault.freed_at, f"  lock free ({fault.kind} on {fault.target})"))
            events.append((fault.ended, f"  fault over ({fault.kind} on {fault.target})"))
        for take in takes:
            events.append(
                (
                    take.committed.timestamp(),
                    f"DB: epoch {take.epoch} taken by {_worker_of(take.app)}",
                )
            )
        for lead in history.leads:
            events.append((lead.at, f"{lead.worker}: leads epoch {lead.epoch}"))
        for rec in history.recoveries:
            events.append(
                (
                    rec.at,
                    f"{rec.worker}: recovered epoch {rec.epoch} "
                    f"({rec.live} live, {rec.seconds:.3f} s)",
                )
            )
        for down in history.step_downs:
            events.append(
                (down.at, f"{down.worker}: stepped down from epoch {down.epoch}: {down.reason}")
            )
        for note in history.notes:
            if note.kind in ("fenced", "error", "start", "stop"):
                detail = str(note.fields.get("error", note.fields.get("pid", "")))[:120]
                events.append((note.at, f"{note.worker}: {note.kind} {detail}".rstrip()))
        events.sort(key=lambda e: e[0])
        self.events = events

    def line(self, at: float, text: str) -> str:
        return f"{at - self.started:9.3f} s  {text}"

    def around(self, at: float, before: float = 6.0, after: float = 3.0) -> list[str]:
        return [self.line(t, text) for t, text in self.events if at - before <= t <= at + after][
            -40:
        ]


def _worker_of(app: str) -> str:
    # A lock session is named "<worker> leader <instance id>".
    return re.sub(r" leader [0-9a-f]{8}\Z", "", app)


def _writer(write: AuditWrite) -> tuple[int, str]:
    """The epoch and instance that wrote a row version: from the message every transition
    carries, else (a new task, no transition yet) from its epoch-prefixed id."""
    if write.message is not None:
        match = _MESSAGE.fullmatch(write.message)
        if match:
            return int(match.group(1)), match.group(2)
    return epoch_of(TaskId(write.id)), write.app


def check(
    *,
    profile: str,
    seed: int,
    guards: bool,
    timing: Timing,
    started: float,
    ended: float,
    history: History,
    faults: list[Fault],
    rows: dict[int, tuple[str, int]],
    writes: Sequence[AuditWrite],
    takes: Sequence[EpochTake],
    crashes: Sequence[str],
) -> Report:
    """Check a finished run. ``rows``: ``cronoq_tasks`` as ``id -> (status, attempt)``;
    ``crashes``: workers that died on their own (the harness's failures, not the store's)."""
    report = Report(profile, seed, guards, timing, started, ended, faults)
    timeline = _Timeline(started, history, faults, takes)
    report.timeline = [timeline.line(t, text) for t, text in timeline.events]
    report.acked_submissions = len(history.acks)
    report.acked_mutations = history.acked_mutations
    report.audit_writes = len(writes)
    report.epochs_taken = len(takes)
    fenced = [n for n in history.notes if n.kind == "fenced"]
    report.fenced_commits = len(fenced)
    report.terms_fenced_by_database = len(
        {(n.worker, n.fields["e"]) for n in fenced if _DB_FENCE in n.fields["error"]}
    )
    report.torn_lines = history.torn_lines
    takers = {t.epoch: _worker_of(t.app) for t in takes}
    report.instance_changes = sum(
        1 for a, b in itertools.pairwise(takes) if _worker_of(a.app) != _worker_of(b.app)
    )
    for crash in crashes:
        report.violations.append(Violation(0, f"worker crashed: {crash}"))
    for note in history.errors():
        report.violations.append(
            Violation(
                0,
                f"{note.worker} failed: {note.fields.get('error')}",
                tuple(timeline.around(note.at)),
            )
        )
    _check_acks(report, history.acks, rows, timeline)
    _check_writes(report, writes, takes, timeline)
    _check_one_per_epoch(report, history, takers, timeline)
    _check_takeovers(report, history, faults, takes, timing, timeline)
    report.violations.sort(key=lambda v: v.prop)
    return report


def _check_acks(
    report: Report, acks: Iterable[Ack], rows: dict[int, tuple[str, int]], timeline: _Timeline
) -> None:
    """Property 1: each acknowledged mutation is stored, as itself or a later state."""
    for ack in acks:
        for task, attempt, code in ack.mutations:
            row = rows.get(task)
            if row is None:
                problem = "missing from cronoq_tasks"
            else:
                status, stored_attempt = row
                stored = (stored_attempt, _RANK[_CODE[status]])
                if _RANK[code] == 3:  # terminal: the task never changes again
                    ok = (stored_attempt, _CODE[status]) == (attempt, code)
                else:
                    ok = stored >= (attempt, _RANK[code])
                if ok:
                    continue
                problem = f"stored as {status} (attempt {stored_attempt})"
            report.lost += 1
            report.violations.append(
                Violation(
                    1,
                    f"task {task}: acknowledged as {code!r} attempt {attempt} by {ack.worker} "
                    f"in epoch {ack.epoch}, but {problem}",
                    (
                        timeline.line(
                            ack.at,
                            f"{ack.worker}: ack of epoch {ack.epoch} "
                            f"(sent at {ack.sent - timeline.started:.3f} s)",
                        ),
                        *timeline.around(ack.at),
                    ),
                )
            )


def _check_writes(
    report: Report, writes: Sequence[AuditWrite], takes: Sequence[EpochTake], timeline: _Timeline
) -> None:
    """Properties 2 and 3 from the audit: each row version was written by the current epoch,
    committed before the next one was taken, by the instance that took its epoch."""
    taken = {t.epoch: t for t in takes}
    later = sorted(taken)
    takers = {t.epoch: _worker_of(t.app) for t in takes}
    for write in writes:
        epoch, writer = _writer(write)
        at = write.committed.timestamp()
        problems: list[tuple[int, str]] = []
        if write.seen_epoch != epoch:
            problems.append(
                (2, f"written by epoch {epoch} while the stored epoch was {write.seen_epoch}")
            )
        following = next((e for e in later if e > epoch), None)
        if following is not None and write.committed >= taken[following].committed:
            problems.append((2, f"committed by epoch {epoch} after epoch {following} was taken"))
        if takers.get(epoch) not in (writer, None) or _worker_of(write.app) != writer:
            problems.append(
                (
                    3,
                    f"written in epoch {epoch} by {write.app!r}, which did not "
                    f"take it ({takers.get(epoch)!r} did)",
                )
            )
        for prop, text in problems:
            if prop == 2:
                report.stale_writes += 1
            report.violations.append(
                Violation(
                    prop,
                    f"task {write.id} {write.op} to {write.status} attempt {write.attempt}: {text}",
                    (
                        timeline.line(at, f"DB: this write committed ({write.app})"),
                        *timeline.around(at),
                    ),
                )
            )


def _check_one_per_epoch(
    report: Report, history: History, takers: dict[int, str], timeline: _Timeline
) -> None:
    """Property 3 from the journals: one leader per epoch, and only it acknowledged."""
    leaders: dict[int, set[str]] = defaultdict(set)
    for lead in history.leads:
        leaders[lead.epoch].add(lead.worker)
    ackers: dict[int, set[str]] = defaultdict(set)
    first_ack: dict[int, Ack] = {}
    for ack in history.acks:
        ackers[ack.epoch].add(ack.worker)
        first_ack.setdefault(ack.epoch, ack)
    for epoch in sorted(set(leaders) | set(ackers)):
        owners = leaders[epoch] | ({takers[epoch]} if epoch in takers else set())
        if len(owners) > 1 or len(ackers[epoch] | owners) > 1:
            report.double_ack_epochs += 1
            at = first_ack[epoch].at if epoch in first_ack else timeline.started
            report.violations.append(
                Violation(
                    3,
                    f"epoch {epoch}: taken by {sorted(owners)}, acknowledged by "
                    f"{sorted(ackers[epoch])}",
                    tuple(timeline.around(at)),
                )
            )


def _check_takeovers(
    report: Report,
    history: History,
    faults: Sequence[Fault],
    takes: Sequence[EpochTake],
    timing: Timing,
    timeline: _Timeline,
) -> None:
    """Property 4: attribute each takeover to the fault that freed the lock, and bound it."""
    leads = {lead.epoch: lead for lead in history.leads}
    recoveries = {rec.epoch: rec for rec in history.recoveries}
    last_down = {down.epoch: down for down in history.step_downs}
    for prev, take in itertools.pairwise(takes):
        lead, rec = leads.get(take.epoch), recoveries.get(take.epoch)
        if lead is None or rec is None:
            report.aborted_terms += 1  # the new leader died or lost it before recovering
            continue
        previous = _worker_of(prev.app)
        window = (prev.committed.timestamp(), lead.at)
        causes = [
            f
            for f in faults
            if f.freed_at is not None
            and window[0] <= f.started <= window[1]
            and f.target in (previous, "server")
        ]
        # A later fault in the window (a second server restart...) starts the clock again;
        # each earlier one must have been followed by a takeover within its bound, or by
        # the next fault before that bound ran out.
        for earlier, then in itertools.pairwise(causes):
            limit = _bound(earlier, timing, rec.seconds)
            waited = then.started - _clock_start(earlier)
            if waited > limit:
                report.violations.append(
                    Violation(
                        4,
                        f"no takeover within {waited:.3f} s of {earlier.describe()} "
                        f"(bound {limit:.3f} s)",
                        tuple(timeline.around(then.started, before=waited + 3)),
                    )
                )
        cause = causes[-1] if causes else None
        if cause is None:
            down = last_down.get(prev.epoch)
            start = down.at if down is not None else prev.committed.timestamp()
        else:
            start = _clock_start(cause)
        takeover = Takeover(
            epoch=take.epoch,
            worker=lead.worker,
            previous=previous,
            cause=cause,
            start=start,
            acquired_at=lead.at,
            recovered_at=rec.at,
            recovery_seconds=rec.seconds,
            bound=_bound(cause, timing, rec.seconds),
        )
        (report.takeovers if cause is not None else report.unprovoked).append(takeover)
        if cause is not None and takeover.seconds > takeover.bound:
            report.violations.append(
                Violation(
                    4,
                    f"epoch {take.epoch}: {lead.worker} recovered {takeover.seconds:.3f} s "
                    f"after {cause.describe()} (bound {takeover.bound:.3f} s)",
                    tuple(timeline.around(rec.at, before=takeover.seconds + 3)),
                )
            )


def _clock_start(cause: Fault) -> float:
    """When a takeover's clock starts: at the fault, or once a restarted server is back."""
    if cause.target == "server" and cause.freed_at is not None:
        return cause.freed_at
    return cause.started


def _bound(cause: Fault | None, timing: Timing, recovery: float) -> float:
    """``session_timeout + lock_poll + recovery + SLACK``, with the fault's own allowance
    in place of ``session_timeout`` where it has one (a frozen leader's lock is freed by the
    server's idle limit; after a restart, standbys wait out their reconnect backoff)."""
    wait = timing.session_timeout
    if cause is not None and cause.allowance is not None:
        wait = cause.allowance
    return wait + timing.lock_poll + recovery + SLACK
