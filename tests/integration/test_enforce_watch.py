"""``coalescer enforce`` as a real process says in its log when the index store is emptied under
it, as ``serve`` and ``listen`` do: the decisions waiting in its outboxes are lost with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.store import keys

BIN = Path(sys.executable).parent
EMPTIED = "the index store was emptied"

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def enforce(
    tmp_path: Path, redis_url: str, redis_client: Any, queue_emulator: QueueEmulator
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    policy = tmp_path / "policy.yaml"
    policy.write_text("rules:\n  - name: all\n    keys: '*'\n    strategy: latest-wins\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_")) and k != "REDIS_URL"
    }
    env.update(
        REDIS_URL=redis_url,
        COALESCER_POLICY_FILE=str(policy),
        COALESCER_LOG_FORMAT="text",
        TASKCLUSTER_ROOT_URL=queue_emulator.root_url,
        TASKCLUSTER_CLIENT_ID="enforcer",
        TASKCLUSTER_ACCESS_TOKEN="no-secret",
        PYTHONUNBUFFERED="1",
    )
    log = tmp_path / "enforce.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "coalescer"), "enforce", "--poll", "0.2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=20)


def _wait(check: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log.read_text()}"
        time.sleep(0.1)


async def test_enforce_says_when_the_index_store_is_emptied(
    enforce: tuple[subprocess.Popen[bytes], Path], redis_client: Any
) -> None:
    proc, log = enforce

    def marker() -> bool:
        return log.read_text().count("holds no marker") >= 1

    # Its first look at a new store marks it (and says so).
    _wait(marker, "enforce's first look at the store", proc, log)
    assert await redis_client.exists(keys.INDEX_STATE)
    await redis_client.flushdb()
    _wait(lambda: EMPTIED in log.read_text(), "enforce to say the index was emptied", proc, log)
    lines = [line for line in log.read_text().splitlines() if EMPTIED in line]
    assert len(lines) == 1 and " ERROR " in lines[0], lines
    assert "coalescer reconcile --rebuild" in lines[0]
