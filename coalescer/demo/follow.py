"""What the demo prints as it happens: each primary that superseded others, once it is
resolved (its secondaries are resolved before it, with ``superseded-by.json``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx

SUPERSEDES = "public/supersedes.json"


class Follower:
    def __init__(
        self,
        root_url: str,
        service: str,
        say: Callable[[str], None],
        check: Callable[[], None],
    ) -> None:
        self.root_url = root_url
        self.service = service
        self.say = say
        self.check = check  # raises when a process of the demo has exited
        self.ran = 0
        self.superseded = 0

    async def run(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """Follow the queue's ``task-completed`` messages until ``stop`` is set."""
        seen: set[str] = set()
        while not stop.is_set():
            r = await http.get(
                f"{self.root_url}/emulator/v1/messages", params={"exchange": "task-completed"}
            )
            for message in r.json()["messages"]:
                task_id = message["payload"]["status"]["taskId"]
                if task_id in seen:
                    continue
                seen.add(task_id)
                self.ran += 1
                await self.report(http, message)
            self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def report(self, http: httpx.AsyncClient, message: dict[str, Any]) -> None:
        """Say what the completed task superseded, if anything, and where to see it."""
        task_id, run_id = message["payload"]["status"]["taskId"], message["payload"]["runId"]
        head = "route.coalesce.v1."
        key = next((c[len(head) :] for c in message["CC"] if c.startswith(head)), "?")
        url = f"{self.root_url}/api/queue/v1/task/{task_id}/runs/{run_id}/artifacts/{SUPERSEDES}"
        r = await http.get(url)
        if r.status_code == 404:
            return  # it ran alone
        r.raise_for_status()
        superseded = r.json()
        self.superseded += len(superseded)
        # Whole ids: one pasted into a page's URL or the queue's API must name the task.
        names = ", ".join(s["taskId"] for s in superseded)
        self.say(
            f"{key:<16} ran {task_id}, superseding {len(superseded)} older: {names}\n"
            f"        {self.service}/tasks/{task_id}"
        )
