"""Ending held runs: artifacts first, then the resolution, each with the claim's newest
credentials and under its lock so that a reclaim cannot swap them midway.

A 409 means the run was resolved by someone else (canceled, expired): the claim is dropped and
forgotten, as Taskcluster's manual, "Queue-Worker Interaction" says, and the caller learns that the
resolution did not happen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import httpx
from taskcluster.exceptions import TaskclusterFailure

from coalescer.worker import notice
from coalescer.worker.claims import Claim, http_status
from coalescer.worker.notice import Why
from coalescer.worker.protocol import (
    REJECTS,
    RELEASED,
    SUPERSEDED_BY,
    Outcome,
    Resolution,
    SupersedeAs,
    fallback,
    mode_warning,
    superseded_by_json,
)

log = logging.getLogger("coalescer.worker")

JSON = "application/json"


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
    """Ends held runs as superseded, per :class:`SupersedeAs`, says how and why, and leaves the
    run a log that says so (:mod:`coalescer.worker.notice`).

    For ``auto`` and ``exception-superseded`` it learns once whether the queue accepts reason
    ``superseded`` (a current queue answers 400). ``worker_queue`` signs with the worker's own
    credentials, for ``cancelTask`` (a claim's credentials lack that scope); the first 401/403
    on ``cancelTask`` is remembered. ``root_url`` (the Taskcluster UI's) links the log to the
    superseding task; ``by`` names who resolves (a worker, the enforcer).

    ``public/superseded-by.json`` is uploaded only where the resolution as superseded follows:
    before ``reportCompleted``, or after an ``exception`` resolution (``superseded``,
    ``canceled``), which the queue still takes artifacts for (20 minutes; Taskcluster's manual,
    "Queue-Worker Interaction"). A run released
    because it could not be superseded gets none, so no artifact names a primary that did not
    supersede; its log says why it was given back.
    """

    def __init__(
        self,
        mode: SupersedeAs,
        worker_queue: Any,
        http: httpx.AsyncClient,
        *,
        root_url: str | None = None,
        by: str = "coalescer",
    ) -> None:
        self.mode = mode
        self._worker_queue = worker_queue
        self._http = http
        self._root_url = root_url
        self._by = by
        #: Whether the queue accepts reason ``superseded`` (None: not asked yet).
        self.accepts_superseded: bool | None = None
        self._may_cancel = True
        if (warning := mode_warning(mode)) is not None:
            log.warning("%s", warning)

    async def supersede(self, claim: Claim, primary: tuple[str, int], why: Why) -> Resolution:
        """End ``claim``'s run superseded by ``primary`` (``(taskId, runId)``) for the reason
        ``why``. Raises the queue's error when a call fails (409: the run is not ours any
        more); a refusal to supersede releases the run and answers ``released``."""
        if self.mode in (SupersedeAs.AUTO, SupersedeAs.EXCEPTION_SUPERSEDED):
            if self.accepts_superseded is not False and await self._report_superseded(claim):
                done = Resolution("exception/superseded", "the queue accepts reason 'superseded'")
                await self._link_after(claim, primary, done, why)
                return done
            if self.mode is SupersedeAs.EXCEPTION_SUPERSEDED:
                return await self._release(claim, primary, Resolution(RELEASED, REJECTS), why)
        if self.mode is SupersedeAs.COMPLETED:
            done = Resolution("completed", "--resolve-superseded-as completed")
            await put_artifact(self._http, claim, SUPERSEDED_BY, superseded_by_json(*primary))
            await put_artifact(
                self._http, claim, notice.LOG, self._log(claim, primary, done, why), notice.TEXT
            )
            await claim.queue.reportCompleted(claim.task_id, str(claim.run_id))
            return done
        if self.mode is SupersedeAs.CANCELED:
            how = Resolution("canceled", "--resolve-superseded-as canceled")
        else:
            how = fallback(self._may_cancel)
        if how.how == "canceled":
            try:
                await self._worker_queue.cancelTask(claim.task_id)
            except TaskclusterFailure as exc:
                if self.mode is SupersedeAs.CANCELED or http_status(exc) not in (401, 403):
                    raise
                log.warning("the worker's credentials may not cancel tasks: %s", exc)
                self._may_cancel = False
                how = fallback(False)
            else:
                await self._link_after(claim, primary, how, why)
                return how
        return await self._release(claim, primary, how, why)

    async def would_release(self, task_id: str) -> str | None:
        """Why superseding ``task_id`` could, as far as is known, only release it (None: it
        could be superseded). Such a task is better not claimed at all: each release costs it a
        retry, and it would be listed, claimed and released again until none is left."""
        if self.accepts_superseded is not False:
            return None
        if self.mode is SupersedeAs.EXCEPTION_SUPERSEDED:
            return REJECTS
        if self.mode is SupersedeAs.AUTO and not self._may_cancel:
            return fallback(may_cancel=False).why
        return None

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
                log.warning("%s: %s", REJECTS, exc)
            self.accepts_superseded = False
            return False
        self.accepts_superseded = True
        return True

    def _log(self, claim: Claim, primary: tuple[str, int], done: Resolution, why: Why) -> bytes:
        return notice.render(
            claim.task_id,
            claim.run_id,
            primary,
            done.how,
            done.why,
            why,
            root_url=self._root_url,
            by=self._by,
        )

    async def _link_after(
        self, claim: Claim, primary: tuple[str, int], done: Resolution, why: Why
    ) -> None:
        """The artifacts after an ``exception`` resolution: best effort, the resolution
        stands."""
        artifacts = [(SUPERSEDED_BY, superseded_by_json(*primary), JSON)] if done.superseded else []
        artifacts.append((notice.LOG, self._log(claim, primary, done, why), notice.TEXT))
        for name, body, content_type in artifacts:
            try:
                await put_artifact(self._http, claim, name, body, content_type)
            except (TaskclusterFailure, httpx.HTTPError) as exc:
                log.warning("no %s on %r: %s", name, claim, exc)

    async def _release(
        self, claim: Claim, primary: tuple[str, int], why_released: Resolution, why: Why
    ) -> Resolution:
        log.warning("releasing %r rather than superseding it: %s", claim, why_released.why)
        await release(claim)
        await self._link_after(claim, primary, why_released, why)
        return why_released


async def release(claim: Claim) -> None:
    """``reportException(worker-shutdown)``: the queue retries the task with a new run."""
    await claim.queue.reportException(
        claim.task_id, str(claim.run_id), {"reason": "worker-shutdown"}
    )


class Resolver:
    """Resolves held runs. Remembers, for ``auto``, whether the queue accepts ``superseded``."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        worker_queue: Any,
        mode: SupersedeAs,
        *,
        root_url: str | None = None,
        by: str = "coalescer",
    ) -> None:
        self._http = http
        self.superseding = Superseding(mode, worker_queue, http, root_url=root_url, by=by)

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

    async def supersede(self, claim: Claim, primary: Claim, why: Why) -> Resolution | None:
        """End a secondary as superseded by ``primary`` (per ``mode``, for the reason ``why``):
        how and why, or None
        when the run was not ours any more (409) or could not even be released. When the queue
        will not take the resolution, the run is released so that it is not lost."""
        async with claim.lock:
            if claim.done:
                return None
            try:
                done = await self.superseding.supersede(
                    claim, (primary.task_id, primary.run_id), why
                )
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
