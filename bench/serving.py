"""What the HTTP benchmarks share: the realistic mix's index, the servers, and wrk driving them.

The mix: :data:`KEYS` keys with :data:`PER_KEY` pending tasks each; wrk rotates over every key
and every task of each (one URL per request, in a shuffled order), so that every answer is a
full list of :data:`CAP` taskIds and no key stays hot in a cache.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import httpx
import redis

from coalescer.model import TaskEvent
from coalescer.store import open_store

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
KEYS, PER_KEY, CAP = 100, 50, 32
ROUNDS = max(5, int(os.environ.get("BENCH_ROUNDS", "5")))
SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
CONNECTIONS = 32


def slug(rng: random.Random) -> str:
    raw = bytearray(uuid.UUID(int=rng.getrandbits(128), version=4).bytes)
    raw[0] &= 0x7F
    return base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")


def load() -> str:
    """The load average, to print beside every figure: the machine is shared."""
    return "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mix_ids(keys: int = KEYS, per_key: int = PER_KEY, seed: int = 1) -> list[list[str]]:
    """``ids[k]``: the taskIds pending under key ``bench.k<k>``, oldest first."""
    rng = random.Random(seed)
    return [[slug(rng) for _ in range(per_key)] for _ in range(keys)]


def mix_paths(ids: list[list[str]], prefix: str = "bench") -> list[str]:
    """Every (key, task) pair of the mix as a query path, in a shuffled, fixed order."""
    paths = [f"/{prefix}.k{k}?taskId={t}" for k, tasks in enumerate(ids) for t in tasks]
    random.Random(4).shuffle(paths)
    return paths


def mix_events(ids: list[list[str]], now_ms: int, prefix: str = "bench") -> Iterator[TaskEvent]:
    """What ingest writes for the mix: each task pending, in order, waiting for a minute."""
    for k, tasks in enumerate(ids):
        for i, task in enumerate(tasks):
            yield TaskEvent(
                task, 0, "pending", (f"{prefix}.k{k}",), float(i), now_ms + 86_400_000,
                now_ms - 60_000,
            )  # fmt: skip


async def write(url: str, events: Iterator[TaskEvent], *, batch: int = 500, depth: int = 4,
                progress: Callable[[int], None] | None = None) -> int:  # fmt: skip
    """Apply ``events`` through the store's batch write path (``Store.apply``: one round trip
    per batch, ``depth`` batches in flight); how many were applied."""
    import asyncio

    store = await open_store(url, grace_seconds=3600)
    done = 0
    try:
        pending: set[asyncio.Task[object]] = set()
        chunk: list[TaskEvent] = []
        for event in events:
            chunk.append(event)
            if len(chunk) == batch:
                pending.add(asyncio.ensure_future(store.apply(chunk)))
                chunk = []
                done += batch
                if len(pending) >= depth:
                    finished, pending = await asyncio.wait(
                        pending, return_when=asyncio.FIRST_COMPLETED
                    )
                    for f in finished:
                        f.result()
                if progress is not None:
                    progress(done)
        if chunk:
            pending.add(asyncio.ensure_future(store.apply(chunk)))
            done += len(chunk)
        for f in pending:
            await f
    finally:
        await store.close()
    return done


def wait_http(url: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"server at {url} did not come up")


def rotation_script(paths: Sequence[str], directory: Path) -> Path:
    """A wrk Lua script sending ``paths`` in turn (each connection thread from its own start),
    every request formatted once, up front, so that the load generator's cost stays low."""
    lines = ",\n".join(f'  wrk.format(nil, "{p}")' for p in paths)
    script = directory / f"rotate-{len(paths)}.lua"
    script.write_text(
        "local requests = {\n" + lines + "\n}\n"
        "local n = #requests\n"
        "local i = math.random(n)\n"
        "request = function()\n"
        "  i = i % n + 1\n"
        "  return requests[i]\n"
        "end\n"
    )
    return script


class Run(NamedTuple):
    """One wrk run: requests per second, and CPU time spent per request (microseconds) by the
    processes serving it, Redis included: the machine's load moves the first much more than the
    second. ``redis_us``: Redis's part of ``cpu_us``, when it was counted apart."""

    rps: float
    cpu_us: float
    redis_us: float = float("nan")
    #: The share of the machine's CPU time left idle over the run (every core's): what a second
    #: process could still use.
    idle: float = float("nan")


