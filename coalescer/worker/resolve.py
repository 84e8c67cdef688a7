"""Ending held runs: artifacts first, then the resolution, each with the claim's newest
credentials and under its lock so that a reclaim cannot swap them midway.

A 409 means the run was resolved by someone else (canceled, expired): the claim is dropped and
forgotten, as seed 003 says, and the caller learns that the resolution did not happen.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
from taskcluster.exceptions import TaskclusterFailure

from coalescer.worker.claims import Claim, http_status
from coalescer.worker.protocol import (
    SUPERSEDED_BY,
    Outcome,
    SupersedeAs,
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


class Superseding:
    """Resolves a held run as superseded, per :class:`SupersedeAs`; for ``auto``, learns once
    that the queue rejects ``superseded`` (a current queue: 400) and completes from then on.

    ``worker_queue`` signs with the worker's own credentials, for ``cancelTask`` (the claim's
    credentials lack ``queue:cancel-task:...``).
    """

    def __init__(self, mode: SupersedeAs, worker_queue: Any) -> None:
        self.mode = mode
        self._worker_queue = worker_queue

    async def resolve(self, claim: Claim) -> None:
        task_id, run_id = claim.task_id, str(claim.run_id)
        if self.mode in (SupersedeAs.AUTO, SupersedeAs.EXCEPTION_SUPERSEDED):
            try:
                await claim.queue.reportException(task_id, run_id, {"reason": "superseded"})
                return
            except TaskclusterFailure as exc:
                if self.mode is not SupersedeAs.AUTO or http_status(exc) != 400:
                    raise
                log.warning(
                    "the queue rejects reason 'superseded' (%s); resolving superseded tasks "
                    "as completed from now on",
                    exc,
                )
                self.mode = SupersedeAs.COMPLETED
        if self.mode is SupersedeAs.COMPLETED:
            await claim.queue.reportCompleted(task_id, run_id)
        else:
            await self._worker_queue.cancelTask(task_id)


class Resolver:
    """Resolves held runs. Remembers, for ``auto``, whether the queue accepts ``superseded``."""

    def __init__(self, http: httpx.AsyncClient, worker_queue: Any, mode: SupersedeAs) -> None:
        self._http = http
        self.superseding = Superseding(mode, worker_queue)

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

    async def supersede(self, claim: Claim, primary: Claim) -> bool:
        """Resolve a secondary as superseded by ``primary`` (per ``mode``). When the queue will
        not take that (other than with a 409), the run is released so that it is not lost."""
        async with claim.lock:
            if claim.done:
                return False
            try:
                body = superseded_by_json(primary.task_id, primary.run_id)
                await put_artifact(self._http, claim, SUPERSEDED_BY, body)
                await self._resolve_superseded(claim)
            except (TaskclusterFailure, httpx.HTTPError) as exc:
                status = http_status(exc)
                if status == 409:
                    log.info("%r was resolved meanwhile: %s", claim, exc)
                    return False
                log.error("could not supersede %r (HTTP %s), releasing it: %s", claim, status, exc)
                with contextlib.suppress(TaskclusterFailure):
                    await self._report_shutdown(claim)
                return False
            finally:
                claim.done = True
        log.info("%r superseded by %r", claim, primary, extra={"task_id": claim.task_id})
        return True

    @property
    def mode(self) -> SupersedeAs:
        return self.superseding.mode

    async def _resolve_superseded(self, claim: Claim) -> None:
        await self.superseding.resolve(claim)

    async def _report_shutdown(self, claim: Claim) -> None:
        await claim.queue.reportException(
            claim.task_id, str(claim.run_id), {"reason": "worker-shutdown"}
        )

    async def release(self, claim: Claim) -> bool:
        """Give a run back with ``worker-shutdown``: the queue retries it with a new run."""

        ok = await self._finish(claim, lambda: self._report_shutdown(claim))
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
