"""``PgStore``: the scheduler's write-ahead state in PostgreSQL, one cluster per schema.

The store runs the statements of :mod:`cronoq_store.statements` and nothing else: SQL is
composed there, batches are folded in :mod:`cronoq_store.folding`, rows are decoded with
:mod:`cronoq_store.codec`, and leader election lives in :mod:`cronoq_store.leadership`.
Every failure leaves through :func:`cronoq_store.errors.translate_error`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import asyncpg
from sqlalchemy import Executable, Row, event
from sqlalchemy.engine import URL
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from . import migrations
from . import statements as st
from .codec import (
    QUARANTINE_PREFIX,
    decode_deps,
    decode_miss_policy,
    decode_recurring,
    decode_resources,
    decode_retry,
    decode_strings,
    ns_to_duration,
)
from .config import PgStoreConfig, keepalive_settings
from .domain import (
    I64_MAX,
    I64_MIN,
    LIVE_STATUS_NAMES,
    UNIX_EPOCH,
    FixedStart,
    Mutation,
    Priority,
    Recovered,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskSpec,
    TaskStatus,
    TimeBase,
    clean_text,
)
from .errors import (
    BatchTooLargeError,
    FencedError,
    IdCollisionError,
    StoreError,
    UnavailableError,
    translate_error,
)
from .folding import FoldedBatch, fold
from .leadership import Leadership
from .schema import schema_options
from .sizing import MAX_COMMIT_BYTES, batch_size
from .urls import async_url, redact
from .writer import STAGE_MIN_ROWS, BatchWriter, CompiledStatement

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Unpack

    _Row: TypeAlias = Row[Unpack[tuple[Any, ...]]]

__all__ = ["PRUNE_BATCH", "RECOVERY_PARTITION", "PgStore", "next_id"]

logger = logging.getLogger("cronoq_store")

#: Rows deleted per statement by :meth:`PgStore.prune`: short transactions, bounded locks.
PRUNE_BATCH = 1000
#: Live task rows read and decoded at a time by :meth:`PgStore.recover`.
RECOVERY_PARTITION = 10_000

# SQLSTATE classes after which a session is gone or going: connection exception, operator
# intervention (shutdown, terminated backend).
_CONNECTION_CLASSES = ("08", "57P")
_DEFAULT_TOLERANCE_NS = 1_000_000_000
#: Longest reason kept in a quarantined row's message (the message column is stored text).
_QUARANTINE_REASON_CHARS = 500


class PgStore:
    """PostgreSQL-backed ``Store`` and ``StoreQueries`` for one scheduler cluster.

    Build it with :meth:`connect` (the store owns its engine) or :meth:`from_engine` (it
    shares an application's engine and pool). Use it as an async context manager, or call
    :meth:`close`. The leader lock never rides on the pool: :class:`Leadership` holds it on
    a dedicated session, opened from ``lock_url`` when given; else a store on an
    application's engine opens it the way that engine connects (its creator, TLS and
    connect arguments, on a pool of its own), and a store with its own engine from the URL.
    """

    #: The largest batch :meth:`commit` sends, as :func:`~cronoq_store.sizing.batch_size`
    #: estimates it; larger ones fail with ``BatchTooLargeError``. Lower it on an instance to
    #: keep commits smaller; raising it risks batches the server refuses.
    max_commit_bytes: int = MAX_COMMIT_BYTES

    def __init__(
        self,
        engine: AsyncEngine,
        config: PgStoreConfig,
        *,
        schema_oid: int,
        may_stage: bool,
        owns_engine: bool,
        lock_url: URL,
        lock_pool: Pool | None = None,
    ) -> None:
        """Use :meth:`connect` or :meth:`from_engine`: they migrate (or check the revision)
        and read the schema's OID and whether large batches may be staged."""
        self._engine = engine
        self._config = config
        self._owns_engine = owns_engine
        # The cluster's schema is applied at execution: one compiled statement per construct
        # serves every schema.
        self._db = engine.execution_options(**schema_options(config.schema))
        # A borrowed engine's sessions keep the application's search_path: the store sets
        # its own (statements.SEARCH_PATH) while it uses one and gives the old one back.
        self._take_path = CompiledStatement.of(st.take_search_path, engine.dialect, config.schema)
        self._restore_path = CompiledStatement.of(
            st.restore_search_path, engine.dialect, config.schema
        )
        self._writer = BatchWriter(
            engine.dialect, config.schema, stage_min_rows=STAGE_MIN_ROWS if may_stage else None
        )
        self._leader_lock = (st.LOCK_NS_LEADER, schema_oid)
        self._leadership = Leadership(
            lock_url,
            config.schema,
            self._leader_lock,
            config,
            pool=lock_pool,
            trust=migrations.TrustCheck(config.schema, config.trusted_triggers),
        )
        # Leadership counts as lost once it was held and is gone, or once a commit was
        # fenced. A store that never led may commit: the epoch check in the transaction
        # still fences it.
        self._has_led = False
        self._fenced = False
        self._closed = False

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
        sockets with ``?host=/path``). Give ``lock_url``, a direct server URL, when ``url``
        goes through a transaction-pooling PgBouncer: a session advisory lock cannot live
        there. With ``migrate=False`` the store only checks that no untrusted role controls
        the schema and that it is at this build's revision (``MigrationError`` otherwise):
        for a runtime role without DDL rights, where ops migrate with ``cronoq-store
        migrate`` or Alembic.
        """
        config = config or PgStoreConfig()
        schema_options(config.schema)  # refuse a bad name before anything connects
        engine = create_async_engine(
            async_url(url),
            pool_size=config.max_connections,
            max_overflow=0,
            # No store call waits for a connection longer than a commit may take.
            pool_timeout=config.commit_timeout,
            # Batches carry payloads; errors and logs must not.
            hide_parameters=True,
            connect_args=_pool_connect_args(config),
        )
        event.listen(engine.sync_engine.pool, "checkout", _reject_closed)
        try:
            return await cls._open(
                engine, config, owns_engine=True, lock_url=lock_url, migrate=migrate
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
        :meth:`connect`.
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
    ) -> PgStore:
        where = redact(engine.url)
        await _require_utf8(engine, where)
        trusted = config.trusted_triggers
        if migrate:
            await migrations.upgrade(engine, config.schema, trusted_triggers=trusted)
        else:
            await migrations.require_head(engine, config.schema, trusted_triggers=trusted)
        try:
            async with engine.begin() as conn:
                await conn.execute(st.local_search_path)
                oid = (await conn.execute(st.schema_oid, {"schema": config.schema})).scalar()
                may_stage = bool((await conn.execute(st.may_stage)).scalar())
        except Exception as exc:
            raise translate_error(exc, f"reading the OID of schema {config.schema!r}") from exc
        if oid is None:
            raise StoreError(f"schema {config.schema!r} not found at {where} after migrating")
        return cls(
            engine,
            config,
            schema_oid=oid,
            may_stage=may_stage,
            owns_engine=owns_engine,
            lock_url=engine.url if lock_url is None else async_url(lock_url),
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
            self._engine, self._config.schema, trusted_triggers=self._config.trusted_triggers
        )

    async def close(self) -> None:
        """Give up leadership and close the pool, unless the pool is an application's."""
        if self._closed:
            return
        self._closed = True
        try:
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
            f"PgStore(url={redact(self._engine.url)!r}, schema={self._config.schema!r}, "
            f"owns_engine={self._owns_engine})"
        )

    @property
    def config(self) -> PgStoreConfig:
        return self._config

    @property
    def engine(self) -> AsyncEngine:
        """The engine whose pool serves commits and queries (never the leader lock)."""
        return self._engine

    # --- leadership -------------------------------------------------------------------------

    async def acquire_leadership(self) -> int:
        """Wait until this instance leads; returns the new fencing epoch.

        Once the lock is taken, and before the epoch is bumped, the lock session runs the
        schema's trust check again (:class:`~cronoq_store.migrations.TrustCheck`): a trigger
        or grant added since the store opened makes this raise ``MigrationError``, with the
        lock released and no epoch taken.
        """
        epoch = await self._leadership.acquire()
        self._has_led, self._fenced = True, False
        return epoch

    async def release_leadership(self) -> None:
        """Release the leader lock; commits fail with ``FencedError`` from now on."""
        await self._leadership.release()

    async def leadership_lost(self) -> None:
        """Return once leadership held by this instance is lost (or released)."""
        await self._leadership.wait_lost()

    @property
    def is_leader(self) -> bool:
        return self._leadership.is_leader

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads, else ``None``."""
        return self._leadership.epoch

    @property
    def leader_lock(self) -> tuple[int, int]:
        """The two keys of the leader's advisory lock (``pg_locks.classid``, ``objid``)."""
        return self._leader_lock

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
        Raises ``FencedError`` if ``epoch`` is not the stored one (leadership is then marked
        lost and nothing is written) or leadership was lost before,
        ``BatchTooLargeError`` (before sending anything) if the batch could exceed
        :attr:`max_commit_bytes`, and ``UnavailableError`` if the database fails or the
        commit takes longer than ``commit_timeout``.
        """
        if self._fenced or (self._has_led and not self._leadership.is_leader):
            raise FencedError("leadership was lost: this instance must not write any more")
        size = batch_size(batch, outputs)
        if size > self.max_commit_bytes:
            raise BatchTooLargeError(
                f"committing a batch failed: its {len(batch)} mutations and {len(outputs)} "
                f"outputs take up to {size} bytes, over the {self.max_commit_bytes} bytes "
                "one commit may send (PostgreSQL refuses a message over 1 GiB); commit "
                "them in smaller batches"
            )
        folded = fold(batch, base, time.time_ns(), outputs)
        timeout = self._config.commit_timeout
        async with self._translated("committing a batch"):
            try:
                await _within(self._write(epoch, folded), timeout)
            except asyncio.TimeoutError as exc:
                raise UnavailableError(
                    f"committing a batch failed: not done within commit_timeout ({timeout} s)"
                ) from exc

    async def ping(self) -> None:
        """Return once the database answers and takes writes; ``UnavailableError`` if it
        does not within ``commit_timeout``. The group committer asks, when a batch keeps
        failing transiently, whether the database or the batch is at fault."""
        timeout = self._config.commit_timeout
        async with self._translated("pinging the database"):
            try:
                await _within(self._ping(), timeout)
            except asyncio.TimeoutError as exc:
                raise UnavailableError(
                    f"pinging the database failed: no answer within commit_timeout ({timeout} s)"
                ) from exc

    async def _ping(self) -> None:
        async with self._db.connect() as conn:
            writable = (await conn.execute(st.accepts_writes)).scalar()
        if not writable:
            raise UnavailableError(
                "pinging the database failed: the server does not take writes (a standby?)",
                reconnect=True,
            )

    async def _write(self, epoch: int, batch: FoldedBatch) -> None:
        async with self._driver_connection() as conn:
            written = await self._writer.write(conn, epoch, batch)
        if written.colliding is not None:
            raise IdCollisionError(written.colliding)
        current = written.epoch
        if current != epoch:
            self._fenced = True
            self._leadership.mark_lost()
            logger.error(
                "commit fenced: another instance took leadership",
                extra={"epoch": epoch, "current_epoch": current},
            )
            raise FencedError(f"fenced: the stored epoch is {current}, this instance's is {epoch}")

    @asynccontextmanager
    async def _driver_connection(self) -> AsyncIterator[Any]:
        """A pooled connection's asyncpg connection, for :class:`BatchWriter`.

        SQLAlchemy does not see what runs on it, so a connection that may be left in doubt
        (closed, still in a transaction, or interrupted by a timeout or a driver error) is
        invalidated here instead of going back to the pool. A server's error leaves it
        usable: asyncpg rolled the transaction back. A borrowed engine's session runs under
        the store's search_path and gets its own back before it returns to the pool (two
        round trips per commit; the store's own sessions have it from the start).
        """
        pooled = await self._engine.raw_connection()
        driver: Any = pooled.driver_connection
        borrowed_path: str | None = None
        try:
            if not self._owns_engine:
                borrowed_path = await driver.fetchval(self._take_path.sql)
            yield driver
        except BaseException as exc:
            clean = (
                isinstance(exc, asyncpg.PostgresError)
                and not exc.sqlstate.startswith(_CONNECTION_CLASSES)
                and not driver.is_closed()
                and not driver.is_in_transaction()
            )
            if not clean:
                # Close the socket first: a graceful close waits for the operation in
                # progress and fails ("another operation is in progress") after a timeout
                # or cancellation, which would mask the error being raised.
                driver.terminate()
                pooled.invalidate()
            raise
        finally:
            try:
                if borrowed_path is not None and pooled.is_valid:
                    args = self._restore_path.args({"path": borrowed_path})
                    try:
                        await driver.execute(self._restore_path.sql, *args)
                    except BaseException:
                        # Never back to the application with our search_path.
                        driver.terminate()
                        pooled.invalidate()
                        raise
            finally:
                # Back to the pool (or, invalidated, discarded). Inside a greenlet, because
                # the pool's reset-on-return may call the driver; it has nothing to roll back.
                await greenlet_spawn(pooled.close)

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[AsyncConnection]:
        """A pooled connection in a transaction, with the cluster's schema applied, under
        the store's search_path (a borrowed session's own returns when the transaction
        ends: one more round trip per read)."""
        async with self._db.begin() as conn:
            if not self._owns_engine:
                await conn.execute(st.local_search_path)
            yield conn

    @asynccontextmanager
    async def _translated(self, action: str) -> AsyncIterator[None]:
        """Turn any failure into a ``StoreError``; the one place errors leave the store.

        A demoted primary (``reconnect``) also disposes the pool, shared or owned: every
        pooled connection points at a server that can no longer write, and pre-ping cannot
        tell. ``dispose()`` closes idle connections and those in use when returned; the
        engine stays usable and reconnects to whatever the URL resolves to now.
        """
        if self._closed:
            # An owned engine would quietly open a new pool that nothing disposes.
            raise StoreError(f"{action} failed: the store is closed")
        try:
            yield
        except Exception as exc:
            error = translate_error(exc, action)
            if isinstance(error, UnavailableError) and error.reconnect:
                logger.warning(
                    "the database no longer accepts writes (demoted primary?); "
                    "dropping the pool's connections",
                    extra={"url": redact(self._engine.url), "error": str(error)},
                )
                await self._engine.dispose()
            if error is exc:
                raise
            raise error from exc

    # --- recovery ---------------------------------------------------------------------------

    async def recover(self, base: TimeBase) -> Recovered:
        """Load what a new leader needs: live tasks, finished ones within ``retention`` or
        depended on by a live task, recurring schedules, and the next id to issue.

        Total whatever the rows hold: an undecodable live row is quarantined (marked
        failed with the reason, once: it is an ordinary failed task afterwards) and reported
        as finished; an undecodable schedule is logged, skipped and left in the table.
        """
        async with self._translated("recovering"), self._session() as conn:
            recovered = Recovered(next_id=next_id(*(await conn.execute(st.high_water)).one()))
            now = time.time_ns()
            await self._recover_tasks(conn, base, now, recovered)
            await self._recover_recurring(conn, base, recovered)
        return recovered

    async def _recover_tasks(
        self, conn: AsyncConnection, base: TimeBase, now: int, recovered: Recovered
    ) -> None:
        corrupt_ids: list[int] = []
        corrupt_messages: list[str] = []
        # A server-side cursor, read and decoded a partition at a time: rows are dropped as
        # they are decoded, and the transaction is never idle for longer than it takes to
        # decode one partition (the pool's idle_in_transaction_session_timeout applies).
        result = await conn.stream(st.live_tasks)
        async for rows in result.partitions(RECOVERY_PARTITION):
            with _gc_paused():
                for row in rows:
                    try:
                        recovered.tasks.append(_decode_task(base, row))
                    except Exception as exc:  # whatever the row holds; free when nothing raises
                        reason = _reason(exc)
                        logger.error(
                            "quarantining undecodable task row",
                            extra={"task_id": row.id, "error": reason},
                        )
                        corrupt_ids.append(row.id)
                        corrupt_messages.append(f"{QUARANTINE_PREFIX} {reason}")
        if corrupt_ids:
            await conn.execute(
                st.quarantine,
                {
                    "ids": corrupt_ids,
                    "messages": corrupt_messages,
                    "failed": TaskStatus.FAILED.value,
                    "now": now,
                },
            )
        dep_ids: set[int] = set()
        dep_keys: set[str] = set()
        for task in recovered.tasks:
            for dep in task.spec.deps:
                if isinstance(dep.target, str):
                    dep_keys.add(dep.target)
                else:
                    dep_ids.add(dep.target)
        # Quarantined rows were just updated (to `now`): this query returns them too.
        cutoff = now - round(self._config.retention * 1e9)
        finished = await conn.execute(
            st.recent_terminal,
            {"cutoff": cutoff, "dep_ids": list(dep_ids), "dep_keys": list(dep_keys)},
        )
        for done in finished:
            status = TaskStatus.from_stored(done.status)
            if status is None or not status.is_terminal:
                logger.warning(
                    "skipping finished task with an unknown status",
                    extra={"task_id": done.id, "status": done.status},
                )
                continue
            recovered.terminal.append(
                RecoveredTerminal(
                    id=TaskId(done.id),
                    key=done.key,
                    status=status,
                    at=base.from_unix(done.updated_unix_ns),
                )
            )

    async def _recover_recurring(
        self, conn: AsyncConnection, base: TimeBase, recovered: Recovered
    ) -> None:
        for row in await conn.execute(st.recurring_schedules):
            try:
                recovered.recurring.append(_decode_recurring(base, row))
            except Exception as exc:  # whatever the row holds
                # Left in place, so it can be repaired, but not scheduled.
                logger.error(
                    "skipping undecodable recurring schedule",
                    extra={"schedule": row.name, "error": _reason(exc)},
                )

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of task ``id`` if it succeeded, else ``None``."""
        async with self._translated("loading an output"), self._session() as conn:
            output: bytes | None = (await conn.execute(st.task_output, {"id": id})).scalar()
        return output

    # --- queries ----------------------------------------------------------------------------

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """The task with id ``ref`` (an int), or the newest task with key ``ref`` (a str)."""
        stmt: Executable
        params: dict[str, object]
        if isinstance(ref, str):
            stmt, params = st.task_by_key, {"key": clean_text(ref)}
        else:
            stmt, params = st.task_by_id, {"id": int(ref)}
        async with self._translated("looking up a task"), self._session() as conn:
            row = (await conn.execute(stmt, params)).first()
        return None if row is None else _record(row)

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
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: must be a non-negative integer, got {limit!r}")
        params = {
            "pools": [clean_text(p) for p in pools],
            "statuses": [s.value for s in statuses],
            "after": -1 if after is None else after,
            "limit": limit,
        }
        async with self._translated("listing finished tasks"), self._session() as conn:
            rows = (await conn.execute(st.finished_page, params)).all()
        return [_record(row) for row in rows]

    async def prune(self, older_than: float) -> int:
        """Delete finished tasks last updated more than ``older_than`` seconds ago, except
        those a live task depends on (by id or key); returns how many were deleted.

        Deletes :data:`PRUNE_BATCH` rows per transaction, oldest first, so locks stay short.
        Each batch first takes the leader row ``FOR SHARE``: a commit that inserts tasks
        holds that row locked (it records the id high-water mark) from before its insert to
        its end, so the batch waits for such commits in flight and its ``DELETE``, under a
        new snapshot, sees the dependencies they added; commits arriving meanwhile wait for
        one batch.
        """
        if (
            isinstance(older_than, bool)
            or not isinstance(older_than, (int, float))
            or not math.isfinite(older_than)
            or older_than < 0
        ):
            raise ValueError(
                f"older_than: must be a non-negative number of seconds, got {older_than!r}"
            )
        params = {"cutoff": time.time_ns() - round(older_than * 1e9), "batch": PRUNE_BATCH}
        total = 0
        async with self._translated("pruning finished tasks"):
            while True:
                async with self._session() as conn:
                    await conn.execute(st.epoch_for_share)
                    deleted = (await conn.execute(st.prune_batch, params)).rowcount
                total += deleted
                if deleted < PRUNE_BATCH:
                    return total


