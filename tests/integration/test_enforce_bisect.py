"""``on-primary-failure: bisect`` end to end, in real processes: ``coalescer emulator`` (a
current queue) posting its messages to ``coalescer serve`` (on Redis), ``coalescer enforce``
under a policy file, and a reference ``coalescer worker`` that runs whatever it claims.

Nine pushes of one key land while no worker runs, their commands failing from push 5 on; the
enforcer holds the eight older ones for the newest. The worker runs the newest, which fails:
the enforcer releases a few held pushes, one at a time, for the worker to run, locates push 5
as the culprit and push 4 as the last good, and supersedes every other push by the run whose
result stands for it.

With ``bisect-confirm: 1`` every failure the search would narrow on is first run again
(``rerunTask``); push 4's first run fails intermittently (its command fails once, leaving a
marker behind), its rerun passes: the search does not blame it.

With every field at its default (``bisect-parallel`` 2, failures confirmed as the key's flake
rate asks), the search runs two at a time, in fewer rounds than runs, and every probe waits for
its worker at priority ``highest``. And when no push is broken but the newest push's first run
fails (a flaky task), the primary's rerun passes: the verdict is *flaky*, nobody is blamed, and
the primary's passing run stands for every victim that did not run.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import taskcluster

from coalescer.bisection import max_runs
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
    bisect-parallel: 1
"""
#: Every field of ``bisect`` at its default: bisect-parallel 2, bisect-confirm 3, confidence 0.99.
DEFAULTS = f"""\
rules:
  - name: bisect
    keys: {KEY}
    strategy: latest-wins
    on-primary-failure: bisect
"""
#: The push whose first run fails intermittently, with bisect-confirm 1.
FLAKY = 4
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
    """Poll ``check`` (a function returning a bool, run in a thread, or a coroutine function)
    until true."""
    give_up = time.monotonic() + within

    async def holds() -> bool:
        if inspect.iscoroutinefunction(check):
            return bool(await check())
        return bool(await asyncio.to_thread(check))

    while not await holds():
        procs.check_alive()
        if time.monotonic() > give_up:
            logs = {n: procs.output(n)[-2500:] for n in procs.procs}
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}: {logs}")
        await asyncio.sleep(0.1)


