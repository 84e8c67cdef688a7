"""A recorded history for the replay's tests: a queue with N workers per task queue, simulated
independently of the pool model (one-second ticks, each claim after a random poll delay of up
to 3 s), written as the Pulse messages the queue would have published."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from typing import Any

import orjson

from tests.replay.support import T0

QUEUES = ("proj/linux", "proj/mac")


def iso(ms: int) -> str:
    return (
        datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"
    )


def message(kind: str, task: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    provisioner, worker_type = task["queue"].split("/")
    status = {
        "taskId": task["id"],
        "provisionerId": provisioner,
        "workerType": worker_type,
        "taskQueueId": task["queue"],
        "schedulerId": "-",
        "projectId": "none",
        "taskGroupId": task["id"],
        "deadline": iso(task["scheduled"] + 86_400_000),
        "expires": iso(task["scheduled"] + 2 * 86_400_000),
        "retriesLeft": 5,
        "state": run["state"],
        "runs": [run],
    }
    payload: dict[str, Any] = {"version": 1, "status": status, "runId": 0, "task": {"tags": {}}}
    if kind != "pending":
        payload.update(workerGroup="wg", workerId=run["workerId"])
    if kind == "running":
        payload["takenUntil"] = run["takenUntil"]
    return {
        "exchange": f"exchange/taskcluster-queue/v1/task-{kind}",
        "routingKey": "primary." + task["id"],
        "CC": [f"route.coalesce.v1.{task['key']}"],
        "payload": payload,
    }


def record(count: int, workers: int, seed: int = 1) -> tuple[list[bytes], int]:
    """JSON lines of ``count`` tasks' messages, and the recorded makespan (ms)."""
    rng = random.Random(seed)
    tasks = []
    at = T0
    for n in range(count):
        at += rng.randint(0, 120_000)
        tasks.append(
            {
                "id": f"{n:04d}AAAAQAC" + "A" * 11,
                "queue": rng.choice(QUEUES),
                "key": rng.choice(["build", "test"]),
                "scheduled": at,
                "duration": rng.randint(60, 1200) * 1000,
            }
        )
    free_at = {q: [T0] * workers for q in QUEUES}
    lines: list[bytes] = []
    end = T0
    for t in tasks:  # first come, first served: each task takes the worker free soonest
        slots = free_at[t["queue"]]
        w = min(range(workers), key=slots.__getitem__)
        tick = max(slots[w], t["scheduled"])
        tick += 1000 - tick % 1000 + rng.randint(0, 3) * 1000  # the next tick, then a poll delay
        started, resolved = tick, tick + t["duration"]
        slots[w] = resolved
        end = max(end, resolved)
        run = {"runId": 0, "reasonCreated": "scheduled", "scheduled": iso(t["scheduled"])}
        lines.append(orjson.dumps(message("pending", t, {**run, "state": "pending"})))
        worker = f"{t['queue'].split('/')[1]}-{w}"
        claimed = {**run, "workerGroup": "wg", "workerId": worker, "takenUntil": iso(resolved)}
        lines.append(
            orjson.dumps(
                message("running", t, {**claimed, "state": "running", "started": iso(started)})
            )
        )
        done = {
            **claimed,
            "state": "completed",
            "started": iso(started),
            "resolved": iso(resolved),
            "reasonResolved": "completed",
        }
        lines.append(orjson.dumps(message("completed", t, done)))
    return lines, end - tasks[0]["scheduled"]
