"""A malformed Redis URL, in ``REDIS_URL`` or a command's ``--redis-url``, is one line naming
the setting and what it accepts, and exit 2, in every command: no traceback, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
BAD = ("http://localhost:6379", "not-a-url", "redis://localhost:6379/99")
ACCEPTS = "redis://[:password@]host[:port][/db] (rediss:// for TLS, unix:///path.sock), db 0-15"
COMMANDS = {
    "serve": ["serve", "--port", "0"],
    "listen": ["listen"],
    "reconcile": ["reconcile"],
    "worker": ["worker", "--task-queue-id", "p/w", "--worker-group", "g", "--worker-id", "w"],
    "emulator": ["emulator", "--port", "0"],
    "enforce": ["enforce"],
    "replay": ["replay", "--hours", "1"],
    "demo": ["demo", "--port", "0", "--emulator-port", "0"],
}

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_")) and k != "REDIS_URL"
    }
    return subprocess.run(
        [str(BIN / "coalescer"), *argv],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("url", BAD)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_malformed_redis_url_setting_is_one_line_and_exit_2(command: str, url: str) -> None:
    done = run(COMMANDS[command], REDIS_URL=url)
    assert done.returncode == 2, done
    assert done.stderr == f"coalescer: REDIS_URL must be {ACCEPTS}, not {url!r}\n", done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize("url", BAD)
@pytest.mark.parametrize("command", ["replay", "demo"])
def test_a_malformed_redis_url_flag_is_one_line_and_exit_2(command: str, url: str) -> None:
    done = run([*COMMANDS[command], "--redis-url", url])
    assert done.returncode == 2, done
    assert done.stderr == f"coalescer: --redis-url must be {ACCEPTS}, not {url!r}\n", done.stderr
    assert done.stdout == ""


def test_a_password_in_a_malformed_url_is_not_printed() -> None:
    done = run(COMMANDS["serve"], REDIS_URL="http://:s3cret@localhost:6379")
    assert done.returncode == 2 and "s3cret" not in done.stderr, done.stderr
