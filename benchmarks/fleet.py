"""The fleet: host processes (``PgHost``) sharing many clusters, each a separate OS process
(``python -m benchmarks.fleet_worker``), as issue 31's targets describe them.

Every cluster is enrolled (migrated by the store's own migrations) and seeded by a few
seeding processes at once: the same live and finished task rows, COPYed with the store's
column list from a template cluster that ``benchmarks.history`` generated and that
``recover()`` read back first. Then, in order:

1. ``fleet_processes`` processes start together; the clock runs from their start until
   every cluster is led and recovered (``open``). Their server sessions are counted in
   ``pg_stat_activity`` by each process's own ``application_name`` while each leads its
   share and commits (``backends``).
2. A process of a group with no clusters waits to lead: its sessions (``standby``).
3. One more process joins; the moves settle (``join``). Then a process is SIGKILLed: the
   clock runs until the control schema gives each of its clusters to another process
   (``takeover``), then the moves settle again (``kill``). Then the process that reaches
   the server through :class:`~benchmarks.proxy.StallingProxy` is cut off (its sockets
   stay open, nothing passes): the same clock (``cutoff``); then it is back in touch.
4. Every process stops; each acknowledged id (journalled after its acknowledgement) is
   looked up in its cluster (``lost``).
5. One process alone leads every cluster, then the same one-mutation submitters commit
   spread over ``fleet_clusters`` clusters and over 10, rounds interleaved (``commit``);
   then the floor: the statements the commit bus would send for the same commits, on raw
   asyncpg sessions, rounds interleaved the same way.
   With ``fleet_commit_only`` (``--fleet-commit-only``) this phase alone follows the
   seeding.

Server memory is each backend's from ``/proc`` (the server is local): RSS, and USS (its
private pages, without the shared buffers it touched); client memory is each process's RSS.
Figures only: nothing here asserts a speed. With ``$BENCH_FLEET_PROFILE`` naming a
directory, every worker runs under ``cProfile`` and writes ``<name>.prof`` there when it
exits (a SIGKILLed one writes nothing).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import psutil
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import PgStoreConfig, TimeBase, upgrade
from cronoq_store._store import PgStore

from .common import Profile, dsn, paired, summarize
from .fleet_worker import PROFILE_ENV
from .history import HISTORY_EPOCH, seed
from .proxy import StallingProxy
from .recovery import raw_recover

_ROOT = Path(__file__).resolve().parent.parent
#: How long any phase may take before the section gives up on it, per 1,000 clusters
#: (fewer count as 1,000): seeding, opening and moving grow with the clusters.
_CAP = 600.0
_MIB = 2**20
#: How long a process may take to exit once told to.
_STOP = 60.0


class Worker:
    """One ``benchmarks.fleet_worker`` process and what it said, by event."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, started: float) -> None:
        self.name = name
        self.process = process
        self.started = started
        self.events: list[dict[str, Any]] = []
        self._said = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, name: str, mode: str, args: dict[str, Any], url: URL) -> Worker:
        env = dict(os.environ)
        profile_dir = os.environ.get(PROFILE_ENV)
        if profile_dir:
            env[PROFILE_ENV] = str(Path(profile_dir) / f"{name}.prof")
        args = {
            **args,
            "name": name,
            "url": dsn(url.update_query_dict({"application_name": name})),
        }
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks.fleet_worker",
            mode,
            cwd=_ROOT,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        # On stdin, not the command line, which any local user reads: the URL has a password.
        assert process.stdin is not None
        process.stdin.write(json.dumps(args).encode())
        await process.stdin.drain()
        process.stdin.close()
        return cls(name, process, started)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for line in self.process.stdout:
            self.events.append(json.loads(line))
            self._said.set()

    def said(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["e"] == event]

    async def wait_for(self, event: str, cap: float = _CAP) -> dict[str, Any]:
        deadline = time.monotonic() + cap
        while not (found := self.said(event)):
            if self.process.returncode is not None or self._reader.done():
                await self.process.wait()
                raise RuntimeError(f"{self.name} exited ({self.process.returncode})")
            self._said.clear()
            await asyncio.wait_for(self._said.wait(), max(0.0, deadline - time.monotonic()))
        return found[0]

    @property
    def process_id(self) -> int:
        return int(self.said("registered")[0]["process_id"])

    async def exited(self) -> None:
        """Wait for a process that ends by itself; it must exit 0."""
        await asyncio.wait_for(self.process.wait(), _CAP)
        await self._reader
        if self.process.returncode != 0:
            raise RuntimeError(f"{self.name} exited ({self.process.returncode})")

    async def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Signal the process and return its exit code; one that has not exited within
        ``_STOP`` seconds of a SIGTERM is SIGKILLed (its code then says so)."""
        if self.process.returncode is None:
            self.process.send_signal(sig)
        try:
            await asyncio.wait_for(self.process.wait(), _STOP)
        except asyncio.TimeoutError:
            self.process.kill()
            await self.process.wait()
        await self._reader
        return self.process.returncode or 0


@dataclass
class _Fleet:
    """One run's names and connections."""

    url: URL
    profile: Profile
    prefix: str
    conn: asyncpg.Connection
    journals: Path
    workers: list[Worker] = field(default_factory=list)

    @property
    def control(self) -> str:
        return f"{self.prefix}_host"

    @property
    def cap(self) -> float:
        """How long a phase may take: :data:`_CAP` per 1,000 clusters."""
        return _CAP * max(1.0, self.profile.fleet_clusters / 1000)

    @property
    def schemas(self) -> list[str]:
        return [f"{self.prefix}_{i:05d}" for i in range(self.profile.fleet_clusters)]

    def args(self, group: str | None = None, **more: Any) -> dict[str, Any]:
        return {
            "control": self.control,
            "group": group or self.prefix,
            "pool": self.profile.fleet_pool,
            "timing": list(self.profile.fleet_timing),
            **more,
        }

    async def owners(self) -> dict[str, int | None]:
        # The section's own schema names, no input from outside: here and below.
        rows = await self.conn.fetch(
            f'SELECT schema_name, owner FROM "{self.control}".clusters WHERE host_group = $1',  # noqa: S608
            self.prefix,
        )
        return {r["schema_name"]: r["owner"] for r in rows}

    async def shares(self, members: list[int]) -> tuple[int, int]:
        """Clusters nobody owns, and the most minus the fewest that one of ``members`` owns."""
        owners = await self.owners()
        counts = dict.fromkeys(members, 0)
        unowned = 0
        for owner in owners.values():
            if owner is None:
                unowned += 1
            else:
                counts[owner] = counts.get(owner, 0) + 1
        return unowned, max(counts.values()) - min(counts.values())

    async def settle(self, members: list[int], since: float) -> dict[str, Any]:
        """Wait until nothing is unowned and the spread is at most 1 over two looks a
        ``lock_poll`` apart (or the cap): the seconds since ``since``, and the spread."""
        poll = self.profile.fleet_timing[2]
        deadline = time.monotonic() + self.cap
        calm = 0
        while True:
            unowned, spread = await self.shares(members)
            calm = calm + 1 if unowned == 0 and spread <= 1 else 0
            if calm >= 2 or time.monotonic() > deadline:
                return {
                    "settled_seconds": time.monotonic() - since - (poll if calm >= 2 else 0),
                    "spread": spread,
                    "unowned": unowned,
                }
            await asyncio.sleep(poll)

    def taken_from(self, process_id: int, schemas: list[str]) -> Callable[[], Awaitable[bool]]:
        """Whether the control schema gives each of ``schemas`` to a process other than
        ``process_id``."""

        async def check() -> bool:
            owners = await self.owners()
            return all(owners[s] not in (None, process_id) for s in schemas)

        return check

    async def backends(self, name: str) -> list[int]:
        rows = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 "
            "OR application_name LIKE $1 || ' %'",
            name,
        )
        return [int(r["pid"]) for r in rows]


