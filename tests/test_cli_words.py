"""Durations, retry policies and times as the task page and ``tasks show`` print them: in
the units an operator reads, never as raw nanoseconds."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from cronoq_store._cli import output
from cronoq_store._codec import retry_to_json
from cronoq_store._domain import RetryPolicy

S = 10**9


@pytest.mark.parametrize(
    ("ns", "words"),
    [
        (None, "-"),
        (0, "0 ns"),
        (1_500, "1.5 µs"),
        (250_000_000, "250 ms"),
        (1_500_000_000, "1.5 s"),
        (30 * S, "30 s"),
        (125 * S, "2 min 5 s"),
        (120 * S, "2 min"),
        (3_780 * S, "1 h 3 min"),
        (3_600 * S + 5 * S, "1 h"),
        (2 * 86_400 * S + 3_600 * S, "2 d 1 h"),
        (-30 * S, "-30 s"),
    ],
)
def test_durations_in_the_two_largest_units(ns: int | None, words: str) -> None:
    assert output.duration_words(ns) == words


@pytest.mark.parametrize(
    ("policy", "words"),
    [
        (
            RetryPolicy(),
            "up to 3 attempts; waits 1 s after the first failure, "
            "multiplied by 2 after each failure after it, without a cap",
        ),
        (
            RetryPolicy(5, timedelta(seconds=30), timedelta(minutes=10), 1.5),
            "up to 5 attempts; waits 30 s after the first failure, "
            "multiplied by 1.5 after each failure after it, at most 10 min",
        ),
        (
            RetryPolicy(4, timedelta(seconds=2), None, 1.0),
            "up to 4 attempts; waits 2 s after the first failure, "
            "the same after each failure after it",
        ),
        (RetryPolicy(1), "a single attempt: the first failure is final"),
    ],
)
def test_a_retry_policy_in_words(policy: RetryPolicy, words: str) -> None:
    assert output.retry_words(retry_to_json(policy)) == words


def test_a_retry_policy_of_another_shape_is_shown_as_stored() -> None:
    assert output.retry_words(None) == "no retry: the first failure is final"
    assert output.retry_words({"tries": 3}) == '{"tries": 3}'


def test_a_time_to_the_second_with_how_long_ago() -> None:
    moment = datetime.now(timezone.utc).replace(microsecond=0) - timedelta(seconds=185)
    words = output.moment_words(moment)
    assert words == f"{moment:%Y-%m-%d %H:%M:%S} UTC (3 min ago)"
    assert output.moment_words(output.rfc3339(moment)) == words
    ahead = output.moment_words(moment + timedelta(hours=2))
    assert ahead == f"{moment + timedelta(hours=2):%Y-%m-%d %H:%M:%S} UTC (in 1 h)"
    assert output.moment_words(None) == "-"
