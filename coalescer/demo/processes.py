"""The demo's processes: each a ``coalescer`` command in its own session, logging to a file;
waited for until it answers, checked while the demo runs, stopped in order at the end."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import BinaryIO

import httpx

from coalescer.errors import ConfigError


def free_port(wanted: int) -> int:
    """``wanted`` if it is free on loopback, else any free port.

    Probed as the servers bind it, with ``SO_REUSEADDR``: the connections of a demo that just
    ended linger in TIME_WAIT on its ports for a minute, and they do not keep a server from
    listening there again (a port another server listens on is still refused)."""
    for candidate in (wanted, 0):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise ConfigError("no free port")


class Processes:
    def __init__(self, log_dir: Path, token: str) -> None:
        self.log_dir = log_dir
        self.token = token
        self.running: list[tuple[str, asyncio.subprocess.Process]] = []

    def env(self, **extra: str) -> dict[str, str]:
        """This environment without the settings of a real deployment, plus ``extra``."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_", "REDIS_URL"))
        }
        env.update(COALESCER_INGEST_TOKEN=self.token, COALESCER_LOG_LEVEL="WARNING", **extra)
        return env

    def _log(self, name: str) -> BinaryIO:
        return open(self.log_dir / f"{name}.log", "wb")

    async def start(self, name: str, *argv: str, env: dict[str, str]) -> None:
        """Run ``coalescer <argv>`` as ``name``, logging to ``<log dir>/<name>.log``."""
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
        self.running.append((name, proc))

    async def wait_http(self, url: str, what: str, within: float = 30.0) -> None:
        """Until ``url`` answers 200; a process that exits meanwhile ends the demo."""
        give_up = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                self.check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url)).status_code == 200:
                        return
                if time.monotonic() > give_up:
                    raise ConfigError(f"{what} did not start; see {self.log_dir}")
                await asyncio.sleep(0.1)

    def check_alive(self) -> None:
        for name, proc in self.running:
            if proc.returncode is not None:
                log = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise ConfigError(f"the {name} process exited ({proc.returncode}):\n{log}")

    async def stop_all(self) -> None:
        """Workers first (they release what they hold), then the queue and the service."""
        for group in (
            [p for n, p in self.running if n.startswith("worker")],
            [p for n, p in self.running if not n.startswith("worker")],
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