if sys.version_info >= (3, 11):

    async def _within(work: Awaitable[None], seconds: float) -> None:
        """``work``, cancelled with ``TimeoutError`` after ``seconds``: ``asyncio.wait_for``
        without the task it creates on 3.11 (a few event-loop turns per commit)."""
        async with asyncio.timeout(seconds):
            await work

else:
    _within = asyncio.wait_for  # pragma: no cover


def next_id(recorded_max: int, stored_max: int | None) -> int:
    """One more than the largest id ever issued, 0 when none was: ``recorded_max`` is 0 until
    a batch records one (the column's default), ``stored_max`` ``None`` without tasks."""
    recorded = recorded_max + 1 if recorded_max > 0 else 0
    return max(recorded, 0 if stored_max is None else stored_max + 1)


async def _require_utf8(engine: AsyncEngine, where: str) -> None:
    """Refuse a database whose encoding is not UTF8, before anything is created in it: every
    string the domain accepts must be storable, and another encoding lacks most characters."""
    try:
        async with engine.connect() as conn:
            encoding = (await conn.execute(st.server_encoding)).scalar_one()
    except Exception as exc:
        raise translate_error(exc, "reading the database's encoding") from exc
    if encoding != "UTF8":
        raise StoreError(
            f"the database at {where} is encoded in {encoding}: cronoq-store needs a UTF8 "
            "database (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
        )


