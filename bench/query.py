"""Benchmark: the superseding query against a bare Starlette endpoint and a tc-coalesce model,
ingest throughput, and Redis memory per tracked task. Prints figures and ratios from one run.

    make bench            (or: python scripts/with_services.py python bench/query.py)

Each server is one process on loopback; wrk drives it with 32 connections. Rounds alternate
between servers and the medians are compared, since this machine is shared and noisy.
"""

from __future__ import annotations

import asyncio
import base64
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import redis

from coalescer.model import TaskEvent
from coalescer.store import open_store

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
REDIS_URL = os.environ.get("COALESCER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
KEYS, PER_KEY = 100, 50
ROUNDS, SECONDS = (
    int(os.environ.get("BENCH_ROUNDS", "3")),
    int(os.environ.get("BENCH_SECONDS", "5")),
)


def slug(rng: random.Random) -> str:
    raw = bytearray(uuid.UUID(int=rng.getrandbits(128), version=4).bytes)
    raw[0] &= 0x7F
    return base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server at {url} did not come up")


def wrk(url: str) -> float:
    out = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{SECONDS}s", url], capture_output=True, text=True, check=True
    ).stdout
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise SystemExit(f"{url} answered errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


async def seed_index(url: str, ids: list[list[str]]) -> None:
    """``ids[k]`` pending under key ``bench.k<k>``, in that order, waiting for a minute."""
    store = await open_store(url, grace_seconds=3600)
    now = int(time.time() * 1000)
    events = [
        TaskEvent(
            ids[k][i], 0, "pending", (f"bench.k{k}",), float(i), now + 86_400_000, now - 60_000
        )
        for k in range(KEYS)
        for i in range(PER_KEY)
    ]
    for i in range(0, len(events), 500):
        await store.apply(events[i : i + 500])
    await store.close()


async def seed(ids: list[list[str]]) -> None:
    await seed_index(REDIS_URL, ids)
    # The tc-coalesce model's layout: a list per key, newest first, and a timestamp per task.
    r = redis.Redis.from_url(REDIS_URL)
    pipe = r.pipeline()
    for k in range(KEYS):
        pipe.lpush(f"tc.lists.bench.k{k}", *ids[k])
        for task in ids[k]:
            pipe.set(f"tc.{task}.timestamp", time.time() - 60)
    pipe.execute()
    r.close()


async def ingest_rate(n: int, batch: int) -> float:
    store = await open_store(REDIS_URL, grace_seconds=3600)
    rng = random.Random(2)
    now = int(time.time() * 1000)
    events = [
        TaskEvent(slug(rng), 0, "pending", (f"ingest.k{i % 50}",), float(i), now + 86_400_000, now)
        for i in range(n)
    ]
    start = time.perf_counter()
    for i in range(0, n, batch):
        await store.apply(events[i : i + batch])
    elapsed = time.perf_counter() - start
    await store.close()
    return n / elapsed


async def memory_per_task(n: int = 100_000) -> float:
    r = redis.Redis.from_url(REDIS_URL)
    r.flushdb()
    before = int(r.info("memory")["used_memory"])
    store = await open_store(REDIS_URL, grace_seconds=3600)
    rng = random.Random(3)
    now = int(time.time() * 1000)
    for start in range(0, n, 1000):
        await store.apply(
            [
                TaskEvent(
                    slug(rng), 0, "pending", (f"mem.k{i % 1000}",), float(i), now + 86_400_000, now
                )
                for i in range(start, start + 1000)
            ]
        )
    await store.close()
    after = int(r.info("memory")["used_memory"])
    r.flushdb()
    r.close()
    return (after - before) / n


def main() -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("bench needs wrk: apt-get install wrk")
    redis.Redis.from_url(REDIS_URL).flushdb()
    rng = random.Random(1)
    ids = [[slug(rng) for _ in range(PER_KEY)] for _ in range(KEYS)]
    asyncio.run(seed(ids))
    env = {**os.environ, "REDIS_URL": REDIS_URL, "COALESCER_LOG_LEVEL": "WARNING"}
    ports = {name: free_port() for name in ("bare", "coalescer", "tc-coalesce")}
    procs = [
        subprocess.Popen(
            [
                str(BIN / "uvicorn"),
                "bare:app",
                "--port",
                str(ports["bare"]),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            cwd=ROOT / "bench",
            env=env,
        ),
        subprocess.Popen(
            [str(BIN / "coalescer"), "serve", "--port", str(ports["coalescer"])], env=env
        ),
    ]
    have_tc = shutil.which("gunicorn", path=str(BIN)) is not None
    if have_tc:
        procs.append(
            subprocess.Popen(
                [
                    str(BIN / "gunicorn"),
                    "-w",
                    "1",
                    "-b",
                    f"127.0.0.1:{ports['tc-coalesce']}",
                    "--log-level",
                    "warning",
                    "tc_coalesce_model:app",
                ],
                cwd=ROOT / "bench",
                env=env,
            )
        )
    try:
        task = ids[7][10]
        urls = {
            "bare": f"http://127.0.0.1:{ports['bare']}/bench.k7?taskId={task}",
            "coalescer": f"http://127.0.0.1:{ports['coalescer']}/bench.k7?taskId={task}",
            "coalescer-compat": f"http://127.0.0.1:{ports['coalescer']}/v1/list/0/0/bench.k7",
        }
        if have_tc:
            urls["tc-coalesce"] = f"http://127.0.0.1:{ports['tc-coalesce']}/v1/list/0/0/bench.k7"
        for url in urls.values():
            wait_http(url)
        got = httpx.get(urls["coalescer"]).json()["supersedes"]
        assert len(got) == 32 and task in got, got
        results: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(ROUNDS):
            for name, url in urls.items():
                results[name].append(wrk(url))
            print(
                f"round {r + 1}/{ROUNDS}: "
                + ", ".join(f"{n} {v[-1]:.0f}" for n, v in results.items()),
                flush=True,
            )
        med = {name: statistics.median(v) for name, v in results.items()}
        print(
            f"\nsuperseding query, requests/s (median of {ROUNDS} x {SECONDS}s, wrk -c32, one process each):"
        )
        for name, value in med.items():
            print(f"  {name:18} {value:9.0f}")
        print(
            f"  coalescer / bare Starlette          {med['coalescer'] / med['bare']:.2f}x  (target >= 0.80)"
        )
        if have_tc:
            print(
                f"  coalescer / tc-coalesce model       {med['coalescer'] / med['tc-coalesce']:.1f}x  (target >= 5)"
            )
            print(
                f"  compat route / tc-coalesce model    {med['coalescer-compat'] / med['tc-coalesce']:.1f}x"
            )
        else:
            print("  (tc-coalesce model skipped: pip install '.[bench]' for flask and gunicorn)")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
    print("\ningest, events/s applied to Redis (one process, 20k events):")
    one = asyncio.run(ingest_rate(5_000, 1))
    hundred = asyncio.run(ingest_rate(20_000, 100))
    print(f"  one event per round trip            {one:9.0f}")
    print(f"  100 events per round trip           {hundred:9.0f}")
    per_task = asyncio.run(memory_per_task())
    print(
        f"\nRedis memory per tracked pending task at 100k tasks over 1000 keys: {per_task:.0f} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
