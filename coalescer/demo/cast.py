"""Who takes part in the demo, and how each is started: the service (and its own Pulse
consumer with Redis and a broker), the queue emulator publishing to it, the workers."""

from __future__ import annotations

import argparse
import dataclasses
from urllib.parse import urlparse

from coalescer.demo.processes import Processes

TASK_QUEUE = "demo/linux"
#: The service's charts in 5-second buckets (2 hours of them), so that a demo of a minute
#: draws something to look at; a deployment keeps the default minute.
HISTORY_BUCKET_SECONDS = "5"


@dataclasses.dataclass(frozen=True)
class Cast:
    args: argparse.Namespace
    port: int
    emulator_port: int

    @property
    def service(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def root_url(self) -> str:
        """The emulator's: the queue's root URL, and the Taskcluster UI's (``/tasks/<id>``)."""
        return f"http://127.0.0.1:{self.emulator_port}"

    async def start(self, processes: Processes) -> None:
        """Start everyone, and wait until the service and the queue answer."""
        a = self.args
        service_env = {
            # Task ids on the pages link to the emulator's task page (and the service may ask
            # the emulator about a task it has not seen yet).
            "TASKCLUSTER_ROOT_URL": self.root_url,
            "COALESCER_HISTORY_BUCKET_SECONDS": HISTORY_BUCKET_SECONDS,
        }
        if a.redis_url:
            service_env["REDIS_URL"] = a.redis_url
        if a.pulse_url:
            service_env["PULSE_URL"] = a.pulse_url
            # One queue for every demo run (Pulse lets a user declare queue/<user>/... only).
            user = urlparse(a.pulse_url).username or "guest"
            service_env["PULSE_QUEUE"] = f"queue/{user}/coalescer-demo"
        env = processes.env(**service_env)
        await processes.start("service", "serve", "--port", str(self.port), env=env)
        if a.pulse_url and a.redis_url:  # with Redis, the consumer is a process of its own
            await processes.start("listen", "listen", "--declare-exchanges", env=env)
        publish = (
            ["--pulse-url", a.pulse_url]
            if a.pulse_url
            else ["--publish-to", f"{self.service}/v1/events"]
        )
        await processes.start(
            "emulator",
            "emulator",
            "--port",
            str(self.emulator_port),
            "--legacy",
            "--claim-work-timeout",
            "2",
            *publish,
            env=processes.env(),
        )
        await processes.wait_http(f"{self.service}/__lbheartbeat__", "the service")
        await processes.wait_http(f"{self.root_url}/api/queue/v1/ping", "the queue emulator")
        worker_env = processes.env(
            TASKCLUSTER_ROOT_URL=self.root_url,
            TASKCLUSTER_CLIENT_ID="demo",
            TASKCLUSTER_ACCESS_TOKEN="demo",
        )
        for i in range(1, a.workers + 1):
            await processes.start(
                f"worker-{i}",
                "worker",
                "--task-queue-id",
                TASK_QUEUE,
                "--worker-group",
                "demo",
                "--worker-id",
                f"w{i}",
                "--superseder-allow",
                f"{self.service}/",
                env=worker_env,
            )
