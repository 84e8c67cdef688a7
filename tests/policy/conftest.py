"""Fixtures for superseding policies: a legacy queue emulator (it accepts ``superseded``, as
queues before Taskcluster v40 did) and the loop that ties it to the index."""

from __future__ import annotations

import dataclasses

import pytest

from coalescer.emulator.harness import TEST_OPTIONS, QueueEmulator
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.policy.rules import Policy
from coalescer.store import Store
from tests.policy.support import Loop, rule


@pytest.fixture
def legacy() -> bool:
    return True


@pytest.fixture
def queue_emulator_options(legacy: bool) -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, legacy=legacy)


@pytest.fixture
def policy() -> Policy:
    """Override per test module or test; by default latest-wins on key ``k``."""
    return rule("k", strategy="latest-wins")


@pytest.fixture
def loop(queue_emulator: QueueEmulator, store: Store, policy: Policy) -> Loop:
    return Loop(queue_emulator, store, policy)
