"""PgStoreConfig refuses settings that could never work, when it is built."""

from __future__ import annotations

from typing import Any

import pytest

from cronoq_store import PgStoreConfig


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"schema": "1bad"}, "invalid schema name"),
        ({"retention": 0}, "retention must be a positive"),
        ({"lock_poll": float("nan")}, "lock_poll must be a positive"),
        ({"commit_timeout": True}, "commit_timeout must be a number"),
        ({"keepalive": 10.0, "session_timeout": 10.0}, "keepalive .* must be shorter"),
        ({"lock_poll": 5.0, "session_timeout": 2.0, "keepalive": 1.0}, "lock_poll .* shorter"),
        ({"max_connections": 0}, "max_connections must be at least 1"),
        ({"application_name": ""}, "application_name must be"),
        ({"prepared_statements": "no"}, "prepared_statements must be a bool"),
    ],
)
def test_impossible_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PgStoreConfig(**settings)


def test_defaults_are_the_seeds() -> None:
    config = PgStoreConfig()
    assert (config.schema, config.retention, config.lock_poll, config.keepalive) == (
        "public",
        3600.0,
        0.5,
        1.0,
    )
    assert (config.session_timeout, config.commit_timeout, config.max_connections) == (
        10.0,
        30.0,
        8,
    )
    assert config.prepared_statements is True
