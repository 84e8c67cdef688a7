"""Scenario: ``on-primary-failure: bisect`` on the real queue, every field at its default
(``bisect-parallel`` 2, failures confirmed as the key's flake rate asks), carried out by
``coalescer enforce`` while ``coalescer worker`` runs whatever it claims.

Nine pushes of one key are created while no worker runs; the enforcer holds the eight older
ones for the newest. Then the worker starts and runs the newest, which fails:

* a regression from push 5 on: the search runs two at a time, each probe (a released victim)
  at priority ``highest``, locates push 5 as the culprit and push 4 as the last good in fewer
  rounds than runs, and supersedes every other push by the run whose result stands for it;
* no regression, but the newest push's first run fails (a flaky task: its command fails once,
  leaving a marker behind): its rerun passes, the verdict is *flaky*, nobody is blamed, and
  the primary's passing run stands for every victim that did not run;
* the regression again with ``hold-by: priority``, the pushes at priority ``low``: the older
  pushes wait pending at ``lowest``, unclaimed; the culprit is located as before, and no run is
  given back (each push that ran did so in the run it waited in).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests_taskcluster.support import RESOLVED, Loop, RealQueue, Run, in_thread

pytestmark = pytest.mark.integration

KEY = "bisect.build"
PUSHES = 9
FIRST_BAD = 5
POLICY = """\
rules:
  - name: bisect
    keys: "bisect.*"
    strategy: latest-wins
    on-primary-failure: bisect
"""
#: The search's runs wait for one worker's claimWork (the real queue answers within seconds).
WITHIN = 180.0
FAILED, COMPLETED = ("failed", "failed"), ("completed", "completed")
SHUTDOWN = ("exception", "worker-shutdown")


def command(push: int, first_bad: int, marker: Path | None) -> str:
    """Push ``push``'s command: it fails from ``first_bad`` on; with ``marker``, it also fails
    while ``marker`` does not exist, creating it."""
    script = f'echo "push {push}"; test {push} -lt {first_bad}'
    if marker is not None:
        script = f'if [ ! -e "{marker}" ]; then touch "{marker}"; exit 1; fi; {script}'
    return script


async def bisected(
    loop: Loop,
    queue: RealQueue,
    run: Run,
    tmp_path: Path,
    *,
    first_bad: int = FIRST_BAD,
    marker: Path | None = None,
    parked: bool = False,
) -> tuple[Callable[[str], list[tuple[str, str]]], list[str], dict[str, Any]]:
    """The pushes held for the newest, a worker, and the search over: each task's results,
    the pushes' taskIds (oldest first) and the finding. ``parked``: ``hold-by: priority``,
    the pushes at priority ``low``."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY + ("    hold-by: priority\n" if parked else ""))
    loop.env["COALESCER_POLICY_FILE"] = str(policy)
    service = await loop.start_service()
    loop.procs.start("enforce", "enforce", "--poll", "0.2")
    own = {"priority": "low"} if parked else {}
    ids = [
        queue.create(
            KEY, command=command(push, first_bad, marker if push == PUSHES else None), **own
        )
        for push in range(1, PUSHES + 1)
    ]
    victims, primary = ids[:-1], ids[-1]

    def waits(task_id: str) -> bool:
        if parked:
            runs = [r["state"] for r in queue.status(task_id)["runs"]]
            return runs == ["pending"] and queue.client.task(task_id)["priority"] == "lowest"
        runs = [(r["state"], r.get("workerGroup")) for r in queue.status(task_id)["runs"]]
        return runs == [("running", "coalescer")]

    def held() -> bool:
        return all(waits(t) for t in victims) and [
            r["state"] for r in queue.status(primary)["runs"]
        ] == ["pending"]

    await loop.eventually(lambda: in_thread(held), "the enforcer to hold the eight older pushes")
    loop.procs.start(
        "worker", "worker",
        "--task-queue-id", run.task_queue_id,
        "--worker-group", "coalescer-rt",
        "--worker-id", f"w-{run.uid}",
    )  # fmt: skip

    def findings() -> list[dict[str, Any]]:
        answer = httpx.get(f"{service}/v1/tasks/{primary}", timeout=10)
        return list(answer.json().get("bisection") or []) if answer.status_code == 200 else []

    def over() -> bool:
        resolved = all(queue.state(t) in RESOLVED for t in ids)
        return resolved and bool(findings())

    await loop.eventually(
        lambda: in_thread(over), "the search to end and every push resolved", within=WITHIN
    )
    [finding] = findings()

    def results(task_id: str) -> list[tuple[str, str]]:
        return [(r["state"], r.get("reasonResolved")) for r in queue.status(task_id)["runs"]]

    return results, ids, finding


