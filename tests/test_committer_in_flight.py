"""The group committer answers as serial commits: each submission gets the answer, and the
rows end as, committing the same submissions one at a time in the order accepted, whatever
batches it merges them into and however many batches are in flight at once.

A commit is held in flight by an admin transaction that holds the leader row
``FOR UPDATE`` (every commit's share lock waits on it), so the test sees which batches were
sent (``pg_stat_activity``). Chosen cases pin each way a merge or two batches in flight could
change an answer; the property tests draw concurrent submitters sending any submissions
over a few tasks, keys and schedules, with any number of batches in flight, and compare
every answer, task, output and schedule with a serial replay in another schema (or
another in-memory store).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol, TypeAlias

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store._committer import GroupCommitter, footprint
from cronoq_store._config import PgStoreConfig
from cronoq_store._domain import (
    UNIX_EPOCH,
    IntervalSchedule,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store._errors import CommitterClosedError, FencedError, IdCollisionError, StoreError
from cronoq_store._migrations import upgrade
from cronoq_store._results import Recovered, TaskRecord
from cronoq_store._store import Committable, PgStore
from cronoq_store._urls import async_url
from cronoq_store.telemetry import Telemetry
from cronoq_store.testing import InMemoryStore

from .pgharness import admin_execute
from .support import PROCESS_BASE, CommitMeasuredByCommit, LeaderRowHold, app_name, stored_ids
from .waits import bounded, holds_for, until

_ids = itertools.count(1)
_clock = itertools.count(1)

#: One submitter's call: its mutations and outputs.
Submission: TypeAlias = tuple[list[Mutation], list[tuple[TaskId, bytes]]]


def new(key: str | None = None) -> Submitted:
    id = next(_ids)
    return Submitted(TaskId(id), id, 1, TaskSpec(b"p%d" % id, key=key))


def moved(task: Submitted, status: TaskStatus, attempt: int = 1) -> StatusChanged:
    return StatusChanged(task.id, status, attempt, next(_clock), f"{status.value} {attempt}")


#: What a submission is told: ``None`` (acknowledged), or its error's name and the ids or
#: keys the error names.
Answer: TypeAlias = tuple[str, object] | None


def answer_of(error: BaseException | None) -> Answer:
    if error is None:
        return None
    named = getattr(error, "ids", None) or getattr(error, "keys", None)
    return type(error).__name__, named


class Observed(Committable, Protocol):
    """What both stores answer, through the API the scheduler and the committer use."""

    async def get_task(self, ref: TaskId | str) -> TaskRecord | None: ...

    async def load_output(self, id: TaskId) -> bytes | None: ...

    async def recover(self, base: TimeBase) -> Recovered: ...


async def one_at_a_time(store: Observed, submissions: Sequence[Submission]) -> list[Answer]:
    """What committing each of ``submissions`` alone, in order, answers it."""
    answers: list[Answer] = []
    for mutations, outputs in submissions:
        error: StoreError | None = None
        try:
            await store.commit(0, PROCESS_BASE, mutations, outputs)
        except StoreError as exc:
            error = exc
        answers.append(answer_of(error))
    return answers


async def sent(url: URL, name: str) -> int:
    """How many commits of ``name``'s sessions wait on the held leader row."""
    rows = await admin_execute(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
        "AND wait_event_type = 'Lock'",
        name,
    )
    return int(rows[0][0])


@pytest.fixture
async def store(pg_url: URL, migrated: str) -> AsyncIterator[PgStore]:
    """A store on its own pool whose sessions carry the test's own name (see app_name)."""
    config = PgStoreConfig(schema=migrated, application_name=app_name(migrated))
    async with await PgStore.connect(pg_url, config) as s:
        yield s


@pytest.fixture
async def serial_store(engine: AsyncEngine, migrated: str, pg_url: URL) -> AsyncIterator[PgStore]:
    """Another schema, for the same submissions committed one at a time."""
    schema = f"{migrated}_serial"
    await upgrade(engine, schema)
    try:
        async with await PgStore.from_engine(engine, PgStoreConfig(schema=schema)) as s:
            yield s
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


async def rows(url: URL, schema: str, ids: set[int] | None = None) -> list[tuple[Any, ...]]:
    found = await admin_execute(
        url,
        f"SELECT id, status, attempt, terminal, key, message, output "
        f'FROM "{schema}".cronoq_tasks ORDER BY id',
    )
    return [tuple(r) for r in found if ids is None or r[0] in ids]


