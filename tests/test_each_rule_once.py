"""Rules written once (issue 21): each test pins that every place applies the one rule."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

import cronoq_store.testing._memory as memory
from cronoq_store import (
    GroupCommitter,
    PgStoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
)
from cronoq_store._codec import (
    QUARANTINE_PREFIX,
    quarantine_reason,
)
from cronoq_store._commit_path import MAX_COMMIT_BYTES, batch_size
from cronoq_store._errors import BatchTooLargeError
from cronoq_store._queries import prune_age_ns
from cronoq_store._retry import Backoff, bounded
from cronoq_store._schema import UPDATE_PARAMS, StatusUpdates
from cronoq_store._statements import update_status_fenced
from cronoq_store.telemetry import DISABLED
from cronoq_store.testing import InMemoryStore

from .support import FIXED_BASE, CommitMeasuredByCommit


class _Store(CommitMeasuredByCommit):
    max_commit_bytes = MAX_COMMIT_BYTES
    telemetry = DISABLED

    async def commit(self, *args: Any) -> None:
        pass

    async def ping(self) -> None:
        pass


# --- a number of seconds --------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, "1", None])
def test_every_seconds_setting_refuses_a_non_number_alike(value: Any) -> None:
    """Settings, the in-memory store's retention, the committer's timeout, backoff and
    prune's age: one rule, one message, for a value that is not a number at all."""
    with pytest.raises(ValueError, match=r"^retention must be a number of seconds"):
        PgStoreConfig(retention=value)
    with pytest.raises(ValueError, match=r"^retention must be a number of seconds"):
        InMemoryStore(retention=value)
    with pytest.raises(ValueError, match=r"^backoff initial must be a number of seconds"):
        Backoff(initial=value, cap=1.0)
    with pytest.raises(ValueError, match=r"^older_than: must be a number of seconds"):
        prune_age_ns(value)


async def test_the_committers_timeout_follows_the_same_rule() -> None:
    committer = GroupCommitter(_Store(), 1, FIXED_BASE)
    with pytest.raises(ValueError, match=r"^timeout must be a number of seconds"):
        await committer.close(timeout=True)
    with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds"):
        await committer.close(timeout=float("nan"))
    await committer.close()


# --- quarantine and batch size: the same from both stores -----------------------------------


def test_a_quarantine_reason_is_cut_to_its_limit_with_an_ellipsis() -> None:
    reason = quarantine_reason(ValueError("é" * 600 + "\0"))
    assert len(reason) == 500
    assert reason == "é" * 499 + "…"
    assert quarantine_reason(KeyError("k")) == "KeyError: 'k'"
    assert quarantine_reason(ValueError("a\0b")) == "a\ufffdb"


async def test_the_in_memory_store_quarantines_with_the_same_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long decode error is cut as ``PgStore`` cuts it (it was cut bare, 500 characters)."""
    store = InMemoryStore()
    await store.acquire_leadership()
    await store.commit(1, FIXED_BASE, [Submitted(TaskId(7), 1, 0, TaskSpec(b""))], [])

    class Refusing:
        def __init__(self, base: TimeBase) -> None:
            pass

        def decode(self, *row: Any) -> Any:
            raise ValueError("x" * 1000)

    monkeypatch.setattr(memory, "LiveTasks", Refusing)
    await store.recover(FIXED_BASE)
    record = await store.get_task(TaskId(7))
    assert record is not None
    assert record.message == f"{QUARANTINE_PREFIX} {'x' * 499}…"


async def test_the_in_memory_store_refuses_a_large_batch_as_pgstore_does() -> None:
    store = InMemoryStore()
    await store.acquire_leadership()
    store.max_commit_bytes = 1
    batch = [Submitted(TaskId(7), 1, 0, TaskSpec(b""))]
    with pytest.raises(BatchTooLargeError) as caught:
        await store.commit(1, FIXED_BASE, batch, [])
    assert str(caught.value) == (
        f"committing a batch failed: its 1 mutations and 0 outputs take up to "
        f"{batch_size(batch, [])} bytes, over the 1 bytes one commit may send (PostgreSQL "
        "refuses a message over 1 GiB); commit them in smaller batches"
    )


# --- the status-update columns ---------------------------------------------------------------


def test_update_status_binds_exactly_the_declared_arrays() -> None:
    compiled = update_status_fenced.compile()
    # The caller's parameters: the transitions' arrays and the fence (the leader row's id
    # is the statement's own, bound with its value).
    given = {name for name, bind in compiled.binds.items() if bind.value is None}
    assert given == {*UPDATE_PARAMS, "epoch", "incarnation"}
    for f in dataclasses.fields(StatusUpdates):
        bound = compiled.binds[f.name].type
        assert type(bound.item_type) is type(f.metadata["sql"]), f.name  # type: ignore[attr-defined]


# --- the one timeout -------------------------------------------------------------------


async def test_bounded_aborts_then_cancels_work_that_stays_silent() -> None:
    aborted: list[bool] = []
    silent = asyncio.Event()

    with pytest.raises(asyncio.TimeoutError, match=r"the session did not answer within 0\.01 s"):
        await bounded(
            silent.wait(),
            0.01,
            abort=lambda: aborted.append(True),
            grace=0.01,
            silent="the session did not answer",
        )
    assert aborted == [True]
    with pytest.raises(asyncio.TimeoutError, match=r"no answer within 0\.01 s"):
        await bounded(silent.wait(), 0.01)
