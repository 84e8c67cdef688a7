"""Hostile input at the HTTP edge, over the real Redis store: ids and keys are matched whole, a
message cannot name more routes than a task can have, a client leaving mid-body is no error,
and every response tells a browser how to treat it."""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette
from starlette.types import Message

from coalescer.store import Store
from coalescer.web import pages
from tests.conftest import make_message
from tests.web.conftest import AUTH, HTML, ids, post


async def test_a_task_id_or_key_with_a_trailing_newline_is_a_400(
    client: httpx.AsyncClient,
) -> None:
    (task,) = ids(1)
    r = await client.get(f"/k?taskId={task}%0A")
    assert r.status_code == 400
    assert "malformed taskId" in r.json()["error"]
    r = await client.get(f"/k%0A?taskId={task}")
    assert r.status_code == 400
    assert "malformed coalescing key" in r.json()["error"]


async def test_ingest_refuses_newline_ids_and_more_routes_than_a_task_can_have(
    client: httpx.AsyncClient, store: Store
) -> None:
    a, b, c = ids(3)
    newline = make_message(a)
    newline["payload"]["status"]["taskId"] = a + "\n"
    flood = make_message(b, routes=tuple(f"coalesce.v1.k{i}" for i in range(65)))
    results = await post(client, newline, flood, make_message(c, routes=("coalesce.v1.k\n",)))
    assert [r["status"] for r in results] == ["invalid", "invalid", "ignored"]
    assert "status/taskId: " in results[0]["error"] and "does not match" in results[0]["error"]
    assert "at most 64" in results[1]["error"]
    assert await store.keys() == []


def error_count(status: str) -> float:
    return REGISTRY.get_sample_value("coalescer_http_errors_total", {"status": status}) or 0.0


async def test_a_client_leaving_mid_body_is_no_error_and_applies_nothing(
    app: Starlette, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    (task,) = ids(1)
    body = orjson.dumps([make_message(task)])
    arrivals: list[Message] = [
        {"type": "http.request", "body": body[:40], "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return arrivals.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/events",
        "raw_path": b"/v1/events",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"test"),
            (b"authorization", AUTH["Authorization"].encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
        "state": {},
    }
    before = error_count("500")
    await app(scope, receive, send)
    assert sent[0]["status"] == 499  # nginx's "client closed request"
    assert error_count("500") == before
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert "POST /v1/events 499" in [r.getMessage() for r in caplog.records]
    assert await store.keys() == []


async def test_pages_forbid_scripts_framing_and_sniffing(client: httpx.AsyncClient) -> None:
    (task,) = ids(1)
    await post(client, make_message(task))
    for url in ("/", "/k", f"/tasks/{task}", "/tasks/nope", "/v1/nothing-here"):
        r = await client.get(url, headers=HTML)
        assert r.headers["content-type"].startswith("text/html"), url
        assert r.headers["content-security-policy"] == pages.CSP, url
        assert r.headers["x-frame-options"] == "DENY", url
        assert r.headers["x-content-type-options"] == "nosniff", url
    assert "default-src 'none'" in pages.CSP
    assert "script-src" not in pages.CSP and "unsafe-inline" not in pages.CSP


async def test_the_policy_allows_exactly_the_stylesheet_the_pages_carry(
    client: httpx.AsyncClient,
) -> None:
    r = await client.get("/", headers=HTML)
    styles = re.findall(r"<style>(.*?)</style>", r.text, re.DOTALL)
    assert len(styles) == 1
    digest = base64.b64encode(hashlib.sha256(styles[0].encode()).digest()).decode()
    assert f"style-src 'sha256-{digest}'" in r.headers["content-security-policy"]
    assert " style=" not in r.text  # inline style attributes would need 'unsafe-inline'


async def test_every_other_response_says_nosniff(client: httpx.AsyncClient) -> None:
    (task,) = ids(1)
    await post(client, make_message(task))
    for url in (f"/k?taskId={task}", "/k?taskId=bad", "/k", "/v1/stats", "/metrics", "/nope/"):
        r = await client.get(url)
        assert r.headers["x-content-type-options"] == "nosniff", url
