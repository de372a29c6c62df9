"""A rolling upgrade from the previous release, as docs/operations.md ("Upgrading") orders
it, with that release's own build: its code (``git archive`` of tag ``v0.1.0``) runs in
processes of its own beside this build, on one real server.

The assertions follow both builds' heads: while they are the same revision the migration
has nothing to do and the previous release reopens; once this build adds a revision, the
same steps check the real path (the previous release commits through the migration and is
refused on restart; this build waits with ``migrate=False`` until ops migrate).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from cronoq_store import MigrationError, PgStore, TimeBase, epoch_of
from cronoq_store._cli import ExitCode
from cronoq_store._migrations import head_revision

from .pgharness import without_instance
from .support import ROOT, full, named_config, revision_of, run
from .waits import PATIENCE, bounded, holds_for

#: The previous release: its tag, and its commit should the tag be missing.
PREVIOUS_TAG = "v0.1.0"
PREVIOUS_COMMIT = "bf18aee5f2d87c57246f52d1f174629b193b4262"

#: The previous release's leader: it leads, commits one submission every 50 ms and prints
#: one JSON line per event, until its stdin closes; then it releases and exits. Only the
#: public API, which the previous release shares with this one.
OLD_LEADER = """
import asyncio, json, sys, time
from cronoq_store import FencedError, PgStore, PgStoreConfig, Submitted, TaskSpec, TimeBase
from cronoq_store import task_id

def say(**event):
    print(json.dumps(event), flush=True)

