"""``coalescer demo``: the whole superseding loop on one machine, in a minute.

It starts the queue emulator (a legacy queue, so that tasks can be resolved ``superseded``),
the service (embedded store unless ``--redis-url``) with the emulator publishing its task
events to it (``POST /v1/events`` with a generated token; or through RabbitMQ with
``--pulse-url``), and a few reference workers. Then it pushes: every ``--interval`` seconds one
task per key, each running ``sleep`` with the service as its ``supersederUrl``. Pushes outrun
the workers, so each worker that takes a task finds newer ones pending, runs the newest and
supersedes the rest; the demo prints each of those as it happens, and the URL of the pages.

Each process runs in its own session, logging to a file in ``--log-dir``; the demo stops them
(workers first, so that they release what they hold) after ``--duration`` or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO, TextIO
from urllib.parse import urlparse

import httpx

from coalescer.errors import ConfigError
from coalescer.settings import Settings

KEYS = ("linux64-tests", "windows11-tests", "macos-build", "android-lint")
TASK_QUEUE = "demo/linux"
SUPERSEDES = "public/supersedes.json"


def register(subparsers: Any) -> None:
    """Add ``coalescer demo`` to the CLI."""
    p = subparsers.add_parser(
        "demo",
        help="run the emulator, the service and workers on one machine, and watch superseding",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="default 60 s")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="default 2")
    p.add_argument("--keys", type=int, default=3, metavar="N", help=f"1-{len(KEYS)} (default 3)")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="between pushes")
    p.add_argument("--sleep", type=float, default=2.0, metavar="S", help="each task's run time")
    p.add_argument("--port", type=int, default=8000, help="the service's (default 8000, or free)")
    p.add_argument("--emulator-port", type=int, default=8081, help="default 8081, or free")
    p.add_argument("--pulse-url", metavar="URL", help="carry events through this AMQP broker")
    p.add_argument("--redis-url", metavar="URL", help="index in this Redis (default: embedded)")
    p.add_argument("--log-dir", type=Path, help="the processes' logs (default: a temp dir)")
    p.set_defaults(handler=handle)


def _port(wanted: int) -> int:
    """``wanted`` if it is free on loopback, else any free port."""
    for candidate in (wanted, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise ConfigError("no free port")


def handle(args: argparse.Namespace, settings: Settings) -> int:
    """Run the demo until ``--duration`` passes or it is interrupted."""
    if not 1 <= args.keys <= len(KEYS):
        raise ConfigError(f"--keys must be 1 to {len(KEYS)}")
    if args.workers < 1 or args.duration <= 0 or args.interval <= 0 or args.sleep < 0:
        raise ConfigError("--workers, --duration and --interval must be positive")
    if args.pulse_url and not args.pulse_url.startswith(("amqp://", "amqps://")):
        raise ConfigError("--pulse-url must start with amqp:// or amqps://")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="coalescer-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request: noise here
    return asyncio.run(Demo(args, log_dir, sys.stdout).run())


class Demo:
    def __init__(self, args: argparse.Namespace, log_dir: Path, out: TextIO) -> None:
        self.args = args
        self.log_dir = log_dir
        self.out = out
        self.port = _port(args.port)
        self.emulator_port = _port(args.emulator_port)
        self.service = f"http://127.0.0.1:{self.port}"
        self.root_url = f"http://127.0.0.1:{self.emulator_port}"
        self.token = secrets.token_urlsafe(18)
        self.keys = KEYS[: args.keys]
        self.processes: list[tuple[str, asyncio.subprocess.Process]] = []
        self.started = time.monotonic()
        self.pushed = 0
        self.ran = 0
        self.superseded = 0

    def say(self, line: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        print(f"{elapsed // 60:2d}:{elapsed % 60:02d}  {line}", file=self.out, flush=True)

    # -- processes ------------------------------------------------------------------------------
    def _env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_", "REDIS_URL"))
        }
        env.update(COALESCER_INGEST_TOKEN=self.token, COALESCER_LOG_LEVEL="WARNING", **extra)
        return env

    def _log(self, name: str) -> BinaryIO:
        return open(self.log_dir / f"{name}.log", "wb")

    async def _start(self, name: str, *argv: str, env: dict[str, str]) -> None:
        with self._log(name) as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "coalescer.cli",
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # Ctrl-C reaches the demo only; it stops them in order
            )
        self.processes.append((name, proc))

    async def _start_all(self) -> None:
        a = self.args
        service_env: dict[str, str] = {}
        if a.redis_url:
            service_env["REDIS_URL"] = a.redis_url
        if a.pulse_url:
            service_env["PULSE_URL"] = a.pulse_url
            # One queue for every demo run (Pulse lets a user declare queue/<user>/... only).
            user = urlparse(a.pulse_url).username or "guest"
            service_env["PULSE_QUEUE"] = f"queue/{user}/coalescer-demo"
        await self._start(
            "service", "serve", "--port", str(self.port), env=self._env(**service_env)
        )
        if a.pulse_url and a.redis_url:  # with Redis, the consumer is a process of its own
            await self._start(
                "listen", "listen", "--declare-exchanges", env=self._env(**service_env)
            )
        publish = (
            ["--pulse-url", a.pulse_url]
            if a.pulse_url
            else ["--publish-to", f"{self.service}/v1/events"]
        )
        await self._start(
            "emulator",
            "emulator",
            "--port",
            str(self.emulator_port),
            "--legacy",
            "--claim-work-timeout",
            "2",
            *publish,
            env=self._env(),
        )
        await self._wait_http(f"{self.service}/__lbheartbeat__", "the service")
        await self._wait_http(f"{self.root_url}/api/queue/v1/ping", "the queue emulator")
        worker_env = self._env(
            TASKCLUSTER_ROOT_URL=self.root_url,
            TASKCLUSTER_CLIENT_ID="demo",
            TASKCLUSTER_ACCESS_TOKEN="demo",
        )
        for i in range(1, a.workers + 1):
            await self._start(
                f"worker-{i}",
                "worker",
                "--task-queue-id",
                TASK_QUEUE,
                "--worker-group",
                "demo",
                "--worker-id",
                f"w{i}",
                "--superseder-allow",
                f"{self.service}/",
                env=worker_env,
            )

    async def _wait_http(self, url: str, what: str, within: float = 30.0) -> None:
        give_up = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                self._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() > give_up:
                    raise ConfigError(f"{what} did not start; see {self.log_dir}")
                await asyncio.sleep(0.1)

    def _check_alive(self) -> None:
        for name, proc in self.processes:
            if proc.returncode is not None:
                log = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise ConfigError(f"the {name} process exited ({proc.returncode}):\n{log}")

    async def _stop_all(self) -> None:
        """Workers first (they release what they hold), then the queue and the service."""
        for group in (
            [p for n, p in self.processes if n.startswith("worker")],
            [p for n, p in self.processes if not n.startswith("worker")],
        ):
            for proc in group:
                if proc.returncode is None:
                    proc.terminate()
            for proc in group:
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self._start_all()
            self._banner()
            async with httpx.AsyncClient(timeout=10, follow_redirects=True) as http:
                tasks = [
                    asyncio.create_task(self._push(http, stop)),
                    asyncio.create_task(self._follow(http, stop)),
                ]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.args.duration)
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            await self._stop_all()
        print(
            f"\nDone: pushed {self.pushed} tasks; {self.ran} ran, superseding "
            f"{self.superseded}. Logs: {self.log_dir}",
            file=self.out,
            flush=True,
        )
        return 0

    def _banner(self) -> None:
        print(
            f"coalescer demo: {self.args.workers} workers on {TASK_QUEUE}, pushes on "
            f"{len(self.keys)} keys every {self.args.interval:g} s, for {self.args.duration:g} s "
            "(Ctrl-C stops it).\n"
            f"  Open {self.service}/ to watch the keys (pages refresh themselves)\n"
            f"  queue emulator (rootUrl): {self.root_url}\n"
            f"  logs: {self.log_dir}\n",
            file=self.out,
            flush=True,
        )

    def _task(self, key: str) -> dict[str, Any]:
        import taskcluster

        return {
            "taskQueueId": TASK_QUEUE,
            "created": taskcluster.fromNowJSON("0 seconds"),
            "deadline": taskcluster.fromNowJSON("1 hour"),
            "routes": [f"coalesce.v1.{key}"],
            "payload": {
                "command": ["sleep", f"{self.args.sleep:g}"],
                "supersederUrl": f"{self.service}/{key}",
                "maxRunTime": 600,
            },
            "metadata": {
                "name": f"demo {key}",
                "description": "coalescer demo task",
                "owner": "demo@example.com",
                "source": "https://github.com/taskcluster",
            },
        }

    async def _push(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        import taskcluster

        while not stop.is_set():
            for key in self.keys:
                task_id = taskcluster.slugid.nice()
                r = await http.put(
                    f"{self.root_url}/api/queue/v1/task/{task_id}", json=self._task(key)
                )
                r.raise_for_status()
                self.pushed += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.args.interval)

    async def _follow(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """Print each primary that superseded others, once it is resolved (its secondaries
        are resolved before it, with ``superseded-by.json``)."""
        seen: set[str] = set()
        while not stop.is_set():
            r = await http.get(
                f"{self.root_url}/emulator/v1/messages", params={"exchange": "task-completed"}
            )
            for message in r.json()["messages"]:
                task_id = message["payload"]["status"]["taskId"]
                if task_id in seen:
                    continue
                seen.add(task_id)
                self.ran += 1
                await self._report(http, message)
            self._check_alive()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _report(self, http: httpx.AsyncClient, message: dict[str, Any]) -> None:
        task_id, run_id = message["payload"]["status"]["taskId"], message["payload"]["runId"]
        head = "route.coalesce.v1."
        key = next((c[len(head) :] for c in message["CC"] if c.startswith(head)), "?")
        url = f"{self.root_url}/api/queue/v1/task/{task_id}/runs/{run_id}/artifacts/{SUPERSEDES}"
        r = await http.get(url)
        if r.status_code == 404:
            return  # it ran alone
        r.raise_for_status()
        superseded = r.json()
        self.superseded += len(superseded)
        names = ", ".join(s["taskId"][:8] + "…" for s in superseded)
        self.say(
            f"{key:<16} ran {task_id[:8]}…, superseding {len(superseded)} older: {names}\n"
            f"        {self.service}/tasks/{task_id}"
        )
