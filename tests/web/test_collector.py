"""The web process collects reference cycles on a timer, whatever its collector's threshold."""

from __future__ import annotations

import gc
import weakref

import pytest

from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web import app as web_app
from tests.worker.support import poll


class Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_a_reference_cycle_in_the_oldest_generation_is_collected_on_a_timer(
    store: Store, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(web_app, "COLLECT_SECONDS", 0.1)
    threshold = gc.get_threshold()
    app = web_app.create_app(Settings.from_environ({"REDIS_URL": redis_url}), store)
    try:
        async with app.router.lifespan_context(app):
            cycle = Cycle()
            gone = weakref.ref(cycle)
            gc.collect()  # it survives into the oldest generation, which only a full collection
            del cycle  # looks at: with the service's threshold, hardly ever by itself
            await poll(lambda: gone() is None, within=10, what="the cycle collected")
    finally:
        gc.set_threshold(*threshold)  # as the lifespan found it, for the tests after this one
        gc.unfreeze()
