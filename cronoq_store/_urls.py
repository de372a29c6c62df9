"""Database URLs: read as libpq reads them, never printed with a secret.

:func:`resolve` reads a URL the way libpq 18 does (the URI, then the service file, then the
``PG*`` environment, then the defaults) into one :class:`ConnectParameters`, refusing by
name each parameter asyncpg cannot honour. Nothing here opens a connection: the door
(:mod:`cronoq_store._door`) dials every session from those parameters, so that SQLAlchemy's
own URL-to-keywords translation cannot drop one.

A URL can carry a password in its user info (``user:secret@host``, percent-encoded or not),
in query parameters (``?password=``, the libpq form SQLAlchemy and asyncpg accept, and other
secret-bearing ones such as ``sslpassword``), and a libpq keyword DSN in ``key=value`` pairs.
:func:`scrub` is the one place that masks them; :func:`redact` renders a URL through it.
"""

from __future__ import annotations

import getpass
import locale
import logging
import os
import pwd
import random
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import unquote, urlencode

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from ._errors import UnsupportedParameterError

__all__ = [
    "MASK",
    "URL_ENV",
    "ConnectParameters",
    "UnsupportedParameterError",
    "async_url",
    "redact",
    "resolve",
    "scrub",
]

logger = logging.getLogger("cronoq_store")

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
# space in the password, or no scheme at all): the password runs to the URL's last "@".
_TYPED_USERINFO = re.compile(
    r"\A(?P<head>(?:[\w+.-]+:)?(?://)?[^:/@\s]*:)(?P<secret>.*)(?=@[^@]*\Z)", re.S
)
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
    """The ``postgresql+asyncpg`` form of ``url``, for an engine SQLAlchemy dials from it.

    Only the parameters SQLAlchemy hands to asyncpg with their libpq meaning are accepted:
    a service, for one, is refused (asyncpg ignores it there);
    :func:`~cronoq_store.engine_arguments` reads every parameter.

    Accepts ``postgres://``, ``postgresql://`` and ``postgresql+asyncpg://`` URLs, including
    unix-socket ones (``postgresql:///db?host=/run/postgresql``). A ``?password=`` parameter
    becomes the URL's password, so that SQLAlchemy's own masking (``str(engine.url)``, its
    logging) covers it; libpq's TLS parameters stay in the query (make engines with
    :func:`~cronoq_store.engine_arguments`). Raises ``ValueError`` for anything else, with
    the password masked, and :class:`UnsupportedParameterError` for a parameter the store
    cannot honour.
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


def _refuse_missing_files(shown: str, tls: Mapping[str, str | None]) -> None:
    """Refuse, naming it, a certificate, key or CRL file that is not there: asyncpg would
    fail every connect with a ``FileNotFoundError`` that names no file, and libpq in
    ``require`` mode would skip the verification the operator asked for."""
    for name in _TLS_FILES:
        path = tls.get(name)
        if path and not os.path.isfile(path):
            raise UnsupportedParameterError(
                f"database URL {shown}: {name} {path!r} is not a file (a relative path "
                f"is read from the working directory, {os.getcwd()!r}, and '~' is not "
                "expanded, as in libpq)",
                [name],
            )


def _last(value: str | tuple[str, ...] | None) -> str | None:
    """A query parameter's value; the last one when repeated, as libpq and asyncpg take it."""
    return value if value is None or isinstance(value, str) else value[-1]


# --- reading a URL the way libpq does --------------------------------------------------------

