"""How many store calls of one process use its Redis connection pool at once, and how long the
others wait for a connection: a burst is served as fast as the pool allows, or shed.

Each process's pool holds :data:`POOL_SIZE` connections. Without a bound on who waits, a burst
of page or listing requests larger than the pool made redis-py refuse the rest with "Too many
connections", a false outage. :class:`Admission` lets :data:`POOL_SIZE` calls in at once; the
next :data:`WAITING` wait, each at most :data:`WAIT_SECONDS`; the rest, and those that waited
that long, raise :class:`~coalescer.errors.StoreOverloaded` at once: load shed, answered ``503``
with ``Retry-After`` at the web edge, never counted as a store error. Shedding at once keeps
the event loop free to answer new clients while the burst drains.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from coalescer.errors import StoreOverloaded

#: Connections in each process's Redis pool (redis-py's ``max_connections``).
POOL_SIZE = 256
#: Calls that may wait for a connection of the pool while every one is in use.
WAITING = 256
#: The longest a call waits for a connection before it is shed.
WAIT_SECONDS = 0.5


class Admission:
    """At most ``size`` calls at once; ``waiting`` more wait, each ``wait`` seconds at most."""

    def __init__(
        self, size: int = POOL_SIZE, *, waiting: int = WAITING, wait: float = WAIT_SECONDS
    ) -> None:
        self.size = size
        self.waiting = waiting
        self.wait = wait
        self._slots = asyncio.Semaphore(size)
        self._waiters = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one of the pool's connections for the block; raises :class:`StoreOverloaded`
        when none comes free soon enough."""
        if self._slots.locked():
            if self._waiters >= self.waiting:
                raise self._shed(f"{self._waiters} more calls waiting")
            self._waiters += 1
            try:
                async with asyncio.timeout(self.wait):
                    await self._slots.acquire()
            except TimeoutError:
                raise self._shed(f"none came free within {self.wait:g} s") from None
            finally:
                self._waiters -= 1
        else:
            await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()

    def _shed(self, why: str) -> StoreOverloaded:
        return StoreOverloaded(
            f"every one of the {self.size} connections to Redis is in use ({why}): "
            "load shed, retry shortly"
        )