def _memory(pids: list[int]) -> dict[str, float]:
    """Mean RSS and USS in MiB of the server's backends ``pids`` (``/proc``)."""
    rss, uss = [], []
    for pid in pids:
        try:
            info = psutil.Process(pid).memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss.append(info.rss / _MIB)
        uss.append(info.uss / _MIB)
    if not rss:
        return {}
    return {"rss_mib": sum(rss) / len(rss), "uss_mib": sum(uss) / len(uss), "n": len(rss)}


def _client_rss(worker: Worker) -> float:
    return float(psutil.Process(worker.process.pid).memory_info().rss) / _MIB


#: Rounds of the template's recovery, by the store and by raw asyncpg in turn.
_RECOVERY_ROUNDS = 7
#: Finished tasks kept by the template's recovery: every seeded one.
_TEMPLATE_RETENTION = 86_400.0


async def _template(fleet: _Fleet) -> dict[str, Any]:
    """A migrated template cluster with the seeded rows, what ``recover()`` read of it, and
    the open's floor: one cluster's recovery by the store and by raw asyncpg running the
    same queries and decoding (interleaved rounds), the latter times the clusters over the
    machine's cores being what leading every cluster costs with the store taken out."""
    profile = fleet.profile
    template = f"{fleet.prefix}_template"
    engine = create_async_engine(fleet.url.set(drivername="postgresql+asyncpg"))
    store_s: list[float] = []
    raw_s: list[float] = []
    try:
        await upgrade(engine, template)
        count = profile.fleet_live + profile.fleet_finished
        # history.seed rounds the live rows down: a fraction a little above the exact one.
        fraction = (profile.fleet_live + 0.5) / count
        await seed(
            fleet.conn,
            template,
            count,
            epoch=HISTORY_EPOCH,
            key_prefix="fleet-",
            live_fraction=fraction,
        )
        config = PgStoreConfig(schema=template, retention=_TEMPLATE_RETENTION)
        async with await PgStore.from_engine(engine, config) as store:
            recovered = await store.recover(TimeBase.now())
            for _ in range(_RECOVERY_ROUNDS):
                started = time.perf_counter()
                await store.recover(TimeBase.now())
                store_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                raw = await raw_recover(
                    fleet.conn, template, TimeBase.now(), retention=_TEMPLATE_RETENTION
                )
                raw_s.append(time.perf_counter() - started)
    finally:
        await engine.dispose()
    if (len(raw.tasks), len(raw.terminal)) != (len(recovered.tasks), len(recovered.terminal)):
        raise RuntimeError("fleet: the raw recovery read other rows than the store's")
    floor = summarize(raw_s)["median"] * profile.fleet_clusters / (os.cpu_count() or 1)
    return {
        "schema": template,
        "live": len(recovered.tasks),
        "finished": len(recovered.terminal),
        "recover_seconds": summarize(store_s),
        "raw_recover_seconds": summarize(raw_s),
        "open_floor_seconds": floor,
    }


