"""The worker shim's GET to the service, through httpx (as it is) and through aiohttp.

Why the shim keeps httpx beside the aiohttp session that ``taskcluster.aio`` needs: this times
the one HTTP call the shim makes per claim, ``GET <service>/<key>?taskId=<id>``, through
:func:`coalescer.worker.superseder.fetch_answer` (httpx, streamed, the body capped) and through
the same request on an ``aiohttp.ClientSession`` (streamed, ``auto_decompress=False``, capped
alike), one request at a time on one kept-alive connection, as a shim makes them.

The server is a child process that answers every request with the same superseder-shaped JSON
(10 taskIds) from a bare asyncio protocol, so the clients' own cost is what differs. Each round
runs each client for ``--requests`` requests, in an order that alternates; each line gives the
median of ``--rounds`` rounds of requests/s and of this process's CPU microseconds per request.
Loopback only, a few seconds in all.

    .venv/bin/python bench/http_clients.py [--rounds 3] [--requests 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coalescer.worker.superseder import fetch_answer

MAX_BYTES = 1 << 20
BODY = orjson.dumps({"supersedes": [f"task{i:018d}AAAA" for i in range(10)]})
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    + f"content-length: {len(BODY)}\r\n\r\n".encode()
    + BODY
)


class Answer(asyncio.Protocol):
    """Answers each request (a head ending in a blank line; GETs have no body) with RESPONSE."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            self.buffer = self.buffer[end + 4 :]
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


async def serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Answer, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def via_httpx(url: str, n: int) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        await fetch_answer(http, url, "warmup", max_bytes=MAX_BYTES)
        return await timed(lambda i: fetch_answer(http, url, f"t{i}", max_bytes=MAX_BYTES), n)


async def via_aiohttp(url: str, n: int) -> tuple[float, float]:
    headers = {"accept": "application/json", "accept-encoding": "gzip, deflate"}
    async with aiohttp.ClientSession(auto_decompress=False) as session:

        async def get(i: int) -> bytes:
            async with session.get(
                url, params={"taskId": f"t{i}"}, headers=headers, allow_redirects=False
            ) as response:
                if response.status != 200:
                    raise RuntimeError(response.status)
                body = bytearray()
                async for chunk in response.content.iter_any():
                    body += chunk
                    if len(body) > MAX_BYTES:
                        raise RuntimeError("too long")
                return bytes(body)

        await get(-1)
        return await timed(get, n)


async def timed(call: Callable[[int], Awaitable[bytes]], n: int) -> tuple[float, float]:
    wall, cpu = time.monotonic(), time.process_time()
    for i in range(n):
        if await call(i) != BODY:
            raise AssertionError("a different body")
    return time.monotonic() - wall, time.process_time() - cpu


CLIENTS: dict[str, Callable[[str, int], Awaitable[tuple[float, float]]]] = {
    "httpx": via_httpx,
    "aiohttp": via_aiohttp,
}


async def measure(url: str, args: argparse.Namespace) -> None:
    rates: dict[str, list[float]] = {c: [] for c in CLIENTS}
    costs: dict[str, list[float]] = {c: [] for c in CLIENTS}
    for r in range(args.rounds):
        order = list(CLIENTS) if r % 2 == 0 else list(reversed(CLIENTS))
        for client in order:
            wall, cpu = await CLIENTS[client](url, args.requests)
            rates[client].append(args.requests / wall)
            costs[client].append(cpu / args.requests * 1e6)
    print(f"{args.requests} sequential GETs a round; medians of {args.rounds} rounds:")
    print(f"{'client':<8} {'requests/s':>11} {'CPU µs/request':>15}")
    for client in CLIENTS:
        rate, cost = statistics.median(rates[client]), statistics.median(costs[client])
        print(f"{client:<8} {rate:>11,.0f} {cost:>15,.0f}")
    ratio = statistics.median(costs["httpx"]) / statistics.median(costs["aiohttp"])
    print(f"httpx's CPU per request: {ratio:.2f}x aiohttp's")


def main(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("the answering server did not start")
                time.sleep(0.05)
        asyncio.run(measure(f"http://127.0.0.1:{port}/k", args))
        return 0
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve:
        asyncio.run(serve(arguments.serve))
    else:
        sys.exit(main(arguments))
