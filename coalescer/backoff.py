"""The one retry policy: exponential backoff with jitter. Pure: no IO, no clock.

Every loop that retries something that failed (the store, the broker, the queue, a sink, a
background task) waits what :meth:`Backoff.next` says: ``initial`` seconds after the first
failure, twice as long after each next one, at most ``maximum``, and :meth:`Backoff.reset` once
a try succeeds. Each wait is shortened by up to ``jitter`` of itself at random, so that the
processes and tasks that failed together (a Redis restart fails every consumer at once) do not
retry together::

    backoff = Backoff(1.0, maximum=30.0)
    while True:
        try:
            return await connect()
        except Unavailable:
            await asyncio.sleep(backoff.next())
"""

from __future__ import annotations

import dataclasses
import random

#: The share of each wait drawn at random by default: a wait is between half and all of it.
JITTER = 0.5


@dataclasses.dataclass
class Backoff:
    """Waits between tries: ``initial``, doubling up to ``maximum``, each less up to ``jitter``
    of itself at random (``jitter`` 0: exactly those)."""

    initial: float
    maximum: float = 30.0
    jitter: float = JITTER
    rng: random.Random = dataclasses.field(default_factory=random.Random, repr=False)
    #: The wait before jitter that :meth:`next` gives next.
    base: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"need 0 < initial <= maximum, not {self.initial}, {self.maximum}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be from 0 to less than 1, not {self.jitter}")
        self.base = self.initial

    def next(self) -> float:
        """The wait before the next try; the one after it is twice as long (up to ``maximum``)."""
        wait = self.base * (1 - self.jitter * self.rng.random())
        self.base = min(self.base * 2, self.maximum)
        return wait

    def reset(self) -> None:
        """A try succeeded: the next failure waits ``initial`` again."""
        self.base = self.initial
