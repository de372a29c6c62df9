"""Where the console reads: the database URL, one pooled engine for the console's life
(connecting costs more than most pages' statements), and the triggers the operator trusts.
Every connection it hands out went through the CLI's own opening (``cli.database``: the
trust check, the schema applied); the overview checks its whole page in one statement
first (:meth:`Source.vet`), and the opening then skips the check of those schemas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from .. import _catalog as catalog
from .. import _door as door
from .._cli import database, hosted
from .._cli.app import Options
from .._errors import MigrationError

__all__ = ["POOL_SIZE", "ClusterNotFound", "ClusterPage", "Source"]

#: Connections the console keeps open (as many again may open under load).
POOL_SIZE = 2


class ClusterNotFound(LookupError):
    """No cluster in that schema (or a name no schema can have): a 404."""


@dataclass(frozen=True)
class ClusterPage:
    """A page of the cluster schemas whose names hold a search, in name order."""

    names: tuple[str, ...]
    #: Schemas whose names hold the search, and those of them before this page.
    matching: int
    preceding: int
    #: Schemas holding a cluster, matching or not (``None``: not looked up).
    clusters: int | None
    #: Whether matching names come after, and before, this page.
    more_after: bool
    more_before: bool


class Source:
    def __init__(
        self,
        url: str,
        trusted_triggers: frozenset[str] = frozenset(),
        control_schema: str = hosted.DEFAULT_CONTROL_SCHEMA,
    ) -> None:
        self.url = url
        self.trusted_triggers = trusted_triggers
        #: Where the owners of clusters a host group leads are read.
        self.control_schema = control_schema
        self.engine = database.engine(url, pool_size=POOL_SIZE)

    @asynccontextmanager
    async def connect(
        self, schema: str, vetted: database.Vetted | None = None
    ) -> AsyncIterator[AsyncConnection]:
        """A connection to ``schema``'s cluster, as the CLI opens one (without the trust
        check when ``vetted``, from :meth:`vet`, found nothing in it)."""
        options = Options(url=self.url, schema=schema, trusted_triggers=self.trusted_triggers)
        async with database.database(options, self.engine, vetted) as conn:
            yield conn

    async def vet(
        self, schemas: Sequence[str]
    ) -> tuple[database.Vetted, dict[str, MigrationError]]:
        """The trust check of all of ``schemas`` in one statement: those it found nothing
        in, for :meth:`connect`, and the refusal of each other one."""
        return await database.vet(self.engine, schemas, self.trusted_triggers)

    async def hosts(self, schemas: Sequence[str]) -> hosted.HostRows:
        """The control rows of ``schemas`` (those a host group leads have one) in one
        statement, after the control schema's trust check; where this role may not read
        it, each hosted cluster of the page says so (:func:`~.hosted.read_hosts`)."""
        async with (
            door.translated("reading the host control schema"),
            self.engine.connect() as conn,
        ):
            return await hosted.read_hosts(conn, schemas, self.control_schema)

    async def cluster_page(
        self, search: str, size: int, after: str = "", before: str | None = None
    ) -> ClusterPage:
        """At most ``size`` cluster schemas whose names hold ``search`` (any case), the
        first ones after ``after``, or the last ones before ``before`` when given: one
        catalog query, however many schemas the database holds."""
        params = {"pattern": catalog.substring_pattern(search), "limit": size + 1}
        async with self.engine.connect() as conn:
            if before is None:
                statement, params["after"] = catalog.cluster_page_after, after
            else:
                statement, params["before"] = catalog.cluster_page_before, before
            row = (await conn.execute(statement, params)).one()
        found: list[str] = list(row.names)
        beyond = len(found) > size
        shown = found[:size]
        if before is None:
            return ClusterPage(
                tuple(shown), row.matching, row.preceding, row.clusters, beyond, row.preceding > 0
            )
        preceding = row.preceding - len(shown)
        return ClusterPage(
            tuple(reversed(shown)),
            row.matching,
            preceding,
            row.clusters,
            row.matching > row.preceding,
            beyond,
        )

    async def known(self, schema: str) -> None:
        """``ClusterNotFound`` unless ``schema`` holds a cluster."""
        async with self.engine.connect() as conn:
            found = (await conn.execute(catalog.cluster_schema_exists, {"schema": schema})).scalar()
        if not found:
            raise ClusterNotFound(schema)

    async def close(self) -> None:
        await self.engine.dispose()