async def test_independent_batches_are_in_flight_at_once(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    name = app_name(migrated)
    committer = GroupCommitter(
        store, 0, PROCESS_BASE, max_batch_mutations=1, max_batches_in_flight=3
    )
    async with LeaderRowHold(pg_url, migrated) as hold:
        tasks = [new() for _ in range(5)]
        waiting = [asyncio.ensure_future(committer.submit([t])) for t in tasks]
        await until(lambda: _sent_is(pg_url, name, 3), "three batches in flight")
        await holds_for(  # the bound: the other two wait for a slot
            lambda: _sent_is(pg_url, name, 3), "three batches in flight, no more", 0.1
        )
        await hold.release()
        await bounded(asyncio.gather(*waiting), "every submission once the row is free")
    await committer.close()
    assert [r[0] for r in await rows(pg_url, migrated)] == [t.id for t in tasks]


async def _sent_is(url: URL, name: str, count: int) -> bool:
    return await sent(url, name) == count


@pytest.mark.parametrize(
    "second",
    [
        "a transition of the task",
        "an output of the task",
        "a task given the key the first releases",
        "a task finished while the first gives out a key",
    ],
)
async def test_a_batch_waits_for_the_batch_in_flight_it_must_follow(
    store: PgStore, serial_store: PgStore, migrated: str, pg_url: URL, second: str
) -> None:
    """The second batch is not sent while the first is in flight (an independent third one
    is); once the first lands, the second lands on its rows, as if committed after it."""
    name = app_name(migrated)
    holder = new("k")
    task = new("k2" if second.endswith("gives out a key") else None)
    first: list[Mutation] = [task]
    outputs: list[tuple[TaskId, bytes]] = []
    if second == "a transition of the task":
        follower: list[Mutation] = [moved(task, TaskStatus.RUNNING)]
    elif second == "an output of the task":
        follower, outputs = [moved(task, TaskStatus.SUCCEEDED)], [(task.id, b"out")]
    elif second == "a task given the key the first releases":
        first, follower = [moved(holder, TaskStatus.SUCCEEDED)], [new("k")]
    else:
        follower = [moved(holder, TaskStatus.FAILED)]
    independent = new()
    await store.commit(0, PROCESS_BASE, [holder], [])
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit(first))
        await until(lambda: _sent_is(pg_url, name, 1), "the first batch in flight")
        two = asyncio.ensure_future(committer.submit(follower, outputs))
        await holds_for(
            lambda: _sent_is(pg_url, name, 1), "the second batch held back behind the first", 0.2
        )
        assert not two.done()
        await hold.release()
        await bounded(asyncio.gather(one, two), "both batches once the row is free")
        await committer.submit([independent])
    await committer.close()
    replay: list[tuple[list[Mutation], list[tuple[TaskId, bytes]]]] = [
        ([holder], []),
        (first, []),
        (follower, outputs),
        ([independent], []),
    ]
    for mutations, extra in replay:
        await serial_store.commit(0, PROCESS_BASE, mutations, extra)
    if second == "an output of the task":
        assert await store.load_output(task.id) == b"out"
    assert await rows(pg_url, migrated) == await rows(pg_url, serial_store.config.schema)


