"""Calls run side by side that all end before an error is raised."""

from __future__ import annotations

import asyncio

import pytest

from coalescer.concurrency import all_ended


async def test_the_results_come_in_the_calls_order() -> None:
    async def later(value: int, turns: int) -> int:
        for _ in range(turns):
            await asyncio.sleep(0)
        return value

    assert await all_ended(later(1, 3), later(2, 0), later(3, 1)) == [1, 2, 3]
    assert await all_ended() == []


async def test_an_error_is_raised_once_every_other_call_has_ended() -> None:
    ended: list[str] = []
    release = asyncio.Event()

    async def fails() -> None:
        ended.append("fails")
        raise LookupError("first")

    async def fails_later() -> None:
        await release.wait()
        ended.append("fails later")
        raise KeyError("second")

    async def slow() -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        ended.append("slow")
        release.set()

    with pytest.raises(LookupError, match="first"):
        await all_ended(fails(), fails_later(), slow())
    # Neither cancelled nor left running: each ran to its end before the first error surfaced.
    assert sorted(ended) == ["fails", "fails later", "slow"]
