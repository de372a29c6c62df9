"""A :class:`~tests.tcpproxy.TcpProxy` that stalls itself at a chosen moment: right after it
passed on to the server the first chunk holding a given statement text.

A stall at a random instant rarely catches a session inside a transaction, or between a
statement's parse and its execution (asyncpg prepares with Parse, Describe and Flush, and
binds after the answer): this one does, every time, so a test can say what the server
does with such a session when its client goes silent.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

from .. import tcpproxy
from ..tcpproxy import TcpProxy

__all__ = ["Tripwire"]


class _Wire:
    """The server side of one link: stalls the proxy once it wrote the needle."""

    def __init__(self, writer: asyncio.StreamWriter, proxy: Tripwire) -> None:
        self._writer = writer
        self._proxy = proxy
        self.transport = writer.transport

    def write(self, data: bytes) -> None:
        self._writer.write(data)
        self._proxy.passed(data)

    async def drain(self) -> None:
        await self._writer.drain()


class Tripwire(TcpProxy):
    """Forwards until a client sends one of the ``needles`` (once :meth:`arm` is called),
    then stalls the moment that chunk is on its way to the server."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self._needles: tuple[bytes, ...] = ()
        #: Wall-clock time (time.time()) of the stall, once tripped.
        self.tripped_at: float | None = None
        #: The needle the stall followed, once tripped.
        self.tripped_on: bytes | None = None

    def arm(self, *needles: bytes) -> None:
        self._needles = needles

    def passed(self, data: bytes) -> None:
        for needle in self._needles:
            if needle in data:
                self._needles = ()
                self.tripped_at = time.time()
                self.tripped_on = needle
                self.stall()
                return

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing():
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        if self._refusing():
            writer.transport.abort()
            up_writer.transport.abort()
            return
        wire = cast(asyncio.StreamWriter, _Wire(up_writer, self))
        self._links.add(tcpproxy._Link(self, (reader, writer), (up_reader, wire)))