#: libpq's keywords (PostgreSQL 18) and the environment variable each falls back to.
LIBPQ_KEYWORDS: dict[str, str | None] = {
    "service": "PGSERVICE",
    "servicefile": "PGSERVICEFILE",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "passfile": "PGPASSFILE",
    "channel_binding": "PGCHANNELBINDING",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "dbname": "PGDATABASE",
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "client_encoding": "PGCLIENTENCODING",
    "options": "PGOPTIONS",
    "application_name": "PGAPPNAME",
    "fallback_application_name": None,
    "keepalives": None,
    "keepalives_idle": None,
    "keepalives_interval": None,
    "keepalives_count": None,
    "tcp_user_timeout": None,
    "sslmode": "PGSSLMODE",
    "sslnegotiation": "PGSSLNEGOTIATION",
    "sslcompression": "PGSSLCOMPRESSION",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "sslcertmode": "PGSSLCERTMODE",
    "sslpassword": None,
    "sslrootcert": "PGSSLROOTCERT",
    "sslcrl": "PGSSLCRL",
    "sslcrldir": "PGSSLCRLDIR",
    "sslsni": "PGSSLSNI",
    "sslkeylogfile": None,
    "requirepeer": "PGREQUIREPEER",
    "require_auth": "PGREQUIREAUTH",
    "min_protocol_version": "PGMINPROTOCOLVERSION",
    "max_protocol_version": "PGMAXPROTOCOLVERSION",
    "ssl_min_protocol_version": "PGSSLMINPROTOCOLVERSION",
    "ssl_max_protocol_version": "PGSSLMAXPROTOCOLVERSION",
    "gssencmode": "PGGSSENCMODE",
    "krbsrvname": "PGKRBSRVNAME",
    "gsslib": "PGGSSLIB",
    "gssdelegation": "PGGSSDELEGATION",
    "replication": None,
    "target_session_attrs": "PGTARGETSESSIONATTRS",
    "load_balance_hosts": "PGLOADBALANCEHOSTS",
    "scram_client_key": None,
    "scram_server_key": None,
    "oauth_issuer": None,
    "oauth_client_id": None,
    "oauth_client_secret": None,
    "oauth_scope": None,
}

#: Why each parameter asyncpg cannot implement is refused, whatever its value.
REFUSED: dict[str, str] = {
    "hostaddr": "asyncpg dials the host it verifies and matches in the password file; it "
    "cannot dial one address under another name",
    "require_auth": "asyncpg cannot restrict the authentication methods a server may ask for",
    "requirepeer": "asyncpg cannot check the server process's user before authenticating",
    "sslcrldir": "asyncpg reads a CRL file (sslcrl), not a directory of them",
    "sslkeylogfile": "asyncpg writes TLS keys only where $SSLKEYLOGFILE says",
    "scram_client_key": "asyncpg authenticates with the password only",
    "scram_server_key": "asyncpg authenticates with the password only",
    "oauth_issuer": "asyncpg does not implement OAuth authentication",
    "oauth_client_id": "asyncpg does not implement OAuth authentication",
    "oauth_client_secret": "asyncpg does not implement OAuth authentication",
    "oauth_scope": "asyncpg does not implement OAuth authentication",
}

#: Parameters honoured for only some values: the values, and why the others are refused.
LIMITED: dict[str, tuple[tuple[str, ...], str]] = {
    "channel_binding": (("disable",), "asyncpg's SCRAM never uses channel binding"),
    "gssencmode": (("disable",), "asyncpg does not implement GSSAPI encryption"),
    "gssdelegation": (("0",), "asyncpg does not delegate GSSAPI credentials"),
    "sslcompression": (("0",), "asyncpg never compresses TLS"),
    "sslcertmode": (
        ("allow",),
        "asyncpg sends a client certificate whenever one is configured, as allow does",
    ),
    "sslsni": (("1",), "asyncpg always sends the host name as SNI"),
    "sslmode": (_SSLMODES, "libpq knows no other mode"),
    "sslnegotiation": (("postgres", "direct"), "libpq knows no other"),
    "ssl_min_protocol_version": (_TLS_VERSIONS, "libpq knows no other"),
    "ssl_max_protocol_version": (_TLS_VERSIONS, "libpq knows no other"),
    "min_protocol_version": (("3.0",), "asyncpg speaks protocol 3.0 only"),
    "max_protocol_version": (
        ("3.0", "3.2", "latest"),
        "libpq knows no other (asyncpg speaks 3.0, inside every range)",
    ),
    "replication": (
        ("0", "off", "false", "no"),
        "asyncpg does not speak the replication protocol",
    ),
    "target_session_attrs": (
        ("any", "read-write", "read-only", "primary", "standby", "prefer-standby"),
        "libpq knows no other",
    ),
    "load_balance_hosts": (("disable", "random"), "libpq knows no other"),
    "gsslib": (("gssapi",), "sspi exists on Windows only"),
}

