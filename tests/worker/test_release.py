"""``--on-primary-failure release``: a released task runs itself, however many newer tasks
fail; releases never use up its retries."""

from __future__ import annotations

import dataclasses

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import OnPrimaryFailure, Options
from tests.worker.support import Superseder, Tasks, make_shim, poll, resolved, running


def pushes(tasks: Tasks, count: int, first_bad: int) -> list[str]:
    """Tasks of pushes 1..count of key ``k`` whose command fails from push ``first_bad`` on."""
    command = ["sh", "-c", f'test "$PUSH" -lt {first_bad}']
    return [
        tasks.create(payload={"command": command, "env": {"PUSH": str(push)}})
        for push in range(1, count + 1)
    ]


async def test_released_tasks_run_rather_than_use_up_their_retries(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    ids = pushes(tasks, 9, first_bad=3)
    superseder.lists["k"] = ids
    release = dataclasses.replace(options, on_primary_failure=OnPrimaryFailure.RELEASE)
    async with make_shim(queue_emulator, release) as shim, running(shim):
        await poll(resolved(tasks, *ids), within=60, what="every push resolved")

    last = [tasks.last_run(t) for t in ids]
    assert [r["state"] for r in last] == ["completed"] * 2 + ["failed"] * 7
    for task_id in ids:
        runs = tasks.status(task_id)["runs"]
        # Given back at most once (by the failed primary that held it); then it ran.
        assert [r["reasonResolved"] for r in runs[:-1]] in ([], ["worker-shutdown"]), runs
        assert tasks.status(task_id)["retriesLeft"] >= 4
