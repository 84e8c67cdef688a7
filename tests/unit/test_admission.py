"""The store's admission to its connection pool: a bounded number in, a bounded number waiting
a bounded time, the rest shed at once."""

from __future__ import annotations

import asyncio

import pytest

from coalescer.errors import StoreOverloaded, StoreUnavailable
from coalescer.store.admission import Admission


async def _hold(admission: Admission, entered: asyncio.Event, release: asyncio.Event) -> None:
    async with admission.slot():
        entered.set()
        await release.wait()


async def test_calls_past_the_pool_wait_and_enter_when_one_leaves() -> None:
    admission = Admission(1, waiting=1, wait=60)
    entered, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_hold(admission, entered, release))
    await entered.wait()
    second_in, second_release = asyncio.Event(), asyncio.Event()
    waiter = asyncio.create_task(_hold(admission, second_in, second_release))
    await asyncio.sleep(0)
    assert not second_in.is_set()
    release.set()
    await asyncio.wait_for(second_in.wait(), 10)
    second_release.set()
    await asyncio.gather(holder, waiter)


async def test_calls_past_the_waiting_bound_are_shed_at_once() -> None:
    admission = Admission(1, waiting=1, wait=60)
    entered, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_hold(admission, entered, release))
    await entered.wait()
    waiter = asyncio.create_task(_hold(admission, asyncio.Event(), release))
    await asyncio.sleep(0)
    with pytest.raises(StoreOverloaded, match="1 more calls waiting") as caught:
        async with admission.slot():
            pass
    # Load shed: a store that is unavailable for now to its callers, never an outage's reason.
    assert isinstance(caught.value, StoreUnavailable) and caught.value.reason == "overloaded"
    release.set()
    await asyncio.gather(holder, waiter)


async def test_a_call_that_waited_too_long_is_shed_and_leaves_its_place() -> None:
    admission = Admission(1, waiting=1, wait=0.01)
    entered, release = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_hold(admission, entered, release))
    await entered.wait()
    with pytest.raises(StoreOverloaded, match=r"within 0\.01 s"):
        async with admission.slot():
            pass
    release.set()
    await holder
    async with admission.slot():  # nothing leaked: the slot and the waiting place are free
        assert admission._waiters == 0
