"""What ``coalescer demo`` prints: whole task ids, that a reader can paste into a URL."""

from __future__ import annotations

import httpx
from taskcluster import slugid

from coalescer.demo.follow import SUPERSEDES, Follower

ROOT = "http://queue.test"
SERVICE = "http://service.test"


async def test_a_primary_and_what_it_superseded_are_printed_with_whole_ids() -> None:
    primary, older = slugid.nice(), [slugid.nice(), slugid.nice()]
    artifact = f"/api/queue/v1/task/{primary}/runs/0/artifacts/{SUPERSEDES}"

    def queue(request: httpx.Request) -> httpx.Response:
        assert request.url.path == artifact
        return httpx.Response(200, json=[{"taskId": t} for t in older])

    said: list[str] = []
    follower = Follower(ROOT, SERVICE, said.append, lambda: None)
    message = {
        "payload": {"status": {"taskId": primary}, "runId": 0},
        "CC": ["route.coalesce.v1.linux64-tests"],
    }
    async with httpx.AsyncClient(transport=httpx.MockTransport(queue)) as http:
        await follower.report(http, message)
    assert follower.superseded == 2
    [line] = said
    assert f"ran {primary}, superseding 2 older: {older[0]}, {older[1]}\n" in line
    assert line.endswith(f"{SERVICE}/tasks/{primary}")
    assert "…" not in line
