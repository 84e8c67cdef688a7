"""Histories from what a queue recorded: Pulse messages (JSON lines), or task groups read from
the queue with the official client (``listTaskGroup``).

A task's history comes from its newest status: its first run's ``scheduled`` time, its task
queue and deadline, and the run that did its work (the last one resolved ``completed`` or
``failed`` that was not superseded: its ``started``→``resolved`` is the duration the replay
gives it). A task that never did its work (superseded, canceled, deadline) gets a duration
drawn from its key's runs. Superseded runs, whichever way they ended, are told apart from
work and from a person's cancel by :mod:`coalescer.replay.runs`, with the links
(``superseded-by.json``, the service's lineage) read for the runs that need one; a task whose
newest run a person canceled (``cancelTask``) is canceled in the replay at that time. Order
within a key is the index's: the rank tag if set, else the first run's ``scheduled``. Pulse
messages carry neither dependencies nor priorities: a task group read from the queue does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import orjson
from taskcluster.exceptions import TaskclusterFailure

from coalescer.errors import CoalescerError, InvalidEvent, InvalidInput
from coalescer.ingest import validation
from coalescer.ingest.events import EXCHANGE_PREFIX, Message, exchange_state, status_event
from coalescer.model import keys_from_routes, parse_time_ms
from coalescer.replay import capacity, lags, probes, runs
from coalescer.replay.history import History, TaskSpec, percentile, priority_rank
from coalescer.replay.lags import with_gaps
from coalescer.replay.links import Evidence, LinkError


class SourceError(CoalescerError):
    """A history cannot be read: the message says where and why."""


def task_spec(
    status: Mapping[str, Any],
    routes: Iterable[str],
    *,
    prefix: str,
    rank_tag: str | None,
    tags: Mapping[str, Any] | None = None,
    definition: Mapping[str, Any] | None = None,
    fate: runs.Fate | None = None,
) -> TaskSpec | None:
    """The replayable task of a status (and its definition, when read from the queue), with
    what its runs say (:func:`coalescer.replay.runs.fate`; without one, read from the status
    alone); ``None`` for a task that was never pending and never will be (resolved before any
    run)."""
    keys = keys_from_routes(list(routes), prefix)
    recorded = runs.Recorded(status, keys)
    if definition is not None:  # a dependent was created with its push, pending later
        scheduled = parse_time_ms(definition["created"])
    elif recorded.runs:
        scheduled = parse_time_ms(recorded.runs[0]["scheduled"])
    else:
        return None
    order = float(scheduled)
    if keys and recorded.runs:
        event = status_event(status, keys, tags=tags, rank_tag=rank_tag)
        if event is not None:
            order = event.order
    if fate is None:
        fate = runs.fate(recorded, {}, (), set())
    started, resolved, outcome = fate.worked or (0, 0, "completed")
    queue = task_queue(status)
    definition = definition or {}
    dependencies = tuple(d for d in definition.get("dependencies", ()) if d != status["taskId"])
    if fate.after and fate.after not in dependencies:  # known from the lineage's cascade only
        dependencies += (fate.after,)
    return TaskSpec(
        task_id=status["taskId"],
        task_queue=queue,
        keys=keys,
        order=order,
        scheduled_ms=scheduled,
        deadline_ms=parse_time_ms(status["deadline"]),
        priority=priority_rank(definition.get("priority", "lowest")),
        dependencies=dependencies,
        duration_ms=resolved - started if fate.worked else None,
        outcome=outcome,
        started_ms=started,
        resolved_ms=resolved,
        canceled_ms=fate.canceled_ms,
        superseded_ms=fate.superseded_ms,
        superseded_by=fate.superseded_by,
        cascaded_ms=fate.cascaded_ms,
        real_runs=fate.real,
        group=status.get("taskGroupId", ""),
    )


def task_queue(status: Mapping[str, Any]) -> str:
    """A status's task queue (``provisionerId/workerType`` on an old queue)."""
    return str(status.get("taskQueueId") or f"{status['provisionerId']}/{status['workerType']}")


@dataclasses.dataclass(frozen=True)
class _Read:
    """A task as read, before its runs are weighed against the others'."""

    status: Mapping[str, Any]
    routes: Sequence[str]
    tags: Mapping[str, Any] | None
    definition: Mapping[str, Any] | None