def definition(
    push: int,
    created: str,
    marker: Path | None = None,
    *,
    first_bad: int = FIRST_BAD,
    flaky: int = FLAKY,
) -> dict[str, Any]:
    """Push ``push``'s task: its command fails from ``first_bad`` on; with ``marker``,
    push ``flaky``'s also fails while ``marker`` does not exist, creating it."""
    script = f'echo "push $PUSH"; test "$PUSH" -lt {first_bad}'
    env = {"PUSH": str(push)}
    if marker is not None and push == flaky:
        script = f'if [ ! -e "$MARKER" ]; then touch "$MARKER"; exit 1; fi; {script}'
        env["MARKER"] = str(marker)
    return {
        "taskQueueId": QUEUE,
        "created": created,
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"{PREFIX}.{KEY}"],
        "tags": {"push": str(push)},
        "payload": {
            "command": ["sh", "-c", script],
            "env": env,
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
    await end_to_end(store, redis_url, tmp_path, POLICY, scenario)


async def test_the_enforcer_confirms_failures_and_does_not_blame_an_intermittent_one(
    store: Store, redis_url: str, tmp_path: Path
) -> None:
    policy = POLICY.replace("bisect-confirm: 0", "bisect-confirm: 1")
    await end_to_end(store, redis_url, tmp_path, policy, confirmed_scenario)


async def test_with_the_defaults_probes_run_at_once_at_the_highest_priority(
    store: Store, redis_url: str, tmp_path: Path
) -> None:
    await end_to_end(store, redis_url, tmp_path, DEFAULTS, parallel_scenario)


async def test_a_failure_that_does_not_come_back_is_flaky_and_blames_nobody(
    store: Store, redis_url: str, tmp_path: Path
) -> None:
    await end_to_end(store, redis_url, tmp_path, DEFAULTS, flaky_scenario)


Scenario = Callable[[Processes, Store, str, str, int, int, Path], Awaitable[None]]


async def end_to_end(
    store: Store, redis_url: str, tmp_path: Path, policy: str, play: Scenario
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy)
    procs = Processes(environment(redis_url, root, policy_file), tmp_path)
    try:
        started = time.monotonic()
        await play(procs, store, root, service, queue_port, web_port, tmp_path)
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


async def bisected(
    procs: Processes,
    store: Store,
    root: str,
    service: str,
    queue_port: int,
    web_port: int,
    marker: Path | None = None,
    *,
    first_bad: int = FIRST_BAD,
    flaky: int = FLAKY,
) -> tuple[Callable[[str], list[dict[str, Any]]], list[str]]:
    """The processes, the pushes held for the newest, a worker, and the bisection over: each
    task's runs, and the pushes' taskIds (oldest first)."""
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
        queue.createTask(
            task_id, definition(push, created, marker, first_bad=first_bad, flaky=flaky)
        )
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

    async def drained() -> bool:
        # The last queue calls are acknowledged in the store just after the queue saw them.
        return (await outbox.outstanding(store, [KEY]))[KEY] == (0, 0)

    await until(drained, procs, 30, "nothing left held, searched or to do")
    return runs, ids


async def scenario(
    procs: Processes,
    store: Store,
    root: str,
    service: str,
    queue_port: int,
    web_port: int,
    tmp_path: Path,
) -> None:
    runs, ids = await bisected(procs, store, root, service, queue_port, web_port)
    victims, primary = ids[:-1], ids[-1]

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


async def confirmed_scenario(
    procs: Processes,
    store: Store,
    root: str,
    service: str,
    queue_port: int,
    web_port: int,
    tmp_path: Path,
) -> None:
    marker = tmp_path / f"push-{FLAKY}.flaked"
    runs, ids = await bisected(procs, store, root, service, queue_port, web_port, marker)
    victims, primary = ids[:-1], ids[-1]
    assert marker.exists()

    def results(task_id: str) -> list[tuple[str, str]]:
        return [(r["state"], r["reasonResolved"]) for r in runs(task_id)]

    # The primary's failure came back when it ran again.
    assert results(primary) == [("failed", "failed"), ("failed", "failed")]
    shutdown = ("exception", "worker-shutdown")
    # Push 4, probed first, failed and passed when it ran again: intermittent, a good push.
    flaky = victims[FLAKY - 1]
    assert results(flaky) == [shutdown, ("failed", "failed"), ("completed", "completed")]
    ran = [t for t in victims if len(runs(t)) > 1]
    culprit = victims[FIRST_BAD - 1]
    assert culprit in ran and flaky in ran
    for task_id in ran:
        push = ids.index(task_id) + 1
        if push >= FIRST_BAD:  # failed, and failed again
            assert results(task_id) == [shutdown, ("failed", "failed"), ("failed", "failed")]
        elif task_id != flaky:
            assert results(task_id) == [shutdown, ("completed", "completed")]
    extra = sum(len(runs(t)) - 1 for t in ran) + len(runs(primary)) - 1
    assert extra <= max_runs(8, 1)  # the bound with confirmations: 1 + 2 * 4

    # Every other push is superseded by the run whose result stands for it.
    good = flaky  # push 4: its rerun passed
    async with httpx.AsyncClient(timeout=10) as http:
        for i, task_id in enumerate(victims):
            if task_id in ran:
                continue
            stand_in = good if i < FLAKY - 1 else culprit
            [run] = runs(task_id)
            assert (run["state"], run["reasonResolved"]) == ("exception", "canceled"), task_id
            response = await http.get(
                f"{root}/emulator/v1/blobs/{task_id}/0/public/superseded-by.json"
            )
            assert response.raise_for_status().json() == {"taskId": stand_in, "runId": 2}

        answer = (await http.get(f"{service}/v1/tasks/{flaky}")).raise_for_status().json()
    [finding] = answer["bisection"]
    assert finding["role"] == "lastGood"
    assert finding["culprit"] == {"taskId": culprit, "runId": 2}
    assert finding["lastGood"] == {"taskId": flaky, "runId": 2}
    assert finding["intermittent"] == [{"taskId": flaky, "runId": 1}]
    assert finding["extraRuns"] == extra
    attempts = [(r["taskId"], r["runId"], r["attempt"], r["passed"]) for r in finding["runs"]]
    assert attempts[:4] == [
        (primary, 0, 0, False),
        (primary, 1, 1, False),
        (flaky, 1, 0, False),
        (flaky, 2, 1, True),
    ]
    log = procs.output("enforce")
    assert "culprit located: task " + culprit in log
    assert "1 intermittent" in log


async def parallel_scenario(
    procs: Processes,
    store: Store,
    root: str,
    service: str,
    queue_port: int,
    web_port: int,
    tmp_path: Path,
) -> None:
    """The defaults: two runs at once, failures confirmed as the key's flake rate (the prior's
    5%: one confirmation) asks, every probe moved to the front of its task queue."""
    runs, ids = await bisected(procs, store, root, service, queue_port, web_port)
    victims, primary = ids[:-1], ids[-1]
    queue = taskcluster.Queue({"rootUrl": root})

    def results(task_id: str) -> list[tuple[str, str]]:
        return [(r["state"], r["reasonResolved"]) for r in runs(task_id)]

    failed, shutdown = ("failed", "failed"), ("exception", "worker-shutdown")
    assert results(primary) == [failed, failed]  # its failure came back
    ran = [t for t in victims if len(runs(t)) > 1]
    culprit, good = victims[FIRST_BAD - 1], victims[FIRST_BAD - 2]
    assert {culprit, good} <= set(ran)
    for task_id in ran:
        push = ids.index(task_id) + 1
        # Released by the enforcer, run by the worker; a failure run once more.
        want = [shutdown, failed, failed] if push >= FIRST_BAD else [shutdown, ("completed",) * 2]
        assert results(task_id) == want, (push, results(task_id))
        assert runs(task_id)[0]["workerGroup"] == "coalescer"
        # Raised while its released run waited: a task's priority changes only unresolved.
        assert queue.task(task_id)["priority"] == "highest", push
    for task_id in victims:
        if task_id not in ran:  # held, never run: as created
            assert queue.task(task_id)["priority"] == "lowest"

    async with httpx.AsyncClient(timeout=10) as http:
        for i, task_id in enumerate(victims):
            if task_id in ran:
                continue
            stand_in = good if i < FIRST_BAD - 2 else culprit
            [run] = runs(task_id)
            assert (run["state"], run["reasonResolved"]) == ("exception", "canceled"), task_id
            response = await http.get(
                f"{root}/emulator/v1/blobs/{task_id}/0/public/superseded-by.json"
            )
            last = len(runs(stand_in)) - 1
            assert response.raise_for_status().json() == {"taskId": stand_in, "runId": last}

        answer = (await http.get(f"{service}/v1/tasks/{culprit}")).raise_for_status().json()
    [finding] = answer["bisection"]
    assert finding["verdict"] == "culprit" and finding["role"] == "culprit"
    assert finding["culprit"] == {"taskId": culprit, "runId": 2}
    assert finding["lastGood"] == {"taskId": good, "runId": 1}
    assert finding["probability"] >= 0.99
    extra = sum(len(runs(t)) - 1 for t in ids)
    assert finding["extraRuns"] == extra
    # Runs at once share a round: fewer rounds than runs, and no more than one run at a time
    # would have taken (ceil(log2(9)) = 4, each failure confirmed).
    assert 1 <= finding["rounds"] < finding["extraRuns"]
    assert finding["rounds"] <= 4
    assert "culprit located: task " + culprit in procs.output("enforce")


async def flaky_scenario(
    procs: Processes,
    store: Store,
    root: str,
    service: str,
    queue_port: int,
    web_port: int,
    tmp_path: Path,
) -> None:
    """No push is broken; the newest push's first run fails (a flaky task), its rerun passes:
    the search concludes *flaky*, names no culprit, and the primary's passing run stands for
    every victim that did not run."""
    marker = tmp_path / "newest.flaked"
    runs, ids = await bisected(
        procs,
        store,
        root,
        service,
        queue_port,
        web_port,
        marker,
        first_bad=PUSHES + 1,
        flaky=PUSHES,
    )
    victims, primary = ids[:-1], ids[-1]
    assert marker.exists()
    queue = taskcluster.Queue({"rootUrl": root})

    def results(task_id: str) -> list[tuple[str, str]]:
        return [(r["state"], r["reasonResolved"]) for r in runs(task_id)]

    completed = ("completed", "completed")
    assert results(primary) == [("failed", "failed"), completed]
    # The defaults run one probe beside the primary's confirmation; it runs for itself.
    ran = [t for t in victims if len(runs(t)) > 1]
    assert len(ran) <= 1
    for task_id in ran:
        assert results(task_id) == [("exception", "worker-shutdown"), completed]
        assert queue.task(task_id)["priority"] == "highest"

    async with httpx.AsyncClient(timeout=10) as http:

        async def blob(task_id: str, name: str) -> httpx.Response:
            response = await http.get(f"{root}/emulator/v1/blobs/{task_id}/0/{name}")
            return response.raise_for_status()

        superseded = [t for t in victims if t not in ran]
        assert len(superseded) >= PUSHES - 2
        for task_id in superseded:
            [run] = runs(task_id)
            assert (run["state"], run["reasonResolved"]) == ("exception", "canceled"), task_id
            linked = (await blob(task_id, "public/superseded-by.json")).json()
            assert linked == {"taskId": primary, "runId": 1}
            text = (await blob(task_id, "public/logs/live_backing.log")).text
            assert "whose failure did not come back when it ran again" in text, text

        answer = (await http.get(f"{service}/v1/tasks/{primary}")).raise_for_status().json()
    [finding] = answer["bisection"]
    assert finding["verdict"] == "flaky"
    assert finding["culprit"] is None and finding["suspect"] is None
    assert finding["lastGood"] is None
    assert finding["intermittent"] == [{"taskId": primary, "runId": 0}]
    stood = {s["taskId"]: s["by"] for s in finding["standsFor"]}
    assert stood == {t: {"taskId": primary, "runId": 1} for t in superseded}
    log = procs.output("enforce")
    assert f"bisection after {primary}: flaky, no push to blame" in log
    assert "culprit located" not in log
