"""The replay is honest: a small history run end to end (the queue emulator, as a current queue
that refuses reason ``superseded``, ``coalescer listen`` and ``serve``, two real ``coalescer
worker`` processes) and the same history, read back from the queue, replayed under the same
protocol with the same two workers: the same tasks run, and each superseded task (canceled on
the queue, with its ``superseded-by.json``) is superseded by the same task. Replayed without
superseding, every task runs, and no held run sized the pool.

The history is chosen so that the outcome does not hang on which of two simultaneous claims
wins: a burst of three keys lands while no worker runs; one key's tasks run for seconds, the
others' for a fraction of a second, so that one worker is busy while the other drains the rest.

The same check runs under a policy file (one key latest-wins, one first-wins, one left on
claim) with the real ``coalescer enforce`` carrying the decisions out on the emulator, and the
replay given the same file. The workers start once the enforcer is done, so the enforcer's lag
(its poll, the queue calls), which the replay does not model, cannot change what runs. What
may differ is only the *direct* primary of a victim: the live loop hears the burst's events one
by one or in batches, and a victim's ``superseded-by.json`` names the end of the chain as the
enforcer knew it then; so both sides are compared by the chain's final primary.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import taskcluster

from coalescer.policy import rules
from coalescer.replay import sources
from coalescer.replay.history import History, peak_concurrency
from coalescer.replay.metrics import summarize
from coalescer.replay.pool import Outcome, State
from coalescer.replay.runner import Config, replay
from coalescer.store import Store, open_store
from tests.integration.test_e2e import (  # noqa: F401  (the fixture)
    Processes,
    _true,
    eventually,
    loop_environment,
    pulse_queue,
)
from tests.ports import free_port

pytestmark = pytest.mark.integration

QUEUE = "honest/worker"
#: Seconds each key's tasks run: one long, so that the other worker takes the rest.
KEYS = {"build.linux": 3.0, "build.mac": 0.2, "test.unit": 0.2}
PER_KEY = 4


async def test_replay_equals_the_end_to_end_run(
    redis_client: aioredis.Redis,
    redis_url: str,
    store: Store,
    amqp_url: str,
    pulse_queue: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    prefix = f"coalesce.honest{uuid.uuid4().hex[:8]}"
    env = loop_environment(redis_url, amqp_url, pulse_queue, prefix, root, "honest-worker")
    procs = Processes(env, tmp_path)
    try:
        queue, group, tasks = await run_end_to_end(procs, root, service, prefix, amqp_url)
        lived = await asyncio.to_thread(results, queue, root, tasks)
        history = await asyncio.to_thread(
            sources.from_task_groups,
            queue,
            [group],
            prefix=prefix,
            rank_tag="push",
            workers={QUEUE: 2},
        )
    finally:
        procs.stop()
    assert len(history.tasks) == len(tasks)
    check_recorded(history, lived)
    off, outcome = await replay(history, [Config(False), Config.parse("on-claim")], store)
    replayed = replayed_results(history, outcome)
    # Superseding happened, and the replay tells exactly what the real run did.
    assert sum(by is None for by in lived.values()) == len(KEYS)
    assert replayed == lived
    assert set(off.state) == {State.COMPLETED}


#: Under the policy: build.linux latest-wins, build.mac first-wins, test.unit on claim. Once
#: the enforcer is done, the pending tasks are, in the queue's order: mac's first, then test's
#: four, linux's last. The long task is mac's, so that while it runs the other worker claims
#: test's first, asks, and claims the other three before anyone else can take them.
POLICY_KEYS = {"build.linux": 0.2, "build.mac": 3.0, "test.unit": 0.2}
POLICY = """\
rules:
  - name: linux
    keys: build.linux
    strategy: latest-wins
  - name: mac
    keys: build.mac
    strategy: first-wins
