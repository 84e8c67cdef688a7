"""Task-queue listings (listPendingTasks, listClaimedTasks, listTaskQueues) through the official
taskcluster client, every answer checked against the queue's saved response schemas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from taskcluster.exceptions import TaskclusterRestFailure

from coalescer.emulator.harness import QueueEmulator

from .conftest import QUEUE_ID, WORKER, CheckedQueue, as_worker

OTHER_QUEUE = "emulator-test/other"


def every_page(listing: Callable[..., Any], *args: Any, limit: int, field: str = "tasks") -> Any:
    """Every entry of a paged listing, and how many pages it took."""
    entries: list[Any] = []
    pages, token = 0, None
    while True:
        query = {"limit": limit} | ({"continuationToken": token} if token else {})
        page = listing(*args, query=query)
        entries.extend(page[field])
        pages += 1
        token = page.get("continuationToken")
        if token is None:
            return entries, pages


def test_pending_tasks_are_listed_in_inserted_order_page_by_page(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    first = em.create_task()
    em.clock.advance(5)
    rest = [em.create_task() for _ in range(4)]
    em.create_task(taskQueueId=OTHER_QUEUE)
    # Claimed: no longer pending, and listed by listClaimedTasks instead.
    claimed = queue.claimTask(rest[1], 0, WORKER)
    expected = [first, rest[0], *rest[2:]]

    entries, pages = every_page(queue.listPendingTasks, QUEUE_ID, limit=2)
    assert [e["taskId"] for e in entries] == expected and pages == 2
    assert entries[0] == {
        "taskId": first,
        "runId": 0,
        "task": queue.task(first),
        "inserted": queue.status(first)["status"]["runs"][0]["scheduled"],
    }
    # A retried run is pending again, inserted when the retry was made: listed last.
    as_worker(em, claimed).reportException(rest[1], 0, {"reason": "worker-shutdown"})
    entries, _ = every_page(queue.listPendingTasks, QUEUE_ID, limit=1000)
    assert [(e["taskId"], e["runId"]) for e in entries[-2:]] == [(rest[3], 0), (rest[1], 1)]


def test_a_task_leaving_between_pages_does_not_hide_the_next_one(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    tasks = [em.create_task() for _ in range(4)]
    page = queue.listPendingTasks(QUEUE_ID, query={"limit": 2})
    assert [e["taskId"] for e in page["tasks"]] == tasks[:2]
    queue.claimTask(tasks[0], 0, WORKER)
    rest = queue.listPendingTasks(
        QUEUE_ID, query={"limit": 2, "continuationToken": page["continuationToken"]}
    )
    assert [e["taskId"] for e in rest["tasks"]] == tasks[2:]
    assert "continuationToken" not in rest


def test_claimed_tasks_are_listed_oldest_claim_first(
    em: QueueEmulator, queue: CheckedQueue
) -> None:
    tasks = [em.create_task() for _ in range(3)]
    claims = {}
    for task_id in (tasks[2], tasks[0]):
        claims[task_id] = queue.claimTask(task_id, 0, WORKER)
        em.clock.advance(1)
    entries, pages = every_page(queue.listClaimedTasks, QUEUE_ID, limit=1)
    assert [e["taskId"] for e in entries] == [tasks[2], tasks[0]] and pages == 2
    assert entries[0] == {
        "taskId": tasks[2],
        "runId": 0,
        **WORKER,
        "claimed": queue.status(tasks[2])["status"]["runs"][0]["started"],
        "task": queue.task(tasks[2]),
    }
    as_worker(em, claims[tasks[2]]).reportCompleted(tasks[2], 0)
    assert [e["taskId"] for e in queue.listClaimedTasks(QUEUE_ID)["tasks"]] == [tasks[0]]
    assert queue.listClaimedTasks(OTHER_QUEUE) == {"tasks": []}


def test_task_queues_with_tasks_are_listed(em: QueueEmulator, queue: CheckedQueue) -> None:
    assert queue.listTaskQueues() == {"taskQueues": []}
    em.create_task()
    em.clock.advance(60)
    em.create_task(taskQueueId=OTHER_QUEUE)
    entries, pages = every_page(queue.listTaskQueues, limit=1, field="taskQueues")
    assert [e["taskQueueId"] for e in entries] == [OTHER_QUEUE, QUEUE_ID] and pages == 2
    last = {e["taskQueueId"]: e["lastDateActive"] for e in entries}
    assert last[OTHER_QUEUE] > last[QUEUE_ID]
    # Five days after its last task was created, a task queue is no longer active, though its
    # tasks are still there.
    em.clock.advance(5 * 86400 - 30)
    assert [e["taskQueueId"] for e in queue.listTaskQueues()["taskQueues"]] == [OTHER_QUEUE]


@pytest.mark.parametrize("token", ["nonsense", "1-2"])
def test_a_bad_continuation_token_is_refused(queue: CheckedQueue, token: str) -> None:
    with pytest.raises(TaskclusterRestFailure) as failure:
        queue.listPendingTasks(QUEUE_ID, query={"continuationToken": token})
    assert failure.value.status_code == 400
    assert "continuationToken" in failure.value.body["message"]
