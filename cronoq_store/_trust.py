"""The trust checks: who may control the cluster's schema, and who may connect to its
database, as catalog statements any session can run and the refusals that name what they
found.

Alembic's environment (:mod:`cronoq_store._migrations`) and the CLI run
:func:`refuse_untrusted` before touching a schema; the leader lock session runs
:class:`TrustCheck` and :class:`ConnectCheck` at every acquisition
(:class:`~cronoq_store._leadership.Leadership`). Kept apart from the environment so that
leadership does not import Alembic's. Every statement needs ``search_path`` =
``pg_catalog, pg_temp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection, Executable, Text, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY

from . import _statements as st
from ._errors import MigrationError
from ._schema import LEGACY_VERSION_TABLE, VERSION_TABLE, metadata

__all__ = ["ConnectCheck", "TrustCheck", "refuse_untrusted", "untrusted_among"]

# Every table the store creates in the cluster's schema, Alembic's and the legacy one too.
_OUR_TABLES = sorted({*metadata.tables, VERSION_TABLE, LEGACY_VERSION_TABLE})


# Who may own the schema or anything in it, or create in it: a role that can already act with
# our privileges (pg_has_role(..., 'USAGE') is true for ourselves, for superusers and for
# roles that inherit ours), so code it plants gains it nothing. Not a role we are merely a
# member of: its other members could plant code that would then run with our privileges.
# pg_database_owner (owner of `public` since PG 15) stands for the database's owner.
#
# Each finding comes with the schema it is about (nsp), for the schemas {which} picks (a
# condition on pg_namespace): one text checks one schema or many, so the two cannot
# disagree. A foreign key counts as from elsewhere unless it is from our tables of the same
# schema. Our tables are found through pg_class's (relname, relnamespace) index, the
# schema's other objects through pg_depend's (see inside).
_CHECK = """
SELECT {columns} FROM (
WITH ns AS (
    SELECT oid, nspname, nspowner, nspacl FROM pg_namespace WHERE {which}
), ours AS (
    SELECT c.oid, ns.nspname, c.relowner, c.relacl
    FROM pg_class c JOIN ns ON c.relnamespace = ns.oid
    WHERE c.relname = ANY (:tables)
), inside AS (
    -- Every object created in a schema records a dependency on it, found through
    -- pg_depend's (refclassid, refobjid) index; the catalogs' namespace columns have no
    -- index, and with thousands of cluster schemas each scan of pg_class or pg_type took
    -- tens of milliseconds. Not recorded: indexes (their table's), table row types and
    -- implicit arrays (their owner is their table's, or element type's, for good), and a
    -- composite type's pg_class row (its pg_type row is). Only a superuser may edit
    -- pg_depend; every CREATE, SET SCHEMA or OR REPLACE writes the row again.
    SELECT d.classid, d.objid, ns.nspname FROM ns
    JOIN pg_depend d ON d.refclassid = 'pg_namespace'::regclass AND d.refobjid = ns.oid
        AND d.refobjsubid = 0
), found (nsp, what, how, role) AS (
    SELECT nspname, 'schema ' || quote_ident(nspname), 'owned by', nspowner FROM ns
    UNION ALL SELECT i.nspname, CASE c.relkind WHEN 'v' THEN 'view '
            WHEN 'm' THEN 'materialized view ' WHEN 'S' THEN 'sequence '
            WHEN 'f' THEN 'foreign table ' WHEN 'c' THEN 'type '
            ELSE 'table ' END || c.oid::regclass::text, 'owned by', c.relowner
        FROM inside i JOIN pg_class c ON i.classid = 'pg_class'::regclass AND c.oid = i.objid
    UNION ALL SELECT i.nspname, CASE p.prokind WHEN 'p' THEN 'procedure '
            WHEN 'a' THEN 'aggregate ' ELSE 'function ' END || p.oid::regprocedure::text,
            'owned by', p.proowner
        FROM inside i JOIN pg_proc p ON i.classid = 'pg_proc'::regclass AND p.oid = i.objid
    UNION ALL SELECT i.nspname, 'operator ' || o.oid::regoperator::text, 'owned by', o.oprowner
        FROM inside i
        JOIN pg_operator o ON i.classid = 'pg_operator'::regclass AND o.oid = i.objid
    UNION ALL SELECT i.nspname, 'type ' || t.oid::regtype::text, 'owned by', t.typowner
        FROM inside i JOIN pg_type t ON i.classid = 'pg_type'::regclass AND t.oid = i.objid
    UNION ALL SELECT i.nspname, 'collation ' || c.oid::regcollation::text, 'owned by',
            c.collowner
        FROM inside i
        JOIN pg_collation c ON i.classid = 'pg_collation'::regclass AND c.oid = i.objid
    UNION ALL SELECT i.nspname, 'conversion ' || quote_ident(c.conname), 'owned by',
            c.conowner
        FROM inside i
        JOIN pg_conversion c ON i.classid = 'pg_conversion'::regclass AND c.oid = i.objid
    UNION ALL SELECT i.nspname, 'operator class ' || quote_ident(c.opcname), 'owned by',
            c.opcowner
        FROM inside i
        JOIN pg_opclass c ON i.classid = 'pg_opclass'::regclass AND c.oid = i.objid
    UNION ALL SELECT i.nspname, 'operator family ' || quote_ident(f.opfname), 'owned by',
            f.opfowner
        FROM inside i
        JOIN pg_opfamily f ON i.classid = 'pg_opfamily'::regclass AND f.oid = i.objid
    UNION ALL SELECT i.nspname, 'text search configuration ' || c.oid::regconfig::text,
            'owned by', c.cfgowner
        FROM inside i
        JOIN pg_ts_config c ON i.classid = 'pg_ts_config'::regclass AND c.oid = i.objid
    UNION ALL SELECT i.nspname, 'text search dictionary ' || d.oid::regdictionary::text,
            'owned by', d.dictowner
        FROM inside i
        JOIN pg_ts_dict d ON i.classid = 'pg_ts_dict'::regclass AND d.oid = i.objid
    UNION ALL SELECT i.nspname, 'statistics ' || quote_ident(x.stxname), 'owned by',
            x.stxowner
        FROM inside i
        JOIN pg_statistic_ext x ON i.classid = 'pg_statistic_ext'::regclass AND x.oid = i.objid
    -- A role with CREATE on the database may install a trusted extension into any schema
    -- (CREATE on the schema is not asked): its objects are the bootstrap superuser's, the
    -- extension is that role's, to update, move or drop.
    UNION ALL SELECT i.nspname, 'extension ' || quote_ident(e.extname), 'owned by',
            e.extowner
        FROM inside i
        JOIN pg_extension e ON i.classid = 'pg_extension'::regclass AND e.oid = i.objid
    UNION ALL SELECT nspname, 'CREATE on schema ' || quote_ident(nspname), 'granted to',
            a.grantee
        FROM ns, aclexplode(ns.nspacl) a WHERE a.privilege_type = 'CREATE'
    -- TRIGGER could plant code; REFERENCES a foreign key, whose internal triggers run the
    -- referencing table's cascades inside our deletes.
    UNION ALL SELECT ours.nspname, a.privilege_type || ' on ' || ours.oid::regclass::text,
            'granted to', a.grantee
        FROM ours, aclexplode(ours.relacl) a
        WHERE a.privilege_type IN ('TRIGGER', 'REFERENCES')
    -- REFERENCES on a column (pg_attribute's own ACL) is enough for a key onto it.
    UNION ALL SELECT ours.nspname, 'REFERENCES on ' || ours.oid::regclass::text || ' ('
            || quote_ident(att.attname) || ')', 'granted to', a.grantee
        FROM ours JOIN pg_attribute att ON att.attrelid = ours.oid AND att.attnum > 0
            AND att.attacl IS NOT NULL, aclexplode(att.attacl) a
        WHERE a.privilege_type = 'REFERENCES'
    -- What a trigger runs: its function and whatever its WHEN clause calls (pg_depend),
    -- operators by the function that implements them too.
    UNION ALL SELECT ours.nspname, 'trigger ' || quote_ident(tg.tgname) || ' on '
            || ours.oid::regclass::text || ' runs ' || CASE WHEN p.oid IS NOT NULL
                THEN 'function ' || p.oid::regprocedure::text
                ELSE 'operator ' || o.oid::regoperator::text END,
            'owned by', COALESCE(p.proowner, o.oprowner)
        FROM pg_trigger tg JOIN ours ON tg.tgrelid = ours.oid
        JOIN pg_depend d ON d.classid = 'pg_trigger'::regclass AND d.objid = tg.oid
        LEFT JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass
            AND o.oid = d.refobjid
        LEFT JOIN pg_proc p ON (d.refclassid = 'pg_proc'::regclass AND p.oid = d.refobjid)
            OR p.oid = o.oprcode
        WHERE NOT tg.tgisinternal AND (p.oid IS NOT NULL OR o.oid IS NOT NULL)
), db AS (
    SELECT d.datdba, 'pg_database_owner'::regrole::oid AS stand_in
    FROM pg_database d WHERE d.datname = current_database()
)
SELECT nsp, what || ' ' || how || ' ' ||
    CASE WHEN role = 0 THEN 'PUBLIC' ELSE role::regrole::text END AS finding
FROM found, db
WHERE role = 0 OR NOT pg_has_role(
    CASE WHEN role = db.stand_in THEN db.datdba ELSE role END, current_user, 'USAGE')
UNION ALL
SELECT ours.nspname, 'rule ' || quote_ident(r.rulename) || ' on ' || ours.oid::regclass::text
FROM pg_rewrite r JOIN ours ON r.ev_class = ours.oid
-- A foreign key from elsewhere, whoever owns it: its internal triggers run the other table's
-- actions (and that table's triggers) inside prune's deletes, or make every prune fail.
UNION ALL
SELECT r.nspname, 'foreign key ' || quote_ident(k.conname) || ' of '
    || k.conrelid::regclass::text || ' references ' || r.oid::regclass::text
FROM (
    -- A foreign key depends on each column it references (pg_depend's index again: no
    -- index on confrelid), one row per column.
    SELECT DISTINCT d.objid AS key_oid, ours.oid, ours.nspname FROM ours
    JOIN pg_depend d ON d.refclassid = 'pg_class'::regclass AND d.refobjid = ours.oid
        AND d.classid = 'pg_constraint'::regclass
) r
JOIN pg_constraint k ON k.oid = r.key_oid AND k.confrelid = r.oid
WHERE k.contype = 'f'
    AND k.conrelid NOT IN (SELECT o.oid FROM ours o WHERE o.nspname = r.nspname)
-- Our migrations create no trigger: each must be one the operator named, and even then
-- without a WHEN clause (it can call anything, through a cast to a domain, say).
UNION ALL
SELECT ours.nspname, 'trigger ' || quote_ident(tg.tgname) || ' on '
    || ours.oid::regclass::text
    || CASE WHEN tg.tgname::text = ANY (:triggers) THEN ' has a WHEN clause'
        ELSE ' was not created by cronoq-store and is not one of the trusted_triggers' END
FROM pg_trigger tg JOIN ours ON tg.tgrelid = ours.oid
WHERE NOT tg.tgisinternal
    AND (tg.tgqual IS NOT NULL OR NOT tg.tgname::text = ANY (:triggers))
) found_in ORDER BY {columns}
"""


def _check(which: str, columns: str) -> str:
    """The check of the schemas ``which`` picks, each row the ``columns`` named."""
    return _CHECK.replace("{which}", which).replace("{columns}", columns)


_UNTRUSTED = text(_check("nspname = :schema", "finding")).bindparams(
    bindparam("tables", type_=ARRAY(Text)), bindparam("triggers", type_=ARRAY(Text))
)

# The check of every schema in :schemas in one statement: each catalog is read once for all
# of them (most of a check's time, where thousands of schemas fill pg_class).
_UNTRUSTED_AMONG = text(_check("nspname = ANY (:schemas)", "nsp, finding")).bindparams(
    bindparam("schemas", type_=ARRAY(Text)),
    bindparam("tables", type_=ARRAY(Text)),
    bindparam("triggers", type_=ARRAY(Text)),
)


@dataclass(frozen=True, slots=True)
class TrustCheck:
    """The trust check of one schema, as a statement any session can run and a verdict.

    :func:`refuse_untrusted` runs it on a migration's or a command's connection; the leader
    lock session runs it after taking the lock, before the epoch bump that would fire a
    trigger on the leader row (:class:`~cronoq_store._leadership.Leadership`). Needs
    ``search_path`` = ``pg_catalog, pg_temp``.
    """

    schema: str
    #: Triggers the operator allows on our tables (``PgStoreConfig.trusted_triggers``).
    trusted_triggers: frozenset[str] = frozenset()
    #: The tables of ours in the schema, whose triggers, rules, grants and foreign keys the
    #: check looks at; empty means a cluster's. The host's control schema names its own.
    tables: tuple[str, ...] = ()

    statement: ClassVar[Executable] = _UNTRUSTED
    #: Who the check ran as, for the refusal.
    current_user: ClassVar[Executable] = st.current_user

    @property
    def params(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "tables": list(self.tables) or _OUR_TABLES,
            "triggers": sorted(self.trusted_triggers),
        }

    def refusal(self, found: Sequence[str], me: str) -> MigrationError:
        """The error naming everything ``found`` (as ``me``, the role the check ran as)."""
        return MigrationError(
            f"schema {self.schema!r} is not safe to use, refusing it: {'; '.join(found)}. "
            f"Only {me!r}, superusers and roles that can act as {me!r} (members of it that "
            "inherit its privileges) may own the schema or anything in it, create in it or "
            "hold TRIGGER or REFERENCES on its tables or write the code their triggers run; "
            "nothing may add rules to them or reference them by foreign key, and a trigger "
            "on them must be named in trusted_triggers and have no WHEN clause"
        )


# Who can connect to the database: PUBLIC, and each login role that has CONNECT (directly,
# through PUBLIC or through a role it inherits from) and is neither one that can act as us
# (the test of _UNTRUSTED: pg_has_role(..., current_user, 'USAGE')) nor named by the
# operator. pg_roles and has_database_privilege answer about any role.
_UNTRUSTED_CONNECT = text(
    """
SELECT 'PUBLIC' WHERE has_database_privilege('public', current_database(), 'CONNECT')
UNION ALL (
    SELECT quote_ident(r.rolname) FROM pg_roles r
    WHERE r.rolcanlogin AND has_database_privilege(r.oid, current_database(), 'CONNECT')
        AND NOT pg_has_role(r.oid, current_user, 'USAGE')
        AND NOT r.rolname::text = ANY (:roles)
    ORDER BY 1
)
"""
).bindparams(bindparam("roles", type_=ARRAY(Text)))

#: How many untrusted roles a refusal names before it counts the rest.
_NAMED_ROLES = 10


@dataclass(frozen=True, slots=True)
class ConnectCheck:
    """Who besides trusted roles may connect to the store's database: any such role can
    take the leader lock (``pg_locks`` shows every key to everyone) and stop every instance
    from leading. The lock session runs it before it polls for the lock
    (:class:`~cronoq_store._leadership.Leadership`). Trusted are the lock session's role,
    superusers, roles that can act as it, and ``trusted_roles`` (by exact name). Needs
    ``search_path`` = ``pg_catalog, pg_temp``.
    """

    #: Roles the operator lets connect (``PgStoreConfig.trusted_roles``), and the store's
    #: pool role.
    trusted_roles: frozenset[str] = frozenset()

    statement: ClassVar[Executable] = _UNTRUSTED_CONNECT
    database: ClassVar[Executable] = st.current_database

    @property
    def params(self) -> dict[str, Any]:
        return {"roles": sorted(self.trusted_roles)}

    def refusal(self, found: Sequence[str], database: str, me: str) -> MigrationError:
        """The error naming who may connect to ``database`` (as ``me`` saw it), and the fix."""
        named = ", ".join(found[:_NAMED_ROLES])
        if len(found) > _NAMED_ROLES:
            named += f" and {len(found) - _NAMED_ROLES} more"
        quoted = '"' + database.replace('"', '""') + '"'
        return MigrationError(
            f"database {database!r} lets roles the store does not trust connect, refusing to "
            f"lead: CONNECT is granted to {named}. Any role that can connect can take the "
            "leader lock and stop every instance from leading. Run `REVOKE CONNECT ON "
            f"DATABASE {quoted} FROM PUBLIC`, grant CONNECT only to the store's roles and "
            f"those you trust, and name the latter in trusted_roles (trusted already: {me!r}, "
            f"superusers and roles that can act as {me!r}); or set "
            "allow_untrusted_connect=True to lead anyway (docs/reliability.md, "
            '"Who holds the lock")'
        )


def refuse_untrusted(
    conn: Connection,
    schema: str,
    trusted_triggers: frozenset[str] = frozenset(),
    *,
    tables: tuple[str, ...] = (),
) -> None:
    """Raise :class:`~cronoq_store.MigrationError` naming every object of ``schema`` that a
    role we cannot trust controls; run before the first statement that touches the schema,
    and again after migrating (in the same transaction: tables the migration just created
    may carry default privileges).

    Refused: the schema, or any object in it, owned by such a role; such a role (or
    ``PUBLIC``) holding ``CREATE`` on the schema or ``TRIGGER`` or ``REFERENCES`` on our tables
    or on any of their columns (it could plant code after this check); any rule on our
    tables, and any foreign key from another table to them; any trigger on our tables (our
    migrations create none) unless it is named in ``trusted_triggers``, has no ``WHEN``
    clause and runs a function of a trusted role. Trusted are the connecting role,
    superusers and roles that can already act with the connecting role's privileges.
    ``tables``: our tables in ``schema`` (:attr:`TrustCheck.tables`), a cluster's if empty.
    Needs ``search_path`` = ``pg_catalog, pg_temp``.
    """
    check = TrustCheck(schema, trusted_triggers, tables)
    found = conn.execute(check.statement, check.params).scalars().all()
    if found:
        raise check.refusal(found, conn.execute(check.current_user).scalar_one())


def untrusted_among(
    conn: Connection, schemas: Sequence[str], trusted_triggers: frozenset[str] = frozenset()
) -> dict[str, MigrationError]:
    """The refusal :func:`refuse_untrusted` would raise for each of ``schemas`` it refuses,
    from one statement: every catalog is read once for all of them, where checking each
    alone reads them all again (at thousands of schemas, most of a check's time). Needs
    ``search_path`` = ``pg_catalog, pg_temp``.
    """
    if not schemas:
        return {}
    params = {**TrustCheck("", trusted_triggers).params, "schemas": list(schemas)}
    del params["schema"]
    found: dict[str, list[str]] = {}
    for schema, finding in conn.execute(_UNTRUSTED_AMONG, params):
        found.setdefault(schema, []).append(finding)
    if not found:
        return {}
    me = conn.execute(TrustCheck.current_user).scalar_one()
    return {
        schema: TrustCheck(schema, trusted_triggers).refusal(findings, me)
        for schema, findings in found.items()
    }
