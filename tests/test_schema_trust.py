"""No role becomes superuser through the cluster's schema (the CVE-2018-1058 class).

Each attack is planted by a real unprivileged role; the store then connects as a superuser
through one of its entry points. The tests prove that the planted code never ran (the
attacker is still not superuser) and that the store said what it refused and whose it is.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, replace

import asyncpg
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from cronoq_store._cli import ExitCode, cli
from cronoq_store._commit_path import COPY_MIN_ROWS
from cronoq_store._config import PgStoreConfig
from cronoq_store._console import reads
from cronoq_store._console.source import Source
from cronoq_store._domain import StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus, task_id
from cronoq_store._errors import MigrationError
from cronoq_store._host.host import HostedStore, PgHost, PgHostConfig
from cronoq_store._migrations import upgrade
from cronoq_store._store import PgStore
from cronoq_store._trust import refuse_untrusted, untrusted_among
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import PROCESS_BASE, ROOT
from .waits import bounded


@dataclass(frozen=True)
class Attacker:
    name: str
    url: URL


@pytest.fixture
async def attacker(pg_url: URL, schema: str) -> AsyncIterator[Attacker]:
    """A login role with CREATE on the database, as many roles have."""
    name, password = f"{schema}_atk", secrets.token_urlsafe(18)
    try:
        await admin_execute(pg_url, f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    except asyncpg.InsufficientPrivilegeError:
        pytest.skip("needs a server where the suite may create roles")
    try:
        await admin_execute(
            pg_url, f'GRANT CONNECT, CREATE ON DATABASE "{pg_url.database}" TO {name}'
        )
        yield Attacker(name, pg_url.set(username=name, password=password))
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin_execute(pg_url, f"DROP OWNED BY {name}")
        await admin_execute(pg_url, f"DROP ROLE {name}")


async def is_superuser(pg_url: URL, role: str) -> bool:
    rows = await admin_execute(pg_url, "SELECT rolsuper FROM pg_roles WHERE rolname = $1", role)
    return bool(rows[0][0])


def escalating_function(
    where: str,
    attacker: str,
    args: str,
    result: str,
    *,
    witness: str | None = None,
    value: str = "false",
) -> str:
    """A function that makes ``attacker`` superuser when a superuser calls it, returning
    ``value`` (``NEW`` for a trigger). With ``witness`` (a sequence), each call also draws
    from it, which no rollback undoes: the call shows even where the caller's transaction
    rolled the escalation back (a read), as a payload that acts outside the transaction
    (``COPY ... TO PROGRAM``) would."""
    draw = "" if witness is None else f"PERFORM pg_catalog.nextval('{witness}'); "
    returned = "NEW" if result == "trigger" else value
    return (
        f"CREATE FUNCTION {where}({args}) RETURNS {result} LANGUAGE plpgsql AS $$ "
        f"BEGIN {draw}ALTER ROLE {attacker} SUPERUSER; RETURN {returned}; END $$"
    )


async def plant_operator(attacker: Attacker, schema: str) -> None:
    """The schema, pre-created by the attacker, with ``=(name, varchar)``: a catalog lookup
    that compares ``relname`` with a varchar parameter matches it exactly."""
    await admin_execute(attacker.url, f"CREATE SCHEMA {schema}")
    await admin_execute(
        attacker.url, escalating_function(f"{schema}.f", attacker.name, "name, varchar", "bool")
    )
    await admin_execute(
        attacker.url,
        f"CREATE OPERATOR {schema}.= (LEFTARG = name, RIGHTARG = varchar, FUNCTION = {schema}.f)",
    )


def config(schema: str) -> PgStoreConfig:
    """The attacker may connect (it plants what these tests refuse): trusted to connect, not
    to plant, so that acquisitions meet the schema's trust check."""
    return PgStoreConfig(
        schema=schema,
        lock_poll=0.05,
        keepalive=0.2,
        session_timeout=1.0,
        trusted_roles=frozenset({f"{schema}_atk"}),
    )


def refused(schema: str, attacker: str) -> list[str]:
    """What the refusal of the planted operator must name."""
    return [
        f"schema {schema!r} is not safe to use",
        f"schema {schema} owned by {attacker}",
        f"operator {schema}.=(name,character varying) owned by {attacker}",
    ]


async def cronoq_tables(pg_url: URL, schema: str) -> list[str]:
    rows = await admin_execute(
        pg_url, "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", schema
    )
    return [r[0] for r in rows]


# --- a planted operator, through every entry point ------------------------------------------


@pytest.mark.parametrize("entry", ["connect", "from_engine"])
async def test_opening_a_store_refuses_a_schema_with_a_planted_operator(
    pg_url: URL, schema: str, attacker: Attacker, engine: AsyncEngine, entry: str
) -> None:
    await plant_operator(attacker, schema)
    for migrate in (True, False):
        opening = (
            PgStore.connect(pg_url, config(schema), migrate=migrate)
            if entry == "connect"
            else PgStore.from_engine(engine, config(schema), migrate=migrate)
        )
        with pytest.raises(MigrationError) as info:
            await opening
        for said in refused(schema, attacker.name):
            assert said in str(info.value)
    assert not await is_superuser(pg_url, attacker.name)
    assert await cronoq_tables(pg_url, schema) == []


async def test_alembic_upgrade_refuses_a_schema_with_a_planted_operator(
    pg_url: URL, schema: str, attacker: Attacker
) -> None:
    await plant_operator(attacker, schema)
    env = {**os.environ, "CRONOQ_DATABASE_URL": pg_url.render_as_string(hide_password=False)}
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "alembic", "-x", f"schema={schema}", "upgrade", "head"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    for said in refused(schema, attacker.name):
        assert said in result.stdout
    assert not await is_superuser(pg_url, attacker.name)
    assert await cronoq_tables(pg_url, schema) == []


