"""End to end: the graphs real taskgraph generates for five pushes of the example project,
submitted to the queue emulator as decision tasks submit them, are superseded as the policy and
the workers say. Builds (docker-worker, unmodified) supersede on claim through their
supersederUrl; tests (generic-worker, route only) are superseded on arrival by the enforcer
under a latest-wins rule; signing is never touched. The newest push's task of every key runs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from coalescer.emulator.harness import QueueEmulator
from coalescer.policy.rules import Policy
from coalescer.store import Store
from tests.policy.support import Loop, policy
from tests.taskgraph.support import Project, routes, submit
from tests.worker.support import DockerWorkerRules

pytestmark = pytest.mark.integration

PUSHES = 5
SCHEDULER = "example-level-3"
BUILDS, TESTS, SIGNING = (
    "example-3/b-linux",
    "example-t/t-win",
    "scriptworker-k8s/example-3-signing",
)
WORKER = {"workerGroup": "example", "workerId": "w1"}
POLICY = """
rules:
  - name: tests
    keys: "example-ci.test.**"
    strategy: latest-wins
"""


@pytest.fixture
def rules() -> Policy:
    return policy(POLICY)


async def test_five_pushes_the_newest_of_each_key_runs(
    tmp_path: Path, queue_emulator: QueueEmulator, store: Store, service: str, rules: Policy
) -> None:
    em = queue_emulator
    project = Project(tmp_path / "example")
    project.configure(url=service)
    graphs = await asyncio.gather(
        *(asyncio.to_thread(project.generate, push, graph="morphed") for push in range(1, 6))
    )
    # The same keys in every push, and none on signing.
    by_label = [{e["label"]: e for e in g.values()} for g in graphs]
    keys = routes(by_label[0])
    assert all(routes(labels) == keys for labels in by_label)
    assert keys["signing-linux64"] == []

    # Each push: a decision task that creates its graph, then completes.
    pushed: dict[str, tuple[int, str]] = {}  # taskId -> (push, label)
    for push, graph in enumerate(graphs, 1):
        em.clock.advance(60)
        decision = em.create_task(taskQueueId="example-3/decision", schedulerId=SCHEDULER)
        claim = em.queue().claimTask(decision, "0", WORKER)
        created = submit(
            em.queue(), graph, decision=decision, scheduler=SCHEDULER, now=em.clock.now()
        )
        pushed |= {task_id: (push, label) for task_id, label in created.items()}
        em.queue(claim["credentials"]).reportCompleted(decision, "0")
        em.clock.advance(0)  # the dependency resolver: the graph's tasks are pending now
    assert len(pushed) == 5 * PUSHES

    loop = Loop(em, store, rules)
    # The tests' keys decide on arrival: the enforcer supersedes every older pending test.
    assert await loop.enforce() == 2 * (PUSHES - 1)
    # An unmodified docker-worker claims a build, asks the service, runs the newest: one run
    # per build key.
    docker_worker = DockerWorkerRules(em, task_queue_id=BUILDS)
    ran_builds = []
    for _ in range(2):
        await loop.feed()
        primary, secondaries = await docker_worker.run(await docker_worker.claim_work())
        ran_builds.append(primary)
        assert len(secondaries) == PUSHES - 1
    em.clock.advance(0)  # the signing task of the build that ran is pending now
    # generic-worker and the signing worker run whatever is left pending.
    left = [t for t in pushed if em.queue().status(t)["status"]["state"] == "pending"]
    for task_id in left:
        claim = em.queue().claimTask(task_id, "0", WORKER)
        em.queue(claim["credentials"]).reportCompleted(task_id, "0")
    await loop.feed()

    fates = {task_id: fate(em, task_id) for task_id in pushed}
    for task_id, (push, label) in pushed.items():
        if label == "signing-linux64":
            # never superseded: it runs after the build it signs, which only the newest push's did
            assert fates[task_id] == ("completed" if push == PUSHES else "unscheduled"), label
        elif push == PUSHES:
            assert fates[task_id] == "completed", (push, label)
        else:
            assert fates[task_id] == "superseded", (push, label)
    assert sorted(pushed[t] for t in ran_builds) == [
        (PUSHES, "build-linux64"),
        (PUSHES, "build-linux64/debug"),
    ]
    assert sorted(pushed[t] for t in left) == [
        (PUSHES, "signing-linux64"),
        (PUSHES, "test-lint"),
        (PUSHES, "test-unit"),
    ]
    # Every superseded build names the newest build of its key, which ran.
    for task_id, (push, label) in pushed.items():
        if label.startswith("build-") and push < PUSHES:
            by = loop.artifact(task_id, 0, "public/superseded-by.json")
            assert pushed[by["taskId"]] == (PUSHES, label)


def fate(em: QueueEmulator, task_id: str) -> str:
    status: dict[str, Any] = em.queue().status(task_id)["status"]
    runs = status["runs"]
    if status["state"] == "exception":
        assert len(runs) == 1, runs
        return str(runs[0]["reasonResolved"])
    if status["state"] == "completed":
        assert len(runs) == 1, runs  # ran once, never retried
    return str(status["state"])
