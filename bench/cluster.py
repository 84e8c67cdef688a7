"""Benchmark: the superseding query on a Redis Cluster against a bare Starlette endpoint.

Starts a throwaway three-node Redis Cluster on loopback, seeds it as ``bench/query.py`` seeds a
single Redis (100 keys x 50 pending tasks, spread over the nodes by their hash tags), then drives
``coalescer serve`` (``REDIS_URL`` at the cluster) and the bare endpoint with ``wrk -t1 -c32``,
alternating rounds, and prints the medians and their ratio.

    .venv/bin/python bench/cluster.py        (BENCH_ROUNDS, BENCH_SECONDS as for make bench)
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from serving import BIN, ROUNDS, free_port, mix_events, mix_ids, wait_http, write, wrk  # noqa: E402

from tests.redis_cluster import redis_cluster  # noqa: E402


def main() -> int:
    ids = mix_ids()
    with redis_cluster() as url:
        asyncio.run(write(url, mix_events(ids, int(time.time() * 1000))))
        env = {**os.environ, "REDIS_URL": url, "COALESCER_LOG_LEVEL": "WARNING"}
        ports = {"bare": free_port(), "coalescer": free_port()}
        procs = [
            subprocess.Popen(
                [str(BIN / "uvicorn"), "bare:app", "--port", str(ports["bare"]),
                 "--log-level", "warning", "--no-access-log"],
                cwd=ROOT / "bench",
                env=env,
            ),
            subprocess.Popen(
                [str(BIN / "coalescer"), "serve", "--port", str(ports["coalescer"])], env=env
            ),
        ]  # fmt: skip
        try:
            # One key, as in bench/query.py: the routing work is the same whichever node owns it.
            task = ids[7][10]
            urls = {
                "bare": f"http://127.0.0.1:{ports['bare']}/bench.k7?taskId={task}",
                "coalescer on a cluster": (
                    f"http://127.0.0.1:{ports['coalescer']}/bench.k7?taskId={task}"
                ),
            }
            for u in urls.values():
                wait_http(u)
            got = httpx.get(urls["coalescer on a cluster"]).json()["supersedes"]
            assert len(got) == 32 and task in got, got
            results: dict[str, list[float]] = {name: [] for name in urls}
            for r in range(ROUNDS):
                for name, u in urls.items():
                    results[name].append(wrk(u))
                print(
                    f"round {r + 1}/{ROUNDS}: "
                    + ", ".join(f"{n} {v[-1]:.0f}" for n, v in results.items()),
                    flush=True,
                )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=10)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"\nsuperseding query on a 3-node Redis Cluster, requests/s (median of {ROUNDS}):")
    for name, value in med.items():
        print(f"  {name:24} {value:9.0f}")
    ratio = med["coalescer on a cluster"] / med["bare"]
    print(f"  cluster / bare Starlette  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