async def main(url, schema, name):
    config = PgStoreConfig(
        schema=schema, application_name=name, lock_poll=0.05, keepalive=0.2,
        session_timeout=2.0,
    )
    try:
        store = await PgStore.connect(url, config)
    except Exception as exc:
        say(refused=f"{type(exc).__name__}: {exc}")
        sys.exit(3)
    async with store:
        say(opened=schema)
        stopped = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        leading = asyncio.ensure_future(store.acquire_leadership())
        await asyncio.wait({leading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not leading.done():
            leading.cancel()
            return
        epoch = leading.result()
        say(leading=epoch)
        base, n = TimeBase.now(), 0
        while not stopped.done():
            n += 1
            spec = TaskSpec(b"from the previous release", key=f"old-{n}")
            try:
                await store.commit(epoch, base, [Submitted(task_id(epoch, n), n, 0, spec)], [])
                say(acked=task_id(epoch, n), at=time.time())
            except Exception as exc:
                say(failed=task_id(epoch, n), error=f"{type(exc).__name__}: {exc}"[:500])
                if isinstance(exc, FencedError):
                    break
            await asyncio.sleep(0.05)
        await store.release_leadership()
        say(released=epoch)

asyncio.run(main(*sys.argv[1:]))
"""


def previous_commit() -> str:
    """The previous release's commit: its tag, else its known commit; a clear failure
    (never a skip) where this clone's history has neither."""
    for ref in (f"{PREVIOUS_TAG}^{{commit}}", f"{PREVIOUS_COMMIT}^{{commit}}"):
        try:
            found = subprocess.run(
                ["git", "rev-parse", "--verify", "--quiet", ref],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=False,
            )
        except FileNotFoundError:
            pytest.fail(
                "git is not installed: the rolling-upgrade test builds the previous "
                "release from this clone's history"
            )
        if found.returncode == 0:
            return found.stdout.strip()
    pytest.fail(
        f"the previous release's build is not in this checkout's git history (tag "
        f"{PREVIOUS_TAG}, commit {PREVIOUS_COMMIT[:7]}): the rolling-upgrade test runs that "
        f"build; run the suite in a git clone of {ROOT.name} with its history and tags "
        "(`git fetch --tags`; `git fetch --unshallow` for a shallow clone)"
    )


@pytest.fixture(scope="module")
def previous_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's source tree, from ``git archive`` (no worktree is made)."""
    commit = previous_commit()
    tree = tmp_path_factory.mktemp("previous-release")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True
    )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def cli_module(tree: Path) -> str:
    """The ``cronoq-store`` command's module in a build (``cli``, later ``_cli``)."""
    return "cronoq_store._cli" if (tree / "cronoq_store" / "_cli").is_dir() else "cronoq_store.cli"


def old_environment(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRONOQ_")}
    env["PYTHONPATH"] = str(tree)
    return env


async def old_command(tree: Path, url: URL, *args: str) -> tuple[int, str, str]:
    """The previous release's ``cronoq-store``, as its users run it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        cli_module(tree),
        "--url",
        full(url),
        *args,
        cwd=tree,
        env=old_environment(tree),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@dataclass
class OldInstance:
    """A running instance of the previous release and what it said so far."""

    process: asyncio.subprocess.Process
    events: list[dict[str, Any]] = field(default_factory=list)

    def said(self, key: str) -> list[dict[str, Any]]:
        return [e for e in self.events if key in e]

    async def until(self, what: str, test: Any, timeout: float = PATIENCE) -> None:
        deadline = time.monotonic() + timeout
        while not test(self):
            if self.process.returncode is not None and not test(self):
                raise AssertionError(f"the previous release exited first: {self.events}")
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout} s for {what}: {self.events[-5:]}")
            await asyncio.sleep(0.05)


@asynccontextmanager
async def old_instance(tree: Path, url: URL, schema: str, name: str) -> AsyncIterator[OldInstance]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        OLD_LEADER,
        full(url),
        schema,
        name,
        cwd=tree,
        env=old_environment(tree),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    instance = OldInstance(process)

    async def read() -> None:
        assert process.stdout is not None
        async for line in process.stdout:
            instance.events.append(json.loads(line))

    reader = asyncio.ensure_future(read())
    try:
        yield instance
    finally:
        if process.returncode is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        await asyncio.wait_for(reader, 30)


async def test_a_rolling_upgrade_from_the_previous_release(
    previous_build: Path, pg_url: URL, schema: str
) -> None:
    # The cluster as the previous release made it.
    code, out, err = await old_command(previous_build, pg_url, "--schema", schema, "migrate")
    assert code == 0, out + err
    old_head = await revision_of(pg_url, schema)
    same_heads = old_head == head_revision()

    async with old_instance(previous_build, pg_url, schema, "previous") as old:
        await old.until("the previous release to lead", lambda o: o.said("leading"))
        assert old.said("leading")[0]["leading"] == 1
        await old.until("its first commits", lambda o: len(o.said("acked")) >= 3)

        # 1. This build migrates the schema while the previous release leads and commits.
        migrated = await run("--url", full(pg_url), "--schema", schema, "migrate")
        assert migrated.exit_code == 0, migrated.output
        assert await revision_of(pg_url, schema) == head_revision()
        after = time.time()
        await old.until(
            "commits of the previous release after the migration",
            lambda o: len([e for e in o.said("acked") if e["at"] > after]) >= 5,
        )
        assert not old.said("failed"), old.said("failed")

        # 2. This build's instances open without migrating, and wait behind that leader.
        async with await PgStore.connect(
            pg_url, named_config(schema, "current"), migrate=False
        ) as standby:
            health = await standby.health()
            assert health.at_head
            assert health.has_leader
            assert health.holder is not None
            assert health.holder.application_name == "previous leader"
            probe = await run("--url", full(pg_url), "--schema", schema, "health")
            assert probe.exit_code == ExitCode.OK, probe.output
            taking_over = asyncio.ensure_future(standby.acquire_leadership())

            # 3. A previous-release instance restarting now meets this build's schema.
            code, out, err = await old_command(previous_build, pg_url, "--schema", schema, "health")
            if same_heads:
                assert code == ExitCode.OK, out + err
            else:
                assert code == ExitCode.NEWER_DATABASE, out + err
            async with old_instance(previous_build, pg_url, schema, "restarted") as restarted:
                if same_heads:
                    await restarted.until("the restart to open", lambda o: o.said("opened"))
                else:
                    await restarted.until("the refusal", lambda o: o.said("refused"))
                    assert (
                        "which this build does not know" in restarted.said("refused")[0]["refused"]
                    )
            await holds_for(lambda: not taking_over.done(), "this build's standby waiting", 0.5)

            # 4. The previous release's leader stops last; this build takes over with
            # everything it acknowledged.
            acked = {e["acked"] for e in old.said("acked")}
            assert old.process.stdin is not None
            old.process.stdin.close()
            await old.until("its release", lambda o: o.said("released"))
            epoch = await bounded(taking_over, "this build's takeover")
            assert epoch == 2
            recovered = await standby.recover(TimeBase.now())
            live = {task.id for task in recovered.tasks}
            assert acked <= live
            assert {epoch_of(i) for i in acked} == {1}
            probe = await run("--url", full(pg_url), "--schema", schema, "health", "--json")
            assert probe.exit_code == ExitCode.OK, probe.output
            leader = json.loads(probe.stdout)["leader"]
            assert without_instance(leader["application_name"]) == "current leader"
            assert leader["instance"] is not None


async def test_this_release_waits_for_ops_to_migrate_a_schema_of_the_previous_one(
    previous_build: Path, pg_url: URL, schema: str
) -> None:
    """``migrate=False`` (a runtime role without DDL rights) on a schema only the previous
    release migrated: refused until ops migrate, with the revisions named, nothing changed;
    this build's ``health`` says the schema is behind (exit 4)."""
    code, out, err = await old_command(previous_build, pg_url, "--schema", schema, "migrate")
    assert code == 0, out + err
    old_head = await revision_of(pg_url, schema)
    probe = await run("--url", full(pg_url), "--schema", schema, "health", "--json")
    if old_head == head_revision():
        async with await PgStore.connect(
            pg_url, named_config(schema, "current"), migrate=False
        ) as s:
            assert (await s.health()).at_head
        assert probe.exit_code == ExitCode.NO_LEADER, probe.output
        return
    with pytest.raises(MigrationError, match=f"at revision {old_head}, behind this build's head"):
        await PgStore.connect(pg_url, named_config(schema, "current"), migrate=False)
    assert await revision_of(pg_url, schema) == old_head
    assert probe.exit_code == ExitCode.NOT_MIGRATED, probe.output
    assert json.loads(probe.stdout)["revision"] == [old_head]
