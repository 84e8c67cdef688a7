"""The enforcer inside ``coalescer serve``, when the store is embedded.

The embedded store lives in the web process, so no ``coalescer enforce`` process can read its
outboxes: like the Pulse consumer (:class:`coalescer.ingest.pulse.Listener`), the enforcer then
runs as a background task of the web app, started and stopped by its lifespan. It is the same
:class:`~coalescer.policy.enforcer.Enforcer`, with ``coalescer enforce``'s defaults.

It needs a rule that decides on arrival and the queue's credentials (``TASKCLUSTER_ROOT_URL``,
``TASKCLUSTER_CLIENT_ID``, ``TASKCLUSTER_ACCESS_TOKEN``). Without them, decisions are still
taken and recorded (lineage, outbox), and the log says once, at start, what to set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

from coalescer.policy.enforcer import connect
from coalescer.settings import Settings, queue_credentials
from coalescer.store import Store

log = logging.getLogger("coalescer.policy")

#: How long a stop waits for the round in progress before interrupting it.
DRAIN_TIMEOUT = 10.0
#: The wait before running again after an unexpected failure.
RESTART_DELAY = 5.0
#: The name of the background task (visible in ``asyncio.all_tasks()``).
TASK_NAME = "coalescer enforcer"


def start_enforcer(
    settings: Settings, store: Store, *, drain_timeout: float = DRAIN_TIMEOUT
) -> EmbeddedEnforcer | None:
    """Start enforcing on the embedded ``store`` when a rule decides on arrival and the queue's
    credentials are set in the environment; None otherwise."""
    if settings.policy is None or not settings.policy.decides:
        return None
    root_url = settings.taskcluster_root_url
    creds = queue_credentials()
    missing = [
        name
        for name, present in (
            ("TASKCLUSTER_ROOT_URL", root_url),
            ("TASKCLUSTER_CLIENT_ID", creds.get("clientId")),
            ("TASKCLUSTER_ACCESS_TOKEN", creds.get("accessToken")),
        )
        if not present
    ]
    if missing or root_url is None:
        log.warning(
            "superseding decisions (COALESCER_POLICY_FILE) are recorded but NOT carried out: "
            "with the embedded store this process enforces them itself once "
            "TASKCLUSTER_ROOT_URL, TASKCLUSTER_CLIENT_ID and TASKCLUSTER_ACCESS_TOKEN are set "
            "(missing: %s)",
            ", ".join(missing),
        )
        return None
    return EmbeddedEnforcer(settings, store, root_url, creds, drain_timeout=drain_timeout)


class EmbeddedEnforcer:
    """An :class:`~coalescer.policy.enforcer.Enforcer` as a background task; :meth:`stop`
    lets the round in progress finish (within ``drain_timeout``)."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        root_url: str,
        creds: Mapping[str, str],
        *,
        drain_timeout: float = DRAIN_TIMEOUT,
    ) -> None:
        self.drain_timeout = drain_timeout
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(
            self._run(settings, store, root_url, creds), name=TASK_NAME
        )

    async def _run(
        self, settings: Settings, store: Store, root_url: str, creds: Mapping[str, str]
    ) -> None:
        try:
            public_url = settings.public_url or f"http://{settings.host}:{settings.port}"
            async with connect(
                store,
                root_url,
                creds,
                policy=settings.policy,
                public_url=public_url,
                route_prefix=settings.route_prefix,
                rank_tag=settings.rank_tag,
            ) as enforcer:
                log.info(
                    "enforcing superseding decisions in this process (embedded store) on %s as %s",
                    root_url,
                    enforcer.consumer,
                )
                while not self._stop.is_set():
                    try:
                        await enforcer.run(self._stop)
                    except Exception:
                        # Every decision stays in the outbox until carried out: run again.
                        log.exception("the enforcer failed; again in %g s", RESTART_DELAY)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._stop.wait(), RESTART_DELAY)
        except Exception:
            log.exception("the enforcer could not start; decisions are not carried out")
        log.info("enforcer stopped")

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        """Stop after the round in progress; one that takes longer than ``drain_timeout`` is
        interrupted (its entries stay in the outbox, and every action is idempotent)."""
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.drain_timeout)
        except TimeoutError:
            log.warning(
                "the enforcer did not finish its round within %g s: interrupted",
                self.drain_timeout,
            )
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
