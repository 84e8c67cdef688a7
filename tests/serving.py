"""A real ``coalescer serve`` process for the tests that need one, started and stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from tests.ports import free_port

BIN = Path(sys.executable).parent


@contextlib.contextmanager
def serving(
    env: Mapping[str, str], log_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``(base URL, process)`` of ``coalescer serve`` on a free port, once it answers its
    heartbeat; terminated on the way out. Its output goes to ``log_path``."""
    port = free_port()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(BIN / "coalescer"), "serve", "--port", str(port)],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/__lbheartbeat__", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "coalescer serve did not start"
            time.sleep(0.05)
        yield base, proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)