async def _seed(fleet: _Fleet, template: str) -> dict[str, Any]:
    schemas = fleet.schemas
    n = fleet.profile.fleet_seeders
    started = time.monotonic()
    seeders = [
        await Worker.start(
            f"{fleet.prefix}-seed{i}",
            "seed",
            fleet.args(template=template, schemas=schemas[i::n]),
            fleet.url,
        )
        for i in range(n)
    ]
    said = [await s.wait_for("seeded", fleet.cap) for s in seeders]
    for s in seeders:
        await s.exited()
    return {
        "seconds": time.monotonic() - started,
        "processes": n,
        "enroll_seconds_summed": sum(s["enroll_s"] for s in said),
        "copy_seconds_summed": sum(s["copy_s"] for s in said),
    }


async def _serve(
    fleet: _Fleet, name: str, group: str | None = None, url: URL | None = None
) -> Worker:
    journal = fleet.journals / f"{name}.acks"
    args = fleet.args(group, journal=str(journal), commit_every=fleet.profile.fleet_commit_every)
    worker = await Worker.start(name, "serve", args, url or fleet.url)
    if group is None:
        fleet.workers.append(worker)
    return worker


def _led(workers: list[Worker]) -> dict[str, dict[str, Any]]:
    """Each cluster's latest ``led`` event across ``workers``."""
    latest: dict[str, dict[str, Any]] = {}
    for w in workers:
        for e in w.said("led"):
            if e["schema"] not in latest or e["t"] > latest[e["schema"]]["t"]:
                latest[e["schema"]] = e
    return latest


