"""Superseding lineage over HTTP, and the lineage section of the pages.

* ``GET /v1/tasks/<taskId>`` — what superseded the task (and the chain to its final primary),
  and what it superseded, with when, which policy rule and why; and the bisections that name it
  (:mod:`coalescer.web.bisections`);
* ``GET /v1/tasks/<taskId>/supersedes`` — the state handoff: ``[{taskId, runId, task}]`` of
  every task it replaces, transitively (the shape of ``COALESCER_SUPERSEDES_FILE``);
* ``GET /v1/policy`` — the rules in force and, per key and rule, what they superseded and the
  worker time that saved; the same as ``/metrics`` counters (:func:`exposition`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from coalescer import model
from coalescer.policy import lineage as reading
from coalescer.policy.rules import describe
from coalescer.web import bisections
from coalescer.web.responses import JSON, error


async def task_lineage(request: Request) -> Response:
    """The task's lineage, and with ``bisection`` the bisections that name it (absent when
    none): 404 when neither a superseding decision nor a bisection names the task."""
    task_id = model.check_task_id(request.path_params["taskId"])
    store = request.app.state.store
    found = await reading.lineage(store, request.app.state.settings.policy, task_id)
    located = await bisections.for_task(store, task_id)
    if found is None and not located:
        return error(
            404, f"no superseding decision or bisection names task {task_id}", taskId=task_id
        )
    if found is None:
        found = {
            "taskId": task_id,
            "supersededBy": None,
            "chain": [],
            "finalPrimary": None,
            "supersedes": [],
            "decisions": [],
        }
    if located:
        found["bisection"] = located
    return JSON(found)


async def task_handoff(request: Request) -> Response:
    task_id = model.check_task_id(request.path_params["taskId"])
    settings = request.app.state.settings
    return JSON(await reading.handoff(request.app.state.store, settings.policy, task_id))


async def policy_stats(request: Request) -> Response:
    policy = request.app.state.settings.policy
    return JSON(
        {
            "file": request.app.state.settings.policy_file,
            "rules": describe(policy) if policy is not None else [],
            "keys": await reading.stats(request.app.state.store, policy),
        }
    )


async def page_context(
    request: Request, task_id: str, names: Sequence[str] | None = None
) -> dict[str, Any]:
    """What ``_lineage.html`` shows on a task's page (nothing without a deciding policy), and
    what ``_bisection.html`` shows (the bisections that name the task)."""
    store = request.app.state.store
    found = await reading.lineage(store, request.app.state.settings.policy, task_id)
    return {"lineage": found, "bisection": await bisections.for_task(store, task_id, names)}


class _PolicyCounters(Collector):
    """The shared counters every enforcer keeps in the index, as Prometheus counters, added up
    by rule (a series per coalescing key would make up to COALESCER_MAX_KEYS of them; the
    per-key figures are on the pages and ``GET /v1/policy``)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        tasks = CounterMetricFamily(
            "coalescer_policy_tasks",
            "Tasks decided on by superseding policies, by rule and outcome "
            "(decided, superseded, canceled, held, released, spared, cascaded, missed, protected, "
            "gone)",
            labels=["rule", "outcome"],
        )
        saved = CounterMetricFamily(
            "coalescer_policy_saved_seconds",
            "Worker time saved by superseding, estimated from each key's recent run durations, "
            "by rule",
            labels=["rule"],
        )
        counts: dict[tuple[str, str], float] = {}
        saved_ms: dict[str, float] = {}
        for row in self.rows:
            rule = row["rule"]
            for outcome, n in row.items():
                if outcome not in ("key", "rule", "savedMs"):
                    counts[rule, outcome] = counts.get((rule, outcome), 0) + n
            saved_ms[rule] = saved_ms.get(rule, 0) + row["savedMs"]
        for (rule, outcome), n in sorted(counts.items()):
            tasks.add_metric([rule, outcome], n)
        for rule, ms in sorted(saved_ms.items()):
            saved.add_metric([rule], ms / 1000)
        yield tasks
        yield saved


async def exposition(request: Request) -> bytes:
    """``/metrics`` lines for superseding policies (none without a deciding policy)."""
    policy = request.app.state.settings.policy
    if policy is None or not policy.decides:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_PolicyCounters(await reading.stats(request.app.state.store, policy)))
    return generate_latest(registry)
