"""The HA demo: crash a leader mid-stream and show that nothing it acknowledged is lost.

Run by ``cronoq-store demo`` (which imports this package only then). Every instance is a
real process (:mod:`cronoq_store._demo.roles`), so the crash is a real ``SIGKILL``: no
``finally`` runs, no connection is closed politely. The orchestrator (:func:`run_demo`,
:mod:`cronoq_store._demo.orchestrator`) plays the operator:

1. Instance A leads, recovers, and acknowledges submissions from many concurrent submitter
   coroutines through :class:`~cronoq_store._committer.GroupCommitter`. Each submitter
   appends every acknowledged write to a file the moment its ``await`` returns, outside the
   database: that file is what clients were promised.
2. B waits as standby; a zombie process holds A's epoch, as a partitioned copy of A would.
3. A is killed. B takes over with the next epoch and recovers; the takeover is timed from
   the kill to B leading with its state recovered. B then writes under its own epoch.
4. The zombie tries to commit with A's epoch and must be fenced.
5. Every acknowledged write must be in B's recovery and in the table, and nothing the zombie
   tried may be there (:mod:`cronoq_store._demo.verdict`).

The fleet variant (``cronoq-store demo --fleet``, :mod:`cronoq_store._demo.fleet`) does the
same for host processes sharing many clusters: one is killed, the others take its clusters
over. Without a URL the demo runs on a throwaway
:class:`~cronoq_store.testing.EmbeddedPostgres`.
"""

from __future__ import annotations

from .fleet import FleetReport, run_fleet_demo
from .orchestrator import DemoError, run_demo
from .verdict import DemoReport, find_lost, parse_acks

__all__ = [
    "DemoError",
    "DemoReport",
    "FleetReport",
    "find_lost",
    "parse_acks",
    "run_demo",
    "run_fleet_demo",
]
