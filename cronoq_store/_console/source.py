"""Where the console reads: the database URL, one pooled engine for the console's life
(connecting costs more than most pages' statements), and the triggers the operator trusts.
Every connection it hands out went through the CLI's own opening (``cli.database``: the
trust check, the schema applied)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .._cli import database
from .._cli.app import Options

__all__ = ["POOL_SIZE", "ClusterNotFound", "Source"]

#: Connections the console keeps open (as many again may open under load).
POOL_SIZE = 2


class ClusterNotFound(LookupError):
    """No cluster in that schema (or a name no schema can have): a 404."""


class Source:
    def __init__(self, url: str, trusted_triggers: frozenset[str] = frozenset()) -> None:
        self.url = url
        self.trusted_triggers = trusted_triggers
        self.engine = database.engine(url, pool_size=POOL_SIZE)

    @asynccontextmanager
    async def connect(self, schema: str) -> AsyncIterator[AsyncConnection]:
        """A connection to ``schema``'s cluster, as the CLI opens one."""
        options = Options(url=self.url, schema=schema, trusted_triggers=self.trusted_triggers)
        async with database.database(options, self.engine) as conn:
            yield conn

    async def cluster_schemas(self) -> list[str]:
        """Every schema of the database holding a cluster (the CLI's own catalog query)."""
        async with self.engine.connect() as conn:
            return list((await conn.execute(catalog.cluster_schemas)).scalars())

    async def known(self, schema: str) -> None:
        """``ClusterNotFound`` unless ``schema`` holds a cluster."""
        if schema not in await self.cluster_schemas():
            raise ClusterNotFound(schema)

    async def close(self) -> None:
        await self.engine.dispose()