"""


async def test_replay_under_a_policy_equals_the_end_to_end_run_with_the_enforcer(
    redis_client: aioredis.Redis,
    redis_url: str,
    amqp_url: str,
    pulse_queue: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    queue_port, web_port = free_port(), free_port()
    root, service = f"http://127.0.0.1:{queue_port}", f"http://127.0.0.1:{web_port}"
    prefix = f"coalesce.honest{uuid.uuid4().hex[:8]}"
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(POLICY)
    env = loop_environment(redis_url, amqp_url, pulse_queue, prefix, root, "honest-worker")
    env["COALESCER_POLICY_FILE"] = str(policy_file)
    procs = Processes(env, tmp_path)
    try:
        # One worker: two could both claim a task of the on-claim key, one before the other's
        # answer held it, as a loaded machine shows; the replay has that race, not its timing.
        queue, group, tasks = await run_end_to_end(
            procs, root, service, prefix, amqp_url, keys=POLICY_KEYS, enforce=True, workers=1
        )
        lived = await asyncio.to_thread(results, queue, root, tasks)
        history = await asyncio.to_thread(
            sources.from_task_groups,
            queue,
            [group],
            prefix=prefix,
            rank_tag="push",
            workers={QUEUE: 1},
        )
    finally:
        procs.stop()
    check_recorded(history, lived)
    config = Config.from_policy(rules.load(policy_file), policy_file.name)
    # The embedded store: a policy replay wants a database of its own.
    scratch = await open_store(None, grace_seconds=3600)
    try:
        off, outcome = await replay(history, [Config(False), config], scratch)
    finally:
        await scratch.close()
    assert set(off.state) == {State.COMPLETED}
    replayed = replayed_results(history, outcome)
    ids = [t.task_id for t in history.tasks]
    by_key = {key: [t for t in tasks if lived_key(history, t) == key] for key in POLICY_KEYS}
    # Per rule, as both sides have it: latest-wins keeps the newest push, first-wins the
    # oldest, the on-claim key's worker runs its newest after asking.
    assert {by_key["build.linux"][-1], by_key["build.mac"][0], by_key["test.unit"][-1]} == {
        t for t in tasks if lived[t] is None
    }
    assert final(replayed) == final(lived)
    report = summarize(history, config.name, outcome, None, rule_of=config.rule_for)
    assert (report.run, report.superseded, report.wrong_winners, report.lost) == (3, 9, 0, 0)
    assert {r.rule: r.superseded for r in report.rules} == {"linux": 3, "mac": 3, "default": 3}
    assert outcome.asked == 1  # only the on-claim key's worker asked
    # The worker time is the real runs' own: the same tasks ran, for their recorded time.
    real_ms = sum(t.duration_ms or 0 for t in history.tasks if lived[t.task_id] is None)
    assert outcome.worker_ms == real_ms
    assert {ids[i] for i, s in enumerate(outcome.state) if s == State.COMPLETED} == {
        t for t in tasks if lived[t] is None
    }


def check_recorded(history: History, lived: dict[str, str | None]) -> None:
    """The history read back knows which tasks were superseded (canceled on the queue, by a
    worker or by the enforcer), none as a person's cancel; a held run sized no pool."""
    assert {t.task_id for t in history.tasks if t.superseded_ms} == {
        task for task, by in lived.items() if by is not None
    }
    assert not any(t.canceled_ms or t.cascaded_ms for t in history.tasks)
    assert peak_concurrency(history.tasks)[QUEUE] in (1, 2)


def lived_key(history: History, task_id: str) -> str:
    [task] = [t for t in history.tasks if t.task_id == task_id]
    return task.keys[0]


def final(results: dict[str, str | None]) -> dict[str, str | None]:
    """Each task's final primary: the end of its chain of superseded-by links."""
    out: dict[str, str | None] = {}
    for task_id, by in results.items():
        seen = {task_id}
        while by is not None and results.get(by) is not None and by not in seen:
            seen.add(by)
            by = results[by]
        out[task_id] = by
    return out


def replayed_results(history: History, outcome: Outcome) -> dict[str, str | None]:
    """Each task: ``None`` if it ran in the replay, else the task that superseded it."""
    replayed: dict[str, str | None] = {}
    for i, task in enumerate(history.tasks):
        state, by = outcome.state[i], outcome.by[i]
        assert state in (State.COMPLETED, State.SUPERSEDED), (task.task_id, state)
        replayed[task.task_id] = history.tasks[by].task_id if state == State.SUPERSEDED else None
    return replayed


