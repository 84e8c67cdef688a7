"""The invariants, checked once the stream and the faults have stopped and everything settled.
Each finding is a :class:`Violation` naming the invariant and the tasks involved."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import httpx

from tests.soak.load import Pushed

RESOLUTIONS = ("task-completed", "task-failed", "task-exception")
#: memory is flat when, after each life's warm-up, it grows by at most MEMORY_SLOPE a minute
#: (the median slope of every pair of samples within one life: a leak's steady climb weighs, the
#: few steps of an allocator's arenas little) or, at that slope, by at most MEMORY_GROWTH over
#: the longest life watched after warm-up (a step in a short life is not a slope)
MEMORY_WARMUP_S, MEMORY_SLOPE, MEMORY_GROWTH = 20.0, 8 * 2**20, 16 * 2**20
#: a canceled run may have run this much longer than its rule protects: the enforcer checks the
#: protection, then uploads an artifact and cancels
PROTECT_SLACK_MS = 1000


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


async def unsettled(queue: Queue, tasks: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The statuses of those of ``tasks`` that have a pending or running run."""
    found = await queue.statuses(tasks)
    return {t: s for t, s in found.items() if s["state"] in ("pending", "running")}


def holder(status: Mapping[str, Any]) -> str:
    """Who holds a task's latest run, as the queue says: ``run N running on group/id``."""
    run = (status.get("runs") or [{}])[-1]
    where = f" on {run['workerGroup']}/{run['workerId']}" if run.get("workerId") else ""
    return f"run {run.get('runId')} {run.get('state')}{where}"


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


async def check_queue(
    queue: Queue, tasks: Mapping[str, Pushed], findings: Findings
) -> dict[str, dict[str, Any]]:
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
    return statuses


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
            elif winner.rank <= me.rank and not winner.fate == me.fate == "broken":
                # a bisection's culprit stands for the newer pushes, which fail as it does
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
    """Per process name, over the whole run: the median of the slopes between every two samples
    of one life (name, pid) taken after that life's warm-up, against :data:`MEMORY_SLOPE` and
    :data:`MEMORY_GROWTH`. A process SIGKILLed every few minutes still shows a leak: each life
    climbs. Returns the peak RSS by name; the slopes go in the counts (MiB a minute)."""
    lives: dict[tuple[str, int], list[tuple[float, int]]] = {}
    peak: dict[str, int] = {}
    for at, name, pid, rss in samples:
        if rss:
            lives.setdefault((name, pid), []).append((at, rss))
            peak[name] = max(peak.get(name, 0), rss)
    slopes: dict[str, list[float]] = {}
    watched: dict[str, float] = {}  # the longest life after warm-up, in seconds
    for (name, _), life in lives.items():
        born = life[0][0]
        warm = [(t, rss) for t, rss in life if t - born >= MEMORY_WARMUP_S]
        if warm:
            watched[name] = max(watched.get(name, 0.0), warm[-1][0] - warm[0][0])
        pairs = slopes.setdefault(name, [])
        for i, (t0, r0) in enumerate(warm):
            pairs.extend((r1 - r0) / (t1 - t0) * 60 for t1, r1 in warm[i + 1 :] if t1 > t0)
    found: dict[str, float] = {}
    for name, pairs in sorted(slopes.items()):
        if len(pairs) < 10:
            continue  # too little after warm-up to judge
        slope = statistics.median(pairs)
        found[name] = round(slope / 2**20, 2)
        grown = slope * watched[name] / 60
        if slope > MEMORY_SLOPE and grown > MEMORY_GROWTH:
            findings.add(
                "memory flat",
                f"{name} grows {slope / 2**20:.1f} MiB a minute after warm-up (median slope "
                f"over {len(pairs)} pairs of samples; at most {MEMORY_SLOPE / 2**20:.0f}), "
                f"{grown / 2**20:.0f} MiB over its longest life watched ({watched[name]:.0f} s)",
            )
    findings.counts["memory slope MiB/min"] = found
    return peak


@dataclasses.dataclass(frozen=True)
class Rule:
    """What the policy file lets the enforcer do to a key's running tasks."""

    supersede_running: bool = False
    protect_ms: int | None = None