async def test_a_takeover_fences_every_batch_in_flight_and_queued(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """Three batches wait in flight on the leader row; a takeover bumps the epoch there:
    every pending submission fails with FencedError and nothing of any batch lands."""
    name = app_name(migrated)
    committer = GroupCommitter(
        store, 0, PROCESS_BASE, max_batch_mutations=1, max_batches_in_flight=3
    )
    async with LeaderRowHold(pg_url, migrated) as hold:
        waiting = [asyncio.ensure_future(committer.submit([new()])) for _ in range(6)]
        await until(lambda: _sent_is(pg_url, name, 3), "three batches in flight")
        await hold.execute(f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
        await hold.release(commit=True)
        outcomes = await bounded(
            asyncio.gather(*waiting, return_exceptions=True), "every submission to be fenced"
        )
    await committer.close()
    assert all(isinstance(o, FencedError) for o in outcomes), outcomes
    assert committer.fenced
    assert await rows(pg_url, migrated) == []


# --- chosen cases: what a merge or two batches in flight could answer otherwise -----------


def _merge_hazard(case: str) -> tuple[list[Mutation], list[Mutation], list[Submission]]:
    """What is stored before the committer starts, what the committer commits first, then
    the submissions whose merged outcome would differ from their serial one if they shared
    a batch (``case`` names the hazard)."""
    if case == "a key claimed before its stored holder is finished":
        holder = new("k")
        return [holder], [], [([new("k")], []), ([moved(holder, TaskStatus.SUCCEEDED)], [])]
    if case == "a key claimed before its holder, committed by the committer, is finished":
        holder = new("k")
        return [], [holder], [([new("k")], []), ([moved(holder, TaskStatus.SUCCEEDED)], [])]
    if case == "a key claimed before a holder of the batch is finished":
        holder = new("k")
        finished = moved(holder, TaskStatus.FAILED)
        return [], [], [([holder], []), ([new("k")], []), ([finished], [])]
    if case == "a key claimed while held, by a task finished later":
        holder, claimer = new("k"), new("k")
        return [holder], [], [([claimer], []), ([moved(claimer, TaskStatus.CANCELLED)], [])]
    if case == "a transition sent before its task's submission":
        task = new()
        return [], [], [([moved(task, TaskStatus.RUNNING)], []), ([task], [])]
    assert case == "an output given before its task succeeds"
    task = new()
    return [task], [], [([], [(task.id, b"out")]), ([moved(task, TaskStatus.SUCCEEDED)], [])]


@pytest.mark.parametrize("in_flight", [1, 2, 4])
@pytest.mark.parametrize(
    "case",
    [
        "a key claimed before its stored holder is finished",
        "a key claimed before its holder, committed by the committer, is finished",
        "a key claimed before a holder of the batch is finished",
        "a key claimed while held, by a task finished later",
        "a transition sent before its task's submission",
        "an output given before its task succeeds",
    ],
)
async def test_submissions_queued_together_get_the_answers_of_serial_commits(
    store: PgStore,
    serial_store: PgStore,
    migrated: str,
    pg_url: URL,
    case: str,
    in_flight: int,
) -> None:
    """Submissions sent without waiting for one another are taken into one batch; each is
    told what committing them one at a time, in order, tells it, and the rows are those."""
    stored, first, submissions = _merge_hazard(case)
    for each in (store, serial_store):
        await each.commit(0, PROCESS_BASE, stored, [])
    await serial_store.commit(0, PROCESS_BASE, first, [])
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=in_flight)
    await committer.submit(first)
    pending = [asyncio.ensure_future(committer.submit(m, o)) for m, o in submissions]
    answers = await bounded(asyncio.gather(*pending, return_exceptions=True), "every answer")
    await committer.close()
    assert [answer_of(a) for a in answers] == await one_at_a_time(serial_store, submissions)
    assert await rows(pg_url, migrated) == await rows(pg_url, serial_store.config.schema)


def _schedule(name: str) -> RecurringUpsert:
    return RecurringUpsert(
        RecurringSpec(name, IntervalSchedule(timedelta(seconds=5)), TaskSpec(b"t"))
    )


@pytest.mark.parametrize("spelled", ["a key", "a schedule's name"])
async def test_two_spellings_of_one_stored_name_are_one_for_batches_in_flight(
    store: PgStore, serial_store: PgStore, migrated: str, pg_url: URL, spelled: str
) -> None:
    """NUL is stored as U+FFFD, so ``"s\\0"`` and ``"s\\ufffd"`` are one key (or one
    schedule): a batch naming one spelling is not sent while a batch naming the other is
    in flight, and both get the answers of serial commits."""
    name = app_name(migrated)
    if spelled == "a key":
        first: list[Mutation] = [new("s\0")]
        second: list[Mutation] = [new("s\ufffd")]
    else:
        first, second = [_schedule("r\0")], [RecurringRemove("r\ufffd")]
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit(first))
        await until(lambda: _sent_is(pg_url, name, 1), "the first batch in flight")
        two = asyncio.ensure_future(committer.submit(second))
        await holds_for(
            lambda: _sent_is(pg_url, name, 1), "the second batch held back behind the first", 0.2
        )
        await hold.release()
        answers = await bounded(
            asyncio.gather(one, two, return_exceptions=True), "both answers once the row is free"
        )
    await committer.close()
    serial = await one_at_a_time(serial_store, [(first, []), (second, [])])
    assert [answer_of(a) for a in answers] == serial
    assert await rows(pg_url, migrated) == await rows(pg_url, serial_store.config.schema)
    schedules = [
        await admin_execute(pg_url, f'SELECT name FROM "{schema}".cronoq_recurring')
        for schema in (migrated, serial_store.config.schema)
    ]
    assert [r[0] for r in schedules[0]] == [r[0] for r in schedules[1]]