#: Query parameters that are not libpq's but that SQLAlchemy's and asyncpg's URLs take:
#: ``database`` (libpq's ``dbname``), ``ssl`` (asyncpg's name for ``sslmode``; libpq reads
#: ``ssl=true`` as ``sslmode=require``) and the dialect's ``prepared_statement_cache_size``.
EXTRA_PARAMETERS = ("database", "ssl", "prepared_statement_cache_size")

#: Environment variables libpq reads that are not a keyword's fallback: settings sent at
#: connection start (``"default"`` sends nothing), the deprecated ``$PGREQUIRESSL`` and
#: where the system-wide service file lives.
STARTUP_ENVIRONMENT = {"PGDATESTYLE": "datestyle", "PGTZ": "timezone", "PGGEQO": "geqo"}
#: Where ``pg_service.conf`` is when ``$PGSYSCONFDIR`` is unset (Debian's libpq).
DEFAULT_SYSCONFDIR = "/etc/postgresql-common"
#: The socket directory libpq matches as ``localhost`` in a password file (Debian's libpq).
DEFAULT_SOCKET_DIR = "/var/run/postgresql"
#: What asyncpg dials when no host is given: the socket directories of common builds, then
#: ``localhost``.
DEFAULT_HOSTS = ("/run/postgresql", "/var/run/postgresql", "/tmp", "localhost")
_UTF8_NAMES = ("UTF8", "UNICODE")
_FALSE = ("0", "off", "false", "no")


@dataclass(frozen=True)
class ConnectParameters:
    """One URL read the way libpq reads it (the URL, then the service's, then the
    environment's, then the defaults), as typed values asyncpg takes as they are.

    ``password`` and the TLS parameters never show in the repr; :attr:`shown` is the URL
    masked, for messages."""

    shown: str
    hosts: tuple[str, ...]
    ports: tuple[int, ...]
    user: str
    database: str
    password: str | None = field(repr=False)
    #: libpq's TLS parameters, with libpq's meaning in asyncpg's DSN (``sslpassword`` among
    #: them: not in the repr).
    tls: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    #: Settings sent at connection start (``options``, ``$PGTZ``...).
    settings: tuple[tuple[str, str], ...] = ()
    application_name: str | None = None
    fallback_application_name: str | None = None
    #: Seconds per host, or ``None`` for no bound; ``connect_timeout_given`` tells whether the
    #: URL (or its service, or ``$PGCONNECT_TIMEOUT``) said anything.
    connect_timeout: float | None = None
    connect_timeout_given: bool = False
    target_session_attrs: str = "any"
    krbsrvname: str | None = None
    gsslib: str | None = None
    load_balance: bool = False
    keepalives: bool = True
    keepalives_idle: int = 0
    keepalives_interval: int = 0
    keepalives_count: int = 0
    tcp_user_timeout: int = 0
    prepared_statement_cache_size: int | None = None

    def url(self) -> URL:
        """A URL naming the first host, for ``engine.url``: what messages show (SQLAlchemy
        masks its password); every session is dialled from the parameters themselves."""
        host = self.hosts[0] if self.hosts else None
        socket_dir = host is not None and host.startswith("/")
        return URL.create(
            "postgresql+asyncpg",
            username=self.user,
            password=self.password,
            host=None if socket_dir else host,
            port=self.ports[0] if self.ports else None,
            database=self.database,
            query={"host": host} if socket_dir and host else {},
        )

    def with_application_name(self, name: str) -> ConnectParameters:
        """These parameters, naming their sessions ``name`` whatever the URL says."""
        return replace(self, application_name=name)

    def session_name(self, fallback: str) -> str:
        """The ``application_name`` the sessions get: the URL's (or ``$PGAPPNAME``), else its
        ``fallback_application_name``, else the caller's ``fallback``."""
        return self.application_name or self.fallback_application_name or fallback

    def asyncpg_arguments(self) -> dict[str, Any]:
        """``asyncpg.connect()``'s keywords for these parameters (no ``server_settings`` and
        no ``timeout``: the door's dialler merges those with the caller's)."""
        hosts: list[str] | None = list(self.hosts) or None
        ports: list[int] | None = list(self.ports) or None
        if self.load_balance and hosts is not None and ports is not None:
            pairs = list(zip(hosts, ports, strict=True))
            random.shuffle(pairs)
            hosts, ports = [h for h, _ in pairs], [p for _, p in pairs]
        arguments: dict[str, Any] = {
            "host": hosts if hosts is None or len(hosts) > 1 else hosts[0],
            "port": ports if ports is None or len(ports) > 1 else ports[0],
            "user": self.user,
            "database": self.database,
            "password": self.password,
            # A file that cannot exist: the password (or its absence) was read here, as
            # libpq reads it.
            "passfile": os.path.join(os.devnull, "none"),
            "target_session_attrs": self.target_session_attrs,
            "krbsrvname": self.krbsrvname,
            "gsslib": self.gsslib or "gssapi",
        }
        if self.tls:
            arguments["dsn"] = "postgresql://?" + urlencode(self.tls)
        return arguments


