"""A small TCP proxy on loopback, to put network faults between a client and the server.

PostgreSQL cannot be told to go silent: a terminated backend closes its socket, and the client
notices at once. A real partition is worse: nothing arrives and nothing closes. The proxy
makes both, on demand, for every connection that goes through it:

- ``forward``: pass bytes both ways;
- ``stall``: stop forwarding in both directions without closing either side (bytes, and a
  close, are held back and delivered in order if forwarding resumes), like a partition;
- ``cut``: close every connection now and refuse new ones, like a reset;
- ``delay``: deliver every chunk ``seconds`` after it arrived, in order, like a slow link.

Buffers are bounded (a stalled direction stops reading once it holds ``max_chunks``), and
:meth:`close` ends every connection and task at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any, Literal

from sqlalchemy.engine import URL

__all__ = ["Mode", "TcpProxy"]

Mode = Literal["forward", "stall", "cut", "delay"]

_CHUNK = 64 * 1024


class _Link:
    """One proxied connection: two pumps, each a reader feeding a bounded queue and a writer."""

    def __init__(
        self,
        proxy: TcpProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.writers = (client[1], server[1])
        self.tasks: list[asyncio.Task[None]] = []
        for reader, writer in ((client[0], server[1]), (server[0], client[1])):
            queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(proxy.max_chunks)
            self.tasks.append(asyncio.ensure_future(self._read(reader, queue)))
            self.tasks.append(asyncio.ensure_future(self._write(queue, writer)))

    async def _read(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            while True:
                data = await reader.read(_CHUNK)
                await queue.put((loop.time(), data))
                if not data:
                    return
        await queue.put((loop.time(), b""))

    async def _write(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                arrived, data = await queue.get()
                await self.proxy._flowing.wait()
                if self.proxy.mode == "delay":
                    await asyncio.sleep(max(0.0, arrived + self.proxy.latency - loop.time()))
                    await self.proxy._flowing.wait()
                if not data:
                    # The other side closed: close this one too, then this link is over.
                    self.abort()
                    return
                writer.write(data)
                await writer.drain()
                self.proxy.last_delivery = loop.time()
        except OSError:
            self.abort()

    def abort(self) -> None:
        """Close both sockets at once (a reset, without waiting for buffered bytes)."""
        for writer in self.writers:
            writer.transport.abort()
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self.proxy._links.discard(self)


class TcpProxy:
    """A TCP proxy from ``127.0.0.1:<random port>`` to ``host:port``; an async context manager."""

    def __init__(self, host: str, port: int, *, max_chunks: int = 64) -> None:
        self.host = host
        self.target_port = port
        self.max_chunks = max_chunks
        self.mode: Mode = "forward"
        self.latency = 0.0
        #: Event-loop time at which bytes last went through, in either direction.
        self.last_delivery = 0.0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._pending: set[asyncio.Task[Any]] = set()

    @classmethod
    def to(cls, url: URL) -> TcpProxy:
        """A proxy in front of the server ``url`` names (TCP URLs only)."""
        if not url.host or url.port is None:
            raise ValueError("the proxy needs a TCP URL with host and port")
        return cls(url.host, url.port)

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return int(self._server.sockets[0].getsockname()[1])

    def url(self, url: URL) -> URL:
        """``url`` pointed at the proxy instead of the server."""
        return url.set(host="127.0.0.1", port=self.port)

    @property
    def connections(self) -> int:
        return len(self._links)

    # --- modes ------------------------------------------------------------------------

    def forward(self) -> None:
        self.mode = "forward"
        self._flowing.set()

    def stall(self) -> None:
        self.mode = "stall"
        self._flowing.clear()

    def cut(self) -> None:
        self.mode = "cut"
        self._flowing.set()
        for link in list(self._links):
            link.abort()

    def delay(self, seconds: float) -> None:
        self.mode = "delay"
        self.latency = seconds
        self._flowing.set()

    # --- lifecycle --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing():
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._pending.add(task)
        try:
            upstream = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        finally:
            self._pending.discard(task)
        if self._refusing():  # cut or closed while connecting upstream
            writer.transport.abort()
            upstream[1].transport.abort()
            return
        self._links.add(_Link(self, (reader, writer), upstream))

    def _refusing(self) -> bool:
        return self.mode == "cut" or self._server is None

    async def close(self) -> None:
        """Stop listening and end every connection and task; returns promptly."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks: list[asyncio.Task[Any]] = list(self._pending)
        for link in list(self._links):
            tasks.extend(link.tasks)
            link.abort()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if server is not None:
            await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> TcpProxy:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
