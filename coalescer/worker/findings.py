"""What a worker reports of a bisection to its superseder service (``POST /v1/bisections``).
Pure: the JSON from :class:`~coalescer.worker.culprit.Finding`, the key the ``supersederUrl``
names, and where to post.

The finding's shape is the service's (:mod:`coalescer.store.bisections`): camelCase, instants in
ISO 8601 UTC with milliseconds, as the queue writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from coalescer import verdicts
from coalescer.model import format_time_ms, keys_from_routes
from coalescer.verdicts import DEFAULT_FLAKE
from coalescer.worker.culprit import Finding, Ref
from coalescer.worker.notice import service_base

#: The service's endpoint, under its base URL.
PATH = "/v1/bisections"


def _time(at: datetime | None) -> str | None:
    return None if at is None else format_time_ms(round(at.timestamp() * 1000))


def _ref(ref: Ref | None) -> dict[str, Any] | None:
    return None if ref is None else {"taskId": ref[0], "runId": ref[1]}


def finding_json(
    finding: Finding,
    *,
    key: str,
    by: str,
    primary: Ref,
    located: datetime,
    listed: Sequence[str] = (),
) -> dict[str, Any]:
    """The body of ``POST /v1/bisections`` for ``finding``: the search after ``primary``
    failed, under coalescing ``key``, run by ``by`` and over at ``located``; the tasks that
    did not run in the superseder's order, ``listed`` (oldest first)."""
    place = {task_id: i for i, task_id in enumerate(listed)}
    stood = sorted(finding.stood_for.items(), key=lambda kv: (place.get(kv[0][0], len(place)), kv))
    return {
        "key": key,
        "by": by,
        "primary": _ref(primary),
        "held": finding.held,
        "culprit": _ref(finding.culprit),
        "lastGood": _ref(finding.last_good),
        "runs": [
            {
                "taskId": run.task_id,
                "runId": run.run_id,
                "attempt": run.attempt,
                "passed": run.passed,
                "ended": _time(run.ended),
            }
            for run in finding.runs
        ],
        "intermittent": [_ref(ref) for ref in finding.intermittent],
        "standsFor": [
            {"taskId": task_id, "runId": run_id, "by": _ref(stand_in)}
            for (task_id, run_id), stand_in in stood
        ],
        "extraRuns": finding.extra_runs,
        # The shim runs its search one run at a time: a round each.
        "rounds": finding.extra_runs,
        "located": _time(located),
    } | _verdict(finding)


def _verdict(finding: Finding) -> dict[str, Any]:
    """The verdict's fields, for a search that ended (one that stopped has none)."""
    if finding.verdict is None:
        return {"flake": finding.flake}
    return {
        "verdict": str(finding.verdict),
        "suspect": _ref(finding.suspect),
        "probability": finding.probability,
        "flake": finding.flake,
    }


def flake_rate(answer: Any) -> float:
    """A key's flake rate from the service's ``GET /v1/bisections?key=K`` answer (its newest
    findings): :func:`coalescer.verdicts.flake_rate`; the prior's when the answer is not one."""
    found = answer.get("findings") if isinstance(answer, dict) else None
    if not isinstance(found, list):
        return DEFAULT_FLAKE
    return verdicts.flake_rate(f for f in found if isinstance(f, dict))


def reported_key(url: str, routes: list[str], prefix: str) -> str | None:
    """The coalescing key a ``supersederUrl`` names among the task's ``routes`` (the key the
    service answered for), or None when it names none of them."""
    for key in keys_from_routes(routes, prefix):
        if service_base(url, [f"{prefix}.{key}"], prefix) is not None:
            return key
    return None


def report_url(url: str, routes: list[str], prefix: str) -> str | None:
    """Where to post the finding: ``POST /v1/bisections`` of the service ``url`` belongs to,
    or None when ``url`` names none of the task's keys."""
    base = service_base(url, routes, prefix)
    return None if base is None else base + PATH
