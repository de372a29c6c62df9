"""What the console may change, only with ``--allow-actions``: a handover, shown first (the
holder, the epoch) and done on confirmation, and a prune, counted first (a dry run) and done
on confirmation with the dry run's cutoff; each by ``POST``.

A ``POST`` is refused (403) unless it comes from the console's own page: its ``Origin`` (when
the browser sends one) is the console's, its ``Sec-Fetch-Site`` (when sent) is
``same-origin``, and it carries the CSRF token the confirmation page rendered, an HMAC of the
schema and action under a secret made at start-up. Basic auth is sent by the browser to any
page that posts to the console, so credentials alone never authorise an action. Every action
is logged with who asked (the authenticated user, or "token").

The handover itself is the CLI's (``cli.operations``): end the holder's session, then wait
for another session to hold the lock with a moved epoch. The prune is the store's one loop
(``queries.prune``), batch by batch, run in the background (:class:`Pruning`) so that its
page shows the rows deleted so far; each batch is logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request

from .. import _door as door
from .._cli import database, operations
from .._cli.exits import CliError, ExitCode
from .._cli.output import format_duration, holder_document, rfc3339
from .._errors import StoreError
from .._terminal_safe import visible
from .._urls import scrub
from .source import Source

__all__ = [
    "HANDOVER_WAIT",
    "ActionRefused",
    "Csrf",
    "PruneJob",
    "PruneNotFound",
    "Pruning",
    "check_origin",
    "handover",
    "handover_facts",
    "prune_preview",
]

#: Seconds a handover waits for a standby to lead.
HANDOVER_WAIT = 15.0

log = logging.getLogger("cronoq_store.console")


class ActionRefused(PermissionError):
    """A POST that did not come from the console's own page: a 403 with the reason."""


class PruneNotFound(LookupError):
    """No prune with that id on this console (it keeps the last ones only): a 404."""


class Csrf:
    """Tokens bound to one schema and action, valid while this console runs."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def token(self, schema: str, action: str) -> str:
        return hmac.new(self._secret, f"{schema}\0{action}".encode(), hashlib.sha256).hexdigest()

    def check(self, schema: str, action: str, given: str | None) -> None:
        if given is None or not hmac.compare_digest(given, self.token(schema, action)):
            raise ActionRefused("missing or wrong CSRF token: start from the console's page")


def check_origin(request: Request) -> None:
    """Refuse a request another site's page made (``Origin``, ``Sec-Fetch-Site``)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        raise ActionRefused(f"refused a {site} request: actions come from the console's page")
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if origin is not None and origin not in (f"http://{host}", f"https://{host}"):
        raise ActionRefused("refused a request from another origin")


async def handover_facts(source: Source, schema: str) -> dict[str, Any]:
    """What the confirmation page shows: the epoch and the holder it would end."""
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        lock = await operations.leader_lock(conn, schema)
        facts = await operations.fresh_facts(conn, lock)
    return {
        "schema": schema,
        "stored_epoch": facts.stored_epoch,
        "leader": holder_document(facts.holder),
    }


async def handover(source: Source, schema: str, pid: int, who: str) -> dict[str, Any]:
    """End session ``pid`` if it still holds the leader lock, and wait until another instance
    leads; where the lock went otherwise is raised as the error the page shows."""
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        lock = await operations.leader_lock(conn, schema)
        before = await operations.fresh_facts(conn, lock)
        holder = before.holder
        if holder is None or holder.pid != pid:
            raise CliError("the leader lock changed hands meanwhile: look again", ExitCode.FAILED)
        log.warning("handover of %s asked by %s: ending session pid %d", schema, who, pid)
        await operations.end_leader_session(conn, lock, pid)
        result = await operations.wait_for_new_leader(conn, lock, before, holder, HANDOVER_WAIT)
    after = result.check()  # another instance leads, or the page says where the lock went
    log.warning("handover of %s asked by %s: epoch %d", schema, who, after.stored_epoch)
    return {
        "schema": schema,
        "ended_pid": pid,
        "previous_epoch": before.stored_epoch,
        "stored_epoch": after.stored_epoch,
        "leader": holder_document(after.holder),
    }


