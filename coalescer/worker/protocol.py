"""The superseding protocol's decisions, as pure functions on plain data. No IO here.

What a worker decides, in order: whether to follow a task's ``supersederUrl`` at all
(:func:`superseder_url`; :mod:`coalescer.worker.allow` holds the allow-list), whether the
answer is usable (:func:`parse_answer`), which listed tasks it may claim (:func:`ineligibility`,
:func:`claimable_run`), which held task runs (:func:`choose_primary`), what happens to the
others (:func:`secondary_fate`), and what the artifacts say (:func:`superseded_by_json`,
:func:`supersedes_json`). Every refusal carries a reason that the worker logs.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson

from coalescer.errors import CoalescerError, InvalidInput
from coalescer.model import check_task_id, keys_from_routes
from coalescer.settings import Secret
from coalescer.verdicts import DEFAULT_CONFIDENCE, DEFAULT_CONFIRM

SUPERSEDED_BY = "public/superseded-by.json"
SUPERSEDES = "public/supersedes.json"
#: Environment variable naming the JSON file that shows a command what it supersedes.
SUPERSEDES_FILE_ENV = "COALESCER_SUPERSEDES_FILE"


class SupersederError(CoalescerError):
    """The superseder cannot be used for this task; the worker runs the claimed task alone.

    ``reason`` is a short word for logs and metrics (``no-url``, ``not-allowed``,
    ``unavailable``, ``timeout``, ``bad-status``, ``not-json``, ``bad-answer``, ``empty``,
    ``initial-missing``).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Order(enum.StrEnum):
    """How the superseder sorts its list. The documented protocol is oldest first; Mozilla's
    tc-coalesce answered newest first (and docker-worker ran the lowest index)."""

    OLDEST_FIRST = "oldest-first"
    NEWEST_FIRST = "newest-first"


class SupersedeAs(enum.StrEnum):
    """How a secondary is resolved once the primary has run. None but ``completed`` lets a
    run that never ran its command read as a success.

    * ``exception-superseded`` — ``reportException(reason="superseded")``: the documented
      resolution; only queues before Taskcluster v40 accept it. Where the queue rejects it, the
      run is released (``worker-shutdown``) and the task runs itself.
    * ``canceled`` — ``cancelTask`` with the worker's own credentials (needs
      ``queue:cancel-task:...``): the run ends ``exception/canceled``.
    * ``auto`` (the default) — ``exception-superseded`` while the queue accepts it; on a queue
      that rejects the reason, ``canceled`` (:func:`fallback`), and where the credentials may
      not cancel, released so that the task runs itself.
    * ``completed`` — ``reportCompleted`` after the ``superseded-by`` artifact. Every queue
      accepts it, but every dashboard then shows the run as passed, and ``all-completed``
      dependents are scheduled as if it had run: only when asked for by name
      (:func:`mode_warning`).

    An ``exception`` resolution (``superseded``, ``canceled``) resolves the task: dependents
    with ``requires: all-resolved`` are scheduled, ``all-completed`` ones never are.
    """

    AUTO = "auto"
    EXCEPTION_SUPERSEDED = "exception-superseded"
    COMPLETED = "completed"
    CANCELED = "canceled"


