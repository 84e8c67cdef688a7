"""Enforcers side by side, and an enforcer killed in the middle of its outbox."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coalescer.emulator import endpoints
from coalescer.emulator.app import Call
from coalescer.emulator.model import QueueError
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.errors import StoreUnavailable
from coalescer.policy.rules import Policy
from coalescer.store import policy as outbox
from tests.policy.support import Loop, eventually, rule

pytestmark = pytest.mark.integration

KEYS = [f"k.{n}" for n in range(6)]


@pytest.fixture
def policy() -> Policy:
    return rule("k.*", strategy="latest-wins")


def superseded_once(loop: Loop, victims: list[list[str]], newest: dict[str, str]) -> None:
    for key, tasks in zip(KEYS, victims, strict=False):
        for task_id in tasks:
            exceptions = loop.em.messages("task-exception", task_id)
            assert [m["payload"]["status"]["runs"][-1]["reasonResolved"] for m in exceptions] == [
                "superseded"
            ]
            assert loop.artifact(task_id, 0, "public/superseded-by.json")["taskId"] == newest[key]


async def test_two_enforcers_split_the_keys_and_act_once_per_victim(loop: Loop) -> None:
    victims: list[list[str]] = []
    newest: dict[str, str] = {}
    for key in KEYS:
        victims.append([loop.create(key) for _ in range(3)])
        newest[key] = loop.create(key)
    await loop.feed()
    done = [0, 0]
    async with loop.enforcer("one") as one, loop.enforcer("two") as two:
        give_up = time.monotonic() + 20
        while True:
            await loop.feed()
            counts = await asyncio.gather(one.round(), two.round())
            done = [a + b for a, b in zip(done, counts, strict=True)]
            if not any(counts) and not await loop.store.client.zcard("co:outbox"):
                break
            assert time.monotonic() < give_up
    assert sum(done) == 3 * len(KEYS)
    superseded_once(loop, victims, newest)


class Gate:
    """Holds the emulator's reportException for one task until released, then fails it as if
    the request had never arrived: the enforcer that sent it is killed meanwhile."""

    def __init__(self) -> None:
        self.task_id = ""
        #: False: once released, the held call goes through (a slow queue, nobody killed)
        self.fail = True
        self.reached = threading.Event()
        self.released = threading.Event()
        self._real = endpoints.HANDLERS["reportException"]

    async def handler(self, call: Call) -> Any:
        if call.task_id == self.task_id and not self.reached.is_set():
            self.reached.set()
            while not self.released.is_set():  # noqa: ASYNC110 (the release comes from a thread)
                await asyncio.sleep(0.01)
            if self.fail:
                raise QueueError("InternalServerError", "the enforcer was killed before this")
        return await self._real(call)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setitem(endpoints.HANDLERS, "reportException", g.handler)
    yield g
    g.released.set()


@pytest.fixture
def queue_emulator_options(gate: Gate, queue_emulator_options: EmulatorOptions) -> EmulatorOptions:
    return queue_emulator_options  # the gate is in place before the emulator's app is built


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "coalescer.cli", *args], env=env, stdout=out, stderr=out
        )


async def test_a_killed_enforcer_s_outbox_is_resumed_and_nothing_is_done_twice(
    loop: Loop, gate: Gate, redis_url: str, tmp_path: Path
) -> None:
    victims = [loop.create("k.0") for _ in range(3)]
    newest = loop.create("k.0")
    await loop.feed()
    gate.task_id = victims[1]
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("rules: [{keys: 'k.*', strategy: latest-wins}]\n")
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "TASKCLUSTER_ROOT_URL": loop.em.root_url,
        "TASKCLUSTER_CLIENT_ID": "enforcer",
        "TASKCLUSTER_ACCESS_TOKEN": "no-secret",
        "COALESCER_POLICY_FILE": str(policy_file),
        "COALESCER_LOG_FORMAT": "text",
    }
    args = ["enforce", "--consumer", "doomed", "--lease", "1", "--poll", "0.05"]
    proc = spawn(args, env, tmp_path / "enforcer.log")
    try:
        reached = await asyncio.to_thread(gate.reached.wait, 30)
        assert reached, (tmp_path / "enforcer.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)  # mid-action: claimed, artifact up, not resolved
    finally:
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
    gate.released.set()
    half_done = loop.last_run(victims[1])
    assert (half_done["state"], half_done["workerId"]) == ("running", "enforcer")
    pending = await loop.store.client.xpending("co:{k.0}:o", "enforce")
    assert pending["pending"] >= 1  # the killed enforcer's entries, unacknowledged

    async def drained() -> bool:
        await loop.feed()
        async with loop.enforcer("rescuer") as rescuer:
            await rescuer.round()
        return await loop.store.client.xlen("co:{k.0}:o") == 0

    await eventually(drained, within=15)  # once the dead enforcer's 1 s lease has expired
    superseded_once(loop, [victims], {"k.0": newest})
    pending = await loop.store.client.xpending("co:{k.0}:o", "enforce")
    assert pending["pending"] == 0


async def test_a_key_whose_store_fails_leaves_no_other_key_s_action_running_into_the_next_round(
    loop: Loop, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a Redis Cluster a failover fails one key's store calls (StoreUnavailable) while the
    # other keys' rounds go on. The round must end with them, or the next round (the same
    # consumer, so the same lease) takes their pending entries again and acts a second time:
    # the soak's runs canceled twice.
    slow = loop.create("k.0")
    newest = loop.create("k.0")
    loop.create("k.1")
    loop.create("k.1")
    await loop.feed()
    gate.task_id, gate.fail = slow, False
    read = outbox.read
    failures = 0

    async def failing(store: Any, key: str, consumer: str, **options: Any) -> Any:
        nonlocal failures
        if key == "k.1" and not gate.released.is_set():
            failures += 1
            raise StoreUnavailable("Redis is moved: 1 127.0.0.1:1", reason="moved")
        return await read(store, key, consumer, **options)

    monkeypatch.setattr(outbox, "read", failing)

    async def release_later() -> None:
        assert await asyncio.to_thread(gate.reached.wait, 10)

        async def k1_failed() -> bool:
            return failures > 0

        await eventually(k1_failed, within=15)
        # Not a wait for something, a window: an enforcer that ended the round with k.1's error
        # would start new ones (every 0.02 s poll) and take k.0's pending entry again in it.
        await asyncio.sleep(0.5)
        gate.released.set()

    async def drained() -> bool:
        await loop.feed()
        return not await loop.store.client.zcard("co:outbox") and gate.released.is_set()

    stop = asyncio.Event()
    async with loop.enforcer() as enforcer:
        running = asyncio.create_task(enforcer.run(stop))
        try:
            await release_later()
            await eventually(drained, within=15)
        finally:
            stop.set()
            await running
    superseded_once(loop, [[slow]], {"k.0": newest})
