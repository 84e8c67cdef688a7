"""Shared helpers: taskcluster clients whose every response is checked against its schema, and a
teardown check of every Pulse message an emulator published."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import taskcluster
import taskcluster.aio

from coalescer.emulator.harness import QueueEmulator
from coalescer.schemas import errors, load_reference

_OUTPUTS = {
    e["name"]: e["output"].removeprefix("v1/").removesuffix(".json#")
    for e in load_reference("api.json")["entries"]
    if "output" in e
}
_EXCHANGES = {e["exchange"]: e for e in load_reference("exchanges.json")["entries"]}
WORKER = {"workerGroup": "test-group", "workerId": "worker-1"}
QUEUE_ID = "emulator-test/worker"


def assert_valid(schema: str, instance: Any) -> None:
    problems = errors(schema, instance)
    assert not problems, f"{schema}: {problems}"


class CheckedQueue:
    """A ``taskcluster.Queue`` whose responses must match the saved output schemas."""

    def __init__(self, queue: taskcluster.Queue) -> None:
        self._queue = queue

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._queue, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if name in _OUTPUTS:
                assert_valid(_OUTPUTS[name], result)
            return result

        return call


class CheckedAioQueue:
    """The same for ``taskcluster.aio.Queue``."""

    def __init__(self, queue: taskcluster.aio.Queue) -> None:
        self._queue = queue

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._queue, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await method(*args, **kwargs)
            if name in _OUTPUTS:
                assert_valid(_OUTPUTS[name], result)
            return result

        return call


def check_message(message: dict[str, Any]) -> None:
    """Body valid for its exchange's schema; routing key and CC as the queue builds them."""
    kind = message["exchange"].removeprefix("exchange/taskcluster-queue/v1/")
    assert message["exchange"] != kind, message["exchange"]
    entry = _EXCHANGES[kind]
    payload = message["payload"]
    assert_valid(entry["schema"].removeprefix("v1/").removesuffix(".json#"), payload)
    words = message["routingKey"].split(".")
    assert len(words) == len(entry["routingKey"]), message["routingKey"]
    assert words[0] == "primary" and words[-1] == "_"
    if entry["routingKey"][1]["name"] == "taskGroupId":
        # a task group's message: primary.<taskGroupId>.<schedulerId>._, no CC
        assert words[1:-1] == [payload["taskGroupId"], payload["schedulerId"]]
        assert message["CC"] == []
        return
    status = payload["status"]
    expected = [
        status["taskId"],
        str(payload.get("runId", "_")),
        payload.get("workerGroup", "_"),
        payload.get("workerId", "_"),
        status["provisionerId"],
        status["workerType"],
        status["schedulerId"],
        status["taskGroupId"],
    ]
    assert words[1:-1] == expected, message["routingKey"]


@pytest.fixture
def em(queue_emulator: QueueEmulator) -> Iterator[QueueEmulator]:
    """The ``queue_emulator`` fixture, checking every message it published at teardown."""
    yield queue_emulator
    for message in list(queue_emulator.published):
        check_message(message)


@pytest.fixture
def queue(em: QueueEmulator) -> CheckedQueue:
    """A scheduler's client (permanent credentials)."""
    return CheckedQueue(em.queue())


def claim_one(
    em: QueueEmulator, queue: CheckedQueue, task_id: str, **worker: str
) -> dict[str, Any]:
    """Claim work until ``task_id`` is among the claims; returns its claim."""
    body = {**WORKER, **worker, "tasks": 1}
    claims = queue.claimWork(QUEUE_ID, body)["tasks"]
    assert [c["status"]["taskId"] for c in claims] == [task_id]
    claim: dict[str, Any] = claims[0]
    return claim


def as_worker(em: QueueEmulator, claim: dict[str, Any]) -> CheckedQueue:
    """A client signed with a claim's temporary credentials."""
    return CheckedQueue(em.queue(claim["credentials"]))


def kinds(em: QueueEmulator, task_id: str) -> list[str]:
    """The exchanges of the messages published about ``task_id``, in order."""
    return [m["exchange"].rsplit("/", 1)[-1] for m in em.messages(task_id=task_id)]


def poll(condition: Callable[[], Any], timeout: float = 5.0) -> Any:
    """Wait for ``condition()`` to be truthy (no sleeping for synchronisation)."""
    give_up = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > give_up:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)
    return value