def _pool_connect_args(config: PgStoreConfig) -> dict[str, Any]:
    """How the store's own pool connects: its server settings, or, without prepared
    statements (a transaction-pooling PgBouncer), unnamed statements and no settings but
    ``application_name``, the one such a PgBouncer accepts at connection start."""
    if not config.prepared_statements:
        return {
            # asyncpg then sends every statement unnamed (Parse, Describe and Bind travel
            # before one Sync, so PgBouncer keeps them on one server connection).
            "statement_cache_size": 0,
            "prepared_statement_cache_size": 0,
            "server_settings": {"application_name": config.application_name},
        }
    return {
        "server_settings": {
            "application_name": config.application_name,
            # No schema another role can write is ever on the path (CVE-2018-1058).
            "search_path": st.SEARCH_PATH,
            # A leader frozen or cut off between two statements of a commit holds the
            # leader row lock; the server ends such a session, so a takeover waits at most
            # this long for it (the keeper has stepped down by then).
            "idle_in_transaction_session_timeout": str(round(config.session_timeout * 1000)),
            # And one cut off while the server sends or waits on it (keepalive_settings).
            **keepalive_settings(config),
        }
    }


def _reject_closed(dbapi_connection: Any, record: Any, proxy: PoolProxiedConnection) -> None:
    """The pool's pre-ping, without a round trip: a pooled connection that the server
    closed (restart, terminated backend, idle timeout) is replaced at checkout.

    asyncpg notices a closed socket as soon as the event loop reads its end, so this catches
    what a ``SELECT 1`` would, three round trips cheaper (the asyncpg dialect pings inside
    ``BEGIN ... ROLLBACK``). A connection that died silently fails its next statement
    instead, with ``UnavailableError``, and is invalidated; commits are idempotent and the
    caller retries.
    """
    driver: Any = proxy.driver_connection
    if driver.is_closed():
        raise DisconnectionError("the server closed this pooled connection")


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Decoding builds millions of objects that all stay alive: without a pause the cyclic
    collector would walk the growing heap again and again (about a third of recovery time).
    The loop it guards never awaits, so nothing else runs meanwhile."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _reason(exc: Exception) -> str:
    """Why a row could not be decoded, as storable text: bounded and cleaned.

    A ``ValueError`` (``DecodeError`` included) names the field; anything else is a failure
    of this build on an odd value and says what it was.
    """
    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    if len(reason) > _QUARANTINE_REASON_CHARS:
        reason = reason[: _QUARANTINE_REASON_CHARS - 1] + "…"
    return clean_text(reason)