def _specs(
    read: Sequence[_Read], *, prefix: str, rank_tag: str | None, evidence: Evidence
) -> tuple[list[TaskSpec], dict[str, Any]]:
    """The tasks, each with what its runs say once the links of the runs that may have been
    superseded are read; and what the history observed besides, as :meth:`History.build`'s
    arguments: how many such runs no link could be read for, the queue's resolver lag."""
    recorded = [
        runs.Recorded(
            r.status,
            keys_from_routes(list(r.routes), prefix),
            tuple((r.definition or {}).get("dependencies", ())),
        )
        for r in read
    ]
    shared = runs.shared_worker(recorded)
    candidates = runs.to_check(recorded, evidence.identities, shared)
    try:
        links = evidence.links(candidates)
    except LinkError as exc:
        raise SourceError(str(exc)) from exc
    unchecked = 0
    if not evidence.reads_links:
        unchecked = len(runs.undecided(recorded, candidates, evidence.identities))
    fates = runs.fates(recorded, links, evidence.identities, shared)
    specs = []
    for r, task in zip(read, recorded, strict=True):
        try:
            spec = task_spec(
                r.status,
                r.routes,
                prefix=prefix,
                rank_tag=rank_tag,
                tags=r.tags,
                definition=r.definition,
                fate=fates[task.task_id],
            )
        except (KeyError, InvalidEvent, InvalidInput) as exc:
            raise SourceError(f"task {r.status.get('taskId')}: {exc}") from exc
        if spec is not None:
            specs.append(spec)
    try:  # the worker shims' searches: each run's own work, not its claim's span
        specs = probes.apply(specs, evidence.findings({k for t in recorded for k in t.keys}))
    except LinkError as exc:
        raise SourceError(str(exc)) from exc
    pending = {t.task_id: parse_time_ms(t.runs[0]["scheduled"]) for t in recorded if t.runs}
    specs = with_gaps(specs, pending)
    started = list(_runs(read, recorded, evidence))
    waits, holds = lags.claim_waits(started), lags.hold_times(started)
    specs = lags.with_waits(specs, waits, holds)
    observed = {
        "unchecked": unchecked,
        "resolver_lag_ms": lags.resolver_lag_ms(specs, pending),
        "curves": capacity.curves(_claimed(read, evidence)),
        "claim_wait_ms": int(percentile([w for *_, w, polled in waits if polled], 0.5) or 0),
        "hold_ms": int(percentile(list(holds.values()), 0.5) or 0),
    }
    return specs, observed


def _claimed(
    read: Sequence[_Read], evidence: Evidence
) -> Iterator[tuple[str, str, int, int | None]]:
    """Every run a worker of the pool claimed (not the enforcer): its task queue, its worker,
    when it started and when it resolved (``None``: not yet)."""
    for r in read:
        queue = task_queue(r.status)
        for run in r.status.get("runs") or ():
            worker = (run.get("workerGroup"), run.get("workerId"))
            if "started" not in run or None in worker or worker in evidence.identities:
                continue
            resolved = parse_time_ms(run["resolved"]) if "resolved" in run else None
            yield queue, "/".join(map(str, worker)), parse_time_ms(run["started"]), resolved


def _runs(
    read: Sequence[_Read], recorded: Sequence[runs.Recorded], evidence: Evidence
) -> Iterator[lags.Run]:
    """Every run a worker of the pool started (not the enforcer), as
    :mod:`coalescer.replay.lags` reads it."""
    for r, task in zip(read, recorded, strict=True):
        queue = task_queue(r.status)
        for run in r.status.get("runs") or ():
            worker = (run.get("workerGroup"), run.get("workerId"))
            if "started" not in run or None in worker or worker in evidence.identities:
                continue
            yield lags.Run(
                r.status["taskId"],
                int(run["runId"]),
                task.keys,
                (queue, "/".join(map(str, worker))),
                parse_time_ms(run["scheduled"]),
                parse_time_ms(run["started"]),
                parse_time_ms(run["resolved"]) if "resolved" in run else None,
                str(run.get("reasonResolved", "")),
            )


#: What ``--events`` reads, for the error that says it.
EVENTS_FORMAT = (
    "one Pulse message per line (JSON lines, as COALESCER_RECORD_FILE records them), or a JSON "
    "array of messages (the body of POST /v1/events)"
)