def check_cancels(
    tasks: Mapping[str, Pushed],
    statuses: Mapping[str, dict[str, Any]],
    ran: set[tuple[str, int]],
    rule_of: Callable[[str], Rule],
    findings: Findings,
) -> None:
    """A run canceled after its command started (the soak's own mark says so, whoever claimed
    it) is a running task canceled: only on a key whose rule has ``supersede-running``, and
    never once it has run longer than ``protect-running-after``."""
    canceled = 0
    for task_id, pushed in tasks.items():
        for run in statuses.get(task_id, {}).get("runs", []):
            if run.get("reasonResolved") != "canceled" or (task_id, run["runId"]) not in ran:
                continue
            canceled += 1
            rule = rule_of(pushed.key)
            where = f"{task_id} ({pushed.key}, push {pushed.rank}) run {run['runId']}"
            if not rule.supersede_running:
                findings.add(
                    "no running task canceled unless its rule allows it",
                    f"{where} was canceled while its command ran; its rule has no "
                    "supersede-running",
                )
                continue
            if rule.protect_ms is None or not run.get("started") or not run.get("resolved"):
                continue
            ran_ms = _ms(run["resolved"]) - _ms(run["started"])
            if ran_ms > rule.protect_ms + PROTECT_SLACK_MS:
                findings.add(
                    "no running task canceled unless its rule allows it",
                    f"{where} was canceled after running {ran_ms / 1000:.1f} s; "
                    f"protect-running-after is {rule.protect_ms / 1000:g} s",
                )
    findings.counts["running tasks canceled"] = canceled


def check_completed_ran(
    tasks: Mapping[str, Pushed],
    statuses: Mapping[str, dict[str, Any]],
    ran: set[tuple[str, int]],
    findings: Findings,
    *,
    completed_named: bool = False,
) -> None:
    """A run that reads ``completed`` ran its command (the soak's own mark), unless the
    configuration names ``completed`` for superseded runs: whatever artifacts it has or lacks."""
    if completed_named:
        return
    for task_id, pushed in tasks.items():
        for run in statuses.get(task_id, {}).get("runs", []):
            if run["state"] == "completed" and (task_id, run["runId"]) not in ran:
                findings.add(
                    "no task that did not run reads completed",
                    f"{task_id} ({pushed.key}, push {pushed.rank}) run {run['runId']} "
                    "completed; its command never started",
                )


@dataclasses.dataclass(frozen=True)
class Culprit:
    """A culprit a search named: where (a process's log, the service), the task and the last
    good task (None: none named)."""

    source: str
    task_id: str
    last_good: str | None


_LOCATED = re.compile(
    r"culprit located: task (\S+) run \d+ is the first failing .*?; "
    r"last good (?:task (\S+) run \d+|none)"
)


def culprits_in_log(source: str, text: str) -> list[Culprit]:
    """The ``culprit located: ...`` lines of a worker's or an enforcer's log."""
    return [Culprit(source, m[1], m[2]) for m in _LOCATED.finditer(text)]


def culprits_in_lineage(task_id: str, body: Mapping[str, Any]) -> list[Culprit]:
    """The findings ``GET /v1/tasks/<taskId>`` shows."""
    found = []
    for finding in body.get("bisection") or []:
        culprit, good = finding.get("culprit"), finding.get("lastGood")
        if culprit:
            source = f"service ({finding.get('by')}, read on {task_id})"
            found.append(Culprit(source, culprit["taskId"], good["taskId"] if good else None))
    return found


