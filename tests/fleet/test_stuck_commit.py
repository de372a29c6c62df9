"""A host process cut off while one of its pool sessions is inside a commit's fenced insert
(issue 31). The server received the statement's Parse, so the commit's ``FOR SHARE`` holds
the cluster's leader table in ``ROW SHARE``, and it waits for the rest of the exchange
(``active``, ``ClientRead``): no idle limit ends such a session, and every claim's barrier
waits for it. The path's host session goes silent with it, so the process is taken for dead.

The others lead every cluster of the cut-off process within the bound that follows from the
settings: its host session ends within ``1.5 x session_timeout`` (its idle limit) or one
more ``session_timeout`` (the others end it when stuck mid-statement), and a claim that
finds the leader table held ends the sessions stuck on it past ``1.5 x session_timeout``,
however long a commit may take. The stalled commit is never acknowledged, nothing acknowledged is
lost, and nothing the cut-off process sent lands once its path resumes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

from cronoq_store._host.host import PgHost

from ..pgharness import admin_execute
from ..waits import PATIENCE, until, until_value
from .conftest import Fleet
from .processes import claimed_at, diagnosis, epoch_rows, num, of, records, start_worker
from .tripwire import Tripwire
from .worker import STORE, host_config

SESSION_TIMEOUT = STORE.session_timeout
#: Every process's commits (and handover grace) wait this long: longer than the takeover
#: bound, so that a claim waiting for the stuck commit to time out fails the test.
COMMIT_TIMEOUT = 20.0
#: How long a session stays stuck on a leader table before a claim that meets it ends it.
STUCK_AFTER = 1.5 * SESSION_TIMEOUT
#: Room for a loaded two-core machine on top of the figures the settings give (seconds).
MARGIN = 6.0
#: The host session of the cut-off process ends within ``STUCK_AFTER + session_timeout``
#: at worst, the stuck commit is ended by the first claim after ``STUCK_AFTER``, and the
#: next round (``lock_poll``) claims.
TAKEOVER_WITHIN = STUCK_AFTER + SESSION_TIMEOUT + STORE.lock_poll + MARGIN


async def stuck_on_leader(fleet: Fleet, schema: str) -> list[int]:
    """The sessions that hold ``schema``'s leader table while they wait for their client in
    the middle of a statement."""
    rows = await admin_execute(
        fleet.url,
        "SELECT a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'relation' AND l.granted AND l.mode = 'RowShareLock' "
        "AND l.relation = to_regclass(quote_ident($1) || '.cronoq_leader') "
        "AND a.state = 'active' AND a.wait_event = 'ClientRead'",
        schema,
    )
    return sorted(int(r["pid"]) for r in rows)


async def alive(fleet: Fleet, pids: list[int]) -> list[int]:
    rows = await admin_execute(
        fleet.url, "SELECT pid FROM pg_stat_activity WHERE pid = ANY($1)", pids
    )
    return sorted(int(r["pid"]) for r in rows)


async def test_a_process_cut_off_inside_a_fenced_commit_keeps_no_cluster_from_the_others(
    fleet: Fleet, tmp_path: Path
) -> None:
    schemas = fleet.clusters(9)
    host = await PgHost.connect(fleet.url, host_config(fleet.group, fleet.control))
    try:
        await host.enroll(schemas)
    finally:
        await host.close()
    journals = [tmp_path / f"w{i}.jsonl" for i in range(3)]
    options = ["--late", "--commit-timeout", str(COMMIT_TIMEOUT)]
    timings: dict[str, float] = {}
    workers = [
        await start_worker(fleet.url, fleet, "w1", journals[1], options),
        await start_worker(fleet.url, fleet, "w2", journals[2], options),
    ]
    assert fleet.url.host is not None
    assert fleet.url.port is not None
    proxy = Tripwire(fleet.url.host, fleet.url.port)
    async with proxy:
        try:
            await until_value(fleet.shares, lambda s: sorted(s) == [4, 5], "a 5/4 split")
            # A claim commits before its process journals its lead.
            await until(lambda: bool(of(records(journals[1]), "lead")), "w1 to journal a lead")
            survivor = int(num(of(records(journals[1]), "lead")[-1], "process"))
            workers.append(
                await start_worker(proxy.url(fleet.url), fleet, "w0", journals[0], options)
            )
            await until_value(fleet.shares, lambda s: s == [3, 3, 3], "a 3/3/3 split")
            await until(lambda: bool(of(records(journals[0]), "lead")), "w0 to journal a lead")
            victim = int(num(of(records(journals[0]), "lead")[-1], "process"))
            first = sorted(s for s, p in (await fleet.owners()).items() if p == victim)
            await until(
                lambda: {r["schema"] for r in of(records(journals[0]), "ack")} >= set(first),
                "commits acknowledged on every cluster of the process to cut off",
            )
            # A cluster it never led has its fenced insert sent as text (a Parse) on its
            # first commit there that goes alone: asyncpg prepares a statement once per
            # connection. (A commit the bus stages with others inserts by a statement the
            # bus prepared outside any transaction: not this needle.)
            led = {str(r["schema"]) for r in of(records(journals[0]), "lead")}
            needles = {
                f"(INSERT INTO {s}.cronoq_tasks ".encode(): s for s in schemas if s not in led
            }
            assert needles, led
            proxy.arm(*needles)
            # The third process leaves: the one to cut off gains at least one of its clusters.
            workers[1].send_signal(signal.SIGTERM)
            await until(
                lambda: proxy.tripped_at is not None,
                "the process to cut off to commit on a cluster it gained",
            )
            assert proxy.tripped_at is not None
            assert proxy.tripped_on is not None
            tripped = proxy.tripped_at
            stalled_on = needles[proxy.tripped_on]
            # What the test builds: the server holds the commit's share lock on the leader
            # table, waiting for the rest of the exchange.
            stuck = await until_value(
                lambda: stuck_on_leader(fleet, stalled_on),
                bool,
                f"the stalled commit to hold {stalled_on}'s leader table mid-statement",
            )
            owners = await fleet.owners()
            cut_off = sorted(s for s, p in owners.items() if p == victim)
            assert stalled_on in cut_off, owners
            # The terms the stall cuts off, read before anyone can move them: the others
            # claim only once the process's lock is free, 1.5 x session_timeout away.
            terms = {s: await fleet.stored_epoch(s) for s in cut_off}

            try:
                await until_value(
                    fleet.owners,
                    lambda o: all(p == survivor for p in o.values()),
                    "the survivor to lead every cluster",
                    within=TAKEOVER_WITHIN + MARGIN,
                )
            except AssertionError as failed:
                raise AssertionError(f"{failed}\n{await diagnosis(fleet, schemas)}") from None
            timings["takeover_s"] = time.time() - tripped
            assert timings["takeover_s"] <= TAKEOVER_WITHIN, timings
            # The claim ended the stalled commit's session; nothing else would have.
            assert await alive(fleet, stuck) == [], stuck

            def survivor_leads() -> set[str]:
                return {
                    str(r["schema"])
                    for r in of(records(journals[1]), "lead", process=survivor)
                    if r["schema"] in terms and num(r, "epoch") > terms[str(r["schema"])]
                }

            await until(
                lambda: survivor_leads() >= set(cut_off),
                "the survivor to recover every cluster of the cut-off process",
            )
            # No claim before the cut-off process stepped the cluster down (where it got
            # as far as leading it, its journal says when).
            for schema, epoch in terms.items():
                down = of(records(journals[0]), "down", schema=schema, epoch=epoch)
                if of(records(journals[0]), "lead", schema=schema, epoch=epoch):
                    assert down, (schema, epoch)
                if down:
                    claimed = await claimed_at(fleet.url, schema, epoch)
                    assert claimed > num(down[0], "t"), (schema, claimed, down)

            # What the deposed terms wrote before the stall (the commit bus may have written
            # on the stalled cluster in staged groups first): nothing more may land once the
            # path resumes and everything it held back reaches the server.
            before = await epoch_rows(fleet.url, terms)
            proxy.forward()
            resumed = time.time()
            await until(
                lambda: any(r["process"] != victim for r in of(records(journals[0]), "lead")),
                "the cut-off process to lead again under a new id",
                within=PATIENCE,
            )
            timings["rejoin_s"] = time.time() - resumed
            await asyncio.sleep(1.0)  # every commit the stall held back answered
            after = await epoch_rows(fleet.url, terms)
            assert after == before, "a deposed term's commit landed after the stall"
        finally:
            proxy.forward()
            for worker in workers:
                if worker.returncode is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in workers:
                await asyncio.wait_for(worker.wait(), 60)
    assert [w.returncode for w in workers] == [0, 0, 0]
    print(f"stuck commit: {stalled_on}, timings {json.dumps(timings)}")

    found = records(*journals)
    for schema, epoch in terms.items():
        late = of(found, "late", schema=schema, epoch=epoch, process=victim)
        assert all(r["got"] != "ack" for r in late), late
    # The stalled commit was never acknowledged: what the process acknowledged on that
    # cluster in that term (the bus may have committed there before the stall) was all
    # stored by the time the stall was cut short, where the stalled commit never was.
    acked = of(found, "ack", schema=stalled_on, epoch=terms[stalled_on], process=victim)
    assert {int(num(a, "id")) for a in acked} <= before[stalled_on], (before, acked)
    # Every acknowledged task of every process is stored.
    by_schema: dict[str, set[int]] = {}
    for ack in of(found, "ack"):
        by_schema.setdefault(str(ack["schema"]), set()).add(int(num(ack, "id")))
    for schema, ids in by_schema.items():
        rows = await admin_execute(
            fleet.url, f'SELECT id FROM "{schema}".cronoq_tasks WHERE id = ANY($1)', list(ids)
        )
        assert {r["id"] for r in rows} == ids, f"acknowledged tasks lost in {schema}"
    # No (schema, epoch) acknowledged by two processes.
    acked_by: dict[tuple[str, int], set[object]] = {}
    for ack in of(found, "ack"):
        acked_by.setdefault((str(ack["schema"]), int(num(ack, "epoch"))), set()).add(ack["process"])
    assert all(len(p) == 1 for p in acked_by.values()), "an epoch acknowledged by two processes"
