"""The store as its callers see it: the protocols, and ``PgStore``, which implements them in
PostgreSQL, one cluster per schema.

The scheduler's engine needs :class:`Store` (leadership, write-ahead commits, recovery);
tools that only look at tasks need :class:`StoreQueries`, which any instance serves, leader
or not; the group committer needs :class:`Committable`. ``commit`` is declared once, in
:class:`SupportsCommit`, which the others extend. :class:`PgStore` implements all three, and
so does :class:`cronoq_store.testing.InMemoryStore` (tests/contract runs one suite against
the two).

``PgStore`` is a facade: it opens and closes, holds the engine, and wires the paths. A
commit goes down to :class:`~cronoq_store._commit_path.CommitPath`; recovery is
:mod:`cronoq_store._recovery`, look-ups and pruning :mod:`cronoq_store._queries`, leader
election :mod:`cronoq_store._leadership`. Every failure leaves the store through
:meth:`PgStore._failure` (:func:`cronoq_store._door.translate_error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import NoReturn, Protocol, TypeVar, runtime_checkable

from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import Pool

from . import _door as door
from . import _migrations as migrations
from . import _queries as queries
from . import _recovery as recovery
from . import _statements as st
from . import _trust as trust
from ._commit_path import (
    MAX_COMMIT_BYTES,
    Carrier,
    CommitPath,
    batch_size,
    check_batch_size,
    fold,
)
from ._config import PgStoreConfig
from ._domain import Mutation, TaskId, TaskRef, TaskStatus, TimeBase, check_task_id
from ._errors import (
    ClusterReplacedError,
    FencedError,
    SchemaGoneError,
    StoreError,
    UnavailableError,
)
from ._leadership import Leadership, LeaderTerm
from ._results import Health, LockHolder, Recovered, TaskRecord
from ._retry import TimeLimit, bounded
from ._schema import schema_options
from ._urls import redact
from ._urls import resolve as resolve_url
from .telemetry import Telemetry, resolve

__all__ = ["Committable", "PgStore", "Store", "StoreQueries", "SupportsCommit"]


@runtime_checkable
class StoreQueries(Protocol):
    """Look-ups and housekeeping over stored tasks; safe on any instance."""

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref``, or the newest task with key ``ref``."""
        ...

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks in id order, above ``after``; empty filters match everything."""
        ...

    async def prune(self, older_than: float) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago that no
        live task depends on; returns how many were deleted."""
        ...

    @property
    def is_leader(self) -> bool:
        """Whether this instance currently holds leadership."""
        ...

    async def leadership_lost(self) -> None:
        """Return once leadership held by this instance is lost."""
        ...


class SupportsCommit(Protocol):
    """Write-ahead commits: the one declaration of ``commit``, which the scheduler's engine
    calls through :class:`Store` and the group committer through :class:`Committable`."""

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        """Write ``batch`` and ``outputs`` in one transaction; return only once committed.

        Idempotent. Raises ``FencedError`` when ``epoch`` is no longer current (only a
        fence of this instance's current epoch ends its term: a late commit of an earlier
        term is refused, and the term goes on) and ``UnavailableError`` when the database
        cannot be reached in time.
        """
        ...


class Committable(SupportsCommit, Protocol):
    """What the group committer needs of a store (``PgStore`` and ``InMemoryStore`` both
    are one): its commits, the largest batch it accepts, where it records, and whether the
    database answers.

    ``max_commit_bytes`` is read for every batch, so a limit lowered at run time holds for
    the next one. ``ping`` tells an outage (it fails) from a batch at fault (it answers
    while the batch keeps failing transiently)."""

    @property
    def max_commit_bytes(self) -> int:
        """The largest batch ``commit`` accepts, in bytes as ``_commit_path.batch_size``
        estimates them; a larger one fails with ``BatchTooLargeError`` before anything is
        sent."""
        ...

    @property
    def telemetry(self) -> Telemetry:
        """Where the committer records its batches, retries and queue depth."""
        ...

    async def ping(self) -> None:
        """Return once the database answers; raise ``StoreError`` if it does not."""
        ...

    async def _commit_measured(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
        size: int,
    ) -> None:
        """``commit``, with ``size``, the batch's ``_commit_path.batch_size``, measured by
        the caller: the committer measures each submission to cut its batches, and a
        mutation measured twice costs the committer's loop a tenth of its time. The group
        committer calls this, never ``commit``: a wrapper or subclass that changes what
        ``commit`` does must change this too."""
        ...


