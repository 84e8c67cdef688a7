"""A ``redis-server`` of a test's own, to fill, freeze, kill and empty (real faults, real server)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import redis

from tests.ports import free_port


class RedisServer:
    """One throwaway ``redis-server`` on a free loopback port, without persistence: a restart
    starts it empty, as a Redis without persistence (or a lost volume) does."""

    def __init__(self, *options: str, env: Mapping[str, str] | None = None) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = Path(tempfile.mkdtemp(prefix="coalescer-fault-redis-"))
        self.argv = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning",
            "--logfile", str(self.workdir / "redis.log"), *options,
        ]  # fmt: skip
        self.env = None if env is None else {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = redis.Redis(port=self.port, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log").read_text(errors="replace")
                raise RuntimeError(f"redis-server did not start on {self.port}:\n{log}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                pass
            return bool(self.client.ping())
        except (OSError, redis.RedisError):
            return False

    def kill(self) -> None:
        """SIGKILL: the data set is gone with it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self.client.connection_pool.disconnect()

    def restart_empty(self) -> None:
        self.kill()
        self.start()

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def fill(self, headroom: int = 64 * 1024) -> int:
        """Make Redis full: ``maxmemory`` a little above what it uses, then filler keys until it
        refuses writes with ``OOM``, and the limit pinned just under what it then uses (memory
        use wavers by a few kilobytes: a small write could otherwise slip in). Returns how
        many filler keys it took."""
        used = int(self.client.info("memory")["used_memory"])
        self.client.config_set("maxmemory", used + headroom)
        n = 0
        while True:
            try:
                self.client.set(f"filler:{n}", b"x" * 4096)
            except redis.exceptions.OutOfMemoryError:
                break
            n += 1
        used = int(self.client.info("memory")["used_memory"])
        self.client.config_set("maxmemory", used - 32 * 1024)
        return n

    def unfill(self) -> None:
        """Give memory back: drop the filler and lift the limit."""
        for key in self.client.scan_iter("filler:*", count=1000):
            self.client.unlink(key)
        self.client.config_set("maxmemory", 0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)
        self.client.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def redis_server(*options: str, env: Mapping[str, str] | None = None) -> Iterator[RedisServer]:
    """A started :class:`RedisServer`, stopped after; ``env``: variables to add to its
    environment (a locale, say)."""
    server = RedisServer("--maxmemory-policy", "noeviction", *options, env=env)
    server.start()
    try:
        yield server
    finally:
        server.stop()
