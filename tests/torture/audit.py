"""The test's instrument inside the database: every committed row version, every epoch.

Triggers on the cluster's tables append to tables of a separate schema (``torture_audit``):

- ``writes``: each row version of ``cronoq_tasks`` that a statement inserted or updated,
  with the epoch stored in ``cronoq_leader`` as that statement saw it, the writing session's
  ``application_name`` and its transaction id;
- ``epochs``: each change of the leader row's epoch (a takeover), with the same.

Statement-level triggers with transition tables keep the cost to one extra statement per
statement. The audit rows commit or roll back with the transaction that wrote them, so they
record exactly what landed. With ``track_commit_timestamp = on`` the server keeps each
transaction's commit time, which orders every write against every takeover.

No trigger has a ``WHEN`` clause (the store refuses those: a condition can call any code):
the epoch trigger tests its condition in its function. The stores trust the triggers by
name (:data:`TRIGGERS`). The functions are ``SECURITY DEFINER`` so that a store role
without rights on the audit schema (the lock role) still records; they are owned by the
superuser that installs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import URL

from cronoq_store._config import validate_schema_name

from ..pgharness import admin_execute

__all__ = [
    "AUDIT_SCHEMA",
    "TRIGGERS",
    "AuditWrite",
    "EpochTake",
    "fetch_epochs",
    "fetch_writes",
    "install",
]

AUDIT_SCHEMA = "torture_audit"
#: The audit's triggers on the cluster's tables: every store of the run must trust them by
#: name (``PgStoreConfig.trusted_triggers``), or it refuses the schema.
TRIGGERS = frozenset({"torture_audit_insert", "torture_audit_update", "torture_audit_epoch"})


def _ddl(schema: str) -> list[str]:
    s = validate_schema_name(schema)
    a = AUDIT_SCHEMA
    return [
        f"CREATE SCHEMA {a}",
        f"""CREATE TABLE {a}.writes (
            id bigint NOT NULL,
            status text NOT NULL,
            attempt int NOT NULL,
            message text,
            op text NOT NULL,
            seen_epoch int,
            app text NOT NULL DEFAULT current_setting('application_name'),
            xid xid8 NOT NULL DEFAULT pg_current_xact_id())""",
        f"""CREATE TABLE {a}.epochs (
            epoch int NOT NULL,
            app text NOT NULL DEFAULT current_setting('application_name'),
            xid xid8 NOT NULL DEFAULT pg_current_xact_id())""",
        f"""CREATE FUNCTION {a}.record_tasks() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            BEGIN
                INSERT INTO {a}.writes (id, status, attempt, message, op, seen_epoch)
                SELECT n.id, n.status, n.attempt, n.message, TG_OP,
                       (SELECT l.epoch FROM "{s}".cronoq_leader l WHERE l.id = 1)
                FROM new_rows n;
                RETURN NULL;
            END $$""",
        f"""CREATE TRIGGER torture_audit_insert AFTER INSERT ON "{s}".cronoq_tasks
            REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION {a}.record_tasks()""",
        f"""CREATE TRIGGER torture_audit_update AFTER UPDATE ON "{s}".cronoq_tasks
            REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION {a}.record_tasks()""",
        f"""CREATE FUNCTION {a}.record_epoch() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
            BEGIN
                IF OLD.epoch IS DISTINCT FROM NEW.epoch THEN
                    INSERT INTO {a}.epochs (epoch) VALUES (NEW.epoch);
                END IF;
                RETURN NULL;
            END $$""",
        f"""CREATE TRIGGER torture_audit_epoch AFTER UPDATE OF epoch ON "{s}".cronoq_leader
            FOR EACH ROW EXECUTE FUNCTION {a}.record_epoch()""",
    ]


async def install(url: URL, schema: str) -> None:
    """Install the audit on the migrated cluster ``schema`` (``url``: a superuser)."""
    for statement in _ddl(schema):
        await admin_execute(url, statement)


@dataclass(frozen=True, slots=True)
class AuditWrite:
    """One committed version of a task row."""

    id: int
    status: str
    attempt: int
    message: str | None
    op: str
    seen_epoch: int | None
    app: str
    committed: datetime


@dataclass(frozen=True, slots=True)
class EpochTake:
    """One committed epoch bump: a takeover."""

    epoch: int
    app: str
    committed: datetime


async def fetch_writes(url: URL) -> list[AuditWrite]:
    rows = await admin_execute(
        url,
        f"SELECT id, status, attempt, message, op, seen_epoch, app, "
        f"pg_xact_commit_timestamp(xid::xid) AS committed FROM {AUDIT_SCHEMA}.writes",
    )
    return [AuditWrite(*r) for r in rows]


async def fetch_epochs(url: URL) -> list[EpochTake]:
    rows = await admin_execute(
        url,
        f"SELECT epoch, app, pg_xact_commit_timestamp(xid::xid) AS committed "
        f"FROM {AUDIT_SCHEMA}.epochs ORDER BY committed",
    )
    return [EpochTake(*r) for r in rows]
