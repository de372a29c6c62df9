"""A health endpoint: ``/livez`` (the process answers) and ``/readyz`` (``PgStore.health()``).

Run it as ``python examples/health.py URL [SCHEMA] [PORT]``; it prints the port it serves.
Any web framework does the same; this one uses only the standard library.
"""

from __future__ import annotations

import asyncio
import json
import sys

from cronoq_store import PgStore, PgStoreConfig, StoreError


async def ready(store: PgStore) -> tuple[int, dict[str, object]]:
    """Readiness: the database answers and the schema is at this build's head."""
    try:
        health = await store.health()
    except StoreError as exc:
        return 503, {"error": str(exc)}
    body: dict[str, object] = {
        "leader": health.is_leader,
        "cluster_has_leader": health.has_leader,
        "epoch": health.stored_epoch,
        "at_head": health.at_head,
    }
    return (200 if health.at_head else 503), body


async def serve(store: PgStore, port: int) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = (await reader.readline()).decode("latin-1").split()
        path = request[1] if len(request) > 1 else ""
        body: dict[str, object]
        if path == "/livez":  # never the database nor leadership: a standby is alive
            code, body = 200, {"alive": True}
        elif path == "/readyz":
            code, body = await ready(store)
        else:
            code, body = 404, {"error": "not found"}
        data = json.dumps(body).encode()
        writer.write(
            f"HTTP/1.1 {code} {'OK' if code == 200 else 'Error'}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", port)
    print(f"serving on port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


async def main(url: str, schema: str, port: int) -> None:
    config = PgStoreConfig(schema=schema, application_name="example-health")
    async with await PgStore.connect(url, config) as store:
        await serve(store, port)


if __name__ == "__main__":
    url, schema, port = (sys.argv[1:] + ["cluster_a", "8080"][len(sys.argv) - 2 :])[:3]
    asyncio.run(main(url, schema, int(port)))