def _decode_task(base: TimeBase, row: _Row) -> RecoveredTask:
    """A live task row as the scheduler's value; ``ValueError`` names what is wrong.

    The row is unpacked once, in ``statements.live_tasks`` column order: a look-up by
    attribute per column costs about 30% of recovery at a million rows. A row the domain
    would refuse as a submission (an empty pool, a negative seq or id) is refused here too.
    """
    (
        id_, seq, arrival, pool, kind, priority, key, payload, deadline, fixed_at, tolerance,
        on_miss, hint, timeout, retry, deps, resources, tags, labels, tenant, status, attempt,
    ) = row  # fmt: skip
    if status not in LIVE_STATUS_NAMES and TaskStatus.from_stored(status) is not None:
        # A finished status on a row marked live: which of the two is wrong cannot be told.
        # A name this build does not know is a newer build's live status: the task stays live.
        raise ValueError(f"status: {status!r} is the status of a finished task, on a live row")
    fixed = None
    if fixed_at is not None:
        fixed = FixedStart(
            at=base.from_unix(fixed_at),
            tolerance=ns_to_duration(_DEFAULT_TOLERANCE_NS if tolerance is None else tolerance),
            on_miss=decode_miss_policy(on_miss),
        )
    spec = TaskSpec(
        payload,
        kind=kind,
        pool=pool,
        priority=Priority.from_stored(priority),
        key=key,
        deadline=None if deadline is None else base.from_unix(deadline),
        fixed_start=fixed,
        duration_hint=_duration(hint),
        timeout=_duration(timeout),
        retry=decode_retry(retry),
        deps=decode_deps(deps),
        resources=decode_resources(resources),
        tags=decode_strings(tags, "tags"),
        labels=decode_strings(labels, "labels"),
        tenant=tenant,
    )
    if seq < 0:
        raise ValueError(f"seq: must be an integer in 0..2**63-1, got {seq}")
    if id_ < 0:
        raise ValueError(f"id: must be a task id in 0..2**63-1, got {id_}")
    arrival_ns = base.from_unix(arrival)
    if not I64_MIN <= arrival_ns <= I64_MAX:
        _engine_time(base, arrival, "arrival_unix_ns")  # raises, naming the column
    return RecoveredTask(
        id=TaskId(id_),
        seq=seq,
        arrival=arrival_ns,
        spec=spec,
        attempt=max(attempt, 0),
    )


