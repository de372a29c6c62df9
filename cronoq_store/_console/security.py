"""Who may read the console, and what a browser may do with its pages.

Without credentials in the environment the console serves loopback only, and only to
requests that name a loopback host (a page elsewhere that rebinds its own name to 127.0.0.1
gets nothing). With them, every request must carry them: ``Authorization: Bearer TOKEN``,
or basic auth (``CRONOQ_CONSOLE_USER`` and ``CRONOQ_CONSOLE_PASSWORD``, or any user name
with the token as its password, which is what a browser's prompt sends). Credentials come
only from the environment, never from the command line, where ``ps`` shows them.

Every response forbids inline script and framing, and content-type sniffing.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "PASSWORD_ENV",
    "TOKEN_ENV",
    "USER_ENV",
    "Credentials",
    "Guard",
    "credentials_from",
    "is_loopback",
]

TOKEN_ENV = "CRONOQ_CONSOLE_TOKEN"
USER_ENV = "CRONOQ_CONSOLE_USER"
PASSWORD_ENV = "CRONOQ_CONSOLE_PASSWORD"
#: The shortest secret accepted: a guessable one is no authentication.
MIN_SECRET = 16

#: What every response carries. No inline script or style anywhere (``'self'`` only), no
#: framing (clickjacking), no sniffing (a JSON value never runs as HTML).
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    # same-origin, not no-referrer: a form POST would otherwise carry "Origin: null".
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})


@dataclass(frozen=True)
class Credentials:
    token: str | None = None
    user: str | None = None
    password: str | None = None

    def identify(self, authorization: str | None) -> str | None:
        """Who the ``Authorization`` header says asks (the user name, or ``token``) if it
        carries these credentials, else ``None``; compared in constant time."""
        if authorization is None:
            return None
        scheme, _, value = authorization.partition(" ")
        scheme = scheme.lower()
        if scheme == "bearer" and self.token is not None:
            return "token" if _same(value.strip(), self.token) else None
        if scheme != "basic":
            return None
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        user, sep, password = decoded.partition(":")
        if not sep:
            return None
        if self.token is not None and _same(password, self.token):
            return "token"
        if (
            self.user is not None
            and self.password is not None
            and _same(user, self.user)
            and _same(password, self.password)
        ):
            return self.user
        return None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def credentials_from(environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """The credentials the environment gives, ``None`` when it gives none; ``ValueError``
    for a half-given or too-short one (it would protect nothing)."""
    token = environ.get(TOKEN_ENV)
    user, password = environ.get(USER_ENV), environ.get(PASSWORD_ENV)
    if token is None and user is None and password is None:
        return None
    if (user is None) != (password is None):
        raise ValueError(f"set both ${USER_ENV} and ${PASSWORD_ENV}, or neither")
    for name, secret in ((TOKEN_ENV, token), (PASSWORD_ENV, password)):
        if secret is not None and len(secret) < MIN_SECRET:
            raise ValueError(f"${name} is shorter than {MIN_SECRET} characters")
    if user == "":
        raise ValueError(f"${USER_ENV} is empty")
    return Credentials(token=token, user=user, password=password)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:8080`` -> ``[::1]``)."""
    if host_header.startswith("["):
        return host_header.split("]", 1)[0] + "]"
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class Guard:
    """ASGI middleware: the credentials (or the loopback host check), then the headers."""

    def __init__(self, app: ASGIApp, credentials: Credentials | None) -> None:
        self.app = app
        self.credentials = credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.decode("latin-1").lower() not in SECURITY_HEADERS
                ]
                headers.extend((k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items())
                message["headers"] = headers
            await send(message)

        headers = Headers(scope=scope)
        refusal = self._refusal(headers)
        if refusal is not None:
            await refusal(scope, receive, send_with_headers)
            return
        if self.credentials is not None:
            # Who asks, for the log of actions (``request.state.who``).
            scope.setdefault("state", {})["who"] = self.credentials.identify(
                headers.get("authorization")
            )
        await self.app(scope, receive, send_with_headers)

    def _refusal(self, headers: Headers) -> PlainTextResponse | None:
        if self.credentials is None:
            if _host_name(headers.get("host", "")).lower() not in _LOOPBACK_NAMES:
                return PlainTextResponse("this console answers loopback hosts only", 421)
            return None
        if self.credentials.identify(headers.get("authorization")) is not None:
            return None
        return PlainTextResponse(
            "authentication required",
            401,
            headers={"www-authenticate": 'Basic realm="cronoq-store console", charset="UTF-8"'},
        )
