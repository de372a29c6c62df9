"""Commits on the driver connection: the statements of :mod:`cronoq_store.statements`,
compiled once per schema, run on the asyncpg connection under a pooled SQLAlchemy one.

A commit is the store's hot path and mostly round trips and client CPU: SQLAlchemy's
per-execution work (parameter processing, result wrapping, a greenlet switch per call)
cost more than the server's at small batches. So the commit's statements, still Core
constructs composed in :mod:`cronoq_store.statements`, are compiled here for the engine's
dialect with the cluster's schema (``schema_translate_map``, rendered once), and executed
with asyncpg's prepared-statement cache. Reads keep the SQLAlchemy path.

A batch that only inserts new tasks, or only changes statuses, is one statement: the epoch
check lives in a CTE of the write, so no BEGIN or COMMIT travels. Every other batch runs in
one transaction in the contract's order: epoch check, updates, inserts, outputs, recurring.
From :data:`STAGE_MIN_ROWS` new tasks on, the inserts travel by binary COPY into a
temporary staging table and are inserted from there (``statements.stage``): a few more
round trips, much less client CPU per row.

An insert that finds one of its ids stored fails when the stored row is a different task, or
is the same task and the batch's transitions of it are ahead (see ``statements._insert_from``),
which rolls back everything the batch wrote. The writer then names the ids held by other
tasks (``statements.colliding_ids``) and reports them instead of the epoch; if there are
none, it writes the batch again in one transaction with those transitions in the update,
before the insert. It does the same when such a batch fails on the unique index of live
keys: a task it sends again may still hold, in the store, a key that a new task of the batch
takes once the update has finished the old holder; a key still refused then is really held.
That costs nothing to the common batch: a submission is sent again together with a
transition only when an unacknowledged batch is retried.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
from sqlalchemy import ClauseElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import Pool, PoolProxiedConnection
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.util import greenlet_spawn

from . import statements as st
from .errors import CONNECTION_CLASSES, FencedError, IdCollisionError, KeyTakenError
from .folding import FoldedBatch, RecurringAction
from .rows import INSERT_COLUMNS
from .schema import tasks

__all__ = ["STAGE_MIN_ROWS", "BatchWriter", "CommitPath", "CompiledStatement", "Written"]

logger = logging.getLogger("cronoq_store")

#: New tasks per batch from which they are staged by COPY rather than sent as arrays: the
#: crossover measured on 2 cores (arrays win at 64 rows by 12%, staging at 128 by 10%).
STAGE_MIN_ROWS = 128

# The unique index on live keys (see :func:`_maybe_stored`).
_LIVE_KEY_INDEX = next(index.name for index in tasks.indexes if index.unique)
# The server's detail for a violation of it: the key as text.
_KEY_DETAIL = re.compile(r"Key \(key\)=\((.*)\) already exists\.", re.DOTALL)


@dataclass(frozen=True, slots=True)
class CompiledStatement:
    """A Core statement as the driver's SQL text, with its parameters in positional order."""

    sql: str
    names: tuple[str, ...]
    #: Values the construct carries itself (literals such as the leader row's id).
    defaults: Mapping[str, Any]

    @classmethod
    def of(cls, statement: ClauseElement, dialect: Dialect, schema: str) -> CompiledStatement:
        """``statement`` as ``dialect`` renders it for the cluster in ``schema``."""
        compiled = statement.compile(
            dialect=dialect, schema_translate_map={None: schema}, render_schema_translate=True
        )
        if not isinstance(compiled, SQLCompiler):  # DDL: no parameters
            return cls(compiled.string, (), {})
        return cls(compiled.string, tuple(compiled.positiontup or ()), compiled.params)

    def args(self, values: Mapping[str, Any]) -> list[Any]:
        """The positional arguments: ``values`` by name, the construct's own otherwise."""
        return [values[n] if n in values else self.defaults[n] for n in self.names]


class _Stale(Exception):
    """Raised inside a commit's transaction to roll it back when the epoch moved on."""

    def __init__(self, current: int) -> None:
        super().__init__(current)
        self.current = current


