"""Histories from a queue: a task group read with the official client (``listTaskGroup``) and
the Pulse messages the same queue published, from the queue emulator. Both give the same runs;
the group also gives dependencies and priorities."""

from __future__ import annotations

import asyncio

import orjson
import pytest
import taskcluster

from coalescer.emulator.harness import QueueEmulator
from coalescer.model import parse_time_ms
from coalescer.replay.history import Durations, priority_rank
from coalescer.replay.pool import Pool, State
from coalescer.replay.sources import SourceError, from_events, from_task_groups, read_events

QUEUE_ID = "emulator-test/worker"
WORKER = {"workerGroup": "wg", "workerId": "w1"}


def work(em: QueueEmulator, task_id: str, seconds: float, *, cancel: bool = False) -> None:
    """Claim ``task_id`` (the only pending task), let ``seconds`` pass, resolve it."""
    queue = em.queue()
    claims = queue.claimWork(QUEUE_ID, {**WORKER, "tasks": 1})["tasks"]
    assert [c["status"]["taskId"] for c in claims] == [task_id]
    em.clock.advance(seconds)
    if cancel:
        queue.cancelTask(task_id)
    else:
        em.queue(claims[0]["credentials"]).reportCompleted(task_id, claims[0]["runId"])


@pytest.fixture
def group(queue_emulator: QueueEmulator) -> tuple[str, dict[str, str]]:
    em = queue_emulator
    group = taskcluster.slugid.nice()
    ids = {name: taskcluster.slugid.nice() for name in ("build1", "test1", "build2")}

    def create(name: str, key: str, **extra: object) -> None:
        em.create_task(ids[name], taskGroupId=group, routes=[f"coalesce.v1.{key}"], **extra)

    create("build1", "build", priority="high")
    create("test1", "test", dependencies=[ids["build1"]])
    em.clock.advance(30)
    create("build2", "build")
    em.clock.advance(30)
    work(em, ids["build1"], 600)
    work(em, ids["build2"], 45, cancel=True)  # pending before test1 was
    work(em, ids["test1"], 300)
    return group, ids


def test_a_task_group_read_from_the_queue(
    queue_emulator: QueueEmulator, group: tuple[str, dict[str, str]]
) -> None:
    group_id, ids = group
    history = from_task_groups(
        queue_emulator.queue(), [group_id], prefix="coalesce.v1", rank_tag=None
    )
    tasks = {t.task_id: t for t in history.tasks}
    build1, test1, build2 = (tasks[ids[n]] for n in ("build1", "test1", "build2"))
    # The emulator's clock runs on between the steps the test takes: a few milliseconds.
    assert build1.duration_ms == pytest.approx(600_000, abs=2000)
    assert test1.duration_ms == pytest.approx(300_000, abs=2000)
    assert build2.duration_ms is None
    assert build1.keys == build2.keys == ("build",) and test1.keys == ("test",)
    assert build1.priority == priority_rank("high") > build2.priority == priority_rank("lowest")
    assert test1.dependencies == (ids["build1"],)
    # Created with its push (not when it became pending, after build1).
    assert test1.scheduled_ms - build1.scheduled_ms < 1000 < test1.order - build1.order
    assert build2.order > build1.order
    assert history.workers == {QUEUE_ID: 1}
    assert Durations(history.tasks).of(build2) == build1.duration_ms  # drawn from its key's runs

    # build2 was canceled while it ran: the replay cancels it at the same time, its worker
    # having claimed it when build1 completed.
    assert build2.canceled_ms == pytest.approx(build1.resolved_ms + 45_000, abs=2000)
    out = asyncio.run(Pool(history, None).run())
    b2 = history.tasks.index(build2)
    assert out.state[b2] == State.WITHDRAWN and out.resolved_ms[b2] == build2.canceled_ms
    # The one worker came at its first claim, build1's, a minute after build1 was created:
    # the replay's worker too, so build1 runs when it really ran.
    assert history.curves == {QUEUE_ID: ((build1.started_ms, 1), (test1.resolved_ms, 0))}
    assert out.left_ms[history.tasks.index(build1)] == build1.started_ms
    # build2 ran from its claim, the moment its worker took to claim it after build1 (the
    # history's claim wait, a few milliseconds), to its cancel.
    [(build2_started, _)] = build2.real_runs
    assert build2.wait_ms == build2_started - build1.resolved_ms
    assert out.worker_ms == build1.duration_ms + (build2.canceled_ms - build2_started) + (
        test1.duration_ms
    )
    # The emulator's dependency resolver made test1 pending a moment after build1 completed
    # (on its next pass: at once, or once build2's 45 seconds had passed): the history's
    # resolver lag, which the replay keeps.
    status = queue_emulator.queue().status(ids["test1"])["status"]
    pending = parse_time_ms(status["runs"][0]["scheduled"])
    assert history.resolver_lag_ms == pending - build1.resolved_ms >= 0
    i = history.tasks.index(test1)
    lag = out.pending_ms[i] - out.resolved_ms[history.tasks.index(build1)]
    assert lag == history.resolver_lag_ms


def test_the_same_queue_s_messages_give_the_same_runs(
    queue_emulator: QueueEmulator, group: tuple[str, dict[str, str]]
) -> None:
    group_id, _ = group
    lines = [orjson.dumps(m) for m in queue_emulator.published]
    recorded = from_events(read_events(lines), prefix="coalesce.v1", rank_tag=None)
    listed = from_task_groups(
        queue_emulator.queue(), [group_id], prefix="coalesce.v1", rank_tag=None
    )
    runs = {t.task_id: (t.duration_ms, t.keys, t.order, t.task_queue) for t in listed.tasks}
    assert {
        t.task_id: (t.duration_ms, t.keys, t.order, t.task_queue) for t in recorded.tasks
    } == runs
    assert all(t.dependencies == () for t in recorded.tasks)  # messages do not carry them


def test_an_unknown_task_group_is_a_clear_error(queue_emulator: QueueEmulator) -> None:
    with pytest.raises(SourceError, match="cannot list task group"):
        from_task_groups(
            queue_emulator.queue(), [taskcluster.slugid.nice()], prefix="coalesce.v1", rank_tag=None
        )
