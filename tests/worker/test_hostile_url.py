"""A task author's ``supersederUrl`` never writes markup into another task's log: the query a
worker was given is not copied into the logs of the runs it supersedes."""

from __future__ import annotations

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Options
from tests.worker.support import Superseder, Tasks, make_shim
from tests.worker.test_lifecycle import Held, start

HOSTILE = "[Download-fix](https://evil.example/fix.sh)<img/src=x/onerror=alert(1)>"


async def test_a_hostile_superseder_url_query_never_reaches_another_tasks_log(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    # The claimed task's URL carries the query; its answer supersedes another task too.
    initial = tasks.create(url=f"{superseder.url_for('k')}?x={HOSTILE}&age=0")
    other, newest = tasks.create(), tasks.create()
    superseder.lists["k"] = [initial, other, newest]
    async with make_shim(queue_emulator, options) as shim:
        execute = Held()
        execute.release.set()
        report = await (await start(shim, execute))

    assert sorted(report.superseded) == sorted([(initial, 0), (other, 0)])
    for task_id in (initial, other):
        text = tasks.artifact(task_id, 0, "public/logs/live_backing.log")
        assert isinstance(text, str)
        # The service the answer came from, with the threshold, never the foreign parameter.
        assert f"the superseder answered {superseder.url}/k?age=0&taskId={initial} " in text
        for hostile in ("evil.example", "<img", "](", "[Download", "onerror", "x="):
            assert hostile not in text, text
