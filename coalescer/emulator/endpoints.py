"""Handlers for the queue API endpoints the emulator implements, keyed by ``api.json`` name.

Each handler gets a validated :class:`~coalescer.emulator.app.Call` and returns a JSON-able body
(or a Response); state changes go through ``call.apply`` so that expiry is applied first and the
resulting Pulse messages are published.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from coalescer import __version__
from coalescer.emulator import artifacts, claims, groups, listings
from coalescer.emulator.app import JSON, Call, Handler
from coalescer.emulator.model import Artifact, QueueError, Task
from coalescer.emulator.state import QueueState

T = TypeVar("T")
_STARTED = time.monotonic()


def _page(items: Sequence[T], query: Mapping[str, str]) -> tuple[Sequence[T], str | None]:
    """One page by ``limit`` (at most 1000) and the opaque ``continuationToken`` (an offset)."""
    try:
        start = int(query.get("continuationToken") or 0)
        limit = min(int(query.get("limit") or 1000), 1000)
    except ValueError:
        raise QueueError("InvalidRequestArguments", "bad continuationToken or limit") from None
    end = start + max(limit, 1)
    return items[start:end], (str(end) if end < len(items) else None)


async def ping(call: Call) -> Any:
    return {"alive": True, "uptime": time.monotonic() - _STARTED}


async def heartbeat(call: Call) -> Any:
    return {}


async def version(call: Call) -> Any:
    return {"source": "coalescer queue emulator", "version": __version__, "commit": "", "build": ""}


async def task(call: Call) -> Any:
    return call.read(lambda: call.state.task(call.task_id).definition)


async def status(call: Call) -> Any:
    return call.read(lambda: {"status": call.state.task(call.task_id).status()})


def _bulk(call: Call, field: str, describe: Any) -> Any:
    """``tasks`` and ``statuses``: one entry per requested task that exists, as the real queue's
    database answers: unknown and repeated ids left out, neither in the request's nor in taskId
    order. The real query has no ``ORDER BY``, so it answers in the order its ``tasks`` table
    holds the rows: creation order at first, changed as updated rows move. This answers in
    creation order, one order the real queue can give; paged like the other listings."""

    def query() -> dict[str, Any]:
        wanted = set(call.body.get("taskIds", []))
        found = [call.state.tasks[t] for t in wanted if t in call.state.tasks]
        found.sort(key=lambda task: task.seq)
        page, token = _page(found, call.request.query_params)
        out: dict[str, Any] = {field: [{"taskId": t.task_id, **describe(t)} for t in page]}
        if token:
            out["continuationToken"] = token
        return out

    return call.read(query)


async def tasks(call: Call) -> Any:
    return _bulk(call, "tasks", lambda t: {"task": t.definition})


async def statuses(call: Call) -> Any:
    return _bulk(call, "statuses", lambda t: {"status": t.status()})


async def list_dependent_tasks(call: Call) -> Any:
    def query() -> dict[str, Any]:
        page, token = _page(call.state.dependents(call.task_id), call.request.query_params)
        out: dict[str, Any] = {
            "taskId": call.task_id,
            "tasks": [{"task": t.definition, "status": t.status()} for t in page],
        }
        if token:
            out["continuationToken"] = token
        return out

    return call.read(query)


async def list_task_group(call: Call) -> Any:
    group_id = call.params["taskGroupId"]

    def query() -> dict[str, Any]:
        found = call.state.groups.get(group_id)
        page, token = _page(groups.members(call.state, group_id), call.request.query_params)
        out = found.to_json()
        out["tasks"] = [{"task": t.definition, "status": t.status()} for t in page]
        if token:
            out["continuationToken"] = token
        return out

    return call.read(query)


async def get_task_group(call: Call) -> Any:
    return call.read(lambda: call.state.groups.get(call.params["taskGroupId"]).to_json())


async def seal_task_group(call: Call) -> Any:
    group_id = call.params["taskGroupId"]
    return call.apply(lambda now: groups.seal_task_group(call.state, group_id, now))


async def cancel_task_group(call: Call) -> Any:
    group_id = call.params["taskGroupId"]
    return call.apply(lambda now: groups.cancel_task_group(call.state, group_id, now))


async def change_task_group_priority(call: Call) -> Any:
    group_id, priority = call.params["taskGroupId"], call.body["newPriority"]
    return call.apply(
        lambda now: groups.change_task_group_priority(call.state, group_id, priority, now)
    )


async def create_task(call: Call) -> Any:
    return call.apply(lambda now: call.state.create_task(call.task_id, call.body, now))


async def schedule_task(call: Call) -> Any:
    return call.apply(lambda now: call.state.schedule_task(call.task_id, now))


async def cancel_task(call: Call) -> Any:
    return call.apply(lambda now: call.state.cancel_task(call.task_id, now))


async def rerun_task(call: Call) -> Any:
    return call.apply(lambda now: call.state.rerun_task(call.task_id, now))


async def change_task_priority(call: Call) -> Any:
    priority = call.body["newPriority"]
    return call.apply(
        lambda now: groups.change_task_priority(call.state, call.task_id, priority, now)
    )


async def pending_tasks(call: Call) -> Any:
    queue_id = call.params["taskQueueId"]
    provisioner, _, worker_type = queue_id.partition("/")

    def query() -> dict[str, Any]:
        tasks = call.state.tasks.values()
        count = sum(1 for t in tasks if t.task_queue_id == queue_id and t.state == "pending")
        return {
            "provisionerId": provisioner,
            "workerType": worker_type,
            "taskQueueId": queue_id,
            "pendingTasks": count,
        }

    return call.read(query)


async def claim_work(call: Call) -> Any:
    """Claim what is pending now, else wait (up to ``claim_work_timeout``) for work to appear."""
    queue_id, body = call.params["taskQueueId"], call.body
    loop = asyncio.get_running_loop()
    give_up = loop.time() + call.emulator.options.claim_work_timeout
    while True:
        signal = call.emulator.work_signal()  # taken before looking, so no wake-up is missed
        result = call.apply(
            lambda now: claims.claim_work(
                call.state, queue_id, body["workerGroup"], body["workerId"], body["tasks"], now
            )
        )
        remaining = give_up - loop.time()
        if result["tasks"] or remaining <= 0:
            return result
        # Wake at least every second to notice a client that hung up.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(remaining, 1.0)):
                await signal.wait()
        if await call.request.is_disconnected():
            return {"tasks": []}


async def claim_task(call: Call) -> Any:
    group, worker = call.body["workerGroup"], call.body["workerId"]
    return call.apply(
        lambda now: claims.claim_task(call.state, call.task_id, call.run_id, group, worker, now)
    )


async def reclaim_task(call: Call) -> Any:
    call.authorize_run("queue:reclaim-task")
    return call.apply(lambda now: claims.reclaim_task(call.state, call.task_id, call.run_id, now))


async def report_completed(call: Call) -> Any:
    call.authorize_run("queue:resolve-task")
    return call.apply(
        lambda now: claims.report(call.state, call.task_id, call.run_id, "completed", now)
    )


async def report_failed(call: Call) -> Any:
    call.authorize_run("queue:resolve-task")
    return call.apply(
        lambda now: claims.report(call.state, call.task_id, call.run_id, "failed", now)
    )


async def report_exception(call: Call) -> Any:
    call.authorize_run("queue:resolve-task")
    reason = call.body["reason"]
    return call.apply(
        lambda now: claims.report_exception(call.state, call.task_id, call.run_id, reason, now)
    )


async def create_artifact(call: Call) -> Any:
    call.authorize_run("queue:create-artifact")
    name = call.params["name"]
    put_url = call.blob_url(call.task_id, call.run_id, name)
    return call.apply(
        lambda now: call.state.create_artifact(
            call.task_id, call.run_id, name, call.body, now, put_url=put_url
        )
    )


async def finish_artifact(call: Call) -> Any:
    def query() -> None:
        found = call.state.task(call.task_id).artifacts.get((call.run_id, call.params["name"]))
        if found is None:
            raise QueueError("ResourceNotFound", "Artifact not found")
        raise QueueError("InputError", "Only object artifacts can be finished")

    return call.read(query)


def _locate(call: Call) -> tuple[Task, int, Artifact]:
    """The task, run and artifact a getArtifact-like call names (latest run without runId)."""

    def query(now: Any) -> tuple[tuple[Task, int, Artifact], list[Any]]:
        found = call.state.task(call.task_id)
        run_id = call.run_id if "runId" in call.params else artifacts.latest_run_id(found)
        return (found, run_id, artifacts.fetch(found, run_id, call.params["name"], now)), []

    located: tuple[Task, int, Artifact] = call.apply(query)
    return located


def _url(call: Call, found: Task, run_id: int, artifact: Artifact) -> str:
    if artifact.storage_type == "s3":
        return call.blob_url(found.task_id, run_id, artifact.name)
    return str(artifact.details["url"])


async def get_artifact(call: Call) -> Any:
    """getArtifact / getLatestArtifact: a 303 to the data with the URL in the body too, or 424."""
    found, run_id, artifact = _locate(call)
    headers = {"x-taskcluster-artifact-storage-type": artifact.storage_type}
    if artifact.storage_type == "error":
        body = {"reason": artifact.details["reason"], "message": artifact.details["message"]}
        return JSON(body, status_code=424, headers=headers)
    url = _url(call, found, run_id, artifact)
    headers["location"] = url
    return JSON(
        {"storageType": artifact.storage_type, "url": url}, status_code=303, headers=headers
    )


async def artifact_content(call: Call) -> Any:
    """artifact / latestArtifact: where the content is, as JSON."""
    found, run_id, artifact = _locate(call)
    if artifact.storage_type == "error":
        return {"storageType": "error", **artifact.details}
    return {"storageType": artifact.storage_type, "url": _url(call, found, run_id, artifact)}


async def list_artifacts(call: Call) -> Any:
    def query() -> dict[str, Any]:
        found = call.state.task(call.task_id)
        run_id = call.run_id if "runId" in call.params else artifacts.latest_run_id(found)
        listed = artifacts.listing(found, run_id)
        page, token = _page(listed["artifacts"], call.request.query_params)
        return {"artifacts": list(page)} | ({"continuationToken": token} if token else {})

    return call.read(query)


async def artifact_info(call: Call) -> Any:
    def query() -> dict[str, Any]:
        found = call.state.task(call.task_id)
        run_id = call.run_id if "runId" in call.params else artifacts.latest_run_id(found)
        artifact = found.artifacts.get((run_id, call.params["name"]))
        if artifact is None:
            raise QueueError("ResourceNotFound", "Artifact not found")
        return artifact.to_json()

    return call.read(query)


def _by_task_queue(listing: Callable[[QueueState, str, Mapping[str, str]], Any]) -> Handler:
    async def handler(call: Call) -> Any:
        queue_id, query = call.params["taskQueueId"], call.request.query_params
        return call.read(lambda: listing(call.state, queue_id, query))

    return handler


async def list_task_queues(call: Call) -> Any:
    now = call.emulator.clock.now()
    return call.read(lambda: listings.task_queues(call.state, call.request.query_params, now))


async def not_implemented(call: Call) -> Any:
    raise QueueError("ResourceNotFound", f"the queue emulator does not implement {call.name}")


HANDLERS: dict[str, Handler] = {
    "ping": ping,
    "lbheartbeat": heartbeat,
    "heartbeat": heartbeat,
    "version": version,
    "task": task,
    "status": status,
    "tasks": tasks,
    "statuses": statuses,
    "listDependentTasks": list_dependent_tasks,
    "listTaskGroup": list_task_group,
    "getTaskGroup": get_task_group,
    "sealTaskGroup": seal_task_group,
    "cancelTaskGroup": cancel_task_group,
    "changeTaskGroupPriority": change_task_group_priority,
    "createTask": create_task,
    "scheduleTask": schedule_task,
    "cancelTask": cancel_task,
    "rerunTask": rerun_task,
    "changeTaskPriority": change_task_priority,
    "pendingTasks": pending_tasks,
    "claimWork": claim_work,
    "claimTask": claim_task,
    "reclaimTask": reclaim_task,
    "reportCompleted": report_completed,
    "reportFailed": report_failed,
    "reportException": report_exception,
    "createArtifact": create_artifact,
    "finishArtifact": finish_artifact,
    "getArtifact": get_artifact,
    "getLatestArtifact": get_artifact,
    "artifact": artifact_content,
    "latestArtifact": artifact_content,
    "listArtifacts": list_artifacts,
    "listLatestArtifacts": list_artifacts,
    "artifactInfo": artifact_info,
    "latestArtifactInfo": artifact_info,
    "listPendingTasks": _by_task_queue(listings.pending_tasks),
    "listClaimedTasks": _by_task_queue(listings.claimed_tasks),
    "listTaskQueues": list_task_queues,
}
