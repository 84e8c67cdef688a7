"""What each recorded run of a task was: work, a hold by the superseding side, or a person's
cancel. Pure: the links it weighs are read at the edges (:mod:`coalescer.replay.links`).

A superseded run did no work: a worker (or the enforcer) claimed it and resolved it without
running its command, in whichever way the queue let it end it: ``exception/superseded`` on an
old queue, ``exception/canceled`` through ``cancelTask``, or ``completed`` when an operator asked
for that by name. Whatever the resolution, it is recognised by:

* its reason, ``superseded``;
* a link naming its primary: its ``public/superseded-by.json``, or the service's lineage (``GET
  /v1/tasks/<taskId>``);
* the identity that resolved it: the enforcer's (``coalescer/enforcer`` unless told otherwise)
  runs no command, so every run it claimed and resolved was superseded.

A run the superseding side released (``exception/worker-shutdown``) is retried: the task's next
run tells its fate. The enforcer's ``cascade: cancel`` cancels a victim's dependents before they
ever ran: such a cancel (named so by the lineage, or, in a task group, a dependent canceled
before it ran while a task it depends on was superseded) is superseding's doing too, and the
task depends on that victim. A cancel that none of these explains is a person's.

Only *real* runs, runs that executed a command, size the pools: a run that completed or failed
and was not superseded, and a run canceled on its worker, by a person or by the enforcer for a
newer task (``supersede-running``): it ran until then. A worker's held secondaries are not (a
canceled run its worker held beside a run of the same key is taken for one), nor anything the
enforcer claimed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from coalescer.model import parse_time_ms

#: A queue identity, ``(workerGroup, workerId)``.
Identity = tuple[str, str]
#: A task's run, ``(taskId, runId)``.
Ref = tuple[str, int]

#: The identity ``coalescer enforce`` claims as by default.
ENFORCER: Identity = ("coalescer", "enforcer")


def parse_identity(text: str) -> Identity:
    """``GROUP/ID`` as an identity."""
    group, sep, worker = text.partition("/")
    if not sep or not group or not worker or "/" in worker:
        raise ValueError(f"{text!r}: expected WORKER_GROUP/WORKER_ID")
    return group, worker


@dataclasses.dataclass(frozen=True, slots=True)
class Recorded:
    """A task as a source read it: its status (``runs`` as the queue gives them), its
    coalescing keys and, when known, the tasks it depends on."""

    status: Mapping[str, Any]
    keys: tuple[str, ...]
    dependencies: tuple[str, ...] = ()

    @property
    def task_id(self) -> str:
        return str(self.status["taskId"])

    @property
    def runs(self) -> Sequence[Mapping[str, Any]]:
        return self.status.get("runs") or []


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """What a link says of a run: it was ended for ``primary`` (``""`` when the link does not
    name it); with ``cascade``, canceled because ``primary``, a task it depends on, was."""

    primary: str = ""
    cascade: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Fate:
    """What a task's runs say. ``worked``: ``(started, resolved, state)`` of the run that did
    its work, if one did; ``superseded_ms``: when its newest run was resolved superseded (0 if
    it was not), by ``superseded_by`` when known; ``canceled_ms``: when a person canceled it
    (0 if nobody did); ``cascaded_ms``: when the enforcer canceled it because ``after``, a task
    it depends on, was superseded; ``real``: ``(started, resolved)`` of every run that executed
    a command."""

    worked: tuple[int, int, str] | None = None
    superseded_ms: int = 0
    superseded_by: str = ""
    canceled_ms: int = 0
    cascaded_ms: int = 0
    after: str = ""
    real: tuple[tuple[int, int], ...] = ()


def identity(run: Mapping[str, Any]) -> Identity | None:
    group, worker = run.get("workerGroup"), run.get("workerId")
    return (group, worker) if isinstance(group, str) and isinstance(worker, str) else None


def _span(run: Mapping[str, Any]) -> tuple[int, int] | None:
    if "started" in run and "resolved" in run:
        return parse_time_ms(run["started"]), parse_time_ms(run["resolved"])
    return None


def shared_worker(tasks: Iterable[Recorded]) -> set[Ref]:
    """Runs held by one worker at the same time as a run of another task of the same key: a
    worker's task set (its primary and the secondaries it held while the primary ran)."""
    by_worker: dict[Identity, list[tuple[int, int, str, int, frozenset[str]]]] = defaultdict(list)
    for task in tasks:
        if not task.keys:
            continue
        for run in task.runs:
            who, span = identity(run), _span(run)
            if who is not None and span is not None:
                by_worker[who].append(
                    (*span, task.task_id, int(run["runId"]), frozenset(task.keys))
                )
    found: set[Ref] = set()
    for spans in by_worker.values():
        spans.sort()
        active: list[tuple[int, int, str, int, frozenset[str]]] = []
        for held in spans:
            start, _, task_id, run_id, keys = held
            active = [a for a in active if a[1] > start]
            for other in active:
                if other[2] != task_id and other[4] & keys:
                    found.update({(task_id, run_id), (other[2], other[3])})
            active.append(held)
    return found


