"""The task life-cycle (Taskcluster's manual, "Task Life-Cycle") as pure state transitions:
creation, dependencies, scheduling, cancellation, reruns, claim expiry, deadlines and expiry. The
worker's side (claims and resolutions, "Queue-Worker Interaction") is in
:mod:`coalescer.emulator.claims`; task groups and priorities
(sealing, canceling a group, changing priorities) in :mod:`coalescer.emulator.groups`.

Every operation takes ``now`` and returns ``(response body, messages to publish)``; nothing here
does IO or reads a clock. Failures are :class:`~coalescer.emulator.model.QueueError`.

Where the real queue and its documentation differ, the real queue wins: when a run is retried
(``claim-expired``, ``worker-shutdown``, ``intermittent-task`` with retries left) ``task-exception``
for the old run comes first, then ``task-pending`` for the new one; a deadline is acted on
``deadline_delay`` after it passes, as the queue's deadline resolver does; and a resolution's
consequences come later, when the background dependency resolver works through the resolutions
(:meth:`QueueState.resolve_dependencies`): the dependents it unblocks become pending, the task
is marked ever-resolved, then ``task-group-resolved`` is published if no task of the group is
left that was never resolved.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator import artifacts, credentials
from coalescer.emulator import messages as msg
from coalescer.emulator.clock import parse_time
from coalescer.emulator.collation import sort_key
from coalescer.emulator.definition import complete
from coalescer.emulator.messages import Message
from coalescer.emulator.model import RESOLVED, QueueError, Run, Task
from coalescer.emulator.registry import TaskGroups

Outcome = tuple[Any, list[Message]]

#: Runs a task may have; rerunTask refuses past it, as the real queue does.
MAX_RUNS = 50


@dataclasses.dataclass(frozen=True)
class Timing:
    """The queue's time constants."""

    #: takenUntil is this far after a claim or reclaim (the real queue's default: 20 minutes)
    claim_timeout: timedelta = timedelta(minutes=20)
    #: temporary credentials outlive their takenUntil by this much
    credential_grace: timedelta = timedelta(minutes=1)
    #: artifacts may still be created this long after a run is resolved exception
    #: ("Queue-Worker Interaction")
    artifact_grace: timedelta = timedelta(minutes=20)
    #: an unresolved task is resolved deadline-exceeded this long after its deadline (the real
    #: queue's ``deadlineDelay``; its resolver then polls, so it acts within 20 s more)
    deadline_delay: timedelta = timedelta(minutes=1)