@pytest.mark.parametrize("command", ["migrate", "status"])
async def test_the_cli_refuses_a_schema_with_a_planted_operator(
    pg_url: URL, schema: str, attacker: Attacker, command: str
) -> None:
    await plant_operator(attacker, schema)
    url = pg_url.render_as_string(hide_password=False)
    result = await asyncio.to_thread(
        CliRunner().invoke, cli, ["--url", url, "--schema", schema, command]
    )
    assert result.exit_code == ExitCode.FAILED, result.output
    for said in refused(schema, attacker.name):
        assert said in result.stderr
    assert not await is_superuser(pg_url, attacker.name)
    assert await cronoq_tables(pg_url, schema) == []


# --- triggers on our tables -----------------------------------------------------------------


async def plant_trigger(attacker: Attacker, schema: str) -> str:
    """A trigger on ``cronoq_tasks`` whose function (in the attacker's own schema) escalates."""
    own = f"{attacker.name}_own"
    await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
    await admin_execute(attacker.url, escalating_function(f"{own}.t", attacker.name, "", "trigger"))
    await admin_execute(
        attacker.url,
        f"CREATE TRIGGER planted BEFORE INSERT OR UPDATE ON {schema}.cronoq_tasks "
        f"FOR EACH ROW EXECUTE FUNCTION {own}.t()",
    )
    return (
        f"trigger planted on {schema}.cronoq_tasks runs function {own}.t() owned by {attacker.name}"
    )


async def commit_one_task(store: PgStore) -> None:
    # A store that never led may commit at the stored epoch (0 after migrating).
    await store.commit(
        0, PROCESS_BASE, [Submitted(TaskId(1), 1, PROCESS_BASE.engine_ns, TaskSpec(b"x"))], []
    )


async def open_and_update(opening: Awaitable[PgStore]) -> None:
    """Open a store, insert a task and update it: on a build that does not refuse, the
    trigger's WHEN clause runs."""
    async with await opening as store:
        await commit_one_task(store)
        change = StatusChanged(TaskId(1), TaskStatus.RUNNING, 1, PROCESS_BASE.engine_ns)
        await store.commit(0, PROCESS_BASE, [change], [])


async def open_and_commit(opening: Awaitable[PgStore]) -> None:
    """Open a store and insert a task: on a build that does not refuse, the trigger runs."""
    async with await opening as store:
        await commit_one_task(store)


async def test_migrate_false_refuses_a_trigger_on_a_foreign_owned_table(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    schema = migrated
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"ALTER TABLE {schema}.cronoq_tasks OWNER TO {attacker.name}")
    trigger = await plant_trigger(attacker, schema)
    with pytest.raises(MigrationError) as info:
        await open_and_commit(PgStore.connect(pg_url, config(schema), migrate=False))
    assert f"table {schema}.cronoq_tasks owned by {attacker.name}" in str(info.value)
    assert trigger in str(info.value)
    assert not await is_superuser(pg_url, attacker.name)


async def test_a_trigger_by_a_role_granted_trigger_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    schema = migrated
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT ALL ON {schema}.cronoq_tasks TO {attacker.name}")
    trigger = await plant_trigger(attacker, schema)
    for migrate in (True, False):
        with pytest.raises(MigrationError) as info:
            await open_and_commit(PgStore.from_engine(engine, config(schema), migrate=migrate))
        assert trigger in str(info.value)
        assert f"TRIGGER on {schema}.cronoq_tasks granted to {attacker.name}" in str(info.value)
    assert not await is_superuser(pg_url, attacker.name)
    # Without the trigger, holding the privilege is enough to be refused: it could plant one.
    await admin_execute(pg_url, f"DROP TRIGGER planted ON {schema}.cronoq_tasks")
    with pytest.raises(MigrationError, match=f"TRIGGER on {schema}.cronoq_tasks granted to"):
        await PgStore.from_engine(engine, config(schema))


async def test_a_foreign_key_onto_our_tables_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """A foreign key needs only REFERENCES: its internal triggers would run the other table's
    cascades (and triggers) inside prune's deletes, or make every prune fail."""
    schema = migrated
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT REFERENCES ON {schema}.cronoq_tasks TO {attacker.name}")
    with pytest.raises(MigrationError, match=f"REFERENCES on {schema}.cronoq_tasks granted to"):
        await PgStore.from_engine(engine, config(schema))
    table = f"{attacker.name}_s.t"
    await admin_execute(attacker.url, f"CREATE SCHEMA {attacker.name}_s")
    await admin_execute(
        attacker.url,
        f"CREATE TABLE {table} (ref bigint REFERENCES {schema}.cronoq_tasks (id) "
        "ON DELETE CASCADE)",
    )
    await admin_execute(pg_url, f"REVOKE REFERENCES ON {schema}.cronoq_tasks FROM {attacker.name}")
    # The key stays when the grant goes; whoever owns it, it is refused on every entry point.
    for migrate in (True, False):
        with pytest.raises(MigrationError) as info:
            await PgStore.from_engine(engine, config(schema), migrate=migrate)
        assert f"of {table} references {schema}.cronoq_tasks" in str(info.value)


