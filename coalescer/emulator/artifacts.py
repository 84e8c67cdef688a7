"""Artifact rules (Taskcluster's manual, "Queue-Worker Interaction": uploading artifacts), as
pure functions on a task.

``s3`` artifacts get a ``putUrl`` on the emulator itself, whose bytes are kept in memory;
``reference``, ``link`` and ``error`` artifacts are complete on creation. ``object`` artifacts
need Taskcluster's object service, which the emulator does not have.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator.clock import format_time, parse_time
from coalescer.emulator.model import Artifact, QueueError, Run, Task

#: How long a ``putUrl`` stays valid (the real queue signs S3 URLs for 45 minutes).
PUT_URL_TTL = timedelta(minutes=45)
_PAST_TOLERANCE = timedelta(minutes=15)


def _details(request: dict[str, Any]) -> dict[str, Any]:
    storage = request["storageType"]
    if storage == "reference":
        return {"url": request["url"]}
    if storage == "link":
        return {"artifact": request["artifact"]}
    if storage == "error":
        return {"message": request["message"], "reason": request["reason"]}
    return {}


def _compatible(
    original: Artifact, storage: str, content_type: str, expires: datetime, details: dict[str, Any]
) -> bool:
    """The real queue's ``createArtifactCallsCompatible``: what a repeated call may change."""
    if storage != "link" and original.content_type != content_type:
        return False
    if original.expires > expires:  # expiry can be extended, never shortened
        return False
    if original.storage_type == storage:
        return original.details == details or storage == "reference"
    return original.storage_type == "reference" and storage == "link"


def create(
    task: Task,
    run_id: int,
    name: str,
    request: dict[str, Any],
    now: datetime,
    *,
    grace: timedelta,
    put_url: str,
) -> tuple[dict[str, Any], Artifact, Run]:
    """createArtifact: the response, the stored artifact and its run (or a QueueError)."""
    storage = request["storageType"]
    if storage == "object":
        raise QueueError(
            "InputError",
            "the queue emulator has no object service: use s3, reference, link or error artifacts",
        )
    expires = parse_time(request["expires"])
    if expires < now - _PAST_TOLERANCE:
        raise QueueError("InputError", "Expires must be in the future")
    if not 0 <= run_id < len(task.runs):
        raise QueueError("InputError", "Run not found")
    run = task.runs[run_id]
    if run.worker_group is None or run.worker_id is None:
        raise QueueError(
            "InputError", "Run was not claimed by a worker and so no artifacts can exist"
        )
    if expires > task.expires:
        raise QueueError(
            "InputError",
            f"Artifact expires ({format_time(expires)}) after the task expiration "
            f"{format_time(task.expires)} (task.expires < expires) - this is not allowed",
        )
    if run.state != "running":
        # Seed 003: after reportException a worker may still upload, for a while; never after
        # completed or failed, so consumers of a finished task see all its artifacts.
        late_ok = (
            run.state == "exception" and run.resolved is not None and now < run.resolved + grace
        )
        if not late_ok:
            raise QueueError(
                "RequestConflict",
                "Artifacts cannot be created for a task after it is resolved, unless it is "
                f"resolved 'exception', and even in this case only up to {grace} past resolution.",
                status=task.status(),
            )

    content_type = request.get("contentType", "application/binary")
    details = _details(request)
    artifact = task.artifacts.get((run_id, name))
    if artifact is None:
        artifact = Artifact(name, storage, content_type, expires, details)
        task.artifacts[(run_id, name)] = artifact
    elif not _compatible(artifact, storage, content_type, expires, details):
        raise QueueError(
            "RequestConflict",
            "Artifact already exists with different properties, and none of the allowed "
            "exceptions apply",
            originalArtifact=artifact.to_json(),
        )
    else:
        artifact.storage_type, artifact.expires, artifact.details = storage, expires, details
    if "contentLength" in request:
        artifact.content_length = request["contentLength"]

    if storage == "s3":
        artifact.put_expires = now + PUT_URL_TTL
        response = {
            "storageType": "s3",
            "contentType": content_type,
            "expires": format_time(artifact.put_expires),
            "putUrl": put_url,
        }
        return response, artifact, run
    return {"storageType": storage}, artifact, run


def latest_run_id(task: Task) -> int:
    if not task.runs:
        raise QueueError("ResourceNotFound", "Task doesn't have any runs")
    return len(task.runs) - 1


def fetch(task: Task, run_id: int, name: str, now: datetime) -> Artifact:
    """The artifact to serve for ``name``, following ``link`` artifacts."""
    seen: list[str] = []
    while True:
        seen.append(name)
        artifact = task.artifacts.get((run_id, name))
        if artifact is None:
            raise QueueError("ResourceNotFound", "Artifact not found", name=name)
        if artifact.expires < now:
            raise QueueError("ResourceExpired", "Artifact expired", name=name)
        if artifact.storage_type != "link":
            return artifact
        name = artifact.details["artifact"]
        if name in seen:
            raise QueueError("InputError", "Artifact leads to a link cycle", names=seen)


def listing(task: Task, run_id: int) -> dict[str, Any]:
    """``list-artifacts-response.json`` for one run."""
    if not 0 <= run_id < len(task.runs):
        raise QueueError(
            "ResourceNotFound",
            f"Task with taskId: `{task.task_id}` has no run with runId: {run_id}",
        )
    found = sorted((n, a) for (r, n), a in task.artifacts.items() if r == run_id)
    return {"artifacts": [artifact.to_json() for _, artifact in found]}


def store_upload(
    task: Task, run_id: int, name: str, data: bytes, content_type: str | None, now: datetime
) -> None:
    """Keep the bytes PUT to an ``s3`` artifact's ``putUrl``, with S3's checks.

    The real ``putUrl`` is presigned over the host only (``X-Amz-SignedHeaders=host``), so S3
    takes any ``Content-Type`` and serves the object with the one the PUT carried (S3's
    ``binary/octet-stream`` when none)."""
    artifact = task.artifacts.get((run_id, name))
    if artifact is None or artifact.storage_type != "s3" or artifact.put_expires is None:
        raise QueueError("AccessDenied", "no s3 artifact awaits an upload at this URL")
    if now > artifact.put_expires:
        raise QueueError("AccessDenied", "the putUrl has expired: call createArtifact again")
    artifact.data, artifact.data_type = data, content_type or "binary/octet-stream"
