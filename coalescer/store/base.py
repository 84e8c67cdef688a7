"""The store's public seam for the modules beside ``redis.py``: one round trip of queued
commands, and script calls queued on it.

Each module of :mod:`coalescer.store` owns its own keys (``history.py`` the charts' buckets,
``policy.py`` the decisions, ``bisections.py`` the findings, ...) and reads and writes them
through these two methods of :class:`~coalescer.store.Store`, as rq's registries do through a
pipeline they are given. A protocol, so that those modules do not import ``redis.py``, which
imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Pipelining(Protocol):
    #: How long a task stays indexed past its deadline, in milliseconds.
    grace_ms: int

    async def pipeline(
        self,
        fill: Callable[[Any], object],
        *,
        raise_on_error: bool = True,
        replicated: bool = False,
    ) -> list[Any]:
        """Run the commands ``fill`` queues on the pipeline it is given, in one round trip,
        and return their replies in order. Scripts Redis lost are loaded again and the round
        trip sent once more (every script call is idempotent). Raises
        :class:`~coalescer.errors.StoreError`; with ``raise_on_error`` false, a command's
        error is its reply instead. With ``replicated``, on a Cluster, the writes are done
        only once a replica holds them (a failover cannot take back what someone was told or
        what the queue was then asked to do), else the store is unavailable."""
        ...

    def eval(self, pipe: Any, name: str, key_names: Sequence[str], *args: Any) -> None:
        """Queue on ``pipe`` a call of ``store/scripts/<name>.lua`` with ``key_names`` as its
        KEYS and ``args`` as its ARGV (see the script's header)."""
        ...
