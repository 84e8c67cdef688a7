"""Record the replay's real-queue histories: each scenario runs on a real Taskcluster queue
(the product's processes against it, as ``make test-taskcluster`` runs them), then its task
group is read as ``coalescer replay --task-group ID --save FILE`` reads it, and kept.

    . ~/.cache/taskcluster-local/client.env     # or any deployment: TASKCLUSTER_*, PULSE_URL
    python scripts/record_history.py --out tests/replay/histories [SCENARIO ...]

Each scenario writes ``<name>.json`` (a recorded history, replayed with ``coalescer replay
--recorded``) and ``<name>.events.jsonl`` (the Pulse messages ``coalescer listen`` applied,
replayed with ``--events``). Scenarios (all by default): see :data:`SCENARIOS`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coalescer.replay import recorded, sources  # noqa: E402
from coalescer.replay.links import Evidence  # noqa: E402
from tests.redis_server import redis_server  # noqa: E402
from tests_taskcluster.environment import from_environ, problem  # noqa: E402
from tests_taskcluster.support import RESOLVED, Loop, RealQueue, Run  # noqa: E402

#: The token the service takes findings with, and the workers report them with.
TOKEN = "record-history"
PUSHES = 6
#: Seconds between pushes, and each kind's run (a build's test depends on it).
EVERY, BUILD, TEST, MAC = 4, 6, 3, 5


class Scenario:
    """One recording: the product's processes on the queue, the pushes, the end."""

    def __init__(self, loop: Loop, queue: RealQueue, run: Run) -> None:
        self.loop, self.queue, self.run = loop, queue, run
        self.service = ""
        self.ids: list[str] = []

    def task_queue(self, kind: str) -> str:
        return f"coalescer-rt/{kind}-{self.run.uid}"

    def worker(self, kind: str, *extra: str) -> None:
        self.loop.procs.start(
            f"worker-{kind}", "worker",
            "--task-queue-id", self.task_queue(kind),
            "--worker-group", "coalescer-rt",
            "--worker-id", f"{kind}-{self.run.uid}",
            "--superseder-allow", f"{self.service}/",
            *extra,
        )  # fmt: skip

    def enforcer(self, policy: str) -> None:
        path = self.loop.logs / "policy.yaml"
        path.write_text(policy)
        self.loop.env["COALESCER_POLICY_FILE"] = str(path)

    def create(self, kind: str, command: str, *, asking: bool, **task: Any) -> str:
        superseder = f"{self.service}/{kind}" if asking else None
        task_id = self.queue.create(
            kind, superseder=superseder, command=command, taskQueueId=self.task_queue(kind), **task
        )
        self.ids.append(task_id)
        return task_id

    async def pushes(self, count: int, *, asking: tuple[str, ...], mac: bool = True) -> None:
        """``count`` pushes ``EVERY`` seconds apart: a build, its test, a mac task."""
        for n in range(count):
            if n:
                await asyncio.sleep(EVERY)
            build = self.create("build", f"sleep {BUILD}", asking="build" in asking)
            self.create("test", f"sleep {TEST}", asking="test" in asking, dependencies=[build])
            if mac:
                self.create("mac", f"sleep {MAC}", asking="mac" in asking)

    def settled(self) -> bool:
        """Every task resolved, but a dependent whose dependency did not complete."""
        for task_id in self.ids:
            status = self.queue.status(task_id)
            if status["state"] in RESOLVED:
                continue
            if status["state"] != "unscheduled":
                return False
            for dep in self.queue.client.task(task_id)["dependencies"]:
                if dep != task_id and self.queue.state(dep) == "completed":
                    return False
        return True

    async def until(self, check: Callable[[], bool], what: str, within: float = 240) -> None:
        await self.loop.eventually(lambda: _thread(check), what, within=within)


async def _thread(check: Callable[[], bool]) -> bool:
    return await asyncio.to_thread(check)


async def shim(s: Scenario) -> None:
    """Worker shims (one per task queue, up before the pushes) supersede on claim."""
    for kind in ("build", "test", "mac"):
        s.worker(kind)
    await s.pushes(PUSHES, asking=("build", "test", "mac"))


LATEST_WINS = """\
rules:
  - name: builds
    keys: build
    strategy: latest-wins
  - name: mac
    keys: mac
    strategy: latest-wins
"""