@dataclass(frozen=True, slots=True)
class Written:
    """What ``BatchWriter.write`` found: the stored epoch (nothing was written unless it is
    the batch's), or ids held by other tasks (nothing was written)."""

    epoch: int | None
    colliding: list[int] | None = None


class BatchWriter:
    """Writes folded batches for one cluster; ``write`` says what it found.

    ``stage_min_rows`` is where staging by COPY starts (``None``: never, for a role that
    may not create temporary tables). ``pin_search_path``: the sessions may run under a
    search_path that is not the store's (an application's engine, or PgBouncer handing out
    any server connection), so every statement runs in a transaction that first sets the
    store's with ``SET LOCAL`` semantics; the one-statement fast paths are off then.
    """

    def __init__(
        self,
        dialect: Dialect,
        schema: str,
        *,
        stage_min_rows: int | None = STAGE_MIN_ROWS,
        pin_search_path: bool = False,
    ) -> None:
        self._stage_min_rows = stage_min_rows

        def compiled(statement: ClauseElement) -> CompiledStatement:
            return CompiledStatement.of(statement, dialect, schema)

        self._insert_fenced = compiled(st.insert_tasks_fenced)
        self._update_fenced = compiled(st.update_status_fenced)
        self._record_max_id = compiled(st.record_max_id)
        self._epoch_for_share = compiled(st.epoch_for_share)
        self._update = compiled(st.update_status)
        self._insert = compiled(st.insert_tasks)
        self._outputs = compiled(st.store_outputs)
        self._create_stage = compiled(st.create_stage)
        self._insert_from_stage = compiled(st.insert_from_stage)
        self._colliding_ids = compiled(st.colliding_ids)
        self._pin = compiled(st.local_search_path) if pin_search_path else None
        self._recurring = {
            RecurringAction.UPSERT: compiled(st.upsert_recurring),
            RecurringAction.REMOVE: compiled(st.remove_recurring),
            RecurringAction.NEXT: compiled(st.advance_recurring),
        }
        # One writer per write field of FoldedBatch: a field without one fails here, at
        # construction, instead of being skipped by every commit.
        self._writers: dict[str, Callable[[Any, FoldedBatch], Awaitable[None]]] = {
            "updates": self._write_updates,
            "insert_rows": self._write_inserts,
            "outputs": self._write_outputs,
            "recurring": self._write_recurring,
        }
        if set(self._writers) != set(FoldedBatch.WRITES):
            raise RuntimeError(
                f"BatchWriter writes {sorted(self._writers)}, FoldedBatch holds "
                f"{sorted(FoldedBatch.WRITES)}"
            )

    async def write(self, conn: Any, epoch: int, batch: FoldedBatch) -> Written:
        """Write ``batch`` on the asyncpg connection ``conn`` if ``epoch`` is the stored
        epoch and none of its ids is held by another task, else write nothing."""
        try:
            return Written(await self._write(conn, epoch, batch))
        except (asyncpg.NotNullViolationError, asyncpg.UniqueViolationError) as exc:
            if not _maybe_stored(exc, batch):
                raise
        colliding = await self._colliding(conn, batch)
        if colliding or not batch.inserted_updates["ids"]:
            return Written(None, colliding)
        # Tasks the batch submits may be stored already with its transitions moving them:
        # write the batch again, those transitions in the update, before the insert. A live
        # key that still fails then is held by another task.
        try:
            return Written(await self._write(conn, epoch, batch.resubmitted()))
        except asyncpg.NotNullViolationError as exc:
            if not _taken(exc):
                raise
        return Written(None, await self._colliding(conn, batch))

    async def _colliding(self, conn: Any, batch: FoldedBatch) -> list[int]:
        stmt = self._colliding_ids
        if self._pin is None:
            return [r[0] for r in await conn.fetch(stmt.sql, *stmt.args(batch.inserts))]
        async with conn.transaction():
            await conn.execute(self._pin.sql)
            return [r[0] for r in await conn.fetch(stmt.sql, *stmt.args(batch.inserts))]

    def path(self, batch: FoldedBatch) -> str:
        """The write path ``batch`` takes (its first write; a batch written again runs in a
        transaction): one statement (``insert`` or ``update``, when it holds one kind of
        write that has a fenced form), ``staged_copy``, or ``transaction``."""
        return self._path(batch, batch.writes())

    def _path(self, batch: FoldedBatch, writes: tuple[str, ...]) -> str:
        # The one-statement paths need the session's own search_path to be the store's.
        fast = self._pin is None
        if fast and writes == ("insert_rows",) and not self._staged(batch):
            return "insert"
        if fast and writes == ("updates",):
            return "update"
        return "staged_copy" if self._staged(batch) else "transaction"

    async def _write(self, conn: Any, epoch: int, batch: FoldedBatch) -> int:
        writes = batch.writes()
        path = self._path(batch, writes)
        if path == "insert":
            stmt = self._insert_fenced
            params = {**batch.inserts, "issued": batch.max_id, "epoch": epoch}
            current: int = await conn.fetchval(stmt.sql, *stmt.args(params))
            return current
        if path == "update":
            stmt = self._update_fenced
            current, updated = await conn.fetchrow(
                stmt.sql, *stmt.args({**batch.updates, "epoch": epoch})
            )
            if current == epoch:
                _warn_unchanged(batch.update_count, updated)
            return current
        transaction = conn.transaction()
        await transaction.start()
        try:
            if self._pin is not None:
                await conn.execute(self._pin.sql)
            await self._write_in_transaction(conn, epoch, batch, writes)
        except _Stale as stale:
            await transaction.rollback()
            return stale.current
        except BaseException:
            # On a connection that died or whose statement was cancelled, the rollback fails
            # too ("another operation is in progress"); that must not replace the error that
            # explains the failure. The caller discards a connection left in a transaction.
            with contextlib.suppress(Exception):
                await transaction.rollback()
            raise
        await transaction.commit()
        return epoch

    async def _write_in_transaction(
        self, conn: Any, epoch: int, batch: FoldedBatch, writes: tuple[str, ...]
    ) -> None:
        if batch.max_id is None:
            stmt = self._epoch_for_share
            current = await conn.fetchval(stmt.sql, *stmt.args({}))
        else:
            # Record the id high-water mark while checking the epoch.
            stmt = self._record_max_id
            current = await conn.fetchval(stmt.sql, *stmt.args({"issued": batch.max_id}))
        if current != epoch:
            raise _Stale(current)
        # In FoldedBatch.WRITES order: updates first, so keys they release can be reused by
        # tasks inserted after them.
        for name in writes:
            await self._writers[name](conn, batch)

    async def _write_updates(self, conn: Any, batch: FoldedBatch) -> None:
        status = await conn.execute(self._update.sql, *self._update.args(batch.updates))
        _warn_unchanged(batch.update_count, _row_count(status))

    async def _write_inserts(self, conn: Any, batch: FoldedBatch) -> None:
        if self._staged(batch):
            await conn.execute(self._create_stage.sql)
            await conn.copy_records_to_table(
                st.stage.name,
                records=batch.insert_rows,
                columns=INSERT_COLUMNS,
                schema_name=st.stage.schema,
            )
            await conn.execute(self._insert_from_stage.sql)
        else:
            await conn.execute(self._insert.sql, *self._insert.args(batch.inserts))

    async def _write_outputs(self, conn: Any, batch: FoldedBatch) -> None:
        status = await conn.execute(self._outputs.sql, *self._outputs.args(batch.outputs))
        _warn_unstored_outputs(batch.output_count, _row_count(status))

    async def _write_recurring(self, conn: Any, batch: FoldedBatch) -> None:
        for action, params in batch.recurring:
            stmt = self._recurring[action]
            await conn.execute(stmt.sql, *stmt.args(params))

    def _staged(self, batch: FoldedBatch) -> bool:
        threshold = self._stage_min_rows
        return threshold is not None and batch.insert_count >= threshold


