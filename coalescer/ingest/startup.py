"""The embedded store's index, rebuilt from the queue when ``coalescer serve`` starts.

The embedded store starts empty, and ``coalescer reconcile --rebuild`` runs in another process,
which cannot reach it. So when the store is embedded and a queue is known
(``TASKCLUSTER_ROOT_URL``; credentials from the environment when the listings need them), the
web app rebuilds the index itself, as a supervised background task, with the same
:func:`~coalescer.ingest.rebuild.rebuild_index` as the command. Events that arrive meanwhile
are applied as usual: versions make the two orders give the same index.

A rebuild that fails (the queue down, a listing not read to its end) keeps the index marked
incomplete and is tried again, later and later; one the queue can never serve (no listing
endpoints, the credentials lack their scopes) stops with the reason in the log and the
heartbeat.
"""

from __future__ import annotations

import functools
import logging
import time

from coalescer.errors import CoalescerError, ConfigError
from coalescer.health import Health, Supervisor
from coalescer.ingest.rebuild import ListingFailed, queue_client, rebuild_index
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.store.census import Limits

log = logging.getLogger(__name__)

#: The background task's name (in ``/__heartbeat__``'s ``details.background``).
NAME = "rebuild-at-start"
#: Answers to the task queue listing that retrying cannot change (no endpoint, refused).
_FOR_GOOD = frozenset((401, 403, 404))


class RebuildIncomplete(CoalescerError):
    """A rebuild did not list or apply everything; the message says what was missed."""


def start_rebuild(settings: Settings, store: Store, supervisor: Supervisor) -> bool:
    """Rebuild the embedded ``store``'s index from the queue in the background, when there is a
    queue to ask; whether it was started."""
    if not store.embedded or settings.taskcluster_root_url is None:
        return False
    supervisor.health.rebuilds = True
    supervisor.service(
        NAME,
        functools.partial(rebuild_at_start, settings, store, supervisor.health),
        expected=(ListingFailed, RebuildIncomplete),
    )
    return True


async def rebuild_at_start(settings: Settings, store: Store, health: Health) -> None:
    """Rebuild the index from every active task queue and mark it rebuilt; raise when the
    rebuild is not complete (:class:`ConfigError` when retrying cannot help)."""
    root_url = settings.taskcluster_root_url
    assert root_url is not None
    log.info("rebuilding the embedded store's index from the queue at %s", root_url)
    async with queue_client(root_url) as queue:
        try:
            summary = await rebuild_index(
                store,
                queue,
                prefix=settings.route_prefix,
                rank_tag=settings.rank_tag,
                limits=Limits(settings.max_keys, settings.max_tasks),
            )
        except ListingFailed as exc:
            if exc.status in _FOR_GOOD:
                raise ConfigError(f"cannot rebuild the index from the queue: {exc}") from exc
            raise
    if not summary.complete:
        missed = "; ".join(summary.incomplete) or f"{summary.failed} tasks could not be indexed"
        raise RebuildIncomplete(f"{summary.line()}: {missed}")
    log.info("%s", summary.line())
    # The pages and the heartbeat say so now, not at the store watch's next round.
    health.index = await store.index_state(int(time.time() * 1000))
