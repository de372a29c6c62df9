"""Balancing (cronoq_store._host.balance): the targets, the choices, and rounds simulated.

The pure functions are the whole of the host's balancing rule, so their properties are the
design's claims: targets are floor/ceil and sum to N whatever the order of the members;
total excess equals total deficit; and processes that each act on themselves only, racing
for the same clusters, reach spread <= 1 after exactly the initial excess of moves, from
any start, after a join and after a leave.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cronoq_store._host.balance import score, spread, targets, to_claim, to_release

#: Loaded machines: no per-example deadline; enough examples to meet the odd shapes.
PROPERTIES = settings(deadline=None, max_examples=150)

process_ids = st.integers(min_value=1, max_value=2**31 - 1)
memberships = st.lists(process_ids, min_size=1, max_size=7, unique=True)
cluster_counts = st.integers(min_value=0, max_value=80)
limits = st.integers(min_value=1, max_value=16)


def names(count: int) -> list[str]:
    return [f"cluster_{index:03d}" for index in range(count)]


def excess_of(counts: Mapping[int, int], goal: Mapping[int, int]) -> int:
    return sum(max(0, counts.get(p, 0) - goal[p]) for p in goal)


def deficit_of(counts: Mapping[int, int], goal: Mapping[int, int]) -> int:
    return sum(max(0, goal[p] - counts.get(p, 0)) for p in goal)


# --- targets ---------------------------------------------------------------------------


@PROPERTIES
@given(members=memberships, clusters=cluster_counts)
def test_targets_are_floor_or_ceil_and_sum_to_the_clusters(
    members: list[int], clusters: int
) -> None:
    goal = targets(members, clusters)
    assert set(goal) == set(members)
    assert sum(goal.values()) == clusters
    floor = clusters // len(members)
    assert all(value in (floor, floor + 1) for value in goal.values())
    assert sum(value == floor + 1 for value in goal.values()) == clusters % len(members)


@PROPERTIES
@given(members=memberships, clusters=cluster_counts, seed=st.randoms(use_true_random=False))
def test_targets_depend_on_the_members_not_their_order(
    members: list[int], clusters: int, seed: random.Random
) -> None:
    shuffled = list(members)
    seed.shuffle(shuffled)
    assert targets(shuffled, clusters) == targets(members, clusters)
    # The extras go to the lowest process ids.
    ordered = sorted(members)
    extra = clusters % len(members)
    floor = clusters // len(members)
    expected = [floor + 1] * extra + [floor] * (len(members) - extra)
    assert [targets(members, clusters)[p] for p in ordered] == expected


def test_targets_edges() -> None:
    assert targets([], 10) == {}
    assert targets([7], 0) == {7: 0}
    assert targets([30, 10, 20], 5) == {10: 2, 20: 2, 30: 1}
    assert targets([1, 2, 3], 1) == {1: 1, 2: 0, 3: 0}
    with pytest.raises(ValueError, match="clusters"):
        targets([1], -1)
    with pytest.raises(ValueError, match="distinct"):
        targets([1, 1], 3)


# --- score -----------------------------------------------------------------------------


def test_score_is_the_same_in_every_run() -> None:
    # Fixed values: a salted hash (Python's hash()) or another encoding changes them.
    assert score("a", 1) == 0xCD85A665880B4301
    assert score("tenant_0042", 2_147_483_647) == 0xD976CD32057CFE68
    assert score("a1", 2) != score("a", 12)


def test_hashing_alone_leaves_a_spread_near_sqrt_n_over_p() -> None:
    # Why the design does not balance by hashing alone: each cluster to its top scorer
    # leaves a spread of a few sqrt(N/P) (~16 at 1,000 clusters over 4 processes), never
    # floor/ceil. A score that is not uniform (constant, biased) lands outside the band.
    spreads = []
    for first in range(1, 41, 4):
        members = [first, first + 1, first + 2, first + 3]
        counts = dict.fromkeys(members, 0)
        for schema in names(1000):
            counts[max(members, key=lambda p: score(schema, p))] += 1
        spreads.append(spread(counts))
    assert min(spreads) > 1
    assert 16 <= statistics.mean(spreads) <= 64


# --- excess and deficit ----------------------------------------------------------------


@PROPERTIES
@given(
    members=memberships,
    clusters=cluster_counts,
    picks=st.lists(st.integers(min_value=-1, max_value=6), max_size=80),
)
def test_total_excess_equals_total_deficit_plus_the_unowned(
    members: list[int], clusters: int, picks: list[int]
) -> None:
    picks = (picks + [0] * clusters)[:clusters]
    counts: dict[int, int] = {}
    unowned = 0
    for pick in picks:
        if pick < 0:
            unowned += 1
        else:
            owner = members[pick % len(members)]
            counts[owner] = counts.get(owner, 0) + 1
    goal = targets(members, clusters)
    assert deficit_of(counts, goal) == excess_of(counts, goal) + unowned


# --- to_release ------------------------------------------------------------------------


@PROPERTIES
@given(
    owned=st.integers(min_value=0, max_value=60),
    target=st.integers(min_value=0, max_value=60),
    me=process_ids,
    limit=st.integers(min_value=0, max_value=100),
)
def test_to_release_hands_over_exactly_the_excess_lowest_scores_first(
    owned: int, target: int, me: int, limit: int
) -> None:
    mine = names(owned)
    released = to_release(mine, me, target, limit)
    assert len(released) == min(max(0, owned - target), limit)
    assert len(set(released)) == len(released)
    assert set(released) <= set(mine)
    kept = set(mine) - set(released)
    if released and kept:
        assert max(score(s, me) for s in released) < min(score(s, me) for s in kept)
    assert released == sorted(released, key=lambda s: score(s, me))
    assert to_release(list(reversed(mine)), me, target, limit) == released


# --- to_claim --------------------------------------------------------------------------


@PROPERTIES
@given(members=memberships, clusters=cluster_counts)
def test_without_patience_each_cluster_is_claimed_by_its_top_scorer_alone(
    members: list[int], clusters: int
) -> None:
    candidates = names(clusters)
    deficits = dict.fromkeys(members, clusters + 1)
    claimed: dict[str, int] = {}
    for me in members:
        for schema in to_claim(candidates, me, members, deficits, clusters + 1, patient=False):
            assert schema not in claimed, "two processes reached for the same cluster"
            claimed[schema] = me
    assert claimed == {s: max(members, key=lambda p: score(s, p)) for s in candidates}


@PROPERTIES
@given(
    members=memberships,
    clusters=cluster_counts,
    room=st.integers(min_value=-1, max_value=90),
    full=st.sets(st.integers(min_value=0, max_value=6)),
    seed=st.randoms(use_true_random=False),
)
def test_to_claim_stays_within_room_and_prefers_its_own_clusters(
    members: list[int], clusters: int, room: int, full: set[int], seed: random.Random
) -> None:
    me = members[0]
    deficits = {p: 0 if i in full else 5 for i, p in enumerate(members)}
    candidates = names(clusters)
    shuffled = list(candidates)
    seed.shuffle(shuffled)
    rivals = [p for p in members if p != me and deficits[p] > 0]

    def mine(schema: str) -> bool:
        return all(score(schema, me) > score(schema, p) for p in rivals)

    eager = to_claim(candidates, me, members, deficits, room, patient=False)
    patient = to_claim(candidates, me, members, deficits, room, patient=True)
    assert to_claim(shuffled, me, members, deficits, room, patient=True) == patient
    assert len(patient) == min(max(0, room), clusters)
    assert all(mine(s) for s in eager)
    assert len(eager) == min(max(0, room), sum(mine(s) for s in candidates))
    assert patient[: len(eager)] == eager
    firsts = [s for s in patient if mine(s)]
    assert patient[: len(firsts)] == firsts
    for part in (firsts, patient[len(firsts) :]):
        assert part == sorted(part, key=lambda s: (-score(s, me), s))


# --- rounds simulated ------------------------------------------------------------------


@dataclass
class Fleet:
    """Clusters and their owners (None: unowned), and how long each has been unowned."""

    members: list[int]
    owner: dict[str, int | None]
    waited: dict[str, int] = field(default_factory=dict)
    moves: int = 0
    rounds: int = 0

    def counts(self) -> dict[int, int]:
        found = dict.fromkeys(self.members, 0)
        for process in self.owner.values():
            if process is not None:
                found[process] += 1
        return found

    def owned_by(self, process: int) -> list[str]:
        return sorted(s for s, p in self.owner.items() if p == process)

    def settled(self) -> bool:
        return None not in self.owner.values() and self.counts() == targets(
            self.members, len(self.owner)
        )

    def round(self, limit: int, shuffle: random.Random) -> None:
        """One probe of every process: each releases its excess, then each under target
        claims from the same snapshot; claims land in a random order, and a cluster
        already taken is lost (``FOR UPDATE`` settles the race)."""
        self.rounds += 1
        goal = targets(self.members, len(self.owner))
        for process in self.members:
            for schema in to_release(self.owned_by(process), process, goal[process], limit):
                assert self.owner[schema] == process
                self.owner[schema] = None
                self.waited[schema] = 0
                self.moves += 1
        counts = self.counts()
        deficits = {p: goal[p] - counts[p] for p in self.members}
        unowned = sorted(s for s, p in self.owner.items() if p is None)
        aged = [s for s in unowned if self.waited.get(s, 0) >= 1]
        wanted: dict[int, list[str]] = {}
        for process in self.members:
            room = deficits[process]
            first = to_claim(unowned, process, self.members, deficits, room, patient=False)
            later = to_claim(
                [s for s in aged if s not in first],
                process,
                self.members,
                deficits,
                room - len(first),
                patient=True,
            )
            assert len(first) + len(later) <= max(0, room)
            wanted[process] = first + later
        order = list(self.members)
        shuffle.shuffle(order)
        for process in order:
            for schema in wanted[process]:
                if self.owner[schema] is None:
                    self.owner[schema] = process
        for schema, holder in self.owner.items():
            if holder is None:
                self.waited[schema] = self.waited.get(schema, 0) + 1

    def run(self, limit: int, shuffle: random.Random) -> None:
        goal = targets(self.members, len(self.owner))
        excess = excess_of(self.counts(), goal)
        # A bound, not a tuning: the releases take ceil(excess / limit) rounds, and each
        # later round lands at least the first claimer's picks.
        bound = -(-excess // limit) + len(self.owner) + 2
        while not self.settled():
            assert self.rounds < bound, (self.rounds, self.counts(), goal)
            self.round(limit, shuffle)


def settle(fleet: Fleet, limit: int, shuffle: random.Random) -> None:
    """Run ``fleet`` to the end and check the design's claims about where it ends."""
    start = dict(fleet.owner)
    goal = targets(fleet.members, len(fleet.owner))
    excess = excess_of(fleet.counts(), goal)
    fleet.run(limit, shuffle)
    assert fleet.counts() == goal
    assert spread(fleet.counts()) <= 1
    assert fleet.moves == excess
    moved = [s for s, p in start.items() if p is not None and fleet.owner[s] != p]
    assert len(moved) == excess, "a cluster moved more than once, or one moved needlessly"


