"""A fleet per test: its own control schema and host group, and cluster schemas named after
it; every schema dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from sqlalchemy.engine import URL

from ..pgharness import admin_execute


@dataclass(frozen=True)
class Fleet:
    """One test's control schema, group and cluster schema names."""

    url: URL
    control: str
    group: str
    prefix: str

    def clusters(self, n: int) -> list[str]:
        return [f"{self.prefix}_{i:03d}" for i in range(n)]

    async def owners(self) -> dict[str, int | None]:
        """Each enrolled cluster's owning process, from the control schema."""
        rows = await admin_execute(
            self.url,
            f'SELECT schema_name, owner FROM "{self.control}".clusters WHERE host_group = $1',
            self.group,
        )
        return {r["schema_name"]: r["owner"] for r in rows}

    async def shares(self) -> list[int]:
        """How many clusters each live owner leads, largest first (unowned not counted)."""
        counts: dict[int, int] = {}
        for owner in (await self.owners()).values():
            if owner is not None:
                counts[owner] = counts.get(owner, 0) + 1
        return sorted(counts.values(), reverse=True)

    async def stored_epoch(self, schema: str) -> int:
        rows = await admin_execute(self.url, f'SELECT epoch FROM "{schema}".cronoq_leader')
        return int(rows[0]["epoch"])


@pytest.fixture
async def fleet(pg_url: URL) -> AsyncIterator[Fleet]:
    tag = uuid.uuid4().hex[:8]
    made = Fleet(pg_url, f"h_{tag}", f"g_{tag}", f"f_{tag}")
    yield made
    rows = await admin_execute(
        pg_url, "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", f"%{tag}%"
    )
    for row in rows:
        await admin_execute(pg_url, f'DROP SCHEMA IF EXISTS "{row["nspname"]}" CASCADE')
