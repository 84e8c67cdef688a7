"""Running calls side by side, and ending them together."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def all_ended(*calls: Awaitable[T]) -> list[T]:
    """Await every call at once and return their results in order; once *all* have ended, raise
    the first error among them. Unlike ``asyncio.gather`` (which raises at the first error) or a
    ``TaskGroup`` (which cancels the others), no call is left running, or cut short, behind an
    error: for calls whose effects the caller's clean-up or next round must not overlap."""
    ended = await asyncio.gather(*calls, return_exceptions=True)
    results: list[T] = []
    for one in ended:
        if isinstance(one, BaseException):
            raise one
        results.append(one)
    return results