async def test_references_on_a_column_of_our_tables_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """A column's REFERENCES (pg_attribute.attacl, not the table's relacl) is enough for a
    foreign key onto that column: refused like the table's, before the key exists."""
    schema = migrated
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(
        pg_url, f"GRANT REFERENCES (id) ON {schema}.cronoq_tasks TO {attacker.name}"
    )
    said = f"REFERENCES on {schema}.cronoq_tasks (id) granted to {attacker.name}"
    with pytest.raises(MigrationError) as info:
        await upgrade(engine, schema)
    assert said in str(info.value)
    with pytest.raises(MigrationError, match=re.escape(said)):
        await PgStore.from_engine(engine, config(schema), migrate=False)
    # What the grant allows, once the store has opened: a key whose cascade runs in prune.
    await admin_execute(attacker.url, f"CREATE SCHEMA {attacker.name}_s")
    await admin_execute(
        attacker.url,
        f"CREATE TABLE {attacker.name}_s.t (ref bigint REFERENCES {schema}.cronoq_tasks (id) "
        "ON DELETE CASCADE)",
    )


async def test_a_foreign_key_from_a_partitioned_table_outlives_its_grant_and_detach(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """A partitioned table's key is cloned onto each partition; a detached partition keeps
    its own. Each is found through the columns it references, the grant revoked since."""
    schema, own = migrated, f"{attacker.name}_s"
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT REFERENCES ON {schema}.cronoq_tasks TO {attacker.name}")
    await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
    await admin_execute(
        attacker.url,
        f"CREATE TABLE {own}.t (ref bigint REFERENCES {schema}.cronoq_tasks (id) "
        "ON DELETE CASCADE) PARTITION BY RANGE (ref)",
    )
    await admin_execute(
        attacker.url, f"CREATE TABLE {own}.t1 PARTITION OF {own}.t FOR VALUES FROM (0) TO (9)"
    )
    await admin_execute(attacker.url, f"ALTER TABLE {own}.t DETACH PARTITION {own}.t1")
    await admin_execute(attacker.url, f"DROP TABLE {own}.t")
    await admin_execute(pg_url, f"REVOKE REFERENCES ON {schema}.cronoq_tasks FROM {attacker.name}")
    with pytest.raises(MigrationError) as info:
        await PgStore.from_engine(engine, config(schema), migrate=False)
    assert f"of {own}.t1 references {schema}.cronoq_tasks" in str(info.value)


async def test_a_trigger_whose_when_clause_runs_untrusted_code_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """A trusted trigger function, but the WHEN clause calls the attacker's function; the
    TRIGGER privilege it was created with is revoked since."""
    schema, own = migrated, f"{attacker.name}_own"
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT TRIGGER ON {schema}.cronoq_tasks TO {attacker.name}")
    await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
    await admin_execute(attacker.url, escalating_function(f"{own}.w", attacker.name, "", "bool"))
    await admin_execute(
        attacker.url,
        f"CREATE TRIGGER planted BEFORE UPDATE ON {schema}.cronoq_tasks FOR EACH ROW "
        f"WHEN ({own}.w()) EXECUTE FUNCTION suppress_redundant_updates_trigger()",
    )
    await admin_execute(pg_url, f"REVOKE TRIGGER ON {schema}.cronoq_tasks FROM {attacker.name}")
    with pytest.raises(MigrationError) as info:
        await open_and_update(PgStore.from_engine(engine, config(schema)))
    assert (
        f"trigger planted on {schema}.cronoq_tasks runs function {own}.w() owned by "
        f"{attacker.name}" in str(info.value)
    )
    assert "suppress_redundant_updates_trigger" not in str(info.value)  # trusted: the system's
    assert not await is_superuser(pg_url, attacker.name)


async def test_a_rule_on_our_table_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str
) -> None:
    await admin_execute(
        pg_url,
        f"CREATE RULE planted AS ON INSERT TO {migrated}.cronoq_recurring DO ALSO NOTIFY x",
    )
    with pytest.raises(MigrationError, match=f"rule planted on {migrated}.cronoq_recurring"):
        await PgStore.from_engine(engine, config(migrated), migrate=False)


# --- objects planted in a schema we own ------------------------------------------------------


PLANTED = {
    "function": ("CREATE FUNCTION {s}.hashtext(varchar) RETURNS int LANGUAGE sql AS 'SELECT 1'",
                 "function {s}.hashtext(character varying) owned by {a}"),
    "type": ("CREATE TYPE {s}.mood AS ENUM ('sad')", "type {s}.mood owned by {a}"),
    "domain": ("CREATE DOMAIN {s}.positive AS int CHECK (VALUE > 0)",
               "type {s}.positive owned by {a}"),
    "view": ("CREATE VIEW {s}.v AS SELECT 1 AS one", "view {s}.v owned by {a}"),
    "table": ("CREATE TABLE {s}.notes (x int)", "table {s}.notes owned by {a}"),
    "sequence": ("CREATE SEQUENCE {s}.seq", "sequence {s}.seq owned by {a}"),
    "aggregate": ("CREATE AGGREGATE {s}.total(int) (SFUNC = int4pl, STYPE = int)",
                  "aggregate {s}.total(integer) owned by {a}"),
    "procedure": ("CREATE PROCEDURE {s}.p() LANGUAGE sql AS 'SELECT 1'",
                  "procedure {s}.p() owned by {a}"),
    "collation": ("CREATE COLLATION {s}.c (locale = 'C')", "collation {s}.c owned by {a}"),
    "text search configuration": ("CREATE TEXT SEARCH CONFIGURATION {s}.ts (COPY = simple)",
                                  "text search configuration {s}.ts owned by {a}"),
    "composite type": ("CREATE TYPE {s}.pair AS (a int, b int)", "type {s}.pair owned by {a}"),
    "range type": ("CREATE TYPE {s}.span AS RANGE (subtype = int4)",
                   "type {s}.span_multirange owned by {a}"),
    "materialized view": ("CREATE MATERIALIZED VIEW {s}.mv AS SELECT 1 AS one",
                          "materialized view {s}.mv owned by {a}"),
    "partition": ("CREATE TABLE {s}.part PARTITION OF {o}.parted DEFAULT",
                  "table {s}.part owned by {a}"),
    "statistics": ("CREATE STATISTICS {s}.st ON a, b FROM {o}.pair", "statistics st owned by {a}"),
    "conversion": ("CREATE CONVERSION {s}.cv FOR 'LATIN1' TO 'UTF8' FROM iso8859_1_to_utf8",
                   "conversion cv owned by {a}"),
    "text search dictionary": ("CREATE TEXT SEARCH DICTIONARY {s}.d (TEMPLATE = simple)",
                               "text search dictionary {s}.d owned by {a}"),
}  # fmt: skip

