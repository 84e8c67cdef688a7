"""``/metrics``: events by exchange and outcome, queries and their latency, index gauges read at
scrape time, Redis errors; and every process's counters with PROMETHEUS_MULTIPROC_DIR."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from coalescer.settings import Settings
from coalescer.web.app import create_app
from tests.conftest import make_message
from tests.web.conftest import ids, post


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def scraped(text: str) -> dict[str, float]:
    """Unlabelled samples of a scrape, by name."""
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def test_events_are_counted_by_exchange_and_outcome(client: httpx.AsyncClient) -> None:
    labels = {"source": "http", "exchange": "task-pending"}
    applied = sample("coalescer_events_total", **labels, outcome="applied")
    stale = sample("coalescer_events_total", **labels, outcome="stale")
    invalid = sample("coalescer_events_total", source="http", exchange="other", outcome="invalid")
    (a,) = ids(1)
    await post(client, make_message(a), make_message(a), {"exchange": "nope", "payload": {}})
    assert sample("coalescer_events_total", **labels, outcome="applied") == applied + 1
    assert sample("coalescer_events_total", **labels, outcome="stale") == stale + 1
    assert (
        sample("coalescer_events_total", source="http", exchange="other", outcome="invalid")
        == invalid + 1
    )
    text = (await client.get("/metrics")).text
    assert 'coalescer_events_total{exchange="task-pending",outcome="applied",source="http"}' in text


async def test_queries_and_their_latency_are_observed_at_flush(
    client: httpx.AsyncClient, app: Starlette
) -> None:
    queries = sample("coalescer_queries_total", reason="ok")
    timed = sample("coalescer_query_seconds_count")
    a, b = ids(2)
    await post(client, make_message(a), make_message(b))
    for _ in range(3):
        assert (await client.get(f"/k?taskId={a}")).status_code == 200
    assert sample("coalescer_query_seconds_count") == timed  # nothing on the hot path
    await app.state.observer.flush()
    assert sample("coalescer_queries_total", reason="ok") == queries + 3
    assert sample("coalescer_query_seconds_count") == timed + 3
    assert 0 < sample("coalescer_query_seconds_sum") < 60


async def test_index_gauges_are_read_at_scrape_time(client: httpx.AsyncClient) -> None:
    a, b, c = ids(3)
    await post(
        client,
        make_message(a, routes=("coalesce.v1.one",)),
        make_message(b, routes=("coalesce.v1.one",)),
        make_message(c, routes=("coalesce.v1.two",)),
    )
    await post(client, make_message(c, "running", routes=("coalesce.v1.two",)))
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = scraped(r.text)
    assert values["coalescer_store_up"] == 1
    assert values["coalescer_pending_tasks"] == 2
    assert values["coalescer_keys"] == 2
    assert values["coalescer_keys_with_pending"] == 1
    assert values["coalescer_oldest_pending_seconds"] == 0  # scheduled in the future


async def test_metrics_answer_without_redis_and_count_the_error(settings: Settings) -> None:
    from coalescer.store import open_store

    dead = await open_store("redis://127.0.0.1:1/0", grace_seconds=60)
    errors = sample("coalescer_store_errors_total", reason="unreachable")
    app = create_app(settings, dead)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/metrics")
    await dead.close()
    assert r.status_code == 200
    values = scraped(r.text)
    assert values["coalescer_store_up"] == 0 and "coalescer_pending_tasks" not in values
    assert sample("coalescer_store_errors_total", reason="unreachable") == errors + 1


COUNT = """
from coalescer.observe import EVENTS
EVENTS.labels("pulse", "task-pending", "applied").inc({n})
"""
SCRAPE = """
import asyncio
from coalescer import observe
from coalescer.settings import Settings
class NoStore:
    async def pipeline(self, fill):
        from coalescer.errors import StoreUnavailable
        raise StoreUnavailable("not needed here")
folder = Settings.from_environ().prometheus_multiproc_dir
print(asyncio.run(observe.exposition(NoStore(), multiproc_dir=folder)).decode())
"""


def test_several_processes_are_merged_with_prometheus_multiproc_dir(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for n in (2, 3):
        subprocess.run([sys.executable, "-c", COUNT.format(n=n)], env=env, check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-c", SCRAPE],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    ).stdout
    assert (
        'coalescer_events_total{exchange="task-pending",outcome="applied",source="pulse"} 5.0'
        in out
    )
    assert "coalescer_store_up 0.0" in out
