"""``host move`` against what goes wrong around it: a process with the old placement, a
control row saying ``moving`` that no freeze wrote, rows changed in the source while the
copy reads it, and a target server whose settings render rows as other text."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

from cronoq_store import StoreError
from cronoq_store._host import move as moving
from cronoq_store._schema import tasks
from cronoq_store._urls import redact

from ..pgharness import admin_execute
from ..waits import until
from . import test_two_databases as two
from .conftest import Fleet
from .hosts import commit_one, config, serving
from .test_two_databases import _engine, leading, move_cli, state_in_control, two_hosts

#: The second server and its fleet, as the two-database tests have them.
west_server, west = two.west_server, two.west


async def schema_exists(fleet: Fleet, schema: str) -> bool:
    rows = await admin_execute(fleet.url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema)
    return bool(rows)


async def test_a_process_with_the_old_placement_cannot_enroll_a_dropped_source(
    fleet: Fleet, west: Fleet
) -> None:
    (schema,) = fleet.clusters(1)
    async with two_hosts(fleet, west, [schema]) as (east, west_host):
        await commit_one(east.host.led()[schema], 1)
        code, said = await move_cli(fleet, west, schema, "--drop-source")
        assert code == 0, said
        assert not await schema_exists(fleet, schema)
        assert await state_in_control(fleet, schema) == "moved"  # kept: it refuses below
        # Its enrolment migrates: it must neither make an empty cluster there nor lead one.
        with pytest.raises(StoreError, match="remove the tombstone first"):
            await east.host.enroll(schema)
        assert not await schema_exists(fleet, schema)
        assert await state_in_control(fleet, schema) == "moved"
        await until(leading(west_host, schema), "the target leads it")


async def test_a_moving_row_no_freeze_wrote_is_not_copied(fleet: Fleet, west: Fleet) -> None:
    (schema,) = fleet.clusters(1)
    async with two_hosts(fleet, west, [schema]) as (east, _west_host):
        await commit_one(east.host.led()[schema], 1)
        note = f"moving to {redact(west.url.set(drivername='postgresql'))}"
        await admin_execute(
            fleet.url,
            f"UPDATE \"{fleet.control}\".clusters SET state = 'moving', refused_why = $1 "
            "WHERE schema_name = $2",
            note,
            schema,
        )
        code, said = await move_cli(fleet, west, schema)
        assert code == 1
        assert "is not frozen by a move" in said
        assert not await schema_exists(west, schema)


async def test_the_copy_reads_one_snapshot(
    fleet: Fleet, west: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A term recorded in the source once the first table is copied: the copy, one
    snapshot, lacks it; the verification, reading the source again, sees it."""
    (schema,) = fleet.clusters(1)
    stream = moving._stream

    async def then_a_term(reader: Any, writer: Any, schema: str, table: Any) -> int:
        copied = await stream(reader, writer, schema, table)
        if table.name == "cronoq_tasks":
            await admin_execute(
                fleet.url,
                f'INSERT INTO "{schema}".cronoq_leader_history (epoch, began_at, pid) '
                "VALUES (100000, now(), 1)",
            )
        return copied

    monkeypatch.setattr(moving, "_stream", then_a_term)
    async with two_hosts(fleet, west, [schema]) as (east, _west_host):
        await commit_one(east.host.led()[schema], 1)
        terms = await admin_execute(
            fleet.url, f'SELECT count(*) AS n FROM "{schema}".cronoq_leader_history'
        )
        lines: list[str] = []
        source, target = _engine(fleet.url), _engine(west.url)
        try:
            with pytest.raises(moving.MoveError, match=r"leader_history differs .*not the source"):
                await moving.move(
                    source, target, schema, group=fleet.group, control_schema=fleet.control,
                    said=lines.append,
                )  # fmt: skip
        finally:
            await source.dispose()
            await target.dispose()
        # The freeze's own term is the one more than before it.
        assert f"leader_history {terms[0]['n'] + 1:,} rows" in lines[-1], lines


