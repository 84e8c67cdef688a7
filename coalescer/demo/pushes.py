"""The demo's pushes: every ``--interval`` seconds one task per key, each running ``sleep``
with the service as its ``supersederUrl``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import httpx

from coalescer.demo.cast import TASK_QUEUE


class Pusher:
    def __init__(
        self, root_url: str, service: str, keys: Sequence[str], *, interval: float, sleep: float
    ) -> None:
        self.root_url = root_url
        self.service = service
        self.keys = keys
        self.interval = interval
        self.sleep = sleep
        self.pushed = 0

    def task(self, key: str) -> dict[str, Any]:
        """The definition of a demo task on ``key``."""
        import taskcluster

        return {
            "taskQueueId": TASK_QUEUE,
            "created": taskcluster.fromNowJSON("0 seconds"),
            "deadline": taskcluster.fromNowJSON("1 hour"),
            "routes": [f"coalesce.v1.{key}"],
            "payload": {
                "command": ["sleep", f"{self.sleep:g}"],
                "supersederUrl": f"{self.service}/{key}",
                "maxRunTime": 600,
            },
            "metadata": {
                "name": f"demo {key}",
                "description": "coalescer demo task",
                "owner": "demo@example.com",
                "source": "https://github.com/taskcluster",
            },
        }

    async def run(self, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        """Push until ``stop`` is set."""
        import taskcluster

        while not stop.is_set():
            for key in self.keys:
                task_id = taskcluster.slugid.nice()
                r = await http.put(
                    f"{self.root_url}/api/queue/v1/task/{task_id}", json=self.task(key)
                )
                r.raise_for_status()
                self.pushed += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
