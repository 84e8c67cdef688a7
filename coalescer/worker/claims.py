"""Held task runs: claiming them, and keeping them alive with ``reclaimTask``.

Each :class:`Claim` talks to the queue through its own ``taskcluster.aio.Queue``, rebuilt from
the newest credentials every time a reclaim returns some: the credentials from ``claimTask``
expire shortly after the first ``takenUntil``, so a long primary that kept them (as
docker-worker did) could no longer resolve its secondaries. A 409 on a claim or a reclaim
means the run is no longer ours (Taskcluster's manual, "Queue-Worker Interaction"): the claim is dropped and
forgotten.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import aiohttp
from taskcluster.aio import Queue
from taskcluster.exceptions import TaskclusterFailure

from coalescer.model import parse_time_ms
from coalescer.worker.protocol import (
    Options,
    claimable_run,
    given_back,
    ineligibility,
    reclaim_at,
)

log = logging.getLogger("coalescer.worker")

Clock = Callable[[], datetime]
#: Statuses after which a reclaim can never succeed: the run is gone, or our credentials are.
_LOST = frozenset({401, 403, 404, 409})


def utcnow() -> datetime:
    return datetime.now(UTC)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a taskcluster client error, None for connection errors."""
    status = getattr(exc, "status_code", None)
    return status if isinstance(status, int) else None


def parse_time(value: str) -> datetime:
    return datetime.fromtimestamp(parse_time_ms(value) / 1000, UTC)


@dataclasses.dataclass(frozen=True)
class Connection:
    """What every queue client shares: the root URL, one HTTP session, the retry policy."""

    root_url: str
    session: aiohttp.ClientSession
    max_retries: int = 5

    def queue(self, credentials: Mapping[str, Any] | None) -> Any:
        """A ``taskcluster.aio.Queue`` signing with ``credentials`` (unsigned when None)."""
        options: dict[str, Any] = {"rootUrl": self.root_url, "maxRetries": self.max_retries}
        if credentials:
            options["credentials"] = {k: v for k, v in credentials.items() if v}
        return Queue(options, session=self.session)


class Claim:
    """One task run this worker holds, with its newest credentials.

    ``lock`` serialises what uses the credentials to change the run's state (reclaiming,
    resolving); ``done`` turns true once the run is resolved, released or lost. ``attempt`` is
    0 while the run's command runs the first time, ``k`` when it runs again under the same
    claim to confirm a failure (``--on-primary-failure bisect``).
    """

    def __init__(
        self, response: Mapping[str, Any], conn: Connection, received: datetime, fraction: float
    ) -> None:
        self.task_id: str = response["status"]["taskId"]
        self.run_id: int = int(response["runId"])
        self.task: Mapping[str, Any] = response["task"]
        self.lock = asyncio.Lock()
        self.done = False
        self.lost = False
        self.attempt = 0
        self._conn = conn
        self._fraction = fraction
        self.refresh(response, received)

    def refresh(self, response: Mapping[str, Any], received: datetime) -> None:
        """Take the credentials and ``takenUntil`` of a claim or reclaim response.

        ``received`` is best the time the request was *sent*: the queue set ``takenUntil``
        after that, so measuring from it never overestimates how long is left."""
        self.status: Mapping[str, Any] = response["status"]
        self.credentials: Mapping[str, Any] = response["credentials"]
        self.taken_until = parse_time(response["takenUntil"])
        self.reclaim_at = reclaim_at(received, self.taken_until, self._fraction)
        self.queue: Any = self._conn.queue(self.credentials)

    def __repr__(self) -> str:
        return f"<Claim {self.task_id}/{self.run_id}>"


async def claim_one(
    worker_queue: Any,
    conn: Connection,
    task_id: str,
    initial: Claim,
    *,
    options: Options,
    worker_group: str,
    worker_id: str,
    clock: Clock,
) -> Claim | None:
    """Claim ``task_id``'s current run if it may be claimed, else None (and log why).

    The definition is checked *before* claiming: claiming a foreign task and then releasing it
    would still cost that task a retry.
    """
    answers: tuple[Any, Any] = await asyncio.gather(
        worker_queue.status(task_id), worker_queue.task(task_id), return_exceptions=True
    )
    status, task = answers
    for answer in answers:
        if isinstance(answer, asyncio.CancelledError):
            raise answer
        if isinstance(answer, BaseException):
            log.info("not claiming %s: %r", task_id, answer, extra={"task_id": task_id})
            return None
    why = ineligibility(initial.task, task, options.route_prefix)
    if why:
        log.warning("not claiming %s listed by the superseder: %s", task_id, why)
        return None
    run_id = claimable_run(status["status"])
    if run_id is None:
        log.info("not claiming %s: its latest run is not pending", task_id)
        return None
    if given_back(status["status"]):
        log.info("not claiming %s: its previous run was given back, it runs itself", task_id)
        return None
    sent = clock()
    try:
        response = await worker_queue.claimTask(
            task_id, str(run_id), {"workerGroup": worker_group, "workerId": worker_id}
        )
    except TaskclusterFailure as exc:
        # 409: another worker was first, or the run was resolved meanwhile; either way not ours.
        log.info("claim of %s/%d failed (HTTP %s): %s", task_id, run_id, http_status(exc), exc)
        return None
    return Claim(response, conn, sent, options.reclaim_fraction)