# Created in the attacker's own schema, then moved into ours (CREATE on it for a moment):
# SET SCHEMA moves the object's dependency on its schema, which is how the check finds it.
MOVED = {
    "table": ("ALTER TABLE {o}.pair SET SCHEMA {s}", "table {s}.pair owned by {a}"),
    "owned sequence": ("ALTER TABLE {o}.pair SET SCHEMA {s}",
                       "sequence {s}.pair_a_seq owned by {a}"),
    "function": ("ALTER FUNCTION {o}.f(int, int) SET SCHEMA {s}",
                 "function {s}.f(integer,integer) owned by {a}"),
    "operator": ("ALTER OPERATOR {o}.===(int, int) SET SCHEMA {s}",
                 "operator {s}.===(integer,integer) owned by {a}"),
    "type": ("ALTER TYPE {o}.span SET SCHEMA {s}", "type {s}.span owned by {a}"),
    "statistics": ("ALTER STATISTICS {o}.st SET SCHEMA {s}", "statistics st owned by {a}"),
    "view": ("ALTER VIEW {o}.v SET SCHEMA {s}", "view {s}.v owned by {a}"),
}  # fmt: skip


async def attackers_schema(attacker: Attacker) -> str:
    """The attacker's own schema, with one of each object the tests plant or move."""
    own = f"{attacker.name}_s"
    for ddl in (
        f"CREATE SCHEMA {own}",
        f"CREATE TABLE {own}.pair (a serial, b int)",
        f"CREATE TABLE {own}.parted (a int) PARTITION BY LIST (a)",
        f"CREATE FUNCTION {own}.f(int, int) RETURNS bool LANGUAGE sql AS 'SELECT true'",
        f"CREATE OPERATOR {own}.=== (LEFTARG = int, RIGHTARG = int, FUNCTION = {own}.f)",
        f"CREATE TYPE {own}.span AS RANGE (subtype = int4)",
        f"CREATE STATISTICS {own}.st ON a, b FROM {own}.pair",
        f"CREATE VIEW {own}.v AS SELECT 1 AS one",
    ):
        await admin_execute(attacker.url, ddl)
    return own


#: Objects made in our schema, and objects made elsewhere and moved in (SET SCHEMA).
_PLANTED_OR_MOVED = {**PLANTED, **{f"moved {kind}": made for kind, made in MOVED.items()}}


@pytest.mark.parametrize("kind", sorted(_PLANTED_OR_MOVED))
async def test_an_object_planted_in_our_schema_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker, kind: str
) -> None:
    ddl, said = _PLANTED_OR_MOVED[kind]
    schema = migrated
    own = await attackers_schema(attacker)
    await admin_execute(pg_url, f"GRANT CREATE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(attacker.url, ddl.format(s=schema, o=own))
    await admin_execute(pg_url, f"REVOKE CREATE ON SCHEMA {schema} FROM {attacker.name}")
    with pytest.raises(MigrationError) as info:
        await upgrade(engine, schema)
    assert said.format(s=schema, a=attacker.name) in str(info.value)
    with pytest.raises(MigrationError, match="owned by"):
        await PgStore.from_engine(engine, config(schema), migrate=False)


async def test_a_trusted_extension_installed_into_our_schema_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """CREATE on the database is enough to install a trusted extension into a schema the
    role may not create in: its objects are the bootstrap superuser's, so only the
    extension's owner betrays it, and that role may update, move or drop it."""
    try:
        await admin_execute(attacker.url, f"CREATE EXTENSION seg SCHEMA {migrated}")
    except asyncpg.UndefinedFileError:
        pytest.skip("the server has no contrib extension seg")
    try:
        with pytest.raises(MigrationError) as info:
            await upgrade(engine, migrated)
        assert f"extension seg owned by {attacker.name}" in str(info.value)
        with pytest.raises(MigrationError, match="extension seg owned by"):
            await PgStore.from_engine(engine, config(migrated), migrate=False)
    finally:
        await admin_execute(pg_url, "DROP EXTENSION seg")
    async with await PgStore.connect(pg_url, config(migrated)) as store:
        assert await store.get_task(TaskId(1)) is None


@pytest.mark.parametrize("grantee", ["attacker", "PUBLIC"])
async def test_create_on_our_schema_granted_to_another_role_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker, grantee: str
) -> None:
    role = attacker.name if grantee == "attacker" else "PUBLIC"
    await admin_execute(pg_url, f"GRANT CREATE ON SCHEMA {migrated} TO {role}")
    message = f"CREATE on schema {migrated} granted to {role}"
    with pytest.raises(MigrationError, match=message):
        await PgStore.connect(pg_url, config(migrated))
    with pytest.raises(MigrationError, match=message):
        await PgStore.connect(pg_url, config(migrated), migrate=False)
    await admin_execute(pg_url, f"REVOKE CREATE ON SCHEMA {migrated} FROM {role}")
    async with await PgStore.connect(pg_url, config(migrated)) as store:
        assert await store.get_task(TaskId(1)) is None