async def latest_wins(s: Scenario) -> None:
    """``coalescer enforce`` under latest-wins for builds and mac tasks; tests ask on claim."""
    for kind in ("build", "test", "mac"):
        s.worker(kind)
    s.loop.procs.start("enforce", "enforce", "--poll", "0.2")
    await s.pushes(PUSHES, asking=("test",))


BISECT = """\
rules:
  - name: bisect
    keys: build
    strategy: latest-wins
    on-primary-failure: bisect
"""
#: The bisections' pushes, and the first that fails.
SEARCHED, FIRST_BAD = 8, 5


def failing(push: int) -> str:
    return f"sleep 2; test {push} -lt {FIRST_BAD}"


async def enforcer_bisect(s: Scenario) -> None:
    """The enforcer holds eight pushes of one key for the newest, which fails from push 5 on;
    a worker starts, and the enforcer's search locates the culprit."""
    s.loop.procs.start("enforce", "enforce", "--poll", "0.2")
    for push in range(1, SEARCHED + 1):
        s.create("build", failing(push), asking=False)
        await asyncio.sleep(1)

    def held() -> bool:
        return all(
            [r["state"] for r in s.queue.status(t)["runs"]] == ["running"] for t in s.ids[:-1]
        )

    await s.until(held, "the enforcer to hold the older pushes")
    s.worker("build")


async def shim_bisect(s: Scenario) -> None:
    """Eight pushes of one key wait for a worker shim that bisects after a failed primary."""
    for push in range(1, SEARCHED + 1):
        s.create("build", failing(push), asking=True)
        await asyncio.sleep(1)
    await asyncio.sleep(3)
    s.worker("build", "--on-primary-failure", "bisect")


async def late_pool(s: Scenario) -> None:
    """Five pushes of a build and a mac task, then the pool starts: one shim per queue."""
    for _ in range(5):
        s.create("build", f"sleep {BUILD}", asking=True)
        s.create("mac", f"sleep {MAC}", asking=True)
        await asyncio.sleep(2)
    await asyncio.sleep(10)
    s.worker("build")
    s.worker("mac")


SCENARIOS: dict[str, tuple[Callable[[Scenario], Awaitable[None]], str | None]] = {
    "shim": (shim, None),
    "latest-wins": (latest_wins, LATEST_WINS),
    "enforcer-bisect": (enforcer_bisect, BISECT),
    "shim-bisect": (shim_bisect, None),
    "late-pool": (late_pool, None),
}


async def record(name: str, out: Path) -> Path:
    drive, policy = SCENARIOS[name]
    deployment = from_environ(os.environ)
    run = Run.new(deployment.pulse_user)
    logs = out / f".{name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    events = out / f"{name}.events.jsonl"
    events.unlink(missing_ok=True)
    with redis_server() as server:
        loop = Loop(deployment, run, server.url, logs)
        queue = RealQueue(deployment, run)
        s = Scenario(loop, queue, run)
        loop.env["COALESCER_INGEST_TOKEN"] = TOKEN
        loop.env["COALESCER_RECORD_FILE"] = str(events)
        if policy is not None:
            s.enforcer(policy)
        try:
            s.service = await loop.start_service()
            started = time.monotonic()
            await drive(s)
            await s.until(s.settled, "every task to settle")
            await asyncio.sleep(6)  # the last findings and the record file's flush
            print(f"{name}: settled in {time.monotonic() - started:.0f} s", file=sys.stderr)
            answers = await asyncio.to_thread(_read, queue, run, s.service)
        finally:
            for line in loop.stop():  # first: the messages of the clean-up are not the run's
                print(f"{name}: {line}", file=sys.stderr)
            with contextlib.suppress(Exception):
                queue.clean_up()
    path = out / f"{name}.json"
    answers.save(path)
    return path


def _read(queue: RealQueue, run: Run, service: str) -> recorded.Answers:
    """The task group read as ``coalescer replay --task-group --save`` reads it."""
    client, evidence = recorded.recording(queue.client, Evidence(service=service))
    sources.from_task_groups(
        client, [queue.group], prefix=run.prefix, rank_tag=None, evidence=evidence
    )
    evidence.answers.prefix = run.prefix
    return evidence.answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=", ".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=Path("histories"), help="(./histories)")
    args = parser.parse_args()
    if message := problem(os.environ):
        print(f"record_history: {message}", file=sys.stderr)
        return 2
    if unknown := set(args.scenarios) - set(SCENARIOS):
        parser.error(f"no scenario {', '.join(sorted(unknown))}: {', '.join(SCENARIOS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.scenarios or SCENARIOS:
        print(asyncio.run(record(name, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
