"""Fixtures for the worker shim: the queue emulator (legacy or current), a superseder that
answers whatever a test wants, and a shim wired to both."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.worker import Options, Shim
from tests.worker.support import Served, Superseder, Tasks, make_shim


@pytest.fixture
def superseder() -> Iterator[Superseder]:
    s = Superseder()
    app = Starlette(routes=[Route("/v1/bisections/gap", s.gap), Route("/{key:path}", s.endpoint)])
    with Served(app) as served:
        s.url = served.url
        yield s


@pytest.fixture
def legacy() -> bool:
    """Whether the emulated queue accepts ``superseded`` (Taskcluster before v40)."""
    return True


@pytest.fixture
def queue_emulator_options(legacy: bool) -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, legacy=legacy)


@pytest.fixture
def options(superseder: Superseder) -> Options:
    return Options(allow=(superseder.url,), timeout=2.0, tick=0.02)


@pytest.fixture
async def shim(queue_emulator: QueueEmulator, options: Options) -> AsyncIterator[Shim]:
    async with make_shim(queue_emulator, options) as s:
        yield s


@pytest.fixture
def tasks(queue_emulator: QueueEmulator, superseder: Superseder) -> Tasks:
    return Tasks(queue_emulator, superseder)