async def run_end_to_end(
    procs: Processes,
    root: str,
    service: str,
    prefix: str,
    amqp_url: str,
    *,
    keys: dict[str, float] = KEYS,
    enforce: bool = False,
    workers: int = 2,
) -> tuple[taskcluster.Queue, str, list[str]]:
    """The burst, run end to end by ``workers`` workers; with ``enforce``, under the
    environment's policy file, with ``coalescer enforce`` running, and the workers started once
    every decision was carried out."""
    queue_port, web_port = int(root.rsplit(":", 1)[1]), int(service.rsplit(":", 1)[1])
    procs.start("listen", "listen", "--declare-exchanges")
    procs.start("serve", "serve", "--port", str(web_port))
    if enforce:
        procs.start("enforce", "enforce", "--poll", "0.2")
    async with httpx.AsyncClient(timeout=10) as http:

        async def answers(url: str) -> bool:
            try:
                return (await http.get(url)).status_code < 500
            except httpx.TransportError:
                return False

        await eventually(lambda: answers(f"{service}/__lbheartbeat__"), procs, 30, "serve")
        await eventually(
            lambda: _true("consuming queue/" in procs.output("listen")), procs, 30, "listen"
        )
        procs.start("emulator", "emulator", "--port", str(queue_port), "--pulse-url", amqp_url)
        await eventually(lambda: answers(f"{root}/api/queue/v1/ping"), procs, 30, "emulator")
        queue = taskcluster.Queue(
            {"rootUrl": root, "credentials": {"clientId": "honest", "accessToken": "x"}}
        )
        # One creation time for the whole burst, and task ids in creation order: the replay
        # orders tasks of one instant by id, the queue by creation.
        ids = sorted(taskcluster.slugid.nice() for _ in range(PER_KEY * len(KEYS)))
        group = ids[0]
        created = taskcluster.stringDate(taskcluster.fromNow("0 seconds"))
        tasks = iter(ids)
        for push in range(PER_KEY):
            for key, seconds in keys.items():
                task_id = next(tasks)
                queue.createTask(
                    task_id, definition(key, push, prefix, service, created, group, seconds)
                )

        # Under the policy, each deciding key keeps one pending task.
        expected = PER_KEY + 2 if enforce else len(ids)

        async def indexed() -> bool:
            listed = 0
            for key in keys:
                body = (await http.get(f"{service}/{key.replace('.', '/')}")).json()
                listed += len(body.get("pending", []))
            return listed == expected

        await eventually(indexed, procs, 30, "the service to index the burst")
        if enforce:

            def enforced() -> bool:
                superseded = sum(queue.status(t)["status"]["state"] == "exception" for t in ids)
                return bool(superseded == 2 * (PER_KEY - 1))

            await eventually(
                lambda: asyncio.to_thread(enforced), procs, 60, "the enforcer's decisions"
            )
        for name in [f"w{n}" for n in range(1, workers + 1)]:
            procs.start(
                name,
                "worker",
                "--task-queue-id",
                QUEUE,
                "--worker-group",
                "honest",
                "--worker-id",
                name,
                "--superseder-allow",
                f"{service}/",
            )

        def all_resolved() -> bool:
            return all(
                queue.status(t)["status"]["state"] in ("completed", "failed", "exception")
                for t in ids
            )

        await eventually(lambda: asyncio.to_thread(all_resolved), procs, 60, "every task resolved")
    return queue, group, ids


def results(queue: taskcluster.Queue, root: str, tasks: list[str]) -> dict[str, str | None]:
    """Each task: ``None`` if it ran, else the task that superseded it (its artifact)."""
    out: dict[str, str | None] = {}
    for task_id in tasks:
        [run] = queue.status(task_id)["status"]["runs"]
        if run["reasonResolved"] == "completed":
            out[task_id] = None
        else:  # a current queue refuses reason 'superseded': canceled, with its link
            assert run["reasonResolved"] == "canceled", (task_id, run)
            blob = f"{root}/emulator/v1/blobs/{task_id}/0/public/superseded-by.json"
            out[task_id] = httpx.get(blob).raise_for_status().json()["taskId"]
    return out


def definition(
    key: str, push: int, prefix: str, service: str, created: str, group: str, seconds: float
) -> dict[str, Any]:
    return {
        "taskQueueId": QUEUE,
        "taskGroupId": group,
        "created": created,
        "deadline": taskcluster.stringDate(taskcluster.fromNow("1 hour")),
        "routes": [f"{prefix}.{key}"],
        "tags": {"push": str(push)},
        "payload": {
            "command": ["sh", "-c", f'echo "ran $TASK_ID"; sleep {seconds}'],
            "maxRunTime": 60,
            "supersederUrl": f"{service}/{key.replace('.', '/')}",
        },
        "metadata": {
            "name": key,
            "description": "honest",
            "owner": "e@example.com",
            "source": service,
        },
    }