class CommitPath:
    """The store's commits: a pooled connection's driver connection, the
    :class:`BatchWriter` (``writer``), and what it found turned into errors.

    ``pin_search_path``: the sessions may not run under the store's search_path (an
    application's engine, or a transaction-pooling PgBouncer): every commit sets it for its
    own transaction (:class:`BatchWriter`), so nothing is left on the session either.
    ``on_fenced`` runs when a commit finds another epoch, before ``FencedError`` is raised.

    ``hold``: keep one pooled connection checked out between commits (the writer's, for the
    term) instead of a checkout and a return per commit, which cost a greenlet switch each
    and the pool's bookkeeping. One commit at a time uses it; a concurrent one checks out
    another as before. It is given up, never reused, when in doubt (as any connection of a
    failed commit), when the server closed it, or when the pool it came from was disposed
    (a demoted primary); and returned by :meth:`release` (``PgStore`` calls it at close,
    ``release_leadership``, fencing, the first commit refused after a lost term, and
    ``acquire_leadership``: a standby holds none, a new term takes a fresh one).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        schema: str,
        *,
        may_stage: bool,
        pin_search_path: bool,
        on_fenced: Callable[[], None],
        hold: bool = False,
    ) -> None:
        self._engine = engine
        self._on_fenced = on_fenced
        self._hold = hold
        self._held: PoolProxiedConnection | None = None
        self._held_from: Pool | None = None  # the pool it came from
        self._held_busy = False
        self._releases = 0  # a connection checked out before a release is not held
        self.writer = BatchWriter(
            engine.dialect,
            schema,
            stage_min_rows=STAGE_MIN_ROWS if may_stage else None,
            pin_search_path=pin_search_path,
        )

    async def commit(self, epoch: int, batch: FoldedBatch) -> None:
        """Write ``batch`` under ``epoch``; ``IdCollisionError``, ``KeyTakenError`` or
        ``FencedError`` if it wrote nothing because an id is another task's, a live key is
        another live task's or the stored epoch is another."""
        try:
            async with self._driver_connection() as conn:
                written = await self.writer.write(conn, epoch, batch)
        except asyncpg.UniqueViolationError as exc:
            # Translated here, after the connection went back clean to the pool.
            if exc.constraint_name != _LIVE_KEY_INDEX:
                raise
            raise KeyTakenError(_keys_named(exc)) from exc
        if written.colliding is not None:
            raise IdCollisionError(written.colliding)
        current = written.epoch
        if current != epoch:
            await self.release()
            self._on_fenced()
            logger.error(
                "commit fenced: another instance took leadership",
                extra={"epoch": epoch, "current_epoch": current},
            )
            raise FencedError(f"fenced: the stored epoch is {current}, this instance's is {epoch}")

    async def release(self) -> None:
        """Return the held connection to the pool (a commit using it returns it when done);
        a later commit holds one again."""
        held, busy = self._held, self._held_busy
        self._held, self._held_busy = None, False
        self._releases += 1
        if held is not None and not busy:
            if self._held_from is not self._engine.sync_engine.pool:
                # Its pool was disposed (a demoted primary): it would stay open there.
                _driver(held).terminate()
                held.invalidate()
            await greenlet_spawn(held.close)

    async def _checkout(self) -> PoolProxiedConnection:
        """The held connection if it is free and sound, else one from the pool."""
        held = self._held
        if held is None or self._held_busy:
            return await self._engine.raw_connection()
        if self._held_from is self._engine.sync_engine.pool and not _driver(held).is_closed():
            self._held_busy = True
            return held
        # What the pool's checkout check would refuse, or a connection of a pool disposed
        # since (a demoted primary): discarded, never reused.
        self._held = None
        _driver(held).terminate()
        held.invalidate()
        await greenlet_spawn(held.close)
        return await self._engine.raw_connection()

    @asynccontextmanager
    async def _driver_connection(self) -> AsyncIterator[Any]:
        """A pooled connection's asyncpg connection, for :class:`BatchWriter`.

        SQLAlchemy does not see what runs on it, so a connection that may be left in doubt
        (closed, still in a transaction, or interrupted by a timeout or a driver error) is
        invalidated here instead of going back to the pool. A server's error leaves it
        usable: asyncpg rolled the transaction back. With ``hold``, a sound connection is
        kept as the held one when none is (and none was released meanwhile).
        """
        pool, releases = self._engine.sync_engine.pool, self._releases
        pooled = await self._checkout()
        driver = _driver(pooled)
        sound = False
        try:
            yield driver
            sound = True
        except BaseException as exc:
            clean = (
                isinstance(exc, asyncpg.PostgresError)
                and not exc.sqlstate.startswith(CONNECTION_CLASSES)
                and not driver.is_closed()
                and not driver.is_in_transaction()
            )
            if clean:
                sound = True
            else:
                if pooled is self._held:
                    self._held, self._held_busy = None, False
                # Close the socket first: a graceful close waits for the operation in
                # progress and fails ("another operation is in progress") after a timeout
                # or cancellation, which would mask the error being raised.
                driver.terminate()
                pooled.invalidate()
            raise
        finally:
            if pooled is self._held:
                self._held_busy = False
            elif sound and self._hold and self._held is None and self._releases == releases:
                self._held, self._held_from = pooled, pool
            else:
                if sound and pool is not self._engine.sync_engine.pool:
                    # Its pool was disposed meanwhile (close(), a demoted primary): returned
                    # there, it would stay open, never handed out nor closed.
                    driver.terminate()
                    pooled.invalidate()
                # Back to the pool (or, invalidated, discarded). Inside a greenlet, because
                # the pool's reset-on-return may call the driver; it has nothing to roll back.
                await greenlet_spawn(pooled.close)


