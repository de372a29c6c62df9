"""``PgHost``: one process leading any number of cluster schemas, with others sharing them.

The processes of a host group share the clusters enrolled in the group: each process
holds one host session (:mod:`cronoq_store._host.session`) and a pool, whatever the number
of clusters it leads, and the server's lock table holds one entry per process. Every
``lock_poll`` each process looks at the group: processes whose lock is free are dead and
their clusters unowned; then it gives up what it holds beyond its share
(:mod:`cronoq_store._host.balance`), or claims unowned clusters up to it. Each claim bumps
the cluster's epoch as a standalone takeover does, so each cluster stays fenced on its own:
no commit of an earlier owner lands after a claim, whichever process it comes from.

For each cluster it leads, the host gives the application a :class:`HostedStore`: today's
``PgStore`` API (epoch, ``recover``, ``commit``, ``GroupCommitter``, ``leadership_lost``),
one object per term. Its commits go through the host's commit bus
(:mod:`cronoq_store._host.bus`), several clusters' in one transaction, each fenced by its
own epoch.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, TypeVar

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from .. import _door as door
from .. import _migrations as migrations
from .. import _queries as queries
from .. import _statements as st
from .._config import PgStoreConfig, validate_schema_name
from .._domain import TimeBase
from .._errors import (
    ClusterReplacedError,
    FencedError,
    LockHeldError,
    StoreError,
    UnavailableError,
)
from .._leadership import cool_down, session_settings
from .._results import Health, LockHolder, Recovered
from .._retry import acquisition_backoff, bounded, pause
from .._schema import schema_options
from .._store import PgStore
from .._urls import redact, resolve
from ..telemetry import DISABLED, resolve_group
from . import balance, control
from .bus import CommitBus
from .move import ARRIVING_MARK, MOVED, MOVED_MARK, MOVING, MOVING_MARK, move_state, refusal
from .pace import ClaimPace
from .session import Claim, ClaimRefused, HostSession

__all__ = ["HostedStore", "PgHost", "PgHostConfig"]

logger = logging.getLogger("cronoq_store")

_T = TypeVar("_T")

#: Unowned clusters read at a time when looking for some to claim.
_CANDIDATES = 1024
#: The pause between two tries of a cluster's leader lock when enrolling it.
_ENROLL_RETRY = 0.05
#: Clusters claimed in one transaction: one commit, and a round trip per step, for all.
_CLAIMS_PER_TRANSACTION = 16
#: Led clusters whose leader rows the sweep reads each tick.
_SWEEP_SLICE = 32
#: Seconds a row of a process that left is kept: a day to look up a process that a log line,
#: or a leadership term's application name, mentions.
_LEFT_KEPT = 86_400.0
#: Seconds between two prunes of such rows by one process, and the rows one prune deletes at
#: most: a short statement now and then, whatever the group's churn.
_PRUNE_LEFT_EVERY = 60.0
_PRUNE_LEFT_ROWS = 100


@dataclass(frozen=True, slots=True)
class PgHostConfig:
    """Host settings. ``store`` gives what each hosted cluster's store uses (``lock_poll``,
    ``keepalive``, ``session_timeout``, ``commit_timeout``, ``retention``, the trusted
    triggers and roles); its ``schema`` and ``max_connections`` are not used."""

    store: PgStoreConfig = field(default_factory=PgStoreConfig)
    #: Processes of one group share its clusters; several groups may share a database.
    group: str = "default"
    #: The schema of the host groups' control tables, one per database.
    control_schema: str = "cronoq_host"
    #: The pool shared by every cluster this process leads. Commits take half of it, each
    #: connection writing the commits of several clusters in one transaction; clusters
    #: gained together recover on all but one of the rest at once, and reads take the
    #: last: with 8, 4 lanes, 3 recoveries and 1 read.
    max_connections: int = 8
    #: At most this many commits, of any clusters, share one transaction (one WAL flush).
    clusters_per_commit: int = 16
    #: Prepared statements each pooled session keeps (with its own pool, :meth:`PgHost.connect`):
    #: a commit session serves its share of the clusters, a few statements each. Each costs
    #: the server from 16 KiB (an epoch check) to 200-500 KiB (a fenced insert or update of
    #: tasks) while kept (PostgreSQL 18, `pg_backend_memory_contexts`); one not kept is
    #: prepared again at each use. The
    #: commit bus's lanes keep as many of their own (two per cluster: its epoch check and
    #: its staged insert); with 0 they stage nothing.
    statement_cache: int = 1024
    #: At most this many clusters handed over at once when giving up a share.
    max_releases: int = 16
    #: How long the application's ``lead`` may take to return once its cluster is lost,
    #: before it is cancelled.
    handover_grace: float = 10.0
    #: Seconds a new process waits before claiming unowned clusters, so that processes
    #: started together share them instead of the first taking all (default
    #: ``2 * lock_poll + 1``).
    join_settle: float | None = None
    #: The label of this host's database when one process leads several: a
    #: ``MultiDatabaseHost`` sets it to each database's, and the host's telemetry records
    #: it as ``cronoq.host.database``, so one group's series stay apart per database.
    database: str | None = None

    def __post_init__(self) -> None:
        validate_schema_name(self.control_schema)
        if not self.group or "\x00" in self.group or len(self.group.encode()) > 63:
            raise ValueError("group: 1 to 63 bytes, no NUL")
        if self.max_connections < 1:
            raise ValueError("max_connections: at least 1")
        if self.clusters_per_commit < 1:
            raise ValueError("clusters_per_commit: at least 1")
        if self.statement_cache < 0:
            raise ValueError("statement_cache: not negative")
        if self.max_releases < 1:
            raise ValueError("max_releases: at least 1")
        if self.handover_grace < 0:
            raise ValueError("handover_grace: not negative")
        if self.database is not None and (not self.database or "\x00" in self.database):
            raise ValueError("database: not empty, no NUL")

    @property
    def settle(self) -> float:
        """Seconds a new process waits before claiming: ``join_settle``, or its default."""
        return cool_down(self.store) if self.join_settle is None else self.join_settle


def pool_split(max_connections: int) -> tuple[int, int]:
    """How a host's pool of ``max_connections`` is shared: ``(lanes, recoveries)``.

    The commit bus keeps half of it as lanes, each writing several clusters' commits per
    transaction; the clusters the host gains together recover at once on all but one of
    the rest, so their recoveries never wait at the pool for a lane's connection (past the
    pool's timeout they failed, and their clusters were handed over), and the last one is
    left to the application's reads. With a pool of 8: 4 lanes, 3 recoveries, 1 read.
    Below 3 the lanes are not held (``CommitBus``'s ``hold``): commits, one recovery and
    reads share what there is, each taking a connection only while it works.
    """
    lanes = max(1, max_connections // 2)
    return lanes, max(1, max_connections - lanes - 1)


class _Term:
    """One hosted term of one cluster: what its :class:`HostedStore` reads before each
    commit, and ends when a commit finds the fence moved (``LeaderTerm``)."""

    def __init__(
        self, epoch: int, process_id: int, ended: Callable[[], None], control_schema: str
    ) -> None:
        self._epoch: int | None = epoch
        self._key = (control.LOCK_NS_HOST, process_id)
        #: Where the cluster's owner is recorded (``HostedStore.health``).
        self.control_schema = control_schema
        self._lost = asyncio.Event()
        self._ended = ended
        self.reason: str | None = None
        #: time.monotonic() when the term ended.
        self.ended_at = 0.0
        self.replaced: ClusterReplacedError | None = None
        self.telemetry = DISABLED

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def is_leader(self) -> bool:
        return self._epoch is not None

    @property
    def lock_key(self) -> tuple[int, int]:
        """The lock whose holding keeps this cluster led: the host process's."""
        return self._key

    def mark_lost(self, reason: str = "fenced") -> None:
        if self._epoch is None:
            return
        self._epoch, self.reason, self.ended_at = None, reason, time.monotonic()
        self.telemetry.step_down(reason)
        self._lost.set()
        self._ended()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def acquire(self) -> int:
        if self._epoch is None:
            raise FencedError(
                "this hosted term ended: the host hands a new store when it leads the cluster again"
            )
        return self._epoch

    async def release(self) -> None:
        self.mark_lost("released")

    async def close(self) -> None:
        """The host, not the store, ends the term."""


class HostedStore(PgStore):
    """A cluster led by a :class:`PgHost`, for one term: ``PgStore``'s API on the host's
    pool. ``acquire_leadership`` returns this term's epoch, or raises ``FencedError`` once
    it ended (the host hands a new store when it leads the cluster again);
    ``release_leadership`` hands the cluster over; ``close`` leaves the host's pool open.
    ``recover`` takes its turn: a few recover at once (``PgHostConfig.max_connections``),
    so the commits of the clusters the host leads already keep their lanes; it waits
    ``commit_timeout`` at most for a lock on the cluster's tables, so that one cluster an
    operator locked holds no turn for longer.
    """

    def __init__(self, *args: Any, recoveries: RecoveryTurns, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recoveries = recoveries
        self._recovery_lock_wait = self._config.commit_timeout

    async def recover(self, base: TimeBase) -> Recovered:
        """``PgStore.recover``, taking its turn among the host's recoveries: a host gains
        clusters many at a time, and their recoveries at once would hold every pooled
        connection, failing the commits of the clusters it leads already and the
        recoveries queued past the pool's timeout."""
        async with self._recoveries.turn():
            return await super().recover(base)

    async def health(self) -> Health:
        """``PgStore.health()``, its leader the one a hosted cluster has, as ``cronoq-store
        health`` reads it: ``holder`` is the session holding the process lock of the owner
        the control schema records, a store instance when it is that process's own host
        session. So ``has_leader`` holds exactly while a live host process owns the
        cluster, whichever it is (this store's term may have ended), and ``holder`` is
        ``None`` while none does. A session on the cluster's standalone key (it blocks
        every claim; health exit 7) stays the ``holder``, a ``foreign_holder``, unless it
        is the owner's host session claiming. ``hosted_by`` names the group."""
        found = await super().health()
        term, group = self._leadership, found.hosted_by
        if group is None or not isinstance(term, _Term):
            return found  # removed from the group meanwhile: a standalone cluster's facts
        schema = self.config.schema
        async with self._translated("reading health"):
            owner = await self._read(
                lambda conn: _owner_holder(conn, term.control_schema, group, schema)
            )
        standalone = found.holder
        if standalone is not None and (owner is None or standalone.pid != owner.pid):
            return found
        return replace(found, holder=owner)


async def _owner_holder(
    conn: AsyncConnection, control_schema: str, group: str, schema: str
) -> LockHolder | None:
    """The session holding the process lock of ``schema``'s owner in ``group``, a store
    instance when it is the session that process registered with; ``None`` when nobody
    owns the cluster or the owner's lock is free (the process is gone)."""
    row = (
        await conn.execute(
            control.owner_of,
            {"group": group, "schema": schema},
            execution_options=control.control_options(control_schema),
        )
    ).first()
    if row is None:
        return None
    holder = await queries.leader_lock_holder(conn, (control.LOCK_NS_HOST, int(row.owner)))
    if holder is None:
        return None
    return replace(holder, store_instance=holder.pid == row.backend_pid)


async def _not_enrollable(conn: AsyncConnection, schema: str, control_schema: str) -> str:
    """Why the leader row of ``schema`` kept the group's mark off: another group's, or a
    ``host move``'s mark, which no group can be named; then the move's note in the control
    schema (``moving to …``, ``moved to …``, its target's URL, password hidden) says where."""
    row = (await conn.execute(st.leader_enrolment, execution_options=schema_options(schema))).one()
    if row.host_group not in (MOVING_MARK, MOVED_MARK, ARRIVING_MARK):
        return "it is enrolled in another host group"
    if row.host_group == ARRIVING_MARK:
        return (
            "it is a copy a move is bringing to this database, not enrolled yet: run the move "
            "again to finish it (`cronoq-store host move`)"
        )
    found = (
        await conn.execute(
            control.cluster_host,
            {"schema": schema},
            execution_options=control.control_options(control_schema),
        )
    ).first()
    note = None if found is None else found.refused_why
    if row.host_group == MOVING_MARK:
        return (
            f"it is being moved ({note or 'its control row is gone'}): finish or resume the "
            "move first (`cronoq-store host move`)"
        )
    return (
        f"it was {note or 'moved to another database'}, and this copy is the move's "
        "tombstone: enroll it where it went, or drop this schema to enroll a new cluster "
        "under its name"
    )


class RecoveryTurns:
    """The recoveries a host runs at once. A wait for a turn fails with
    ``UnavailableError`` once no turn has ended for ``stall`` seconds (``commit_timeout``):
    recoveries that stopped moving (a silent path) would otherwise keep every cluster
    gained after them waiting, neither recovered nor handed over to another process."""

    def __init__(self, turns: int, stall: float) -> None:
        self._free = asyncio.Semaphore(turns)
        self._stall = stall
        self._ended_at = time.monotonic()
        #: Recoveries waiting for a turn or running: the host claims no more ahead of them
        #: than its claim window (:mod:`cronoq_store._host.pace`).
        self.pending = 0

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        self.pending += 1
        try:
            while True:
                try:
                    await bounded(self._free.acquire(), self._stall, discard=self._give_back)
                    break
                except asyncio.TimeoutError:
                    if time.monotonic() - self._ended_at >= self._stall:
                        raise UnavailableError(
                            f"recovering failed: no recovery of this host ended within "
                            f"commit_timeout ({self._stall} s)"
                        ) from None
            try:
                yield
            finally:
                self._ended_at = time.monotonic()
                self._free.release()
        finally:
            self.pending -= 1

    async def _give_back(self, _taken: bool) -> None:
        """A turn taken as the wait for it ran out: nobody has it."""
        self._free.release()


@dataclass(slots=True)
class _Led:
    """A cluster this process owns in the control schema: its store, its term, the epoch
    it claimed (still owned after the term ended, until released), the application's task."""

    store: HostedStore
    term: _Term
    epoch: int
    task: asyncio.Task[None] | None = None


class PgHost:
    """Leads many clusters with a few connections, sharing them with the group's other
    processes (see the module's docstring). Open with :meth:`connect` or
    :meth:`from_engine`, enroll clusters with :meth:`enroll`, then :meth:`serve`."""

    def __init__(
        self,
        engine: AsyncEngine,
        config: PgHostConfig,
        *,
        owns_engine: bool,
        lock_engine: AsyncEngine,
        settings: dict[str, str],
        apply_settings: bool,
        instance: str,
    ) -> None:
        self._engine = engine
        self._config = config
        self._owns_engine = owns_engine
        # Sessions that may carry settings that are not the store's, as for a PgStore: an
        # application's (any search_path, role, timeouts), or a transaction-pooling
        # PgBouncer's. Each of the host's transactions there opens with the store's own
        # (:meth:`_transaction`); the host's own pool's sessions carry them from connect.
        borrowed = not owns_engine or not config.store.prepared_statements
        self._opening = _opening(engine, door.idle_in_transaction_ms(config.store), borrowed)
        self._read_opening = _opening(engine, st.IDLE_LIMIT_MS, borrowed)
        self._lock_engine = lock_engine
        self._settings = settings
        self._apply_settings = apply_settings
        #: This process's id, at the end of its host session's ``application_name``.
        self.instance = instance
        self._led: dict[str, _Led] = {}
        # Clusters whose term ended and that this process has not released yet.
        self._ending: set[str] = set()
        # When this process last gave each cluster up: not claimed again within cool_down.
        self._gave_up: dict[str, float] = {}
        self._lead: Callable[[HostedStore], Awaitable[None]] | None = None
        self._closing = asyncio.Event()
        # The close, once begun: each call of close() waits for this one.
        self._closed: asyncio.Task[None] | None = None
        # Enrolments and removals under way on the pool: the close waits for them before it
        # disposes it, as a connection they take after would come from a new pool.
        self._calls = 0
        self._no_calls = asyncio.Event()
        self._no_calls.set()
        self._wake = asyncio.Event()
        self._session: HostSession | None = None
        self._runner: asyncio.Task[None] | None = None
        self._joined_at = 0.0
        self._seen_unowned: set[str] = set()
        # Where the sweep of leader rows goes on at the next tick.
        self._sweep_at = 0
        # time.monotonic() of the last look for other processes' stuck sessions.
        self._stuck_checked_at = 0.0
        # time.monotonic() of the last prune of the rows of processes that left.
        self._pruned_left_at = -_PRUNE_LEFT_EVERY
        # Tasks that cancel the application's overdue leads and close their stores.
        self._reapers: set[asyncio.Task[None]] = set()
        lanes, recoveries = pool_split(config.max_connections)
        # Recoveries at once: those of clusters gained together never take the lanes'
        # connections, nor the last one, which the application's reads need.
        self._recoveries = RecoveryTurns(recoveries, config.store.commit_timeout)
        # How many clusters a balancing round may claim, by how late the keeper wakes.
        self._pace = ClaimPace(config.store.session_timeout, _CLAIMS_PER_TRANSACTION, _CANDIDATES)
        # One recorder for every cluster this process leads, labelled with the group (and
        # the database's label): the global providers' label sets stay as few as the groups
        # times the databases, whatever the clusters.
        self._telemetry = resolve_group(config.group, config.database)
        # Every hosted store's commits; an application's pool is not the host's to hold
        # connections of, as for a PgStore.
        self._bus = CommitBus(
            engine,
            lanes=lanes,
            hold=owns_engine and config.max_connections >= 3,
            group_size=config.clusters_per_commit,
            timeout=config.store.commit_timeout,
            prepared=config.statement_cache,
        )

    # --- construction -----------------------------------------------------------------

    @classmethod
    async def connect(cls, url: str | URL, config: PgHostConfig | None = None) -> PgHost:
        """A host with its own pool of ``max_connections`` on ``url``, and its host session
        dialled from it; the control schema is migrated first."""
        config = config or PgHostConfig()
        store = replace(config.store, max_connections=config.max_connections)
        engine = door.own_engine(url, store, statement_cache=config.statement_cache)
        try:
            await _require_utf8(engine)
            await control.prepare_control(engine, config.control_schema)
            instance = secrets.token_hex(4)
            settings, lock_engine = _dialled_host_session(url, config.store, instance)
        except BaseException:
            await engine.dispose()
            raise
        return cls(
            engine,
            config,
            owns_engine=True,
            lock_engine=lock_engine,
            settings=settings,
            apply_settings=False,
            instance=instance,
        )

    @classmethod
    async def from_engine(
        cls,
        engine: AsyncEngine,
        config: PgHostConfig | None = None,
        *,
        lock_url: str | URL | None = None,
    ) -> PgHost:
        """A host on an application's ``AsyncEngine`` (asyncpg), sharing its pool:
        ``max_connections`` does not size it (it still sets the commit lanes and the
        recoveries at once), and :meth:`close` leaves the engine open. Each transaction of
        the host and its stores there opens with the store's own settings, for itself
        alone: the application's sessions keep theirs, and a ``search_path`` of theirs
        reaches no statement of ours (docs/reliability.md, "Borrowed sessions").
        The host session is dialled from ``lock_url`` when given (a direct server URL, as
        for ``PgStore.from_engine``), else made as the engine makes its own connections, on
        a pool of its own that hands out none of the application's sessions."""
        config = config or PgHostConfig()
        if engine.dialect.driver != "asyncpg":
            raise ValueError(
                f"engine: the host needs the asyncpg driver (postgresql+asyncpg://), got "
                f"{engine.dialect.name}+{engine.dialect.driver}"
            )
        # The host session holds the process lock every hosted cluster's fence rests on.
        await door.refuse_unsafe_lock_session(
            engine,
            prepared_statements=config.store.prepared_statements,
            lock_url=lock_url,
            borrowed=True,
        )
        await _require_utf8(engine)
        await control.prepare_control(engine, config.control_schema)
        instance = secrets.token_hex(4)
        if lock_url is None:
            settings = session_settings(config.store, instance, config.store.application_name)
            lock_engine = door.borrowed_lock_engine(engine.url, engine.sync_engine.pool.recreate())
        else:
            settings, lock_engine = _dialled_host_session(lock_url, config.store, instance)
        return cls(
            engine,
            config,
            owns_engine=False,
            lock_engine=lock_engine,
            settings=settings,
            apply_settings=lock_url is None,
            instance=instance,
        )

    def _refuse_closed(self) -> None:
        """Refuse work once :meth:`close` began: its pool is disposed (a disposed engine
        makes a new pool, whose connections no one would close)."""
        if self._closing.is_set():
            raise StoreError("this host is closed")

    @asynccontextmanager
    async def _call(self) -> AsyncIterator[None]:
        """An enrolment or a removal: refused once :meth:`close` began, which waits for
        those under way before it closes the pool."""
        self._refuse_closed()
        self._calls += 1
        self._no_calls.clear()
        try:
            yield
        finally:
            self._calls -= 1
            if not self._calls:
                self._no_calls.set()

    async def close(self) -> None:
        """Hand every cluster over, leave the group, and close the pool (unless it is an
        application's), once the enrolments and removals under way ended (later ones are
        refused). The close runs once: every call returns when it is done, and a caller
        that stops waiting (cancelled) leaves it going."""
        if self._closed is None:
            self._closed = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        self._closing.set()
        self._wake.set()
        for led in list(self._led.values()):
            led.term.mark_lost("closed")
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.wait({runner})
        if self._reapers:
            # Each cancels its lead at the end of its grace; one that ignores the
            # cancellation is left behind rather than holding the close forever.
            await asyncio.wait(set(self._reapers), timeout=self._config.handover_grace + 1)
        await self._no_calls.wait()
        await self._bus.close()
        await self._lock_engine.dispose()
        if self._owns_engine:
            await self._engine.dispose()

    async def __aenter__(self) -> PgHost:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"PgHost(url={redact(self._engine.url)!r}, group={self._config.group!r}, "
            f"instance={self.instance!r})"
        )

    @property
    def process_id(self) -> int | None:
        """This process's id in the group while it is registered."""
        return None if self._session is None else self._session.process_id

    def led(self) -> Mapping[str, HostedStore]:
        """The clusters this process leads now, by schema."""
        return {schema: led.store for schema, led in self._led.items() if led.term.is_leader}

    def _transaction(self, work: Callable[[AsyncConnection], Awaitable[_T]]) -> Awaitable[_T]:
        """``work`` in a transaction on the pool, under the store's settings: on an
        application's session, whose ``search_path`` may put first a schema another role
        writes (its operators would run as us), the transaction opens with the store's own,
        for itself alone (:func:`_opening`); a session the application reset (``DISCARD
        ALL``) runs it again (:func:`~cronoq_store._door.run_transaction`). On the host's
        own pool, SQLAlchemy's ``BEGIN``: its sessions carry them from connect."""
        return door.run_transaction(self._engine, self._opening, work)

    # --- enrolment --------------------------------------------------------------------

    async def enroll(self, schemas: str | Iterable[str], *, migrate: bool = True) -> list[str]:
        """Put clusters in this host group: migrated first (or checked at head with
        ``migrate=False``), then marked as the group's in their own leader row and listed
        in the control schema. A cluster a standalone ``PgStore`` leads is refused with
        ``LockHeldError`` naming it; one already in this group is left as it is. Returns
        the schemas newly enrolled. Once :meth:`close` began, raises ``StoreError`` before
        the next schema."""
        self._refuse_closed()
        names = [schemas] if isinstance(schemas, str) else list(schemas)
        for name in names:
            validate_schema_name(name)
            if name == self._config.control_schema:
                raise ValueError(f"schema {name!r} is the host's control schema, not a cluster")
        added = []
        for schema in names:
            async with self._call():
                if await self._enroll_one(schema, migrate):
                    added.append(schema)
        self._wake.set()
        return added

    async def _enroll_one(self, schema: str, migrate: bool) -> bool:
        store = self._config.store
        in_control = schema_options(self._config.control_schema)

        async def read_move(conn: AsyncConnection) -> Any:
            found = await conn.execute(move_state, {"schema": schema}, execution_options=in_control)
            return found.first()

        # Before the migration, which would make an empty schema where a move dropped the
        # source: checked again below, with the control row locked.
        async with door.translated(f"enrolling schema {schema!r}"):
            moved = await self._transaction(read_move)
        if moved is not None:
            raise StoreError(refusal(schema, moved.state, moved.refused_why))
        if migrate:
            await migrations.upgrade(
                self._engine,
                schema,
                trusted_triggers=store.trusted_triggers,
                lock_timeout=store.migration_lock_timeout,
            )
        else:
            await migrations.require_head(
                self._engine,
                schema,
                trusted_triggers=store.trusted_triggers,
                opening=self._read_opening,
            )
        async with door.translated(f"enrolling schema {schema!r}"):
            return await self._transaction(lambda conn: self._enroll_in(conn, schema))

    async def _enroll_in(self, conn: AsyncConnection, schema: str) -> bool:
        """Enroll ``schema`` in ``conn``'s transaction: its leader row marked as the group's
        under its leader lock, its control row added (or made current); whether it was new."""
        in_control = schema_options(self._config.control_schema)
        group = self._config.group
        oid = (await conn.execute(st.schema_oid, {"schema": schema})).scalar()
        incarnation = (
            await conn.execute(st.leader_now, execution_options=schema_options(schema))
        ).first()
        if oid is None or incarnation is None:
            raise StoreError(f"schema {schema!r} holds no migrated cluster")
        await self._take_leader_lock(conn, schema, int(oid))
        marked = (
            await conn.execute(
                st.enroll_cluster,
                {"group": group, "incarnation": int(incarnation.tableoid)},
                execution_options=schema_options(schema),
            )
        ).first()
        if marked is None:
            why = await _not_enrollable(conn, schema, self._config.control_schema)
            raise StoreError(f"enrolling schema {schema!r} failed: {why}")
        moved = (
            await conn.execute(move_state, {"schema": schema}, execution_options=in_control)
        ).first()
        if moved is not None:
            raise StoreError(refusal(schema, moved.state, moved.refused_why))
        row = {"group": group, "schema": schema, "incarnation": int(incarnation.tableoid)}
        added = (await conn.execute(control.enroll, row, execution_options=in_control)).first()
        if added is None:
            raise UnavailableError(
                f"enrolling schema {schema!r} failed: another enrolment of it committed "
                "meanwhile; enroll it again",
                reconnect=False,
            )
        if added.inserted:
            return True
        if added.host_group != group:
            raise StoreError(
                f"enrolling schema {schema!r} failed: it is enrolled in host group "
                f"{added.host_group!r}"
            )
        # Listed already. Made again under its name since: enrolling again is the
        # operator's word that the cluster standing there now is the group's, unowned
        # until claimed. Refused: the operator cleared the cause, so it is claimed again.
        # Listed as it stands, led or not: nothing changes (every process of a group may
        # enroll the same clusters at its start).
        again = control.reenroll if added.incarnation != row["incarnation"] else control.mark_active
        await conn.execute(again, row, execution_options=in_control)
        return False

    async def _take_leader_lock(self, conn: AsyncConnection, schema: str, oid: int) -> None:
        """Take the cluster's standalone leader lock for the enrolment's transaction, trying
        for up to ``lock_poll`` plus a second (a host's claim, or another enrolment, holds
        it a moment); then ``LockHeldError`` naming the session that holds it."""
        lock = {"k1": st.LOCK_NS_LEADER, "k2": oid}
        deadline = time.monotonic() + self._config.store.lock_poll + 1.0
        while not (await conn.execute(st.try_leader_lock_for_transaction, lock)).scalar():
            if time.monotonic() >= deadline:
                holder = await queries.leader_lock_holder(conn, (st.LOCK_NS_LEADER, oid))
                who = "a session" if holder is None else door.describe_holders([holder])
                raise LockHeldError(
                    f"enrolling schema {schema!r} failed: its leader lock is held by {who} "
                    "(a standalone leader, a downgrade, or a claim that did not end); stop "
                    "it first",
                    [] if holder is None else [holder],
                )
            await asyncio.sleep(_ENROLL_RETRY)

    async def remove(self, schema: str) -> bool:
        """Take ``schema`` out of this host group, fencing whichever process leads it: the
        epoch is bumped (after the commits in flight, as a takeover waits for them), so no
        later commit of the group lands, and its owner steps the cluster down at its next
        check. A standalone ``PgStore`` may lead it from then on. Whether it was enrolled.

        A cluster ``host move`` froze (``moving``) is refused with ``StoreError``: its row is
        what the move resumes from, and without it the cluster stays frozen for good. A
        ``moved`` row (the source's tombstone) is deleted and nothing else done: its leader
        row keeps the move's mark, so nothing leads that copy, and a move back into this
        database needs the name free in the control schema."""
        self._refuse_closed()
        validate_schema_name(schema)
        async with self._call(), door.translated(f"removing schema {schema!r}"):
            removed = await self._transaction(lambda conn: self._remove_in(conn, schema))
        self._wake.set()
        return removed

    async def _remove_in(self, conn: AsyncConnection, schema: str) -> bool:
        """Take ``schema`` out of the group in ``conn``'s transaction (:meth:`remove`)."""
        group = self._config.group
        bound = self._config.store.commit_timeout
        in_cluster = schema_options(schema)
        removed = (
            await conn.execute(
                control.remove,
                {"group": group, "schema": schema},
                execution_options=schema_options(self._config.control_schema),
            )
        ).first()
        if removed is None:
            return False
        if removed.state == MOVING:
            # Raised inside the transaction: the row stays.
            raise StoreError(
                f"schema {schema!r} is being moved ({removed.refused_why}): finish or "
                "resume the move first (`cronoq-store host move`, same --to); removed "
                "now, it would stay frozen with no move to resume"
            )
        if removed.state == MOVED:
            return True  # a tombstone: its leader row's mark keeps every leader off
        if (await conn.execute(st.schema_oid, {"schema": schema})).scalar() is None:
            return True  # nothing left to fence
        await door.leader_barrier(
            lambda statement, params: conn.execute(statement, params, execution_options=in_cluster),
            schema,
            bound,
            "removing a cluster from its host group (the bound is commit_timeout)",
        )
        row = (await conn.execute(st.leader_now, execution_options=in_cluster)).first()
        if row is not None:
            await conn.execute(
                st.take_hosted_epoch,
                {"incarnation": int(row.tableoid), "group": group},
                execution_options=in_cluster,
            )
        await conn.execute(st.unenroll_cluster, {"group": group}, execution_options=in_cluster)
        return True

    # --- serving ----------------------------------------------------------------------

    async def serve(self, lead: Callable[[HostedStore], Awaitable[None]]) -> None:
        """Lead the group's share of clusters until :meth:`close`: ``lead(store)`` runs in a
        task of its own for each cluster gained. Once the cluster is lost,
        ``store.leadership_lost()`` returns and ``lead`` has ``handover_grace`` seconds to
        return before it is cancelled. An exception from ``lead`` is logged and the cluster
        handed over; returning while still leading hands it over too. Raises once
        :meth:`close` began (it would return at once, leading nothing)."""
        self._refuse_closed()
        if self._lead is not None:
            raise StoreError("this host is already serving")
        self._lead = lead
        self._runner = asyncio.ensure_future(self._run())
        try:
            await self._closing.wait()
        finally:
            if not self._closing.is_set():
                await self.close()

    async def _run(self) -> None:
        """Register, tend the group until the session is lost, register again."""
        config = self._config.store
        delays = acquisition_backoff(config).delays()
        while not self._closing.is_set():
            try:
                self._session = await HostSession.register(
                    self._lock_engine,
                    config,
                    self._config.control_schema,
                    self._config.group,
                    self.instance,
                    self._settings if self._apply_settings else None,
                )
            except Exception as error:
                logger.warning(
                    "cannot register the host process for now; retrying",
                    extra={"group": self._config.group, "error": str(error)},
                    exc_info=not isinstance(error, (StoreError, asyncio.TimeoutError, OSError)),
                )
                await pause(next(delays), self._closing)
                continue
            delays = acquisition_backoff(config).delays()
            self._joined_at = time.monotonic()
            self._pace.restart()
            logger.info(
                "host process registered",
                extra={"group": self._config.group, "process_id": self._session.process_id},
            )
            try:
                await self._tend(self._session)
            except Exception as error:
                logger.error(
                    "host session lost; stepping every cluster down",
                    extra={"group": self._config.group, "error": str(error)},
                    exc_info=not isinstance(error, (StoreError, asyncio.TimeoutError, OSError)),
                )
            finally:
                await self._end_all("session_lost")
                self._abandon_all()
                session, self._session = self._session, None
                if session is not None:
                    if self._closing.is_set():
                        await self._leave(session)
                    await session.close()

    def _abandon_all(self) -> None:
        """Forget every cluster of a session that is gone: the others claim them once they
        see this process's lock free, and a release under the next session's id would be
        no one's. Each application task still running gets ``handover_grace``, then it is
        cancelled, without the keeper ever waiting on it."""
        for led in self._led.values():
            self._reap(led)
        self._led.clear()
        self._ending.clear()

    def _reap(self, led: _Led) -> None:
        """Cancel ``led``'s application task once ``handover_grace`` has run out since its
        term ended, in a task of its own (never awaited by the keeper); close its store."""
        task = led.task
        grace = max(0.0, led.term.ended_at + self._config.handover_grace - time.monotonic())

        async def reap() -> None:
            if task is not None and not task.done():
                await asyncio.wait({task}, timeout=grace)
                if not task.done():
                    logger.warning(
                        "the application's lead did not return within handover_grace; "
                        "cancelling it",
                        extra={"schema": led.store.config.schema},
                    )
                    task.cancel()
            await led.store.close()

        reaper = asyncio.ensure_future(reap())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)

    async def _leave(self, session: HostSession) -> None:
        try:
            await session.leave()
        except Exception as error:
            logger.warning("leaving the host group failed", extra={"error": str(error)})

    async def _tend(self, session: HostSession) -> None:
        """The keeper and the balancer on one session, until it fails or the host closes."""
        config = self._config.store
        tick = min(config.keepalive, config.lock_poll)
        next_look = 0.0
        loop = asyncio.get_running_loop()
        while not self._closing.is_set():
            try:
                await self._check_owned(session)
                await self._sweep(session)
                await self._release_ended(session)
                now = time.monotonic()
                if now >= next_look:
                    next_look = now + config.lock_poll
                    await self._balance(session)
                    await self._prune_left(now)
            except StoreError as error:
                if session.broken:
                    raise
                # The server answered (a lock wait ran out, a statement failed): this
                # round is lost, the session and every term go on.
                logger.warning(
                    "a round of the host's checks failed; trying again",
                    extra={"group": self._config.group, "error": str(error)},
                )
            self._wake.clear()
            slept_at = loop.time()
            if not await pause(tick, self._wake):
                self._pace.woke(max(0.0, loop.time() - slept_at - tick))
        await self._end_all("closed")
        await self._release_ended(session, wait=True)

    async def _check_owned(self, session: HostSession) -> None:
        """Step down at once each cluster the control schema no longer gives this process
        under the epoch it claimed (another process claimed it after this one was taken
        for dead, or an operator moved it). One round trip when nothing changed: only
        others take a cluster from this process, and epochs only grow, so the count and
        the sum of epochs of what it owns move with any change."""
        count, total = await session.digest()
        if count == len(self._led) and total == sum(led.epoch for led in self._led.values()):
            return
        owned = await session.owned()
        for schema, led in list(self._led.items()):
            row = owned.get(schema)
            if led.term.is_leader and (row is None or row.epoch != led.epoch):
                logger.error(
                    "a hosted cluster was taken from this process; stepping it down",
                    extra={"schema": schema, "epoch": led.epoch},
                )
                led.term.mark_lost("fenced")

    async def _sweep(self, session: HostSession) -> None:
        """Read the leader rows of the next slice of led clusters, and step down each whose
        row says its term is over: the epoch moved outside the host (a forced downgrade),
        the schema holds another cluster, or none. The control schema cannot show these;
        each cluster is read every ``len(led) / _SWEEP_SLICE`` ticks, and its next commit
        is fenced meanwhile anyway."""
        leading = sorted(s for s, led in self._led.items() if led.term.is_leader)
        if not leading:
            return
        start = self._sweep_at % len(leading)
        chosen = (leading[start:] + leading[:start])[:_SWEEP_SLICE]
        self._sweep_at = start + len(chosen)
        rows = await session.leader_rows(chosen)
        for schema in chosen:
            led = self._led.get(schema)
            if led is None or not led.term.is_leader:
                continue
            row = rows.get(schema)
            incarnation = led.store.incarnation
            if row is None or row[1] != incarnation:
                led.term.replaced = ClusterReplacedError(
                    schema, incarnation, None if row is None else row[1], "checking the leader row"
                )
                reason = "schema_gone" if row is None else "cluster_replaced"
            elif row[0] != led.epoch:
                reason = "fenced"
            else:
                continue
            logger.error(
                "a hosted cluster's leader row ends its term; stepping it down",
                extra={"schema": schema, "epoch": led.epoch, "reason": reason},
            )
            led.term.mark_lost(reason)

    async def _balance(self, session: HostSession) -> None:
        me = session.process_id
        members = await session.members()
        dead = await session.dead_among([m for m in members if m != me])
        if dead:
            logger.warning(
                "host processes gone; their clusters are unowned",
                extra={"group": self._config.group, "process_ids": dead},
            )
            await session.bury(dead)
        live = [m for m in members if m not in dead]
        await self._end_stuck(session, [m for m in live if m != me])
        counts = await session.counts()
        if any(owner is not None and owner not in members for owner in counts):
            # Only members are buried: clusters a process kept past leaving are freed here.
            freed = await session.orphan_left()
            if freed:
                logger.warning(
                    "clusters owned by processes that left are unowned",
                    extra={"group": self._config.group, "clusters": len(freed)},
                )
                counts = await session.counts()
        total = sum(counts.values())
        targets = balance.targets(live, total)
        target = targets.get(me, 0)
        if self._closing.is_set():
            target = 0
        allowance = self._pace.allowance(self._recoveries.pending)
        owned = [s for s, led in self._led.items() if led.term.is_leader]
        if len(owned) > target:
            # A cluster taken from this process since the keeper's check (a move's freeze,
            # a removal) is missing from ``counts`` already, and the excess would then be
            # one this process still owns: read again what it owns, after ``counts``.
            await self._check_owned(session)
            owned = [s for s, led in self._led.items() if led.term.is_leader]
        held = len(owned) + len(self._ending)
        if len(owned) > target:
            for schema in balance.to_release(owned, me, target, self._config.max_releases):
                logger.info(
                    "handing a cluster over to balance the group",
                    extra={"schema": schema, "group": self._config.group},
                )
                self._led[schema].term.mark_lost("rebalanced")
            return
        if (
            held >= target
            or allowance == 0
            or time.monotonic() - self._joined_at < self._config.settle
        ):
            return
        if counts.get(None, 0) == 0:
            self._seen_unowned.clear()
            return
        candidates = [
            s
            for s in await session.unowned(_CANDIDATES)
            if s not in self._led and not self._cooling(s)
        ]
        deficits = {p: targets[p] - counts.get(p, 0) for p in live}
        room = min(target - held, allowance)
        chosen = balance.to_claim(candidates, me, live, deficits, room, patient=False)
        patient = [s for s in candidates if s in self._seen_unowned and s not in chosen]
        chosen += balance.to_claim(patient, me, live, deficits, room - len(chosen), patient=True)
        self._seen_unowned = set(candidates) - set(chosen)
        if chosen:
            self._pace.gained(await self._claim(session, chosen))

    async def _prune_left(self, now: float) -> None:
        """Every ``_PRUNE_LEFT_EVERY`` seconds, delete up to ``_PRUNE_LEFT_ROWS`` rows of
        processes that left the group over ``_LEFT_KEPT`` ago (:data:`control.prune_left`),
        on the pool: history only, so a failure is logged and costs no round of the
        balancing, which the host session's checks would."""
        if now - self._pruned_left_at < _PRUNE_LEFT_EVERY:
            return
        self._pruned_left_at = now
        params = {"group": self._config.group, "seconds": _LEFT_KEPT, "limit": _PRUNE_LEFT_ROWS}
        wait = {"ms": str(round(self._config.store.commit_timeout * 1000))}

        async def prune(conn: AsyncConnection) -> int:
            await conn.execute(st.set_local_lock_timeout, wait)
            pruned = await conn.execute(
                control.prune_left,
                params,
                execution_options=control.control_options(self._config.control_schema),
            )
            return len(pruned.all())

        try:
            async with door.translated("pruning left processes"):
                count = await self._transaction(prune)
        except StoreError as error:
            logger.warning(
                "pruning the rows of processes that left failed; trying again later",
                extra={"group": self._config.group, "error": str(error)},
            )
            return
        if count:
            logger.info(
                "pruned the rows of processes that left",
                extra={"group": self._config.group, "processes": count},
            )

    async def _end_stuck(self, session: HostSession, others: list[int]) -> None:
        """Every ``session_timeout``, end the host sessions of other processes stuck
        mid-statement for ``1.5 x session_timeout``: past ``session_timeout`` without an
        answer their own keepers stepped every cluster down, but the server keeps their
        locks while it waits for the rest of a message, where no idle limit applies."""
        limit = self._config.store.session_timeout
        now = time.monotonic()
        if now - self._stuck_checked_at < limit:
            return
        self._stuck_checked_at = now
        try:
            ended = await session.end_stuck(others, 1.5 * limit)
        except StoreError as error:
            if session.broken:
                raise
            logger.warning(
                "ending the host sessions of processes stuck mid-statement failed",
                extra={"group": self._config.group, "error": str(error)},
            )
            return
        if ended:
            logger.warning(
                "ended the host sessions of processes stuck mid-statement; their clusters "
                "are claimed once their locks are free",
                extra={"group": self._config.group, "pids": ended},
            )

    def _cooling(self, schema: str) -> bool:
        gave_up = self._gave_up.get(schema)
        return gave_up is not None and time.monotonic() - gave_up < cool_down(self._config.store)

    async def _claim(self, session: HostSession, schemas: list[str]) -> int:
        """Claim ``schemas``, :data:`_CLAIMS_PER_TRANSACTION` in each transaction: a round
        trip per step for all of them, and one commit. A batch that fails as a whole (a
        leader table held past the bound, a schema dropped meanwhile) is claimed again one
        cluster at a time, so that only the cluster at fault waits or is refused. Stops
        between two batches once the event loop runs late; how many were gained."""
        gained = 0
        if not schemas:
            return gained
        config = self._config.store
        refused = await session.refusals(schemas, config.trusted_triggers)
        for schema, error in refused.items():
            await self._refuse(session, schema, str(error))
        bound = max(0.001, min(config.keepalive, (config.session_timeout - config.keepalive) / 2))
        wanted = sorted(s for s in schemas if s not in refused)
        for start in range(0, len(wanted), _CLAIMS_PER_TRANSACTION):
            if self._closing.is_set():
                return gained
            # The clusters gained in the batches before load the loop already.
            if start and await self._pace.lagging():
                return gained
            batch = wanted[start : start + _CLAIMS_PER_TRANSACTION]
            try:
                outcomes = await session.claim_many(batch, bound)
            except StoreError as error:
                if session.broken:
                    raise
                logger.warning(
                    "claiming clusters together failed; claiming each alone",
                    extra={"schemas": batch, "error": str(error)},
                )
                outcomes = {}
                for schema in batch:
                    if self._closing.is_set():
                        return gained
                    outcomes[schema] = await self._claim_one(session, schema, bound)
            # Every claim that committed is gained before any refusal is recorded: a
            # refusal that fails must not leave clusters owned by this process unled.
            for claimed in outcomes.values():
                if isinstance(claimed, Claim):
                    self._gained(session, claimed)
                    gained += 1
            for schema, claimed in outcomes.items():
                if isinstance(claimed, ClaimRefused):
                    await self._refuse(session, schema, claimed.why)
        return gained

    async def _refuse(self, session: HostSession, schema: str, why: str) -> None:
        """Record that ``schema`` cannot be led as it stands. A refusal the server fails
        (a role's ``statement_timeout``, a lock) is logged and tried at the next round,
        where the cluster is still unowned: it never ends the round."""
        logger.error("refusing to lead a hosted cluster", extra={"schema": schema, "error": why})
        try:
            await session.refuse(schema, why)
        except StoreError as error:
            if session.broken:
                raise
            logger.warning(
                "recording a refusal failed; tried again at the next round",
                extra={"schema": schema, "error": str(error)},
            )

    async def _claim_one(
        self, session: HostSession, schema: str, bound: float
    ) -> Claim | ClaimRefused | None:
        """Claim ``schema`` alone; ``None`` when it waits for the next round (a lock wait
        ran out, a deadlock), a refusal when the server refused a step."""
        try:
            return await session.claim(schema, bound)
        except StoreError as error:
            if session.broken:
                raise
            if isinstance(error, UnavailableError):
                logger.warning(
                    "claiming a hosted cluster failed for now",
                    extra={"schema": schema, "error": str(error)},
                )
                return None
            return ClaimRefused(schema, str(error))

    def _gained(self, session: HostSession, claim: Claim) -> None:
        schema = claim.schema
        control_schema = self._config.control_schema
        term = _Term(claim.epoch, session.process_id, lambda: self._ended(schema), control_schema)
        store = HostedStore(
            self._engine,
            replace(self._config.store, schema=schema),
            schema_oid=claim.schema_oid,
            incarnation=claim.incarnation,
            owns_engine=False,
            own_sessions=self._owns_engine,
            lock_url=self._engine.url,
            term=term,
            telemetry=self._telemetry,
            recoveries=self._recoveries,
            carrier=self._bus,
        )
        led = _Led(store, term, claim.epoch)
        self._led[schema] = led
        logger.info(
            "leading a hosted cluster",
            extra={"schema": schema, "epoch": claim.epoch, "process_id": session.process_id},
        )
        if self._lead is not None:
            led.task = asyncio.ensure_future(self._serve_one(led))

    async def _serve_one(self, led: _Led) -> None:
        assert self._lead is not None
        try:
            await self._lead(led.store)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception(
                "the application's lead failed; handing the cluster over",
                extra={"schema": led.store.config.schema},
            )
            led.term.mark_lost("failed")
            return
        led.term.mark_lost("released")

    def _ended(self, schema: str) -> None:
        self._ending.add(schema)
        self._wake.set()

    async def _release_ended(self, session: HostSession, *, wait: bool = False) -> None:
        """Give up, in the control schema, each cluster whose term ended here, once the
        application's task for it returned or its ``handover_grace`` ran out (then it is
        cancelled, and not waited for: the next claim's epoch fences whatever it still
        sends). With ``wait`` (closing), waits out the grace for every one at once, the
        session answering every ``keepalive`` meanwhile: each statement is bounded by what
        is left of ``session_timeout`` since its last answer, and the releases would
        otherwise find the session timed out after a grace as long."""
        ending = [self._led[s] for s in sorted(self._ending) if s in self._led]
        if wait:
            running = {led.task for led in ending if led.task is not None and not led.task.done()}
            deadline = time.monotonic() + self._config.handover_grace
            while running and (left := deadline - time.monotonic()) > 0:
                _, running = await asyncio.wait(
                    running, timeout=min(left, self._config.store.keepalive)
                )
                if running:
                    await session.digest()
        for led in ending:
            task = led.task
            overdue = time.monotonic() - led.term.ended_at >= self._config.handover_grace
            if task is not None and not task.done() and not (wait or overdue):
                continue
            schema = led.store.config.schema
            self._reap(led)
            await session.release(schema)
            self._ending.discard(schema)
            del self._led[schema]
            self._gave_up[schema] = time.monotonic()

    async def _end_all(self, reason: str) -> None:
        for led in list(self._led.values()):
            led.term.mark_lost(reason)


