"""Request ids and structured logs, off the query path."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import httpx
import orjson
import pytest

from coalescer import logs
from coalescer.settings import Settings
from coalescer.web.app import create_app


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """What the service logs, formatted as ``coalescer.logs.setup`` does."""
    out = io.StringIO()
    handler = logs.make_handler(stream=out)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield out
    root.removeHandler(handler)
    root.setLevel(level)


def parsed(out: io.StringIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in out.getvalue().splitlines()]


async def test_an_incoming_request_id_is_echoed_and_logged(
    client: httpx.AsyncClient, log_lines: io.StringIO
) -> None:
    r = await client.get("/", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    (line,) = [d for d in parsed(log_lines) if d["logger"] == "coalescer.web"]
    assert line["request_id"] == "abc-123"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/", 200)
    assert line["level"] == "info" and isinstance(line["duration_ms"], float)


async def test_a_request_id_is_made_when_missing_or_unusable(client: httpx.AsyncClient) -> None:
    made = (await client.get("/v1/ping")).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    odd = (await client.get("/v1/ping", headers={"X-Request-Id": "a b\tc"})).headers
    assert re.fullmatch(r"[0-9a-f]{32}", odd["x-request-id"])


async def test_errors_carry_the_request_id_and_probes_log_quietly(
    client: httpx.AsyncClient, log_lines: io.StringIO
) -> None:
    r = await client.get("/tasks/nope", headers={"X-Request-Id": "r1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "r1"
    await client.get("/__lbheartbeat__", headers={"X-Request-Id": "r2"})
    lines = {d["request_id"]: d for d in parsed(log_lines) if d["logger"] == "coalescer.web"}
    assert lines["r1"]["status"] == 400
    assert "r2" not in lines  # DEBUG: load balancers poll it all the time


async def test_lines_logged_while_handling_a_request_carry_its_id(
    settings: Settings, log_lines: io.StringIO
) -> None:
    from coalescer.store import open_store

    dead = await open_store("redis://127.0.0.1:1/0", grace_seconds=60)
    app = create_app(settings, dead)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.get("/", headers={"X-Request-Id": "down-1"})
    await dead.close()
    assert r.status_code == 503 and r.headers["x-request-id"] == "down-1"
    store_line = next(d for d in parsed(log_lines) if "store unavailable" in str(d["message"]))
    assert store_line["request_id"] == "down-1" and store_line["level"] == "error"


async def test_the_query_path_is_not_traced(client: httpx.AsyncClient) -> None:
    r = await client.get("/k?taskId=fN1SbArXTPSVFNUvaOlinQ", headers={"X-Request-Id": "q"})
    assert r.status_code == 200 and "x-request-id" not in r.headers
    listing = await client.get("/k", headers={"X-Request-Id": "l"})
    assert listing.headers["x-request-id"] == "l"


async def test_long_paths_and_queries_are_clipped_in_log_lines(
    client: httpx.AsyncClient, log_lines: io.StringIO
) -> None:
    path = "/" + "k" * 4999
    r = await client.get(path, params={"age": "1" * 3000}, headers={"X-Request-Id": "long"})
    assert r.status_code == 400
    (raw,) = [line for line in log_lines.getvalue().splitlines() if '"long"' in line]
    assert len(raw) < 2000
    line = orjson.loads(raw)
    kept = logs.MAX_VALUE
    assert line["path"] == path[:kept] + f"…(+{5000 - kept} chars)"
    assert line["message"] == f"GET {path[:kept]}…(+{5000 - kept} chars) 400"
    assert str(line["query"]).endswith(f"…(+{len('age=') + 3000 - kept} chars)")


def test_a_record_is_clipped_once_whatever_the_number_of_handlers() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%s", ("a" * 300,), None)
    record.path = "p" * 300
    for _ in range(2):
        assert logs.ClipLong().filter(record)
    assert record.getMessage() == "a" * logs.MAX_VALUE + f"…(+{300 - logs.MAX_VALUE} chars)"
    assert record.path == "p" * logs.MAX_VALUE + f"…(+{300 - logs.MAX_VALUE} chars)"


def test_clip_keeps_short_values_whole() -> None:
    assert logs.clip("short") == "short"
    assert logs.clip("x" * 10, limit=4) == "xxxx…(+6 chars)"