# --- the property: any submissions, any batches in flight, the answers of serial commits ---


class Jittered(CommitMeasuredByCommit):
    """A store whose commits each start after the next of ``delays`` (cycled)."""

    def __init__(self, store: Committable, delays: list[float]) -> None:
        self._store = store
        self._delays = itertools.cycle(delays)

    @property
    def max_commit_bytes(self) -> int:
        return self._store.max_commit_bytes

    @property
    def telemetry(self) -> Telemetry:
        return self._store.telemetry

    async def ping(self) -> None:
        await self._store.ping()

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        await asyncio.sleep(next(self._delays))
        await self._store.commit(epoch, base, batch, outputs)


@dataclass
class Scenario:
    """Stored first (tasks of an earlier term, whose keys the committer never saw), then
    what each concurrent submitter sends: a submission, and what it does before sending
    the next (:data:`PACES`)."""

    ids: list[TaskId]
    names: list[str]
    stored: list[Submission]
    submitters: list[list[tuple[Submission, str]]]


_examples = itertools.count(1)
#: What a submitter does before sending its next submission: waits for the answer, lets
#: the writer take the submission into a batch, or sends the next at once.
PACES = ["answered", "taken", "taken", "at once", "at once"]
LIVE = [TaskStatus.RUNNING, TaskStatus.RETRYING]
FINISHED = [TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Few tasks, keys and schedules, so that submissions meet: keys claimed while held and
    before or after their holder is finished (stored or submitted beside them), transitions
    before, with and after their task's submission, outputs before and after the success,
    a task sent again, another task under a used id, schedules created, advanced and
    removed, barriers. Most submissions are sent without waiting for the one before."""
    n = next(_examples)
    # Two spellings of one stored key and of one schedule's name (NUL is stored as U+FFFD).
    keys = [None, f"e{n}a", f"e{n}a", f"e{n}b\0", f"e{n}b\ufffd"]
    tasks = [new(draw(st.sampled_from(keys))) for _ in range(draw(st.integers(2, 3)))]
    ids = [t.id for t in tasks]
    names = [f"e{n}r1", f"e{n}r2\0", f"e{n}r2\ufffd"]
    clock = st.integers(1, 30)  # few distinct times: ties and transitions that go backwards
    # How often this example finishes tasks, gives outputs and reuses ids: each hazard shows
    # only where the others leave room (a finish orders batches, a collision bisects them).
    statuses = draw(st.sampled_from([LIVE, LIVE + FINISHED, FINISHED, [TaskStatus.SUCCEEDED]]))
    outputs_per = draw(st.sampled_from([[0], [0, 1], [0, 1, 1]]))
    collisions = draw(st.booleans())

    def transition(task: Submitted) -> StatusChanged:
        status = draw(st.sampled_from(statuses))
        message = draw(st.sampled_from([None, "m", "boom"]))
        return StatusChanged(task.id, status, draw(st.integers(0, 2)), draw(clock), message)

    def mutation() -> Mutation:
        kind = draw(st.integers(0, 19))
        task = draw(st.sampled_from(tasks))
        if kind < 7:
            return task
        if kind == 7 and collisions:  # another task under a used id
            return Submitted(task.id, task.seq, 1, TaskSpec(b"x", key=draw(st.sampled_from(keys))))
        if kind < 16:
            return transition(task)
        name = draw(st.sampled_from(names))
        if kind < 18:
            every = timedelta(seconds=draw(st.integers(1, 3)))
            return RecurringUpsert(RecurringSpec(name, IntervalSchedule(every), TaskSpec(b"t")))
        if kind == 18:
            return RecurringRemove(name)
        return RecurringNext(name, draw(clock), draw(st.sampled_from([None, *ids])))

    def submission() -> Submission:
        mutations = [mutation() for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3])))]
        outputs = [
            (TaskId(draw(st.sampled_from(ids))), b"o%d" % draw(st.integers(0, 9)))
            for _ in range(draw(st.sampled_from(outputs_per)))
        ]
        return mutations, outputs

    # Tasks of an earlier term: live (holding their keys) or moved on.
    stored: list[Submission] = []
    for task in tasks:
        if draw(st.booleans()):
            stored.append(([task, *(transition(task) for _ in range(draw(st.integers(0, 1))))], []))
    paces = st.sampled_from(PACES)

    def steps() -> list[tuple[Submission, str]]:
        """One submission, or a pair sent together that a merge or two batches in flight
        could answer otherwise than serial commits: a key claimed before its holder is
        finished (the holder first committed by the committer, or not), a transition before
        its task's submission, an output before its task's success, one key or schedule
        spelled two ways."""
        one = draw(st.sampled_from(tasks))
        pair = draw(st.sampled_from(["none", "none", "claim", "transition", "output", "spelled"]))
        if pair == "none":
            return [(submission(), draw(paces))]
        if pair == "spelled":  # one key, or one schedule, spelled two ways, likely two batches
            if draw(st.booleans()):
                first, second = new(f"e{n}s\0"), new(f"e{n}s\ufffd")
                ids.extend((first.id, second.id))
                return [(([first], []), "taken"), (([second], []), draw(paces))]
            spellings = draw(st.permutations(names[1:]))
            every = IntervalSchedule(timedelta(seconds=1))
            created = RecurringUpsert(RecurringSpec(spellings[0], every, TaskSpec(b"t")))
            removed = RecurringRemove(spellings[1])
            return [(([created], []), "taken"), (([removed], []), draw(paces))]
        if pair == "claim":
            holder = draw(st.sampled_from([t for t in tasks if t.spec.key] or tasks))
            claimer = new(holder.spec.key)  # a new task, under the key of another
            ids.append(claimer.id)
            found: list[tuple[Submission, str]] = []
            if draw(st.booleans()):
                found.append((([holder], []), "answered"))
            status = draw(st.sampled_from(FINISHED))
            finished = StatusChanged(holder.id, status, 1, draw(clock), None)
            return [*found, (([claimer], []), "at once"), (([finished], []), draw(paces))]
        if pair == "transition":
            return [(([transition(one)], []), "at once"), (([one], []), draw(paces))]
        succeeded = StatusChanged(one.id, TaskStatus.SUCCEEDED, 1, draw(clock), None)
        return [(([], [(one.id, b"early")]), "at once"), (([succeeded], []), draw(paces))]

    submitters = [
        [step for _ in range(draw(st.integers(1, 6))) for step in steps()]
        for _ in range(draw(st.integers(1, 3)))
    ]
    return Scenario(ids, names, stored, submitters)


async def seen(store: Observed, scenario: Scenario) -> list[object]:
    """Every task of ``scenario`` as the API shows it (a queued task's time is its
    commit's, so it is left out), its output, and its schedules as recovered."""
    found: list[object] = []
    for id in scenario.ids:
        record = await store.get_task(TaskId(id))
        if record is not None and record.status is None:
            record = replace(record, updated=UNIX_EPOCH)
        found.append((record, await store.load_output(TaskId(id))))
    recovered = await store.recover(PROCESS_BASE)
    found.extend(r for r in recovered.recurring if r.spec.name in scenario.names)
    return found


async def committed_through_the_committer(
    store: Observed,
    serial: Observed,
    scenario: Scenario,
    in_flight: int,
    batch: int,
    delays: list[float],
) -> None:
    """Commit ``scenario`` through a committer on ``store`` (``in_flight`` batches at once,
    up to ``batch`` rows each, each commit after the next of ``delays`` so that batches in
    flight overtake one another); commit the same submissions one at a time on ``serial``,
    in the order the committer accepted them; both answer every submission alike and end
    alike."""
    for mutations, outputs in scenario.stored:
        for each in (store, serial):
            with contextlib.suppress(StoreError):
                await each.commit(0, PROCESS_BASE, mutations, outputs)
    order: list[Submission] = []
    answers: dict[int, Answer] = {}
    committer = GroupCommitter(
        Jittered(store, delays),
        0,
        PROCESS_BASE,
        max_batches_in_flight=in_flight,
        max_batch_mutations=batch,
    )

    async def send(sub: Submission) -> None:
        index = len(order)
        order.append(sub)  # accepted in this order: submit enqueues before it awaits
        try:
            await committer.submit(*sub)
            answers[index] = None
        except StoreError as exc:
            answers[index] = answer_of(exc)

    async def submitter(steps: list[tuple[Submission, str]]) -> None:
        unanswered: list[asyncio.Future[None]] = []
        for sub, pace in steps:
            # Tasks run in the order created, so submissions are accepted in this order.
            pending = asyncio.ensure_future(send(sub))
            if pace == "answered":
                await pending
                continue
            unanswered.append(pending)
            if pace == "taken":
                for _ in range(3):  # the send, the loop's wake-up, its cut
                    await asyncio.sleep(0)
        await asyncio.gather(*unanswered)

    await bounded(asyncio.gather(*map(submitter, scenario.submitters)), "every submitter")
    await committer.close()
    assert [answers[index] for index in range(len(order))] == await one_at_a_time(serial, order)
    assert await seen(store, scenario) == await seen(serial, scenario)


DRAWS = {
    "scenario": scenarios(),
    "in_flight": st.integers(1, 6),
    "batch": st.integers(1, 8),
    "delays": st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.004]), min_size=1, max_size=8),
}


