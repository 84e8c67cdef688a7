"""The embedded store: Redis semantics in-process (fakeredis with Lua), for one-command starts.

It is neither shared between processes nor durable: everything is gone when the process exits.
"""

from __future__ import annotations

import logging

import fakeredis

log = logging.getLogger(__name__)


def embedded_client() -> fakeredis.FakeAsyncRedis:
    log.warning(
        "REDIS_URL is not set: using the EMBEDDED in-process store. It is not shared between "
        "processes and not durable; set REDIS_URL for production."
    )
    server = fakeredis.FakeServer(version=(7,))
    return fakeredis.FakeAsyncRedis(server=server)
