"""The pure parts of a rebuild: what a listing entry gives the index, which listings cover a
request, and checking listing answers against their schemas."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from coalescer.ingest.rebuild import RebuildSummary, Source, listed_task, sources
from coalescer.ingest.validation import listing_errors

TASK_ID = "fN1SbArXTPSVFNUvaOlinQ"
OTHER_ID = "aZ2SbArXTPSVFNUvaOlinQ"


def definition(routes: list[str], tags: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "provisionerId": "proj",
        "workerType": "linux",
        "taskQueueId": "proj/linux",
        "schedulerId": "-",
        "projectId": "none",
        "taskGroupId": TASK_ID,
        "dependencies": [],
        "requires": "all-completed",
        "routes": routes,
        "priority": "lowest",
        "retries": 5,
        "created": "2030-01-01T00:00:00.000Z",
        "deadline": "2030-01-02T00:00:00.000Z",
        "expires": "2031-01-01T00:00:00.000Z",
        "scopes": [],
        "payload": {},
        "metadata": {
            "name": "t",
            "description": "d",
            "owner": "me@example.com",
            "source": "https://example.com",
        },
        "tags": tags or {},
        "extra": {},
    }


def pending_entry(task_id: str = TASK_ID, routes: list[str] | None = None) -> dict[str, Any]:
    return {
        "taskId": task_id,
        "runId": 0,
        "task": definition(["coalesce.v1.a.b"] if routes is None else routes),
        "inserted": "2030-01-01T00:00:00.000Z",
    }


def test_a_listed_task_is_indexed_under_each_coalescing_route_with_its_tags() -> None:
    entry = pending_entry(routes=["index.x", "coalesce.v1.a.b", "coalesce.v1.c"])
    entry["task"]["tags"] = {"push": "12"}
    found = listed_task(entry, "coalesce.v1")
    assert found is not None
    assert (found.task_id, found.keys, dict(found.tags)) == (TASK_ID, ("a.b", "c"), {"push": "12"})
    assert listed_task(pending_entry(routes=["index.x"]), "coalesce.v1") is None
    assert listed_task(entry, "coalesce.v2") is None


@pytest.mark.parametrize(
    ("state", "kept"),
    [("pending", True), ("running", True), ("unscheduled", False), ("completed", False)],
)
def test_a_task_groups_entry_is_kept_while_it_is_live(state: str, kept: bool) -> None:
    entry = {"task": definition(["coalesce.v1.k"]), "status": {"taskId": OTHER_ID, "state": state}}
    found = listed_task(entry, "coalesce.v1")
    assert (found is not None) is kept
    assert found is None or found.task_id == OTHER_ID


def test_task_queues_are_listed_pending_then_claimed_and_groups_after() -> None:
    assert [str(s) for s in sources(["p/a", "p/b"], [TASK_ID])] == [
        "pending tasks of p/a",
        "claimed tasks of p/a",
        "pending tasks of p/b",
        "claimed tasks of p/b",
        f"task group {TASK_ID}",
    ]
    assert sources([], []) == []
    assert Source("listPendingTasks", "p/a") in sources(["p/a"], [])


def test_a_rebuild_is_complete_only_without_failures_or_unread_listings() -> None:
    assert RebuildSummary().complete
    assert not RebuildSummary(failed=1).complete
    unread = RebuildSummary(incomplete=["pending tasks of p/a: 404"])
    assert not unread.complete and unread.line().endswith("1 listings not read to the end")


def by_task(entry: Any) -> Any:
    return (entry["taskId"], entry["runId"])


def test_listing_answers_are_checked_against_their_schema() -> None:
    page = {"tasks": [pending_entry(), pending_entry(OTHER_ID)], "continuationToken": "x"}
    assert listing_errors("list-pending-tasks-response", page, "tasks", by_task) == []
    broken = copy.deepcopy(page)
    del broken["tasks"][1]["inserted"]
    assert listing_errors("list-pending-tasks-response", broken, "tasks", by_task)
    # The same entry twice breaks uniqueItems; one task under two runs does not.
    twice = {"tasks": [pending_entry(), pending_entry()]}
    assert any(
        "unique" in p
        for p in listing_errors("list-pending-tasks-response", twice, "tasks", by_task)
    )
    rerun = {"tasks": [pending_entry(), {**pending_entry(), "runId": 1}]}
    assert (
        listing_errors("list-pending-tasks-response", rerun, "tasks", lambda e: e["taskId"]) == []
    )
    assert listing_errors("list-pending-tasks-response", {"tasks": {}}, "tasks", by_task)
