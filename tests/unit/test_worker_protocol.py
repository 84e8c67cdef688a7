"""The worker's pure decisions: following a supersederUrl, reading its answer, what to claim,
which task runs, and what the artifacts say."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from coalescer.worker.protocol import (
    COMPLETED,
    FAILED,
    OnPrimaryFailure,
    Order,
    Outcome,
    SupersedeAs,
    SupersederError,
    choose_primary,
    claimable_run,
    fallback,
    ineligibility,
    mode_warning,
    parse_answer,
    query_url,
    reclaim_at,
    secondary_fate,
    superseded_by_json,
    superseder_url,
    supersedes_json,
    supersedes_view,
)

# The worked example of Taskcluster's superseding documentation; its middle taskId is not a valid slugid (the queue would refuse
# it), so a valid one stands in for it.
E, M, K = "E5SBRfo-RfOIxh0V4187Qg", "AbN5WN6USOqdbhAyPHRD2w", "KGt8egfvRaqxczIRgOScaw"
OTHER = "fN1x3yDmQdC1o5mB5ZcS0A"


def answer(ids: list[Any]) -> bytes:
    return orjson.dumps({"supersedes": ids})


def parse(
    body: bytes, initial: str = E, order: Order = Order.OLDEST_FIRST, cap: int = 32
) -> list[str]:
    return parse_answer(body, initial, order=order, max_tasks=cap)


def test_answer_in_documented_order_is_kept_oldest_first() -> None:
    assert parse(answer([E, M, K])) == [E, M, K]


def test_newest_first_answer_is_reversed() -> None:
    assert parse(answer([K, M, E]), order=Order.NEWEST_FIRST) == [E, M, K]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html>oops</html>", "not-json"),
        (b"", "not-json"),
        (b"[]", "bad-answer"),
        (b'{"supersedes": "E5SBRfo-RfOIxh0V4187Qg"}', "bad-answer"),
        (b'{"tasks": []}', "bad-answer"),
        (answer([]), "empty"),
        (answer([M, K]), "initial-missing"),
        (answer([E, "not-a-task-id"]), "bad-answer"),
        (answer([E, 42]), "bad-answer"),
        (answer([E, M, E]), "bad-answer"),
    ],
)
def test_unusable_answers_are_refused_with_a_reason(body: bytes, reason: str) -> None:
    with pytest.raises(SupersederError) as info:
        parse(body)
    assert info.value.reason == reason


def test_long_answer_keeps_the_newest_and_the_initial_task() -> None:
    assert parse(answer([E, M, K, OTHER]), cap=2) == [E, OTHER]
    assert parse(answer([M, E, K, OTHER]), cap=3) == [E, K, OTHER]
    assert parse(answer([M, K, OTHER, E]), cap=2) == [OTHER, E]
    assert parse(answer([M, K, E]), cap=1) == [E]


def test_query_appends_task_id() -> None:
    assert query_url("http://h/k", E) == f"http://h/k?taskId={E}"
    assert query_url("http://h/k?size=2", E) == f"http://h/k?size=2&taskId={E}"


def test_superseder_url_is_read_from_the_payload() -> None:
    assert superseder_url({"payload": {"supersederUrl": "http://h/k"}}) == "http://h/k"
    tasks: list[dict[str, Any]] = [{"payload": {}}, {}, {"payload": {"supersederUrl": ""}}]
    for task in [*tasks, {"payload": []}]:
        with pytest.raises(SupersederError) as info:
            superseder_url(task)
        assert info.value.reason == "no-url"
    with pytest.raises(SupersederError):
        superseder_url({"payload": {"supersederUrl": ["http://h/k"]}})


def definition(
    queue: str = "proj/linux", routes: tuple[str, ...] = ("coalesce.v1.k",)
) -> dict[str, Any]:
    return {"taskQueueId": queue, "routes": list(routes)}


def test_a_listed_task_must_share_the_queue_and_the_coalescing_routes() -> None:
    initial = definition(routes=("coalesce.v1.k", "index.x"))
    assert ineligibility(initial, definition(routes=("coalesce.v1.k",)), "coalesce.v1") is None
    assert "task queue" in str(ineligibility(initial, definition("proj/mac"), "coalesce.v1"))
    assert "routes" in str(
        ineligibility(initial, definition(routes=("coalesce.v1.j",)), "coalesce.v1")
    )
    assert "routes" in str(ineligibility(initial, definition(routes=()), "coalesce.v1"))
    both = definition(routes=("coalesce.v1.k", "coalesce.v1.j"))
    assert ineligibility(initial, both, "coalesce.v1") is not None
    assert ineligibility(both, both, "coalesce.v1") is None


def test_the_route_prefix_is_configurable() -> None:
    initial = definition(routes=("mine.k",))
    assert ineligibility(initial, definition(routes=("mine.k",)), "mine") is None
    assert "no mine.* route" in str(ineligibility(definition(), definition(), "mine"))


def test_queue_is_compared_through_provisioner_and_worker_type_for_old_definitions() -> None:
    old = {"provisionerId": "proj", "workerType": "linux", "routes": ["coalesce.v1.k"]}
    assert ineligibility(definition(), old, "coalesce.v1") is None


def test_only_a_pending_latest_run_is_claimable() -> None:
    assert claimable_run({"runs": [{"runId": 0, "state": "pending"}]}) == 0
    runs = [{"runId": 0, "state": "exception"}, {"runId": 1, "state": "pending"}]
    assert claimable_run({"runs": runs}) == 1
    assert claimable_run({"runs": [{"runId": 0, "state": "running"}]}) is None
    assert claimable_run({"runs": []}) is None


def test_the_seed_example_runs_the_middle_task_when_the_last_claim_fails() -> None:
    assert choose_primary([E, M, K], {E, M}) == M
    assert choose_primary([E, M, K], {E, M, K}) == K
    assert choose_primary([E, M, K], {E}) == E
    with pytest.raises(ValueError):
        choose_primary([E], set())


def test_secondaries_are_superseded_unless_the_primary_broke() -> None:
    assert secondary_fate(COMPLETED, OnPrimaryFailure.SUPERSEDE) == "supersede"
    assert secondary_fate(FAILED, OnPrimaryFailure.SUPERSEDE) == "supersede"
    assert secondary_fate(FAILED, OnPrimaryFailure.RELEASE) == "release"
    broke = Outcome("exception", "malformed-payload")
    assert secondary_fate(broke, OnPrimaryFailure.SUPERSEDE) == "release"


def test_outcomes_are_checked() -> None:
    with pytest.raises(ValueError):
        Outcome("exception")
    with pytest.raises(ValueError):
        Outcome("completed", "superseded")
    with pytest.raises(ValueError):
        Outcome("running")


def test_reclaim_happens_a_third_of_the_way_to_taken_until() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert reclaim_at(now, now + timedelta(minutes=20), 1 / 3) == now + timedelta(minutes=20 / 3)


def test_artifacts_have_the_documented_shape() -> None:
    assert orjson.loads(superseded_by_json(K, 2)) == {"taskId": K, "runId": 2}
    assert orjson.loads(supersedes_json([(E, 0), (M, 1)])) == [
        {"taskId": E, "runId": 0},
        {"taskId": M, "runId": 1},
    ]
    view = orjson.loads(supersedes_view([(E, 0, {"payload": {}})]))
    assert view == [{"taskId": E, "runId": 0, "task": {"payload": {}}}]


def test_a_superseded_task_is_never_completed_unless_asked_by_name() -> None:
    # A current queue rejects 'superseded': canceled, or given back to run itself.
    canceled = fallback(may_cancel=True)
    assert canceled.how == "canceled" and canceled.superseded
    released = fallback(may_cancel=False)
    assert released.how == "released" and not released.superseded
    assert "may not cancel" in released.why
    # Only 'completed', asked for by name, reads as passed: a warning says so at start.
    for mode in SupersedeAs:
        warning = mode_warning(mode)
        assert (warning is not None) == (mode is SupersedeAs.COMPLETED)
    assert "passed" in (mode_warning(SupersedeAs.COMPLETED) or "")