async def _until(
    check: Callable[[], Awaitable[bool]], what: str, cap: float, poll: float = 0.05
) -> float:
    deadline = time.monotonic() + cap
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fleet: no {what} within {cap:.0f} s")
        await asyncio.sleep(poll)
    return time.monotonic()


async def _open(fleet: _Fleet, through: URL) -> dict[str, Any]:
    """Start the processes together; until every cluster is led and recovered."""
    profile = fleet.profile
    workers = [
        # The second process goes through the proxy: the one cut off later.
        await _serve(fleet, f"{fleet.prefix}-w{i}", url=through if i == 1 else None)
        for i in range(profile.fleet_processes)
    ]
    first = min(w.started for w in workers)

    async def all_led() -> bool:
        for w in workers:
            if w.process.returncode is not None:
                raise RuntimeError(f"{w.name} exited ({w.process.returncode})")
        return len(_led(workers)) == profile.fleet_clusters

    await _until(all_led, "open", fleet.cap, poll=0.1)
    led = _led(workers)
    last = max(e["t"] for e in led.values())
    first_leads = [min(w.said("led"), key=lambda e: e["t"]) for w in workers if w.said("led")]
    wrong = [
        e
        for e in led.values()
        if e["live"] < profile.fleet_live or e["finished"] != profile.fleet_finished
    ]
    return {
        "seconds": last - first,
        "connected_seconds": summarize([w.said("connected")[0]["t"] - w.started for w in workers]),
        "first_lead_seconds": summarize([e["t"] - first for e in first_leads]),
        "recovered_other_than_seeded": len(wrong),
    }