def _decode_recurring(base: TimeBase, row: _Row) -> RecoveredRecurring:
    """A schedule row as the scheduler's value; ``ValueError`` names what is wrong."""
    name, spec, payload, next_, last = row
    if last is not None and last < 0:
        raise ValueError(f"last_task_id: must be a task id in 0..2**63-1, got {last}")
    return RecoveredRecurring(
        spec=decode_recurring(base, name, spec, payload),
        next=None if next_ is None else _engine_time(base, next_, "next_unix_ns"),
        last=None if last is None else TaskId(last),
    )


def _engine_time(base: TimeBase, unix_ns: int, column: str) -> int:
    """The engine time of a stored time, which must fit the 64 bits the domain takes."""
    engine_ns = base.from_unix(unix_ns)
    if I64_MIN <= engine_ns <= I64_MAX:
        return engine_ns
    raise ValueError(
        f"{column}: {unix_ns} is engine time {engine_ns} through {base!r}, outside -2**63..2**63-1"
    )


def _duration(ns: int | None) -> timedelta | None:
    return None if ns is None else ns_to_duration(ns)


def _record(row: _Row) -> TaskRecord:
    return TaskRecord(
        id=TaskId(row.id),
        key=row.key,
        pool=row.pool,
        kind=row.kind,
        priority=Priority.from_stored(row.priority),
        tenant=row.tenant,
        status=TaskStatus.from_stored(row.status),
        attempt=max(row.attempt, 0),
        message=row.message,
        output=row.output,
        updated=UNIX_EPOCH + timedelta(microseconds=max(row.updated_unix_ns, 0) // 1000),
    )
