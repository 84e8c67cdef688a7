"""What the store's helper modules (views, policy) need of a :class:`~coalescer.store.Store`: one
round trip of queued commands, and script calls queued on it. A protocol, so that those modules
do not import ``redis.py``, which imports them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Pipelining(Protocol):
    grace_ms: int

    async def _pipeline(
        self, fill: Callable[[Any], object], *, raise_on_error: bool = True
    ) -> list[Any]: ...

    def _eval(self, pipe: Any, name: str, key_names: Sequence[str], *args: Any) -> None: ...