@settings(
    max_examples=60,  # CI time; the in-memory twin below draws five times more
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(**DRAWS)
async def test_any_submissions_get_the_answers_of_serial_commits_on_a_server(
    store: PgStore,
    serial_store: PgStore,
    scenario: Scenario,
    in_flight: int,
    batch: int,
    delays: list[float],
) -> None:
    """Concurrent submitters send through one committer on a real server; the same
    submissions committed one at a time, in the order accepted, answer each alike and
    leave the same tasks, outputs and schedules."""
    await committed_through_the_committer(store, serial_store, scenario, in_flight, batch, delays)


@settings(max_examples=300, deadline=None)
@given(**DRAWS)
async def test_any_submissions_get_the_answers_of_serial_commits_in_memory(
    scenario: Scenario, in_flight: int, batch: int, delays: list[float]
) -> None:
    """The same, on the in-memory store (the fold and key rules are the server's)."""
    await committed_through_the_committer(
        InMemoryStore(), InMemoryStore(), scenario, in_flight, batch, [d / 10 for d in delays]
    )


# --- batches in flight when another is fenced, cancelled, killed or bisected ------------
#
# A commit's reply can come back after a later batch's: SlowFirstReply is a store whose first
# commit's reply is held (the commit has landed) until the test lets it through.


class SlowFirstReply(CommitMeasuredByCommit):
    """A store whose first commit lands at once but whose reply waits for ``reply``."""

    def __init__(self, store: PgStore) -> None:
        self._store = store
        self.landed = asyncio.Event()
        self.reply = asyncio.Event()
        self._first = True

    @property
    def max_commit_bytes(self) -> int:
        return self._store.max_commit_bytes

    @property
    def telemetry(self) -> Telemetry:
        return self._store.telemetry

    async def ping(self) -> None:
        await self._store.ping()

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        first, self._first = self._first, False
        await self._store.commit(epoch, base, batch, outputs)
        if first:
            self.landed.set()
            await self.reply.wait()


async def test_a_batch_that_landed_is_acknowledged_though_a_later_one_was_fenced(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """The first batch commits under its epoch; a takeover follows; a second, independent
    batch is fenced by its own check before the first one's reply is back. The first
    batch's submitter is told it is durable (its rows are stored), not FencedError; the
    second's is fenced, and nothing of it is stored."""
    slow = SlowFirstReply(store)
    committer = GroupCommitter(slow, 0, PROCESS_BASE, max_batches_in_flight=2)
    first, second = new(), new()
    one = asyncio.ensure_future(committer.submit([first]))
    await bounded(slow.landed.wait(), "the submissions to settle")
    await admin_execute(pg_url, f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
    two = asyncio.ensure_future(committer.submit([second]))
    await until(lambda: committer.fenced, "the second batch fenced")
    slow.reply.set()
    outcomes = await bounded(
        asyncio.gather(one, two, return_exceptions=True), "the submissions to settle"
    )
    await committer.close()
    assert await stored_ids(pg_url, migrated) == [first.id]
    assert outcomes[0] is None, outcomes[0]
    assert isinstance(outcomes[1], FencedError)


async def test_a_writer_cancelled_with_a_batch_waiting_for_one_in_flight_fails_it(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """The second batch (a transition of the first batch's task) waits for the first, which
    waits on a held leader row. The committer's loop is cancelled (an event loop shutting
    down): every submitter is told, the waiting batch's too, none is left waiting for ever."""
    name = app_name(migrated)
    task = new()
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=2)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit([task]))
        await until(lambda: _sent_is(pg_url, name, 1), "the first batch in flight")
        two = asyncio.ensure_future(
            committer.submit([StatusChanged(task.id, TaskStatus.RUNNING, 1, 5)])
        )
        await holds_for(
            lambda: _sent_is(pg_url, name, 1), "the second batch held back behind the first", 0.2
        )
        assert not one.done()
        assert not two.done()
        writers = [t for t in asyncio.all_tasks() if t.get_name() == "cronoq-group-commit-epoch-0"]
        assert len(writers) == 1
        writers[0].cancel()
        await asyncio.wait({writers[0]}, timeout=10)
        await hold.release()
        outcomes = await bounded(
            asyncio.gather(one, two, return_exceptions=True), "the submissions to settle"
        )
    await committer.close()
    assert all(isinstance(o, CommitterClosedError) for o in outcomes), outcomes


async def waiting_pids(url: URL, name: str) -> list[int]:
    """The sessions of ``name`` whose commits wait on the held leader row."""
    rows = await admin_execute(
        url,
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
        "AND wait_event_type = 'Lock' ORDER BY backend_start",
        name,
    )
    return [r[0] for r in rows]


@pytest.mark.parametrize("then", ["release", "takeover"])
async def test_a_batch_whose_session_is_killed_in_flight_lands_once_or_is_fenced(
    pg_url: URL, migrated: str, then: str
) -> None:
    """Three batches wait in flight on the held leader row; one's backend is terminated
    there. With the row released, the killed batch is retried and every submission lands,
    each once; with a takeover instead, every one (the retried batch's too) is fenced and
    nothing is stored."""
    name = f"kill-{migrated}"
    config = PgStoreConfig(schema=migrated, application_name=name)
    async with await PgStore.connect(pg_url, config) as store:
        committer = GroupCommitter(
            store, 0, PROCESS_BASE, max_batch_mutations=1, max_batches_in_flight=3
        )
        tasks = [new() for _ in range(5)]
        async with LeaderRowHold(pg_url, migrated) as hold:
            waiting = [asyncio.ensure_future(committer.submit([t])) for t in tasks]

            async def three() -> bool:
                return len(await waiting_pids(pg_url, name)) == 3

            await until(three, "three batches in flight")
            killed = (await waiting_pids(pg_url, name))[1]
            await admin_execute(pg_url, "SELECT pg_terminate_backend($1)", killed)

            async def sent_again() -> bool:
                pids = await waiting_pids(pg_url, name)
                return len(pids) == 3 and killed not in pids

            await until(sent_again, "the killed batch sent again, three in flight")
            if then == "takeover":
                await hold.execute(f'UPDATE "{migrated}".cronoq_leader SET epoch = epoch + 1')
                await hold.release(commit=True)
            else:
                await hold.release()
            outcomes = await bounded(
                asyncio.gather(*waiting, return_exceptions=True), "the submissions to settle"
            )
        await committer.close()
    if then == "takeover":
        assert all(isinstance(o, FencedError) for o in outcomes), outcomes
        assert await stored_ids(pg_url, migrated) == []
    else:
        assert outcomes == [None] * len(tasks)
        assert await stored_ids(pg_url, migrated) == [t.id for t in tasks]


async def test_batches_in_flight_on_an_applications_one_connection_pool_with_a_prune(
    pg_url: URL, migrated: str
) -> None:
    """An application's engine with one connection and no overflow; four batches in flight
    and a prune share it. Nothing deadlocks: the flights take the connection in turn, the
    prune takes its barrier between them, and every submission lands."""
    app = create_async_engine(async_url(pg_url), pool_size=1, max_overflow=0)
    try:
        async with await PgStore.from_engine(app, PgStoreConfig(schema=migrated)) as store:
            committer = GroupCommitter(
                store, 0, PROCESS_BASE, max_batch_mutations=2, max_batches_in_flight=4
            )
            tasks = [new() for _ in range(40)]
            submissions = [asyncio.ensure_future(committer.submit([t])) for t in tasks]
            pruned = asyncio.ensure_future(store.prune(1))
            outcomes = await bounded(asyncio.gather(*submissions), "the submissions to settle")
            assert await asyncio.wait_for(pruned, 30) == 0
            await committer.close()
    finally:
        await app.dispose()
    assert outcomes == [None] * len(tasks)
    assert await stored_ids(pg_url, migrated) == [t.id for t in tasks]


@pytest.mark.parametrize("follower", ["a transition of its task", "a task taking its key"])
async def test_a_batch_waits_for_the_bisection_of_a_failed_batch_it_follows(
    store: PgStore, migrated: str, pg_url: URL, follower: str
) -> None:
    """The first batch holds an innocent submission (a new task, or the finish of the
    holder of key ``k``) and a guilty one (an id another task holds): it fails whole and is
    bisected. The second batch follows the innocent one (a transition of that task, or a
    new task with ``k``): it lands after the innocent half, as serially."""
    other, holder = new(), Submitted(TaskId(next(_ids)), 1, 1, TaskSpec(b"h", key="k"))
    await store.commit(0, PROCESS_BASE, [other, holder], [])
    task = new()
    if follower == "a transition of its task":
        innocent: list[Mutation] = [task]
        later: list[Mutation] = [StatusChanged(task.id, TaskStatus.RUNNING, 1, 5)]
    else:
        innocent = [StatusChanged(holder.id, TaskStatus.SUCCEEDED, 1, 5)]
        later = [Submitted(task.id, 2, 1, TaskSpec(b"n", key="k"))]
    guilty = Submitted(other.id, 9, 9, TaskSpec(b"not the same task"))
    name = app_name(migrated)
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit(innocent))
        bad = asyncio.ensure_future(committer.submit([guilty]))
        await until(lambda: _sent_is(pg_url, name, 1), "one batch of both in flight")
        two = asyncio.ensure_future(committer.submit(later))
        await holds_for(
            lambda: _sent_is(pg_url, name, 1), "the second batch held back behind the first", 0.2
        )
        assert not two.done()
        await hold.release()
        outcomes = await bounded(
            asyncio.gather(one, bad, two, return_exceptions=True), "the submissions to settle"
        )
    await committer.close()
    assert outcomes[0] is None
    assert isinstance(outcomes[1], IdCollisionError)
    assert outcomes[2] is None, outcomes[2]
    record = await store.get_task(task.id)
    assert record is not None
    if follower == "a transition of its task":
        assert record.status is TaskStatus.RUNNING
    else:
        assert record.key == "k"


async def test_a_barrier_returns_only_once_everything_before_it_is_settled(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """An empty submission is a barrier: it returns once everything submitted before it is
    settled. The first batch has landed but its reply is slow; a barrier submitted after it
    (a batch of its own, in flight beside it) does not return before it."""
    slow = SlowFirstReply(store)
    committer = GroupCommitter(slow, 0, PROCESS_BASE, max_batches_in_flight=4)
    one = asyncio.ensure_future(committer.submit([new()]))
    await bounded(slow.landed.wait(), "the submissions to settle")
    barrier = asyncio.ensure_future(committer.submit([]))
    await holds_for(lambda: not barrier.done(), "the barrier waiting for the slow reply", 0.3)
    slow.reply.set()
    await bounded(asyncio.gather(one, barrier), "the submission and the barrier")
    await committer.close()


async def test_a_schedules_upsert_and_remove_in_batches_in_flight_land_in_order(
    store: PgStore, migrated: str, pg_url: URL
) -> None:
    """A schedule is created in one batch (held in flight) and removed in the next: the
    removal waits for the creation, so the schedule is gone at the end, as serially."""
    spec = RecurringSpec("r", IntervalSchedule(timedelta(seconds=5)), TaskSpec(b"t"))
    name = app_name(migrated)
    committer = GroupCommitter(store, 0, PROCESS_BASE, max_batches_in_flight=4)
    async with LeaderRowHold(pg_url, migrated) as hold:
        one = asyncio.ensure_future(committer.submit([RecurringUpsert(spec)]))
        await until(lambda: _sent_is(pg_url, name, 1), "the creation in flight")
        two = asyncio.ensure_future(committer.submit([RecurringRemove("r")]))
        await holds_for(
            lambda: _sent_is(pg_url, name, 1), "the removal held back behind the creation", 0.2
        )
        assert not two.done()
        await hold.release()
        await bounded(asyncio.gather(one, two), "the submissions to settle")
    await committer.close()
    rows = await admin_execute(pg_url, f'SELECT count(*) FROM "{migrated}".cronoq_recurring')
    assert rows[0][0] == 0


def test_a_mutation_of_no_known_type_gets_no_empty_footprint() -> None:
    """A batch in flight orders itself behind earlier ones by its footprint; a mutation of a
    type the footprint does not know is refused, naming the type, never given an empty
    footprint that would let it overtake a batch it depends on."""
    unknown: Any = b"not a mutation"
    with pytest.raises(TypeError, match="not a mutation: bytes"):
        footprint([unknown])
