"""The invariants, checked once the stream and the faults have stopped and everything settled.
Each finding is a :class:`Violation` naming the invariant and the tasks involved."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import httpx

from tests.soak.load import Pushed

RESOLUTIONS = ("task-completed", "task-failed", "task-exception")
#: memory is flat when the last third's median RSS is at most this much above the first third's
MEMORY_RATIO, MEMORY_SLACK = 1.25, 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str


class Queue:
    """What the checker reads from the emulator: statuses, blobs, published messages."""

    def __init__(self, http: httpx.AsyncClient, root_url: str) -> None:
        self.http = http
        self.root = root_url

    async def statuses(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        ids = list(task_ids)
        found: dict[str, dict[str, Any]] = {}
        for at in range(0, len(ids), 500):
            query: dict[str, str] = {}
            while True:
                r = await self.http.post(
                    f"{self.root}/api/queue/v1/tasks/status",
                    json={"taskIds": ids[at : at + 500]},
                    params=query,
                )
                r.raise_for_status()
                body = r.json()
                found.update((e["taskId"], e["status"]) for e in body["statuses"])
                if "continuationToken" not in body:
                    break
                query = {"continuationToken": body["continuationToken"]}
        return found

    async def blob(self, task_id: str, run_id: int, name: str) -> Any | None:
        r = await self.http.get(f"{self.root}/emulator/v1/blobs/{task_id}/{run_id}/{name}")
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    async def messages(self, kind: str) -> list[dict[str, Any]]:
        r = await self.http.get(f"{self.root}/emulator/v1/messages", params={"exchange": kind})
        r.raise_for_status()
        return list(r.json()["messages"])


async def unsettled(queue: Queue, tasks: Iterable[str]) -> int:
    """How many of ``tasks`` have a pending or running run."""
    found = await queue.statuses(tasks)
    return sum(1 for s in found.values() if s["state"] in ("pending", "running"))


@dataclasses.dataclass
class Findings:
    violations: list[Violation] = dataclasses.field(default_factory=list)
    counts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def add(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(invariant, detail))


def _resolution(run: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    """What resolved a run: its state, reasonResolved and when."""
    return run["state"], run.get("reasonResolved"), run.get("resolved")


async def _told(queue: Queue) -> dict[tuple[str, int], list[tuple[str, str | None, str | None]]]:
    """Per run, the resolution each of its resolution messages reports (the run as the message's
    status shows it), in publishing order."""
    told: dict[tuple[str, int], list[tuple[str, str | None, str | None]]] = {}
    for kind in RESOLUTIONS:
        for m in await queue.messages(kind):
            payload = m["payload"]
            run_id = int(payload["runId"])
            runs = payload["status"].get("runs") or []
            said = runs[run_id] if run_id < len(runs) else {}
            found = (kind.removeprefix("task-"), said.get("reasonResolved"), said.get("resolved"))
            told.setdefault((payload["status"]["taskId"], run_id), []).append(found)
    return told


async def check_queue(queue: Queue, tasks: Mapping[str, Pushed], findings: Findings) -> None:
    """The queue's state is the truth: each run is resolved once, as its status says, and its
    resolution published. A resolution message may be published more than once (the queue
    publishes again on a repeated cancelTask or report, and Pulse delivers at least once): a
    repeat is counted, not a violation, as long as it reports that same resolution; a message
    reporting another one is a run resolved twice."""
    statuses = await queue.statuses(tasks)
    told = await _told(queue)
    outcomes: Counter[str] = Counter()
    repeated = 0
    again: list[str] = []  # a few of the repeats, as examples
    runs = 0
    for task_id, pushed in tasks.items():
        status = statuses.get(task_id)
        if status is None:
            findings.add("task known to the queue", f"{task_id} ({pushed.key}) is missing")
            continue
        outcomes[status["state"]] += 1
        for run in status["runs"]:
            runs += 1
            where = f"{task_id} ({pushed.key}) run {run['runId']}"
            if run["state"] in ("pending", "running"):
                findings.add("every run resolved", f"{where} is still {run['state']}")
                continue
            outcomes[f"run {run['state']}/{run.get('reasonResolved')}"] += 1
            truth = _resolution(run)
            said = told.pop((task_id, run["runId"]), [])
            if not said:
                findings.add("every resolution published", f"{where} resolved {truth}, no message")
            elif any(one != truth for one in said):
                findings.add(
                    "every run resolved once",
                    f"{where} resolved {truth}; its messages reported {said}",
                )
            if len(said) > 1:
                repeated += len(said) - 1
                if len(again) < 5:
                    again.append(f"{where}: {len(said)} messages, {truth[0]}/{truth[1]}")
    for (task_id, run_id), said in told.items():
        if task_id in tasks:
            findings.add(
                "every run resolved once",
                f"{task_id} run {run_id} is not resolved in the queue; its messages reported {said}",
            )
    findings.counts["tasks by state"] = dict(outcomes)
    findings.counts["runs"] = runs
    findings.counts["resolution messages repeated"] = repeated
    findings.counts["resolutions published again, e.g."] = again
    await _check_superseding(queue, tasks, statuses, findings)
    _check_dependents(tasks, statuses, findings)


async def _check_superseding(
    queue: Queue,
    tasks: Mapping[str, Pushed],
    statuses: Mapping[str, dict[str, Any]],
    findings: Findings,
) -> None:
    semaphore = asyncio.Semaphore(16)
    superseded = primaries = 0

    async def one(task_id: str, run: dict[str, Any]) -> None:
        nonlocal superseded, primaries
        me = tasks[task_id]
        where = f"{task_id} ({me.key}, push {me.rank}) run {run['runId']}"
        async with semaphore:
            by = await queue.blob(task_id, run["runId"], "public/superseded-by.json")
            held = None
            if run["state"] == "completed":
                held = await queue.blob(task_id, run["runId"], "public/supersedes.json")
        if by is not None:
            superseded += 1
            if run["state"] == "completed":
                findings.add("superseded runs never pass", f"{where} completed with superseded-by")
            winner = tasks.get(by["taskId"])
            if winner is None or winner.key != me.key:
                findings.add("winner of the same key", f"{where} superseded by {by}")
            elif winner.rank <= me.rank:
                findings.add(
                    "only newer supersedes older",
                    f"{where} superseded by older {by['taskId']} (push {winner.rank})",
                )
        if held:
            primaries += 1
            for entry in held:
                victim = tasks.get(entry["taskId"])
                if entry["taskId"] == task_id:
                    continue
                if victim is None or victim.key != me.key:
                    findings.add("winner of the same key", f"{where} held {entry}")
                elif victim.rank > me.rank:
                    findings.add(
                        "the winner is the newest it held",
                        f"{where} superseded newer {entry['taskId']} (push {victim.rank})",
                    )

    jobs = [
        one(task_id, run)
        for task_id, status in statuses.items()
        if task_id in tasks
        for run in status["runs"]
        if run["state"] in ("completed", "exception")
    ]
    await asyncio.gather(*jobs)
    findings.counts["superseded runs"] = superseded
    findings.counts["primaries"] = primaries


def _check_dependents(
    tasks: Mapping[str, Pushed], statuses: Mapping[str, dict[str, Any]], findings: Findings
) -> None:
    dependents = ran = 0
    for task_id, pushed in tasks.items():
        if not pushed.dependencies or task_id not in statuses:
            continue
        dependents += 1
        # A run created "exception" is a cancel of the unscheduled task: it was never scheduled.
        runs = statuses[task_id]["runs"]
        if not any(r["reasonCreated"] != "exception" for r in runs):
            continue
        ran += 1
        for dep in pushed.dependencies:
            runs = statuses.get(dep, {}).get("runs", [])
            if not any(r["state"] == "completed" for r in runs):
                findings.add(
                    "all-completed dependents run only after their dependencies",
                    f"{task_id} ran but its dependency {dep} never completed: "
                    f"{[(r['state'], r.get('reasonResolved')) for r in runs]}",
                )
    findings.counts["dependents"] = dependents
    findings.counts["dependents scheduled"] = ran


def check_dead_letters(bodies: list[bytes], sent_invalid: int, findings: Findings) -> None:
    ours = [b for b in bodies if b.startswith(b"{soak: invalid")]
    for body in bodies:
        if not body.startswith(b"{soak: invalid"):
            findings.add(
                "the dead-letter queue holds only invalid messages",
                body[:300].decode(errors="replace"),
            )
    findings.counts["dead-lettered"] = len(bodies)
    findings.counts["invalid Pulse messages sent"] = sent_invalid
    if len(ours) > sent_invalid:
        findings.add(
            "the dead-letter queue holds only invalid messages",
            f"{len(ours)} invalid messages dead-lettered, {sent_invalid} sent",
        )


def check_memory(samples: list[tuple[float, str, int, int]], findings: Findings) -> dict[str, int]:
    """Per process lifetime (name, pid) with enough samples: the last third's median RSS against
    the first third's (after a warm-up tenth). Returns the peak RSS by name."""
    by_life: dict[tuple[str, int], list[int]] = {}
    peak: dict[str, int] = {}
    for _, name, pid, rss in samples:
        if rss:
            by_life.setdefault((name, pid), []).append(rss)
            peak[name] = max(peak.get(name, 0), rss)
    longest = max((len(v) for v in by_life.values()), default=0)
    for (name, pid), series in by_life.items():
        if len(series) < max(9, longest // 2):
            continue  # a short life (restarted after a kill): too little to judge
        series = series[len(series) // 10 :]
        third = len(series) // 3
        first, last = statistics.median(series[:third]), statistics.median(series[-third:])
        if last > first * MEMORY_RATIO + MEMORY_SLACK:
            findings.add(
                "memory flat",
                f"{name} (pid {pid}) RSS {first / 2**20:.0f} MiB → "
                f"{last / 2**20:.0f} MiB (first third → last third, medians)",
            )
    return peak


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
