"""``cronoq_store.testing``'s pytest plugin, as an application uses it: in a pytest run of its own.

The application's test file below enables the plugin the documented way and checks what its
tests rely on: a migrated schema on a real server, a store that opens on it without
migrating, a schema per test. The run here then checks that the schemas were dropped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import URL

from cronoq_store.testing import TEST_URL_ENV

from .pgharness import admin_execute

_INI = """\
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
filterwarnings = error
"""

_CONFTEST = 'pytest_plugins = ["cronoq_store.testing.pytest_plugin"]\n'

_APPLICATION_TESTS = """
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from cronoq_store import PgStore, PgStoreConfig, TaskId, TimeBase

SEEN = Path(__file__).with_name("schemas.txt")


async def tables(url: str, schema: str) -> set[str]:
    conn = await asyncpg.connect(make_url(url).render_as_string(hide_password=False))
    try:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = $1", schema
        )
    finally:
        await conn.close()
    return {row[0] for row in rows}


@pytest.mark.asyncio
@pytest.mark.parametrize("n", [1, 2])
async def test_a_migrated_schema_of_its_own(
    cronoq_database_url: str, cronoq_schema: str, n: int
) -> None:
    with SEEN.open("a") as seen:
        seen.write(cronoq_schema + "\\n")
    assert {"cronoq_tasks", "cronoq_leader", "cronoq_recurring", "cronoq_alembic_version"} <= (
        await tables(cronoq_database_url, cronoq_schema)
    )
    config = PgStoreConfig(schema=cronoq_schema)
    async with await PgStore.connect(cronoq_database_url, config, migrate=False) as store:
        assert await store.get_task(TaskId(1)) is None


@pytest.mark.asyncio
async def test_an_open_store(cronoq_store: PgStore, cronoq_schema: str) -> None:
    assert cronoq_store._config.schema == cronoq_schema
    assert await cronoq_store.acquire_leadership() == 1
    assert (await cronoq_store.recover(TimeBase.now())).tasks == []
"""


def _application(pytester: pytest.Pytester) -> Path:
    pytester.makeini(_INI)
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(test_application=_APPLICATION_TESTS)
    return pytester.path / "schemas.txt"


async def test_the_plugin_gives_each_test_a_migrated_schema_and_drops_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pg_url: URL
) -> None:
    monkeypatch.setenv(TEST_URL_ENV, pg_url.render_as_string(hide_password=False))
    seen = _application(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    schemas = seen.read_text().split()
    assert len(set(schemas)) == len(schemas) == 2, schemas
    left = await admin_execute(
        pg_url, "SELECT nspname FROM pg_namespace WHERE nspname = ANY($1)", schemas
    )
    assert left == [], "the plugin left its schemas behind"


def test_without_a_url_the_plugin_starts_an_embedded_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TEST_URL_ENV, raising=False)
    _application(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
