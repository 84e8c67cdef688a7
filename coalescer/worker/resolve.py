"""Ending held runs: artifacts first, then the resolution, each with the claim's newest
credentials and under its lock so that a reclaim cannot swap them midway.

A 409 means the run was resolved by someone else (canceled, expired): the claim is dropped and
forgotten, as seed 003 says, and the caller learns that the resolution did not happen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
from taskcluster.exceptions import TaskclusterFailure

from coalescer.worker.claims import Claim, http_status
from coalescer.worker.protocol import (
    RELEASED,
    SUPERSEDED_BY,
    Outcome,
    Resolution,
    SupersedeAs,
    fallback,
    superseded_by_json,
)

log = logging.getLogger("coalescer.worker")

JSON = "application/json"
_RESOLVED = frozenset({"completed", "failed", "exception"})


async def put_artifact(
    http: httpx.AsyncClient, claim: Claim, name: str, body: bytes, content_type: str = JSON
) -> None:
    """Create an ``s3`` artifact and PUT ``body`` to its ``putUrl`` (as docker-worker did:
    every queue version takes it). Expires with the task."""
    created = await claim.queue.createArtifact(
        claim.task_id,
        str(claim.run_id),
        name,
        {"storageType": "s3", "expires": claim.task["expires"], "contentType": content_type},
    )
    response = await http.put(
        created["putUrl"], content=body, headers={"content-type": content_type}
    )
    response.raise_for_status()


async def put_reference(claim: Claim, name: str, url: str, content_type: str) -> None:
    """Create a ``reference`` artifact: fetching it redirects to ``url``. The queue lets a
    reference be replaced by another while the run is running (a live log's artifact is
    pointed at the log's copy that way). Expires with the task: a replacement may not expire
    sooner than the artifact it replaces."""
    await claim.queue.createArtifact(
        claim.task_id,
        str(claim.run_id),
        name,
        {
            "storageType": "reference",
            "expires": claim.task["expires"],
            "url": url,
            "contentType": content_type,
        },
    )


async def dependents(queue: Any, task_id: str) -> list[Mapping[str, Any]]:
    """Every ``{task, status}`` that depends on ``task_id`` (``listDependentTasks``, paged)."""
    found: list[Mapping[str, Any]] = []
    token: str | None = None
    while True:
        page = await queue.listDependentTasks(
            task_id, query={"continuationToken": token} if token else {}
        )
        found += page.get("tasks", [])
        token = page.get("continuationToken")
        if not token:
            return found


class Superseding:
    """Ends held runs as superseded, per :class:`SupersedeAs`, and says how and why.

    For ``auto`` and ``exception-superseded`` it learns once whether the queue accepts reason
    ``superseded`` (a current queue answers 400). ``worker_queue`` signs with the worker's own
    credentials, for ``listDependentTasks`` and ``cancelTask`` (a claim's credentials lack
    those scopes); the first 401/403 on ``cancelTask`` is remembered.

    ``public/superseded-by.json`` is uploaded only where the resolution as superseded follows:
    before ``reportCompleted``, or after an ``exception`` resolution (``superseded``,
    ``canceled``), which the queue still takes artifacts for (25 min; seed 003). A run released
    because the queue refused gets none, so no artifact names a primary that did not supersede.
    """

    def __init__(self, mode: SupersedeAs, worker_queue: Any, http: httpx.AsyncClient) -> None:
        self.mode = mode
        self._worker_queue = worker_queue
        self._http = http
        #: Whether the queue accepts reason ``superseded`` (None: not asked yet).
        self.accepts_superseded: bool | None = None
        self._may_cancel = True

    async def supersede(self, claim: Claim, primary: tuple[str, int]) -> Resolution:
        """End ``claim``'s run superseded by ``primary`` (``(taskId, runId)``). Raises the
        queue's error when a call fails (409: the run is not ours any more); a refusal to
        supersede releases the run and answers ``released``."""
        body = superseded_by_json(*primary)
        if self.mode in (SupersedeAs.AUTO, SupersedeAs.EXCEPTION_SUPERSEDED):
            if self.accepts_superseded is not False and await self._report_superseded(claim):
                await self._link_after(claim, body)
                return Resolution("exception/superseded", "the queue accepts reason 'superseded'")
            if self.mode is SupersedeAs.EXCEPTION_SUPERSEDED:
                return await self._release(
                    claim, Resolution(RELEASED, "the queue rejects reason 'superseded'")
                )
        if self.mode is SupersedeAs.COMPLETED:
            return await self._complete(claim, body, "--resolve-superseded-as completed")
        if self.mode is SupersedeAs.CANCELED:
            await self._worker_queue.cancelTask(claim.task_id)
            await self._link_after(claim, body)
            return Resolution("canceled", "--resolve-superseded-as canceled")
        waiting = await self._waiting(claim.task_id)
        how = fallback(waiting, self._may_cancel)
        if how.how == "completed":
            return await self._complete(claim, body, how.why)
        if how.how == "canceled":
            try:
                await self._worker_queue.cancelTask(claim.task_id)
            except TaskclusterFailure as exc:
                if http_status(exc) not in (401, 403):
                    raise
                log.warning("the worker's credentials may not cancel tasks: %s", exc)
                self._may_cancel = False
                how = fallback(waiting, False)
            else:
                await self._link_after(claim, body)
                return how
        return await self._release(claim, how)

    async def would_release(self, task_id: str) -> str | None:
        """Why superseding ``task_id`` could, as far as is known, only release it (None: it
        could be superseded). Such a task is better not claimed at all: each release costs it a
        retry, and it would be listed, claimed and released again until none is left."""
        if self.accepts_superseded is not False:
            return None
        if self.mode is SupersedeAs.EXCEPTION_SUPERSEDED:
            return "the queue rejects reason 'superseded'"
        if self.mode is SupersedeAs.AUTO and not self._may_cancel:
            waiting = await self._waiting(task_id)
            return None if waiting == 0 else fallback(waiting, may_cancel=False).why
        return None

    async def _waiting(self, task_id: str) -> int | None:
        """How many dependents of ``task_id`` are unresolved; None when they cannot be listed."""
        try:
            found = await dependents(self._worker_queue, task_id)
        except Exception as exc:  # unknown, which the caller handles; never blocks the task
            log.warning("could not list the dependents of %s: %s", task_id, exc)
            return None
        return sum(1 for d in found if d["status"]["state"] not in _RESOLVED)

    async def _report_superseded(self, claim: Claim) -> bool:
        """``reportException(superseded)``; False when the queue rejects the reason (400)."""
        try:
            await claim.queue.reportException(
                claim.task_id, str(claim.run_id), {"reason": "superseded"}
            )
        except TaskclusterFailure as exc:
            if http_status(exc) != 400:
                raise
            if self.accepts_superseded is None:
                log.warning("the queue rejects reason 'superseded': %s", exc)
            self.accepts_superseded = False
            return False
        self.accepts_superseded = True
        return True

    async def _complete(self, claim: Claim, body: bytes, why: str) -> Resolution:
        await put_artifact(self._http, claim, SUPERSEDED_BY, body)
        await claim.queue.reportCompleted(claim.task_id, str(claim.run_id))
        return Resolution("completed", why)

    async def _link_after(self, claim: Claim, body: bytes) -> None:
        """The artifact after an ``exception`` resolution: best effort, the resolution stands."""
        try:
            await put_artifact(self._http, claim, SUPERSEDED_BY, body)
        except (TaskclusterFailure, httpx.HTTPError) as exc:
            log.warning("no %s on %r: %s", SUPERSEDED_BY, claim, exc)

    async def _release(self, claim: Claim, why: Resolution) -> Resolution:
        log.warning("releasing %r rather than superseding it: %s", claim, why.why)
        await release(claim)
        return why


async def release(claim: Claim) -> None:
    """``reportException(worker-shutdown)``: the queue retries the task with a new run."""
    await claim.queue.reportException(
        claim.task_id, str(claim.run_id), {"reason": "worker-shutdown"}
    )


class Resolver:
    """Resolves held runs. Remembers, for ``auto``, whether the queue accepts ``superseded``."""

    def __init__(self, http: httpx.AsyncClient, worker_queue: Any, mode: SupersedeAs) -> None:
        self._http = http
        self.superseding = Superseding(mode, worker_queue, http)

    async def _finish(self, claim: Claim, step: Callable[[], Awaitable[None]]) -> bool:
        """Run ``step`` with the claim locked, then mark the claim done. False if the run was
        not ours any more (409) or the step failed; the claim is dropped either way."""
        async with claim.lock:
            if claim.done:
                return False
            try:
                await step()
            except (TaskclusterFailure, httpx.HTTPError) as exc:
                status = http_status(exc)
                level = logging.INFO if status == 409 else logging.ERROR
                log.log(level, "could not resolve %r (HTTP %s): %s", claim, status, exc)
                return False
            finally:
                claim.done = True
        return True

    async def supersede(self, claim: Claim, primary: Claim) -> Resolution | None:
        """End a secondary as superseded by ``primary`` (per ``mode``): how and why, or None
        when the run was not ours any more (409) or could not even be released. When the queue
        will not take the resolution, the run is released so that it is not lost."""
        async with claim.lock:
            if claim.done:
                return None
            try:
                done = await self.superseding.supersede(claim, (primary.task_id, primary.run_id))
            except (TaskclusterFailure, httpx.HTTPError) as exc:
                status = http_status(exc)
                if status == 409:
                    log.info("%r was resolved meanwhile: %s", claim, exc)
                    return None
                log.error("could not supersede %r (HTTP %s), releasing it: %s", claim, status, exc)
                try:
                    await release(claim)
                except TaskclusterFailure:
                    return None
                return Resolution(RELEASED, f"superseding it failed (HTTP {status})")
            finally:
                claim.done = True
        log.info(
            "%r superseded by %r: %s (%s)",
            claim,
            primary,
            done.how,
            done.why,
            extra={"task_id": claim.task_id},
        )
        return done

    @property
    def mode(self) -> SupersedeAs:
        return self.superseding.mode

    async def release(self, claim: Claim) -> bool:
        """Give a run back with ``worker-shutdown``: the queue retries it with a new run."""

        ok = await self._finish(claim, lambda: release(claim))
        if ok:
            log.info("released %r", claim, extra={"task_id": claim.task_id})
        return ok

    async def resolve(
        self, claim: Claim, outcome: Outcome, artifacts: Sequence[tuple[str, bytes]] = ()
    ) -> bool:
        """Upload ``artifacts`` (JSON), then report ``outcome`` for the run."""

        async def step() -> None:
            for name, body in artifacts:
                await put_artifact(self._http, claim, name, body)
            task_id, run_id = claim.task_id, str(claim.run_id)
            if outcome.state == "completed":
                await claim.queue.reportCompleted(task_id, run_id)
            elif outcome.state == "failed":
                await claim.queue.reportFailed(task_id, run_id)
            else:
                await claim.queue.reportException(task_id, run_id, {"reason": outcome.reason})

        ok = await self._finish(claim, step)
        if ok:
            log.info("resolved %r %s", claim, outcome.reason or outcome.state)
        return ok
