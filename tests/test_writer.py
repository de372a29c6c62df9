"""The writer's choices and its one-message transaction opening, without a server."""

from __future__ import annotations

import pytest
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg

from cronoq_store import _statements as st
from cronoq_store._commit_path import (
    COPY_MIN_ROWS,
    BatchWriter,
    fold,
)
from cronoq_store._door import CompiledStatement, Opening

from .support import FIXED_BASE, RUNNING, changed, submitted

DIALECT = PGDialect_asyncpg()  # type: ignore[no-untyped-call]


def compiled(statement: object) -> CompiledStatement:
    return CompiledStatement.of(statement, DIALECT, "s")  # type: ignore[arg-type]


def test_the_opening_sends_begin_and_the_check_with_its_integers_as_literals() -> None:
    opening = Opening.of(compiled(st.epoch_held_for_share))
    sql = opening.sql({"epoch": 2**30 + 7, "incarnation": 2**32 - 1})
    assert sql.startswith("BEGIN; SELECT s.cronoq_leader.epoch")
    assert "$" not in sql
    assert f"s.cronoq_leader.epoch = {2**30 + 7}::INTEGER" in sql
    assert f"s.cronoq_leader.tableoid = {2**32 - 1}::OID" in sql
    assert "s.cronoq_leader.id = 1::SMALLINT" in sql  # the construct's own value
    begin, *settings = map(compiled, st.borrowed_transaction(5000))
    pinned = Opening.of(compiled(st.epoch_held_for_share), *settings, begin=begin.sql)
    sql = pinned.sql({"epoch": 9, "incarnation": 7})
    *sent, check = sql.split("; ")
    assert sent == [begin.sql, *(s.sql for s in settings)]
    assert begin.sql.startswith("BEGIN ISOLATION LEVEL READ COMMITTED, READ WRITE")
    assert check.endswith("FOR SHARE")
    assert "epoch = 9::INTEGER" in check


@pytest.mark.parametrize("value", ["1; DROP TABLE x", 1.5, True, None])
def test_the_opening_renders_nothing_but_integers(value: object) -> None:
    opening = Opening.of(compiled(st.epoch_held_for_share))
    with pytest.raises(TypeError, match="only integers"):
        opening.sql({"epoch": value, "incarnation": 1})


def test_only_the_last_statement_of_an_opening_takes_parameters() -> None:
    with pytest.raises(ValueError, match="only the epoch check"):
        Opening.of(compiled(st.epoch_held_for_share), compiled(st.epoch_held_for_share))


def test_new_tasks_go_by_copy_from_the_threshold_on() -> None:
    writer = BatchWriter(DIALECT, "s")
    pinned = BatchWriter(DIALECT, "s", borrowed=st.borrowed_transaction(5000))
    below = fold([submitted(n) for n in range(COPY_MIN_ROWS - 1)], FIXED_BASE, 0)
    at = fold([submitted(n) for n in range(COPY_MIN_ROWS)], FIXED_BASE, 0)
    mixed = fold(
        [changed(10**6, RUNNING), *map(submitted, range(2))],
        FIXED_BASE,
        0,
    )
    assert [writer.path(b) for b in (below, at, mixed)] == ["insert", "copy", "transaction"]
    # A borrowed session's batch of new tasks is one statement too, in the transaction that
    # sets the store's settings.
    assert [pinned.path(b) for b in (below, at, mixed)] == ["insert", "copy", "transaction"]
