"""Settings of one store instance, validated when built so a typo fails at start-up."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ._domain import check_seconds

__all__ = [
    "MIGRATION_LOCK_TIMEOUT",
    "PgStoreConfig",
    "keepalive_settings",
    "trusted_role_names",
    "trusted_trigger_names",
    "validate_schema_name",
]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: Words PostgreSQL reserves (``pg_get_keywords()``, categories R and T, on PostgreSQL 18)
#: that SQLAlchemy's dialect writes unquoted: no statement naming such a schema parses.
#: A test compares this with the server's list.
UNQUOTED_RESERVED = frozenset(
    {"collation", "concurrently", "lateral", "system_user", "tablesample"}
)

#: Seconds a migration waits for the schema's migration lock and its tables while other
#: sessions hold them (:attr:`PgStoreConfig.migration_lock_timeout`, ``cronoq-store migrate
#: --lock-timeout``, ``alembic -x lock_timeout=``): ten minutes, Kubernetes' default
#: progress deadline for a rollout, time to wait behind another instance's upgrade of a
#: large table.
MIGRATION_LOCK_TIMEOUT = 600.0


def validate_schema_name(schema: str) -> str:
    """Return ``schema`` if it is a plain PostgreSQL identifier, else raise ``ValueError``.

    Only ASCII letters, digits and ``_``, not starting with a digit, at most 63 characters
    (PostgreSQL truncates longer names silently, which would merge two clusters). Checked
    before the name reaches any statement, so quoting is never the only defence. The system's
    schemas (``pg_*``, ``information_schema``, in any case) are refused: they are not ours to
    fill, and ``pg_temp`` is a different schema in every session.
    """
    if not isinstance(schema, str):
        raise ValueError(f"schema name must be a string, got {type(schema).__name__}")
    if _IDENTIFIER.fullmatch(schema) is None:
        raise ValueError(
            f"invalid schema name {schema!r}: use 1 to 63 ASCII letters, digits and '_', "
            "not starting with a digit"
        )
    if schema in UNQUOTED_RESERVED:
        raise ValueError(
            f"invalid schema name {schema!r}: a word PostgreSQL reserves, which the "
            "statements would not quote; give the cluster another name"
        )
    if schema.lower().startswith("pg_") or schema.lower() == "information_schema":
        raise ValueError(
            f"invalid schema name {schema!r}: pg_* and information_schema are the system's "
            "schemas; give the cluster a schema of its own"
        )
    return schema


def trusted_trigger_names(names: Iterable[str]) -> frozenset[str]:
    """Validate the names of triggers an operator allows on the cluster's tables.

    Plain identifiers only, compared with ``pg_trigger.tgname`` exactly: a name that needs
    quoting to read right is more likely a mistake than an audit trigger.
    """
    if isinstance(names, (str, bytes)):
        raise ValueError(f"trusted_triggers must be a set of trigger names, not {names!r}")
    found = frozenset(names)
    for name in sorted(found, key=repr):
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
            raise ValueError(
                f"trusted_triggers: {name!r} is not a plain identifier (letters, digits and "
                "_, not starting with a digit, at most 63 characters)"
            )
    return found


def trusted_role_names(names: Iterable[str]) -> frozenset[str]:
    """Validate the names of roles an operator lets connect to the store's database.

    Compared with ``pg_roles.rolname`` exactly, as written (no case folding): any name
    PostgreSQL can hold, non-empty, without NUL, at most 63 bytes.
    """
    if isinstance(names, (str, bytes)):
        raise ValueError(f"trusted_roles must be a set of role names, not {names!r}")
    found = frozenset(names)
    for name in sorted(found, key=repr):
        if (
            not isinstance(name, str)
            or not name
            or "\x00" in name
            or len(name.encode("utf-8", "surrogatepass")) > 63
        ):
            raise ValueError(f"trusted_roles: {name!r} is not a role name (1 to 63 bytes, no NUL)")
    return found


@dataclass(frozen=True, slots=True)
class PgStoreConfig:
    """Store settings; durations are float seconds, as asyncio and asyncpg take them."""

    #: PostgreSQL schema holding this cluster's tables (created if missing). Instances with
    #: the same schema form one active-passive cluster; different schemas share nothing.
    schema: str = "public"
    #: How long finished tasks are loaded on recovery, for key deduplication. Finished tasks
    #: that live tasks depend on are always loaded.
    retention: float = 3600.0
    #: Interval between attempts to take the leader lock.
    lock_poll: float = 0.5
    #: Interval of liveness checks on the leader lock session.
    keepalive: float = 1.0
    #: How long the lock session may stay unresponsive before this instance steps down;
    #: also the idle time of that session's server-side TCP keepalive.
    session_timeout: float = 10.0
    #: Upper bound on one commit; a slower commit fails as ``UnavailableError``.
    commit_timeout: float = 30.0
    #: Size of the connection pool used for commits and queries (``connect`` only: an engine
    #: given to ``from_engine`` keeps its own pool). From 3 on, a leader keeps one of them
    #: checked out for its commits for the whole term.
    max_connections: int = 8
    #: ``application_name`` of the store's sessions, as ``pg_stat_activity`` shows them.
    application_name: str = "cronoq-store"
    #: Triggers an operator put on the cluster's tables on purpose (an audit, CDC), by name.
    #: Our migrations create none, so the trust check refuses every other one; a trigger named
    #: here is still refused if it has a ``WHEN`` clause or runs a function of a role the
    #: store cannot trust (docs/reliability.md, "Whose schema the store trusts").
    trusted_triggers: frozenset[str] = frozenset()
    #: Login roles besides the store's own (and superusers, and roles that can act as the
    #: lock session's role) that may connect to the database, by exact name: a monitoring
    #: role, say. Any role that can connect can take the leader lock and stop every
    #: instance from leading, so the store refuses to lead where ``PUBLIC`` or any other
    #: login role has ``CONNECT`` (docs/reliability.md, "Who holds the lock").
    trusted_roles: frozenset[str] = frozenset()
    #: ``True`` leads even where untrusted roles may connect (a shared database whose grants
    #: the operator cannot change): logged as a warning at every acquisition; a foreign
    #: lock holder is then possible, and ``health`` reports it.
    allow_untrusted_connect: bool = False
    #: ``False`` for a pool behind a transaction-pooling PgBouncer older than 1.21, which
    #: cannot keep a named prepared statement past the transaction that made it: pooled
    #: connections then run unnamed statements only (asyncpg's and SQLAlchemy's statement
    #: caches off) and send no server settings at connection start, which such a PgBouncer
    #: refuses; the store then requires its ``search_path`` to be set by PgBouncer or for
    #: the role (docs/reliability.md, "PgBouncer"). The leader lock session, direct
    #: through ``lock_url``, is not affected.
    prepared_statements: bool = True
    #: How long opening the store (or ``migrate()``) waits, when the schema needs an
    #: upgrade, for the schema's migration lock and its tables while other sessions hold
    #: them, logging who does (another instance upgrading the same schema, ops running
    #: ``cronoq-store migrate`` or Alembic, any session that took the lock); then it gives
    #: up with ``LockHeldError`` naming them (:data:`MIGRATION_LOCK_TIMEOUT`). A schema
    #: already at this build's head takes no lock.
    migration_lock_timeout: float = MIGRATION_LOCK_TIMEOUT

    def __post_init__(self) -> None:
        validate_schema_name(self.schema)
        object.__setattr__(self, "trusted_triggers", trusted_trigger_names(self.trusted_triggers))
        object.__setattr__(self, "trusted_roles", trusted_role_names(self.trusted_roles))
        if not isinstance(self.allow_untrusted_connect, bool):
            raise ValueError(
                f"allow_untrusted_connect must be a bool, got {self.allow_untrusted_connect!r}"
            )
        for name in (
            "retention",
            "lock_poll",
            "keepalive",
            "session_timeout",
            "commit_timeout",
            "migration_lock_timeout",
        ):
            check_seconds(name, getattr(self, name))
        if self.keepalive >= self.session_timeout:
            raise ValueError(
                f"keepalive ({self.keepalive}s) must be shorter than session_timeout "
                f"({self.session_timeout}s), or a slow check could never be told from a dead one"
            )
        if self.lock_poll >= self.session_timeout:
            raise ValueError(
                f"lock_poll ({self.lock_poll}s) must be shorter than session_timeout "
                f"({self.session_timeout}s): a standby's lock session idle for longer than "
                "1.5 x session_timeout is ended by the server"
            )
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise ValueError(f"max_connections must be an int, got {self.max_connections!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {self.max_connections}")
        if not self.application_name or "\x00" in self.application_name:
            raise ValueError("application_name must be a non-empty string without NUL")
        if not isinstance(self.prepared_statements, bool):
            raise ValueError(
                f"prepared_statements must be a bool, got {self.prepared_statements!r}"
            )


def keepalive_settings(config: PgStoreConfig) -> dict[str, str]:
    """Server settings that end a session whose client vanished, within about
    ``session_timeout``: TCP keepalives (idle ``session_timeout``, then three probes a second
    apart) for a session waiting on its client, and ``tcp_user_timeout`` for one whose
    replies go unacknowledged. A pool session cut off inside a commit holds the leader row
    (``FOR SHARE`` or the epoch update): without these the server keeps it, and blocks every
    takeover, until the kernel gives up on the socket, which can take hours."""
    return {
        "tcp_keepalives_idle": str(max(1, int(config.session_timeout))),
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": str(round(config.session_timeout * 1000)),
    }
