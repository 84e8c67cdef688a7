"""The documentation's ingest example, ``docs/examples/events.json``, posted as it is to a real
``coalescer serve``: every message is applied, and the key then knows the task."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving import serving

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "events.json"
TOKEN = "docs-example-token"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    """The base URL of a ``coalescer serve`` process on the embedded store."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_")) and k != "REDIS_URL"
    }
    env.update(COALESCER_INGEST_TOKEN=TOKEN)
    with serving(env, tmp_path / "serve.log") as (base, _):
        yield base


def _key(route: str) -> str:
    prefix = "route.coalesce.v1."
    assert route.startswith(prefix), route
    return route[len(prefix) :]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_documented_events_body_is_applied_and_answers_queries(service: str) -> None:
    body = EXAMPLE.read_bytes()
    messages = json.loads(body)
    r = httpx.post(
        f"{service}/v1/events",
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    tasks = [m["payload"]["status"]["taskId"] for m in messages]
    assert r.json() == {"results": [{"status": "applied", "taskId": t} for t in tasks]}

    for message, task in zip(messages, tasks, strict=True):
        for route in message["CC"]:
            key = _key(route)
            listing = httpx.get(f"{service}/{key}", params={"format": "json"}, timeout=10)
            assert listing.status_code == 200, listing.text
            assert task in [p["taskId"] for p in listing.json()["pending"]]
            answer = httpx.get(f"{service}/{key}", params={"taskId": task}, timeout=10)
            assert answer.status_code == 200, answer.text
            assert task in answer.json()["supersedes"]

    # Posting it again changes nothing: the index already holds these versions.
    again = httpx.post(
        f"{service}/v1/events",
        content=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert [x["status"] for x in again.json()["results"]] == ["stale"] * len(tasks)