@runtime_checkable
class Store(SupportsCommit, Protocol):
    """The scheduler engine's persistence: one leader writes, every commit is fenced."""

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch."""
        ...

    async def release_leadership(self) -> None:
        """Give leadership up, so a standby can take over at once."""
        ...

    async def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume, engine times through ``base``."""
        ...

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded; ``None`` otherwise."""
        ...


logger = logging.getLogger("cronoq_store")

_T = TypeVar("_T")


class PgStore:
    """PostgreSQL-backed ``Store`` and ``StoreQueries`` for one scheduler cluster.

    Build it with :meth:`connect` (the store owns its engine) or :meth:`from_engine` (it
    shares an application's engine and pool). Use it as an async context manager, or call
    :meth:`close`. The leader lock never rides on the pool: it is held on a dedicated
    session, opened from ``lock_url`` when given; else a store on an
    application's engine opens it the way that engine connects (its creator, TLS and
    connect arguments, on a pool of its own), and a store with its own engine from the URL.
    """

    #: The largest batch :meth:`commit` sends, as the store estimates its size before
    #: sending it; larger ones fail with ``BatchTooLargeError``. Lower it on an instance to
    #: keep commits smaller; raising it risks batches the server refuses.
    max_commit_bytes: int = MAX_COMMIT_BYTES
    #: Seconds :meth:`recover` waits for a lock on the cluster's tables (an operator's
    #: migration) before it fails; ``None``: as long as it takes, the cluster's own wait.
    _recovery_lock_wait: float | None = None

    def __init__(
        self,
        engine: AsyncEngine,
        config: PgStoreConfig,
        *,
        schema_oid: int,
        incarnation: int,
        owns_engine: bool,
        lock_url: str | URL,
        lock_pool: Pool | None = None,
        pool_role: str | None = None,
        term: LeaderTerm | None = None,
        own_sessions: bool | None = None,
        telemetry: Telemetry | None = None,
        carrier: Carrier | None = None,
    ) -> None:
        """Use :meth:`connect` or :meth:`from_engine`: they migrate (or check the revision)
        and read the schema's OID and the cluster's incarnation.

        ``term``: where leadership comes from when it is not this store's own lock session
        (a host leading the cluster among many, which also owns the engine; ``lock_url``
        then names the pool's role only). ``own_sessions``: whether the engine's sessions
        carry the store's settings from their connect (default: the store owns the engine).
        ``telemetry``: a recorder shared with other stores (a host's, labelled with its group
        so that thousands of clusters do not make thousands of label values), which does not
        report this store's leadership in the is-leader gauges. ``carrier``: where commits
        go instead of the pool (a host's commit bus, sharing transactions among clusters).

        Long for a reason: it wires every path of the store, one assignment each."""
        self._engine = engine
        self._config = config
        self._incarnation = incarnation
        self._owns_engine = owns_engine
        # Sessions that may carry settings that are not the store's: an application's (its
        # SETs), or any server connection a transaction-pooling PgBouncer hands out
        # (whatever another client of its pool left set). Every transaction of the store
        # then sets what its guarantees need for itself (statements.borrowed_transaction).
        self._borrows_sessions = (
            not (owns_engine if own_sessions is None else own_sessions)
            or not config.prepared_statements
        )
        # The cluster's schema is applied at execution: one compiled statement per construct
        # serves every schema.
        self._db = engine.execution_options(**schema_options(config.schema))
        #: The message that opens the store's reads, recovery and health checks: the
        #: store's settings on a borrowed session, and an idle limit that is not
        #: ``session_timeout`` (:data:`~cronoq_store._statements.IDLE_LIMIT_MS`).
        self._read_opening = _reads_opening(engine, self._borrows_sessions)
        self._commit_limit = TimeLimit(config.commit_timeout)
        self._commits = CommitPath(
            engine,
            config.schema,
            incarnation=incarnation,
            borrowed=(
                st.borrowed_transaction(door.idle_in_transaction_ms(config))
                if self._borrows_sessions
                else None
            ),
            # The store's own pool holds one connection for the commits (no checkout per
            # commit) when two are left for reads, pings and concurrent commits (with one,
            # a read waiting on a lock, such as a prune behind a commit, would starve a
            # health probe); an application's pool is not the store's to hold from.
            hold=owns_engine and config.max_connections >= 3,
            carrier=carrier,
        )
        self._leadership: LeaderTerm = (
            term
            if term is not None
            else Leadership(
                lock_url,
                config.schema,
                (st.LOCK_NS_LEADER, schema_oid),
                config,
                incarnation=incarnation,
                pool=lock_pool,
                trust=trust.TrustCheck(config.schema, config.trusted_triggers),
                # The pool's role connects as the store does: trusted by its lock session too.
                connect=trust.ConnectCheck(
                    config.trusted_roles | ({pool_role} if pool_role is not None else set())
                ),
            )
        )
        # Who may connect, as health() reads it on the pool's role: its lock role is the
        # store's too.
        lock_user = (
            lock_url.username
            if isinstance(lock_url, URL) and lock_pool
            else resolve_url(lock_url).user
        )
        lock_role = {lock_user} if lock_user else set()
        self._connect_check = trust.ConnectCheck(config.trusted_roles | lock_role)
        # Leadership counts as lost once it was held and is gone, or once a commit was
        # fenced. A store that never led may commit: the epoch check in the transaction
        # still fences it.
        self._has_led = term is not None
        self._fenced = False
        self._closed = False
        # time.monotonic() of the last commit that returned, for health().
        self._last_commit: float | None = None
        if telemetry is None:
            self._use_telemetry(resolve(config.schema))
        else:
            self._telemetry = self._leadership.telemetry = telemetry

    # --- construction -----------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        url: str | URL,
        config: PgStoreConfig | None = None,
        *,
        lock_url: str | URL | None = None,
        migrate: bool = True,
    ) -> PgStore:
        """Open a store with its own pool, migrating the schema first.

        ``url`` is ``postgresql://``, ``postgres://`` or ``postgresql+asyncpg://`` (unix
        sockets with ``?host=/path``). When ``url`` goes through a transaction-pooling
        PgBouncer, give ``lock_url``, a direct server URL (a session advisory lock cannot
        live there), and ``PgStoreConfig(prepared_statements=False)``. With
        ``migrate=False`` the store only checks that no untrusted role controls the schema
        and that it is at this build's revision (``MigrationError`` otherwise): for a
        runtime role without DDL rights, where ops migrate with ``cronoq-store migrate`` or
        Alembic.
        """
        config = config or PgStoreConfig()
        schema_options(config.schema)  # refuse a bad name before anything connects
        engine = door.own_engine(url, config)
        try:
            return await cls._open(
                engine,
                config,
                owns_engine=True,
                lock_url=lock_url,
                migrate=migrate,
                url=url,
            )
        except BaseException:
            await engine.dispose()
            raise

    @classmethod
    async def from_engine(
        cls,
        engine: AsyncEngine,
        config: PgStoreConfig | None = None,
        *,
        lock_url: str | URL | None = None,
        migrate: bool = True,
    ) -> PgStore:
        """Open a store on an application's ``AsyncEngine``, sharing its pool (an async
        classmethod: ``await PgStore.from_engine(engine)``).

        :meth:`close` leaves the engine open. ``config.max_connections`` does not apply:
        the engine keeps its own pool settings. ``lock_url`` and ``migrate`` are as for
        :meth:`connect`. Behind a transaction-pooling PgBouncer the engine must turn off
        asyncpg's and SQLAlchemy's statement caches (``connect_args={"statement_cache_size":
        0, "prepared_statement_cache_size": 0}``) and ``config.prepared_statements`` be
        ``False`` (docs/reliability.md, "PgBouncer").
        """
        config = config or PgStoreConfig()
        schema_options(config.schema)
        if engine.dialect.driver != "asyncpg":
            raise ValueError(
                f"engine: the store needs the asyncpg driver "
                f"(postgresql+asyncpg://), got {engine.dialect.name}+{engine.dialect.driver}"
            )
        return await cls._open(
            engine, config, owns_engine=False, lock_url=lock_url, migrate=migrate
        )

    @classmethod
    async def _open(
        cls,
        engine: AsyncEngine,
        config: PgStoreConfig,
        *,
        owns_engine: bool,
        lock_url: str | URL | None,
        migrate: bool,
        url: str | URL | None = None,
    ) -> PgStore:
        """``url``: the one the store's own engine was made from, as given (``engine.url``
        names the first host only), for the lock session."""
        await door.refuse_unsafe_lock_session(
            engine,
            prepared_statements=config.prepared_statements,
            lock_url=lock_url,
            borrowed=not owns_engine,
        )
        where = redact(engine.url)
        # What the store reads at open runs under its own settings too: an application's
        # SET (a role, a millisecond's timeout) must neither fail the open nor be believed.
        opening = _reads_opening(engine, not owns_engine or not config.prepared_statements)
        await door.require_utf8(engine, where, opening)
        if not config.prepared_statements:
            await door.require_search_path(engine, where)
        trusted = config.trusted_triggers
        if migrate:
            await migrations.upgrade(
                engine,
                config.schema,
                trusted_triggers=trusted,
                lock_timeout=config.migration_lock_timeout,
            )
        else:
            await migrations.require_head(
                engine, config.schema, trusted_triggers=trusted, opening=opening
            )
        oid, incarnation, pool_role = await door.cluster_identity(engine, config.schema, opening)
        if oid is None:
            raise StoreError(f"schema {config.schema!r} not found at {where} after migrating")
        if incarnation is None:
            raise StoreError(
                f"the leader row of schema {config.schema!r} at {where} is missing: run the "
                "migrations"
            )
        return cls(
            engine,
            config,
            schema_oid=oid,
            incarnation=incarnation,
            owns_engine=owns_engine,
            pool_role=pool_role,
            lock_url=(url or engine.url) if lock_url is None else lock_url,
            # An application's engine may connect through a creator, TLS or connect_args
            # its URL does not show: a pool made like its own (Pool.recreate) makes the
            # lock session the same way, and hands out none of the application's sessions.
            lock_pool=(
                engine.sync_engine.pool.recreate() if lock_url is None and not owns_engine else None
            ),
        )

    async def migrate(self) -> None:
        """Apply pending migrations (idempotent, serialized); :meth:`connect` already did."""
        await migrations.upgrade(
            self._engine,
            self._config.schema,
            trusted_triggers=self._config.trusted_triggers,
            lock_timeout=self._config.migration_lock_timeout,
        )

    async def close(self) -> None:
        """Give up leadership and close the pool, unless the pool is an application's."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._commits.release()
            await self._leadership.close()
        finally:
            if self._owns_engine:
                await self._engine.dispose()

    async def __aenter__(self) -> PgStore:
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
            f"{type(self).__name__}(url={redact(self._engine.url)!r}, "
            f"schema={self._config.schema!r}, "
            f"owns_engine={self._owns_engine})"
        )

    @property
    def config(self) -> PgStoreConfig:
        """The settings this store was opened with."""
        return self._config

    @property
    def engine(self) -> AsyncEngine:
        """The engine whose pool serves commits and queries (never the leader lock)."""
        return self._engine

    @property
    def incarnation(self) -> int:
        """The cluster this store was opened on: the OID of its leader table, read at open.
        The schema's name may come to hold another cluster (dropped and migrated again,
        renamed, restored from a logical dump); this store then never writes there, and
        raises ``ClusterReplacedError`` (docs/reliability.md, "The cluster's incarnation").
        A physical copy of the server (a promoted replica, a point-in-time restore) and
        ``pg_upgrade`` keep it."""
        return self._incarnation

    @property
    def telemetry(self) -> Telemetry:
        """Where this store records metrics and spans (:mod:`cronoq_store.telemetry`):
        the global OpenTelemetry providers configured when it opened, or those given to
        :func:`~cronoq_store.telemetry.instrument`; ``enabled`` is ``False`` for none."""
        return self._telemetry

    def _use_telemetry(self, recorder: Telemetry) -> None:
        self._telemetry = recorder
        self._leadership.telemetry = recorder
        recorder.watch_leadership(self._leadership)

    # --- leadership -------------------------------------------------------------------------

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch.

        Once the lock is taken, and before the epoch is bumped, the lock session runs the
        schema's trust check again: a trigger or grant added since the store opened makes
        this raise ``MigrationError``, with the lock released and no epoch taken. Before it
        waits for the lock, it refuses, with ``MigrationError``, a database where ``PUBLIC``
        or a login role it does not trust has ``CONNECT`` (unless
        ``allow_untrusted_connect``): any such role could hold the lock forever. While it
        waits behind a holder that is not a store instance, it logs a warning naming it.
        After a term of this instance ended (lost, or released), it first waits the rest of
        ``2 * lock_poll + 1`` seconds, so that a waiting standby leads instead
        (docs/operations.md, "A forced handover").
        It raises ``ClusterReplacedError`` where the schema no longer holds the cluster this
        store was opened on (:attr:`incarnation`), and ``SchemaGoneError`` where the schema
        is gone, with the lock released and no epoch taken: open a new store then.
        """
        # A standby holds no commit connection, and a new term takes a fresh one.
        await self._commits.release()
        with self._telemetry.acquisition():
            epoch = await self._leadership.acquire()
        self._has_led, self._fenced = True, False
        return epoch

    async def release_leadership(self) -> None:
        """Release the leader lock; commits fail with ``FencedError`` from now on. A waiting
        standby leads next: this instance's next ``acquire_leadership`` first waits
        ``2 * lock_poll + 1`` seconds."""
        await self._leadership.release()
        await self._commits.release()

    async def leadership_lost(self) -> None:
        """Return once leadership held by this instance is lost (or released)."""
        await self._leadership.wait_lost()

    @property
    def is_leader(self) -> bool:
        """Whether this instance leads now (it holds the lock and was not fenced)."""
        return self._leadership.is_leader

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads, else ``None``."""
        return self._leadership.epoch

    @property
    def leader_lock(self) -> tuple[int, int]:
        """The two keys of the leader's advisory lock (``pg_locks.classid``, ``objid``): the
        second is the schema's OID, read again by each acquisition (``pg_upgrade`` gives a
        schema another), so these are the last acquisition's, or those read at open."""
        return self._leadership.lock_key

    # --- commits ----------------------------------------------------------------------------

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> None:
        """Write ``batch`` and ``outputs`` in one transaction; return once it committed.

        Idempotent: a batch that already landed changes nothing when committed again.
        Raises ``FencedError`` if ``epoch`` is not the stored one, or leadership was lost
        before; nothing is written then. Only a fence of this instance's current term ends
        it (leadership is then marked lost): a late commit stamped with an earlier term's
        epoch (or any epoch other than the current one) is refused, and the term goes on.
        Raises ``ClusterReplacedError`` (a ``FencedError``; leadership is marked lost) if the
        schema no longer holds the cluster this store was opened on, ``BatchTooLargeError``
        (before sending anything) if the batch could exceed :attr:`max_commit_bytes`, and
        ``UnavailableError`` if the database fails or the commit takes longer than
        ``commit_timeout``.
        """
        await self._commit_measured(epoch, base, batch, outputs, batch_size(batch, outputs))

    async def _commit_measured(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
        size: int,
    ) -> None:
        """:meth:`commit`, the batch's :func:`~cronoq_store._commit_path.batch_size`
        already measured by the caller (``size``). Every commit passes here: the rare
        outcomes are functions of their own, and failures are translated without a context
        manager (:meth:`_failure`)."""
        with self._telemetry.commit(len(batch)) as record:
            if self._fenced or (self._has_led and not self._leadership.is_leader):
                await self._term_over()
            current = self._leadership.epoch
            if current is not None and epoch != current:
                _other_term(epoch, current)
            check_batch_size(batch, outputs, self.max_commit_bytes, size)
            folded = fold(batch, base, time.time_ns(), outputs)
            if record is not None:
                record.size, record.path = size, self._commits.writer.path(folded)
            if self._closed:
                raise _closed(_COMMITTING)
            try:
                found = await self._commit_limit.run(self._commits.commit(epoch, folded))
            except asyncio.TimeoutError as exc:
                raise UnavailableError(
                    f"{_COMMITTING} failed: not done within commit_timeout "
                    f"({self._commit_limit.seconds} s)"
                ) from exc
            except Exception as exc:
                error = await self._failure(exc, _COMMITTING)
                if error is exc:
                    raise
                raise error from exc
            if found is not None:
                self._fence_found(epoch, *found)
        self._last_commit = time.monotonic()

    async def _term_over(self) -> NoReturn:
        """Refuse a commit after this instance's term ended (fenced, or leadership lost):
        ``ClusterReplacedError`` where the schema holds another cluster, else
        ``FencedError``; nothing is sent, and the term's held connection is given back."""
        await self._commits.release()
        replaced = self._leadership.replaced
        if replaced is not None:
            raise ClusterReplacedError(
                replaced.schema, replaced.incarnation, replaced.found, _COMMITTING
            )
        raise FencedError("leadership was lost: this instance must not write any more")

    async def ping(self) -> None:
        """Return once the database answers and takes writes; ``UnavailableError`` if it
        does not within ``commit_timeout``. The group committer asks, when a batch keeps
        failing transiently, whether the database or the batch is at fault."""
        timeout = self._config.commit_timeout
        async with self._translated("pinging the database"):
            try:
                await bounded(self._ping(), timeout)
            except asyncio.TimeoutError as exc:
                raise UnavailableError(
                    f"pinging the database failed: no answer within commit_timeout ({timeout} s)"
                ) from exc

    async def _ping(self) -> None:
        if not await self._read(door.accepts_writes):
            raise UnavailableError(
                "pinging the database failed: the server does not take writes (a standby?)",
                reconnect=True,
            )

    def _fence_found(self, epoch: int, stored: int | None, found: int | None) -> NoReturn:
        """A commit under ``epoch`` found the epoch ``stored`` and the incarnation ``found``
        instead, and wrote nothing (the commit path gave its held connection back): raise
        ``ClusterReplacedError`` where the schema holds another cluster, ``FencedError``
        otherwise, having ended the term if this fence ends it (:meth:`_fenced_out`)."""
        if found is not None and found != self._incarnation:
            replaced = ClusterReplacedError(
                self._config.schema, self._incarnation, found, _COMMITTING
            )
            self._fenced_out(stored, replaced)
            logger.error(
                "commit refused: the schema holds another cluster; stepping down",
                extra={
                    "schema": self._config.schema,
                    "incarnation": self._incarnation,
                    "found_incarnation": found,
                },
            )
            raise replaced
        if self._fenced_out(stored, None):
            logger.error(
                "commit fenced: another instance took leadership",
                extra={"epoch": epoch, "current_epoch": stored},
            )
        else:
            logger.warning(
                "a commit of an earlier term was fenced; the current term goes on",
                extra={"epoch": epoch, "current_epoch": stored},
            )
        raise FencedError(f"fenced: the stored epoch is {stored}, this commit's is {epoch}")

    def _fenced_out(self, stored: int | None, replaced: ClusterReplacedError | None) -> bool:
        """A commit found the epoch ``stored``, or another cluster (``replaced``): whether
        that ends this instance's term, after which it must not write any more. Only a
        fence of the current term ends it: a commit stamped with an earlier term's epoch,
        in flight while a new term began, finds that new term's epoch stored."""
        current = self._leadership.epoch
        if replaced is None and current is not None and stored == current:
            return False
        self._fenced = True
        if replaced is not None:
            self._leadership.replaced = replaced
        self._leadership.mark_lost("fenced" if replaced is None else "cluster_replaced")
        return True

    async def _cluster_gone(self, error: SchemaGoneError | ClusterReplacedError) -> None:
        """The cluster went away under this leader (its tables or columns dropped by a
        forced downgrade, or the schema holding another cluster): step down, releasing the
        lock, as when fenced; a new term needs a migrated schema, or a new store."""
        replaced = isinstance(error, ClusterReplacedError)
        logger.error(
            "the schema no longer holds this store's cluster; stepping down"
            if replaced
            else "the cluster's schema lost what this build uses; stepping down",
            extra={"schema": self._config.schema, "epoch": self.epoch, "error": str(error)},
        )
        self._fenced = True
        if isinstance(error, ClusterReplacedError):
            self._leadership.replaced = error
        self._leadership.mark_lost("cluster_replaced" if replaced else "schema_gone")
        await self._commits.release()

    def _read(self, work: Callable[[AsyncConnection], Awaitable[_T]]) -> Awaitable[_T]:
        """``work`` in a transaction of its own under the store's settings, run again on a
        session that had lost its prepared statements (:func:`~cronoq_store._door.run_transaction`);
        for reads, recovery and health, which take no lock on the leader row."""
        return door.run_transaction(self._db, self._read_opening, work)

    def _locking(self, work: Callable[[AsyncConnection], Awaitable[_T]]) -> Awaitable[_T]:
        """As :meth:`_read`, for a transaction that locks the leader row (a prune batch):
        a takeover waits for it, so it keeps the commits' idle limit, ``session_timeout``."""
        return door.run_transaction(self._db, self._commits.writer.borrowed_opening, work)

    @asynccontextmanager
    async def _translated(self, action: str) -> AsyncIterator[None]:
        """Turn any failure inside into a ``StoreError`` (:meth:`_failure`): with the
        commit, which calls :meth:`_failure` itself, the one place errors leave the store."""
        if self._closed:
            raise _closed(action)
        try:
            yield
        except Exception as exc:
            error = await self._failure(exc, action)
            if error is exc:
                raise
            raise error from exc

    async def _failure(self, exc: Exception, action: str) -> StoreError:
        """The ``StoreError`` that ``exc`` is or translates to
        (:func:`~cronoq_store._door.translate_error`), once what it says is acted on: a
        cluster gone from the schema steps this leader down, a demoted primary
        (``reconnect``) disposes the pool.

        Every pooled connection then points at a server that can no longer write, and
        pre-ping cannot tell. ``dispose()`` closes idle connections and those in use when
        returned; the engine stays usable and reconnects to whatever the URL resolves to
        now. An application's pool is disposed only once a server it hands out says it is
        in recovery: a read-only error alone may come from the application's session
        state, which is no failover.
        """
        error = door.translate_error(exc, action)
        if (
            isinstance(error, (SchemaGoneError, ClusterReplacedError))
            and self._leadership.is_leader
        ):
            await self._cluster_gone(error)
        if isinstance(error, UnavailableError) and error.reconnect and await self._demoted():
            logger.warning(
                "the database no longer accepts writes (demoted primary?); "
                "dropping the pool's connections",
                extra={"url": redact(self._engine.url), "error": str(error)},
            )
            await self._engine.dispose()
        return error

    async def _demoted(self) -> bool:
        """Whether a read-only failure is evidence enough to drop the pool's connections
        (:func:`~cronoq_store._door.demoted`)."""
        return await door.demoted(
            self._db, owned=self._owns_engine, timeout=self._config.commit_timeout
        )

    # --- recovery ---------------------------------------------------------------------------

    async def recover(self, base: TimeBase) -> Recovered:
        """Load what a new leader needs: live tasks, finished ones within ``retention`` or
        depended on by a live task, recurring schedules, and the next id to issue.

        Total whatever the rows hold: an undecodable live row is quarantined (marked
        failed with the reason, once: it is an ordinary failed task afterwards) and reported
        as finished; an undecodable schedule is logged, skipped and left in the table.
        Raises ``ClusterReplacedError`` where the schema no longer holds the cluster this
        store was opened on (:attr:`incarnation`): nothing is read (or quarantined) there.
        """
        quarantined: list[int] = []

        async def attempt(conn: AsyncConnection) -> Recovered:
            quarantined.clear()  # an attempt that failed quarantined nothing
            if self._recovery_lock_wait is not None:
                ms = str(max(1, round(self._recovery_lock_wait * 1000)))
                await conn.execute(st.set_local_lock_timeout, {"ms": ms})
            return await recovery.recover(
                conn,
                self._config.schema,
                base,
                self._config.retention,
                quarantined.append,
                incarnation=self._incarnation,
            )

        with self._telemetry.recovery() as loaded, recovery.collector_paused():
            async with self._translated("recovering"):
                found = await self._read(attempt)
            loaded(len(found.tasks), len(found.terminal), len(found.recurring), sum(quarantined))
        return found

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of task ``id`` if it succeeded, else ``None``."""
        check_task_id("id", id)
        async with self._translated("loading an output"):
            return await self._read(lambda conn: queries.load_output(conn, id))

    # --- queries ----------------------------------------------------------------------------

    async def health(self) -> Health:
        """This instance's leadership and the cluster's, the schema's revision against this
        build's head, the age of this instance's last successful commit, and who may
        connect that the store does not trust: for an application's readiness endpoint.
        "Not healthy" is a fact in the result (no leader, a foreign lock holder, not at
        head); only a database that cannot be read raises (``UnavailableError`` or
        ``StoreError``). A holder that is not a store instance (it never took the epoch) is
        read again after :data:`~cronoq_store._queries.TAKEOVER_GRACE` and reported in
        ``foreign_holder``, never as a leader; whoever holds the schema's migration lock is
        in ``migration_lock``. A schema whose tables are gone (never
        migrated, or downgraded under a leader) reads as no revision and stored epoch 0,
        with whoever holds its leader lock (not a store instance: nothing records one).
        ``incarnation`` is the cluster this instance was opened on, ``stored_incarnation``
        the one the schema holds now: where they differ (``cluster_replaced``), this
        instance never writes again. The holder is that of the lock the schema's OID keys
        now."""
        check, schema = self._connect_check, self._config.schema

        async def others(conn: AsyncConnection) -> tuple[Sequence[str], LockHolder | None]:
            untrusted = (await conn.execute(check.statement, check.params)).scalars().all()
            return untrusted, await queries.migration_lock_holder(conn, schema)

        async def read(
            conn: AsyncConnection,
        ) -> tuple[queries.ClusterFacts, Sequence[str], LockHolder | None]:
            facts = await queries.cluster_facts(conn, await self._lock_now(conn))
            return facts, *await others(conn)

        async def read_without_tables(
            conn: AsyncConnection,
        ) -> tuple[queries.ClusterFacts, Sequence[str], LockHolder | None]:
            holder = await queries.leader_lock_holder(conn, await self._lock_now(conn))
            status = await conn.run_sync(migrations.revision_status, schema)
            facts = queries.ClusterFacts(0, holder, status.current)
            return facts, *await others(conn)

        try:
            async with self._translated("reading health"):
                facts, untrusted, migrating = await self._read(read)
        except SchemaGoneError:
            # No leader table to read (not migrated, or dropped under a leader): what is
            # known is who holds the lock and what the version table (if any) records;
            # epoch 0, as in a cluster not yet created.
            async with self._translated("reading health"):
                facts, untrusted, migrating = await self._read(read_without_tables)
        last = self._last_commit
        return Health(
            is_leader=self.is_leader,
            epoch=self.epoch,
            stored_epoch=facts.stored_epoch,
            holder=facts.holder,
            revision=facts.revision,
            head=migrations.head_revision(),
            last_commit_age=None if last is None else time.monotonic() - last,
            untrusted_connect=tuple(untrusted),
            incarnation=self._incarnation,
            stored_incarnation=facts.incarnation,
            migration_lock=migrating,
            hosted_by=facts.hosted_by,
        )

    async def _lock_now(self, conn: AsyncConnection) -> tuple[int, int]:
        """The leader lock's keys as the schema's OID gives them now (the key of the last
        acquisition, or of the open, when the schema is gone)."""
        oid = (await conn.execute(st.schema_oid, {"schema": self._config.schema})).scalar()
        return self.leader_lock if oid is None else (st.LOCK_NS_LEADER, oid)

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref`` (an int), or the newest task with key ``ref`` (a str)."""
        params = queries.lookup_params(ref)
        async with self._translated("looking up a task"):
            return await self._read(lambda conn: queries.get_task(conn, params))

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks in id order with ids above ``after``, at most ``limit``: those in
        one of ``pools`` (any if empty) with one of ``statuses`` (any if empty). Pass the
        last id of a page as ``after`` to get the next one."""
        params = queries.finished_params(pools, statuses, after, limit)
        async with self._translated("listing finished tasks"):
            return await self._read(lambda conn: queries.list_finished(conn, params))

    async def prune(
        self, older_than: float, *, progress: Callable[[int], None] | None = None
    ) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago, on the
        database server's clock (``now()``, read once), except those a live task depends on
        (by id or key); returns how many were deleted.

        Deletes oldest first, in batches of a transaction each (1,000 rows first, then
        sized to take about 0.2 s, 64,000 at most), so locks stay short, and waits for
        commits in flight that may add dependencies. ``progress``, if given, is
        called with the running total of deleted rows after each batch (an operator's progress
        bar); an exception it raises ends the prune, as a ``StoreError``. Raises
        ``ClusterReplacedError``, having deleted nothing more, once the schema no longer
        holds the cluster this store was opened on (:attr:`incarnation`).
        """
        queries.prune_age_ns(older_than)  # a bad age is a ValueError before connecting
        with self._telemetry.prune() as pruned:
            async with self._translated("pruning finished tasks"):
                cutoff = await self._read(
                    lambda conn: queries.server_prune_cutoff(conn, older_than)
                )
                deleted = await queries.prune(
                    self._locking,
                    cutoff,
                    progress,
                    cluster=(self._config.schema, self._incarnation),
                    # Commits in flight hold the leader row for at most this long.
                    lock_wait=self._config.commit_timeout,
                    waiter="pruning (its wait is commit_timeout)",
                )
            pruned(deleted)
        return deleted


def _reads_opening(engine: AsyncEngine, borrowed: bool) -> str:
    """The message that opens a store transaction that takes no lock on the leader row
    (:func:`~cronoq_store._statements.store_transaction`)."""
    statements = st.store_transaction(st.IDLE_LIMIT_MS, borrowed=borrowed)
    return door.opening_message(statements, engine.dialect)


#: What a commit's errors say it was doing.
_COMMITTING = "committing a batch"


def _closed(action: str) -> StoreError:
    """The error of work asked of a closed store (an owned engine would quietly open a new
    pool that nothing disposes)."""
    return StoreError(f"{action} failed: the store is closed")


def _other_term(epoch: int, current: int) -> NoReturn:
    """Refuse a commit stamped with ``epoch`` while this instance's term is ``current`` (a
    retry from an earlier term's committer): it can never pass the fence, and it is no
    news about the current term, which goes on."""
    logger.warning(
        "a commit stamped with another term's epoch was refused; the current term goes on",
        extra={"epoch": epoch, "current_epoch": current},
    )
    raise FencedError(
        f"fenced: epoch {epoch} is not this instance's term (epoch {current}): nothing "
        "was written, and the current term goes on"
    )
