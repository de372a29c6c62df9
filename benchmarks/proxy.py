"""A TCP proxy on 127.0.0.1 that can stop forwarding, to stall a client's connections.

While stalled, nothing passes in either direction (closes included), but both sockets stay
open: the proxy's kernel still acknowledges what arrives. To the client and to the server
this is a middlebox that hangs; neither side sees a reset, and TCP keepalives succeed.
"""

from __future__ import annotations

import asyncio
import contextlib


class StallingProxy:
    """Forwards connections from ``port`` (chosen when started) to ``target_port``."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    def stall(self) -> None:
        """Stop forwarding: bytes and closes wait in the proxy from now on."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        """Drop every connection (no goodbye is forwarded) and stop listening."""
        if self._server is not None:
            self._server.close()
        for task in self._pumps:
            task.cancel()
        for writer in self._writers:
            writer.transport.abort()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        self._pumps.clear()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(source, sink))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self._flowing.wait()
                sink.write(data)
                await sink.drain()
            await self._flowing.wait()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                sink.close()
