"""Host processes as separate OS processes (``tests/fleet/worker.py``), one SIGKILLed: the
survivors take its clusters over, nothing acknowledged is lost, and no epoch of a cluster
is acknowledged by two processes."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from cronoq_store._host.host import PgHost

from ..pgharness import admin_execute
from ..waits import until, until_value
from .conftest import Fleet
from .processes import Record, of, records, start_worker
from .worker import host_config


async def test_a_killed_process_loses_its_clusters_and_nothing_acknowledged_is_lost(
    fleet: Fleet, tmp_path: Path
) -> None:
    schemas = fleet.clusters(9)
    host = await PgHost.connect(fleet.url, host_config(fleet.group, fleet.control))
    try:
        await host.enroll(schemas)
    finally:
        await host.close()
    journals = [tmp_path / f"w{i}.jsonl" for i in range(3)]

    def journaling(process_id: int) -> int | None:
        """The index of the worker whose journal names ``process_id``, if one does yet."""
        for index, journal in enumerate(journals):
            if of(records(journal), "lead", process=process_id):
                return index
        return None

    workers = [await start_worker(fleet.url, fleet, f"w{i}", journals[i]) for i in range(3)]
    try:
        await until_value(fleet.shares, lambda s: s == [3, 3, 3], "a 3/3/3 split")
        owners = await fleet.owners()
        victim_id = next(p for p in owners.values() if p is not None)
        # The control schema names an owner before its process has recovered the cluster
        # and journaled its term: wait for the journal rather than read it once.
        await until(
            lambda: journaling(victim_id) is not None, f"the journal of process {victim_id}"
        )
        victim = workers[journaling(victim_id) or 0]
        await until(
            lambda: {r["schema"] for r in of(records(*journals), "ack")} >= set(schemas),
            "a commit acknowledged on every cluster",
        )
        victim.send_signal(signal.SIGKILL)
        await victim.wait()
        await until_value(
            fleet.owners,
            lambda o: all(p is not None and p != victim_id for p in o.values()),
            "every cluster of the killed process led again",
        )
        await until_value(fleet.shares, lambda s: s == [5, 4], "a 5/4 split of the survivors")
        await until(
            lambda: taken_over(records(*journals), victim_id) == set(schemas),
            "every cluster journaled as led by a survivor",
        )
    finally:
        for worker in workers:
            if worker.returncode is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            await asyncio.wait_for(worker.wait(), 60)
    assert [w.returncode for w in workers].count(0) == 2
    found = records(*journals)
    acks = [r for r in found if r["k"] == "ack"]
    assert acks, "no commit was acknowledged"
    by_schema: dict[str, set[int]] = {}
    for ack in acks:
        by_schema.setdefault(str(ack["schema"]), set()).add(int(ack["id"]))  # type: ignore[call-overload]
    for schema, ids in by_schema.items():
        rows = await admin_execute(
            fleet.url, f'SELECT id FROM "{schema}".cronoq_tasks WHERE id = ANY($1)', list(ids)
        )
        assert {r["id"] for r in rows} == ids, f"acknowledged tasks lost in {schema}"
    acked_by: dict[tuple[str, int], set[int]] = {}
    for ack in acks:
        key = (str(ack["schema"]), int(ack["epoch"]))  # type: ignore[call-overload]
        acked_by.setdefault(key, set()).add(int(ack["process"]))  # type: ignore[call-overload]
    assert all(len(p) == 1 for p in acked_by.values()), "an epoch acknowledged by two processes"
    assert taken_over(found, victim_id) == set(schemas)


def taken_over(found: list[Record], victim_id: int) -> set[str]:
    """The schemas journaled as led by a process other than the killed one."""
    return {str(r["schema"]) for r in of(found, "lead") if r["process"] != victim_id}