def start(members: Sequence[int], clusters: int, picks: Sequence[int]) -> Fleet:
    """A fleet whose cluster ``i`` is owned by ``members[picks[i] % P]``, or none if < 0."""
    padded = [*picks, *[-1] * clusters][:clusters]
    owner: dict[str, int | None] = {
        schema: None if pick < 0 else members[pick % len(members)]
        for schema, pick in zip(names(clusters), padded, strict=True)
    }
    return Fleet(list(members), owner)


def balanced(members: Sequence[int], clusters: int, shuffle: random.Random) -> Fleet:
    """A fleet already at its targets, its clusters dealt at random."""
    goal = targets(members, clusters)
    dealt = names(clusters)
    shuffle.shuffle(dealt)
    owner: dict[str, int | None] = {}
    for process in members:
        for schema in dealt[: goal[process]]:
            owner[schema] = process
        dealt = dealt[goal[process] :]
    fleet = Fleet(list(members), owner)
    assert fleet.settled()
    return fleet


@PROPERTIES
@given(
    members=memberships,
    clusters=cluster_counts,
    picks=st.lists(st.integers(min_value=-1, max_value=6), max_size=80),
    limit=limits,
    shuffle=st.randoms(use_true_random=False),
)
def test_rounds_converge_from_any_start_after_exactly_the_excess(
    members: list[int], clusters: int, picks: list[int], limit: int, shuffle: random.Random
) -> None:
    settle(start(members, clusters, picks), limit, shuffle)


