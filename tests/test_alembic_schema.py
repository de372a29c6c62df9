"""Alembic's command line through the store's env agrees with ``cronoq-store`` on the
cluster's schema: a schema nobody named is refused when the clusters live elsewhere, and
``current`` on a schema without a cluster says so instead of printing nothing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store._migrations import head_revision, upgrade
from cronoq_store._urls import async_url

from .pgharness import admin_execute
from .support import alembic


@pytest.fixture
async def database(pg_url: URL) -> AsyncIterator[URL]:
    """A database of its own, with clusters in ``billing`` and ``alpha`` only."""
    name = f"cq_{uuid.uuid4().hex[:10]}"
    await admin_execute(pg_url, f"CREATE DATABASE {name}")
    url = pg_url.set(database=name)
    engine = create_async_engine(async_url(url))
    try:
        for schema in ("billing", "alpha"):
            await upgrade(engine, schema)
    finally:
        await engine.dispose()
    try:
        yield url
    finally:
        await admin_execute(pg_url, f"DROP DATABASE {name} WITH (FORCE)")


async def public_tables(url: URL) -> list[str]:
    rows = await admin_execute(
        url, "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace"
    )
    return [row["relname"] for row in rows]


async def test_no_schema_given_is_refused_when_clusters_live_elsewhere(database: URL) -> None:
    for args in (["upgrade", "head"], ["current"]):
        refused = alembic(*args, url=database)
        assert refused.returncode != 0, (args, refused.stdout, refused.stderr)
        assert "the clusters in this database are in: alpha, billing;" in refused.stderr
        assert "pass -x schema=NAME (-x schema=public to use 'public' anyway)" in refused.stderr
    assert await public_tables(database) == []

    named = alembic("-x", "schema=public", "upgrade", "head", url=database)
    assert named.returncode == 0, named.stderr
    # Now public holds a cluster: the default is that one, as for the CLI.
    current = alembic("current", url=database)
    assert current.returncode == 0, current.stderr
    assert f"{head_revision()} (head)" in current.stdout


async def test_current_says_a_schema_holds_no_cluster_and_creates_nothing(database: URL) -> None:
    for schema in ("nosuch", "public"):
        result = alembic("-x", f"schema={schema}", "current", url=database)
        assert result.returncode == 0, result.stderr
        assert f"schema '{schema}' holds no cronoq cluster (not migrated)" in result.stdout
    rows = await admin_execute(
        database, "SELECT nspname FROM pg_namespace WHERE nspname = 'nosuch'"
    )
    assert rows == []
    assert await public_tables(database) == []
    at_head = alembic("-x", "schema=alpha", "current", url=database)
    assert f"{head_revision()} (head)" in at_head.stdout
    assert "holds no cronoq cluster" not in at_head.stdout


def test_an_error_quoting_a_hostile_url_is_escaped() -> None:
    url = "mysql://ops:hunter22@db\x1b]0;owned\x07\u202e/app"
    result = alembic("-x", "schema=ops", "-x", f"url={url}", "current")
    assert result.returncode != 0
    assert "unsupported database URL mysql://ops:***@db\\x1b]0;owned\\x07\\u202e/app" in (
        result.stderr
    )
    assert "\x1b" not in result.stderr
    assert "\u202e" not in result.stderr
    assert "hunter22" not in result.stderr


async def test_downgrade_of_a_schema_without_a_cluster_says_so_and_creates_nothing(
    database: URL,
) -> None:
    """Like `current`: a downgrade of a schema that holds no cluster (a typo) is refused,
    saying so, instead of creating the schema and exiting 0 having done nothing."""
    for args in (["downgrade", "base"], ["downgrade", "-1"]):
        result = alembic("-x", "schema=nosuch", *args, url=database)
        assert result.returncode != 0, (args, result.stdout, result.stderr)
        assert "schema 'nosuch' holds no cronoq cluster (not migrated)" in result.stderr
    rows = await admin_execute(
        database, "SELECT nspname FROM pg_namespace WHERE nspname = 'nosuch'"
    )
    assert rows == []
