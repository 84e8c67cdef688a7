"""The deployment the real-systems tests run against, from the environment.

``python -m tests_taskcluster.environment`` exits 2 with one line naming what is missing (``make
test-taskcluster`` runs it first); the tests' ``conftest`` refuses to start in the same way.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

#: What a run needs, and what each is for.
REQUIRED = {
    "TASKCLUSTER_ROOT_URL": "the deployment's root URL",
    "TASKCLUSTER_CLIENT_ID": "a client of the deployment",
    "TASKCLUSTER_ACCESS_TOKEN": "that client's access token",
    "PULSE_URL": "amqp(s)://user:password@host/vhost of the Pulse the queue publishes to",
}


@dataclasses.dataclass(frozen=True)
class Deployment:
    root_url: str
    client_id: str
    access_token: str
    pulse_url: str
    #: ``REDIS_URL``: an empty Redis database of the run's own; unset, a private redis-server
    redis_url: str | None

    @property
    def credentials(self) -> dict[str, str]:
        return {"clientId": self.client_id, "accessToken": self.access_token}

    @property
    def pulse_user(self) -> str:
        return urlsplit(self.pulse_url).username or "guest"


def missing(environ: Mapping[str, str]) -> list[str]:
    return [name for name in REQUIRED if not environ.get(name)]


def problem(environ: Mapping[str, str]) -> str | None:
    """One line saying what is missing or wrong, or ``None`` when a run can start."""
    absent = missing(environ)
    if absent:
        return (
            "the real-Taskcluster tests need "
            + ", ".join(f"{name} ({REQUIRED[name]})" for name in absent)
            + ": see docs/how-to/real-taskcluster.md"
        )
    if not environ["PULSE_URL"].startswith(("amqp://", "amqps://")):
        return "PULSE_URL must start with amqp:// or amqps://"
    return None


def from_environ(environ: Mapping[str, str]) -> Deployment:
    return Deployment(
        root_url=environ["TASKCLUSTER_ROOT_URL"].rstrip("/"),
        client_id=environ["TASKCLUSTER_CLIENT_ID"],
        access_token=environ["TASKCLUSTER_ACCESS_TOKEN"],
        pulse_url=environ["PULSE_URL"],
        redis_url=environ.get("REDIS_URL") or None,
    )


def main() -> int:
    message = problem(os.environ)
    if message is not None:
        print(f"make test-taskcluster: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