@pytest.mark.parametrize("name", ["information_schema", "pg_x", "pg_catalog"])
async def test_system_schemas_are_refused_by_name(
    pg_url: URL, engine: AsyncEngine, name: str
) -> None:
    with pytest.raises(ValueError, match="system's schemas"):
        PgStoreConfig(schema=name)
    with pytest.raises(ValueError, match="system's schemas"):
        await upgrade(engine, name)
    assert not [t for t in await cronoq_tables(pg_url, name) if t.startswith("cronoq_")]


# --- search_path on every session -----------------------------------------------------------


async def test_the_stores_own_sessions_run_under_a_safe_search_path(
    pg_url: URL, schema: str
) -> None:
    async with (
        await PgStore.connect(pg_url, config(schema)) as store,
        store.engine.connect() as conn,
    ):
        path = (await conn.execute(text("SHOW search_path"))).scalar_one()
    assert path == "pg_catalog, pg_temp"


async def plant_an_application_path(pg_url: URL, attacker: Attacker) -> str:
    """The application's ``search_path`` (:func:`application_engine`), its first schema
    the attacker's: ``=`` on ``(int, int)`` (an epoch check), ``(text, varchar)`` (a key
    lookup) and ``(text, text)``, ``now()`` and ``current_schema()`` (SQLAlchemy reads it
    when an engine first connects) there make the attacker superuser when the store's
    statements resolve them, and draw from the sequence :func:`operator_calls` reads."""
    evil = f"{attacker.name}_own"
    await admin_execute(attacker.url, f"CREATE SCHEMA {evil}")
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {evil} TO PUBLIC")
    witness = f"{evil}.calls"
    await admin_execute(attacker.url, f"CREATE SEQUENCE {witness}")
    for args in ("int, int", "text, varchar", "text, text"):
        await admin_execute(
            attacker.url,
            escalating_function(f"{evil}.f", attacker.name, args, "bool", witness=witness),
        )
        left, right = args.split(", ")
        await admin_execute(
            attacker.url,
            f"CREATE OPERATOR {evil}.= (LEFTARG = {left}, RIGHTARG = {right}, FUNCTION = {evil}.f)",
        )
    for name, result in (("now", "timestamptz"), ("current_schema", "name")):
        value = f"pg_catalog.{name}()"
        await admin_execute(
            attacker.url,
            escalating_function(
                f"{evil}.{name}", attacker.name, "", result, witness=witness, value=value
            ),
        )
    return application_path(attacker)


def application_path(attacker: Attacker) -> str:
    """The application's ``search_path``: the schema the attacker writes comes first."""
    return f"{attacker.name}_own, pg_catalog, public"


async def operator_calls(pg_url: URL, attacker: Attacker) -> bool:
    """Whether anything :func:`plant_an_application_path` planted ran, committed or not."""
    rows = await admin_execute(pg_url, f"SELECT is_called FROM {attacker.name}_own.calls")
    return bool(rows[0][0])


async def application_engine(pg_url: URL, attacker: Attacker) -> AsyncEngine:
    """An application's engine of one pooled session, under :func:`application_path`, used
    once before anything is planted: SQLAlchemy sets its dialect up as the engine first
    connects, under the application's settings, which is the application's business."""
    engine = create_async_engine(
        async_url(pg_url),
        pool_size=1,
        max_overflow=0,
        connect_args={"server_settings": {"search_path": application_path(attacker)}},
    )
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
    return engine


async def nothing_ran_as_us(
    pg_url: URL, attacker: Attacker, app: AsyncEngine, app_path: str
) -> None:
    """The planted code never ran, the attacker is no superuser, and the application's
    pooled session, given back, keeps its own search_path."""
    assert not await operator_calls(pg_url, attacker)
    assert not await is_superuser(pg_url, attacker.name)
    async with app.connect() as conn:
        assert (await conn.execute(text("SHOW search_path"))).scalar_one() == app_path


async def test_a_borrowed_engine_keeps_its_search_path_and_cannot_hijack_ours(
    pg_url: URL, migrated: str, attacker: Attacker
) -> None:
    """An application whose search_path puts a schema others can write first: its own
    statements are its business, the store's must not resolve anything there."""
    app = await application_engine(pg_url, attacker)
    try:
        app_path = await plant_an_application_path(pg_url, attacker)
        async with await PgStore.from_engine(app, config(migrated)) as store:
            await commit_one_task(store)  # epoch check: integer = integer
            await store.commit(
                0,
                PROCESS_BASE,
                [StatusChanged(TaskId(1), TaskStatus.RUNNING, 1, PROCESS_BASE.engine_ns)],
                [],
            )
            assert await store.get_task("no such key") is None  # key = varchar
            record = await store.get_task(TaskId(1))
            assert record is not None
            assert record.status is TaskStatus.RUNNING
            copied = [  # a transaction, and COPY into the tasks table
                Submitted(TaskId(n), n, PROCESS_BASE.engine_ns, TaskSpec(b"bulk"))
                for n in range(2, 2 + COPY_MIN_ROWS)
            ]
            await store.commit(0, PROCESS_BASE, copied, [(TaskId(1), b"out")])
            assert len((await store.recover(PROCESS_BASE)).tasks) == 1 + COPY_MIN_ROWS
            assert await store.prune(0) == 0
            # The lock session, made as the application's engine makes its sessions.
            assert await store.acquire_leadership() == 1
        await nothing_ran_as_us(pg_url, attacker, app, app_path)
    finally:
        await app.dispose()


