"""Scenario 3: a superseding policy (``latest-wins``) carried out by ``coalescer enforce`` on the
real queue, with no worker at all: the newest task stays pending, the older ones are claimed by
the enforcer and resolved (``auto``: canceled on release 106, which rejects ``superseded``)
with ``public/superseded-by.json`` and a ``public/logs/live_backing.log`` that says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_taskcluster.support import RESOLVED, Loop, RealQueue, in_thread

pytestmark = pytest.mark.integration

POLICY = """\
rules:
  - name: builds
    keys: "policy.*"
    strategy: latest-wins
"""


async def test_the_enforcer_resolves_older_pending_tasks(
    loop: Loop, queue: RealQueue, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    loop.env["COALESCER_POLICY_FILE"] = str(policy)
    await loop.start_service()
    loop.procs.start("enforce", "enforce", "--poll", "0.2")
    ids = [queue.create("policy.build") for _ in range(5)]
    # A key no rule matches keeps the protocol: nothing happens to it on arrival.
    untouched = [queue.create("lazy.build") for _ in range(2)]

    await loop.eventually(
        lambda: in_thread(lambda: all(queue.state(t) in RESOLVED for t in ids[:-1])),
        "the four older tasks resolved",
    )
    for task_id in ids[:-1]:
        [only] = queue.status(task_id)["runs"]
        # Never a success: canceled, and its log says by what.
        assert (only["state"], only["reasonResolved"]) == ("exception", "canceled")
        assert only["workerGroup"] == "coalescer"
        by = queue.artifact(task_id, 0, "public/superseded-by.json")
        assert by["taskId"] in ids[ids.index(task_id) + 1 :] and by["runId"] == 0
        text = queue.artifact(task_id, 0, "public/logs/live_backing.log")
        assert f"task {by['taskId']} run 0 superseded it" in text
        assert "policy rule 'builds'" in text
    # Chains end at the newest task, which no one touched.
    assert queue.state(ids[-1]) == "pending"
    assert await loop.pending("policy.build") == ids[-1:]
    assert [queue.state(t) for t in untouched] == ["pending", "pending"]
    assert await loop.pending("lazy.build") == untouched
