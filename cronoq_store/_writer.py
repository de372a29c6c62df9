"""The commit path: which way a folded batch is written, on the connection the door lends
(:class:`~cronoq_store._door.CommitConnection`: the statements of
:mod:`cronoq_store._statements`, compiled once per schema, the transaction's messages, the
COPY), and what the writer found turned into errors.

A commit is the store's hot path and mostly round trips and client CPU: SQLAlchemy's
per-execution work (parameter processing, result wrapping, a greenlet switch per call)
cost more than the server's at small batches. So the commit's statements, still Core
constructs composed in :mod:`cronoq_store._statements`, are compiled for the engine's
dialect with the cluster's schema (``schema_translate_map``, rendered once:
:class:`~cronoq_store._door.CompiledStatement`), and executed with asyncpg's
prepared-statement cache, on a connection :class:`~cronoq_store._door.HeldConnection`
checks out.
Reads keep the SQLAlchemy path.

A batch that only inserts new tasks (fewer than :data:`COPY_MIN_ROWS`), or only changes
statuses, is one statement: the epoch check lives in a CTE of the write, so no BEGIN or
COMMIT travels. Every other batch runs in one transaction in the contract's order: epoch
check, updates, inserts, outputs, recurring. Its ``BEGIN`` travels with the epoch check in
one message (the check's parameters are integers we render ourselves). From
:data:`COPY_MIN_ROWS` new tasks on, the inserts travel by binary COPY straight into the
tasks table: a few more round trips than one statement, much less work per row on both
sides. COPY has no conflict rule, so it is optimistic: a batch whose COPY meets a stored
id or a taken live key (a batch sent again, an id collision, a key held) rolls back and is
written again by the insert below, whose conflict rule tells these apart. The common batch
(new tasks) pays only the COPY.

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

Whichever row meets the server first, an id held by another task wins over a held key: a
refusal on the live-key index is followed by the same look-up of colliding ids, and only a
batch without one reports its keys, every key taken (``statements.key_holders`` and
``folding.taken_keys``, the rule the in-memory store applies too).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ClauseElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine

from . import _statements as st
from ._door import (
    CLUSTER_REPLACED,
    INSERT_REFUSALS,
    UNIQUE_VIOLATION,
    CommitConnection,
    CompiledStatement,
    HeldConnection,
    Opening,
    insert_refusal,
    keys_named,
    row_count,
)
from ._errors import (
    ClusterReplacedError,
    FencedError,
    IdCollisionError,
    KeyTakenError,
)
from ._folding import FoldedBatch, RecurringAction, taken_keys
from ._rows import INSERT_COLUMNS
from ._schema import tasks

__all__ = ["COPY_MIN_ROWS", "BatchWriter", "CommitPath", "Fence", "Written"]

logger = logging.getLogger("cronoq_store")

#: New tasks per batch from which they travel by COPY rather than as array parameters of
#: one statement: the crossover measured on 2 cores (see docs/performance.md).
COPY_MIN_ROWS = 32


#: The leader row as a commit found it: the stored epoch and the cluster's incarnation (the
#: leader table's OID), each ``None`` without a leader row.
Fence = tuple[int | None, int | None]
_NO_FENCE: Fence = (None, None)

# The incarnation a failed closing check names (statements.incarnation_kept): its own text,
# which the server quotes in its message whatever the message's language.
_FOUND_INCARNATION = re.compile(r"its leader table is now (\d+|missing)")


#: One write of a batch's transaction, on the door's connection (:attr:`BatchWriter._writers`).
_Write = Callable[[CommitConnection, FoldedBatch, bool], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Written:
    """What ``BatchWriter.write`` found: the stored epoch and incarnation (nothing was
    written unless they are the batch's), or ids held by other tasks, or else live keys
    held by other live tasks (nothing was written)."""

    fence: Fence
    colliding: list[int] | None = None
    taken: list[str] | None = None


class BatchWriter:
    """Writes folded batches for one cluster; ``write`` says what it found.

    ``copy_min_rows``: new tasks per batch from which they travel by COPY.
    ``borrowed``: the sessions may carry settings that are not the store's (an application's
    engine, or PgBouncer handing out any server connection), so every statement runs in a
    transaction opened by these statements (:func:`~cronoq_store._statements.borrowed_transaction`,
    ``BEGIN`` first), sent with the transaction's first statement; the one-statement fast
    paths are off then. :attr:`borrowed_opening` is that opening as one message.
    """

    def __init__(
        self,
        dialect: Dialect,
        schema: str,
        *,
        copy_min_rows: int = COPY_MIN_ROWS,
        borrowed: Sequence[ClauseElement] | None = None,
    ) -> None:
        self._copy_min_rows = copy_min_rows
        self._schema = schema

        def compiled(statement: ClauseElement) -> CompiledStatement:
            return CompiledStatement.of(statement, dialect, schema)

        self._insert_one_fenced = compiled(st.insert_task_fenced)
        self._insert_fenced = compiled(st.insert_tasks_fenced)
        self._update_fenced = compiled(st.update_status_fenced)
        check = compiled(st.epoch_held_for_share)
        #: The message that opens a transaction on a borrowed session, ``None`` when the
        #: sessions are the store's own.
        self.borrowed_opening: str | None = None
        if borrowed is None:
            self._sharing = Opening.of(check)
        else:
            begin, *settings = [compiled(statement) for statement in borrowed]
            self.borrowed_opening = "; ".join([begin.sql, *(s.sql for s in settings)])
            self._sharing = Opening.of(check, *settings, begin=begin.sql)
        self._closing = Opening.closing(compiled(st.incarnation_kept))
        self._stored_fence = compiled(st.epoch_for_share)
        self._update = compiled(st.update_status)
        self._insert = compiled(st.insert_tasks)
        self._outputs = compiled(st.store_outputs)
        self._colliding_ids = compiled(st.colliding_ids)
        self._key_holders = compiled(st.key_holders)
        self._recurring = {
            RecurringAction.UPSERT: compiled(st.upsert_recurring),
            RecurringAction.REMOVE: compiled(st.remove_recurring),
            RecurringAction.NEXT: compiled(st.advance_recurring),
        }
        # One writer per write field of FoldedBatch: a field without one fails here, at
        # construction, instead of being skipped by every commit.
        self._writers: dict[str, _Write] = {
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

    async def write(
        self, conn: CommitConnection, epoch: int, incarnation: int, batch: FoldedBatch
    ) -> Written:
        """Write ``batch`` on the door's connection ``conn`` if ``epoch`` is the stored
        epoch, ``incarnation`` the cluster's, and none of its ids is held by another task,
        else write nothing."""
        fence = (epoch, incarnation)
        if self._copied(batch):
            # Optimistic: new tasks, as nearly every batch holds. A stored id or a taken
            # live key fails the COPY (and rolls back everything): the insert below, with
            # its conflict rule, then says which it was.
            with contextlib.suppress(UNIQUE_VIOLATION):
                return Written(await self._write(conn, fence, batch, copy=True))
        try:
            return Written(await self._write(conn, fence, batch, copy=False))
        except INSERT_REFUSALS as exc:
            if not insert_refusal(exc):
                raise
            refusal = exc
        # Ids held by other tasks win over held keys, whichever row met the server first.
        colliding = await self._colliding(conn, batch)
        if colliding:
            return Written(_NO_FENCE, colliding)
        if batch.inserted_updates["ids"]:
            # Tasks the batch submits may be stored already with its transitions moving
            # them: write the batch again, those transitions in the update, before the
            # insert. A live key that still fails then is held by another task.
            try:
                return Written(await self._write(conn, fence, batch.resubmitted(), copy=False))
            except INSERT_REFUSALS as exc:
                if not insert_refusal(exc):
                    raise
                refusal = exc
            colliding = await self._colliding(conn, batch)
            if colliding:
                return Written(_NO_FENCE, colliding)
        if not isinstance(refusal, UNIQUE_VIOLATION):
            return Written(_NO_FENCE, colliding)  # the colliding task was gone when looked up
        return Written(_NO_FENCE, taken=await self._held_keys(conn, batch) or keys_named(refusal))

    async def _held_keys(self, conn: CommitConnection, batch: FoldedBatch) -> list[str]:
        """The keys of ``batch`` that other live tasks hold (:func:`folding.taken_keys`)."""
        rows = await self._fetch(conn, self._key_holders, batch.inserts)
        stored = {row[0] for row in rows}
        holders = {row[1]: row[0] for row in rows if not row[2] and row[1] is not None}
        return taken_keys(batch, stored, holders)

    async def _colliding(self, conn: CommitConnection, batch: FoldedBatch) -> list[int]:
        return [row[0] for row in await self._fetch(conn, self._colliding_ids, batch.inserts)]

    async def _fetch(
        self, conn: CommitConnection, stmt: CompiledStatement, params: Mapping[str, Any]
    ) -> Any:
        if self.borrowed_opening is None:
            return await conn.fetch(stmt, params)
        try:
            await conn.send(self.borrowed_opening)
            return await conn.fetch(stmt, params)
        finally:
            await conn.roll_back_failed()

    def path(self, batch: FoldedBatch) -> str:
        """The write path ``batch`` takes first (a batch written again after its insert
        found ids or keys stored runs in a transaction, or as one ``insert``): one
        statement (``insert`` or ``update``, when it holds one kind of write that has a
        fenced form), ``copy`` (a transaction whose new tasks travel by COPY), or
        ``transaction``."""
        return self._path(batch.writes(), self._copied(batch))

    def _path(self, writes: tuple[str, ...], copy: bool) -> str:
        # The one-statement paths need the session's own settings to be the store's.
        fast = self.borrowed_opening is None
        if fast and writes == ("insert_rows",) and not copy:
            return "insert"
        if fast and writes == ("updates",):
            return "update"
        return "copy" if copy else "transaction"

    async def _write(
        self, conn: CommitConnection, fence: Fence, batch: FoldedBatch, *, copy: bool
    ) -> Fence:
        """Write ``batch`` under ``fence`` (epoch, incarnation); the fence found, which is
        ``fence`` itself when the batch was written."""
        epoch, incarnation = fence
        fenced = {"epoch": epoch, "incarnation": incarnation}
        writes = batch.writes()
        path = self._path(writes, copy)
        if path == "insert":
            if batch.insert_count == 1:
                stmt = self._insert_one_fenced
                params = dict(zip(INSERT_COLUMNS, batch.insert_rows[0], strict=True), **fenced)
            else:
                stmt = self._insert_fenced
                params = {**batch.inserts, **fenced}
            found = await conn.fetchrow(stmt, params)
            return _NO_FENCE if found is None else (found[0], found[1])
        if path == "update":
            found = await conn.fetchrow(self._update_fenced, {**batch.updates, **fenced})
            if found is None:
                return _NO_FENCE
            if (found[0], found[1]) == fence:
                _warn_unchanged(batch.update_count, found[2])
            return found[0], found[1]
        try:
            checked = await conn.send(self._sharing.sql(fenced))
            if row_count(checked) != 1:
                # Another epoch or cluster: name them, write nothing. (Read by a later
                # statement, they could only be ours again if they moved back meanwhile:
                # fenced all the same.)
                stored = await conn.fetchrow(self._stored_fence, {})
                await conn.roll_back()
                found_fence: Fence = _NO_FENCE if stored is None else (stored[0], stored[1])
                return (None, found_fence[1]) if found_fence == fence else found_fence
            # In FoldedBatch.WRITES order: updates first, so keys they release can be
            # reused by tasks inserted after them.
            for name in writes:
                await self._writers[name](conn, batch, copy)
        except BaseException:
            await conn.roll_back_failed()
            raise
        try:
            # The schema's name may lead to another cluster by now: each write looked its
            # table up again. Checked after them, with the COMMIT, in one message.
            await conn.send(self._closing.sql(fenced))
        except CLUSTER_REPLACED as exc:
            await conn.roll_back_failed()
            # Nothing was committed. Another cluster's incarnation is named as found; no
            # leader row reads as no fence at all, never as this batch's.
            now = _FOUND_INCARNATION.search(str(exc))
            if now is None or now[1] == "missing":
                return _NO_FENCE
            return epoch, int(now[1])
        except BaseException:
            await conn.roll_back_failed()
            raise
        return fence

    async def _write_updates(self, conn: CommitConnection, batch: FoldedBatch, copy: bool) -> None:
        status = await conn.execute(self._update, batch.updates)
        _warn_unchanged(batch.update_count, row_count(status))

    async def _write_inserts(self, conn: CommitConnection, batch: FoldedBatch, copy: bool) -> None:
        if copy:
            await conn.copy_into(tasks.name, batch.insert_rows, INSERT_COLUMNS, self._schema)
        else:
            await conn.execute(self._insert, batch.inserts)

    async def _write_outputs(self, conn: CommitConnection, batch: FoldedBatch, copy: bool) -> None:
        status = await conn.execute(self._outputs, batch.outputs)
        _warn_unstored_outputs(batch.output_count, row_count(status))

    async def _write_recurring(
        self, conn: CommitConnection, batch: FoldedBatch, copy: bool
    ) -> None:
        for action, params in batch.recurring:
            await conn.execute(self._recurring[action], params)

    def _copied(self, batch: FoldedBatch) -> bool:
        return batch.insert_count >= self._copy_min_rows


class CommitPath:
    """The store's commits: a pooled connection's driver connection (:attr:`connections`),
    the :class:`BatchWriter` (``writer``) choosing the write path, and what it found turned
    into errors.

    ``incarnation`` is the cluster's the store was opened on (the leader table's OID): every
    commit writes only there.
    ``borrowed``: the sessions may carry settings that are not the store's (an application's
    engine, or a transaction-pooling PgBouncer): every commit opens its transaction with
    these statements, which set the store's for that transaction alone (:class:`BatchWriter`),
    so nothing is left on the session either.
    ``on_fenced`` runs when a commit finds another epoch (with the epoch found) or another
    cluster (with the ``ClusterReplacedError`` to raise), before the error is raised; it
    says whether that ends this instance's term (a late commit of an earlier term does not
    end the current one).

    ``hold``: keep one pooled connection checked out between commits
    (:class:`~cronoq_store._door.HeldConnection`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        schema: str,
        *,
        incarnation: int,
        borrowed: Sequence[ClauseElement] | None,
        on_fenced: Callable[[int | None, ClusterReplacedError | None], bool],
        hold: bool = False,
    ) -> None:
        self._schema = schema
        self._incarnation = incarnation
        self._on_fenced = on_fenced
        #: The pooled connections commits run on, one of them held with ``hold``.
        self.connections = HeldConnection(engine, hold=hold)
        self.writer = BatchWriter(engine.dialect, schema, borrowed=borrowed)

    async def commit(self, epoch: int, batch: FoldedBatch) -> None:
        """Write ``batch`` under ``epoch`` in the store's cluster; ``IdCollisionError``,
        ``KeyTakenError``, ``ClusterReplacedError`` or ``FencedError`` if it wrote nothing
        because an id is another task's, a live key is another live task's, the schema
        holds another cluster or the stored epoch is another."""
        written = await self.connections.run(
            lambda conn: self.writer.write(conn, epoch, self._incarnation, batch)
        )
        if written.colliding is not None:
            raise IdCollisionError(written.colliding)
        if written.taken is not None:
            raise KeyTakenError(written.taken)
        current, found = written.fence
        if found is not None and found != self._incarnation:
            replaced = ClusterReplacedError(
                self._schema, self._incarnation, found, "committing a batch"
            )
            self._on_fenced(current, replaced)
            await self.release()
            logger.error(
                "commit refused: the schema holds another cluster; stepping down",
                extra={
                    "schema": self._schema,
                    "incarnation": self._incarnation,
                    "found_incarnation": found,
                },
            )
            raise replaced
        if current == epoch:
            return
        if self._on_fenced(current, None):
            await self.release()
            logger.error(
                "commit fenced: another instance took leadership",
                extra={"epoch": epoch, "current_epoch": current},
            )
        else:
            logger.warning(
                "a commit of an earlier term was fenced; the current term goes on",
                extra={"epoch": epoch, "current_epoch": current},
            )
        raise FencedError(f"fenced: the stored epoch is {current}, this commit's is {epoch}")

    async def release(self) -> None:
        """Return the held connection to the pool (:meth:`HeldConnection.release`)."""
        await self.connections.release()


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
