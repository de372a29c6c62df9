"""What the console may change, only with ``--allow-actions``: a handover, shown first (the
holder, the epoch) and done on confirmation, and a prune, counted first (a dry run) and done
on confirmation with the dry run's cutoff; each by ``POST``.

A ``POST`` is refused (403) unless it comes from the console's own page: its ``Origin`` (when
the browser sends one) is the console's, its ``Sec-Fetch-Site`` (when sent) is
``same-origin``, and it carries the CSRF token the confirmation page rendered, an HMAC of the
schema and action under a secret made at start-up. Basic auth is sent by the browser to any
page that posts to the console, so credentials alone never authorise an action. Every action
is logged with who asked (the authenticated user, or "token").

The handover itself is the CLI's (``cli.handover``): end the holder's session, then wait for
another session to hold the lock with a moved epoch. The prune is the store's one loop
(``queries.prune``), batch by batch, each batch logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import timedelta
from typing import Any

from starlette.requests import Request

from .. import _catalog as catalog
from .. import _lock_statements as lock_st
from .. import _queries as queries
from .._cli import database as database
from .._cli.app import Options as Options
from .._cli.exits import CliError as CliError
from .._cli.exits import ExitCode as ExitCode
from .._cli.handover import _facts as leader_facts
from .._cli.handover import _new_leader as new_leader
from .._cli.output import format_duration as format_duration
from .._cli.output import holder_document as holder_document
from .._cli.output import rfc3339 as rfc3339
from .._cli.prune import _transactions as transactions
from .._domain import I64_MAX as I64_MAX
from .._domain import UNIX_EPOCH as UNIX_EPOCH

__all__ = [
    "HANDOVER_WAIT",
    "ActionRefused",
    "Csrf",
    "check_origin",
    "handover",
    "handover_facts",
    "prune",
    "prune_preview",
]

#: Seconds a handover waits for a standby to lead.
HANDOVER_WAIT = 15.0

log = logging.getLogger("cronoq_store.console")


class ActionRefused(PermissionError):
    """A POST that did not come from the console's own page: a 403 with the reason."""


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


async def handover_facts(url: str, schema: str, trusted: frozenset[str]) -> dict[str, Any]:
    """What the confirmation page shows: the epoch and the holder it would end."""
    async with database.database(Options(url, schema, trusted)) as conn:
        await database.require_head(conn, schema)
        lock = await _lock(conn, schema)
        facts = await leader_facts(conn, lock)
    return {
        "schema": schema,
        "stored_epoch": facts.stored_epoch,
        "leader": holder_document(facts.holder),
    }


async def _lock(conn: Any, schema: str) -> tuple[int, int]:
    oid = (await conn.execute(lock_st.schema_oid, {"schema": schema})).scalar_one()
    return (lock_st.LOCK_NS_LEADER, oid)


async def handover(
    url: str, schema: str, trusted: frozenset[str], pid: int, who: str
) -> dict[str, Any]:
    """End session ``pid`` if it still holds the leader lock, and wait for a standby."""
    async with database.database(Options(url, schema, trusted)) as conn:
        await database.require_head(conn, schema)
        lock = await _lock(conn, schema)
        before = await leader_facts(conn, lock)
        holder = before.holder
        if holder is None or holder.pid != pid:
            raise CliError("the leader lock changed hands meanwhile: look again", ExitCode.FAILED)
        log.warning("handover of %s asked by %s: ending session pid %d", schema, who, pid)
        ended = (await conn.execute(catalog.terminate_backend, {"pid": pid})).scalar()
        await conn.rollback()
        if not ended:
            raise CliError(f"session pid {pid} could not be ended", ExitCode.FAILED)
        after = await new_leader(conn, lock, before, holder, HANDOVER_WAIT)
    log.warning("handover of %s asked by %s: epoch %d", schema, who, after.stored_epoch)
    return {
        "schema": schema,
        "ended_pid": pid,
        "previous_epoch": before.stored_epoch,
        "stored_epoch": after.stored_epoch,
        "leader": holder_document(after.holder),
    }


async def prune_preview(
    url: str, schema: str, trusted: frozenset[str], older_than: int
) -> dict[str, Any]:
    """The dry run: what a prune of finished tasks older than ``older_than`` seconds (on the
    server's clock) would delete, and what it would keep because live tasks depend on it."""
    async with database.database(Options(url, schema, trusted)) as conn:
        await database.require_head(conn, schema)
        now = (await conn.execute(catalog.server_now)).scalar_one()
        cutoff = (now - UNIX_EPOCH) // timedelta(microseconds=1) * 1000 - older_than * 10**9
        old = (await conn.execute(catalog.finished_before_count, {"cutoff": cutoff})).scalar_one()
        victims = (
            await conn.execute(catalog.prunable_count, {"cutoff": cutoff, "batch": I64_MAX})
        ).scalar_one()
        await conn.rollback()
    return {
        "schema": schema,
        "older_than": format_duration(older_than),
        "cutoff_ns": cutoff,
        "cutoff": rfc3339(cutoff),
        "would_delete": victims,
        "would_keep": max(0, old - victims),
    }


async def prune(
    url: str, schema: str, trusted: frozenset[str], cutoff: int, who: str
) -> dict[str, Any]:
    """Delete what the dry run counted (finished tasks updated before ``cutoff`` that no
    live task depends on), batch by batch, each logged."""
    log.warning("prune of %s asked by %s: before %s", schema, who, rfc3339(cutoff))
    batches = 0

    def progress(total: int) -> None:
        nonlocal batches
        batches += 1
        log.warning("prune of %s asked by %s: %d deleted", schema, who, total)

    async with database.database(Options(url, schema, trusted)) as conn:
        await database.require_head(conn, schema)
        deleted = await queries.prune(transactions(conn), cutoff, progress)
    return {"schema": schema, "cutoff": rfc3339(cutoff), "deleted": deleted, "batches": batches}