def _opening(engine: AsyncEngine, idle_in_transaction_ms: int, borrowed: bool) -> str | None:
    """The message that opens the host's transactions on ``engine``'s sessions with the
    store's settings (``idle_in_transaction_ms`` their idle limit) when they are
    ``borrowed``; ``None`` (SQLAlchemy's ``BEGIN``) on the host's own, which have them."""
    if not borrowed:
        return None
    statements = st.store_transaction(idle_in_transaction_ms, borrowed=True)
    return door.opening_message(statements, engine.dialect)


async def _require_utf8(engine: AsyncEngine) -> None:
    """Refuse a database not encoded in UTF8 before the control schema is made in it, as
    a store does (:func:`~cronoq_store._door.require_utf8`): its clusters could store no
    task whose strings the encoding lacks."""
    opening = door.opening_message(
        st.store_transaction(st.IDLE_LIMIT_MS, borrowed=True), engine.dialect
    )
    await door.require_utf8(engine, redact(engine.url), opening)


def _dialled_host_session(
    url: str | URL, config: PgStoreConfig, instance: str
) -> tuple[dict[str, str], AsyncEngine]:
    """The host session's settings and its engine, dialled from ``url``: named as the URL
    (or the config) names sessions, the instance id at the end, as a lock session is."""
    parameters = resolve(url)
    settings = session_settings(config, instance, parameters.session_name(config.application_name))
    engine = door.lock_engine(
        parameters.with_application_name(settings["application_name"]),
        settings,
        config.session_timeout,
    )
    return settings, engine