def resolve(url: str | URL, environ: Mapping[str, str] | None = None) -> ConnectParameters:
    """``url`` read as libpq reads it, with ``environ`` (``os.environ``) for the environment.

    Raises ``ValueError`` for a URL that is not one (password masked) and
    :class:`UnsupportedParameterError` naming each parameter asyncpg cannot honour, wherever
    it came from (the URL, the service file or the environment)."""
    env = os.environ if environ is None else environ
    typed = url.render_as_string(hide_password=False) if isinstance(url, URL) else url
    shown = redact(url)
    values, sources = _read_uri(typed, shown)
    service = values.get("service") or env.get("PGSERVICE")
    if service:
        _read_service(service, values, sources, env, shown)
    for name, variable in LIBPQ_KEYWORDS.items():
        if name not in values and variable is not None and variable in env:
            values[name] = env[variable]
            sources[name] = f"${variable}"
    if "sslmode" not in values and env.get("PGREQUIRESSL", "").startswith("1"):
        values["sslmode"] = "require"
        sources["sslmode"] = "$PGREQUIRESSL"
    _refuse(values, sources, shown)
    return _typed(values, sources, env, shown)


def _refusal(shown: str, name: str, source: str, why: str) -> UnsupportedParameterError:
    where = "" if source == "the URL" else f" (from {source})"
    return UnsupportedParameterError(
        f"database URL {shown}: cronoq-store cannot honour the parameter {name}{where}: {why}",
        [name],
    )


def _read_uri(typed: str, shown: str) -> tuple[dict[str, str], dict[str, str]]:
    """A libpq URI's keywords (percent-decoded; query parameters override the URI's parts)
    and where each came from."""
    match = re.match(r"(?P<scheme>[A-Za-z][\w+.-]*)://", typed)
    if match is None:
        raise ValueError(f"invalid database URL {shown}: expected postgresql://user@host/db")
    if match["scheme"] not in _PLAIN_DRIVERS:
        raise ValueError(
            f"unsupported database URL {shown}: cronoq-store speaks PostgreSQL through "
            "asyncpg (postgresql:// or postgresql+asyncpg://)"
        )
    rest = typed[match.end() :]
    end = min([i for i in (rest.find("/"), rest.find("?")) if i >= 0], default=len(rest))
    authority, tail = rest[:end], rest[end:]
    values: dict[str, str] = {}
    userinfo, at, hostlist = authority.rpartition("@")
    if at and (_SPLIT_USERINFO.match(typed) or "@" in userinfo):
        raise ValueError(
            f"invalid database URL {shown}: an '@' in the password must be percent-encoded (%40)"
        )
    if at:
        user, colon, password = userinfo.partition(":")
        if user:
            values["user"] = _decoded(user, shown)
        if colon:
            values["password"] = _decoded(password, shown)
    if hostlist:
        hosts, ports = [], []
        for spec in hostlist.split(","):
            bracketed = re.fullmatch(r"\[(?P<host>[^\]]*)\](?::(?P<port>.*))?", spec)
            if bracketed:
                host, port = bracketed["host"], bracketed["port"] or ""
            else:
                host, _, port = spec.partition(":")
            hosts.append(_decoded(host, shown))
            ports.append(_decoded(port, shown))
        if any(hosts):
            values["host"] = ",".join(hosts)
        if any(ports):
            values["port"] = ",".join(ports)
    path, _, query = tail.partition("?")
    if path.lstrip("/"):
        values["dbname"] = _decoded(path[1:], shown)
    sources = dict.fromkeys(values, "the URL")
    pairs = query.split("&") if query else []
    if {"ssl", "sslmode"} <= {pair.partition("=")[0] for pair in pairs}:
        raise UnsupportedParameterError(
            f"database URL {shown}: give sslmode or asyncpg's ssl, not both", ["ssl", "sslmode"]
        )
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"invalid database URL {shown}: {name!r} has no '=' and no value")
        name, value = _decoded(name, shown), _decoded(value, shown)
        if name == "database":
            name = "dbname"
        elif name == "ssl":
            # libpq reads ssl=true as sslmode=require; asyncpg's ssl is a mode.
            name, value = "sslmode", "require" if value == "true" else value
        elif name not in LIBPQ_KEYWORDS and name not in EXTRA_PARAMETERS:
            raise UnsupportedParameterError(
                f"database URL {shown}: cronoq-store cannot honour the parameter {name} "
                "(neither libpq nor asyncpg knows it)",
                [name],
            )
        values[name] = value
        sources[name] = "the URL"
    _read_sqlalchemy_hosts([pair for pair in pairs if pair.startswith("host=")], values, shown)
    return values, sources