async def test_a_target_server_in_another_time_zone(fleet: Fleet, west: Fleet) -> None:
    """initdb takes the machine's settings: two servers in two regions render the same
    timestamptz (and bytea) as other text."""
    (schema,) = fleet.clusters(1)
    db = west.url.database
    settings = {"TimeZone": "Asia/Tokyo", "bytea_output": "escape", "DateStyle": "SQL, DMY"}
    async with two_hosts(fleet, west, [schema]) as (east, _west_host):
        await commit_one(east.host.led()[schema], 1)
        for name, value in settings.items():
            await admin_execute(west.url, f'ALTER DATABASE "{db}" SET "{name}" = \'{value}\'')
        try:
            code, said = await move_cli(fleet, west, schema)
        finally:
            for name in settings:
                await admin_execute(west.url, f'ALTER DATABASE "{db}" RESET "{name}"')
        assert code == 0, said


async def test_a_move_resumed_after_the_target_pruned_the_freeze_term_ends(
    fleet: Fleet, west: Fleet
) -> None:
    """Interrupted once enrolled; the target leads the cluster and its history drops the
    freeze's term (it keeps the newest 1,000): the copy is still known as this move's."""
    (schema,) = fleet.clusters(1)
    async with two_hosts(fleet, west, [schema]) as (east, west_host):
        await commit_one(east.host.led()[schema], 1)
        await two.interrupted_move(fleet, west.url, schema, "enrolled")
        await until(leading(west_host, schema), "the target leads it")
        await commit_one(west_host.host.led()[schema], 2)
        await admin_execute(
            west.url,
            f'UPDATE "{schema}".cronoq_leader_history SET epoch = epoch + 10000, pid = 1',
        )
        code, said = await move_cli(fleet, west, schema)
        assert code == 0, said
        assert await state_in_control(fleet, schema) == "moved"


async def test_a_target_role_that_cannot_create_is_refused_before_the_freeze(
    fleet: Fleet, west: Fleet
) -> None:
    (schema,) = fleet.clusters(1)
    role = f"{fleet.prefix}_low"
    async with two_hosts(fleet, west, [schema]) as (east, _west_host):
        for sql in (
            f"CREATE ROLE {role} LOGIN PASSWORD 'pw-{role}'",
            f'GRANT CONNECT ON DATABASE "{west.url.database}" TO {role}',
            f'GRANT USAGE ON SCHEMA "{fleet.control}" TO {role}',
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{fleet.control}" '
            f"TO {role}",
        ):
            await admin_execute(west.url, sql)
        try:
            low_url = west.url.set(username=role, password=f"pw-{role}")
            low = Fleet(low_url, fleet.control, fleet.group, fleet.prefix)
            code, said = await move_cli(fleet, low, schema)
        finally:
            await admin_execute(west.url, f"DROP OWNED BY {role} CASCADE")
            await admin_execute(west.url, f"DROP ROLE {role}")
        assert code == 1, said
        assert "the migrations cannot make schema" in said
        assert "nothing was frozen" in said
        assert await state_in_control(fleet, schema) == "active"
        assert schema in east.host.led()


async def test_a_cluster_moves_back_as_docs_operations_says(fleet: Fleet, west: Fleet) -> None:
    """There and back with --drop-source: the tombstone's ``moved`` row, kept in the first
    database, is replaced by the cluster coming back."""
    (schema,) = fleet.clusters(1)
    async with two_hosts(fleet, west, [schema]) as (east, west_host):
        await commit_one(east.host.led()[schema], 1)
        code, said = await move_cli(fleet, west, schema, "--drop-source")
        assert code == 0, said
        await until(leading(west_host, schema), "the target leads it")
        code, said = await move_cli(west, fleet, schema, "--drop-source")
        assert code == 0, said
        assert await state_in_control(fleet, schema) == "active"
        await until(leading(east, schema), "led where it came from")
        await commit_one(east.host.led()[schema], 2)


async def test_a_move_resumed_with_another_spelling_of_its_target_says_how(
    fleet: Fleet, west: Fleet
) -> None:
    (schema,) = fleet.clusters(1)
    other = west.url.set(host="localhost" if west.url.host != "localhost" else "127.0.0.1")
    async with two_hosts(fleet, west, [schema]):
        await two.interrupted_move(fleet, other, schema, "frozen")
        code, said = await move_cli(fleet, west, schema)
        assert code == 1
        assert "--to spelled as the note shows" in said
        assert "elsewhere" not in said


