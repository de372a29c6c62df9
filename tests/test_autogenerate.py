"""An application's own Alembic env, with autogenerate, against a database holding clusters.

The env below is what an application writes: its own ``MetaData`` (one table), its own
version table, an async engine, ``alembic check`` run as the ``alembic`` command. Without
``cronoq_store.autogenerate`` it would drop the store's tables; with it, it finds nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table
from sqlalchemy.engine import URL

from cronoq_store._schema import tasks
from cronoq_store._urls import async_url
from cronoq_store.autogenerate import hiding_store

from .pgharness import admin_execute
from .support import ROOT

ENV_PY = '''
import asyncio
import os

from alembic import context
from sqlalchemy import Column, Integer, MetaData, Table, Text
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store.autogenerate import hiding_store

target = MetaData()
Table("orders", target, Column("id", Integer, primary_key=True), Column("note", Text))
SEEN = set(os.environ["APP_SEES"].split(","))


def own_name(name, type_, parent_names):
    """The application's own filter: its schema and the clusters', nothing else."""
    return type_ != "schema" or name is None or name in SEEN


def configure(connection):
    filters = {"include_name": own_name}
    if os.environ["APP_HIDES_STORE"] == "1":
        filters = hiding_store(include_name=own_name)
    context.configure(
        connection=connection,
        target_metadata=target,
        include_schemas=os.environ["APP_INCLUDE_SCHEMAS"] == "1",
        **filters,
    )
    with context.begin_transaction():
        context.run_migrations()


async def main():
    engine = create_async_engine(
        os.environ["APP_URL"],
        connect_args={"server_settings": {"search_path": os.environ["APP_SCHEMA"]}},
    )
    async with engine.connect() as connection:
        await connection.run_sync(configure)
    await engine.dispose()


asyncio.run(main())
'''


@pytest.fixture
def app_env(tmp_path: Path) -> Path:
    """An application's Alembic directory; returns its ``alembic.ini``."""
    (tmp_path / "versions").mkdir()
    (tmp_path / "env.py").write_text(ENV_PY)
    ini = tmp_path / "alembic.ini"
    ini.write_text(f"[alembic]\nscript_location = {tmp_path}\n")
    return ini


async def _check(
    ini: Path, url: URL, app_schema: str, *, hide: bool, all_schemas: bool, sees: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "APP_URL": async_url(url).render_as_string(hide_password=False),
        "APP_SCHEMA": app_schema,
        "APP_SEES": sees,
        "APP_HIDES_STORE": "1" if hide else "0",
        "APP_INCLUDE_SCHEMAS": "1" if all_schemas else "0",
    }
    command = [sys.executable, "-m", "alembic", "-c", str(ini), "check"]
    return await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=120
    )


async def _app_table(url: URL, schema: str) -> None:
    await admin_execute(url, f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    await admin_execute(url, f'CREATE TABLE "{schema}".orders (id integer PRIMARY KEY, note text)')


async def test_a_cluster_in_the_applications_own_schema_is_left_alone(
    app_env: Path, pg_url: URL, migrated: str
) -> None:
    # The application's tables live where the cluster does (its default schema).
    await _app_table(pg_url, migrated)
    shown = await _check(app_env, pg_url, migrated, hide=True, all_schemas=False, sees="")
    assert shown.returncode == 0, shown.stderr
    assert "No new upgrade operations detected" in shown.stdout + shown.stderr
    # Without the filter, autogenerate would drop the store's tables.
    bare = await _check(app_env, pg_url, migrated, hide=False, all_schemas=False, sees="")
    assert bare.returncode != 0
    said = bare.stdout + bare.stderr
    assert "remove_table" in said
    assert "cronoq_tasks" in said


async def test_clusters_in_other_schemas_are_left_alone_with_include_schemas(
    app_env: Path, pg_url: URL, migrated: str, schema: str
) -> None:
    """The application compares every schema it sees: a cluster's, with the legacy version
    table of earlier builds next to it, shows nothing (tables, indexes, constraints)."""
    app_schema = f"{schema}_app"
    await _app_table(pg_url, app_schema)
    await admin_execute(pg_url, f'CREATE TABLE "{migrated}".cronoq_schema_version (version int)')
    try:
        shown = await _check(
            app_env, pg_url, app_schema, hide=True, all_schemas=True, sees=migrated
        )
        assert shown.returncode == 0, shown.stderr
        assert "No new upgrade operations detected" in shown.stdout + shown.stderr
        bare = await _check(
            app_env, pg_url, app_schema, hide=False, all_schemas=True, sees=migrated
        )
        assert bare.returncode != 0
        for table in (
            "cronoq_tasks",
            "cronoq_leader",
            "cronoq_recurring",
            "cronoq_alembic_version",
            "cronoq_schema_version",
        ):
            assert f"'{table}'" in bare.stdout + bare.stderr, table
    finally:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{app_schema}" CASCADE')


def test_hiding_store_leaves_every_other_decision_to_the_applications_filters() -> None:
    orders = Table("orders", MetaData(), Column("id", Integer, primary_key=True))
    asked: list[str | None] = []

    def own_object(object: Any, name: str | None, type_: str, reflected: bool, to: Any) -> bool:
        asked.append(name)
        return name != "orders"

    include_object = hiding_store(include_object=own_object)["include_object"]
    assert include_object(orders, "orders", "table", False, None) is False
    assert include_object(orders.c.id, "id", "column", False, None) is True
    # The store's own objects are hidden before the application's filter is asked.
    index = next(iter(tasks.indexes))
    assert include_object(tasks, "cronoq_tasks", "table", True, None) is False
    assert include_object(index, index.name, "index", True, None) is False
    assert asked == ["orders", "id"]
