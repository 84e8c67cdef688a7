"""Benchmark: the superseding query against a bare Starlette endpoint answering the same body,
on the realistic mix (the default) and on one URL, and against a tc-coalesce model.

    make bench            (or: python scripts/with_services.py python bench/query.py)

Each server is one process on loopback; wrk drives it with 32 connections from one thread.
Rounds alternate between the servers (service, bare, service, bare...) and the medians are
compared, with the load average beside them: the machine is shared and noisy. The rotating mix
is measured again with the machine kept busy by other work: one busy-loop process, then one
per core.
BENCH_ROUNDS (at least 5) and BENCH_SECONDS set the rounds and their length.

``--against DIR`` also serves the rotating mix with the ``coalescer`` package of another
checkout (``git archive main coalescer | tar -x -C DIR``), in the same alternation, and prints
this checkout's rate against it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

import redis
from serving import (
    BIN,
    CONNECTIONS,
    KEYS,
    PER_KEY,
    ROOT,
    ROUNDS,
    SECONDS,
    Run,
    alternate,
    bare,
    busy,
    check_mix,
    cpu_of,
    free_port,
    load,
    mix_events,
    mix_ids,
    mix_paths,
    process,
    redis_cpu,
    rotation_script,
    scratch,
    service,
    write,
    wrk_run,
)

REDIS_URL = os.environ.get("COALESCER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: Ratio the query must reach against the bare endpoint on the mix: 90% of its requests/s
#: (docs/performance.md compares them).
TARGET = 0.9


def seed(ids: list[list[str]]) -> None:
    asyncio.run(write(REDIS_URL, mix_events(ids, int(time.time() * 1000))))
    # The tc-coalesce model's layout: a list per key, newest first, and a timestamp per task.
    r = redis.Redis.from_url(REDIS_URL)
    pipe = r.pipeline()
    for k, tasks in enumerate(ids):
        pipe.lpush(f"tc.lists.bench.k{k}", *tasks)
        for task in tasks:
            pipe.set(f"tc.{task}.timestamp", time.time() - 60)
    pipe.execute()
    r.close()


def main(against: Path | None) -> int:
    if shutil.which("wrk") is None:
        raise SystemExit("bench needs wrk: apt-get install wrk")
    client = redis.Redis.from_url(REDIS_URL)
    if client.dbsize():
        raise SystemExit(
            f"{REDIS_URL} is not empty: point COALESCER_TEST_REDIS_URL at an empty one"
        )
    ids = mix_ids()
    seed(ids)
    paths = mix_paths(ids)
    single = f"/bench.k7?taskId={ids[7][10]}"
    ports = {name: free_port() for name in ("bare", "coalescer", "tc-coalesce")}
    base = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    have_tc = shutil.which("gunicorn", path=str(BIN)) is not None
    try:
        with (
            scratch() as tmp,
            bare(ports["bare"]) as bare_proc,
            service(ports["coalescer"], REDIS_URL) as service_proc,
            contextlib.ExitStack() as other,
        ):
            script = rotation_script(paths, Path(tmp))
            used = redis_cpu(REDIS_URL)
            cpu = {"bare": cpu_of(bare_proc.pid), "coalescer": cpu_of(service_proc.pid, used)}
            check_mix(base["coalescer"], paths, every=7)
            runs = {
                "coalescer": lambda: wrk_run(
                    base["coalescer"], script=script, cpu=cpu["coalescer"], redis=used
                ),
                "bare": lambda: wrk_run(base["bare"], script=script, cpu=cpu["bare"]),
            }
            if against is not None:
                port = free_port()
                proc = other.enter_context(service(port, REDIS_URL, code=against))
                check_mix(f"http://127.0.0.1:{port}", paths, every=7)
                cpu["against"] = cpu_of(proc.pid, used)
                runs["against"] = lambda: wrk_run(
                    f"http://127.0.0.1:{port}", script=script, cpu=cpu["against"], redis=used
                )
            print(
                f"superseding query, requests/s: median of {ROUNDS} alternating rounds of "
                f"{SECONDS} s, wrk -t1 -c{CONNECTIONS}, one process each",
                flush=True,
            )
            print(
                f"\nrotating mix: {KEYS} keys x {PER_KEY} pending tasks, every (key, taskId) in "
                f"turn, {len(paths)} URLs, 32-id answers",
                flush=True,
            )
            mix = alternate(runs)
            print("\none URL (one key, one taskId), 32-id answer", flush=True)
            one = alternate(
                {
                    "coalescer": lambda: wrk_run(
                        base["coalescer"], path=single, cpu=cpu["coalescer"], redis=used
                    ),
                    "bare": lambda: wrk_run(base["bare"], path=single, cpu=cpu["bare"]),
                }
            )
            # Other work on the machine: the service's web process shares the cores with Redis
            # as well, where the bare endpoint's has only wrk and the busy loops beside it.
            busy_mix: dict[int, dict[str, Run]] = {}
            for n in sorted({1, os.cpu_count() or 1}):
                print(
                    f"\nrotating mix, the machine busy: {n} busy-loop process{'es' * (n > 1)} "
                    "beside the servers",
                    flush=True,
                )
                with busy(n):
                    busy_mix[n] = alternate({name: runs[name] for name in ("coalescer", "bare")})
            tc: dict[str, Run] = {}
            if have_tc:
                env = {**os.environ, "REDIS_URL": REDIS_URL}
                with process(
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
                    env,
                    cwd=ROOT / "bench",
                    ready=f"{base['tc-coalesce']}/v1/list/0/0/bench.k7",
                ) as tc_proc:
                    cpu["tc-coalesce"] = cpu_of(tc_proc.pid, redis_cpu(REDIS_URL))
                    print("\ntc-coalesce's route on one URL: the model and the compat route")
                    tc = alternate(
                        {
                            "compat route": lambda: wrk_run(
                                base["coalescer"],
                                path="/v1/list/0/0/bench.k7",
                                cpu=cpu["coalescer"],
                            ),
                            "tc-coalesce": lambda: wrk_run(
                                base["tc-coalesce"],
                                path="/v1/list/0/0/bench.k7",
                                cpu=cpu["tc-coalesce"],
                            ),
                        }
                    )
    finally:
        client.flushdb()
        client.close()
    print(f"\nsummary (medians; {load()}):")
    print(
        f"  {'':28} {'coalescer':>10} {'bare':>10} {'ratio':>7}   CPU us/request: "
        f"{'coalescer (web + Redis)':>23} {'bare':>6} {'bare/coalescer':>14}"
    )
    lines = [("rotating mix", mix), ("one URL", one)]
    lines += [(f"rotating mix, {n} busy loop{'s' * (n > 1)}", m) for n, m in busy_mix.items()]
    for name, m in lines:
        c, b = m["coalescer"], m["bare"]
        split = f"{c.cpu_us:.0f} ({c.cpu_us - c.redis_us:.0f} + {c.redis_us:.0f})"
        print(
            f"  {name:28} {c.rps:10.0f} {b.rps:10.0f} {c.rps / b.rps:6.2f}x   {'':16}"
            f"{split:>23} {b.cpu_us:6.0f} {b.cpu_us / c.cpu_us:13.2f}x"
            + (f"  (target >= {TARGET} in requests/s)" if name == "rotating mix" else "")
        )
    if against is not None:
        c, a, b = mix["coalescer"], mix["against"], mix["bare"]
        split = f"{a.cpu_us:.0f} ({a.cpu_us - a.redis_us:.0f} + {a.redis_us:.0f})"
        print(
            f"  {'rotating mix, ' + against.name:28} {a.rps:10.0f} {b.rps:10.0f} "
            f"{a.rps / b.rps:6.2f}x   {'':16}{split:>23}  (--against {against}: this checkout "
            f"{c.rps / a.rps:.2f}x its requests/s at {c.cpu_us / a.cpu_us:.2f}x its CPU per "
            "request)"
        )
    if tc:
        c, t = tc["compat route"], tc["tc-coalesce"]
        print(
            f"  {'tc-coalesce route, one URL':28} {c.rps:10.0f} {t.rps:10.0f} "
            f"{c.rps / t.rps:6.1f}x   {'':16}{c.cpu_us:23.0f} {t.cpu_us:6.0f}"
            f" {t.cpu_us / c.cpu_us:13.1f}x  (the second column: the tc-coalesce model, Flask "
            "on one gunicorn worker)"
        )
    else:
        print("  (tc-coalesce model skipped: pip install '.[bench]' for flask and gunicorn)")
    print(
        "  CPU us/request: CPU time of the server's processes (and Redis's, for coalescer and "
        "tc-coalesce) over a run, per request answered"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--against",
        type=Path,
        metavar="DIR",
        help="also serve the rotating mix with the coalescer package of another checkout",
    )
    sys.exit(main(parser.parse_args().against))