async def test_a_target_that_is_the_source_under_another_url_is_refused(fleet: Fleet) -> None:
    """``--to`` reaching the source database through another name of its server: refused,
    the cluster led on, and the message never says to drop the schema "there" (the only
    copy). Another database of the same server is a valid target."""
    (schema,) = fleet.clusters(1)
    same = fleet.url.set(host="localhost" if fleet.url.host != "localhost" else "127.0.0.1")
    other = fleet.url.set(database=f"{fleet.prefix}_db")
    await admin_execute(fleet.url, f'CREATE DATABASE "{other.database}"')
    try:
        async with serving(fleet.url, config(fleet, "east"), [schema]) as east:
            await until(leading(east, schema), "the host leads it")
            code, said = await move_cli(fleet, replace(fleet, url=same), schema, "--drop-source")
            assert code == 1
            assert "reaches the source database itself" in said
            assert "drop or rename" not in said
            assert await state_in_control(fleet, schema) == "active"
            await commit_one(east.host.led()[schema], 1)
            code, said = await move_cli(fleet, replace(fleet, url=other), schema)
            assert code == 0, said
    finally:
        await admin_execute(fleet.url, f'DROP DATABASE "{other.database}" WITH (FORCE)')


async def test_the_digest_of_a_table_in_parts_tells_every_row(fleet: Fleet) -> None:
    """A table's digest joins its rows' md5s part by part (2 rows a part here, 2^20 in a
    move), never into one value over the 1 GB bound: equal copies agree, and a changed row
    in any part, or a row missing, does not."""
    a, b = fleet.clusters(2)
    async with serving(fleet.url, config(fleet, "digest"), [a]) as served:
        await until(lambda: a in served.host.led(), "the host to lead")
        for n in range(5):
            await commit_one(served.host.led()[a], n)
    await admin_execute(fleet.url, f'CREATE SCHEMA "{b}"')
    copy = f'"{b}".cronoq_tasks'
    await admin_execute(fleet.url, f'CREATE TABLE {copy} (LIKE "{a}".cronoq_tasks)')
    await admin_execute(fleet.url, f'INSERT INTO {copy} SELECT * FROM "{a}".cronoq_tasks')
    engine = _engine(fleet.url)
    try:

        async def digests(part_rows: int) -> tuple[tuple[int, str], tuple[int, str]]:
            statement = moving._digest(tasks, tasks.c.id, part_rows)
            first = await moving._one(engine, a, statement)
            second = await moving._one(engine, b, statement)
            return (first[0], first[1]), (second[0], second[1])

        source, same = await digests(2)
        assert source == same
        assert source[0] == 5
        assert source != (await digests(1 << 20))[0]  # the parts are in the digest
        ids = [row["id"] for row in await admin_execute(fleet.url, f"SELECT id FROM {copy}")]
        for changed in sorted(ids)[1::2]:  # the last row of a part, then the first of one
            await admin_execute(
                fleet.url, f"UPDATE {copy} SET message = 'changed' WHERE id = $1", changed
            )
            source, copied = await digests(2)
            assert copied[0] == source[0]
            assert copied[1] != source[1]
            await admin_execute(
                fleet.url, f"UPDATE {copy} SET message = NULL WHERE id = $1", changed
            )
        await admin_execute(fleet.url, f"DELETE FROM {copy} WHERE id = $1", max(ids))
        source, copied = await digests(2)
        assert (copied[0], copied[1] != source[1]) == (4, True)
    finally:
        await engine.dispose()


def test_the_digest_orders_a_text_key_by_its_bytes() -> None:
    """Two databases of other collations order names two ways: a faithful copy of the
    recurring schedules would differ in digest for ever (only C collations exist on the
    test server, so the statement itself is what can be checked)."""
    dialect = PGDialect_asyncpg()  # type: ignore[no-untyped-call]
    for table, key in moving._COPIED:
        rendered = str(moving._digest(table, key).compile(dialect=dialect))
        assert ('COLLATE "C"' in rendered) is (table.name == "cronoq_recurring")
