"""Schemas as the hand-rolled versioning of earlier builds left them, for adoption tests.

Earlier builds ran a base schema script and then numbered ALTERs, recording the count in
``cronoq_schema_version``. This replays that process verbatim (raw SQL, as they did) up to a
given version, so the tests start from exactly what such a database holds.
"""

from __future__ import annotations

import asyncpg

LEGACY_BASE = """
CREATE TABLE IF NOT EXISTS cronoq_leader (
    id SMALLINT NOT NULL, epoch INTEGER DEFAULT 0 NOT NULL,
    CONSTRAINT pk_cronoq_leader PRIMARY KEY (id),
    CONSTRAINT ck_cronoq_leader_single_row CHECK (id = 1));
INSERT INTO cronoq_leader (id, epoch) VALUES (1, 0) ON CONFLICT (id) DO NOTHING;
CREATE TABLE IF NOT EXISTS cronoq_tasks (
    id BIGINT NOT NULL, seq BIGINT NOT NULL, arrival_unix_ns BIGINT NOT NULL,
    pool TEXT NOT NULL, kind TEXT NOT NULL, priority SMALLINT NOT NULL, key TEXT,
    payload BYTEA NOT NULL, deadline_unix_ns BIGINT, fixed_at_unix_ns BIGINT,
    fixed_tolerance_ns BIGINT, fixed_on_miss TEXT, duration_hint_ns BIGINT, timeout_ns BIGINT,
    retry JSONB, deps JSONB DEFAULT '[]'::jsonb NOT NULL,
    resources JSONB DEFAULT '{}'::jsonb NOT NULL, tags JSONB DEFAULT '[]'::jsonb NOT NULL,
    status TEXT NOT NULL, terminal BOOLEAN NOT NULL, attempt INTEGER DEFAULT 0 NOT NULL,
    updated_unix_ns BIGINT NOT NULL, message TEXT, output BYTEA,
    CONSTRAINT pk_cronoq_tasks PRIMARY KEY (id));
CREATE INDEX IF NOT EXISTS ix_cronoq_tasks_live ON cronoq_tasks (id) WHERE NOT terminal;
CREATE UNIQUE INDEX IF NOT EXISTS uq_cronoq_tasks_live_key ON cronoq_tasks (key)
    WHERE NOT terminal AND key IS NOT NULL;
CREATE INDEX IF NOT EXISTS ix_cronoq_tasks_finished_updated ON cronoq_tasks (updated_unix_ns, id)
    WHERE terminal;
CREATE INDEX IF NOT EXISTS ix_cronoq_tasks_key_id ON cronoq_tasks (key, id)
    WHERE key IS NOT NULL;
CREATE INDEX IF NOT EXISTS ix_cronoq_tasks_live_deps ON cronoq_tasks (id)
    WHERE NOT terminal AND deps <> '[]'::jsonb;
CREATE TABLE IF NOT EXISTS cronoq_recurring (
    name TEXT NOT NULL, spec JSONB NOT NULL, template_payload BYTEA NOT NULL,
    next_unix_ns BIGINT, CONSTRAINT pk_cronoq_recurring PRIMARY KEY (name));
"""

LEGACY_STEPS = [
    LEGACY_BASE,
    "ALTER TABLE cronoq_leader ADD COLUMN IF NOT EXISTS max_id BIGINT NOT NULL DEFAULT 0",
    "ALTER TABLE cronoq_recurring ADD COLUMN IF NOT EXISTS last_task_id BIGINT",
    "ALTER TABLE cronoq_tasks ADD COLUMN IF NOT EXISTS labels JSONB NOT NULL DEFAULT '[]'::jsonb",
    "ALTER TABLE cronoq_tasks ADD COLUMN IF NOT EXISTS tenant TEXT",
]


async def create_legacy_schema(dsn: str, schema: str, version: int) -> None:
    """Create ``schema`` the way a build with ``version`` hand-rolled migrations did, with rows."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(f'CREATE SCHEMA "{schema}"')
            await conn.execute(f'SET LOCAL search_path TO "{schema}"')
            await conn.execute(
                "CREATE TABLE cronoq_schema_version "
                "(id SMALLINT PRIMARY KEY CHECK (id = 1), version INT NOT NULL)"
            )
            await conn.execute("INSERT INTO cronoq_schema_version VALUES (1, 0)")
            for step in LEGACY_STEPS[:version]:
                await conn.execute(step)
            await conn.execute("UPDATE cronoq_schema_version SET version = $1", version)
            await conn.execute("UPDATE cronoq_leader SET epoch = 7")
            await conn.execute(
                "INSERT INTO cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority, key, "
                "payload, status, terminal, updated_unix_ns, deps) VALUES "
                "(1, 1, 10, 'default', 'k', 1, 'live-key', '\\x01', 'queued', false, 10, "
                '\'[{"key":"done-key","on":"succeeded"}]\'), '
                "(2, 2, 20, 'default', 'k', 1, 'done-key', '\\x02', 'succeeded', true, 20, '[]')"
            )
            await conn.execute(
                "INSERT INTO cronoq_recurring (name, spec, template_payload, next_unix_ns) "
                "VALUES ('nightly', '{\"schedule\":{\"every_ns\":60000000000}}', '\\x03', 99)"
            )
    finally:
        await conn.close()
