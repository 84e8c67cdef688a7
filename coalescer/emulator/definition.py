"""createTask's input, completed and checked as the real queue does before storing it.

The request has already passed ``create-task-request.json``, which filled in its defaults (so
``queue.task`` returns a full ``task.json``); this derives ``taskQueueId`` from
``provisionerId``/``workerType`` or the reverse, adds ``taskGroupId`` (the taskId) and
``expires``, and applies the queue's time rules. Dates are rewritten in one canonical form so
that an idempotent retry with differently written dates still compares equal.

The real queue completes the request object itself, step by step, and its error replies echo
that object as ``requestInfo.payload``; so does :func:`complete`, so that an error (a 409 for a
taskId already used, say) shows the request as completed up to the step that refused it.
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.model import QueueError

#: Clock drift the queue tolerates on ``created``.
DRIFT = timedelta(minutes=15)
#: How far ahead a deadline may be.
MAX_DEADLINE = timedelta(days=5)


def _one_year_later(when: datetime) -> datetime:
    try:
        return when.replace(year=when.year + 1)
    except ValueError:  # 29 February: JavaScript's setFullYear rolls over to 1 March
        return when.replace(year=when.year + 1, month=3, day=1)


def _split_queue(definition: dict[str, Any]) -> None:
    queue_id = definition.get("taskQueueId")
    provisioner, worker_type = definition.get("provisionerId"), definition.get("workerType")
    if queue_id:
        split_provisioner, _, split_type = str(queue_id).partition("/")
        if (provisioner and provisioner != split_provisioner) or (
            worker_type and worker_type != split_type
        ):
            raise QueueError(
                "InputError",
                "taskQueueId must equal provisionerId/workerType when all three are given",
                taskQueueId=queue_id,
            )
        definition["provisionerId"], definition["workerType"] = split_provisioner, split_type
    elif provisioner and worker_type:
        definition["taskQueueId"] = f"{provisioner}/{worker_type}"
    else:
        raise QueueError(
            "InputError",
            "at least a provisionerId and a workerType or a taskQueueId must be provided",
        )


def complete(task_id: str, request: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The task definition the queue would store for ``request``, or InputError; ``request``
    itself is completed in place, in the real queue's order (see the module docstring)."""
    _split_queue(request)
    request.setdefault("taskGroupId", task_id)
    definition = request

    created = parse_time(definition["created"])
    deadline = parse_time(definition["deadline"])
    if created < now - DRIFT:
        raise QueueError("InputError", "Created timestamp cannot be in the past (max 15min drift)")
    if created > now + DRIFT:
        raise QueueError(
            "InputError", "Created timestamp cannot be in the future (max 15min drift)"
        )
    if created > deadline:
        raise QueueError("InputError", "Deadline cannot be past created")
    if deadline < now:
        raise QueueError("InputError", "Deadline cannot be in the past")
    if deadline - now > MAX_DEADLINE + DRIFT:
        raise QueueError("InputError", "Deadline cannot be more than 5 days into the future")
    definition.setdefault("expires", format_time(_one_year_later(deadline)))
    expires = parse_time(definition["expires"])
    if deadline > expires:
        raise QueueError("InputError", "Expires cannot be before the deadline")
    definition["created"] = format_time(created)
    definition["deadline"] = format_time(deadline)
    definition["expires"] = format_time(expires)
    if any(scope.endswith("**") for scope in definition["scopes"]):
        raise QueueError("InputError", "scopes must not end with `**`")
    return copy.deepcopy(definition)
