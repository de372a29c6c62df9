"""A long-running leader on its own engine: lead, recover, commit, step down, lead again.

Run it as ``python examples/leader.py URL [SCHEMA]``; run a second copy (or
``examples/standby.py``) beside it to see a takeover. Each term: wait for the leader lock,
recover the state, settle each recovered task (:func:`resumed`), commit through a
``GroupCommitter`` until ``leadership_lost()`` resolves, then step down and wait again.
SIGTERM or Ctrl-C releases leadership and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time

from cronoq_store import (
    FencedError,
    GroupCommitter,
    PgStore,
    PgStoreConfig,
    Recovered,
    RecoveredTask,
    StatusChanged,
    StoreError,
    Submitted,
    TaskId,
    TaskRecord,
    TaskSpec,
    TaskStatus,
    TimeBase,
    task_id,
)


class Ids:
    """The ids and sequence numbers a term issues: above everything recovered."""

    def __init__(self, epoch: int, state: Recovered) -> None:
        self.next_id = max(state.next_id, task_id(epoch, 0))
        self.seq = max((task.seq for task in state.tasks), default=-1) + 1

    def submitted(self, spec: TaskSpec) -> Submitted:
        mutation = Submitted(TaskId(self.next_id), self.seq, time.monotonic_ns(), spec)
        self.next_id, self.seq = self.next_id + 1, self.seq + 1
        return mutation


def resumed(task: RecoveredTask, stored: TaskRecord | None, now: int) -> StatusChanged | None:
    """What a new leader writes for a live task it recovered, if anything.

    - Queued (attempt 0): nothing. It runs when its turn comes, as submitted.
    - Retrying: nothing. Its attempt failed and that was recorded; the next attempt starts
      after the backoff, as under the lost leader.
    - Running: the attempt's outcome never reached the store, so it counts as failed. The
      task is retrying if its policy allows another attempt, else it has failed. The lost
      attempt may have done its work already: a task runs at least once, never exactly
      once, so its work must be safe to repeat.
    """
    if stored is None or stored.status is not TaskStatus.RUNNING:
        return None
    allowed = task.spec.retry.max_attempts if task.spec.retry is not None else 1
    lost = f"its leader was lost during attempt {task.attempt} of {allowed}"
    if task.attempt < allowed:
        return StatusChanged(task.id, TaskStatus.RETRYING, task.attempt, now, lost)
    return StatusChanged(task.id, TaskStatus.FAILED, task.attempt, now, lost)


async def resume(store: PgStore, committer: GroupCommitter, state: Recovered) -> None:
    """Settle every recovered task that was running; report what each kind became."""
    counts = dict.fromkeys(
        ["queued", "retrying", "was running: retrying", "was running: failed"], 0
    )
    changes = []
    for task in state.tasks:
        # Recovery gives the attempt, not the status: look up only tasks past attempt 0.
        stored = await store.get_task(task.id) if task.attempt > 0 else None
        change = resumed(task, stored, time.monotonic_ns())
        if change is not None:
            changes.append(change)
            counts[f"was running: {change.status.value}"] += 1
        else:
            counts["retrying" if task.attempt > 0 else "queued"] += 1
    await committer.submit(changes)  # durable before any attempt starts again
    print("resumed: " + "; ".join(f"{n} {what}" for what, n in counts.items()), flush=True)


async def acquire_unless_stopped(store: PgStore, stop: asyncio.Event) -> int | None:
    """The epoch once this instance leads, or ``None`` when asked to stop before."""
    acquiring = asyncio.ensure_future(store.acquire_leadership())  # waits while another leads
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([acquiring, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not acquiring.done():
        acquiring.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await acquiring
        return None
    return acquiring.result()


async def term(store: PgStore, stop: asyncio.Event) -> None:
    """One term as leader: from the lock taken to leadership lost or a stop asked for."""
    epoch = await acquire_unless_stopped(store, stop)
    if epoch is None:
        return
    base = TimeBase.now()
    state = await store.recover(base)
    print(f"leading at epoch {epoch}: {len(state.tasks)} live tasks recovered", flush=True)
    ids = Ids(epoch, state)
    lost = asyncio.ensure_future(store.leadership_lost())
    async with GroupCommitter(store, epoch, base) as committer:
        await resume(store, committer, state)
        while not lost.done() and not stop.is_set():
            tick = ids.submitted(TaskSpec(b"tick", kind="tick"))
            try:
                await committer.submit([tick])  # returns once durable
            except FencedError:
                break  # another instance leads: never write again this term
            await asyncio.wait([lost], timeout=0.2)
    lost.cancel()
    if stop.is_set():
        await store.release_leadership()
        print("released leadership", flush=True)
    else:
        print(f"stepped down from epoch {epoch}", flush=True)


async def main(url: str, schema: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    config = PgStoreConfig(schema=schema, application_name="example-leader")
    async with await PgStore.connect(url, config) as store:  # its own engine and pool
        while not stop.is_set():
            try:
                await term(store, stop)
            except StoreError as exc:  # the database went away: wait, then try again
                print(f"term ended: {exc}", flush=True)
                await asyncio.sleep(1)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cluster_a"))