async def test_the_defaults_locate_the_culprit_in_fewer_rounds_at_the_highest_priority(
    loop: Loop, queue: RealQueue, run: Run, tmp_path: Path
) -> None:
    results, ids, finding = await bisected(loop, queue, run, tmp_path)
    victims, primary = ids[:-1], ids[-1]
    assert results(primary) == [FAILED, FAILED]  # its failure came back
    ran = [t for t in victims if len(results(t)) > 1]
    culprit, good = victims[FIRST_BAD - 1], victims[FIRST_BAD - 2]
    assert {culprit, good} <= set(ran)
    for task_id in ran:
        push = ids.index(task_id) + 1
        want = [SHUTDOWN, FAILED, FAILED] if push >= FIRST_BAD else [SHUTDOWN, COMPLETED]
        assert results(task_id) == want, (push, results(task_id))
        # Released, never resolved: raised while its new run waited for the worker.
        assert queue.client.task(task_id)["priority"] == "highest", push
    for task_id in victims:
        if task_id not in ran:
            assert queue.client.task(task_id)["priority"] == "lowest"
            [only] = queue.status(task_id)["runs"]
            assert (only["state"], only["reasonResolved"]) == ("exception", "canceled")
            stand_in = good if ids.index(task_id) < FIRST_BAD - 2 else culprit
            last = len(results(stand_in)) - 1
            linked = queue.artifact(task_id, 0, "public/superseded-by.json")
            assert linked == {"taskId": stand_in, "runId": last}, task_id
            text = queue.artifact(task_id, 0, "public/logs/live_backing.log")
            assert f"bisection after {primary} failed: {stand_in} is" in text, text

    assert finding["verdict"] == "culprit"
    assert finding["culprit"] == {"taskId": culprit, "runId": 2}
    assert finding["lastGood"] == {"taskId": good, "runId": 1}
    assert finding["probability"] >= 0.99
    assert finding["extraRuns"] == sum(len(results(t)) - 1 for t in ids)
    assert 1 <= finding["rounds"] < finding["extraRuns"]
    assert "culprit located: task " + culprit in loop.procs.output("enforce")


async def test_a_flaky_failure_of_the_newest_push_blames_nobody(
    loop: Loop, queue: RealQueue, run: Run, tmp_path: Path
) -> None:
    marker = tmp_path / "newest.flaked"
    results, ids, finding = await bisected(
        loop, queue, run, tmp_path, first_bad=PUSHES + 1, marker=marker
    )
    victims, primary = ids[:-1], ids[-1]
    assert marker.exists()
    assert results(primary) == [FAILED, COMPLETED]
    # The defaults run one probe beside the primary's confirmation; it runs for itself.
    ran = [t for t in victims if len(results(t)) > 1]
    assert len(ran) <= 1
    for task_id in ran:
        assert results(task_id) == [SHUTDOWN, COMPLETED]
        assert queue.client.task(task_id)["priority"] == "highest"
    superseded = [t for t in victims if t not in ran]
    for task_id in superseded:
        assert results(task_id) == [("exception", "canceled")], task_id
        linked = queue.artifact(task_id, 0, "public/superseded-by.json")
        assert linked == {"taskId": primary, "runId": 1}
        text = queue.artifact(task_id, 0, "public/logs/live_backing.log")
        assert "whose failure did not come back when it ran again" in text, text

    assert finding["verdict"] == "flaky"
    assert finding["culprit"] is None and finding["suspect"] is None
    assert finding["lastGood"] is None
    assert finding["intermittent"] == [{"taskId": primary, "runId": 0}]
    stood = {s["taskId"]: s["by"] for s in finding["standsFor"]}
    assert stood == {t: {"taskId": primary, "runId": 1} for t in superseded}
    log = loop.procs.output("enforce")
    assert f"bisection after {primary}: flaky, no push to blame" in log
    assert "culprit located" not in log


async def test_pushes_waiting_at_the_lowest_priority_are_searched_without_a_retry(
    loop: Loop, queue: RealQueue, run: Run, tmp_path: Path
) -> None:
    results, ids, finding = await bisected(loop, queue, run, tmp_path, parked=True)
    victims = ids[:-1]
    culprit, good = victims[FIRST_BAD - 1], victims[FIRST_BAD - 2]
    for task_id in victims:
        push = ids.index(task_id) + 1
        runs = results(task_id)
        # No claim given back: the first run is the push's own, or its superseding.
        assert SHUTDOWN not in runs, (push, runs)
        if runs == [("exception", "canceled")]:
            continue  # superseded, unclaimed until then
        want = FAILED if push >= FIRST_BAD else COMPLETED
        assert set(runs) == {want}, (push, runs)
    assert results(culprit)[0] == FAILED and results(good) == [COMPLETED]
    assert finding["verdict"] == "culprit"
    assert finding["culprit"]["taskId"] == culprit
    assert finding["lastGood"] == {"taskId": good, "runId": 0}
    assert finding["probability"] >= 0.99
    assert "culprit located: task " + culprit in loop.procs.output("enforce")
