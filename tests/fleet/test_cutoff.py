"""A host process cut off by the network (issue 31): its pool and its host session reach
the server only through a proxy, which then stalls (the path goes silent, the sockets stay
open). The cut-off process steps every cluster down before the server frees its process
lock, the survivors lead them within the standalone bound for a silent leader, no commit of
the deposed terms lands once the path resumes, and the process joins again under a new id.

Bounds are multiples of ``session_timeout`` plus margins for a loaded machine: a bound says
how long the test lets the behaviour take, the guarantees' own figures are in
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

from cronoq_store._host.host import PgHost

from ..pgharness import admin_execute
from ..tcpproxy import TcpProxy
from ..waits import PATIENCE, until, until_value
from .conftest import Fleet
from .processes import Record, claimed_at, diagnosis, epoch_rows, num, of, records, start_worker
from .tripwire import Tripwire
from .worker import STORE, host_config

SESSION_TIMEOUT = STORE.session_timeout
#: The cut-off process steps down within session_timeout of the silence; the bound allows
#: three, for a loaded machine.
STEP_DOWN_WITHIN = 3 * SESSION_TIMEOUT
#: Room for a loaded two-core machine on top of a guarantee's own figure (seconds).
MARGIN = 5.0
#: The server ends a silent host session after its idle limit (1.5 x session_timeout);
#: the survivors see its lock free within lock_poll and claim its clusters (the bound is on
#: the claims, by the server's clock: the recoveries that follow are the application's, and
#: a loaded machine stretches them).
TAKEOVER_WITHIN = 1.5 * SESSION_TIMEOUT + STORE.lock_poll + MARGIN
#: The same when a commit of the cut-off process is stuck mid-statement, holding the leader
#: table: no server limit ends it, so a claim ends it once it is as old as a silent host
#: session may be (1.5 x session_timeout, below the commits' commit_timeout), and the next
#: round claims; with late commits, the first test's cut-off process may leave one.
TAKEOVER_PAST_STUCK_WITHIN = 1.5 * SESSION_TIMEOUT + 2 * STORE.lock_poll + MARGIN
#: The cut-off process's commits wait this long: a commit sent into the stall is still
#: waiting when the path resumes, so the database's fence answers it, not a local timeout.
VICTIM_COMMIT_TIMEOUT = 60.0


async def test_a_cut_off_process_steps_down_before_its_clusters_move_and_none_of_its_late_commits_lands(  # noqa: E501
    fleet: Fleet, tmp_path: Path
) -> None:
    schemas = fleet.clusters(9)
    host = await PgHost.connect(fleet.url, host_config(fleet.group, fleet.control))
    try:
        await host.enroll(schemas)
    finally:
        await host.close()
    journals = [tmp_path / f"w{i}.jsonl" for i in range(3)]
    timings: dict[str, float] = {}
    async with TcpProxy.to(fleet.url) as proxy:
        options = ["--late", "--commit-timeout", str(VICTIM_COMMIT_TIMEOUT)]
        workers = [
            await start_worker(proxy.url(fleet.url), fleet, "w0", journals[0], options),
            await start_worker(fleet.url, fleet, "w1", journals[1], ["--late"]),
            await start_worker(fleet.url, fleet, "w2", journals[2], ["--late"]),
        ]
        try:
            await until_value(fleet.shares, lambda s: s == [3, 3, 3], "a 3/3/3 split")
            # A claim commits before its process journals its lead.
            await until(
                lambda: len(of(records(journals[0]), "lead")) >= 3,
                "the process to be cut off to journal its leads",
            )
            owners = await fleet.owners()
            victim_id = int(num(of(records(journals[0]), "lead")[-1], "process"))
            cut_off = sorted(s for s, p in owners.items() if p == victim_id)
            assert len(cut_off) == 3, owners
            await until(
                lambda: {r["schema"] for r in of(records(journals[0]), "ack")} >= set(cut_off),
                "commits acknowledged on every cluster of the process to cut off",
            )
            # The terms the stall cuts off: the last led by the victim on each cluster it
            # owns (it may have led others before, and handed them over to balance).
            terms = {
                str(r["schema"]): int(num(r, "epoch"))
                for r in of(records(journals[0]), "lead", process=victim_id)
                if r["schema"] in cut_off
            }

            proxy.stall()
            stalled = time.time()

            def stepped_down() -> list[Record]:
                return [
                    r
                    for r in of(records(journals[0]), "down", process=victim_id)
                    if terms.get(str(r["schema"])) == r["epoch"]
                ]

            downs = await until_value(
                stepped_down,
                lambda d: {r["schema"] for r in d} >= set(cut_off),
                "the cut-off process to step every cluster down",
            )
            down_at = {str(r["schema"]): num(r, "t") for r in downs}
            timings["step_down_s"] = max(down_at.values()) - stalled
            # 1. Within about session_timeout of the silence, for the reason that its host
            # session went silent (nothing closed, nothing fenced it first).
            assert timings["step_down_s"] <= STEP_DOWN_WITHIN, timings
            assert {r["why"] for r in downs} == {"session_lost"}, downs

            def survivors_lead() -> list[Record]:
                found = records(journals[1], journals[2])
                # Leads of the terms after the cut-off one's (a survivor may have led a
                # cluster before the process to cut off joined and took it over).
                return [
                    r
                    for r in of(found, "lead")
                    if r["schema"] in cut_off and num(r, "epoch") > terms[str(r["schema"])]
                ]

            try:
                leads = await until_value(
                    survivors_lead,
                    lambda led: {r["schema"] for r in led} >= set(cut_off),
                    "the survivors to lead every cluster of the cut-off process",
                    within=TAKEOVER_PAST_STUCK_WITHIN + PATIENCE / 2,
                )
            except AssertionError as failed:
                raise AssertionError(f"{failed}\n{await diagnosis(fleet, cut_off)}") from None
            timings["takeover_s"] = max(num(r, "t") for r in leads) - stalled
            # 1. The safety argument: no survivor leads a cluster before the cut-off
            # process stepped it down.
            for lead in leads:
                schema = str(lead["schema"])
                assert num(lead, "t") > down_at[schema], (lead, down_at[schema])
            # The same from the server's side: each claim's epoch bump (its leadership
            # history row, stamped by the server's clock in the claim's transaction) came
            # after the step-down. Every process runs on this machine: one clock.
            claims = {}
            for schema, epoch in terms.items():
                claims[schema] = await claimed_at(fleet.url, schema, epoch)
                assert claims[schema] > down_at[schema], (schema, claims, down_at[schema])
            timings["first_claim_s"] = min(claims.values()) - stalled
            timings["claimed_s"] = max(claims.values()) - stalled
            # 2. The bound for a silent leader, on the claims: the standalone one unless a
            # late commit was stuck mid-statement.
            assert timings["first_claim_s"] <= TAKEOVER_WITHIN, timings
            assert timings["claimed_s"] <= TAKEOVER_PAST_STUCK_WITHIN, timings
            owners = await fleet.owners()
            assert victim_id not in owners.values(), owners

            # What the deposed terms wrote before the path went silent: nothing of theirs
            # may land once it resumes.
            before = await epoch_rows(fleet.url, terms)
            proxy.forward()
            resumed = time.time()

            # 4. Back under a new id, with its share.
            def rejoined() -> list[Record]:
                return [r for r in of(records(journals[0]), "lead") if r["process"] != victim_id]

            await until(
                lambda: bool(rejoined()), "the cut-off process to lead again under a new id"
            )
            timings["rejoin_s"] = min(num(r, "t") for r in rejoined()) - resumed
            shares = await until_value(
                fleet.shares,
                lambda s: s == [3, 3, 3],
                "every process, the rejoined one too, to lead its share (3/3/3)",
            )
            timings["rebalanced_s"] = time.time() - resumed
            owners = await fleet.owners()
            rejoined_id = int(num(rejoined()[0], "process"))
            assert rejoined_id != victim_id
            assert rejoined_id in owners.values(), owners
            assert shares[0] - shares[-1] <= 1
            # The cut-off process's commits sent into the stall have their answers.
            await until(
                lambda: {r["schema"] for r in of(records(journals[0]), "late")} >= set(cut_off),
                "every deposed term's late commit to be answered",
            )
            await asyncio.sleep(1.0)  # commits flowing on every cluster
        finally:
            for worker in workers:
                if worker.returncode is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in workers:
                await asyncio.wait_for(worker.wait(), 60)
    assert [w.returncode for w in workers] == [0, 0, 0]
    print(f"cut-off timings: {json.dumps({k: round(v, 2) for k, v in timings.items()})}")

    found = records(*journals)
    # 3. No commit of the deposed terms landed once the path resumed.
    after = await epoch_rows(fleet.url, terms)
    assert after == before, "a deposed term's commit landed after the stall"
    for schema, epoch in terms.items():
        deposed = of(found, "ack", schema=schema, epoch=epoch, process=victim_id)
        # None was sent after the step-down, and each acknowledged one is in the rows that
        # were there before the path resumed (a reply held in the stall may arrive late,
        # for a commit that landed before the silence).
        assert all(num(r, "s") < down_at[schema] for r in deposed), deposed
        assert {int(num(r, "id")) for r in deposed} <= before[schema]
        late = of(found, "late", schema=schema, epoch=epoch, process=victim_id)
        assert [r["got"] for r in late] == ["FencedError"], late
    acked_after_down = [
        r
        for r in of(found, "ack", process=victim_id)
        if terms.get(str(r["schema"])) == r["epoch"] and num(r, "t") > down_at[str(r["schema"])]
    ]
    print(
        "deposed acknowledgements that arrived after the step-down (sent, answered, down, "
        f"relative to the stall): {len(acked_after_down)} "
        + json.dumps(
            [
                [round(num(r, k) - stalled, 3) for k in ("s", "t")]
                + [round(down_at[str(r["schema"])] - stalled, 3)]
                for r in acked_after_down
            ]
        )
    )
    # Every acknowledged task of every process is stored.
    acks = of(found, "ack")
    by_schema: dict[str, set[int]] = {}
    for ack in acks:
        by_schema.setdefault(str(ack["schema"]), set()).add(int(num(ack, "id")))
    for schema, ids in by_schema.items():
        rows = await admin_execute(
            fleet.url, f'SELECT id FROM "{schema}".cronoq_tasks WHERE id = ANY($1)', list(ids)
        )
        assert {r["id"] for r in rows} == ids, f"acknowledged tasks lost in {schema}"
    # No (schema, epoch) acknowledged by two processes.
    acked_by: dict[tuple[str, int], set[object]] = {}
    for ack in acks:
        acked_by.setdefault((str(ack["schema"]), int(num(ack, "epoch"))), set()).add(ack["process"])
    assert all(len(p) == 1 for p in acked_by.values()), "an epoch acknowledged by two processes"


async def test_a_process_cut_off_inside_a_claim_loses_no_cluster_for_longer_than_the_bound(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The path of a joining process goes silent while its host session is inside a claim's
    transaction (the leader table's barrier just sent): every cluster is led again, by the
    others, within the same bound as when the silence finds the session idle."""
    schemas = fleet.clusters(9)
    host = await PgHost.connect(fleet.url, host_config(fleet.group, fleet.control))
    try:
        await host.enroll(schemas)
    finally:
        await host.close()
    journals = [tmp_path / f"w{i}.jsonl" for i in range(3)]
    workers = [
        await start_worker(fleet.url, fleet, "w1", journals[1], ["--late"]),
        await start_worker(fleet.url, fleet, "w2", journals[2], ["--late"]),
    ]
    assert fleet.url.host is not None
    assert fleet.url.port is not None
    proxy = Tripwire(fleet.url.host, fleet.url.port)
    async with proxy:
        try:
            await until_value(fleet.shares, lambda s: sorted(s) == [4, 5], "a 5/4 split")
            # A claim commits before its process journals its lead: wait for both journals.
            await until(
                lambda: len({num(r, "process") for r in of(records(*journals[1:]), "lead")}) == 2,
                "both survivors to journal their leads",
            )
            survivors = {int(num(r, "process")) for r in of(records(*journals[1:]), "lead")}
            proxy.arm(b"IN EXCLUSIVE MODE")
            options = ["--late", "--commit-timeout", str(VICTIM_COMMIT_TIMEOUT)]
            workers.append(
                await start_worker(proxy.url(fleet.url), fleet, "w0", journals[0], options)
            )
            await until(lambda: proxy.tripped_at is not None, "the joining process to claim")
            assert proxy.tripped_at is not None

            async def led_by_survivors() -> dict[str, int | None]:
                return await fleet.owners()

            try:
                await until_value(
                    led_by_survivors,
                    lambda o: all(p in survivors for p in o.values()),
                    "the others to lead every cluster",
                    within=TAKEOVER_WITHIN + PATIENCE / 2,
                )
            except AssertionError as failed:
                raise AssertionError(f"{failed}\n{await diagnosis(fleet, schemas)}") from None
            took = time.time() - proxy.tripped_at
            print(f"cut off inside a claim: every cluster led by the others {took:.2f} s later")
            assert took <= TAKEOVER_WITHIN
        finally:
            proxy.forward()
            for worker in workers:
                if worker.returncode is None:
                    worker.send_signal(signal.SIGTERM)
            for worker in workers:
                await asyncio.wait_for(worker.wait(), 60)
