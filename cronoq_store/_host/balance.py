"""Balancing clusters over a host's processes: pure functions, no I/O.

Balancing is decentralised. There is no coordinator to elect, to fence or to lose: every
process reads the same membership and the same counts, computes the same :func:`targets`,
and acts on itself only. A process over its target releases its excess
(:func:`to_release`); a process under it claims unowned clusters (:func:`to_claim`), and
the database's ``FOR UPDATE`` settles the races that remain. Because the targets sum to the
number of clusters, the total excess equals the total deficit: the moves stop exactly at
floor/ceil (:func:`spread` at most 1), after the fewest moves possible, the initial excess.

Why not hashing alone: rendezvous or consistent hashing by itself gives each process about
``N/P ± sqrt(N/P)`` clusters (±16 at 1,000 clusters over 4 processes), not floor/ceil. The
rendezvous :func:`score` only chooses *which* clusters move, so that releases and claims
agree across processes without talking to each other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["score", "spread", "targets", "to_claim", "to_release"]


def targets(members: Sequence[int], clusters: int) -> dict[int, int]:
    """Each member's target: ``floor(N/P)``, plus one for ``N mod P`` of them.

    ``members`` are the live process ids, in any order; sorted ascending as
    ``p_0 < ... < p_{P-1}``, ``p_i`` gets the extra one when ``i < N mod P``.
    Every process computes the same answer from the same membership, which is what lets
    each act on itself with no coordinator. The targets sum to ``N`` and differ by at most
    one. Each database is balanced on its own: a process's ids differ between databases,
    so no order of members is common to them. No members: no targets.
    """
    if clusters < 0:
        raise ValueError(f"clusters must be >= 0, got {clusters}")
    ordered = sorted(members)
    if len(set(ordered)) != len(ordered):
        raise ValueError(f"members must be distinct process ids, got {list(members)}")
    count = len(ordered)
    if not count:
        return {}
    base, extra = divmod(clusters, count)
    return {process: base + (1 if index < extra else 0) for index, process in enumerate(ordered)}


def score(schema: str, process_id: int) -> int:
    """The rendezvous score of ``schema`` for ``process_id``: 8 bytes of BLAKE2b, big-endian.

    Every process must compute the same score for the same pair, in any Python run, so the
    score is a fixed hash of ``schema``, a NUL, and the decimal process id, never Python's
    ``hash()`` (salted per run for strings). The NUL keeps ``("a1", 2)`` apart from
    ``("a", 12)``: a schema name never holds one.
    """
    digest = hashlib.blake2b(f"{schema}\0{process_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def to_release(owned: Sequence[str], me: int, target: int, limit: int) -> list[str]:
    """The clusters ``me`` hands over now: its excess over ``target``, at most ``limit``.

    The excess goes lowest ``score(schema, me)`` first: where this process scores lowest,
    another process most likely scores highest, so a released cluster tends to have a
    winner in :func:`to_claim` that takes it without waiting. ``limit`` bounds the handovers in
    flight (each is a fenced step-down); the rest follow on the next rounds. A process at or
    under its target releases nothing, so no cluster moves more than once per change of
    membership.
    """
    excess = len(owned) - target
    if excess <= 0 or limit <= 0:
        return []
    ranked = sorted(owned, key=lambda schema: (score(schema, me), schema))
    return ranked[: min(excess, limit)]


def to_claim(
    candidates: Sequence[str],
    me: int,
    members: Sequence[int],
    deficits: Mapping[int, int],
    room: int,
    patient: bool,
) -> list[str]:
    """The unowned clusters ``me`` claims now, at most ``room`` (its deficit).

    First those for which ``me`` has the highest score among the members with a deficit
    (``me`` always competes): every process computes the same winner for each cluster, so
    without any message two processes rarely reach for the same one. The others are
    claimed only when ``patient``: the caller says the candidates have stayed unowned for a
    ``lock_poll``, so their winner is full or gone and waiting longer would only leave
    clusters unled. Within each group, the order is by ``score(schema, me)`` descending,
    then name, so a run is reproducible.
    """
    if room <= 0:
        return []
    rivals = [p for p in members if p != me and deficits.get(p, 0) > 0]
    mine: list[tuple[int, str]] = []
    others: list[tuple[int, str]] = []
    for schema in candidates:
        own = score(schema, me)
        best = max(((score(schema, p), p) for p in rivals), default=None)
        (mine if best is None or (own, me) > best else others).append((own, schema))
    chosen = sorted(mine, key=_by_score)
    if patient:
        chosen += sorted(others, key=_by_score)
    return [schema for _, schema in chosen[:room]]


def _by_score(item: tuple[int, str]) -> tuple[int, str]:
    """Score descending, then name ascending."""
    own, schema = item
    return (-own, schema)


def spread(counts: Mapping[int, int]) -> int:
    """The largest count minus the smallest: at most 1 once balanced (0 with no counts).

    This is ``fleet_balance_spread``: the one figure that says balancing has finished.
    """
    if not counts:
        return 0
    return max(counts.values()) - min(counts.values())