async def test_a_host_on_a_borrowed_engine_runs_nothing_under_its_search_path(
    pg_url: URL, migrated: str, attacker: Attacker
) -> None:
    """``PgHost.from_engine`` on the same application's engine: enrolment, serving (claim,
    recovery, the commit bus's lanes, reads) and removal resolve nothing in the
    application's path, and leave it as it was on the application's session."""
    app = await application_engine(pg_url, attacker)
    control = f"{migrated}_host"
    cfg = PgHostConfig(
        store=config(migrated), control_schema=control, max_connections=3, join_settle=0.0
    )
    gained: asyncio.Queue[HostedStore] = asyncio.Queue()

    async def lead(store: HostedStore) -> None:
        await gained.put(store)
        await store.leadership_lost()

    try:
        app_path = await plant_an_application_path(pg_url, attacker)
        host = await PgHost.from_engine(app, cfg)
        serving = asyncio.ensure_future(host.serve(lead))
        try:
            assert await host.enroll(migrated) == [migrated]
            # Again: its control row is there now, and the enrolment reads it (schema_name =
            # varchar), first alone, then in its transaction.
            assert await host.enroll(migrated) == []
            store = await bounded(gained.get(), "the host to lead the enrolled cluster")
            assert store.epoch is not None
            await store.recover(PROCESS_BASE)
            epoch, ns = store.epoch, PROCESS_BASE.engine_ns
            # Through the commit bus: a transaction (its epoch check is integer = integer),
            # then one that COPYs its tasks.
            first = [Submitted(task_id(epoch, 1), 1, ns, TaskSpec(b"hosted"))]
            await store.commit(epoch, PROCESS_BASE, first, [])
            copied = [
                Submitted(task_id(epoch, n), n, ns, TaskSpec(b"bulk"))
                for n in range(2, 2 + COPY_MIN_ROWS)
            ]
            await store.commit(epoch, PROCESS_BASE, copied, [])
            assert await store.get_task("no such key") is None  # key = varchar
            assert (await store.health()).has_leader
            assert await store.prune(0) == 0
            assert await host.remove(migrated)
        finally:
            await host.close()
            await bounded(serving, "serve to return once the host closed")
        await nothing_ran_as_us(pg_url, attacker, app, app_path)
    finally:
        await app.dispose()
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{control}" CASCADE')


# --- every trigger on our tables is refused unless the operator named it --------------------


async def admin_trigger_function(pg_url: URL, schema: str) -> str:
    """An audit function owned by the superuser (trusted), recording inserted task ids."""
    audit = f"{schema}_audit"
    await admin_execute(pg_url, f"CREATE SCHEMA {audit}")
    await admin_execute(pg_url, f"CREATE TABLE {audit}.seen (id bigint)")
    await admin_execute(
        pg_url,
        f"CREATE FUNCTION {audit}.record() RETURNS trigger LANGUAGE plpgsql "
        f"SET search_path = pg_catalog AS $$ BEGIN "
        f"INSERT INTO {audit}.seen VALUES (NEW.id); RETURN NULL; END $$",
    )
    return f"{audit}.record"


async def drop_schema(pg_url: URL, name: str) -> None:
    await admin_execute(pg_url, f"DROP SCHEMA IF EXISTS {name} CASCADE")


