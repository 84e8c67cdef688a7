"""The worker interface (Taskcluster's manual, "Queue-Worker Interaction"): claiming, reclaiming and
resolving runs.

Plain functions on a :class:`~coalescer.emulator.state.QueueState`; each takes ``now`` and
returns ``(response body, messages to publish)`` or raises a QueueError. Only the last run of a
task can be claimed or resolved; a 409 (RequestConflict) tells a worker to forget the run.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from coalescer.emulator import messages as msg
from coalescer.emulator.model import QueueError, Run, Task
from coalescer.emulator.state import Outcome, QueueState

#: exception reasons the queue retries (while retries are left), and the new run's reasonCreated
RETRIED = {"worker-shutdown": "retry", "intermittent-task": "task-retry"}


def claim_work(
    state: QueueState,
    task_queue_id: str,
    worker_group: str,
    worker_id: str,
    count: int,
    now: datetime,
) -> Outcome:
    """Claim up to ``count`` pending tasks of the queue: highest priority, then oldest. A task
    past its deadline is no longer handed out, though the deadline resolver has yet to resolve
    it (its pending-queue entry lives until the deadline)."""
    pending = [
        t
        for t in state.tasks.values()
        if t.task_queue_id == task_queue_id and t.state == "pending" and now < t.deadline
    ]
    pending.sort(key=lambda t: (t.priority_rank, t.runs[-1].scheduled, t.runs[-1].seq))
    claims, out = [], []
    for task in pending[:count]:
        claim, published = _claim(state, task, task.runs[-1], worker_group, worker_id, now)
        claims.append(claim)
        out += published
    return {"tasks": claims}, out


def claim_task(
    state: QueueState, task_id: str, run_id: int, worker_group: str, worker_id: str, now: datetime
) -> Outcome:
    """Claim one run: only one worker wins, a retried request by the winner gets its claim."""
    task = state.task(task_id)
    if now >= task.deadline:
        raise QueueError("RequestConflict", f"Task `{task_id}` can't be claimed past its deadline.")
    run = task.run(run_id)
    current = run_id == len(task.runs) - 1
    if current and run.state == "pending":
        return _claim(state, task, run, worker_group, worker_id, now)
    same_worker = (run.worker_group, run.worker_id) == (worker_group, worker_id)
    if current and run.state == "running" and same_worker:
        body = _claim_body(task, run, state.issue(task, run, now))
        return body, [msg.task_running(task, run)]
    raise QueueError(
        "RequestConflict", f"Run {run_id} was already claimed by another worker.", runId=run_id
    )


def reclaim_task(state: QueueState, task_id: str, run_id: int, now: datetime) -> Outcome:
    """A later takenUntil and new credentials, while the run is the running one."""
    task = state.task(task_id)
    run = task.run(run_id)
    if now >= task.deadline:
        message = f"Task `{task_id}` can't be reclaimed past its deadline."
        raise QueueError("RequestConflict", message)
    _require_running(task, run)
    assert run.taken_until is not None
    run.taken_until = max(run.taken_until, now + state.timing.claim_timeout)
    body = _claim_body(task, run, state.issue(task, run, now))
    del body["task"]
    return body, []


def report(state: QueueState, task_id: str, run_id: int, target: str, now: datetime) -> Outcome:
    """reportCompleted (``target="completed"``) or reportFailed (``"failed"``)."""
    task = state.task(task_id)
    run = task.run(run_id)
    if run_id == len(task.runs) - 1 and run.state == target:
        # An idempotent repeat; the queue resends the message (at-least-once delivery) and
        # hands the resolution to its dependency resolver again.
        return {"status": task.status()}, state.resolved(task, run, now)
    _require_running(task, run)
    state.resolve(run, target, target, now)
    return {"status": task.status()}, state.resolved(task, run, now)


def report_exception(
    state: QueueState, task_id: str, run_id: int, reason: str, now: datetime
) -> Outcome:
    """Resolve the run exception; retry it when ``reason`` allows and retries are left."""
    task = state.task(task_id)
    run = task.run(run_id)
    if run.state == "exception" and run.reason_resolved == reason and run_id >= len(task.runs) - 2:
        # An idempotent repeat: resend what the first call published, if still true.
        out = [msg.task_resolved(task, run)]
        following = task.runs[run_id + 1] if run_id + 1 < len(task.runs) else None
        if following is not None:
            if following.state != "pending" or following.reason_created not in RETRIED.values():
                return {"status": task.status()}, []
            out.append(msg.task_pending(task, following))
        else:
            state.hand_to_resolver(task)  # resolved, not retried: as after the first call
        return {"status": task.status()}, out
    _require_running(task, run)
    state.resolve(run, "exception", reason, now)
    if reason in RETRIED:
        out = state.retried(task, run, RETRIED[reason], now)
    else:
        out = state.resolved(task, run, now)
    return {"status": task.status()}, out


def _require_running(task: Task, run: Run) -> None:
    if run.run_id != len(task.runs) - 1 or run.state != "running":
        raise QueueError(
            "RequestConflict",
            f"Run {run.run_id} on task `{task.task_id}` is resolved or not running.",
            taskId=task.task_id,
            runId=run.run_id,
        )


def _claim(
    state: QueueState, task: Task, run: Run, worker_group: str, worker_id: str, now: datetime
) -> Outcome:
    run.state, run.worker_group, run.worker_id = "running", worker_group, worker_id
    run.started, run.taken_until = now, now + state.timing.claim_timeout
    body = _claim_body(task, run, state.issue(task, run, now))
    return body, [msg.task_running(task, run)]


def _claim_body(task: Task, run: Run, creds: dict[str, str]) -> dict[str, Any]:
    """``task-claim-response.json`` (reclaim drops ``task``)."""
    status = task.status()
    return {
        "status": status,
        "runId": run.run_id,
        "workerGroup": run.worker_group,
        "workerId": run.worker_id,
        "takenUntil": status["runs"][run.run_id]["takenUntil"],
        "task": task.definition,
        "credentials": creds,
    }
