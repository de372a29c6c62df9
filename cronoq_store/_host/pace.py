"""How fast a host process takes clusters on: by what it gained last, what it still
recovers, and how late its event loop runs.

A process holds its clusters only while its host session answers within
``session_timeout``, and the same event loop serves that session, every commit and every
recovery. A process that takes on more than its cores serve answers later and later; past
``session_timeout`` its session is lost, every cluster steps down, and taking them all back
at once, each with a recovery, loads it more than before: it never converges (seen with
10,000 clusters on 2 cores). So a process:

- claims at most twice what its last claiming round gained (at least one claim
  transaction's worth, and that after each new session), less the recoveries of clusters
  gained earlier still waiting or running: claims follow recoveries, and the load each
  gained cluster brings shows before the next claims;
- claims nothing while its keeper wakes a tenth of ``session_timeout`` late, and stops a
  claim between two batches once the loop runs that late: a claim is a transaction of
  about eight round trips, each as late.

Clusters left unowned that way are claimed once a process has room under its target and a
loop that keeps up; ``status`` shows them unowned, and the warning says why. A process
never hands clusters over for being late: its peers, at their targets, would not take them
(the targets count every live process alike), so the clusters would only go unled.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["ClaimPace"]

logger = logging.getLogger("cronoq_store")

#: The lateness, as a share of ``session_timeout``, from which a process claims nothing.
STRAINED_SHARE = 0.1
#: The timer :meth:`ClaimPace.lagging` measures the loop's lateness with, in seconds.
_PROBE = 0.001


class ClaimPace:
    """The claim window of one process (see the module's docstring). The keeper reports
    each wake-up's lateness with :meth:`woke`; each balancing round asks :meth:`allowance`,
    a claim asks :meth:`lagging` between two batches and reports :meth:`gained`."""

    def __init__(self, session_timeout: float, smallest: int, largest: int) -> None:
        self._strained = STRAINED_SHARE * session_timeout
        self._smallest = smallest
        self._largest = largest
        self._window = smallest
        self._lag = 0.0
        self._was_strained = False

    def restart(self) -> None:
        """A new host session: it claims from the smallest window again."""
        self._window = self._smallest
        self._lag = 0.0

    def woke(self, late: float) -> None:
        """The keeper woke ``late`` seconds after it meant to."""
        self._lag = max(self._lag, late)

    def allowance(self, recovering: int) -> int:
        """How many clusters this balancing round may claim, with ``recovering`` recoveries
        of clusters gained earlier still waiting or running: none while the loop runs late
        (the lateness seen since the last round, consumed here), else the window less them."""
        lag, self._lag = self._lag, 0.0
        if lag >= self._strained:
            if not self._was_strained:
                logger.warning(
                    "this host process's event loop runs late; it claims no more clusters "
                    "until it catches up (add processes or cores if this lasts)",
                    extra={"late_seconds": round(lag, 3), "limit_seconds": self._strained},
                )
            self._was_strained = True
            self._window = self._smallest
            return 0
        if self._was_strained:
            logger.info(
                "this host process's event loop caught up; it claims clusters again",
                extra={"late_seconds": round(lag, 3)},
            )
            self._was_strained = False
        return max(0, self._window - recovering)

    def gained(self, clusters: int) -> None:
        """A claiming round gained ``clusters``: the next may claim twice as many. A round
        that gained none (its clusters cooling, held by a standalone leader, taken by
        another process) closes the window to the smallest: it opens only with gains."""
        self._window = min(self._largest, max(self._smallest, 2 * clusters))

    async def lagging(self) -> bool:
        """Whether the loop runs late now: a short timer's lateness, for a claim that goes
        on batch after batch while the clusters gained in the first ones load the loop."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(_PROBE)
        late = max(0.0, loop.time() - started - _PROBE)
        self.woke(late)
        return late >= self._strained
