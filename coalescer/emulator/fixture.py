"""Pytest plugin: the ``queue_emulator`` fixture, to test a worker against an emulated queue.

Registered through the ``pytest11`` entry point ``coalescer_emulator``, so installing coalescer
makes the fixture available to every test suite. Importing this module only defines fixtures;
the emulator (uvicorn, starlette, taskcluster) is imported when a test first asks for one.

Usage::

    def test_my_worker(queue_emulator):
        task_id = queue_emulator.create_task(routes=["coalesce.v1.my-key"])
        run_my_worker(root_url=queue_emulator.root_url)
        assert queue_emulator.queue().status(task_id)["status"]["state"] == "completed"
        assert queue_emulator.wait_for_message("task-completed", task_id)

Override ``queue_emulator_options`` to change the emulator, e.g. ``legacy=True`` to accept
``superseded``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from coalescer.emulator.harness import QueueEmulator
    from coalescer.emulator.runtime import EmulatorOptions


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    """Options for ``queue_emulator``: by default short long-polls and a controllable clock."""
    from coalescer.emulator.harness import TEST_OPTIONS

    return TEST_OPTIONS


@pytest.fixture
def queue_emulator(queue_emulator_options: EmulatorOptions) -> Iterator[QueueEmulator]:
    """A queue emulator on a free loopback port, for this test only.

    Yields a :class:`coalescer.emulator.harness.QueueEmulator`: ``.root_url`` for the taskcluster
    client, ``.clock.advance(seconds)``, ``.published`` (every Pulse message emitted),
    ``.queue()``/``.aio_queue()`` clients, ``.create_task(**overrides)`` and
    ``.wait_for_message(kind, task_id)``.
    """
    from coalescer.emulator.harness import QueueEmulator

    with QueueEmulator(queue_emulator_options) as emulator:
        yield emulator