def check_culprits(
    tasks: Mapping[str, Pushed], culprits: Iterable[Culprit], findings: Findings
) -> None:
    """Every culprit named is the push where the key's injected regression began (the oldest
    ``broken`` push of the key): never a push that passes, never on a key with no regression
    (a flaky one included). With a last good push named, the culprit is exactly that push (the
    search had a pass below it), and the last good push passes. Without one, every push the
    search held failed: the culprit is then its oldest, at or after the first failing push."""
    began: dict[str, Pushed] = {}
    for pushed in tasks.values():
        if pushed.fate == "broken" and (
            pushed.key not in began or pushed.rank < began[pushed.key].rank
        ):
            began[pushed.key] = pushed
    named: Counter[str] = Counter()
    seen: set[tuple[str, str | None]] = set()
    for c in culprits:
        if (c.task_id, c.last_good) in seen:
            continue
        seen.add((c.task_id, c.last_good))
        me = tasks.get(c.task_id)
        if me is None:
            findings.add("every culprit is where the breakage began", f"{c}: not a soak task")
            continue
        named[me.key] += 1
        where = f"{c.source} named {c.task_id} ({me.key}, push {me.rank}, {me.fate})"
        first = began.get(me.key)
        if first is None:
            flaky = any(t.fate == "flaky" for t in tasks.values() if t.key == me.key)
            findings.add(
                f"no {'flaky' if flaky else 'passing'} key gets a culprit",
                f"{where}; no regression was injected on {me.key}",
            )
            continue
        good = tasks.get(c.last_good) if c.last_good else None
        if me.fate != "broken" or (good is not None and me.task_id != first.task_id):
            findings.add(
                "every culprit is where the breakage began",
                f"{where}; the breakage began at {first.task_id} (push {first.rank})"
                + (f"; last good {good.task_id} (push {good.rank})" if good else ""),
            )
        elif good is not None and good.fate == "broken":
            findings.add(
                "every culprit is where the breakage began",
                f"{where}; its last good {good.task_id} (push {good.rank}) is broken",
            )
    findings.counts["culprits named, by key"] = dict(named)
    findings.counts["regressions injected at"] = {k: p.rank for k, p in sorted(began.items())}


def check_index(
    tasks: Mapping[str, Pushed],
    statuses: Mapping[str, dict[str, Any]],
    index: Mapping[str, Mapping[str, tuple[int, str]]],
    since: float,
    findings: Findings,
) -> list[str]:
    """Every event acknowledged was applied: per key, every task created after ``since`` (the
    last time the index was lost), or whose newest run was scheduled after it (a dependent
    scheduled later, a run retried: every event of that run came after), is in the index, at
    the queue's newest run and state. Counted per key against the queue, so that one lost
    event in hundreds shows. Returns the older tasks the index holds otherwise than the queue
    (what a final ``reconcile`` fixes), each described."""

    def after(p: Pushed) -> bool:
        runs = statuses.get(p.task_id, {}).get("runs")
        if not runs:
            return False
        scheduled = runs[-1].get("scheduled")
        return p.created > since or (scheduled is not None and _ms(scheduled) > since * 1000)

    older: list[str] = []
    for p in tasks.values():
        got, runs = index.get(p.key, {}).get(p.task_id), statuses.get(p.task_id, {}).get("runs")
        if after(p) or got is None or not runs or got == (runs[-1]["runId"], runs[-1]["state"]):
            continue
        last = runs[-1]
        older.append(
            f"{p.task_id} ({p.key}, created {p.created - since:+.0f} s from the last loss): "
            f"{got[1]} run {got[0]} (queue: {last['state']} run {last['runId']}, "
            f"scheduled {last.get('scheduled')}, resolved {last.get('resolved')})"
        )
    checked = 0
    for key in sorted({p.key for p in tasks.values()}):
        ours = [p for p in tasks.values() if p.key == key and after(p)]
        held = index.get(key, {})
        missing, stale = [], []
        for p in ours:
            last = statuses[p.task_id]["runs"][-1]
            truth = (last["runId"], last["state"])
            got = held.get(p.task_id)
            if got is None:
                missing.append(p.task_id)
            elif got != truth:
                stale.append(
                    f"{p.task_id} {got[1]} run {got[0]} (queue: {truth[1]} run {truth[0]})"
                )
        checked += len(ours)
        if missing or stale:
            findings.add(
                "every event acknowledged was applied",
                f"{key}: {len(ours)} tasks since the index was last lost, "
                f"{len(ours) - len(missing) - len(stale)} as the queue has them; "
                f"missing {missing[:5]}, stale {stale[:5]}",
            )
    findings.counts["tasks checked against the index"] = checked
    return older


def _ms(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
