"""The suite's event loops: every one closed by whoever made it (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest


async def test_an_async_test_runs_on_a_loop_of_its_own() -> None:
    assert asyncio.get_running_loop().is_running()


def test_no_test_process_makes_a_current_loop_nobody_closes() -> None:
    # Where no loop was ever set, get_event_loop() makes one; pytest-asyncio calls it around
    # every async test and leaves what it got as the current loop, unclosed.
    with pytest.raises(RuntimeError, match="no current event loop"):
        asyncio.get_event_loop_policy().get_event_loop()


def test_asyncio_run_after_async_tests_leaves_nothing_for_the_collector() -> None:
    async def nothing() -> None:
        pass

    asyncio.run(nothing())  # unsets the current loop: an unclosed one would now be garbage
    gc.collect()  # its unclosed-socket warning is an error here (filterwarnings = error)