def to_check(
    tasks: Iterable[Recorded], identities: Collection[Identity], shared: set[Ref]
) -> list[Ref]:
    """The runs whose link (``superseded-by.json``, lineage) is worth reading: the newest run of
    a task with a key, when it ended superseded (to learn by what), canceled (by a person, or
    for a newer task?), or completed while the enforcer held it or while its worker held
    another run of its key."""
    found = []
    for task in tasks:
        if not task.keys or not task.runs:
            continue
        last = task.runs[-1]
        if "resolved" not in last:
            continue
        ref = (task.task_id, int(last["runId"]))
        if last.get("reasonResolved") in ("superseded", "canceled") or (
            last.get("state") == "completed" and (identity(last) in identities or ref in shared)
        ):
            found.append(ref)
    return found


def undecided(
    tasks: Iterable[Recorded], refs: Collection[Ref], identities: Collection[Identity]
) -> list[Ref]:
    """Of ``refs`` (:func:`to_check`), the runs only a link can tell superseded or not: neither
    their reason nor the identity that resolved them does."""
    wanted = set(refs)
    found = []
    for task in tasks:
        for run in task.runs:
            ref = (task.task_id, int(run["runId"]))
            if ref in wanted and run.get("reasonResolved") != "superseded":
                if identity(run) not in identities:
                    found.append(ref)
    return found


def fates(
    tasks: Sequence[Recorded],
    links: Mapping[Ref, Link],
    identities: Collection[Identity],
    shared: set[Ref],
) -> dict[str, Fate]:
    """Every task's :class:`Fate`, given the links read for its runs (:func:`to_check`), the
    superseding side's identities and :func:`shared_worker`'s runs."""
    found = {task.task_id: fate(task, links, identities, shared) for task in tasks}
    for task in tasks:
        mine = found[task.task_id]
        if not mine.canceled_ms or any(_span(run) for run in task.runs):
            continue
        # Canceled before it ever ran, while a task it waited for was superseded: the
        # enforcer's cascade (its dependents would never have been scheduled anyway).
        for dep in task.dependencies:
            if dep in found and found[dep].superseded_ms:
                found[task.task_id] = dataclasses.replace(
                    mine, canceled_ms=0, cascaded_ms=mine.canceled_ms, after=dep
                )
                break
    return found


def fate(
    task: Recorded,
    links: Mapping[Ref, Link],
    identities: Collection[Identity],
    shared: set[Ref],
) -> Fate:
    """What ``task``'s own runs say (see :func:`fates`)."""
    runs = task.runs
    if not runs:
        return Fate()
    last = runs[-1]
    superseded, by, cascaded = False, "", False
    if "resolved" in last and last.get("state") in ("completed", "exception"):
        ref, reason = (task.task_id, int(last["runId"])), last.get("reasonResolved")
        link = links.get(ref)
        if link is not None and link.cascade and reason == "canceled":
            cascaded, by = True, link.primary
        elif link is not None:
            superseded, by = True, link.primary
        elif reason == "superseded":
            superseded = True
        elif identity(last) in identities and reason in ("completed", "canceled"):
            superseded = True
    real: list[tuple[int, int]] = []
    for run in runs:
        span = _span(run)
        if span is None or identity(run) in identities:
            continue
        state, reason = run.get("state"), run.get("reasonResolved")
        newest = run is last
        if state in ("completed", "failed"):
            if not (newest and superseded):
                real.append(span)
        elif reason == "canceled" and (task.task_id, int(run["runId"])) not in shared:
            # Canceled while running, for a newer task or by a person: it ran until then. A
            # secondary canceled by the worker that held it beside its primary never ran.
            real.append(span)
    worked = None
    if last.get("state") in ("completed", "failed") and not superseded and (span := _span(last)):
        worked = (*span, str(last["state"]))
    canceled = last.get("reasonResolved") == "canceled" and "resolved" in last
    canceled_ms = parse_time_ms(last["resolved"]) if canceled else 0
    return Fate(
        worked=worked,
        superseded_ms=parse_time_ms(last["resolved"]) if superseded else 0,
        superseded_by=by if superseded else "",
        canceled_ms=0 if superseded or cascaded else canceled_ms,
        cascaded_ms=canceled_ms if cascaded else 0,
        after=by if cascaded else "",
        real=tuple(real),
    )