def read_events(lines: Iterable[bytes | str]) -> Iterator[Message]:
    """Messages from JSON lines (blank lines skipped; ``POST /v1/events`` shapes), or from a
    file that is one JSON array of them (``docs/examples/events.json``)."""
    lines = iter(lines)
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.lstrip()[:1] in ("[", b"["):
            yield from _array(n, line, lines)
            return
        try:
            yield Message.from_json(orjson.loads(line))
        except (orjson.JSONDecodeError, InvalidEvent) as exc:
            raise SourceError(f"line {n}: {exc} (expected {EVENTS_FORMAT})") from exc


def _array(n: int, first: bytes | str, rest: Iterator[bytes | str]) -> Iterator[Message]:
    """The messages of a JSON array that begins on line ``n``."""
    text = [x.encode() if isinstance(x, str) else x for x in (first, *rest)]
    try:
        doc = orjson.loads(b"".join(text))
    except orjson.JSONDecodeError as exc:
        raise SourceError(f"line {n}: {exc} (expected {EVENTS_FORMAT})") from exc
    for i, item in enumerate(doc):
        try:
            yield Message.from_json(item)
        except InvalidEvent as exc:
            raise SourceError(f"message {i + 1} of the array: {exc}") from exc


def from_events(
    messages: Iterable[Message],
    *,
    prefix: str,
    rank_tag: str | None,
    workers: Mapping[str, int] | None = None,
    default_workers: int | None = None,
    source: str = "recorded events",
    evidence: Evidence | None = None,
) -> History:
    """A history from recorded Pulse messages: each task as its newest message shows it.
    ``evidence`` tells superseded runs (default: by their reason and the enforcer's identity;
    give it a queue or a service to read their links)."""
    newest: dict[str, tuple[tuple[int, int], Message]] = {}
    for message in messages:
        try:
            exchange_state(message.exchange)
        except InvalidEvent:
            continue  # task-defined, artifact-created, task groups: nothing to replay
        status = message.payload.get("status") or {}
        task_id = status.get("taskId")
        if not isinstance(task_id, str):
            raise SourceError(f"a {message.exchange} message without status.taskId")
        known = status.get("runs") or []
        # A later message knows more: more runs, or the same run further along.
        weight = (len(known), len([r for r in known if "resolved" in r]))
        if task_id not in newest or weight >= newest[task_id][0]:
            newest[task_id] = (weight, message)
    read = []
    for _, message in newest.values():
        name = message.exchange.removeprefix(EXCHANGE_PREFIX)
        if problems := validation.errors(f"{name}-message", message.payload):
            raise SourceError(f"a {name} message fails its schema: " + "; ".join(problems))
        tags = (message.payload.get("task") or {}).get("tags")
        read.append(_Read(message.payload["status"], message.routes, tags, None))
    tasks, observed = _specs(
        read, prefix=prefix, rank_tag=rank_tag, evidence=evidence or Evidence()
    )
    if not tasks:
        raise SourceError("the messages hold no task that was ever pending")
    return History.build(
        tasks,
        workers=workers,
        default_workers=default_workers,
        source=source,
        **observed,
    )


def from_task_groups(
    queue: Any,
    group_ids: Iterable[str],
    *,
    prefix: str,
    rank_tag: str | None,
    workers: Mapping[str, int] | None = None,
    default_workers: int | None = None,
    evidence: Evidence | None = None,
    source: str | None = None,
) -> History:
    """A history from task groups, read with ``queue`` (a ``taskcluster.Queue``), which also
    gives the ``superseded-by.json`` of the runs that may have been superseded (``evidence``
    adds the service's lineage, or other identities of the enforcer)."""
    read = []
    ids = list(group_ids)
    for group in ids:
        query: dict[str, str] = {}
        while True:
            try:
                page = queue.listTaskGroup(group, query=query)
            except TaskclusterFailure as exc:
                raise SourceError(f"cannot list task group {group}: {exc}") from exc
            for entry in page["tasks"]:
                definition, status = entry["task"], entry["status"]
                routes = definition.get("routes", [])
                read.append(_Read(status, routes, definition.get("tags"), definition))
            if not page.get("continuationToken"):
                break
            query = {"continuationToken": page["continuationToken"]}
    evidence = dataclasses.replace(evidence or Evidence(), queue=queue)
    tasks, observed = _specs(read, prefix=prefix, rank_tag=rank_tag, evidence=evidence)
    if not tasks:
        raise SourceError(f"task groups {', '.join(ids)} hold no task")
    return History.build(
        tasks,
        workers=workers,
        default_workers=default_workers,
        source=source or "task groups " + ", ".join(ids),
        **observed,
    )