class QueueState:
    """All tasks of one emulated queue, in memory."""

    def __init__(self, timing: Timing | None = None) -> None:
        self.timing = timing or Timing()
        self.tasks: dict[str, Task] = {}
        self.groups = TaskGroups()
        self.issued: dict[str, credentials.Issued] = {}
        self._dependents: defaultdict[str, list[str]] = defaultdict(list)
        #: Per unscheduled task, the dependencies that do not yet allow it to run (the queue's
        #: task requirements): one is dropped when the resolver sees it resolve as required, and
        #: stays dropped even if that task is rerun.
        self._blocked: dict[str, set[str]] = {}
        self._seq = itertools.count(1)
        #: ``(taskId, taskGroupId, state)`` of the resolutions the dependency resolver has yet to
        #: look at, in order.
        self._resolutions: list[tuple[str, str, str]] = []
        #: Nothing becomes due before this time (``None``: unknown, look), so that reads of a
        #: large state do not scan every task.
        self._quiet_until: datetime | None = None

    # -- lookups -------------------------------------------------------------------------------

    def task(self, task_id: str) -> Task:
        """The task, or ResourceNotFound."""
        try:
            return self.tasks[task_id]
        except KeyError:
            raise QueueError(
                "ResourceNotFound",
                f"`{task_id}` does not correspond to a task that exists.\n"
                "Are you sure this task has already been submitted?",
                taskId=task_id,
            ) from None

    def dependents(self, task_id: str) -> list[Task]:
        """Tasks that list ``task_id`` in their dependencies, by taskId in the database's
        collation, the order in which the real queue lists (and resolves) them."""
        self.task(task_id)
        return [self.tasks[t] for t in self._dependent_ids(task_id) if t in self.tasks]

    def _dependent_ids(self, task_id: str) -> list[str]:
        return sorted(self._dependents.get(task_id, []), key=sort_key)

    def check_credentials(
        self, client_id: str, scope: str, task_id: str, run_id: int, now: datetime
    ) -> None:
        """If ``client_id`` is temporary credentials we issued: AuthenticationFailed once they
        have expired, InsufficientScopes (``scope`` missing) when they are another run's."""
        credentials.check(self.issued.get(client_id), scope, task_id, run_id, now)

    # -- tasks ---------------------------------------------------------------------------------

    def create_task(self, task_id: str, request: dict[str, Any], now: datetime) -> Outcome:
        """createTask: unscheduled until its dependencies allow, else pending at once.
        Idempotent for the same definition; RequestConflict for another."""
        definition = complete(task_id, request, now)
        self.groups.check_joinable(definition)
        existing = self.tasks.get(task_id)
        if existing is not None:
            if existing.definition != definition:
                raise QueueError(
                    "RequestConflict",
                    f"taskId `{task_id}` already used by another task.\n"
                    "This could be the result of faulty idempotency!",
                    existingTask=existing.definition,
                    taskDefinition=definition,
                )
            # An idempotent retry resends what the first call published, while still true.
            first = existing.runs[0].state if existing.runs else "unscheduled"
            if first not in ("unscheduled", "pending"):
                return {"status": existing.status()}, []
            out = [msg.task_defined(existing)]
            if first == "pending":
                out.append(msg.task_pending(existing, existing.runs[0]))
            return {"status": existing.status()}, out

        task = Task(
            task_id=task_id,
            definition=definition,
            deadline=parse_time(definition["deadline"]),
            expires=parse_time(definition["expires"]),
            retries_left=definition["retries"],
            seq=next(self._seq),
        )
        missing = [d for d in task.dependencies if d != task_id and d not in self.tasks]
        if missing:
            raise QueueError(
                "InputError", f"`{task_id}` depends on non-existing tasks: {', '.join(missing)}"
            )
        short = [
            d for d in task.dependencies if d != task_id and self.tasks[d].expires < task.deadline
        ]
        if short:
            raise QueueError(
                "InputError",
                f"`{task_id}` has dependencies that expire before its deadline: {', '.join(short)}",
            )
        self.tasks[task_id] = task
        self.groups.join(task)
        for dependency in task.dependencies:
            self._dependents[dependency].append(task_id)
        # A dependency resolved as required already no longer blocks; a self-dependency does.
        blocked = {
            d for d in task.dependencies if not self._satisfies(d, self.tasks[d].state, task)
        }
        if blocked:
            self._blocked[task_id] = blocked
        run = None if blocked else self.new_run(task, "scheduled", now)
        out = [msg.task_defined(task)]
        if run is not None:
            out.append(msg.task_pending(task, run))
        return {"status": task.status()}, out

    def schedule_task(self, task_id: str, now: datetime) -> Outcome:
        """scheduleTask: make an unscheduled task pending whatever its dependencies."""
        task = self.task(task_id)
        if now >= task.deadline:
            raise QueueError(
                "RequestConflict", f"Task `{task_id}` can't be scheduled past its deadline."
            )
        if task.state != "unscheduled":
            return {"status": task.status()}, []  # idempotent, even once resolved
        run = self.new_run(task, "scheduled", now)
        return {"status": task.status()}, [msg.task_pending(task, run)]

    def cancel_task(self, task_id: str, now: datetime) -> Outcome:
        """cancelTask: resolve the live run (or a new one) exception/canceled; idempotent."""
        task = self.task(task_id)
        if now >= task.deadline:
            raise QueueError(
                "RequestConflict", f"Task `{task_id}` can't be canceled past its deadline."
            )
        run = self.cancel_run(task, now)
        if run is not None:
            return {"status": task.status()}, self.resolved(task, run, now)
        last = task.runs[-1]
        if last.state == "exception" and last.reason_resolved == "canceled":
            # Canceled again: the real queue publishes its task-exception once more, and hands
            # the resolution to its dependency resolver again.
            return {"status": task.status()}, self.resolved(task, last, now)
        return {"status": task.status()}, []

    def cancel_run(self, task: Task, now: datetime) -> Run | None:
        """Resolve an unresolved task's live run (or a new one) exception/canceled, and return
        it (callers publish, via :meth:`resolved`); ``None`` for a resolved task."""
        if task.state in ("pending", "running"):
            run = task.runs[-1]
        elif task.state == "unscheduled":
            # A run made only to carry the exception, as scheduleTask + cancelTask would.
            run = self.new_run(task, "exception", now, state="exception")
        else:
            return None
        self.resolve(run, "exception", "canceled", now)
        return run

    def rerun_task(self, task_id: str, now: datetime) -> Outcome:
        """rerunTask: a new pending run (``rerun``) for a resolved or unscheduled task, with its
        retries reset; a pending or running task is left as it is (idempotent)."""
        task = self.task(task_id)
        if now >= task.deadline:
            raise QueueError(
                "RequestConflict", f"Task `{task_id}` can't be rescheduled past its deadline."
            )
        if task.state in ("pending", "running"):
            return {"status": task.status()}, []
        if len(task.runs) >= MAX_RUNS:
            raise QueueError(
                "RequestConflict", f"Task `{task_id}` has reached the maximum of {MAX_RUNS} runs."
            )
        task.retries_left = task.definition["retries"]
        run = self.new_run(task, "rerun", now)
        return {"status": task.status()}, [msg.task_pending(task, run)]

    # -- artifacts -----------------------------------------------------------------------------

    def create_artifact(
        self,
        task_id: str,
        run_id: int,
        name: str,
        request: dict[str, Any],
        now: datetime,
        *,
        put_url: str,
    ) -> Outcome:
        """createArtifact (see :mod:`coalescer.emulator.artifacts`); ``put_url`` is where an
        ``s3`` artifact's bytes go."""
        task = self.tasks.get(task_id)
        if task is None:  # the real queue says InputError here, not ResourceNotFound
            raise QueueError("InputError", "Task not found", taskId=task_id)
        grace = self.timing.artifact_grace
        body, artifact, run = artifacts.create(
            task, run_id, name, request, now, grace=grace, put_url=put_url
        )
        # The real queue never publishes artifact-created for s3 (its schema has no "s3").
        out = [] if artifact.storage_type == "s3" else [msg.artifact_created(task, run, artifact)]
        return body, out

    # -- time ----------------------------------------------------------------------------------

    def expire(self, now: datetime) -> list[Message]:
        """Everything due by ``now``, in time order: claim expiry, deadlines, task expiry."""
        if self._quiet_until is not None and now < self._quiet_until:
            return []
        out: list[Message] = []
        while (due := self._next_due(now)) is not None:
            when, _, task = due
            run = task.runs[-1] if task.runs else None
            if run is not None and run.state == "running" and run.taken_until == when:
                out += self._claim_expired(task, run, when)
            else:
                out += self._deadline_exceeded(task, when)
        for task in [t for t in self.tasks.values() if t.expires <= now]:
            self._forget(task)
        self.groups.expire(now)
        self._quiet_until = self._next_change()
        return out

    def changed(self) -> None:
        """An operation changed the state: when something next becomes due is unknown."""
        self._quiet_until = None

    def _next_change(self) -> datetime | None:
        """The earliest deadline, claim expiry or task expiry to come."""
        times = [task.expires for task in self.tasks.values()]
        times += [when for task in self.tasks.values() for when, _ in self._due_times(task)]
        return min(times, default=None)

    def _next_due(self, now: datetime) -> tuple[datetime, int, Task] | None:
        due: tuple[datetime, int, Task] | None = None
        for task in self.tasks.values():
            for when, order in self._due_times(task):
                if when <= now and (due is None or (when, order) < due[:2]):
                    due = (when, order, task)
        return due

    def _due_times(self, task: Task) -> list[tuple[datetime, int]]:
        """When an unresolved task's deadline (plus ``deadline_delay``) and its running run's
        claim fall due, as ``(time, tie-break)``: a claim expiring at the same time goes first."""
        if task.resolved:
            return []
        times = [(task.deadline + self.timing.deadline_delay, 1)]
        run = task.runs[-1] if task.runs else None
        if run is not None and run.state == "running" and run.taken_until is not None:
            times.append((run.taken_until, 0))
        return times

    def _claim_expired(self, task: Task, run: Run, when: datetime) -> list[Message]:
        self.resolve(run, "exception", "claim-expired", when)
        return self.retried(task, run, "retry", when)

    def _deadline_exceeded(self, task: Task, when: datetime) -> list[Message]:
        if task.runs:
            run = task.runs[-1]
        else:
            run = self.new_run(task, "exception", when, state="exception")
        self.resolve(run, "exception", "deadline-exceeded", when)
        return self.resolved(task, run, when, with_worker=False)

    def _forget(self, task: Task) -> None:
        del self.tasks[task.task_id]
        self._blocked.pop(task.task_id, None)
        self.groups.leave(task)
        self._dependents.pop(task.task_id, None)
        for dependency in task.dependencies:
            if task.task_id in self._dependents.get(dependency, []):
                self._dependents[dependency].remove(task.task_id)
        for client_id in [c for c, i in self.issued.items() if i.task_id == task.task_id]:
            del self.issued[client_id]

    # -- task groups ---------------------------------------------------------------------------

    def resolve_dependencies(self, now: datetime) -> list[Message]:
        """The dependency resolver's pass over the resolutions since its last one. For each, in
        order, as the real queue's resolver does: the dependents it was the last requirement of
        become pending (unless already scheduled, or past their deadline), in taskId collation
        order; the task is marked ever-resolved (:attr:`Task.ever_resolved`, for good); then
        ``task-group-resolved`` is published if its group (still there) has no task left that
        was never resolved.

        So a group is resolved again by every later resolution of any of its tasks (a rerun
        resolved, a canceled task canceled again, an idempotent report repeated) until a new
        task joins it, even while another of its tasks is pending again after a rerun; and tasks
        of a group resolved together for the first time (``cancelTaskGroup``) give one message,
        for the last of them handled. The real resolver handles up to 32 resolutions at a time concurrently,
        so there a few of those may each find the group resolved (measured: 2 messages for 5
        tasks canceled at once, 1 for 25); the emulator handles them one after another. The real
        resolver runs apart from the API, so a task created into the group in the meantime means
        no message, and a dependent canceled in the meantime is not scheduled."""
        due, self._resolutions = self._resolutions, []
        out = []
        for task_id, group_id, state in due:
            for dependent_id in self._dependent_ids(task_id):
                dependent = self.tasks.get(dependent_id)
                blocked = self._blocked.get(dependent_id)
                if dependent is None or blocked is None or task_id not in blocked:
                    continue
                if not self._satisfies(task_id, state, dependent):
                    continue
                blocked.discard(task_id)
                if blocked:
                    continue
                del self._blocked[dependent_id]
                if dependent.state == "unscheduled" and now < dependent.deadline:
                    run = self.new_run(dependent, "scheduled", now)
                    out.append(msg.task_pending(dependent, run))
            resolved = self.tasks.get(task_id)
            if resolved is not None:
                self.groups.mark_ever_resolved(resolved)
            group = self.groups.find(group_id)
            if group is not None and group.never_resolved == 0:
                out.append(msg.task_group_resolved(group))
        return out

    # -- helpers -------------------------------------------------------------------------------

    def new_run(self, task: Task, reason: str, when: datetime, *, state: str = "pending") -> Run:
        """Add a run (``reason`` is its reasonCreated); only the last run is ever live."""
        run = Run(len(task.runs), state, reason, scheduled=when, seq=next(self._seq))
        task.runs.append(run)
        return run

    @staticmethod
    def _satisfies(dependency: str, state: str, dependent: Task) -> bool:
        """Whether ``dependency`` resolved as ``state`` no longer blocks ``dependent``."""
        if dependency == dependent.task_id:
            return False  # a self-dependency waits for scheduleTask or the deadline
        if dependent.definition["requires"] == "all-completed":
            return state == "completed"
        return state in RESOLVED

    @staticmethod
    def resolve(run: Run, state: str, reason: str, when: datetime) -> None:
        """Mark ``run`` resolved (callers publish, via :meth:`resolved` or a retry)."""
        run.state, run.reason_resolved, run.resolved = state, reason, when

    def retried(self, task: Task, run: Run, reason: str, when: datetime) -> list[Message]:
        """After ``run`` was resolved exception for a reason that retries: a new pending run
        (``reason`` is its reasonCreated) while retries are left. As the real queue does, the
        ``task-exception`` for ``run`` (its status already showing the new run) comes first, then
        ``task-pending``; without retries left the task is resolved (see :meth:`resolved`)."""
        if task.retries_left <= 0:
            return self.resolved(task, run, when)
        task.retries_left -= 1
        retry = self.new_run(task, reason, when)
        return [msg.task_resolved(task, run), msg.task_pending(task, retry)]

    def resolved(
        self, task: Task, run: Run, when: datetime, *, with_worker: bool = True
    ) -> list[Message]:
        """The message for a task that just resolved. The resolution waits for the dependency
        resolver, which schedules the dependents it unblocks and may publish
        ``task-group-resolved`` (see :meth:`resolve_dependencies`), as the real queue's does."""
        self.hand_to_resolver(task)
        return [msg.task_resolved(task, run, with_worker=with_worker)]

    def hand_to_resolver(self, task: Task) -> None:
        """Queue the resolved task's resolution for the dependency resolver. The real queue does
        this on every call that finds the task resolved as asked, an idempotent repeat too."""
        self._resolutions.append((task.task_id, task.task_group_id, task.state))

    def issue(self, task: Task, run: Run, now: datetime) -> dict[str, str]:
        """New temporary credentials for the claimed ``run``, remembered for later checks."""
        assert run.worker_group and run.worker_id and run.taken_until
        creds, issued = credentials.issue(
            task.task_id,
            run.run_id,
            run.worker_group,
            run.worker_id,
            run.taken_until,
            list(task.definition["scopes"]),
            now=now,
            grace=self.timing.credential_grace,
        )
        self.issued[issued.client_id] = issued
        return creds