async def prune_preview(source: Source, schema: str, older_than: int) -> dict[str, Any]:
    """The dry run: what a prune of finished tasks older than ``older_than`` seconds (on the
    server's clock) would delete, and what it would keep because live tasks depend on it."""
    async with source.connect(schema) as conn:
        await database.require_head(conn, schema)
        plan = await operations.plan_prune(conn, older_than)
    return {
        "schema": schema,
        "older_than": format_duration(older_than),
        "cutoff_ns": plan.cutoff_ns,
        "cutoff": rfc3339(plan.cutoff_ns),
        "would_delete": plan.victims,
        "would_keep": plan.protected,
    }


@dataclass
class PruneJob:
    """A prune the console runs in the background: what it was asked, and how far it got
    (its page reads this while it runs, and refreshes until it is done)."""

    id: str
    schema: str
    cutoff: int
    #: What the dry run counted.
    expected: int
    who: str
    started: datetime
    deleted: int = 0
    batches: int = 0
    finished: datetime | None = None
    error: str | None = None

    def document(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "schema": self.schema,
            "cutoff": rfc3339(self.cutoff),
            "expected": self.expected,
            "asked_by": self.who,
            "started": rfc3339(self.started),
            "deleted": self.deleted,
            "batches": self.batches,
            "done": self.finished is not None,
            "finished": rfc3339(self.finished),
            "error": self.error,
        }


class Pruning:
    """The console's prunes: one at a time per cluster, each in a task of its own, so the
    request that starts one returns at once and its page shows the rows deleted so far."""

    #: Finished prunes whose pages stay readable.
    KEPT = 20

    def __init__(self, source: Source) -> None:
        self._source = source
        self._jobs: dict[str, PruneJob] = {}
        self._running: dict[str, asyncio.Task[None]] = {}

    def job(self, schema: str, id: str) -> PruneJob | None:
        found = self._jobs.get(id)
        return found if found is not None and found.schema == schema else None

    def start(self, schema: str, cutoff: int, expected: int, who: str) -> PruneJob:
        """Start deleting what the dry run counted; ``ActionRefused`` while another prune
        of ``schema`` runs."""
        if schema in self._running:
            raise ActionRefused(f"a prune of {schema} is running: wait for it to end")
        job = PruneJob(
            secrets.token_hex(8), schema, cutoff, expected, who, datetime.now(timezone.utc)
        )
        self._jobs[job.id] = job
        for old in [j for j in self._jobs.values() if j.finished is not None][: -self.KEPT]:
            del self._jobs[old.id]
        self._running[schema] = asyncio.create_task(self._run(job))
        return job

    async def _run(self, job: PruneJob) -> None:
        schema, who = job.schema, job.who
        log.warning("prune of %s asked by %s: before %s", schema, who, rfc3339(job.cutoff))

        def progress(total: int) -> None:
            job.deleted, job.batches = total, job.batches + 1
            log.warning("prune of %s asked by %s: %d deleted", schema, who, total)

        try:
            async with (
                door.translated("pruning", passing=(CliError,)),
                self._source.connect(schema) as conn,
            ):
                await database.require_head(conn, schema)
                cluster = await operations.prune_cluster(conn, schema)
                await operations.prune_batches(
                    conn, cluster, job.cutoff, progress, database.LOCK_WAIT
                )
            log.warning("prune of %s asked by %s: done, %d deleted", schema, who, job.deleted)
        except (CliError, StoreError) as error:  # said on the page and in the log only
            job.error = visible(scrub(str(error), [self._source.url]))
            log.warning("prune of %s asked by %s: failed: %s", schema, who, job.error)
        finally:
            job.finished = datetime.now(timezone.utc)
            del self._running[schema]

    async def close(self) -> None:
        """Cancel the prunes still running (the batch in flight rolls back)."""
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