def mode_warning(mode: SupersedeAs) -> str | None:
    """What an operator must know at start about ``mode``, or None."""
    if mode is not SupersedeAs.COMPLETED:
        return None
    return (
        "superseded tasks will be resolved 'completed' (--resolve-superseded-as completed): "
        "the Taskcluster UI, Treeherder and GitHub checks will show them as passed although "
        "they never ran, and their all-completed dependents will be scheduled"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Resolution:
    """How a superseded run was ended (``how``: ``exception/superseded``, ``completed``,
    ``canceled``, ``released``; or ``spared``: left alone), and why."""

    how: str
    why: str

    @property
    def superseded(self) -> bool:
        """Whether the run ended superseded (a released or spared task runs itself)."""
        return self.how not in (RELEASED, SPARED)


RELEASED = "released"
SPARED = "spared"
REJECTS = "the queue rejects reason 'superseded'"


def fallback(may_cancel: bool) -> Resolution:
    """How ``auto`` ends a superseded run on a queue that rejects ``superseded``: canceled
    (``exception/canceled``, never a success), or, when the credentials may not cancel,
    released (``worker-shutdown``) so that the task runs itself."""
    if may_cancel:
        return Resolution("canceled", REJECTS)
    return Resolution(RELEASED, f"{REJECTS}, and the credentials may not cancel tasks")


class OnPrimaryFailure(enum.StrEnum):
    """What a *failed* primary does to the secondaries: supersede them anyway (the newest
    state failed, so the older results are moot), release them so that they run, or bisect
    them to locate the first failing push (:mod:`coalescer.bisection`): a few of them run, the
    others are superseded by the run whose result stands for them."""

    SUPERSEDE = "supersede"
    RELEASE = "release"
    BISECT = "bisect"


@dataclasses.dataclass(frozen=True)
class Options:
    """How a worker supersedes. ``allow`` holds the URL prefixes it follows; empty: none."""

    allow: tuple[str, ...] = ()
    timeout: float = 5.0
    order: Order = Order.OLDEST_FIRST
    supersede_as: SupersedeAs = SupersedeAs.AUTO
    on_primary_failure: OnPrimaryFailure = OnPrimaryFailure.SUPERSEDE
    #: With ``bisect``: the most reruns confirming a failure before the search trusts it
    #: (0: none); spent until it is ``bisect_confidence`` probably a breakage.
    bisect_confirm: int = DEFAULT_CONFIRM
    bisect_confidence: float = DEFAULT_CONFIDENCE
    #: With ``bisect``: the bearer token for the superseder service's ``POST /v1/bisections``
    #: (its ``COALESCER_INGEST_TOKEN``); None: findings are not reported.
    report_token: Secret | None = dataclasses.field(default=None, repr=False)
    route_prefix: str = "coalesce.v1"
    #: At most this many tasks (the initial one included) are claimed per task set.
    max_tasks: int = 32
    #: At most this many claims are in flight at once.
    claim_concurrency: int = 8
    #: Reclaim once this fraction of a claim's lifetime has passed.
    reclaim_fraction: float = 1 / 3
    #: Longest real sleep between looks at the clock (a test's clock can jump).
    tick: float = 1.0
    max_answer_bytes: int = 1 << 20


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the primary ended: ``completed``, ``failed`` or ``exception`` with a reason."""

    state: str
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.state not in ("completed", "failed", "exception"):
            raise ValueError(f"not a resolution: {self.state!r}")
        if (self.state == "exception") != (self.reason is not None):
            raise ValueError("an exception outcome needs a reason; the others take none")


COMPLETED = Outcome("completed")
FAILED = Outcome("failed")


def superseder_url(task: Mapping[str, Any]) -> str:
    """The task's ``payload.supersederUrl``, or SupersederError(``no-url``)."""
    payload = task.get("payload")
    url = payload.get("supersederUrl") if isinstance(payload, Mapping) else None
    if not url:
        raise SupersederError("no-url", "the task has no supersederUrl")
    if not isinstance(url, str):
        raise SupersederError("no-url", "the task's supersederUrl is not a string")
    return url


def query_url(url: str, task_id: str) -> str:
    """``url`` with ``taskId=<task_id>`` appended as the protocol says."""
    return f"{url}{'&' if '?' in url else '?'}taskId={task_id}"


def parse_answer(body: bytes, initial: str, *, order: Order, max_tasks: int) -> list[str]:
    """The superseder's list, oldest first, capped to ``max_tasks`` (newest kept, and always
    the initial task), or SupersederError when the answer is unusable."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise SupersederError("not-json", "the superseder's answer is not JSON") from None
    listed = doc.get("supersedes") if isinstance(doc, dict) else None
    if not isinstance(listed, list):
        raise SupersederError("bad-answer", "the answer has no 'supersedes' list")
    if not listed:
        raise SupersederError("empty", "the superseder listed no tasks")
    ids: list[str] = []
    for item in listed:
        try:
            ids.append(check_task_id(item if isinstance(item, str) else repr(item)))
        except InvalidInput as exc:
            raise SupersederError("bad-answer", f"the answer lists a {exc}") from None
    if len(set(ids)) != len(ids):
        raise SupersederError("bad-answer", "the answer lists a taskId twice")
    if initial not in ids:
        raise SupersederError("initial-missing", f"the answer does not list {initial}")
    if order is Order.NEWEST_FIRST:
        ids.reverse()
    if len(ids) > max_tasks:
        others = [t for t in ids if t != initial][-(max_tasks - 1) :] if max_tasks > 1 else []
        keep = {initial, *others}
        ids = [t for t in ids if t in keep]
    return ids


def task_queue_id(task: Mapping[str, Any]) -> str:
    """``taskQueueId``, or ``provisionerId/workerType`` for definitions that predate it."""
    if task.get("taskQueueId"):
        return str(task["taskQueueId"])
    return f"{task.get('provisionerId')}/{task.get('workerType')}"


def ineligibility(initial: Mapping[str, Any], other: Mapping[str, Any], prefix: str) -> str | None:
    """Why ``other`` (a listed task's definition) must not be claimed, or None if it may.

    A listed task must be on the initial task's task queue and carry exactly the initial task's
    coalescing keys, so that a superseder (or whoever forged its answer) cannot make a worker
    claim, and resolve, tasks that nobody declared equivalent.
    """
    if task_queue_id(other) != task_queue_id(initial):
        return f"it is on task queue {task_queue_id(other)}, not {task_queue_id(initial)}"
    mine = set(keys_from_routes(list(initial.get("routes") or []), prefix))
    theirs = set(keys_from_routes(list(other.get("routes") or []), prefix))
    if not mine:
        return f"the initial task has no {prefix}.* route"
    if theirs != mine:
        return f"its {prefix}.* routes differ from the initial task's"
    return None


def claimable_run(status: Mapping[str, Any]) -> int | None:
    """The runId to claim: the latest run, when it is pending (only it can be claimed)."""
    runs = status.get("runs") or []
    if runs and runs[-1].get("state") == "pending":
        return int(runs[-1]["runId"])
    return None


def choose_primary(listed: Sequence[str], held: Sequence[str] | set[str]) -> str:
    """The highest-indexed listed task among those held: the one that runs."""
    for task_id in reversed(listed):
        if task_id in held:
            return task_id
    raise ValueError("no listed task is held")


def secondary_fate(outcome: Outcome, on_failure: OnPrimaryFailure) -> str:
    """``supersede``, ``release`` or ``bisect`` for the secondaries, given how the primary
    ended.

    An exception (malformed payload, internal error) produced no result that could stand for
    the older tasks, so they are always released; a failure follows ``on_failure``.
    """
    if outcome.state == "completed":
        return "supersede"
    if outcome.state == "failed":
        return {OnPrimaryFailure.SUPERSEDE: "supersede", OnPrimaryFailure.BISECT: "bisect"}.get(
            on_failure, "release"
        )
    return "release"


def given_back(status: Mapping[str, Any]) -> bool:
    """Whether the task's latest run follows a run that was given back (``worker-shutdown``:
    a worker stopped, or a worker released it rather than resolve it).

    Such a task must run itself: claimed as a secondary again it could be released again, and
    each release costs it a retry, until none is left and it ends ``exception`` without having
    run. The queue's status cannot tell a worker's shutdown from a release after a failed
    primary, so both count.
    """
    runs = status.get("runs") or []
    return len(runs) >= 2 and runs[-2].get("reasonResolved") == "worker-shutdown"


def reclaim_at(received: datetime, taken_until: datetime, fraction: float) -> datetime:
    """When to reclaim: ``fraction`` of the way from receiving the claim to ``takenUntil``.

    Measuring from our own receipt time keeps a fair margin even when our clock and the
    queue's disagree by a few minutes.
    """
    return received + (taken_until - received) * fraction


def superseded_by_json(task_id: str, run_id: int) -> bytes:
    """``public/superseded-by.json``: the primary that superseded this task."""
    return orjson.dumps({"taskId": task_id, "runId": run_id})


def supersedes_json(runs: Sequence[tuple[str, int]]) -> bytes:
    """``public/supersedes.json``: the task runs the primary superseded, oldest first."""
    return orjson.dumps([{"taskId": t, "runId": r} for t, r in runs])


def supersedes_view(secondaries: Sequence[tuple[str, int, Mapping[str, Any]]]) -> bytes:
    """What a primary command reads from ``$COALESCER_SUPERSEDES_FILE``: the tasks it may
    supersede, oldest first, with their definitions, so that it can reuse their state."""
    return orjson.dumps([{"taskId": t, "runId": r, "task": d} for t, r, d in secondaries])
