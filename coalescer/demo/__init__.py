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

The parts: :mod:`~coalescer.demo.cast` (who takes part, how each starts),
:mod:`~coalescer.demo.processes` (running, checking and stopping them),
:mod:`~coalescer.demo.pushes` (the tasks pushed) and :mod:`~coalescer.demo.follow` (what is
printed as it happens); :class:`Demo` runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import httpx

from coalescer.demo.cast import TASK_QUEUE, Cast
from coalescer.demo.follow import Follower
from coalescer.demo.processes import Processes, free_port
from coalescer.demo.pushes import Pusher
from coalescer.errors import ConfigError
from coalescer.settings import Settings, amqp_url, redis_url

KEYS = ("linux64-tests", "windows11-tests", "macos-build", "android-lint")


def register(subparsers: Any) -> None:
    """Add ``coalescer demo`` to the CLI."""
    p = subparsers.add_parser(
        "demo",
        help="run the emulator, the service and workers on one machine, and watch superseding",
        description="The whole superseding loop on one machine, in a minute: the queue "
        "emulator, the service and reference workers, with a stream of pushes on a few keys "
        "that outruns the workers; it prints each task that superseded others, with a link, "
        "and stops everything it started at the end (its links then no longer answer).",
    )
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="default 60 s")
    p.add_argument("--workers", type=int, default=2, metavar="N", help="default 2")
    p.add_argument("--keys", type=int, default=3, metavar="N", help=f"1-{len(KEYS)} (default 3)")
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="between pushes (default 1 s)"
    )
    p.add_argument(
        "--sleep", type=float, default=2.0, metavar="S", help="each task's run time (default 2 s)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=8000,
        help="the service's (default 8000, or a free one when taken)",
    )
    p.add_argument(
        "--emulator-port",
        type=int,
        default=8081,
        help="the queue emulator's (default 8081, or a free one when taken)",
    )
    p.add_argument(
        "--pulse-url",
        metavar="URL",
        help="carry events through this AMQP broker (default: posted to the service)",
    )
    p.add_argument("--redis-url", metavar="URL", help="index in this Redis (default: embedded)")
    p.add_argument("--log-dir", type=Path, help="the processes' logs (default: a temp dir)")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace, settings: Settings) -> int:
    """Run the demo until ``--duration`` passes or it is interrupted."""
    if not 1 <= args.keys <= len(KEYS):
        raise ConfigError(f"--keys must be 1 to {len(KEYS)}")
    if args.workers < 1 or args.duration <= 0 or args.interval <= 0 or args.sleep < 0:
        raise ConfigError("--workers, --duration and --interval must be positive")
    amqp_url(args.pulse_url, "--pulse-url")
    redis_url(args.redis_url, "--redis-url")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="coalescer-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request: noise here
    return asyncio.run(Demo(args, log_dir, sys.stdout).run())


class Demo:
    """The demo's run: start the cast, push and follow until the time is up or Ctrl-C, stop
    everyone, and sum up."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, out: TextIO) -> None:
        self.args = args
        self.log_dir = log_dir
        self.out = out
        self.cast = Cast(args, free_port(args.port), free_port(args.emulator_port))
        self.processes = Processes(log_dir, secrets.token_urlsafe(18))
        self.keys = KEYS[: args.keys]
        self.started = time.monotonic()
        self.pusher = Pusher(
            self.cast.root_url,
            self.cast.service,
            self.keys,
            interval=args.interval,
            sleep=args.sleep,
        )
        self.follower = Follower(
            self.cast.root_url, self.cast.service, self.say, self.processes.check_alive
        )

    def say(self, line: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        print(f"{elapsed // 60:2d}:{elapsed % 60:02d}  {line}", file=self.out, flush=True)

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.cast.start(self.processes)
            self._banner()
            async with httpx.AsyncClient(timeout=10, follow_redirects=True) as http:
                tasks = [
                    asyncio.create_task(self.pusher.run(http, stop)),
                    asyncio.create_task(self.follower.run(http, stop)),
                ]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.args.duration)
                stop.set()
                await asyncio.gather(*tasks)
        finally:
            await self.processes.stop_all()
        print(
            f"\nDone: pushed {self.pusher.pushed} tasks; {self.follower.ran} ran, superseding "
            f"{self.follower.superseded}. Logs: {self.log_dir}\n"
            "The service and the queue emulator have stopped with the demo: the links above "
            "no longer answer (the emulator's tasks lived in its memory).",
            file=self.out,
            flush=True,
        )
        return 0

    def _banner(self) -> None:
        print(
            f"coalescer demo: {self.args.workers} workers on {TASK_QUEUE}, pushes on "
            f"{len(self.keys)} keys every {self.args.interval:g} s, for {self.args.duration:g} s "
            "(Ctrl-C stops it).\n"
            f"  Open {self.cast.service}/ to watch the keys (pages refresh themselves)\n"
            f"  queue emulator (the workers' rootUrl; its tasks): {self.cast.root_url}/\n"
            f"  logs: {self.log_dir}\n",
            file=self.out,
            flush=True,
        )
