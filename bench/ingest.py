"""Ingest throughput, both ways in: Pulse (``coalescer listen``) and ``POST /v1/events``.

Each round starts from an empty private ``redis-server`` (started here, so no shared Redis is
disturbed) and real-shaped messages (pending, running, completed of N/3 tasks over 100
coalescing keys):

* **pulse**: a fresh queue on the RabbitMQ in ``COALESCER_TEST_AMQP_URL`` (or ``PULSE_URL``,
  else the local one) is bound as ``listen`` binds it and filled with a backlog; one
  ``coalescer listen`` process then drains it. The clock starts at its first applied batch.
* **http**: one ``coalescer serve`` process (uvicorn) takes the messages in bodies of
  ``--http-batch`` from ``--http-clients`` concurrent clients.

The machine this runs on is shared, so each line gives the median of ``--rounds`` rounds of
wall-clock events/s, and beside it the events per CPU-second the ingesting process used (what
one core would do; it moves far less with the load), the target, and the load average. The http
part also gives the CPU time the private Redis spent per event (``INFO cpu``): Redis shares the
machine's cores.

    .venv/bin/python scripts/with_services.py .venv/bin/python bench/ingest.py \\
        [--rounds 3] [--messages 20000] [--http-messages 60000] [--http-batch 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aio_pika
import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the test suite's message builders and private redis-server

import backlog  # noqa: E402 (bench/backlog.py: the Pulse backlog)
from serving import coalescer_argv, redis_cpu  # noqa: E402 (bench/serving.py: the HTTP benchmarks' helpers)

from coalescer.ingest.topology import bindings, dead_letter_names, queue_arguments  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

PULSE_TARGET, HTTP_TARGET = 15_000, 50_000
LIMIT_S = 120.0
TOKEN = "bench-" + uuid.uuid4().hex
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(COALESCER_LOG_FORMAT="text", COALESCER_LOG_LEVEL="WARNING", **extra)
    return env


def start(
    command: str, env: dict[str, str], log: Path, code: Path | None
) -> subprocess.Popen[bytes]:
    """``coalescer <command>`` of this checkout, or of the one at ``code``."""
    argv = [*coalescer_argv(code), command]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=out)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_until(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    give_up = time.monotonic() + LIMIT_S
    while not check():
        if proc.poll() is not None:
            sys.exit(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > give_up:
            sys.exit(f"gave up waiting for {what} after {LIMIT_S:.0f} s")
        await asyncio.sleep(0.002)


class Round:
    """One round's figures (``redis_cpu``: the CPU-seconds Redis used, when measured)."""

    def __init__(
        self, events: int, seconds: float, cpu: float, redis_cpu: float | None = None
    ) -> None:
        self.rate = events / seconds
        self.per_cpu = events / cpu if cpu else float("inf")
        self.redis_us = None if redis_cpu is None else redis_cpu / events * 1e6


async def pulse_round(
    server: RedisServer, amqp_url: str, n: int, prefetch: int, logs: Path, code: Path | None
) -> Round:
    prefix = f"coalesce.bench{uuid.uuid4().hex[:8]}"
    queue = f"queue/guest/coalescer-bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel(publisher_confirms=False)
    proc = None
    try:
        declared = await channel.declare_queue(
            queue, durable=True, arguments=queue_arguments(queue, 10 * n)
        )
        exchanges = {}
        for name, pattern in bindings(prefix):
            exchanges[name] = await channel.declare_exchange(
                name, aio_pika.ExchangeType.TOPIC, durable=True
            )
            await declared.bind(name, pattern)
        await backlog.publish(lambda m: exchanges[m["exchange"]], backlog.messages(prefix, n))
        give_up = time.monotonic() + LIMIT_S
        while (
            await channel.declare_queue(queue, passive=True)
        ).declaration_result.message_count < n:
            if time.monotonic() > give_up:
                sys.exit("the broker did not take the backlog")
            await asyncio.sleep(0.05)

        env = environ(
            REDIS_URL=server.url,
            PULSE_URL=amqp_url,
            PULSE_QUEUE=queue,
            COALESCER_ROUTE_PREFIX=prefix,
            **({"COALESCER_PULSE_PREFETCH": str(prefetch)} if prefetch else {}),
            COALESCER_PULSE_MAX_LENGTH=str(10 * n),
        )
        proc = start("listen", env, logs / f"listen-{queue.rsplit('-', 1)[1]}.log", code)

        def handled() -> int:
            return int(server.client.hget("co:stats", "total_msgs_handled") or 0)

        await wait_until(lambda: handled() > 0, "listen to start", proc)
        started, cpu = time.monotonic(), cpu_seconds(proc.pid)
        await wait_until(lambda: handled() >= n, "the backlog to drain", proc)
        took, cpu = time.monotonic() - started, cpu_seconds(proc.pid) - cpu
        applied = int(server.client.hget("co:stats", "events_applied") or 0)
        if applied != n:
            sys.exit(f"pulse: {applied} of {n} events applied")
        return Round(n, took, cpu)
    finally:
        if proc is not None:
            stop(proc)
        dead_exchange, dead_queue = dead_letter_names(queue)
        await channel.queue_delete(queue)
        await channel.queue_delete(dead_queue)
        await channel.exchange_delete(dead_exchange)
        await connection.close()