def _read_sqlalchemy_hosts(pairs: list[str], values: dict[str, str], shown: str) -> None:
    """SQLAlchemy's multi-host form, ``?host=h1:5432&host=h2:5433`` (libpq would take the last
    ``host`` and dial a host named ``h2:5433``): hosts and their ports, as SQLAlchemy reads
    them. A single ``host`` without a port is libpq's (a name, a list, a socket directory)."""
    given = [_decoded(pair.partition("=")[2], shown) for pair in pairs]
    split = [re.fullmatch(r"(\[[^\]]*\]|[^/:,][^:,]*):(\d*)", host) for host in given]
    if len(given) < 2 and not any(split):
        return
    hosts, ports = [], []
    for host, match in zip(given, split, strict=True):
        if match is None:
            hosts.append(host)
            ports.append("")
        else:
            hosts.append(match[1].strip("[]"))
            ports.append(match[2])
    values["host"] = ",".join(hosts)
    if any(ports):
        values["port"] = ",".join(ports)


def _decoded(text: str, shown: str) -> str:
    decoded = unquote(text, errors="strict")
    if "\x00" in decoded:
        raise ValueError(f"invalid database URL {shown}: a percent-encoded NUL (%00)")
    return decoded


def _service_files(values: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """Where libpq looks for a service, in order: ``servicefile`` (else
    ``$PGSERVICEFILE``, else ``~/.pg_service.conf``), then ``pg_service.conf`` in
    ``$PGSYSCONFDIR`` (else Debian's system directory)."""
    files: list[str] = []
    if "servicefile" in values:
        files.append(values["servicefile"])
    elif "PGSERVICEFILE" in env:
        files.append(env["PGSERVICEFILE"])
    else:
        home = env.get("HOME") or _home_of_user()
        if home:
            files.append(os.path.join(home, ".pg_service.conf"))
    files.append(os.path.join(env.get("PGSYSCONFDIR", DEFAULT_SYSCONFDIR), "pg_service.conf"))
    return files


def _home_of_user() -> str | None:
    try:
        return pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None


def _read_service(
    service: str,
    values: dict[str, str],
    sources: dict[str, str],
    env: Mapping[str, str],
    shown: str,
) -> None:
    """Fill what the URL left unset from ``service``'s group in the first service file
    that has one, as libpq's ``parseServiceFile`` does (``key=value`` lines, no spaces
    around ``=``, ``#`` comments; a nested service or an unknown keyword is an error)."""
    for path in _service_files(values, env):
        if not os.path.isfile(path):
            continue
        found = False
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            for number, raw in enumerate(file, 1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                if line.startswith("["):
                    if found:
                        break
                    found = line.startswith(f"[{service}]")
                    continue
                if not found:
                    continue
                key, equals, value = line.partition("=")
                if not equals or key not in LIBPQ_KEYWORDS or key in ("service", "servicefile"):
                    raise ValueError(
                        f"database URL {shown}: syntax error in service file {path!r}, line "
                        f"{number} (key=value with a libpq keyword, no nested service)"
                    )
                if key not in values:
                    values[key] = value
                    sources[key] = f"service {service!r} in {path}"
        if found:
            return
    raise ValueError(
        f"database URL {shown}: definition of service {service!r} not found (looked in "
        f"{', '.join(_service_files(values, env))})"
    )


def _refuse(values: Mapping[str, str], sources: Mapping[str, str], shown: str) -> None:
    """Refuse, by name, each parameter set to something asyncpg cannot do."""
    for name, value in values.items():
        if name in REFUSED and value != "":
            raise _refusal(shown, name, sources[name], REFUSED[name])
        if name in LIMITED and value != "":
            allowed, why = LIMITED[name]
            if value not in allowed:
                raise _refusal(
                    shown,
                    name,
                    sources[name],
                    f"{name}={value!r} is not supported (expected {' or '.join(allowed)}: {why})",
                )
    if values.get("sslrootcert") == "system":
        raise _refusal(
            shown,
            "sslrootcert",
            sources["sslrootcert"],
            "sslrootcert=system (libpq 16's system CA store) is not supported; give the CA "
            "certificate file",
        )
    if values.get("sslnegotiation") == "direct" and values.get("sslmode") not in (
        "require",
        "verify-ca",
        "verify-full",
    ):
        raise _refusal(
            shown,
            "sslnegotiation",
            sources["sslnegotiation"],
            "direct needs sslmode=require, verify-ca or verify-full",
        )
    encoding = values.get("client_encoding")
    if encoding:
        name = encoding.upper().replace("-", "").replace("_", "")
        if name == "AUTO":
            name = locale.getpreferredencoding(False).upper().replace("-", "")
        if name not in _UTF8_NAMES:
            raise _refusal(
                shown,
                "client_encoding",
                sources["client_encoding"],
                f"client_encoding={encoding!r}: asyncpg speaks UTF8 only",
            )
    for host in values.get("host", "").split(","):
        if host.startswith("@"):
            raise _refusal(
                shown, "host", sources["host"], f"{host!r}: asyncpg does not dial abstract sockets"
            )


def _integer(values: Mapping[str, str], name: str, shown: str) -> int:
    text = values.get(name, "").strip()
    if not text:
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"database URL {shown}: invalid integer value {text!r} for {name}"
        ) from None


def _typed(
    values: Mapping[str, str], sources: Mapping[str, str], env: Mapping[str, str], shown: str
) -> ConnectParameters:
    hosts = [h for h in values.get("host", "").split(",")] if values.get("host") else []
    port_texts = values.get("port", "").split(",") if values.get("port") else []
    if hosts and len(port_texts) > 1 and len(port_texts) != len(hosts):
        raise ValueError(
            f"database URL {shown}: could not match {len(port_texts)} port numbers to "
            f"{len(hosts)} hosts"
        )
    count = max(len(hosts), 1)
    if len(port_texts) <= 1:
        port_texts = (port_texts or [""]) * count
    ports = []
    for text in port_texts:
        try:
            port = int(text) if text.strip() else 5432
        except ValueError:
            raise ValueError(f"database URL {shown}: invalid port number {text!r}") from None
        if not 0 < port <= 0xFFFF:
            raise ValueError(f"database URL {shown}: port {port} is not in 1 to 65535")
        ports.append(port)
    # An empty entry of a host list is the default socket directory.
    dialled = [h or DEFAULT_SOCKET_DIR for h in hosts]
    user = values.get("user") or _os_user()
    database = values.get("dbname") or user
    password = values.get("password") or None
    if password is None:
        password = _password_from_file(values, env, dialled, ports, database, user, shown)
    tls = {name: values[name] for name in sorted(_TLS_PARAMETERS) if values.get(name)}
    _refuse_missing_files(shown, tls)
    settings: dict[str, str] = {}
    for variable, setting in STARTUP_ENVIRONMENT.items():
        value = env.get(variable)
        if value is not None and value.lower() != "default":
            settings[setting] = value
    if values.get("options"):
        settings["options"] = values["options"]
    timeout = _integer(values, "connect_timeout", shown)
    cache = values.get("prepared_statement_cache_size")
    return ConnectParameters(
        shown=shown,
        hosts=tuple(dialled),
        ports=tuple(ports) if hosts else (ports[0],) if values.get("port") else (),
        user=user,
        database=database,
        password=password,
        tls=tuple(tls.items()),
        settings=tuple(settings.items()),
        application_name=values.get("application_name") or None,
        fallback_application_name=values.get("fallback_application_name") or None,
        connect_timeout=float(max(timeout, 2)) if timeout > 0 else None,
        connect_timeout_given="connect_timeout" in values,
        target_session_attrs=values.get("target_session_attrs") or "any",
        krbsrvname=values.get("krbsrvname") or None,
        gsslib=values.get("gsslib") or None,
        load_balance=values.get("load_balance_hosts") == "random",
        keepalives=_integer(values, "keepalives", shown) != 0 if values.get("keepalives") else True,
        keepalives_idle=_integer(values, "keepalives_idle", shown),
        keepalives_interval=_integer(values, "keepalives_interval", shown),
        keepalives_count=_integer(values, "keepalives_count", shown),
        tcp_user_timeout=_integer(values, "tcp_user_timeout", shown),
        prepared_statement_cache_size=int(cache) if cache else None,
    )


def _os_user() -> str:
    """libpq's default user: the effective user's name (not ``$USER``); for a user id the
    system does not name (a container's), asyncpg's (``$LOGNAME``, ``$USER``...)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return getpass.getuser()


def _password_from_file(
    values: Mapping[str, str],
    env: Mapping[str, str],
    hosts: list[str],
    ports: list[int],
    database: str,
    user: str,
    shown: str,
) -> str | None:
    """The password file's password for these hosts, as libpq's ``passwordFromFile`` reads
    it: the first matching line; a socket in the default directory (or no host) matches
    as ``localhost``; a file with group or world access, or not a plain file, is skipped."""
    path = values.get("passfile")
    if not path:
        home = env.get("HOME") or _home_of_user()
        if not home:
            return None
        path = os.path.join(home, ".pgpass")
    try:
        info = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("password file %r ignored: not a plain file of mode 0600 or less", path)
        return None
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            lines = [line.rstrip("\r\n") for line in file]
    except OSError:
        return None
    found: set[str | None] = set()
    for host, port in zip(hosts or ["localhost"], ports or [5432], strict=False):
        name = "localhost" if host == DEFAULT_SOCKET_DIR else host
        found.add(_match_password(lines, name, str(port), database, user))
    if len(found) > 1:
        raise _refusal(
            shown,
            "passfile",
            "the URL" if "passfile" in values else "the password file",
            "its lines give the URL's hosts different passwords; asyncpg sends one password "
            "to every host",
        )
    return found.pop()


def _match_password(lines: list[str], *fields: str) -> str | None:
    for line in lines:
        if not line or line.startswith("#"):
            continue
        rest = line
        for wanted in fields:
            matched = _match_field(rest, wanted)
            if matched is None:
                break
            rest = matched
        else:
            password, escaped = [], False
            for char in rest:
                if escaped:
                    password.append(char)
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == ":":
                    break
                else:
                    password.append(char)
            return "".join(password)
    return None


def _match_field(line: str, wanted: str) -> str | None:
    """The rest of ``line`` after its first field, if that field is ``*`` or ``wanted``."""
    if line.startswith("*:"):
        return line[2:]
    i = 0
    for char in wanted:
        if i < len(line) and line[i] == "\\" and i + 1 < len(line):
            i += 1
        if i >= len(line) or line[i] != char:
            return None
        i += 1
    if i < len(line) and line[i] == ":":
        return line[i + 1 :]
    return None
