"""The host session: one connection per host process and database, holding the process's
lock, and everything the host does on it.

A process is alive exactly as long as this session holds ``(LOCK_NS_HOST, process_id)``:
the server frees the lock when the session ends (a killed process's socket closes at once;
a cut-off one's is ended by ``idle_session_timeout`` or its keepalives), so no clock decides
liveness. Registration takes a new id from a sequence, then the lock, then writes the
process's row: a row whose lock is free belongs to a dead process, and since ids are never
reused, dead is permanent. A process whose session ended registers again under a new id,
as each standalone term is new.

Every statement is bounded by what is left of ``session_timeout`` since the session last
answered: a silent session is torn down (its socket dropped) before the server could free
the lock, so the process steps its clusters down before any other process can claim them,
the argument of :mod:`cronoq_store._leadership` for one cluster.

Claims run here too, and only here: a claim commits only while this session holds the
process lock, so none can commit after the others buried the process, leaving a cluster
owned by a dead id. Each cluster is taken as a takeover takes one: the control row locked,
the leader table taken ``EXCLUSIVE`` (commits in flight of the last owner land first), the
standalone leader lock tried for the transaction (a standalone leader or a downgrade holds
it: skip), the epoch bumped only where the cluster is still this group's and the same
incarnation, the term recorded, the row given to this process. :meth:`HostSession.claim_many`
takes several in one transaction, one statement per step for all of them (a round trip
each, and one commit, where the session's time goes); :meth:`HostSession.claim` takes one,
for a batch that failed as a whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Executable, Result
from sqlalchemy.ext.asyncio import AsyncEngine

from .. import _door as door
from .. import _statements as st
from .._config import PgStoreConfig
from .._door import LockSession
from .._errors import LockHeldError, MigrationError
from .._trust import untrusted_among
from . import control

__all__ = ["Claim", "ClaimRefused", "HostSession", "Owned"]

logger = logging.getLogger("cronoq_store")


@dataclass(frozen=True, slots=True)
class Owned:
    """A cluster the control schema gives to this process, with the epoch it claimed."""

    schema: str
    epoch: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class Claim:
    """A cluster this process now leads: its epoch, incarnation and schema OID."""

    schema: str
    epoch: int
    incarnation: int
    schema_oid: int


@dataclass(frozen=True, slots=True)
class ClaimRefused:
    """A cluster this process may not lead, and why (recorded on its control row)."""

    schema: str
    why: str


class HostSession:
    """One process's host session in one database (see the module's docstring)."""

    def __init__(
        self, session: LockSession, config: PgStoreConfig, control_schema: str, group: str
    ) -> None:
        self._session = session
        self._config = config
        self._control = control_schema
        self._group = group
        self._loop = asyncio.get_running_loop()
        self._last_answer = self._loop.time()
        #: This process's id in the control schema (its lock's second key).
        self.process_id = 0

    @classmethod
    async def register(
        cls,
        engine: AsyncEngine,
        config: PgStoreConfig,
        control_schema: str,
        group: str,
        instance: str,
        settings: Mapping[str, str] | None,
    ) -> HostSession:
        """Open a session of ``engine`` (the host's lock engine), apply ``settings`` when
        its connect did not send them, and register this process: a new id, its lock,
        then its row."""
        lock = await LockSession.open(engine, config.session_timeout)
        host = cls(lock, config, control_schema, group)
        try:
            if settings is not None:
                await lock.apply_settings(settings, config.session_timeout)
            async with door.translated("registering the host process"):
                process_id = int((await host._run(control.next_process_id)).scalar_one())
                await host._run(control.take_process_lock, {"id": process_id})
                await host._run(
                    control.insert_process,
                    {"process_id": process_id, "group": group, "instance": instance},
                )
        except BaseException:
            await lock.close()
            raise
        host.process_id = process_id
        return host

    @property
    def broken(self) -> bool:
        """Whether the session is gone: then so is this process's lock, and every cluster
        it led must step down. Any other failure was the server's answer to one statement."""
        return self._session.broken

    async def _run(
        self,
        statement: Executable,
        params: Mapping[str, Any] | None = None,
        *,
        schema: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Result[Any]:
        """One statement, bounded by what is left of ``session_timeout`` since the last
        answer; in the control schema unless ``schema`` names a cluster's, or ``options``
        point it at several (:class:`~cronoq_store._statements.HostedClaims`)."""
        async with door.translated("the host session"):
            if options is not None:
                result = await self._session.execute_with(statement, params, self._left(), options)
            else:
                result = await self._session.execute(
                    statement, params, self._left(), schema=schema or self._control
                )
        self._last_answer = self._loop.time()
        return result

    async def owned(self) -> dict[str, Owned]:
        """The clusters the control schema gives to this process now."""
        rows = await self._run(control.owned_by, {"group": self._group, "me": self.process_id})
        return {r.schema_name: Owned(r.schema_name, int(r.epoch), int(r.incarnation)) for r in rows}

    async def digest(self) -> tuple[int, int]:
        """The keeper's one-round-trip check: how many clusters this process owns, and the
        sum of their epochs (:data:`~cronoq_store._host.control.owned_digest`)."""
        row = (
            await self._run(control.owned_digest, {"group": self._group, "me": self.process_id})
        ).one()
        return int(row.clusters), int(row.epochs)

    async def members(self) -> list[int]:
        """The group's processes not known to have left, this one included."""
        rows = await self._run(control.live_members, {"group": self._group})
        return [int(r.process_id) for r in rows if r.state == "member"]

    async def dead_among(self, others: Sequence[int]) -> list[int]:
        """Which of ``others`` hold no process lock: their sessions are gone. Never asked
        of this process's own id, which its session holds (the server would grant the
        shared try, reading it as dead)."""
        if not others:
            return []
        rows = await self._run(control.probe_dead, {"ids": list(others)})
        return sorted(int(r.process_id) for r in rows)

    async def end_stuck(self, others: Sequence[int], seconds: float) -> list[int]:
        """End the host sessions of ``others`` stuck mid-statement for over ``seconds``
        (:data:`~cronoq_store._host.control.end_stuck_sessions`); the pids ended."""
        if not others:
            return []
        found = await self._run(
            control.end_stuck_sessions, {"ids": list(others), "seconds": seconds}
        )
        return [int(r.pid) for r in found]

    async def bury(self, dead: Sequence[int]) -> None:
        """Mark ``dead`` processes left and their clusters unowned, in one transaction."""
        async with self._session.transaction(self._config.session_timeout):
            await self._run(control.mark_left, {"ids": list(dead)})
            await self._run(control.orphan_clusters, {"ids": list(dead)})

    async def counts(self) -> dict[int | None, int]:
        """How many active clusters each process owns (``None``: unowned)."""
        rows = await self._run(control.owner_counts, {"group": self._group})
        return {None if r.owner is None else int(r.owner): int(r.clusters) for r in rows}

    async def unowned(self, limit: int) -> list[str]:
        """Up to ``limit`` active clusters nobody owns, by name."""
        rows = await self._run(
            control.claimable, {"group": self._group, "dead": [], "limit": limit}
        )
        return [str(r.schema_name) for r in rows]

    async def refusals(
        self, schemas: Sequence[str], trusted_triggers: frozenset[str]
    ) -> dict[str, MigrationError]:
        """The trust check of every schema in ``schemas`` at once, before claiming them."""
        async with door.translated("checking the clusters to claim"):
            return await self._session.run_sync(
                lambda conn: untrusted_among(conn, schemas, trusted_triggers),
                self._left(),
            )

    def _left(self) -> float:
        return max(self._last_answer + self._config.session_timeout - self._loop.time(), 0.001)

    async def claim(self, schema: str, bound: float) -> Claim | ClaimRefused | None:
        """Take ``schema`` for this process (see the module's docstring). ``None`` when it
        is not to be had now (another process took it first, a standalone leader or a
        downgrade holds its lock, commits in flight held the leader table past
        ``bound``); :class:`ClaimRefused` when it cannot be led as it stands."""
        key = {"group": self._group, "schema": schema}
        try:
            async with (
                door.translated("claiming a cluster"),
                self._session.transaction(self._left()),
            ):
                row = (await self._run(control.claim_one, key)).first()
                if row is None:
                    return None
                oid = (await self._run(st.schema_oid, {"schema": schema})).scalar()
                if oid is None:
                    return ClaimRefused(schema, f"schema {schema!r} does not exist")
                await door.leader_barrier(
                    lambda statement, params: self._run(statement, params, schema=schema),
                    schema,
                    bound,
                    "claiming a hosted cluster",
                )
                lock = {"k1": st.LOCK_NS_LEADER, "k2": int(oid)}
                if not (await self._run(st.try_leader_lock_for_transaction, lock)).scalar():
                    return None
                epoch = (
                    await self._run(
                        st.take_hosted_epoch,
                        {"incarnation": int(row.incarnation), "group": self._group},
                        schema=schema,
                    )
                ).scalar()
                if epoch is None:
                    return _gone(schema, int(row.incarnation), self._group)
                await self._run(
                    st.record_term, {"epoch": epoch, "lock_seen_held_at": None}, schema=schema
                )
                await self._run(st.prune_terms, None, schema=schema)
                await self._run(
                    control.set_owner, {**key, "me": self.process_id, "epoch": int(epoch)}
                )
                return Claim(schema, int(epoch), int(row.incarnation), int(oid))
        except LockHeldError:
            # Commits in flight hold the leader table: they land, and the claim comes at the
            # next round. Those stuck mid-statement as long as a dead process's host session
            # takes to end are ended, so that the next round can claim: nothing they hold
            # was acknowledged.
            stuck = 1.5 * self._config.session_timeout
            ended = await self._run(control.end_stuck_holders, {"schema": schema, "seconds": stuck})
            pids = [int(r.pid) for r in ended]
            if pids:
                logger.warning(
                    "ended sessions stuck mid-statement on a cluster's leader table",
                    extra={"schema": schema, "pids": pids},
                )
            return None

    async def claim_many(
        self, schemas: Sequence[str], bound: float
    ) -> dict[str, Claim | ClaimRefused | None]:
        """Take ``schemas`` for this process in one transaction, each as :meth:`claim`
        takes one, with one statement for each step over all of them (see the module's
        docstring); what became of each, as :meth:`claim` says it. Raises when a step
        fails for all of them (the leader tables held past ``bound``, a schema dropped
        between two steps): then nothing was claimed, and the caller claims them one at a
        time, where a failure costs only its cluster."""
        ordered = sorted(set(schemas))
        found: dict[str, Claim | ClaimRefused | None] = dict.fromkeys(ordered)
        if not ordered:
            return found
        async with (
            door.translated("claiming clusters"),
            self._session.transaction(self._left()),
        ):
            # Every lock wait of the transaction, the barrier's above all, has the bound.
            await self._run(st.set_local_lock_timeout, {"ms": str(max(1, round(bound * 1000)))})
            rows = await self._run(control.claim_many, {"group": self._group, "schemas": ordered})
            present = {}
            for row in rows:
                if row.schema_oid is None:
                    found[row.schema_name] = ClaimRefused(
                        row.schema_name, f"schema {row.schema_name!r} does not exist"
                    )
                else:
                    present[int(row.schema_oid)] = row
            if not present:
                return found
            tried = await self._run(control.try_leader_locks, {"oids": list(present)})
            kept = sorted(
                (present[int(t.oid)] for t in tried if t.taken), key=lambda r: r.schema_name
            )
            if not kept:
                return found
            claims = st.hosted_claims([r.schema_name for r in kept])
            await self._run(claims.barrier, options=claims.options)
            params = claims.terms_params(self._group, [int(r.incarnation) for r in kept])
            bumped = {
                int(t.slot): int(t.epoch)
                for t in await self._run(claims.terms, params, options=claims.options)
            }
            await self._run(claims.prune, options=claims.options)
            for slot, row in enumerate(kept):
                epoch = bumped.get(slot)
                found[row.schema_name] = (
                    _gone(row.schema_name, int(row.incarnation), self._group)
                    if epoch is None
                    else Claim(row.schema_name, epoch, int(row.incarnation), int(row.schema_oid))
                )
            if bumped:
                owned = [kept[slot].schema_name for slot in bumped]
                await self._run(
                    control.set_owners,
                    {
                        "group": self._group,
                        "me": self.process_id,
                        "schemas": owned,
                        "epochs": list(bumped.values()),
                    },
                )
        return found

    async def leader_rows(self, schemas: list[str]) -> dict[str, tuple[int, int] | None]:
        """Each of ``schemas``'s leader row now (epoch, incarnation), ``None`` where the
        schema holds no leader table: the sweep's read (:mod:`cronoq_store._host.host`)."""
        missing = (await self._run(control.missing_leaders, {"schemas": schemas})).scalars()
        found: dict[str, tuple[int, int] | None] = dict.fromkeys(missing)
        present = [s for s in schemas if s not in found]
        if present:
            for row in await self._run(control.leader_rows(present)):
                found[str(row.schema)] = (int(row.epoch), int(row.tableoid))
        return found

    async def refuse(self, schema: str, why: str) -> None:
        """Record on ``schema``'s control row why no process may lead it as it stands."""
        await self._run(control.mark_refused, {"group": self._group, "schema": schema, "why": why})

    async def release(self, schema: str) -> None:
        """Give ``schema`` up: unowned, released by this process (if it still owns it)."""
        await self._run(
            control.release_cluster,
            {"group": self._group, "schema": schema, "me": self.process_id},
        )

    async def leave(self) -> None:
        """Mark this process left and its clusters unowned, in one transaction: it leads
        nothing and never will under this id (a term it still had is fenced by the next
        claim's epoch, as after any death)."""
        await self.bury([self.process_id])

    async def orphan_left(self) -> list[str]:
        """Free the clusters still owned by processes that left; their names."""
        rows = await self._run(control.orphan_left)
        return [str(r.schema_name) for r in rows]

    async def close(self) -> None:
        """End the session; the server frees the process lock with it."""
        await self._session.close()


def _gone(schema: str, incarnation: int, group: str) -> ClaimRefused:
    """A claim that found no leader row to bump: the schema holds another cluster now,
    or the cluster left the group."""
    return ClaimRefused(
        schema,
        f"schema {schema!r} no longer holds the cluster enrolled (incarnation "
        f"{incarnation}), or it left host group {group!r}",
    )
