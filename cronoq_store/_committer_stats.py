"""What a group committer counts, and the snapshot of it that ``GroupCommitter.stats()`` gives.

Kept apart from the committer's control flow: :class:`Tally` is bumped at each event and
frozen into a :class:`CommitterStats` on demand (percentiles over a bounded window of
recent latencies, sorted only when asked for).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CommitterStats", "Tally"]


@dataclass(frozen=True, slots=True)
class CommitterStats:
    """A snapshot of a committer's counters; latencies are seconds, ``None`` before any ack.

    Latency runs from the call to ``submit`` (backpressure wait included) to the ack, over
    the last ``latency_window`` acknowledged submissions.
    """

    #: Submissions accepted into the queue.
    submissions: int
    #: Submissions acknowledged: their mutations are durable.
    acknowledged: int
    #: Submissions that received an error.
    failed_submissions: int
    #: Submissions cancelled by their submitter before a batch took them: never committed.
    dropped: int
    #: Mutations acknowledged (outputs not counted).
    mutations: int
    #: Transactions that committed.
    commits: int
    #: Commit attempts that failed transiently and were retried.
    retries: int
    #: Batches split in two because a non-transient error failed them, or a stuck one.
    splits: int
    #: Batches that kept failing transiently while the database answered (stuck): split,
    #: or, a single submission, failed with the last error.
    stuck_batches: int
    #: Pings that found the database not answering: the failing batch was retried.
    unanswered_pings: int
    #: Submissions accepted and not yet settled (queued or in flight), and their size.
    pending_submissions: int
    pending_mutations: int
    #: Mutations and submissions per committed transaction.
    mean_batch_mutations: float
    mean_batch_submissions: float
    latency_p50: float | None
    latency_p99: float | None
    latency_max: float | None


class Tally:
    """A committer's running counts and the latencies of its last acknowledged submissions."""

    __slots__ = (
        "acknowledged",
        "commits",
        "committed_submissions",
        "dropped",
        "failed",
        "latencies",
        "mutations",
        "retries",
        "splits",
        "stuck",
        "submissions",
        "unanswered_pings",
    )

    def __init__(self, latency_window: int) -> None:
        self.submissions = 0
        self.acknowledged = 0
        self.failed = 0
        self.dropped = 0
        self.mutations = 0
        self.commits = 0
        self.committed_submissions = 0
        self.retries = 0
        self.splits = 0
        self.stuck = 0
        self.unanswered_pings = 0
        self.latencies: deque[float] = deque(maxlen=latency_window)

    def acknowledge(self, mutations: int, latencies: Sequence[float]) -> None:
        """Submissions holding ``mutations`` in all are durable, each ``latencies[i]``
        seconds after its submit (one call per committed batch)."""
        self.acknowledged += len(latencies)
        self.mutations += mutations
        self.latencies.extend(latencies)

    def commit(self, submissions: int) -> None:
        """One transaction holding ``submissions`` committed."""
        self.commits += 1
        self.committed_submissions += submissions

    def snapshot(self, pending_submissions: int, pending_mutations: int) -> CommitterStats:
        ordered = sorted(self.latencies)
        commits = self.commits
        return CommitterStats(
            submissions=self.submissions,
            acknowledged=self.acknowledged,
            failed_submissions=self.failed,
            dropped=self.dropped,
            mutations=self.mutations,
            commits=commits,
            retries=self.retries,
            splits=self.splits,
            stuck_batches=self.stuck,
            unanswered_pings=self.unanswered_pings,
            pending_submissions=pending_submissions,
            pending_mutations=pending_mutations,
            mean_batch_mutations=self.mutations / commits if commits else 0.0,
            mean_batch_submissions=self.committed_submissions / commits if commits else 0.0,
            latency_p50=_percentile(ordered, 0.50),
            latency_p99=_percentile(ordered, 0.99),
            latency_max=ordered[-1] if ordered else None,
        )


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted sequence."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