async def test_a_when_clause_that_casts_to_a_planted_domain_is_refused(
    pg_url: URL, migrated: str, attacker: Attacker
) -> None:
    """A trusted trigger function (the system's), but the WHEN clause casts to the
    attacker's domain, whose CHECK runs the attacker's code: refused by name, and refused
    even when the operator trusts the trigger's name."""
    schema, own = migrated, f"{attacker.name}_own"
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT ALL ON ALL TABLES IN SCHEMA {schema} TO {attacker.name}")
    await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
    await admin_execute(
        attacker.url, escalating_function(f"{own}.esc", attacker.name, "text", "bool")
    )
    await admin_execute(attacker.url, f"CREATE DOMAIN {own}.d AS text CHECK (NOT {own}.esc(VALUE))")
    await admin_execute(
        attacker.url,
        f"CREATE TRIGGER planted BEFORE UPDATE ON {schema}.cronoq_leader FOR EACH ROW "
        f"WHEN (NEW.epoch::text::{own}.d IS NOT NULL) "
        "EXECUTE FUNCTION pg_catalog.suppress_redundant_updates_trigger()",
    )
    await admin_execute(pg_url, f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {attacker.name}")
    for trusted, said in [
        (frozenset(), "was not created by cronoq-store and is not one of the trusted_triggers"),
        (frozenset({"planted"}), "has a WHEN clause"),
    ]:
        cfg = replace(config(schema), trusted_triggers=trusted) if trusted else config(schema)
        with pytest.raises(MigrationError) as info:
            async with await PgStore.connect(pg_url, cfg) as store:
                await store.acquire_leadership()  # bumps the epoch: an UPDATE of the row
        assert f"trigger planted on {schema}.cronoq_leader {said}" in str(info.value)
        assert not await is_superuser(pg_url, attacker.name)


async def open_plant_and_commit(pg_url: URL, schema: str, attacker: Attacker) -> None:
    """Connect as the superuser; the attacker plants a trigger with the privileges the new
    tables gave it; a commit then runs it (on a build that does not refuse)."""
    async with await PgStore.connect(pg_url, config(schema)) as store:
        await plant_trigger(attacker, schema)
        await commit_one_task(store)


async def test_default_privileges_on_new_tables_are_refused_and_the_migration_undone(
    pg_url: URL, schema: str, attacker: Attacker
) -> None:
    """Ops gave the app role ALL on every table the superuser creates: the tables connect()
    creates come with TRIGGER for it, so the check after the migration refuses them, and
    the whole migration (schema included) is rolled back before the role can plant."""
    me = pg_url.username
    grants = [
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {me} GRANT ALL ON TABLES TO {attacker.name}",
        f"ALTER DEFAULT PRIVILEGES FOR ROLE {me} GRANT USAGE ON SCHEMAS TO {attacker.name}",
    ]
    for grant in grants:
        await admin_execute(pg_url, grant)
    try:
        with pytest.raises(MigrationError) as info:
            await open_plant_and_commit(pg_url, schema, attacker)
        assert f"TRIGGER on {schema}.cronoq_tasks granted to {attacker.name}" in str(info.value)
        assert not await is_superuser(pg_url, attacker.name)
        assert (
            await admin_execute(pg_url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
            == []
        )
    finally:
        for grant in grants:
            revoke = grant.replace(" GRANT ", " REVOKE ").replace(" TO ", " FROM ")
            await admin_execute(pg_url, revoke)


async def test_a_trigger_planted_while_the_store_runs_is_refused_at_the_next_term(
    pg_url: URL, migrated: str, attacker: Attacker
) -> None:
    """TRIGGER granted (and revoked again) after the store opened: the next acquisition
    checks before its epoch bump, refuses without taking an epoch, and releases the lock."""
    schema, own = migrated, f"{attacker.name}_own"
    async with await PgStore.connect(pg_url, config(schema)) as store:
        first = await store.acquire_leadership()
        await store.release_leadership()
        await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
        await admin_execute(pg_url, f"GRANT TRIGGER ON {schema}.cronoq_leader TO {attacker.name}")
        await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
        await admin_execute(
            attacker.url, escalating_function(f"{own}.t", attacker.name, "", "trigger")
        )
        await admin_execute(
            attacker.url,
            f"CREATE TRIGGER planted BEFORE UPDATE ON {schema}.cronoq_leader "
            f"FOR EACH ROW EXECUTE FUNCTION {own}.t()",
        )
        await admin_execute(
            pg_url, f"REVOKE TRIGGER ON {schema}.cronoq_leader FROM {attacker.name}"
        )
        with pytest.raises(MigrationError) as info:
            await store.acquire_leadership()
        assert (
            f"trigger planted on {schema}.cronoq_leader runs function {own}.t() owned by "
            f"{attacker.name}" in str(info.value)
        )
        assert not await is_superuser(pg_url, attacker.name)
        assert not store.is_leader
        await admin_execute(pg_url, f"DROP TRIGGER planted ON {schema}.cronoq_leader")
        # The lock was released and no epoch taken: this store leads again at once.
        assert await bounded(store.acquire_leadership(), "leadership") == first + 1


async def test_a_named_trigger_with_a_trusted_function_is_accepted(
    pg_url: URL, migrated: str, attacker: Attacker
) -> None:
    """The operator's audit trigger works when named, through every entry point; the same
    name with a WHEN clause, or running the attacker's function, is refused."""
    schema = migrated
    record = await admin_trigger_function(pg_url, schema)
    try:
        await admin_execute(
            pg_url,
            f"CREATE TRIGGER audit_ok AFTER INSERT ON {schema}.cronoq_tasks "
            f"FOR EACH ROW EXECUTE FUNCTION {record}()",
        )
        cfg = replace(config(schema), trusted_triggers=frozenset({"audit_ok"}))
        async with await PgStore.connect(pg_url, cfg) as store:
            epoch = await store.acquire_leadership()
            await store.commit(
                epoch,
                PROCESS_BASE,
                [Submitted(TaskId(1), 1, PROCESS_BASE.engine_ns, TaskSpec(b"x"))],
                [],
            )
        assert await admin_execute(pg_url, f"SELECT id FROM {schema}_audit.seen") == [(1,)]
        url = pg_url.render_as_string(hide_password=False)
        result = await asyncio.to_thread(
            CliRunner().invoke,
            cli,
            ["--url", url, "--schema", schema, "--trusted-trigger", "audit_ok", "status"],
        )
        assert result.exit_code == 0, result.output
        env = {**os.environ, "CRONOQ_DATABASE_URL": url}
        alembic = [sys.executable, "-m", "alembic", "-x", f"schema={schema}"]
        for extra, ok in [(["-x", "trusted_triggers=x,audit_ok"], True), ([], False)]:
            run = await asyncio.to_thread(
                subprocess.run,
                [*alembic, *extra, "upgrade", "head"],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert (run.returncode == 0) is ok, run.stdout + run.stderr
        assert f"trigger audit_ok on {schema}.cronoq_tasks was not created" in run.stdout

        own = f"{attacker.name}_own"
        await admin_execute(attacker.url, f"CREATE SCHEMA {own}")
        await admin_execute(
            attacker.url, escalating_function(f"{own}.t", attacker.name, "", "trigger")
        )
        for body, said in [
            (f"WHEN (NEW.id > 0) EXECUTE FUNCTION {record}()", "has a WHEN clause"),
            (f"EXECUTE FUNCTION {own}.t()", f"runs function {own}.t() owned by {attacker.name}"),
        ]:
            await admin_execute(pg_url, f"DROP TRIGGER audit_ok ON {schema}.cronoq_tasks")
            await admin_execute(
                pg_url,
                f"CREATE TRIGGER audit_ok AFTER INSERT ON {schema}.cronoq_tasks "
                f"FOR EACH ROW {body}",
            )
            with pytest.raises(MigrationError) as info:
                async with await PgStore.connect(pg_url, cfg) as store:
                    await commit_one_task(store)
            assert f"trigger audit_ok on {schema}.cronoq_tasks {said}" in str(info.value)
            assert not await is_superuser(pg_url, attacker.name)
    finally:
        await drop_schema(pg_url, f"{schema}_audit")


async def test_an_unnamed_trigger_with_a_trusted_function_is_refused(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """A trigger running only the system's code, planted by a role once granted TRIGGER:
    not ours and not named by the operator, so refused by every entry point."""
    schema = migrated
    await admin_execute(pg_url, f"GRANT USAGE ON SCHEMA {schema} TO {attacker.name}")
    await admin_execute(pg_url, f"GRANT TRIGGER ON {schema}.cronoq_tasks TO {attacker.name}")
    await admin_execute(
        attacker.url,
        f"CREATE TRIGGER planted BEFORE UPDATE ON {schema}.cronoq_tasks FOR EACH ROW "
        "EXECUTE FUNCTION pg_catalog.suppress_redundant_updates_trigger()",
    )
    await admin_execute(pg_url, f"REVOKE TRIGGER ON {schema}.cronoq_tasks FROM {attacker.name}")
    said = f"trigger planted on {schema}.cronoq_tasks was not created by cronoq-store"
    for migrate in (True, False):
        with pytest.raises(MigrationError) as info:
            await open_and_update(PgStore.from_engine(engine, config(schema), migrate=migrate))
        assert said in str(info.value)
    url = pg_url.render_as_string(hide_password=False)
    result = await asyncio.to_thread(
        CliRunner().invoke, cli, ["--url", url, "--schema", schema, "status"]
    )
    assert result.exit_code == ExitCode.FAILED, result.output
    assert said in result.stderr
    assert not await is_superuser(pg_url, attacker.name)


@pytest.mark.parametrize(
    "names", ["audit", ["ok", "bad name"], ["1st"], [""], ["x" * 64], [7]], ids=repr
)
def test_trusted_trigger_names_must_be_plain_identifiers(names: object) -> None:
    with pytest.raises(ValueError, match="trusted_triggers"):
        PgStoreConfig(trusted_triggers=names)  # type: ignore[arg-type]
    result = CliRunner().invoke(cli, ["--trusted-trigger", "bad name", "status"])
    assert result.exit_code == 2
    assert "is not a plain identifier" in result.output


async def test_the_lock_session_checks_as_its_own_role(
    pg_url: URL, schema: str, attacker: Attacker
) -> None:
    """The epoch bump runs as the lock role, so the lock session checks the schema as that
    role: a schema owned by a role that cannot act as the lock role is refused at
    acquisition (no epoch taken) until ops grant the lock role to the owner."""
    owner, lock = attacker, f"{schema}_lock"
    password = secrets.token_urlsafe(18)
    await admin_execute(pg_url, f"CREATE ROLE {lock} LOGIN PASSWORD '{password}'")
    await admin_execute(pg_url, f'GRANT CONNECT ON DATABASE "{pg_url.database}" TO {lock}')
    try:
        async with await PgStore.connect(owner.url, config(schema)):  # the owner migrates
            for grant in [
                f"USAGE ON SCHEMA {schema}",
                f"SELECT, UPDATE ON {schema}.cronoq_leader",
                f"SELECT, INSERT, UPDATE, DELETE ON {schema}.cronoq_leader_history",
            ]:
                await admin_execute(owner.url, f"GRANT {grant} TO {lock}")
        lock_url = pg_url.set(username=lock, password=password)
        async with await PgStore.connect(owner.url, config(schema), lock_url=lock_url) as store:
            with pytest.raises(MigrationError) as info:
                await store.acquire_leadership()
            assert f"schema {schema} owned by {owner.name}" in str(info.value)
            assert f"Only '{lock}'" in str(info.value)
            await admin_execute(pg_url, f"GRANT {lock} TO {owner.name}")
            assert await bounded(store.acquire_leadership(), "leadership") == 1
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await admin_execute(pg_url, f"DROP OWNED BY {lock}")
        await admin_execute(pg_url, f"DROP ROLE {lock}")


# --- many schemas in one statement (the console's overview page) -----------------------------


async def test_checking_many_schemas_at_once_gives_each_its_own_verdict(
    pg_url: URL, engine: AsyncEngine, migrated: str, attacker: Attacker
) -> None:
    """The check of a page of schemas in one statement refuses what the check of each alone
    refuses, in the same words, and the console's overview shows those refusals. In one
    schema the attacker planted a table; another's tasks table is referenced by a foreign
    key from a third's, which is one of our tables there but not in the schema it
    references."""
    clean, planted, referenced = migrated, f"{migrated}_p", f"{migrated}_r"
    try:
        for name in (planted, referenced):
            await upgrade(engine, name)
        await admin_execute(pg_url, f"GRANT CREATE ON SCHEMA {planted} TO {attacker.name}")
        await admin_execute(attacker.url, f"CREATE TABLE {planted}.notes (x int)")
        await admin_execute(pg_url, f"REVOKE CREATE ON SCHEMA {planted} FROM {attacker.name}")
        await admin_execute(
            pg_url,
            f"ALTER TABLE {clean}.cronoq_tasks ADD CONSTRAINT onto FOREIGN KEY (id) "
            f"REFERENCES {referenced}.cronoq_tasks (id)",
        )
        schemas = [clean, planted, referenced, f"{migrated}_none"]
        each: dict[str, str] = {}
        async with engine.connect() as conn:
            await conn.execute(text("SET search_path = pg_catalog, pg_temp"))
            for name in schemas:
                try:
                    await conn.run_sync(refuse_untrusted, name)
                except MigrationError as exc:
                    each[name] = str(exc)
            at_once = await conn.run_sync(untrusted_among, schemas)
        assert sorted(each) == [planted, referenced]
        assert f"table {planted}.notes owned by {attacker.name}" in each[planted]
        assert (
            f"onto of {clean}.cronoq_tasks references {referenced}.cronoq_tasks"
            in (each[referenced])
        )
        assert {name: str(exc) for name, exc in at_once.items()} == each

        source = Source(pg_url.render_as_string(hide_password=False))
        try:
            doc = await reads.overview(source, search=migrated)
        finally:
            await source.close()
        shown = {c["schema"]: c.get("refused") for c in doc["clusters"]}
        assert shown == {clean: None, **each}
    finally:
        for name in (planted, referenced):
            await drop_schema(pg_url, name)
