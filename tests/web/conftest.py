"""Fixtures for the web tests: the app over the real Redis store, a client, a scenario."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import taskcluster
from starlette.applications import Starlette

from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app
from tests.conftest import make_message

AUTH = {"Authorization": "Bearer s3cret"}
HTML = {"Accept": "text/html,application/xhtml+xml"}


@pytest.fixture
def app(settings: Settings, store: Store) -> Starlette:
    return create_app(settings, store)


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as c:
        yield c


def ids(n: int) -> list[str]:
    return [taskcluster.slugid.nice() for _ in range(n)]


def at(minute: int) -> str:
    return f"2030-01-01T00:{minute:02d}:00.000Z"


async def post(client: httpx.AsyncClient, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post("/v1/events", json=list(messages), headers=AUTH)
    assert r.status_code == 200, r.text
    results: list[dict[str, Any]] = r.json()["results"]
    return results


async def supersede_scenario(
    client: httpx.AsyncClient, app: Starlette, key: str = "k"
) -> tuple[str, str, str, str]:
    """Tasks a, b, c, d pending on ``key``; the worker holding ``b`` asks and is told
    ``[a, b, c]``... then ``d`` arrives later; ``c`` runs and completes, ``a`` and ``b`` are
    resolved exception/superseded; ``d`` stays pending. Returns ``(a, b, c, d)``."""
    a, b, c, d = ids(4)
    route = (f"coalesce.v1.{key}",)
    await post(
        client, *(make_message(t, scheduled=at(i), routes=route) for i, t in enumerate((a, b, c)))
    )
    r = await client.get(f"/{key}?taskId={b}")
    assert r.json() == {"supersedes": [a, b, c]}
    await app.state.observer.flush()
    await post(client, make_message(d, scheduled=at(5), routes=route))
    await post(
        client,
        make_message(c, "running", scheduled=at(2), routes=route),
        make_message(a, "running", scheduled=at(0), routes=route),
        make_message(b, "running", scheduled=at(1), routes=route),
    )
    await post(
        client,
        make_message(a, "exception", scheduled=at(0), routes=route, reason="superseded"),
        make_message(b, "exception", scheduled=at(1), routes=route, reason="superseded"),
        make_message(c, "completed", scheduled=at(2), routes=route),
    )
    return a, b, c, d
