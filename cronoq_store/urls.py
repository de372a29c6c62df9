"""Database URLs: accept what users type, hand SQLAlchemy what it needs, never print secrets.

A URL can carry a password in its user info (``user:secret@host``, percent-encoded or not),
in query parameters (``?password=``, the libpq form SQLAlchemy and asyncpg accept, and other
secret-bearing ones such as ``sslpassword``), and a libpq keyword DSN in ``key=value`` pairs.
:func:`scrub` is the one place that masks them; :func:`redact` renders a URL through it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus, unquote

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

__all__ = ["MASK", "URL_ENV", "async_url", "redact", "scrub"]

#: What a secret is replaced with.
MASK = "***"

URL_ENV = "CRONOQ_DATABASE_URL"
"""The environment variable the CLI and ``alembic`` read the database URL from."""

_PLAIN_DRIVERS = {"postgres", "postgresql", "postgresql+asyncpg"}
#: A parameter whose name contains one of these carries a secret (``password``,
#: ``sslpassword``, ``PGPASSWORD``, ``auth_token``...).
_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token")
# The user info of a URL: the password runs up to the last "@" before the host (a password
# with an unencoded "@" is masked whole, even where SQLAlchemy would split it).
_USERINFO = re.compile(r"(?P<head>://[^:/@\s]*:)(?P<secret>\S*?)(?=@[^@\s/?]*(?:[/?\s]|$))")
# A secret-named parameter in a query string or a keyword DSN: `password=x`, `password='x y'`.
_PARAMETER = re.compile(
    r"(?P<head>\b[\w.-]*(?:" + "|".join(_SECRET_WORDS) + r")[\w.-]*\s*=\s*)"
    r"(?P<secret>'(?:[^'\\]|\\.)*'|[^&\s'\"]+)",
    re.IGNORECASE,
)


def _is_secret(name: str) -> bool:
    return any(word in name.lower() for word in _SECRET_WORDS)


def _parse(url: str | URL) -> URL | None:
    if isinstance(url, URL):
        return url
    try:
        return make_url(url)
    except (ArgumentError, ValueError):  # a port that is not a number is a ValueError
        return None


def _secrets(url: str | URL) -> set[str]:
    """Every form of every secret ``url`` carries, as it could appear in a message."""
    found: set[str] = set()
    parsed = _parse(url)
    if parsed is not None:
        if parsed.password:
            found.add(str(parsed.password))
        for name, value in parsed.query.items():
            if _is_secret(name):
                found.update((value,) if isinstance(value, str) else value)
    if isinstance(url, str):
        for pattern in (_USERINFO, _PARAMETER):
            for match in pattern.finditer(url):
                raw = match["secret"]
                found.update((raw, unquote(raw), raw.strip("'")))
    forms: set[str] = set()
    for secret in found:
        if secret:
            forms.update((secret, quote(secret, safe=""), quote_plus(secret)))
    return forms


def scrub(text: str, urls: Iterable[str | URL | None] = ()) -> str:
    """``text`` with every password masked: those ``urls`` carry, wherever a driver or library
    put them, and any URL password or secret-named parameter written in ``text`` itself."""
    secrets: set[str] = set()
    for url in urls:
        if url is not None:
            secrets |= _secrets(url)
    # Longest first, so that a secret containing another is masked whole.
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _mask_written(text)


def _mask_written(text: str) -> str:
    """Mask URL passwords and secret-named parameters written in ``text``."""
    text = _USERINFO.sub(lambda m: m["head"] + (MASK if m["secret"] else ""), text)
    return _PARAMETER.sub(lambda m: m["head"] + MASK, text)


def redact(url: str | URL) -> str:
    """``url`` as text with every secret masked, for logs, errors and CLI output."""
    parsed = _parse(url)
    if parsed is None or (parsed.host is not None and "@" in parsed.host):
        # Unparseable, or a password with an unencoded "@" that SQLAlchemy would split:
        # masked as typed.
        return scrub(str(url), [url])
    query = {name: MASK if _is_secret(name) else value for name, value in parsed.query.items()}
    masked = parsed.set(password=MASK if parsed.password else None, query=query)
    # The secrets are gone from the parts: no search for their text, which would also mask
    # words that merely equal them (a password "postgres" in "postgresql://").
    return _mask_written(masked.render_as_string(hide_password=False))


def async_url(url: str | URL) -> URL:
    """The ``postgresql+asyncpg`` form of ``url``.

    Accepts ``postgres://``, ``postgresql://`` and ``postgresql+asyncpg://`` URLs, including
    unix-socket ones (``postgresql:///db?host=/run/postgresql``). A ``?password=`` parameter
    becomes the URL's password, so that SQLAlchemy's own masking (``str(engine.url)``, its
    logging) covers it. Raises ``ValueError`` for anything else, with the password masked.
    """
    parsed = _parse(url)
    if parsed is None:
        # Raised outside any handler: no chained parser error repeats the URL.
        raise ValueError(f"invalid database URL {redact(url)}: expected postgresql://user@host/db")
    if parsed.drivername not in _PLAIN_DRIVERS:
        raise ValueError(
            f"unsupported database URL {redact(parsed)}: cronoq-store speaks PostgreSQL through "
            "asyncpg (postgresql:// or postgresql+asyncpg://)"
        )
    if parsed.host is not None and "@" in parsed.host:
        raise ValueError(
            f"invalid database URL {redact(url)}: an '@' in the password must be "
            "percent-encoded (%40)"
        )
    unsupported = sorted(n for n in parsed.query if _is_secret(n) and n != "password")
    if unsupported:
        raise ValueError(
            f"database URL {redact(parsed)}: asyncpg does not take {', '.join(unsupported)} "
            "as a URL parameter; give the engine an ssl.SSLContext instead (from_engine)"
        )
    password = parsed.query.get("password")
    if password is not None:
        # asyncpg takes the query's password over the user info's: so does this.
        value = password if isinstance(password, str) else password[-1]
        parsed = parsed.difference_update_query(["password"]).set(password=value)
    return parsed.set(drivername="postgresql+asyncpg")
