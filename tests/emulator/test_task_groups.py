"""Task groups (listTaskGroup, getTaskGroup, sealTaskGroup, cancelTaskGroup) and priorities
(changeTaskPriority, changeTaskGroupPriority), through the official taskcluster client.

The background work (the dependency resolver above all) runs here only when a test advances the
clock: whether a task is already marked ever-resolved is then the test's choice, not a race with
a ticker.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
import taskcluster
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.collation import sort_key
from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions

from .conftest import QUEUE_ID, WORKER, CheckedQueue, as_worker, claim_one, kinds


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, tick_interval=3600.0)


def refused(call: Any, *args: Any) -> TaskclusterRestFailure:
    """The error a queue call answered (failing the test if it succeeded)."""
    with pytest.raises(TaskclusterRestFailure) as failure:
        call(*args)
    assert set(failure.value.body) == {"code", "message", "requestInfo"}
    return failure.value


def group_messages(em: QueueEmulator, kind: str, group_id: str) -> list[dict[str, Any]]:
    return [m for m in em.messages(kind) if m["payload"]["taskGroupId"] == group_id]


def background(em: QueueEmulator) -> None:
    """Let the queue's background work (the dependency resolver) run now."""
    em.clock.advance(0)


def claimed_order(queue: CheckedQueue, count: int) -> list[str]:
    claims = queue.claimWork(QUEUE_ID, {**WORKER, "tasks": count})["tasks"]
    return [c["status"]["taskId"] for c in claims]


# -- listTaskGroup, getTaskGroup ------------------------------------------------------------------


