"""The loop the end-to-end test needs: a queue emulator that accepts ``superseded`` (as
docker-worker's queue did), and the service on a free port, on the test's event loop (where the
store is)."""

from __future__ import annotations

import dataclasses

import pytest

from coalescer.emulator.harness import TEST_OPTIONS
from coalescer.emulator.runtime import EmulatorOptions
from tests.worker.test_with_service import service  # noqa: F401 (the service on a free port)


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, legacy=True)