def tree_cpu(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` and its descendants (the living ones)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(") ", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def redis_cpu(url: str) -> Callable[[], float]:
    """CPU seconds used so far by the Redis at ``url`` (INFO cpu)."""
    client = redis.Redis.from_url(url)

    def used() -> float:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    return used


def cpu_of(pid: int, *more: Callable[[], float]) -> Callable[[], float]:
    return lambda: tree_cpu(pid) + sum(m() for m in more)


def wrk_run(
    base: str,
    *,
    script: Path | None = None,
    path: str = "",
    seconds: int = SECONDS,
    cpu: Callable[[], float] | None = None,
    redis: Callable[[], float] | None = None,
) -> Run:
    """wrk against ``base`` (rotating over ``script``'s paths, or asking ``path``), with the CPU
    time ``cpu`` counts over the run, and of it ``redis``'s; any non-2xx answer or socket error
    stops the benchmark."""
    argv = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds}s"]
    if script is not None:
        argv += ["-s", str(script)]
    before = cpu() if cpu is not None else 0.0
    redis_before = redis() if redis is not None else 0.0
    times_before = machine_times()
    out = subprocess.run([*argv, base + path], capture_output=True, text=True, check=True).stdout
    times = [b - a for a, b in zip(times_before, machine_times(), strict=True)]
    spent = (cpu() - before) if cpu is not None else float("nan")
    redis_spent = (redis() - redis_before) if redis is not None else float("nan")
    if re.search(
        r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*(?:read|write|timeout) [1-9]", out
    ):
        raise SystemExit(f"{base} answered errors:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    requests = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    idle = (times[3] + times[4]) / sum(times) if sum(times) else float("nan")
    return Run(rps, spent / max(requests, 1) * 1e6, redis_spent / max(requests, 1) * 1e6, idle)


def machine_times() -> list[int]:
    """The machine's CPU time so far, every core's, by kind (``/proc/stat``: user, nice,
    system, idle, iowait...); zeros where there is no ``/proc``."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return [0] * 10


def wrk(base: str, *, script: Path | None = None, path: str = "", seconds: int = SECONDS) -> float:
    """Requests per second wrk reached against ``base`` (see :func:`wrk_run`)."""
    return wrk_run(base, script=script, path=path, seconds=seconds).rps


def check_mix(base: str, paths: Sequence[str], *, every: int = 1) -> None:
    """Every ``every``-th path of the mix answers ``CAP`` ids, the task asked about among them:
    the benchmark measures real answers."""
    with httpx.Client(base_url=base, timeout=10) as client:
        for path in paths[::every]:
            got = client.get(path).json()["supersedes"]
            task = path.rsplit("=", 1)[1]
            if len(got) != CAP or task not in got:
                raise SystemExit(f"{path} answered {got}")


@contextlib.contextmanager
def process(argv: Sequence[str], env: dict[str, str], *, cwd: Path | None = None,
            ready: str | None = None) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """A server process, stopped (SIGTERM) at the end; waits for ``ready`` (a URL) to answer."""
    proc = subprocess.Popen(list(argv), env=env, cwd=cwd)
    try:
        if ready is not None:
            wait_http(ready)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


#: ``coalescer`` from another checkout: past this one's editable install, whose finder comes
#: before ``sys.path``.
AGAINST = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith("__editable__")]
sys.path.insert(0, {code!r})
from coalescer import cli
assert cli.__file__.startswith({code!r}), cli.__file__
sys.exit(cli.main(sys.argv[1:]))
"""


def coalescer_argv(code: Path | None = None) -> list[str]:
    """The command that runs ``coalescer``: this checkout's, or the ``coalescer`` package in
    directory ``code`` (e.g. ``git archive main coalescer | tar -x -C DIR``), for comparisons."""
    if code is None:
        return [sys.executable, "-m", "coalescer.cli"]
    if not (code / "coalescer" / "cli.py").is_file():
        raise SystemExit(f"--against {code}: no coalescer/ package there")
    return [sys.executable, "-c", AGAINST.format(code=str(code.resolve()))]


def service(
    port: int, redis_url: str, *extra: str, code: Path | None = None
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """``coalescer serve`` on ``port`` (of the checkout at ``code``, see :func:`coalescer_argv`)."""
    env = {**os.environ, "REDIS_URL": redis_url, "COALESCER_LOG_LEVEL": "WARNING"}
    for name in ("WEB_CONCURRENCY", "PROMETHEUS_MULTIPROC_DIR", "PORT"):
        env.pop(name, None)
    return process(
        [*coalescer_argv(code), "serve", "--port", str(port), *extra],
        env,
        ready=f"http://127.0.0.1:{port}/__lbheartbeat__",
    )


def bare(port: int) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """The yardstick (bench/bare.py), served by uvicorn as the service is: httptools, no access
    log, one process."""
    return process(
        [
            str(BIN / "uvicorn"),
            "bare:app",
            "--port",
            str(port),
            "--http",
            "httptools",
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        dict(os.environ),
        cwd=ROOT / "bench",
        ready=f"http://127.0.0.1:{port}/x",
    )


def alternate(runs: dict[str, Callable[[], Run]], rounds: int = ROUNDS) -> dict[str, Run]:
    """Run each measurement once per round, in turn, for ``rounds`` rounds (the machine's load
    drifts: alternating spreads it over all of them); their medians."""
    results: dict[str, list[Run]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            results[name].append(run())
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {v[-1].rps:.0f}/s {v[-1].cpu_us:.0f} us" for n, v in results.items())
            + f"  ({load()})",
            flush=True,
        )
    return {
        name: Run(*(statistics.median(column) for column in zip(*v, strict=True)))
        for name, v in results.items()
    }


@contextlib.contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` busy loops at normal priority while it lasts: other work keeping the
    machine busy, the same for every server measured meanwhile."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def scratch() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="coalescer-bench-")