@PROPERTIES
@given(
    members=memberships,
    newcomer=process_ids,
    clusters=cluster_counts,
    limit=limits,
    shuffle=st.randoms(use_true_random=False),
)
def test_a_join_converges_after_exactly_the_excess(
    members: list[int], newcomer: int, clusters: int, limit: int, shuffle: random.Random
) -> None:
    assume(newcomer not in members)
    fleet = balanced(members, clusters, shuffle)
    fleet.members.append(newcomer)
    settle(fleet, limit, shuffle)
    assert spread(fleet.counts()) <= 1


@PROPERTIES
@given(
    members=st.lists(process_ids, min_size=2, max_size=7, unique=True),
    leaving=st.integers(min_value=0, max_value=6),
    clusters=cluster_counts,
    limit=limits,
    shuffle=st.randoms(use_true_random=False),
)
def test_a_leave_converges_after_exactly_the_excess(
    members: list[int], leaving: int, clusters: int, limit: int, shuffle: random.Random
) -> None:
    fleet = balanced(members, clusters, shuffle)
    gone = members[leaving % len(members)]
    fleet.members.remove(gone)
    orphans = fleet.owned_by(gone)
    for schema in orphans:
        fleet.owner[schema] = None
    settle(fleet, limit, shuffle)
    assert not set(orphans) & set(fleet.owned_by(gone))
    # Every target only grows when a member leaves: the survivors release nothing.
    assert fleet.moves == 0