async def http_round(
    server: RedisServer, n: int, batch: int, clients: int, logs: Path, code: Path | None
) -> Round:
    prefix = f"coalesce.bench{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = environ(
        REDIS_URL=server.url,
        PORT=str(port),
        COALESCER_ROUTE_PREFIX=prefix,
        COALESCER_INGEST_TOKEN=TOKEN,
    )
    proc = start("serve", env, logs / f"serve-{port}.log", code)
    try:
        all_messages = backlog.messages(prefix, n)
        bodies = [orjson.dumps(all_messages[i : i + batch]) for i in range(0, n, batch)]
        base = f"http://127.0.0.1:{port}"
        headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits) as client:

            def up() -> bool:
                try:
                    return httpx.get(base + "/__lbheartbeat__").status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(up, "serve to start", proc)
            todo = list(reversed(bodies))
            applied = 0

            async def post() -> None:
                nonlocal applied
                while todo:
                    answer = await client.post("/v1/events", content=todo.pop(), timeout=60)
                    answer.raise_for_status()
                    # Bodies are applied concurrently: a task's running event may land after its
                    # completed one, and is then stale, as it should be.
                    results = orjson.loads(answer.content)["results"]
                    applied += sum(r["status"] in ("applied", "stale") for r in results)

            started, cpu = time.monotonic(), cpu_seconds(proc.pid)
            redis_used = redis_cpu(server.url)
            redis_before = redis_used()
            await asyncio.gather(*(post() for _ in range(clients)))
            took, cpu = time.monotonic() - started, cpu_seconds(proc.pid) - cpu
            redis_spent = redis_used() - redis_before
        if applied != n:
            sys.exit(f"http: {applied} of {n} events applied or stale")
        return Round(n, took, cpu, redis_spent)
    finally:
        stop(proc)


def line(name: str, rounds: list[Round], target: int, detail: str) -> str:
    rate = statistics.median(r.rate for r in rounds)
    per_cpu = statistics.median(r.per_cpu for r in rounds)
    each = ", ".join(f"{r.rate:,.0f}" for r in rounds)
    redis = [r.redis_us for r in rounds if r.redis_us is not None]
    redis_cpu = f"; Redis {statistics.median(redis):.1f} µs CPU per event" if redis else ""
    return (
        f"{name:<14} {rate:>7,.0f} events/s median ({each}); {per_cpu:>7,.0f} per CPU-second; "
        f"target {target:,}: {rate / target:.2f}x ({per_cpu / target:.2f}x per CPU-second)"
        f"{redis_cpu}; {detail}; load {os.getloadavg()[0]:.2f}"
    )


def ratio(name: str, ours: list[Round], theirs: list[Round], against: Path) -> str:
    def median(rounds: list[Round], field: str) -> float:
        return statistics.median(getattr(r, field) for r in rounds)

    return (
        f"{name:<14} this checkout / {against}: {median(ours, 'rate') / median(theirs, 'rate'):.2f}x "
        f"events/s, {median(ours, 'per_cpu') / median(theirs, 'per_cpu'):.2f}x per CPU-second"
    )


async def main(args: argparse.Namespace) -> int:
    amqp_url = (
        os.environ.get("COALESCER_TEST_AMQP_URL")
        or os.environ.get("PULSE_URL")
        or "amqp://guest:guest@127.0.0.1:5672/"
    )
    if args.against is not None:
        coalescer_argv(args.against)  # says so now when DIR holds no coalescer package
    codes: list[Path | None] = [None] if args.against is None else [None, args.against]
    logs = Path(tempfile.mkdtemp(prefix="coalescer-bench-ingest-"))
    server = RedisServer()
    server.start()
    pulse: dict[Path | None, list[Round]] = {code: [] for code in codes}
    http: dict[Path | None, list[Round]] = {code: [] for code in codes}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        for i in range(args.rounds):
            for code in codes:  # interleaved, so that both see the same machine
                which = "this checkout" if code is None else str(code)
                if "pulse" in args.only:
                    server.client.flushdb()
                    r = await pulse_round(
                        server, amqp_url, args.messages, args.prefetch, logs, code
                    )
                    pulse[code].append(r)
                    print(
                        f"  round {i + 1} pulse {r.rate:>7,.0f} events/s, {r.per_cpu:>7,.0f}/CPU-s ({which})"
                    )
                if "http" in args.only:
                    server.client.flushdb()
                    r = await http_round(
                        server, args.http_messages, args.http_batch, args.http_clients, logs, code
                    )
                    http[code].append(r)
                    print(
                        f"  round {i + 1} http  {r.rate:>7,.0f} events/s, {r.per_cpu:>7,.0f}/CPU-s, "
                        f"Redis {r.redis_us:.1f} µs/event ({which})"
                    )
    finally:
        server.kill()
    prefetch = args.prefetch or "default"
    for code in codes:
        suffix = "" if code is None else " (against)"
        if pulse[code]:
            detail = f"{args.messages:,} events, prefetch {prefetch}, one `listen` process"
            print(line("pulse" + suffix, pulse[code], PULSE_TARGET, detail))
        if http[code]:
            detail = (
                f"{args.http_messages:,} events in bodies of {args.http_batch}, "
                f"{args.http_clients} clients, one `serve` process"
            )
            print(line("http" + suffix, http[code], HTTP_TARGET, detail))
    if args.against is not None:
        if pulse[None]:
            print(ratio("pulse ratio", pulse[None], pulse[args.against], args.against))
        if http[None]:
            print(ratio("http ratio", http[None], http[args.against], args.against))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20_000, help="per pulse round")
    parser.add_argument("--prefetch", type=int, default=0, help="default: the service's")
    parser.add_argument("--http-messages", type=int, default=60_000, help="per http round")
    parser.add_argument("--http-batch", type=int, default=1000)
    parser.add_argument("--http-clients", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=("pulse", "http"), default=["pulse", "http"])
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="also run the same rounds, interleaved, with the coalescer package of another "
        "checkout (e.g. `git archive main coalescer | tar -x -C DIR`), and print the ratios",
    )
    sys.exit(asyncio.run(main(parser.parse_args())))
