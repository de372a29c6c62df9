"""How fast a host process takes clusters on, and when it gives some up: by how late its
event loop runs.

A process holds its clusters only while its host session answers within
``session_timeout``, and the session is served by the same event loop as every commit and
recovery of those clusters. A process given more than its cores serve (clusters, commits,
recoveries) answers later and later; past ``session_timeout`` its session is lost, every
cluster steps down, and taking them all back at once, each with a recovery, loads it more
than before: it never converges (seen with 10,000 clusters on 2 cores). So a process
measures how late its keeper wakes, and:

- claims in a window that doubles each round that claims, from one claim transaction's
  worth after each new session, less the recoveries of clusters gained earlier still
  waiting or running: the claims follow the recoveries, and the load each gained cluster
  brings shows before the next claims;
- claims nothing while a wake-up is a tenth of ``session_timeout`` late: a claim is a
  transaction of about eight round trips, each as late;
- hands an eighth of its clusters over (at most ``max_releases``) each balancing round
  once two rounds in a row woke a quarter of ``session_timeout`` late: fewer clusters
  here and some unowned for a while, instead of every one stepping down with the session.

Clusters left unowned that way are claimed by whichever process has room, or by this one
once it catches up; ``status`` shows them unowned, and the warnings say why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

__all__ = ["ClaimPace", "Round"]

logger = logging.getLogger("cronoq_store")

#: The lateness, as a share of ``session_timeout``, from which a process claims nothing.
STRAINED_SHARE = 0.1
#: The lateness, as a share of ``session_timeout``, from which it hands clusters over ...
OVERLOADED_SHARE = 0.25
#: ... once that many balancing rounds in a row saw it: one late wake-up is a pause (a
#: collection, a large recovery's decoding), not a load the process cannot carry.
OVERLOADED_STREAK = 2
#: The timer :meth:`ClaimPace.lagging` measures the loop's lateness with, in seconds.
_PROBE = 0.001


@dataclass(frozen=True, slots=True)
class Round:
    """What one balancing round may do: claim (up to the window of ``claims``, 0: none);
    ``shed``: hand some over. ``lag``: the latest wake-up since the last round, seconds."""

    claims: int
    shed: bool
    lag: float


class ClaimPace:
    """The claim window of one process (see the module's docstring). The keeper reports
    each wake-up's lateness with :meth:`woke`; each balancing round asks :meth:`look`,
    then :meth:`claiming` when it claims, and :meth:`lagging` between two claim batches."""

    def __init__(self, session_timeout: float, smallest: int, largest: int) -> None:
        self._strained = STRAINED_SHARE * session_timeout
        self._overloaded = OVERLOADED_SHARE * session_timeout
        self._smallest = smallest
        self._largest = largest
        self._window = smallest
        self._lag = 0.0
        self._streak = 0
        self._was_strained = False

    def restart(self) -> None:
        """A new host session: it claims from the smallest window again."""
        self._window = self._smallest
        self._lag = 0.0
        self._streak = 0

    def woke(self, late: float) -> None:
        """The keeper woke ``late`` seconds after it meant to."""
        self._lag = max(self._lag, late)

    async def lagging(self) -> bool:
        """Whether the loop runs late now (a tenth of ``session_timeout``): a short timer's
        lateness, for a claim that goes on batch after batch while the clusters gained in
        the first ones already load the loop."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(_PROBE)
        late = max(0.0, loop.time() - started - _PROBE)
        self.woke(late)
        return late >= self._strained

    def look(self) -> Round:
        """What this balancing round may do, from the lateness seen since the last one
        (consumed): ``claims`` is the window, or 0 while the loop runs late."""
        lag, self._lag = self._lag, 0.0
        self._streak = self._streak + 1 if lag >= self._overloaded else 0
        shed = self._streak >= OVERLOADED_STREAK
        if lag >= self._strained or shed:
            if not self._was_strained:
                logger.warning(
                    "this host process's event loop runs late; it claims no more clusters "
                    "until it catches up (add processes or cores if this lasts)",
                    extra={"late_seconds": round(lag, 3), "limit_seconds": self._strained},
                )
            self._was_strained = True
            self._window = self._smallest
            return Round(0, shed, lag)
        if self._was_strained:
            logger.info(
                "this host process's event loop caught up; it claims clusters again",
                extra={"late_seconds": round(lag, 3)},
            )
            self._was_strained = False
        return Round(self._window, False, lag)

    def claiming(self, recovering: int) -> int:
        """How many clusters this round claims, with ``recovering`` recoveries of clusters
        gained earlier still waiting or running; the window doubles for the next round
        (it grows only while claims are made, never while a process waits)."""
        claims = max(0, self._window - recovering)
        self._window = min(self._largest, self._window * 2)
        return claims