def _driver(pooled: PoolProxiedConnection) -> Any:
    """The asyncpg connection under a pooled one."""
    return pooled.driver_connection


def _maybe_stored(exc: asyncpg.PostgresError, batch: FoldedBatch) -> bool:
    """Whether the insert's failure may come from tasks of the batch being stored already:
    the insert's signal (:func:`_taken`), or a live key when the batch submits tasks with
    transitions. Their transitions ride in their insert rows, so the key a stored one holds
    is released only by the update of the second write: the row of a new task taking that
    key can meet the index before the stored task's row raises the signal."""
    if isinstance(exc, asyncpg.NotNullViolationError):
        return _taken(exc)
    constraint: str | None = exc.constraint_name
    return constraint == _LIVE_KEY_INDEX and bool(batch.inserted_updates["ids"])


def _keys_named(exc: asyncpg.UniqueViolationError) -> list[str]:
    """The key the server names in a live-key violation ("Key (key)=(k) already exists.")."""
    detail: str | None = exc.detail
    found = _KEY_DETAIL.fullmatch(detail or "")
    return [] if found is None else [found.group(1)]


def _taken(exc: asyncpg.NotNullViolationError) -> bool:
    """Whether ``exc`` is the insert's signal that a stored row holds one of its ids
    (``statements._insert_from``)."""
    table: str | None = exc.table_name
    column: str | None = exc.column_name
    return table == tasks.name and column == "seq"


def _row_count(status: str) -> int:
    """The row count of a command tag such as ``UPDATE 12``."""
    return int(status.rpartition(" ")[2])


def _warn_unstored_outputs(expected: int, stored: int) -> None:
    """Outputs of tasks that are missing (pruned?) or did not succeed: not stored."""
    if stored != expected:
        logger.warning(
            "outputs for tasks missing from the store (pruned?) or not succeeded: not stored",
            extra={"expected": expected, "matched": stored},
        )


def _warn_unchanged(expected: int, moved: int) -> None:
    """Transitions of tasks not submitted in the batch that moved nothing: the task is
    missing, or a retried or late batch found it already further along. (Moved rows of
    tasks the batch submits again count too, so this can miss a case.)"""
    if moved < expected:
        logger.warning(
            "status updates that changed nothing: tasks missing from the store (pruned?) "
            "or already further along (a batch delivered again)",
            extra={"expected": expected, "matched": moved},
        )
