"""How long the superseding decision takes: the superseder's answer plus the claims.

Starts a queue emulator (``coalescer emulator``) and a scripted superseder, each in its own
process, then for task sets of 1 and 32 tasks times :meth:`Shim.run` from the claimWork answer
to the moment the primary starts (ask, validate, check and claim every listed task), and the
whole run (with resolving the secondaries and their artifacts). Prints medians and p90s.

    .venv/bin/python bench/decision.py [--rounds 30] [--sizes 1 32] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import taskcluster
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from coalescer.worker import Claim, Options, Outcome, Shim, Superseded
from coalescer.worker.protocol import COMPLETED

QUEUE = "bench/decision"
LISTS: dict[str, list[str]] = {}


async def answer(request: Request) -> Response:
    key = request.path_params["key"]
    if request.method == "PUT":
        LISTS[key] = orjson.loads(await request.body())
        return Response(status_code=204)
    return Response(
        orjson.dumps({"supersedes": LISTS.get(key, [request.query_params["taskId"]])}),
        media_type="application/json",
    )


superseder = Starlette(routes=[Route("/{key:path}", answer, methods=["GET", "PUT"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + 15
    while time.monotonic() < give_up:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit(f"{argv[:4]} did not start")


def definition(key: str, url: str) -> dict[str, Any]:
    now = taskcluster.fromNow("0 seconds")
    return {
        "taskQueueId": QUEUE,
        "created": taskcluster.stringDate(now),
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"coalesce.v1.{key}"],
        "payload": {"supersederUrl": f"{url}/{key}"},
        "metadata": {"name": "bench", "description": "-", "owner": "b@example.com", "source": url},
    }


async def one_round(
    shim: Shim, queue: Any, http: httpx.AsyncClient, url: str, key: str, size: int
) -> tuple[float, float]:
    ids = [taskcluster.slugid.nice() for _ in range(size)]
    await asyncio.gather(*(queue.createTask(t, definition(key, url)) for t in ids))
    (await http.put(f"{url}/{key}", content=orjson.dumps(ids))).raise_for_status()
    work = await shim.queue.claimWork(
        QUEUE, {"tasks": 1, "workerGroup": shim.worker_group, "workerId": shim.worker_id}
    )
    started: list[float] = []

    async def execute(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        started.append(time.perf_counter())
        assert len(supersedes) == size - 1, "a claim failed"
        return COMPLETED

    t0 = time.perf_counter()
    report = await shim.run(work["tasks"][0], execute)
    total = time.perf_counter() - t0
    assert len(report.superseded) == size - 1, report
    return started[0] - t0, total


async def bench(root: str, url: str, sizes: Sequence[int], rounds: int, concurrency: int) -> None:
    options = Options(allow=(url,), claim_concurrency=concurrency, max_tasks=max(sizes))
    creds = {"clientId": "bench", "accessToken": "no-secret"}
    async with (
        Shim(
            root_url=root, credentials=creds, worker_group="b", worker_id="w", options=options
        ) as shim,
        httpx.AsyncClient() as http,
    ):
        queue = taskcluster.aio.Queue(
            {"rootUrl": root, "credentials": creds}, session=shim.conn.session
        )
        print(
            f"{'tasks':>5} {'decision median':>16} {'p90':>8} {'whole run median':>17} {'p90':>8}"
        )
        for size in sizes:
            await one_round(shim, queue, http, url, f"warm.{size}", size)
            decisions, totals = [], []
            for i in range(rounds):
                decision, total = await one_round(shim, queue, http, url, f"k{size}.{i}", size)
                decisions.append(decision * 1000)
                totals.append(total * 1000)
            q = statistics.quantiles
            print(
                f"{size:>5} {statistics.median(decisions):>13.1f} ms {q(decisions, n=10)[-1]:>5.1f} ms"
                f" {statistics.median(totals):>14.1f} ms {q(totals, n=10)[-1]:>5.1f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--concurrency", type=int, default=8, help="claims in flight at once")
    parser.add_argument("--serve-superseder", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_superseder:
        import uvicorn

        uvicorn.run(superseder, port=args.serve_superseder, log_level="warning", access_log=False)
        return
    queue_port, superseder_port = free_port(), free_port()
    env_python = sys.executable
    procs = [
        start(
            [env_python, "-m", "coalescer.cli", "emulator", "--port", str(queue_port), "--legacy"],
            queue_port,
        ),
        start(
            [env_python, os.path.abspath(__file__), "--serve-superseder", str(superseder_port)],
            superseder_port,
        ),
    ]
    try:
        print(
            f"queue emulator and superseder in their own processes; {args.rounds} rounds per size"
        )
        asyncio.run(
            bench(
                f"http://127.0.0.1:{queue_port}",
                f"http://127.0.0.1:{superseder_port}",
                args.sizes,
                args.rounds,
                args.concurrency,
            )
        )
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