async def claim_listed(
    worker_queue: Any,
    conn: Connection,
    listed: Sequence[str],
    initial: Claim,
    held: dict[str, Claim],
    reserved: set[str],
    *,
    options: Options,
    worker_group: str,
    worker_id: str,
    clock: Clock,
    spare: Callable[[str], Awaitable[str | None]] | None = None,
) -> None:
    """Claim every listed task but the initial one, ``options.claim_concurrency`` at a time,
    adding each success to ``held`` as soon as it lands (so a caller that is cancelled midway
    knows what to release). A task for which ``spare`` gives a reason is not claimed.

    ``reserved`` holds the task ids this worker holds in any task set: the queue answers a
    worker's claimTask of a run that *it* already holds with success, not 409, so without this
    two task sets of one worker could both run or resolve the same run."""
    bound = asyncio.Semaphore(max(1, options.claim_concurrency))

    async def one(task_id: str) -> None:
        if task_id in reserved:
            log.info("not claiming %s: another task set of this worker holds it", task_id)
            return
        reserved.add(task_id)
        claim = None
        try:
            async with bound:
                why = None if spare is None else await spare(task_id)
                if why is not None:
                    log.info("not claiming %s, it could only be released: %s", task_id, why)
                    return
                claim = await claim_one(
                    worker_queue,
                    conn,
                    task_id,
                    initial,
                    options=options,
                    worker_group=worker_group,
                    worker_id=worker_id,
                    clock=clock,
                )
        except Exception:
            # A queue answer we cannot read: skip this task rather than the whole set.
            log.exception("not claiming %s: claiming it broke", task_id)
        finally:
            if claim is None:
                reserved.discard(task_id)
        if claim is not None:
            held[task_id] = claim

    async with asyncio.TaskGroup() as group:
        for task_id in listed:
            if task_id != initial.task_id:
                group.create_task(one(task_id))


class Keeper:
    """Reclaims each claim it keeps until the claim is done; reports lost claims.

    ``on_lost`` is called once for a claim whose reclaim returned 409 (or that expired because
    the queue could not be reached in time); the claim is then marked ``done`` and forgotten.
    """

    def __init__(self, clock: Clock, options: Options, on_lost: Callable[[Claim], None]) -> None:
        self._clock = clock
        self._options = options
        self._on_lost = on_lost
        self._tasks: list[asyncio.Task[None]] = []

    def keep(self, claim: Claim) -> None:
        self._tasks.append(asyncio.create_task(self._loop(claim), name=f"reclaim {claim!r}"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _loop(self, claim: Claim) -> None:
        tick = self._options.tick
        while not claim.done:
            wait = (claim.reclaim_at - self._clock()).total_seconds()
            if wait > 0:
                # Short sleeps: a test's clock may jump ahead between them.
                await asyncio.sleep(min(wait, tick))
                continue
            async with claim.lock:
                if claim.done:
                    return
                if not await self._reclaim(claim):
                    claim.done = claim.lost = True
                    self._on_lost(claim)
                    return
            if self._clock() >= claim.reclaim_at:
                await asyncio.sleep(tick)  # a failed attempt: try again shortly

    async def _reclaim(self, claim: Claim) -> bool:
        """False when the claim is lost for good."""
        sent = self._clock()
        try:
            response = await claim.queue.reclaimTask(claim.task_id, str(claim.run_id))
        except TaskclusterFailure as exc:
            status = http_status(exc)
            if status in _LOST or self._clock() >= claim.taken_until:
                log.warning("lost the claim on %r (HTTP %s): %s", claim, status, exc)
                return False
            log.warning("reclaiming %r failed, will retry (HTTP %s): %s", claim, status, exc)
            return True
        claim.refresh(response, sent)
        log.debug("reclaimed %r until %s", claim, claim.taken_until.isoformat())
        return True
