"""A private ``redis-server`` for fault tests: started on a free port, killed, started again."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time

from tests.ports import free_port


class RedisServer:
    """A redis-server that keeps nothing on disk, so that a restart brings it back empty."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([binary, *args], stdout=subprocess.DEVNULL)
        give_up = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                return
            assert self.proc.poll() is None, "redis-server exited at start"
            assert time.monotonic() < give_up, "redis-server did not start"
            time.sleep(0.02)  # polling for the port, with a deadline

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def restart_empty(self) -> None:
        self.kill()
        self.start()
