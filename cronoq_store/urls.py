"""Database URLs: accept what users type, hand SQLAlchemy what it needs, never print secrets."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["async_url", "redact"]

_PLAIN_DRIVERS = {"postgres", "postgresql", "postgresql+asyncpg"}


def async_url(url: str | URL) -> URL:
    """The ``postgresql+asyncpg`` form of ``url``.

    Accepts ``postgres://``, ``postgresql://`` and ``postgresql+asyncpg://`` URLs, including
    unix-socket ones (``postgresql:///db?host=/run/postgresql``). Raises ``ValueError`` for
    anything else, with the password masked.
    """
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except ArgumentError:
        raise ValueError("invalid database URL: expected postgresql://user@host/db") from None
    if parsed.drivername not in _PLAIN_DRIVERS:
        raise ValueError(
            f"unsupported database URL {redact(parsed)}: cronoq-store speaks PostgreSQL through "
            "asyncpg (postgresql:// or postgresql+asyncpg://)"
        )
    return parsed.set(drivername="postgresql+asyncpg")


def redact(url: str | URL) -> str:
    """``url`` as text with its password masked, for logs, errors and CLI output."""
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except ArgumentError:
        return "<unparseable URL>"
    return parsed.render_as_string(hide_password=True)