def test_a_task_group_is_made_by_its_first_task_and_listed_in_pages(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    members = [em.create_task(taskGroupId=group) for _ in range(4)]
    em.create_task()  # its own group
    assert queue.getTaskGroup(group)["expires"] == queue.task(members[-1])["expires"]
    # The group lives as long as its longest-lived task.
    later = format_time(em.clock.now() + timedelta(days=400))
    members.append(em.create_task(taskGroupId=group, expires=later))
    info = queue.getTaskGroup(group)
    assert info == {"taskGroupId": group, "schedulerId": "-", "expires": later}

    pages, token = [], None
    while True:
        query = {"limit": 2} | ({"continuationToken": token} if token else {})
        page = queue.listTaskGroup(group, query=query)
        assert {k: page[k] for k in ("taskGroupId", "schedulerId", "expires")} == info
        pages.append(page["tasks"])
        token = page.get("continuationToken")
        if token is None:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    listed = [entry for p in pages for entry in p]
    assert [entry["status"]["taskId"] for entry in listed] == sorted(members, key=sort_key)
    for entry in listed:
        task_id = entry["status"]["taskId"]
        assert entry == {"task": queue.task(task_id), "status": queue.status(task_id)["status"]}
    whole = queue.listTaskGroup(group)
    assert "continuationToken" not in whole and len(whole["tasks"]) == 5


def test_an_unknown_task_group_is_not_found(em: QueueEmulator, queue: CheckedQueue) -> None:
    group = taskcluster.slugid.nice()
    for call in (queue.getTaskGroup, queue.listTaskGroup, queue.sealTaskGroup):
        failure = refused(call, group)
        assert (failure.status_code, failure.body["code"]) == (404, "ResourceNotFound")
    assert refused(queue.cancelTaskGroup, group).status_code == 404
    assert refused(queue.changeTaskGroupPriority, group, {"newPriority": "high"}).status_code == 404


def test_a_task_group_holds_the_tasks_of_one_scheduler(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    em.create_task(taskGroupId=group, schedulerId="ci")
    definition = em.task_definition(taskGroupId=group, schedulerId="someone-else")
    failure = refused(queue.createTask, taskcluster.slugid.nice(), definition)
    assert (failure.status_code, failure.body["code"]) == (409, "RequestConflict")
    assert len(queue.listTaskGroup(group)["tasks"]) == 1


def test_a_task_group_is_forgotten_when_its_last_task_expires(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    soon = em.clock.now() + timedelta(hours=2)
    first = em.create_task(taskGroupId=group, expires=format_time(soon))
    em.create_task(taskGroupId=group, expires=format_time(soon + timedelta(hours=1)))
    em.clock.advance(2 * 3600 + 1)  # the first task is gone, the second not yet
    assert refused(queue.status, first).status_code == 404
    assert len(queue.listTaskGroup(group)["tasks"]) == 1
    em.clock.advance(3600)
    assert refused(queue.getTaskGroup, group).status_code == 404


# -- sealTaskGroup ---------------------------------------------------------------------------------


def test_a_sealed_task_group_refuses_new_tasks(em: QueueEmulator, queue: CheckedQueue) -> None:
    group = taskcluster.slugid.nice()
    member = taskcluster.slugid.nice()
    definition = em.task_definition(taskGroupId=group)
    queue.createTask(member, definition)
    assert "sealed" not in queue.getTaskGroup(group)

    before = em.clock.now()
    sealed = queue.sealTaskGroup(group)
    assert before <= parse_time(sealed["sealed"]) <= em.clock.now()
    assert queue.getTaskGroup(group) == sealed
    assert queue.listTaskGroup(group)["sealed"] == sealed["sealed"]
    em.clock.advance(60)
    assert queue.sealTaskGroup(group) == sealed  # once, irreversibly: the first time stays

    failure = refused(
        queue.createTask, taskcluster.slugid.nice(), em.task_definition(taskGroupId=group)
    )
    assert (failure.status_code, failure.body["code"]) == (409, "RequestConflict")
    assert "sealed" in failure.body["message"]
    # Even an identical retry: the group is checked before the task.
    assert refused(queue.createTask, member, definition).status_code == 409
    assert [t["status"]["taskId"] for t in queue.listTaskGroup(group)["tasks"]] == [member]
    em.create_task()  # other groups are open

    messages = group_messages(em, "task-group-sealed", group)
    assert len(messages) == 2  # each call publishes, as other idempotent repeats do
    assert messages[0]["routingKey"] == f"primary.{group}.-._"
    assert messages[0]["CC"] == []
    assert messages[0]["payload"] == {"version": 1, **sealed}


# -- cancelTaskGroup -------------------------------------------------------------------------------


def test_cancel_task_group_refuses_a_group_that_is_not_sealed(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    task_id = em.create_task(taskGroupId=group)
    failure = refused(queue.cancelTaskGroup, group)
    assert (failure.status_code, failure.body["code"]) == (409, "RequestConflict")
    assert queue.status(task_id)["status"]["state"] == "pending"


def test_cancel_task_group_cancels_every_unresolved_task_and_leaves_resolved_ones(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    completed = em.create_task(taskGroupId=group)
    as_worker(em, claim_one(em, queue, completed)).reportCompleted(completed, 0)
    background(em)  # resolved once, while `completed` is its only task
    running = em.create_task(taskGroupId=group)
    worker = as_worker(em, queue.claimTask(running, 0, WORKER))
    # The dependency sorts first, so is canceled first: its dependent is canceled too, not made
    # pending by it (the whole group is canceled at once).
    pending, dependent = sorted((taskcluster.slugid.nice() for _ in range(2)), key=sort_key)
    em.create_task(pending, taskGroupId=group)
    unscheduled = taskcluster.slugid.nice()
    queue.createTask(unscheduled, em.task_definition(taskGroupId=group, dependencies=[unscheduled]))
    em.create_task(dependent, taskGroupId=group, dependencies=[pending], requires="all-resolved")
    outside = em.create_task(dependencies=[pending], requires="all-resolved")
    queue.sealTaskGroup(group)
    assert len(group_messages(em, "task-group-resolved", group)) == 1

    result = queue.cancelTaskGroup(group)
    canceled = sorted([running, pending, unscheduled, dependent], key=sort_key)
    assert result == {
        "taskGroupId": group,
        "taskGroupSize": 5,
        "cancelledCount": 4,
        "taskIds": canceled,
    }
    for task_id in canceled:
        status = queue.status(task_id)["status"]
        assert (status["state"], status["runs"][-1]["reasonResolved"]) == ("exception", "canceled")
        assert kinds(em, task_id)[-1] == "task-exception"
    assert [r["reasonCreated"] for r in queue.status(unscheduled)["status"]["runs"]] == [
        "exception"
    ]
    assert [r["reasonCreated"] for r in queue.status(dependent)["status"]["runs"]] == ["exception"]
    assert "task-pending" not in kinds(em, dependent)
    assert em.messages("task-exception", running)[0]["payload"]["workerId"] == WORKER["workerId"]
    assert refused(worker.reclaimTask, running, 0).status_code == 409
    assert queue.status(completed)["status"]["state"] == "completed"
    assert kinds(em, completed)[-1] == "task-completed"

    # The dependency resolver, later, schedules the dependent outside the group, and finds the
    # group resolved once the last canceled task is marked ever-resolved.
    background(em)
    assert queue.status(outside)["status"]["state"] == "pending"  # its dependency resolved
    [resolved] = group_messages(em, "task-group-resolved", group)[1:]
    assert resolved["routingKey"] == f"primary.{group}.-._"
    assert em.published.index(resolved) > em.published.index(
        em.messages("task-exception", canceled[-1])[0]
    )

    # Again: nothing left to cancel, nothing published.
    published = len(em.published)
    again = queue.cancelTaskGroup(group)
    background(em)
    assert (again["cancelledCount"], again["taskIds"], again["taskGroupSize"]) == (0, [], 5)
    assert len(em.published) == published
    # A rerun is a new run; canceling the group again cancels only that run.
    queue.rerunTask(pending)
    third = queue.cancelTaskGroup(group)
    assert (third["cancelledCount"], third["taskIds"]) == (1, [pending])
    runs = queue.status(pending)["status"]["runs"]
    assert [(r["reasonCreated"], r["reasonResolved"]) for r in runs] == [
        ("scheduled", "canceled"),
        ("rerun", "canceled"),
    ]
    background(em)
    assert len(group_messages(em, "task-group-resolved", group)) == 3


def test_a_task_group_is_resolved_when_its_last_task_resolves(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    first = em.create_task(taskGroupId=group)
    second = em.create_task(taskGroupId=group, retries=1)
    as_worker(em, claim_one(em, queue, first)).reportFailed(first, 0)
    background(em)
    assert group_messages(em, "task-group-resolved", group) == []
    worker = as_worker(em, claim_one(em, queue, second))
    worker.reportException(second, 0, {"reason": "worker-shutdown"})  # retried: not resolved
    background(em)
    assert group_messages(em, "task-group-resolved", group) == []
    as_worker(em, claim_one(em, queue, second)).reportCompleted(second, 1)
    background(em)
    [message] = group_messages(em, "task-group-resolved", group)
    assert message["payload"] == {"version": 1, **queue.getTaskGroup(group)}
    assert em.published.index(message) > em.published.index(
        em.messages("task-completed", second)[0]
    )
    # New work in the group (here a rerun) makes it resolve again later.
    queue.rerunTask(first)
    queue.cancelTask(first)
    background(em)
    assert len(group_messages(em, "task-group-resolved", group)) == 2


# -- changeTaskPriority, changeTaskGroupPriority ---------------------------------------------------


def test_change_task_priority_moves_a_pending_task_in_claim_work_order(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task(priority="low", routes=["coalesce.v1.k"])
    second = em.create_task(priority="low")
    third = em.create_task(priority="low")

    status = queue.changeTaskPriority(third, {"newPriority": "high"})["status"]
    assert status["priority"] == "high"
    assert queue.task(third)["priority"] == "high"
    [message] = em.messages("task-priority-changed", third)
    assert (message["payload"]["oldPriority"], message["payload"]["newPriority"]) == ("low", "high")
    assert message["payload"]["status"] == status
    assert message["routingKey"] == f"primary.{third}._._._.emulator-test.worker.-.{third}._"
    # The same priority again is refused, in release 106's words, and says nothing.
    same = refused(queue.changeTaskPriority, third, {"newPriority": "high"})
    assert (same.status_code, same.body["code"]) == (409, "RequestConflict")
    assert same.body["message"].startswith(
        f"Task `{third}` is already resolved and cannot be reprioritized."
    )
    assert len(em.messages("task-priority-changed", third)) == 1

    queue.changeTaskPriority(first, {"newPriority": "lowest"})
    assert em.messages("task-priority-changed", first)[0]["CC"] == ["route.coalesce.v1.k"]
    assert claimed_order(queue, 3) == [third, second, first]


def test_change_task_priority_of_a_running_task_applies_to_its_retry(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    running = em.create_task(priority="lowest", retries=1)
    claim_one(em, queue, running)
    status = queue.changeTaskPriority(running, {"newPriority": "highest"})["status"]
    assert (status["state"], status["priority"]) == ("running", "highest")
    waiting = em.create_task(priority="high")
    em.clock.advance(1201)  # the claim expires: the task is retried, at its new priority
    assert queue.status(running)["status"]["runs"][-1]["reasonCreated"] == "retry"
    assert claimed_order(queue, 2) == [running, waiting]


def test_change_task_priority_refuses_resolved_unknown_and_invalid(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    done = em.create_task()
    queue.cancelTask(done)
    background(em)  # the dependency resolver marks it ever-resolved
    resolved = refused(queue.changeTaskPriority, done, {"newPriority": "high"})
    assert (resolved.status_code, resolved.body["code"]) == (409, "RequestConflict")
    assert resolved.body["message"].startswith(
        f"Task `{done}` is already resolved and cannot be reprioritized."
    )
    unknown = refused(queue.changeTaskPriority, taskcluster.slugid.nice(), {"newPriority": "high"})
    assert unknown.status_code == 404
    invalid = refused(queue.changeTaskPriority, done, {"newPriority": "urgent"})
    assert (invalid.status_code, invalid.body["code"]) == (400, "InputValidationError")
    assert queue.status(done)["status"]["priority"] == "lowest"
    assert em.messages("task-priority-changed") == []


def test_change_task_priority_refuses_a_task_ever_resolved_even_when_rerun(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    """As release 106 does: the mark is the dependency resolver's, so a task resolved moments
    ago is still changed; once marked, a rerun pending again is refused for good."""
    quick = em.create_task(priority="low")
    as_worker(em, claim_one(em, queue, quick)).reportFailed(quick, 0)
    status = queue.changeTaskPriority(quick, {"newPriority": "high"})["status"]
    assert (status["state"], queue.task(quick)["priority"]) == ("failed", "high")

    rerun = em.create_task(priority="low")
    as_worker(em, claim_one(em, queue, rerun)).reportFailed(rerun, 0)
    background(em)
    queue.rerunTask(rerun)
    assert queue.status(rerun)["status"]["state"] == "pending"
    again = refused(queue.changeTaskPriority, rerun, {"newPriority": "highest"})
    assert (again.status_code, again.body["code"]) == (409, "RequestConflict")
    assert again.body["message"].startswith(
        f"Task `{rerun}` is already resolved and cannot be reprioritized."
    )
    assert queue.task(rerun)["priority"] == "low"
    assert em.messages("task-priority-changed", rerun) == []


def test_change_task_priority_refuses_a_task_past_its_deadline(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    late = em.create_task(deadline=format_time(em.clock.now() + timedelta(seconds=30)))
    em.clock.advance(31)
    past = refused(queue.changeTaskPriority, late, {"newPriority": "high"})
    assert (past.status_code, past.body["code"]) == (409, "RequestConflict")
    deadline = queue.task(late)["deadline"]
    assert past.body["message"].startswith(
        f"Task `{late}` can't be reprioritized past its deadline of {deadline}."
    )


def test_change_task_group_priority_changes_the_unresolved_tasks_of_the_group(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    completed = em.create_task(taskGroupId=group, priority="low")
    as_worker(em, claim_one(em, queue, completed)).reportCompleted(completed, 0)
    background(em)  # marked ever-resolved: out of reach
    outsider = em.create_task(priority="high")  # older, and higher than the group's tasks
    running = em.create_task(taskGroupId=group, priority="low")
    queue.claimTask(running, 0, WORKER)
    pending = em.create_task(taskGroupId=group, priority="low")
    unscheduled = taskcluster.slugid.nice()
    queue.createTask(unscheduled, em.task_definition(taskGroupId=group, dependencies=[unscheduled]))
    already = em.create_task(taskGroupId=group, priority="very-high")

    result = queue.changeTaskGroupPriority(group, {"newPriority": "very-high"})
    changed = sorted([running, pending, unscheduled], key=sort_key)
    assert result == {
        "taskGroupId": group,
        "schedulerId": "-",
        "newPriority": "very-high",
        "tasksAffected": 3,
        "taskIds": changed,
    }
    for task_id in [*changed, already]:
        assert queue.status(task_id)["status"]["priority"] == "very-high"
    assert queue.status(completed)["status"]["priority"] == "low"
    [summary] = group_messages(em, "task-group-priority-changed", group)
    assert summary["payload"] == {
        "version": 1,
        "taskGroupId": group,
        "schedulerId": "-",
        "newPriority": "very-high",
        "tasksAffected": 3,
    }
    assert summary["routingKey"] == f"primary.{group}.-._" and summary["CC"] == []
    assert em.messages("task-priority-changed") == []  # only the summary
    assert claimed_order(queue, 3) == [pending, already, outsider]

    again = queue.changeTaskGroupPriority(group, {"newPriority": "very-high"})
    assert (again["tasksAffected"], again["taskIds"]) == (0, [])
    assert len(group_messages(em, "task-group-priority-changed", group)) == 2
