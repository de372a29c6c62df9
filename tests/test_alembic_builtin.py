"""pytest-alembic's built-in tests: single head, upgrade, model matches DDL, up/down consistency.

They run against a schema of their own, with an ``AsyncEngine`` (``NullPool``) that env.py
accepts in ``attributes["connection"]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pytest_alembic import Config as PytestAlembicConfig
from pytest_alembic.tests import (
    test_model_definitions_match_ddl,
    test_single_head_revision,
    test_up_down_consistency,
    test_upgrade,
)
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from cronoq_store._migrations import alembic_config as cronoq_alembic_config
from cronoq_store._urls import async_url

from .pgharness import asyncpg_dsn

__all__ = [
    "test_model_definitions_match_ddl",
    "test_single_head_revision",
    "test_up_down_consistency",
    "test_upgrade",
]

SCHEMA = "t_pytest_alembic"


@pytest.fixture
def alembic_config() -> PytestAlembicConfig:
    return PytestAlembicConfig.from_raw_config(cronoq_alembic_config(SCHEMA))


@pytest.fixture
def alembic_engine(pg_url: URL) -> Iterator[AsyncEngine]:
    engine = create_async_engine(async_url(pg_url), poolclass=NullPool)
    yield engine
    _drop_schema(pg_url)


def _drop_schema(pg_url: URL) -> None:
    import asyncio

    import asyncpg

    async def drop() -> None:
        conn: Any = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        finally:
            await conn.close()

    asyncio.run(drop())
