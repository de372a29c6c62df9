"""Database URLs: accept what users type, hand SQLAlchemy what it needs, never print secrets.

libpq's TLS parameters (``sslmode``, ``sslrootcert``...) ride in the URL's query, the form
operators write; :func:`engine_arguments` hands them to asyncpg, which implements their
libpq meaning, for every engine the store makes from a URL.

A URL can carry a password in its user info (``user:secret@host``, percent-encoded or not),
in query parameters (``?password=``, the libpq form SQLAlchemy and asyncpg accept, and other
secret-bearing ones such as ``sslpassword``), and a libpq keyword DSN in ``key=value`` pairs.
:func:`scrub` is the one place that masks them; :func:`redact` renders a URL through it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ._errors import UnsupportedParameterError

__all__ = [
    "MASK",
    "URL_ENV",
    "UnsupportedParameterError",
    "async_url",
    "engine_arguments",
    "redact",
    "scrub",
]

#: What a secret is replaced with.
MASK = "***"

URL_ENV = "CRONOQ_DATABASE_URL"
"""The environment variable the CLI and ``alembic`` read the database URL from."""

_PLAIN_DRIVERS = {"postgres", "postgresql", "postgresql+asyncpg"}
#: libpq's TLS parameters that asyncpg implements with libpq's meaning when they come in a
#: DSN (asyncpg 0.32 ``connect_utils``: ``verify-full`` checks the host name, ``verify-ca``
#: only the chain, ``require`` with a root certificate verifies the chain as ``verify-ca``
#: does, ``prefer`` and ``allow`` fall back, a CRL is checked along the chain); SQLAlchemy
#: would pass them to ``asyncpg.connect()`` as keywords it refuses.
_TLS_PARAMETERS = frozenset(
    {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "sslcrl",
        "sslpassword",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
        "sslnegotiation",
    }
)
#: The TLS parameters that name files.
_TLS_FILES = ("sslrootcert", "sslcert", "sslkey", "sslcrl")
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
_TLS_VERSIONS = ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3")
#: Parameters SQLAlchemy hands to ``asyncpg.connect()`` as they are, which it accepts.
_PASSED_PARAMETERS = frozenset(
    {
        "host",
        "port",
        "user",
        "database",
        "passfile",
        "service",
        "servicefile",
        "target_session_attrs",
        "krbsrvname",
        "gsslib",
        "ssl",  # asyncpg's own: a mode, without certificate files
        "prepared_statement_cache_size",  # the dialect's own
    }
)
#: A parameter whose name contains one of these carries a secret (``password``,
#: ``sslpassword``, ``PGPASSWORD``, ``auth_token``...).
_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token")
# The user info of a URL: the password runs up to the last "@" before the host (a password
# with an unencoded "@" is masked whole, even where SQLAlchemy would split it).
# An "@" is not the user info's end when another follows it before the query or a space, or
# in the query's first name (a password "a@b/c" leaves "b/c@host/db", "a@b?c" "b?c@host"):
# the password runs to that one.
_USERINFO = re.compile(
    r"(?P<head>://[^:/@\s]*:)(?P<secret>\S*?)(?=@[^@\s/?]*(?:[/?\s]|$))(?!@[^\s?]*@|@[^\s?]*\?[^=&\s]*@)"
)
# The user info of a URL as typed, when its parts cannot be told apart (an unencoded "@" or
# space in the password): the password runs to the URL's last "@".
_TYPED_USERINFO = re.compile(r"\A(?P<head>[\w+.-]+://[^:/@\s]*:)(?P<secret>.*)(?=@[^@]*\Z)", re.S)
# A URL whose user info has another "@" after its first one, before the query or in the
# query's first parameter name (which never holds one).
_SPLIT_USERINFO = re.compile(r"[^:/@]*://[^@/?]*@(?:[^?]*@|[^?]*\?[^=&]*@)")
_SECRET_NAME = r"(?P<head>\b[\w.-]*(?:" + "|".join(_SECRET_WORDS) + r")[\w.-]*\s*=\s*)"
# A value already masked stays as it is, with what follows it (scrubbing twice changes
# nothing: "?password=***: refused" keeps its colon).
_MASKED = r"\*\*\*(?=[^\w%\\*]|$)"
# A secret-named parameter in a URL's query: its value runs to the next "&" (or "#").
_QUERY_PARAMETER = re.compile(
    r"(?<=[?&])" + _SECRET_NAME + r"(?P<secret>" + _MASKED + r"|[^&#\s'\"]+)", re.IGNORECASE
)
# One in a keyword DSN (`password=x`, `password='x y'`, `password=a\ b`), or in prose: its
# value runs to the next space.
_KEYWORD_PARAMETER = re.compile(
    _SECRET_NAME + r"(?P<secret>" + _MASKED + r"|'(?:[^'\\]|\\.)*'|(?:[^\s'\"\\]|\\.)+)",
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


def scrub(text: str, urls: Iterable[str | URL | None] = ()) -> str:
    """``text`` with every secret masked where it stands, and nothing else changed.

    Each of ``urls`` written in ``text`` as typed is replaced with its masked form
    (a password with characters no pattern can delimit, ``p@ss w/rd``, is still masked
    whole); then every URL user-info password and every secret-named parameter written in
    ``text`` is masked by its position. A known password is never searched for as a bare
    substring: with the password ``o``, that would mask every ``o`` of the message and
    tell a reader which letters the password is made of.
    """
    typed: set[str] = set()
    for url in urls:
        if isinstance(url, URL):
            typed.add(url.render_as_string(hide_password=False))
        elif url:
            typed.add(url)
    # Longest first, so that a URL containing another is replaced whole.
    for url in sorted(typed, key=len, reverse=True):
        if url in text:
            text = text.replace(url, redact(url))
    return _mask_written(text)


def _mask_written(text: str) -> str:
    """Mask URL passwords and secret-named parameters written in ``text``, by position."""
    text = _USERINFO.sub(lambda m: m["head"] + (MASK if m["secret"] else ""), text)
    text = _QUERY_PARAMETER.sub(lambda m: m["head"] + MASK, text)
    return _KEYWORD_PARAMETER.sub(lambda m: m["head"] + MASK, text)


def redact(url: str | URL) -> str:
    """``url`` as text with every secret masked, for logs, errors and CLI output."""
    parsed = _parse(url)
    if parsed is None or _split_password(url, parsed):
        # Unparseable, or a password with an unencoded "@" or space that SQLAlchemy would
        # split: masked as typed.
        typed = _TYPED_USERINFO.sub(lambda m: m["head"] + MASK, str(url), count=1)
        return _mask_written(typed)
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
    logging) covers it; libpq's TLS parameters stay in the query (make engines with
    :func:`engine_arguments`). Raises ``ValueError`` for anything else, with the password
    masked, and :class:`UnsupportedParameterError` for a parameter the store cannot honour.
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
    if _split_password(url, parsed):
        # SQLAlchemy ends the password at its first "@": the rest would be dialled as a host
        # or opened as a database, and part of the password sent as one.
        raise ValueError(
            f"invalid database URL {redact(url)}: an '@' in the password must be "
            "percent-encoded (%40)"
        )
    if parsed.port is not None and not 0 < parsed.port <= 0xFFFF:
        raise ValueError(
            f"invalid database URL {redact(url)}: port {parsed.port} is not in 1 to 65535"
        )
    _refuse_unsupported(parsed)
    password = parsed.query.get("password")
    if password is not None:
        # asyncpg takes the query's password over the user info's: so does this.
        value = password if isinstance(password, str) else password[-1]
        parsed = parsed.difference_update_query(["password"]).set(password=value)
    return parsed.set(drivername="postgresql+asyncpg")


def _split_password(typed: str | URL, parsed: URL) -> bool:
    """Whether SQLAlchemy cut a password with an unencoded "@" (or space) at its first "@":
    a space is left in the host, or another "@" before the query or in a parameter's name
    (``u:a@b/c@host/db``, ``u:a@b?c@host/db``), in the URL as typed."""
    if parsed.host is not None and re.search(r"[@\s]", parsed.host):
        return True
    return isinstance(typed, str) and _SPLIT_USERINFO.match(typed) is not None


def _refuse_unsupported(url: URL) -> None:
    """Refuse, by name, every query parameter neither asyncpg nor this module honours, and
    TLS parameters with values libpq would not accept."""
    names = set(url.query) - {"password"}
    unknown = sorted(names - _TLS_PARAMETERS - _PASSED_PARAMETERS - {"sslsni"})
    if unknown:
        raise UnsupportedParameterError(
            f"database URL {redact(url)}: cronoq-store cannot honour the parameter"
            f"{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (it takes "
            f"{', '.join(sorted(_TLS_PARAMETERS | _PASSED_PARAMETERS | {'sslsni'}))})",
            unknown,
        )
    allowed = {
        "sslmode": _SSLMODES,
        "ssl_min_protocol_version": _TLS_VERSIONS,
        "ssl_max_protocol_version": _TLS_VERSIONS,
        "sslnegotiation": ("postgres", "direct"),
        # asyncpg always sends the host name as SNI; it cannot leave it out.
        "sslsni": ("1",),
    }
    for name, values in allowed.items():
        value = _last(url.query.get(name))
        if value is not None and value not in values:
            raise UnsupportedParameterError(
                f"database URL {redact(url)}: {name}={value!r} is not supported "
                f"(expected {' or '.join(values)})",
                [name],
            )
    if _last(url.query.get("sslrootcert")) == "system":
        raise UnsupportedParameterError(
            f"database URL {redact(url)}: sslrootcert=system (libpq 16's system CA store) "
            "is not supported; give the CA certificate file",
            ["sslrootcert"],
        )
    if "ssl" in names and "sslmode" in names:
        raise UnsupportedParameterError(
            f"database URL {redact(url)}: give sslmode or asyncpg's ssl, not both",
            ["ssl", "sslmode"],
        )


def _refuse_missing_files(url: URL, tls: dict[str, str | None]) -> None:
    """Refuse, naming it, a certificate, key or CRL file that is not there: asyncpg would
    fail every connect with a ``FileNotFoundError`` that names no file, and libpq in
    ``require`` mode would skip the verification the operator asked for."""
    for name in _TLS_FILES:
        path = tls.get(name)
        if path and not os.path.isfile(path):
            raise UnsupportedParameterError(
                f"database URL {redact(url)}: {name} {path!r} is not a file (a relative path "
                f"is read from the working directory, {os.getcwd()!r}, and '~' is not "
                "expanded, as in libpq)",
                [name],
            )


def _last(value: str | tuple[str, ...] | None) -> str | None:
    """A query parameter's value; the last one when repeated, as libpq and asyncpg take it."""
    return value if value is None or isinstance(value, str) else value[-1]


def engine_arguments(url: str | URL) -> tuple[URL, dict[str, Any]]:
    """The URL an engine dials and the asyncpg connect arguments that go with it.

    Every engine the store makes from a URL (its pool, the lock session, the CLI's,
    Alembic's) is made from these, so that each session uses TLS as the URL asks. libpq's
    TLS parameters leave the URL and reach asyncpg as a DSN holding only them, which it
    parses with libpq's meaning; host, user and the rest still come from SQLAlchemy.
    """
    target = async_url(url)
    tls = {name: _last(target.query[name]) for name in _TLS_PARAMETERS if name in target.query}
    _refuse_missing_files(target, tls)
    dialled = target.difference_update_query([*_TLS_PARAMETERS, "sslsni"])
    if not tls:
        return dialled, {}
    return dialled, {"dsn": "postgresql://?" + urlencode(sorted(tls.items()))}
