"""Where the current queue's behaviour is not what its documentation suggests, the emulator does
what the queue does: the task-defined status, when dependents are scheduled and task-group-resolved
is published (and published again), the order of a task group's listing and of a task's
dependents, the payload echoed in an error, and when a deadline is acted on.

The background work (claim expiry, deadlines, the dependency resolver) runs here only when the
test advances the clock, so what happens between two background passes is deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import taskcluster
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions

from .conftest import WORKER, CheckedQueue, as_worker, claim_one, kinds


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, tick_interval=3600.0, deadline_delay=70.0)


def background(em: QueueEmulator) -> None:
    """Let the queue's background work run now."""
    em.clock.advance(0)


def group_resolved(em: QueueEmulator, group: str) -> list[dict[str, Any]]:
    return [m for m in em.messages("task-group-resolved") if m["payload"]["taskGroupId"] == group]


def test_task_defined_shows_the_task_as_defined_unscheduled_without_runs(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task(retries=3)
    assert queue.status(task_id)["status"]["state"] == "pending"
    [defined] = em.messages("task-defined", task_id)
    status = defined["payload"]["status"]
    assert (status["state"], status["runs"], status["retriesLeft"]) == ("unscheduled", [], 3)
    assert em.messages("task-pending", task_id)[0]["payload"]["status"]["state"] == "pending"


def test_task_group_resolved_comes_later_and_only_if_the_group_is_still_resolved(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    first = em.create_task(taskGroupId=group)
    as_worker(em, claim_one(em, queue, first)).reportCompleted(first, 0)
    assert group_resolved(em, group) == []  # not from the API call itself
    background(em)
    [message] = group_resolved(em, group)
    assert message["payload"] == {"version": 1, **queue.getTaskGroup(group)}

    # Resolved again, but a new task joins the group before the resolver looks: no message.
    second = em.create_task(taskGroupId=group)
    as_worker(em, claim_one(em, queue, second)).reportFailed(second, 0)
    third = em.create_task(taskGroupId=group)
    background(em)
    assert len(group_resolved(em, group)) == 1
    queue.cancelTask(third)
    background(em)
    assert len(group_resolved(em, group)) == 2


def test_list_task_group_sorts_task_ids_as_the_database_collation_does(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    # By code point these would be -, A, _, a, b; the queue's ICU collation says _ - a A b.
    ids = [
        "baaaaaaaQaaaaaaaaaaaaA",
        "AAAAAAAAQAaAAAAAAAAAAA",
        "aaaaaaaaQaaaaaaaaaaaaA",
        "-aaaaaaaQaaaaaaaaaaaaA",
        "_aaaaaaaQaaaaaaaaaaaaA",
        "aaaaaaaaQaaaaaaaaaaabA",
    ]
    for task_id in ids:
        queue.createTask(task_id, em.task_definition(taskGroupId=group))
    listed = [t["status"]["taskId"] for t in queue.listTaskGroup(group)["tasks"]]
    assert listed == [ids[4], ids[3], ids[2], ids[1], ids[5], ids[0]]
    first = queue.listTaskGroup(group, query={"limit": 4})
    rest = queue.listTaskGroup(
        group, query={"limit": 4, "continuationToken": first["continuationToken"]}
    )
    assert [t["status"]["taskId"] for t in first["tasks"] + rest["tasks"]] == listed


def test_an_error_echoes_the_payload_with_its_defaults_filled_in(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = taskcluster.slugid.nice()
    bad = em.task_definition(retries=-1, routes=["coalesce.v1.k"])
    with pytest.raises(TaskclusterRestFailure) as invalid:
        queue.createTask(task_id, bad)
    assert invalid.value.body["code"] == "InputValidationError"
    payload = invalid.value.body["requestInfo"]["payload"]
    assert payload == {
        **bad,
        "schedulerId": "-",
        "projectId": "none",
        "dependencies": [],
        "requires": "all-completed",
        "priority": "lowest",
        "scopes": [],
        "tags": {},
        "extra": {},
    }
    # The same for a request that validates but is refused later.
    queue.createTask(task_id, em.task_definition())
    with pytest.raises(TaskclusterRestFailure) as conflict:
        queue.createTask(task_id, em.task_definition(priority="high"))
    assert conflict.value.status_code == 409
    echoed = conflict.value.body["requestInfo"]["payload"]
    assert (echoed["priority"], echoed["retries"], echoed["routes"]) == ("high", 5, [])


def test_an_unresolved_task_is_resolved_deadline_delay_after_its_deadline(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = em.create_task()
    worker = as_worker(em, claim_one(em, queue, task_id))
    em.clock.advance(1000)
    worker = as_worker(em, worker.reclaimTask(task_id, 0))  # takenUntil: 2200 s
    em.clock.advance(1000)
    worker = as_worker(em, worker.reclaimTask(task_id, 0))  # takenUntil: 3200 s
    em.clock.advance(1000)
    worker = as_worker(em, worker.reclaimTask(task_id, 0))  # takenUntil: 4200 s
    em.clock.advance(600 + 65)  # deadline (3600 s) passed, the resolver not yet there (70 s)
    status = queue.status(task_id)["status"]
    assert status["state"] == "running"
    with pytest.raises(TaskclusterRestFailure) as late:
        worker.reclaimTask(task_id, 0)  # the API refuses past the deadline at once
    assert late.value.status_code == 409
    em.clock.advance(5)
    status = queue.status(task_id)["status"]
    assert (status["state"], status["runs"][0]["reasonResolved"]) == (
        "exception",
        "deadline-exceeded",
    )
    assert kinds(em, task_id)[-1] == "task-exception"
    assert status["runs"][0]["workerId"] == WORKER["workerId"]


def _resolve(em: QueueEmulator, queue: CheckedQueue, task_id: str, how: str) -> None:
    """Resolve ``task_id`` the way ``how`` says, as a worker or a scheduler would."""
    if how == "canceled":
        queue.cancelTask(task_id)
        return
    worker = as_worker(em, claim_one(em, queue, task_id))
    if how == "completed":
        worker.reportCompleted(task_id, 0)
    elif how == "failed":
        worker.reportFailed(task_id, 0)
    else:
        worker.reportException(task_id, 0, {"reason": how})


@pytest.mark.parametrize(
    ("how", "requires"),
    [
        ("completed", "all-completed"),
        ("failed", "all-resolved"),
        ("malformed-payload", "all-resolved"),
        ("canceled", "all-resolved"),
    ],
)
def test_dependents_are_scheduled_by_the_dependency_resolver_not_by_the_resolving_call(
    em: QueueEmulator, queue: CheckedQueue, how: str, requires: str
) -> None:
    first = em.create_task()
    second = em.create_task(dependencies=[first], requires=requires)
    _resolve(em, queue, first, how)
    # The real queue hands the resolution to its dependency resolver, which runs apart from the
    # API: the call's answer, and the state right after it, do not show the dependent scheduled.
    assert queue.status(second)["status"]["state"] == "unscheduled"
    assert kinds(em, second) == ["task-defined"]
    background(em)
    status = queue.status(second)["status"]
    assert (status["state"], status["runs"][0]["reasonCreated"]) == ("pending", "scheduled")
    [pending] = em.messages("task-pending", second)
    resolution = em.messages(task_id=first)[-1]
    assert em.published.index(pending) > em.published.index(resolution)


def test_a_dependency_once_satisfied_stays_satisfied_when_it_is_rerun(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first, other = em.create_task(), em.create_task()
    waiting = em.create_task(dependencies=[first, other])
    _resolve(em, queue, first, "completed")
    background(em)
    assert queue.status(waiting)["status"]["state"] == "unscheduled"  # `other` still blocks
    queue.rerunTask(first)  # pending again, but its requirement was met once and for all
    _resolve(em, queue, other, "completed")
    background(em)
    assert queue.status(waiting)["status"]["state"] == "pending"
    assert queue.status(first)["status"]["state"] == "pending"


def test_a_dependent_canceled_before_the_resolver_looks_is_not_scheduled(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task()
    second = em.create_task(dependencies=[first])
    _resolve(em, queue, first, "completed")
    queue.cancelTask(second)
    background(em)
    runs = queue.status(second)["status"]["runs"]
    assert [(r["reasonCreated"], r["reasonResolved"]) for r in runs] == [("exception", "canceled")]
    assert kinds(em, second) == ["task-defined", "task-exception"]


def test_a_dependent_the_resolver_schedules_keeps_its_group_unresolved(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    first = em.create_task(taskGroupId=group)
    second = em.create_task(taskGroupId=group, dependencies=[first])
    _resolve(em, queue, first, "completed")
    background(em)
    assert queue.status(second)["status"]["state"] == "pending"
    assert group_resolved(em, group) == []  # the dependent was scheduled before the check


def test_a_resolved_group_is_resolved_again_whenever_one_of_its_tasks_resolves_again(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    group = taskcluster.slugid.nice()
    first, second = em.create_task(taskGroupId=group), em.create_task(taskGroupId=group)
    _resolve(em, queue, first, "completed")
    background(em)
    assert group_resolved(em, group) == []
    _resolve(em, queue, second, "completed")
    background(em)
    assert len(group_resolved(em, group)) == 1

    # Both rerun: the group is resolved again by each of them resolving, even while the other is
    # pending, as its tasks were all resolved once (the queue's "ever resolved" mark stays).
    queue.rerunTask(first)
    queue.rerunTask(second)
    queue.cancelTask(first)
    background(em)
    assert len(group_resolved(em, group)) == 2
    assert queue.status(second)["status"]["state"] == "pending"
    worker = as_worker(em, claim_one(em, queue, second))
    worker.reportCompleted(second, 1)
    background(em)
    assert len(group_resolved(em, group)) == 3

    # A new task is never resolved yet: until it is, no message.
    third = em.create_task(taskGroupId=group)
    queue.rerunTask(first)
    queue.cancelTask(first)
    background(em)
    assert len(group_resolved(em, group)) == 3
    queue.cancelTask(third)
    background(em)
    assert len(group_resolved(em, group)) == 4


def test_a_repeated_call_that_finds_a_task_resolved_resolves_its_group_again(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    # The real queue hands the resolution to its dependency resolver again whenever a call finds
    # the task resolved as asked: canceling a canceled task, repeating reportCompleted.
    group = taskcluster.slugid.nice()
    canceled, completed = em.create_task(taskGroupId=group), em.create_task(taskGroupId=group)
    queue.cancelTask(canceled)
    background(em)
    worker = as_worker(em, claim_one(em, queue, completed))
    worker.reportCompleted(completed, 0)
    background(em)
    assert len(group_resolved(em, group)) == 1
    queue.cancelTask(canceled)
    background(em)
    assert len(group_resolved(em, group)) == 2
    worker.reportCompleted(completed, 0)
    background(em)
    assert len(group_resolved(em, group)) == 3
    assert kinds(em, completed).count("task-completed") == 2


@pytest.mark.parametrize("size", [5, 25])
def test_tasks_of_a_group_canceled_at_once_resolve_it_once(
    em: QueueEmulator, queue: CheckedQueue, size: int
) -> None:
    # Measured on the real queue: 2 messages for 5 tasks canceled at once, 1 for 25 (its
    # resolver handles a batch of resolutions concurrently, so two of a small batch can both find
    # the group resolved); one message per task is what it never does.
    group = taskcluster.slugid.nice()
    members = [em.create_task(taskGroupId=group) for _ in range(size)]
    queue.sealTaskGroup(group)
    assert queue.cancelTaskGroup(group)["cancelledCount"] == size
    background(em)
    [message] = group_resolved(em, group)
    last = max(em.published.index(em.messages("task-exception", t)[0]) for t in members)
    assert em.published.index(message) > last


def test_list_dependent_tasks_sorts_task_ids_as_the_database_collation_does(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    required = em.create_task()
    # Created in this order; by code point they would be -, A, _, a, b.
    ids = [
        "baaaaaaaQaaaaaaaaaaaaA",
        "AAAAAAAAQAaAAAAAAAAAAA",
        "aaaaaaaaQaaaaaaaaaaaaA",
        "-aaaaaaaQaaaaaaaaaaaaA",
        "_aaaaaaaQaaaaaaaaaaaaA",
    ]
    for task_id in ids:
        queue.createTask(task_id, em.task_definition(dependencies=[required]))
    collated = [ids[4], ids[3], ids[2], ids[1], ids[0]]
    listed = queue.listDependentTasks(required)["tasks"]
    assert [t["status"]["taskId"] for t in listed] == collated
    first = queue.listDependentTasks(required, query={"limit": 3})
    token = first["continuationToken"]
    rest = queue.listDependentTasks(required, query={"limit": 3, "continuationToken": token})
    assert [t["status"]["taskId"] for t in first["tasks"] + rest["tasks"]] == collated
    # The dependency resolver goes through them in the same order.
    _resolve(em, queue, required, "completed")
    background(em)
    pending = [m["payload"]["status"]["taskId"] for m in em.messages("task-pending")]
    assert pending[-5:] == collated


def test_a_conflicting_create_task_echoes_the_request_as_the_queue_completed_it(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    task_id = taskcluster.slugid.nice()
    first = em.task_definition()
    queue.createTask(task_id, first)
    other = {**first, "priority": "high"}
    assert not {"taskGroupId", "provisionerId", "workerType", "expires"} & set(other)
    with pytest.raises(TaskclusterRestFailure) as conflict:
        queue.createTask(task_id, other)
    assert conflict.value.status_code == 409
    body = conflict.value.body
    assert body["code"] == "RequestConflict"
    assert body["message"].startswith(
        f"taskId `{task_id}` already used by another task.\n"
        "This could be the result of faulty idempotency!\n\n---\n"
    )
    echoed = body["requestInfo"]["payload"]
    # taskQueueId split, taskGroupId defaulted to the taskId, expires defaulted to a year after
    # the deadline, as the real queue completes the request before it finds the taskId taken.
    stored = queue.task(task_id)
    assert (echoed["provisionerId"], echoed["workerType"]) == ("emulator-test", "worker")
    assert echoed["taskGroupId"] == task_id
    assert echoed["expires"] == stored["expires"]
    assert echoed == {**stored, "priority": "high"}
