"""Scenario 6: the graphs real taskgraph generates for five pushes of the example project
(``tests/taskgraph/project``, with ``coalescer.taskgraph``'s transforms), created on the real
queue as a decision task creates them, then superseded as the policy and the workers say: the
generic-worker tests (route only) by ``coalescer enforce`` under a ``latest-wins`` rule, the
docker-worker builds by docker-worker's own rules following their ``supersederUrl``; signing is
never touched. The newest push's task of every key is the one left to run."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.taskgraph.support import Project, routes, submit
from tests.worker.support import DockerWorkerRules
from tests_taskcluster.environment import Deployment
from tests_taskcluster.support import RESOLVED, Loop, RealQueue, Run, in_thread

pytestmark = pytest.mark.integration

PUSHES = 5
POLICY = """\
rules:
  - name: tests
    keys: "example-ci.test.**"
    strategy: latest-wins
"""


def on_the_run(project: Project, run: Run) -> None:
    """The example project pointed at the run's names and within the documented scopes: its
    worker aliases in the run's task queues (no worker of the deployment claims there), the
    run's route prefix, the ``lowest`` priority, a deadline of 30 minutes."""

    def change(doc: dict[str, Any]) -> None:
        doc["task-priority"] = "lowest"
        # The queue wants a dependency (the decision task) to expire after the deadline.
        doc["task-deadline-after"] = "30 minutes"
        for alias, spec in doc["workers"]["aliases"].items():
            spec["provisioner"] = "coalescer-rt"
            spec["worker-type"] = f"run-{run.uid}-{alias}"
        doc["coalescer"]["route-prefix"] = run.prefix

    project.edit(change)


#: An hg repository: taskgraph adds a ``checks`` route (and needs its scope) to git ones.
REPOSITORY = {"repository_type": "hg", "head_repository": "https://hg.example.com/example"}


async def test_five_pushes_the_newest_of_each_key_is_left_to_run(
    loop: Loop, queue: RealQueue, run: Run, deployment: Deployment, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    loop.env["COALESCER_POLICY_FILE"] = str(policy)
    service = await loop.start_service()
    loop.procs.start("enforce", "enforce", "--poll", "0.2")
    project = Project(tmp_path / "example")
    project.configure(url=service)
    on_the_run(project, run)
    graphs = await asyncio.gather(
        *(
            asyncio.to_thread(project.generate, push, graph="morphed", level="1", **REPOSITORY)
            for push in range(1, PUSHES + 1)
        )
    )

    pushed: dict[str, tuple[int, str]] = {}
    for push, graph in enumerate(graphs, 1):
        decision = queue.create("decision", routes=[])
        claimed = queue.claim(decision)
        created = submit(
            queue.client, graph, decision=decision, scheduler="-", now=datetime.now(UTC)
        )
        queue.created.extend(created)
        pushed |= {task_id: (push, label) for task_id, label in created.items()}
        claimed.reportCompleted(decision, "0")
        # Pushes come minutes apart: each push's tasks are scheduled (their order in the
        # index) before the next push's decision task completes.
        roots = [t for t, label in created.items() if label != "signing-linux64"]
        await loop.eventually(
            lambda roots=roots: in_thread(
                lambda: all(queue.state(t) != "unscheduled" for t in roots)
            ),
            f"push {push}'s tasks scheduled",
        )
    first = routes({e["label"]: e for e in graphs[0].values()}, run.prefix + ".")
    assert first["signing-linux64"] == [] and len(first) == 5
    assert all(len(r) == 1 for label, r in first.items() if label != "signing-linux64")

    def of(label: str) -> list[str]:
        return sorted((t for t, pl in pushed.items() if pl[1] == label), key=lambda t: pushed[t])

    # Tests: the enforcer cancels every older one as the newer arrive.
    older_tests = [t for label in ("test-unit", "test-lint") for t in of(label)[:-1]]
    await loop.eventually(
        lambda: in_thread(lambda: all(queue.state(t) in RESOLVED for t in older_tests)),
        "the older tests superseded",
    )
    for task_id in older_tests:
        [only] = queue.status(task_id)["runs"]
        assert (only["state"], only["reasonResolved"]) == ("exception", "canceled")
        assert only["workerGroup"] == "coalescer"
    for label in ("test-unit", "test-lint"):
        assert queue.state(of(label)[-1]) == "pending"
        key = f"example-ci.test.{label}"
        await loop.eventually(
            lambda key=key, label=label: _equal(loop.pending(key), of(label)[-1:]),
            f"only the newest {label} pending",
        )

    # Builds: docker-worker's rules, on the build queue, for each build key.
    await loop.eventually(
        lambda: _equal(loop.pending("example-ci.build.build-linux64"), of("build-linux64")),
        "the builds indexed",
    )
    docker_worker = DockerWorkerRules(
        queue,
        worker_group="coalescer-rt",
        worker_id=f"dw-{run.uid}",
        task_queue_id=f"coalescer-rt/run-{run.uid}-b-linux",
        credentials=deployment.credentials,
    )
    for _ in ("build-linux64", "build-linux64/debug"):
        primary, secondaries = await docker_worker.run(await docker_worker.claim_work())
        push, label = pushed[primary]
        assert push == PUSHES
        assert sorted(secondaries) == sorted(of(label)[:-1])
    # A current queue refuses docker-worker's `superseded` (its secondaries stay claimed); an
    # older one takes it. Either way only the newest build ran, and no build is pending.
    for label in ("build-linux64", "build-linux64/debug"):
        assert queue.last_run(of(label)[-1])["reasonResolved"] == "completed"
        for task_id in of(label)[:-1]:
            assert queue.state(task_id) in ("running", "exception")
            assert queue.last_run(task_id).get("reasonResolved") in (None, "superseded")

    # Signing is never superseded: the newest build's signing task is scheduled, the others
    # wait on builds that did not complete.
    signing = of("signing-linux64")
    await loop.eventually(
        lambda: in_thread(lambda: queue.state(signing[-1]) == "pending"),
        "the newest signing task pending",
    )
    assert [queue.state(t) for t in signing[:-1]] == ["unscheduled"] * (PUSHES - 1)


async def _equal(got: Any, expected: list[str]) -> bool:
    return list(await got) == expected
