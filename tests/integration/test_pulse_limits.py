"""A Pulse message naming more routes than a task can have is set aside at once, and the
consumer goes on."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them.
# ruff: noqa: F811

from __future__ import annotations

import taskcluster

from coalescer.model import MAX_ROUTES
from coalescer.settings import Settings
from coalescer.store import Store
from tests.conftest import make_message
from tests.integration.test_pulse import (  # noqa: F401  (fixtures)
    Broker,
    _equals,
    _handled,
    broker,
    consuming,
    eventually,
    make_consumer,
    pending,
    prefix,
    pulse_settings,
    routes,
)


async def test_a_message_with_more_routes_than_a_task_can_have_is_dead_lettered(
    pulse_settings: Settings, store: Store, broker: Broker, prefix: str
) -> None:
    flood, good = taskcluster.slugid.nice(), taskcluster.slugid.nice()
    keys = [f"k{i}" for i in range(MAX_ROUTES + 1)]
    async with consuming(make_consumer(pulse_settings, store)):
        await broker.publish(make_message(flood, routes=routes(prefix, *keys)))
        await broker.publish(make_message(good, routes=routes(prefix, "k0")))
        await eventually(lambda: _equals(pending(store, "k0"), [good]), what="the good message")
        await eventually(lambda: _handled(store, 2), what="both handled")
    dead = await broker.dead()
    assert len(dead) == 1 and len(dead[0].headers["CC"]) == MAX_ROUTES + 1  # type: ignore[arg-type]
    assert (await store.stats())["events_invalid"] == "1"
    assert await broker.depth() == 0
