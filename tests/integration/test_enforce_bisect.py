"""``on-primary-failure: bisect`` end to end, in real processes: ``coalescer emulator`` (a
current queue) posting its messages to ``coalescer serve`` (on Redis), ``coalescer enforce``
under a policy file, and a reference ``coalescer worker`` that runs whatever it claims.

Nine pushes of one key land while no worker runs, their commands failing from push 5 on; the
enforcer holds the eight older ones for the newest. The worker runs the newest, which fails:
the enforcer releases a few held pushes, one at a time, for the worker to run, locates push 5
as the culprit and push 4 as the last good, and supersedes every other push by the run whose
result stands for it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import taskcluster

from coalescer.store import Store
from coalescer.store import policy as outbox
from tests.integration.test_e2e import Processes
from tests.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

KEY = "build.linux"
PREFIX = "coalesce.v1"
QUEUE = "bisect/worker"
TOKEN = "s3cret"
PUSHES = 9
FIRST_BAD = 5
POLICY = f"""\
rules:
  - name: bisect
    keys: {KEY}
    strategy: latest-wins
    on-primary-failure: bisect
    bisect-confirm: 0
"""
RESOLVED = ("completed", "failed", "exception")


def environment(redis_url: str, root: str, policy_file: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_")) and k != "REDIS_URL"
    }
    env.update(
        REDIS_URL=redis_url,
        COALESCER_INGEST_TOKEN=TOKEN,
        COALESCER_POLICY_FILE=str(policy_file),
        COALESCER_ROUTE_PREFIX=PREFIX,
        COALESCER_RANK_TAG="push",
        COALESCER_LOG_FORMAT="text",
        TASKCLUSTER_ROOT_URL=root,
        TASKCLUSTER_CLIENT_ID="bisect-e2e",
        TASKCLUSTER_ACCESS_TOKEN="no-secret",
    )
    return env


async def until(check: Any, procs: Processes, within: float, what: str) -> None:
    """Poll ``check`` (a function returning a bool, run in a thread) until true."""
    give_up = time.monotonic() + within
    while not await asyncio.to_thread(check):
        procs.check_alive()
        if time.monotonic() > give_up:
            logs = {n: procs.output(n)[-2500:] for n in procs.procs}
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}: {logs}")
        await asyncio.sleep(0.1)


def definition(push: int, created: str) -> dict[str, Any]:
    return {
        "taskQueueId": QUEUE,
        "created": created,
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"{PREFIX}.{KEY}"],
        "tags": {"push": str(push)},
        "payload": {
            "command": ["sh", "-c", f'echo "push $PUSH"; test "$PUSH" -lt {FIRST_BAD}'],
            "env": {"PUSH": str(push)},
            "maxRunTime": 60,
        },
        "metadata": {
            "name": KEY,
            "description": "bisect end to end",
            "owner": "e2e@example.com",
            "source": "http://example.com/bisect",
        },
    }


async def test_the_enforcer_bisects_a_failed_primary_on_a_real_queue(
    store: Store, redis_url: str, tmp_path: Path
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    procs = Processes(environment(redis_url, root, policy_file), tmp_path)
    try:
        started = time.monotonic()
        await scenario(procs, store, root, service, queue_port, web_port)
        assert time.monotonic() - started < 90
    finally:
        codes = procs.stop()
    # uvicorn re-raises the SIGTERM it handled once shut down: the servers may end with -15.
    failed = {
        n: (c, procs.output(n)[-3000:])
        for n, c in codes.items()
        if c != 0 and not (n in ("serve", "emulator") and c == -signal.SIGTERM)
    }
    assert not failed, failed


async def scenario(
    procs: Processes, store: Store, root: str, service: str, queue_port: int, web_port: int
) -> None:
    procs.start("serve", "serve", "--port", str(web_port))
    procs.start("enforce", "enforce", "--poll", "0.2")

    def answers(url: str) -> bool:
        try:
            return httpx.get(url, timeout=5).status_code < 500
        except httpx.TransportError:
            return False

    await until(lambda: answers(f"{service}/__lbheartbeat__"), procs, 30, "serve")
    procs.start(
        "emulator",
        "emulator",
        "--port",
        str(queue_port),
        "--publish-to",
        f"{service}/v1/events",
        "--claim-work-timeout",
        "1",
    )
    await until(lambda: answers(f"{root}/api/queue/v1/ping"), procs, 30, "the emulator")
    queue = taskcluster.Queue(
        {"rootUrl": root, "credentials": {"clientId": "bisect-e2e", "accessToken": "x"}}
    )

    def runs(task_id: str) -> list[dict[str, Any]]:
        return list(queue.status(task_id)["status"]["runs"])

    # The pushes, while no worker runs: ids in creation order, so that every order agrees.
    ids = sorted(taskcluster.slugid.nice() for _ in range(PUSHES))
    created = taskcluster.stringDate(taskcluster.fromNow("0 seconds"))
    for push, task_id in enumerate(ids, start=1):
        queue.createTask(task_id, definition(push, created))
    victims, primary = ids[:-1], ids[-1]

    def held() -> bool:
        return all(
            [(r["state"], r.get("workerGroup")) for r in runs(t)] == [("running", "coalescer")]
            for t in victims
        ) and [r["state"] for r in runs(primary)] == ["pending"]

    await until(held, procs, 30, "the enforcer to hold the eight older pushes")

    procs.start(
        "worker",
        "worker",
        "--task-queue-id",
        QUEUE,
        "--worker-group",
        "e2e",
        "--worker-id",
        "w1",
    )

    def over() -> bool:
        if not all(runs(t)[-1]["state"] in RESOLVED for t in ids):
            return False
        response = httpx.get(f"{service}/v1/tasks/{primary}", timeout=5)
        return response.status_code == 200 and bool(response.json().get("bisection"))

    await until(over, procs, 60, "the bisection to end and every push to be resolved")
    assert (await outbox.outstanding(store, [KEY]))[KEY] == (0, 0)  # nothing held or searched

    # The primary ran once and failed; the victims that ran were released once and ran.
    assert [(r["state"], r["reasonResolved"]) for r in runs(primary)] == [("failed", "failed")]
    ran = [t for t in victims if len(runs(t)) > 1]
    assert len(ran) <= 4  # ceil(log2(8 + 1)) runs beyond the primary's
    culprit, good = victims[FIRST_BAD - 1], victims[FIRST_BAD - 2]
    assert {culprit, good} <= set(ran)
    for task_id in ran:
        first, second = runs(task_id)
        assert (first["state"], first["reasonResolved"]) == ("exception", "worker-shutdown")
        assert first["workerGroup"] == "coalescer"
        assert (second["runId"], second["workerGroup"]) == (1, "e2e")
        push = ids.index(task_id) + 1
        assert second["state"] == ("completed" if push < FIRST_BAD else "failed")

    # Every other push is superseded by the run whose result stands for it.
    async with httpx.AsyncClient(timeout=10) as http:

        async def blob(task_id: str, name: str) -> httpx.Response:
            response = await http.get(f"{root}/emulator/v1/blobs/{task_id}/0/{name}")
            return response.raise_for_status()

        for i, task_id in enumerate(victims):
            if task_id in ran:
                continue
            stand_in = good if i < FIRST_BAD - 2 else culprit
            assert i != FIRST_BAD - 2 and i != FIRST_BAD - 1
            [run] = runs(task_id)
            # A current queue refuses reason 'superseded': canceled, with its link.
            assert (run["state"], run["reasonResolved"]) == ("exception", "canceled"), task_id
            linked = (await blob(task_id, "public/superseded-by.json")).json()
            assert linked == {"taskId": stand_in, "runId": 1}, (i, linked)
            text = (await blob(task_id, "public/logs/live_backing.log")).text
            role = "the last good push" if stand_in == good else "the culprit"
            assert f"{stand_in} is {role}" in text, text
            assert f"bisection after {primary} failed" in text, text

        answer = (await http.get(f"{service}/v1/tasks/{culprit}")).raise_for_status().json()
    [finding] = answer["bisection"]
    assert finding["role"] == "culprit"
    assert finding["culprit"] == {"taskId": culprit, "runId": 1}
    assert finding["lastGood"] == {"taskId": good, "runId": 1}
    assert finding["primary"] == {"taskId": primary, "runId": 0}
    assert finding["held"] == 8 and finding["extraRuns"] == len(ran)
    assert {r["taskId"] for r in finding["runs"]} == {primary, *ran}
    assert "culprit located: task " + culprit in procs.output("enforce")
