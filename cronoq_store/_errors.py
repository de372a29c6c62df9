"""The store's errors: every type it raises, pure values.

The scheduler retries :class:`UnavailableError` and treats everything else as a bug or a
misconfiguration. Which driver failure becomes which of these is decided in one place,
:func:`cronoq_store._door.translate_error`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ._domain import show
from ._results import LockHolder

__all__ = [
    "BatchTooLargeError",
    "ClusterHostedError",
    "ClusterReplacedError",
    "CommitterClosedError",
    "FencedError",
    "IdCollisionError",
    "KeyTakenError",
    "LockHeldError",
    "MigrationError",
    "SchemaGoneError",
    "StoreError",
    "UnavailableError",
    "UnsupportedParameterError",
]


class StoreError(Exception):
    """Base of every error the store raises; the driver's exception is chained as cause."""

    #: Whether retrying the same call later can succeed.
    is_transient: bool = False


class UnavailableError(StoreError):
    """The database could not be reached or did not answer in time; retry later.

    Commits are idempotent, so retrying one that did land changes nothing.
    """

    is_transient = True

    def __init__(self, message: str, *, reconnect: bool = False) -> None:
        super().__init__(message)
        #: The pool's connections point at a server that can no longer take writes (a demoted
        #: primary); they should be dropped so new ones find the current primary.
        self.reconnect = reconnect


class LockHeldError(UnavailableError):
    """A lock the call needed stayed held by another session for longer than the call
    waits: the migration lock or the cluster's tables while it opens or migrates
    (``PgStoreConfig.migration_lock_timeout``), the leader table while it prunes
    (``commit_timeout``). Nothing was changed. The message names the sessions that held it
    when the call gave up (pid, role, application name, since when), and ``holders`` has
    them as ``pg_stat_activity`` showed them (empty when they let go as it gave up).
    Transient: the same call succeeds once they let go."""

    def __init__(self, message: str, holders: Sequence[LockHolder] = ()) -> None:
        super().__init__(message)
        self.holders = tuple(holders)


class FencedError(StoreError):
    """Another instance took leadership: this instance must never write again."""


class SchemaGoneError(FencedError):
    """The cluster's tables or columns that this build uses are gone (a forced downgrade, or
    a schema dropped by hand, while it ran): nothing of the failed call was written, and
    retrying cannot help. A leader steps down on it (``leadership_lost()`` returns); migrate
    the schema before any instance leads it again."""


class ClusterReplacedError(SchemaGoneError):
    """The schema no longer holds the cluster this store was opened on: its tables are gone,
    or another cluster's stand in their place (the schema was dropped and made again,
    renamed into another's place, or restored from a logical dump; docs/reliability.md,
    "The cluster's incarnation"). Nothing of the failed call was written, and retrying
    cannot help: a store never writes into a cluster it was not opened on. A leader steps
    down on it (``leadership_lost()`` returns). Open a new store to work on the cluster that
    stands there now.

    ``schema`` is the schema's name; ``incarnation`` the OID of the leader table this store
    was opened on; ``found`` the one found under the name now (``None``: its leader table or
    row is gone)."""

    def __init__(self, schema: str, incarnation: int, found: int | None, action: str) -> None:
        if found is None:
            now = f"no longer holds incarnation {incarnation} (its leader table or row is gone)"
        else:
            now = (
                f"holds incarnation {found}, not incarnation {incarnation} (dropped and made "
                "again, renamed, or restored from a dump)"
            )
        super().__init__(
            f"{action} failed: schema {schema!r} {now}, the cluster this store was opened on: "
            "this store must not write to it; open a new store"
        )
        self.schema = schema
        self.incarnation = incarnation
        self.found = found


class ClusterHostedError(StoreError):
    """A standalone ``PgStore`` was asked to lead a cluster enrolled in a host group: a host
    leads it, without the leader lock, so the store never takes its epoch. The lock was
    released and no epoch taken; a standby that waited for the lock is refused the same way
    once it gets it. Not transient: lead the cluster with that group's host, or remove it
    from the host group first.

    ``schema`` is the schema's name; ``group`` the host group it is enrolled in."""

    def __init__(self, schema: str, group: str, action: str) -> None:
        super().__init__(
            f"{action} failed: schema {schema!r} is enrolled in host group {group!r}: lead it "
            "with PgHost, or remove it from the host group first"
        )
        self.schema = schema
        self.group = group


class MigrationError(StoreError):
    """The schema cannot be migrated safely (newer than this build, foreign-owned, ...)."""


class IdCollisionError(StoreError):
    """A ``Submitted`` reuses the id of a different task (another seq, arrival, key, payload,
    ...); nothing of its batch was written. Not transient: the same batch fails again. The
    same submission sent again is not a collision (a no-op). ``ids`` are the ids named."""

    def __init__(self, ids: list[int], *, in_batch: bool = False) -> None:
        named = ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        where = "another Submitted in the same batch" if in_batch else "a different stored task"
        super().__init__(
            f"task id {named or '(gone when looked up)'} already taken by {where}: nothing of "
            "the batch was written (issue ids from Recovered.next_id, see task_id)"
        )
        self.ids = ids


class KeyTakenError(StoreError):
    """A ``Submitted`` gives a live task a key that another live task holds (keys are unique
    among live tasks; a finished task releases its key); nothing of its batch was written.
    Not transient: the same batch fails again. ``keys`` are every key of the batch taken so,
    sorted (empty only when the holders were gone when looked up). A batch that also reuses
    a stored id raises ``IdCollisionError`` instead: the batch is not what the store holds,
    so its keys mean nothing yet."""

    def __init__(self, keys: list[str]) -> None:
        more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
        named = ", ".join(map(show, keys[:5])) + more or "(gone when looked up)"
        super().__init__(
            f"committing a batch failed: {'keys' if len(keys) > 1 else 'key'} {named} "
            "held by another live task or given twice by the batch (a key is unique among "
            "live tasks): nothing of the batch was written"
        )
        self.keys = keys


class BatchTooLargeError(StoreError):
    """A batch (or one submission) is too large to commit in one transaction; never retried.

    PostgreSQL refuses a protocol message over 1 GiB by closing the connection, which would
    look like an outage; the store refuses such a batch before sending anything instead.
    """


class CommitterClosedError(StoreError):
    """The group committer was closed before this submission could be committed or confirmed.

    Raised by ``GroupCommitter.submit`` after ``GroupCommitter.close``, and given to pending
    submitters that a close without draining (or a drain that timed out) abandons. The
    message says whether the submission may nonetheless have been committed.
    """


class UnsupportedParameterError(ValueError):
    """A URL parameter the store cannot honour (or a value it does not know), refused by
    name before anything connects: a usage error. ``names`` are the parameters."""

    def __init__(self, message: str, names: Iterable[str]) -> None:
        super().__init__(message)
        self.names = tuple(names)