async def _backends(fleet: _Fleet, workers: list[Worker], seconds: float) -> dict[str, Any]:
    """Each worker's most server sessions over ``seconds`` of looks, and their memory."""
    most = {w.name: 0 for w in workers}
    pids: dict[str, list[int]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for w in workers:
            found = await fleet.backends(w.name)
            if len(found) >= most[w.name]:
                most[w.name], pids[w.name] = len(found), found
        await asyncio.sleep(0.1)
    every = [pid for found in pids.values() for pid in found]
    return {
        "per_process": most,
        "max": max(most.values()),
        "server_memory": _memory(every),
        "client_rss_mib": {w.name: _client_rss(w) for w in workers},
    }


async def _lost(fleet: _Fleet) -> dict[str, int]:
    """Acknowledged ids (every journal) missing from their clusters."""
    acked: dict[str, set[int]] = {}
    for path in fleet.journals.glob("*.acks"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():  # a killed process's torn last line
                acked.setdefault(parts[0], set()).add(int(parts[1]))
    lost = 0
    for schema, ids in acked.items():
        found = await fleet.conn.fetch(
            f'SELECT id FROM "{schema}".cronoq_tasks WHERE id = ANY($1::bigint[])',  # noqa: S608
            list(ids),
        )
        lost += len(ids) - len(found)
    return {"acknowledged": sum(map(len, acked.values())), "lost": lost, "clusters": len(acked)}


async def _commit(fleet: _Fleet) -> dict[str, Any]:
    profile = fleet.profile
    # The figure: 1,000 clusters against 10, whatever the fleet's size.
    wide = min(1000, profile.fleet_clusters)
    narrow = min(10, max(1, wide // 4))
    worker = await Worker.start(
        f"{fleet.prefix}-commit",
        "commit",
        fleet.args(
            settle=0.0,
            clusters=profile.fleet_clusters,
            open_cap=fleet.cap,
            wide=wide,
            narrow=narrow,
            submitters=profile.fleet_submitters,
            seconds=profile.fleet_commit_seconds,
            rounds=profile.fleet_commit_rounds,
        ),
        fleet.url,
    )
    opened = await worker.wait_for("all_led", fleet.cap)
    rates = await worker.wait_for("rates", fleet.cap + profile.fleet_commit_rounds * 60)
    floor = await worker.wait_for("floor", fleet.cap + profile.fleet_commit_rounds * 60)
    await worker.exited()
    return {
        "submitters": profile.fleet_submitters,
        "wide_clusters": wide,
        "narrow_clusters": narrow,
        "one_process_open_seconds": opened["seconds"],
        "wide_per_s": summarize(rates["wide"]),
        "narrow_per_s": summarize(rates["narrow"]),
        "wide_vs_narrow": paired(rates["wide"], rates["narrow"]),
        # The same commits' statements on raw asyncpg sessions, the store taken out: raw
        # over many clusters vs raw over few (the key figure), and raw over many vs the
        # store over few (medians: those rounds are not paired), the ratio the store would
        # reach if its many-cluster side cost no more than the raw statements.
        "floor_wide_per_s": summarize(floor["wide"]),
        "floor_narrow_per_s": summarize(floor["narrow"]),
        "floor_wide_vs_floor_narrow": paired(floor["wide"], floor["narrow"]),
        "floor_wide_vs_narrow": statistics.median(floor["wide"])
        / statistics.median(rates["narrow"]),
    }


async def run(url: URL, peers: dict[str, URL], profile: Profile) -> dict[str, Any]:
    """The fleet's figures (see the module's docstring)."""
    prefix = f"fleet_{secrets.token_hex(3)}"
    journals = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    conn = await asyncpg.connect(dsn(url))
    fleet = _Fleet(url, profile, prefix, conn, journals)
    keepalive, session_timeout, lock_poll = profile.fleet_timing
    results: dict[str, Any] = {
        "prefix": prefix,
        "clusters": profile.fleet_clusters,
        "processes": profile.fleet_processes,
        "pool": profile.fleet_pool,
        "live": profile.fleet_live,
        "finished": profile.fleet_finished,
        "keepalive": keepalive,
        "session_timeout": session_timeout,
        "lock_poll": lock_poll,
        "commit_every": profile.fleet_commit_every,
    }
    others: list[Worker] = []
    proxy = await StallingProxy(url.port or 5432).start()
    try:
        await _phases(fleet, proxy, results, others)
    except Exception as error:  # the figures so far are kept, the failure said
        results["error"] = f"{type(error).__name__}: {error}"
        print(f"   fleet failed: {results['error']}", flush=True)
    finally:
        for w in [*fleet.workers, *others]:
            if w.process.returncode is None:
                w.process.kill()
                await w.process.wait()
        await proxy.close()
        await conn.close()
        shutil.rmtree(journals, ignore_errors=True)
    return results


async def _cut_off(fleet: _Fleet, proxy: StallingProxy, cut: Worker) -> dict[str, Any]:
    """Stall ``cut``'s connections until each of its clusters is given to another process,
    or for at most ``3 * session_timeout + 10`` seconds: then the ones still its own or
    unowned are counted, and its server sessions described (what holds them)."""
    session_timeout = fleet.profile.fleet_timing[1]
    theirs = [s for s, o in (await fleet.owners()).items() if o == cut.process_id]
    stalled = time.monotonic()
    proxy.stall()
    deadline = stalled + 3 * session_timeout + 10
    left, moved_at = list(theirs), stalled
    while left and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        owners = await fleet.owners()
        now_left = [s for s in left if owners[s] in (None, cut.process_id)]
        if len(now_left) < len(left):
            left, moved_at = now_left, time.monotonic()
    sessions = await fleet.conn.fetch(
        "SELECT state, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 80) AS query "
        "FROM pg_stat_activity WHERE application_name = $1 OR application_name LIKE $1 || ' %'",
        cut.name,
    )
    return {
        "victim_clusters": len(theirs),
        # Until the last cluster that moved did: every one, unless some are stuck.
        "takeover_seconds": moved_at - stalled,
        "not_taken_over": len(left),
        "cap_seconds": deadline - stalled,
        "sessions_left": [dict(r) for r in sessions],
    }


async def _phases(
    fleet: _Fleet, proxy: StallingProxy, results: dict[str, Any], others: list[Worker]
) -> None:
    """Every phase in turn, each adding its figures to ``results`` once done."""
    profile, prefix = fleet.profile, fleet.prefix
    lock_poll = profile.fleet_timing[2]
    template = await _template(fleet)
    results["template_recovered"] = template
    results["seed"] = await _seed(fleet, template["schema"])
    if profile.fleet_commit_only:
        results["commit"] = await _commit(fleet)
        return
    results["open"] = await _open(fleet, fleet.url.set(port=proxy.port))
    members = [w.process_id for w in fleet.workers]
    await fleet.settle(members, time.monotonic())
    results["backends"] = await _backends(fleet, fleet.workers, 3 * lock_poll + 1)

    idle = await _serve(fleet, f"{prefix}-idle", group=f"{prefix}_idle")
    others.append(idle)
    await idle.wait_for("registered")
    await asyncio.sleep(3 * lock_poll)
    results["standby"] = await _backends(fleet, [idle], 2 * lock_poll + 1)
    await idle.stop()

    joined = await _serve(fleet, f"{prefix}-w{profile.fleet_processes}")
    await joined.wait_for("registered")
    members.append(joined.process_id)
    results["join"] = await fleet.settle(members, joined.started)

    victim = fleet.workers[0]
    theirs = [s for s, o in (await fleet.owners()).items() if o == victim.process_id]
    await asyncio.sleep(lock_poll)
    killed = time.monotonic()
    await victim.stop(signal.SIGKILL)
    took = await _until(fleet.taken_from(victim.process_id, theirs), "takeover", fleet.cap)
    took -= killed
    members.remove(victim.process_id)
    survivors = [w for w in fleet.workers if w is not victim]

    async def recovered() -> bool:
        led = _led(survivors)
        return all(s in led and led[s]["t"] > killed for s in theirs)

    recovered_at = await _until(recovered, "recovery after the kill", fleet.cap, poll=0.1)
    led_again = _led(survivors)
    results["kill"] = {
        "victim_clusters": len(theirs),
        "takeover_seconds": took,
        "recovered_seconds": recovered_at - killed,
        # When each of the victim's clusters was led again (recovered), from the kill: the
        # first is detection plus a claim, the spread is the pacing's rounds and recoveries.
        "led_again_seconds": summarize([led_again[s]["t"] - killed for s in theirs]),
        **await fleet.settle(members, killed),
    }
    results["after"] = await _backends(fleet, survivors, 1.0)

    # The process behind the proxy is cut off: its sockets stay open, nothing passes.
    cut = fleet.workers[1]
    results["cutoff"] = await _cut_off(fleet, proxy, cut)
    # Back in touch: it finds its host session ended, and registers again.
    proxy.resume()
    await asyncio.sleep(2 * profile.fleet_commit_every)
    # All at once: one by one, each stopping process's clusters would move to the rest.
    codes = await asyncio.gather(*(w.stop() for w in survivors))
    results["exit_codes"] = dict(zip([w.name for w in survivors], codes, strict=True))
    results["lost"] = await _lost(fleet)
    results["commit"] = await _commit(fleet)
