"""Carrying out one decision on the queue, idempotently.

Every action starts from the queue's ``status`` of the victim, so repeating it (after a crash,
or by a second enforcer) does what is left and nothing twice: a run the enforcer already holds
is claimed again (``claimTask`` by the same worker identity hands back the claim with fresh
credentials), a run already resolved by the enforcer counts as done, anything else resolved
counts as ``gone``. The enforcer acts as one worker identity (``--worker-group/--worker-id``),
shared by every enforcer process, so any of them can finish what another began.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import httpx
import orjson
from taskcluster.exceptions import TaskclusterFailure

from coalescer.errors import InvalidInput
from coalescer.model import keys_from_routes, parse_time_ms, rank_order
from coalescer.store.lineage import Decision
from coalescer.store.policy import Entry
from coalescer.worker import notice
from coalescer.worker.claims import Claim, Clock, Connection, http_status, utcnow
from coalescer.worker.notice import Why
from coalescer.worker.protocol import (
    RELEASED,
    SPARED,
    SUPERSEDED_BY,
    Resolution,
    SupersedeAs,
    superseded_by_json,
)
from coalescer.worker.resolve import JSON, Superseding, dependents

log = logging.getLogger("coalescer.policy")

RESOLVED = frozenset({"completed", "failed", "exception"})
#: A definition larger than this is kept without its payload for the primary's handoff.
MAX_DEFINITION_BYTES = 64 << 10
#: Resolutions that ``public/superseded-by.json`` follows (see :class:`Superseding`).
_LINKED_AFTER = frozenset({"superseded", "canceled"})
#: The priority a bisection's probes and confirmations run at.
PROBE_PRIORITY = "highest"
#: The priority victims wait at, unclaimed, with ``hold-by: priority``.
PARKED_PRIORITY = "lowest"
#: How often a victim waiting at the lowest priority is looked at (ms): whether a worker took
#: it, or a retry put it back at its own priority.
PARK_CHECK_MS = 10 * 60_000
#: Dependents canceled per victim at most (a cascade is a task graph, not the whole queue).
MAX_CASCADE = 1000


@dataclasses.dataclass(frozen=True)
class Result:
    """What became of a victim: its new lineage ``state`` and what to record with it."""

    state: str
    due_ms: int = 0
    saved: str = ""  # 'pending' or 'running': count the worker time saved
    started_ms: int = 0
    definition: str = ""
    cascaded: tuple[str, ...] = ()
    #: How a superseded victim's run was ended, and why (lineage).
    resolution: Resolution | None = None
    #: A ``missed`` victim's worker, ``workerGroup/workerId``: it claimed the victim first.
    winner: str = ""
    #: A ``released`` victim pending in the run it was held in (it waited unclaimed): the
    #: index is to offer it again, as no new run's event will.
    offer: bool = False


@dataclasses.dataclass(frozen=True)
class Relative:
    """A task a bisection looks at through the task graph (a dependency, or a dependent): its
    coalescing keys, its place in its first key's order (None when only its first run's
    scheduled time would give it: none yet), its deadline (ms) and whether it has a run."""

    task_id: str
    keys: tuple[str, ...]
    order: float | None
    deadline_ms: int
    ran: bool


class QueueActions(Protocol):
    """What the enforcer needs to carry out decisions: :class:`Actions` on a real queue, or
    the replay's modelled queue (:mod:`coalescer.replay.enforcing`)."""

    async def supersede(self, entry: Entry) -> Result: ...

    async def hold(self, entry: Entry) -> Result: ...

    async def park(self, entry: Entry) -> Result: ...

    async def cancel(self, entry: Entry) -> Result: ...

    async def release(self, entry: Entry, priority: str | None = None) -> Result: ...

    async def renew(self, victim: str, priority: str | None = None) -> Result: ...

    async def rerun(self, task_id: str, after_run: int) -> Result: ...

    async def prioritize(self, task_id: str) -> Result: ...

    async def dependencies(self, task_id: str) -> list[Relative]: ...

    async def dependents(self, task_id: str) -> list[Relative]: ...

    async def created_ms(self, task_id: str) -> int | None: ...


def definition_json(task: Mapping[str, Any]) -> str:
    data = orjson.dumps(task)
    if len(data) > MAX_DEFINITION_BYTES:
        data = orjson.dumps({k: v for k, v in task.items() if k != "payload"} | {"payload": None})
    return data.decode()


class Actions:
    """The queue calls behind each outbox action. ``queue`` is a ``taskcluster.aio.Queue``
    with the enforcer's own credentials; ``conn`` builds clients for claims."""

    def __init__(
        self,
        queue: Any,
        conn: Connection,
        http: httpx.AsyncClient,
        *,
        worker_group: str = "coalescer",
        worker_id: str = "enforcer",
        supersede_as: SupersedeAs = SupersedeAs.AUTO,
        public_url: str | None = None,
        clock: Clock = utcnow,
        reclaim_fraction: float = 1 / 3,
        route_prefix: str = "coalesce.v1",
        rank_tag: str | None = None,
    ) -> None:
        self.queue = queue
        self.prefix, self.rank_tag = route_prefix, rank_tag
        self.conn = conn
        self.http = http
        self.me = {"workerGroup": worker_group, "workerId": worker_id}
        self.public_url = public_url
        self.by = f"coalescer enforce ({worker_group}/{worker_id})"
        self.superseding = Superseding(
            supersede_as, queue, http, root_url=conn.root_url, by=self.by
        )
        self.clock = clock
        self.fraction = reclaim_fraction
        #: Whether the queue's refusal to raise a task it resolved before was said (once).
        self.kept_said = False
        #: Whether the queue or the credentials refused ``changeTaskPriority`` for parking
        #: (said once): victims are claimed instead, until the enforcer restarts.
        self.park_refused = False

    # -- looking ----------------------------------------------------------------------------
    def _ours(self, run: Mapping[str, Any]) -> bool:
        return (run.get("workerGroup"), run.get("workerId")) == (
            self.me["workerGroup"],
            self.me["workerId"],
        )

    async def _latest(self, task_id: str) -> Mapping[str, Any] | None:
        status = (await self.queue.status(task_id))["status"]
        runs = status.get("runs") or []
        return runs[-1] if runs else None

    async def _claim(self, task_id: str) -> Claim | Mapping[str, Any] | None:
        """Hold the victim's current run: a :class:`Claim`, or the run that prevents it (resolved,
        or running on a worker), or None for a task with no run yet."""
        for _ in range(3):
            run = await self._latest(task_id)
            if run is None or run["state"] in RESOLVED:
                return run
            if run["state"] == "running" and not self._ours(run):
                return run
            sent = self.clock()
            try:
                response = await self.queue.claimTask(task_id, str(run["runId"]), self.me)
            except TaskclusterFailure as exc:
                if http_status(exc) != 409:
                    raise
                continue  # taken or resolved meanwhile: look again
            return Claim(response, self.conn, sent, self.fraction)
        return await self._latest(task_id)

    def _resolved_by_us(self, run: Mapping[str, Any] | None) -> bool:
        """A run the enforcer (this action, or an earlier try of it) resolved."""
        return run is not None and run["state"] in RESOLVED and self._ours(run)

    # -- actions ----------------------------------------------------------------------------
    async def supersede(self, entry: Entry) -> Result:
        """Resolve a victim superseded by ``entry.primary``: claim it, cancel its dependents
        (cascade), resolve it and upload ``public/superseded-by.json``. A victim that could
        only be released is left alone (``spared``): released, it would be decided again."""
        why = await self.superseding.would_release(entry.victim)
        if why is not None:
            return Result(SPARED, resolution=Resolution(SPARED, f"left to run: {why}"))
        got = await self._claim(entry.victim)
        if not isinstance(got, Claim):
            if got is not None and got["state"] == "running":
                return await self.cancel(entry, got) if entry.supersede_running else missed(got)
            if got is None or not self._resolved_by_us(got):
                return Result("gone")
            if got["state"] == "exception" and got.get("reasonResolved") in _LINKED_AFTER:
                # An earlier try may have ended before its artifact, which follows these.
                await self._link(entry, int(got["runId"]))
            return Result("superseded")
        cascaded = await self.cascade(entry) if entry.cascade == "cancel" else ()
        try:
            done = await self.superseding.supersede(
                got, (entry.primary, entry.primary_run), self._why(entry)
            )
        except (TaskclusterFailure, httpx.HTTPError) as exc:
            status = http_status(exc)
            if status == 409:
                return Result("gone", cascaded=cascaded)
            log.error("could not supersede %r, releasing it: %s", got, exc)
            await self._release(got)
            failed = Resolution(RELEASED, f"superseding it failed (HTTP {status})")
            return Result(RELEASED, cascaded=cascaded, resolution=failed)
        if not done.superseded:
            return Result(RELEASED, cascaded=cascaded, resolution=done)
        log.info(
            "%s superseded by %s (%s): %s, %s",
            entry.victim,
            entry.primary,
            entry.reason,
            done.how,
            done.why,
        )
        return Result(
            "superseded",
            saved="pending",
            definition=definition_json(got.task),
            cascaded=cascaded,
            resolution=done,
        )

    async def hold(self, entry: Entry) -> Result:
        """Claim a victim and keep it until its primary ends (``on-primary-failure: release``)."""
        got = await self._claim(entry.victim)
        if not isinstance(got, Claim):
            if got is not None and got["state"] == "running":
                return await self.cancel(entry, got) if entry.supersede_running else missed(got)
            return Result("gone")
        return Result("held", due_ms=_ms(got.reclaim_at), definition=definition_json(got.task))

    async def park(self, entry: Entry) -> Result:
        """Hold a victim unclaimed (``hold-by: priority``): pending at the lowest priority
        (``changeTaskPriority``), behind every other task of its queue, where an idle worker
        may still run it and no retry is spent. Its definition is recorded as it was, so that
        :meth:`release` can give it its priority back. Claimed as :meth:`hold` does when it is
        not pending, already at the lowest priority (nothing would keep it behind the
        backlog), or when the queue or the credentials refuse (said once)."""
        run = await self._latest(entry.victim)
        if not self.park_refused and run is not None and run["state"] == "pending":
            task = await self.queue.task(entry.victim)
            if task.get("priority", PARKED_PRIORITY) != PARKED_PRIORITY and await self._lower(
                entry.victim
            ):
                return Result("held", due_ms=self._park_due(), definition=definition_json(task))
        return await self.hold(entry)

    async def _lower(self, task_id: str) -> bool:
        """``task_id`` to :data:`PARKED_PRIORITY`: whether it is there now."""
        try:
            await self.queue.changeTaskPriority(task_id, {"newPriority": PARKED_PRIORITY})
        except TaskclusterFailure as exc:
            status = http_status(exc)
            if status not in (401, 403, 404, 409):
                raise
            if status != 409:
                self.park_refused = True
                log.warning(
                    "the queue did not lower the priority of %s (HTTP %s; the enforcer's "
                    "credentials need queue:change-task-priority:<taskId>, on a queue that "
                    "offers changeTaskPriority): victims are claimed and held instead; said once",
                    task_id,
                    status,
                )
                return False
            # At that priority already (a repeat), or resolved meanwhile.
            return bool((await self.queue.task(task_id)).get("priority") == PARKED_PRIORITY)
        log.info("%s waits at the lowest priority until its primary ends", task_id)
        return True

    def _park_due(self) -> int:
        return _ms(self.clock()) + PARK_CHECK_MS

    async def renew(self, victim: str, priority: str | None = None) -> Result:
        """Keep a held victim's claim alive (claim again for fresh credentials, then reclaim).
        ``priority``: the victim's own, when it was parked (:meth:`park`): it stays pending at
        the lowest priority (lowered again after a retry), and a run a worker took meanwhile
        keeps it held: its result is its own, and a search may use it."""
        if priority not in (None, PARKED_PRIORITY) and not self.park_refused:
            run = await self._latest(victim)
            if run is not None and run["state"] == "pending":
                if await self._lower(victim):
                    return Result("held", due_ms=self._park_due())
            elif run is not None and not self._ours(run) and run["state"] != "exception":
                return Result("held", due_ms=self._park_due())
        got = await self._claim(victim)
        if not isinstance(got, Claim):
            return Result("lost")
        sent = self.clock()
        try:
            response = await got.queue.reclaimTask(got.task_id, str(got.run_id))
        except TaskclusterFailure as exc:
            if http_status(exc) == 409:
                return Result("lost")
            raise
        got.refresh(response, sent)
        return Result("held", due_ms=_ms(got.reclaim_at))

    async def release(self, entry: Entry, priority: str | None = None) -> Result:
        """Give a held victim back (its primary failed): it is retried and runs itself. One
        parked (:meth:`park`) is pending already: ``priority``, its own, is given back to it
        (none: it stays where it is, as a bisection's probe, raised next)."""
        run = await self._latest(entry.victim)
        if run is not None and run["state"] == "running" and self._ours(run):
            got = await self._claim(entry.victim)
            if isinstance(got, Claim):
                await self._release(got)
        elif (
            priority not in (None, PARKED_PRIORITY)
            and run is not None
            and run["state"] not in RESOLVED
            and (await self.queue.task(entry.victim)).get("priority") == PARKED_PRIORITY
        ):
            try:
                await self.queue.changeTaskPriority(entry.victim, {"newPriority": priority})
            except TaskclusterFailure as exc:
                if http_status(exc) not in (401, 403, 404, 409):
                    raise
                log.warning("%s keeps the lowest priority: %s", entry.victim, exc)
            return Result("released", offer=run["state"] == "pending")
        return Result("released")

    async def rerun(self, task_id: str, after_run: int) -> Result:
        """Run a resolved task again (``rerunTask``), to confirm the failure of its run
        ``after_run`` (a bisection's): ``rerun`` once it has a newer run, whoever made it (a
        repeat calls nothing: idempotent), ``refused`` when the credentials lack the scope
        (``queue:rerun-task:<schedulerId>/<taskGroupId>/<taskId>``: 401, 403), ``gone`` when
        the queue will not (409: past its deadline, or out of runs). A task with no run yet
        (its dependencies never completed) is scheduled so, whatever its dependencies."""
        run = await self._latest(task_id)
        if run is not None and (int(run["runId"]) > after_run or run["state"] not in RESOLVED):
            return Result("rerun")
        try:
            await self.queue.rerunTask(task_id)
        except TaskclusterFailure as exc:
            status = http_status(exc)
            if status not in (401, 403, 409):
                raise
            log.debug("rerunTask %s: HTTP %s: %s", task_id, status, exc)
            return Result("gone" if status == 409 else "refused")
        log.info("%s runs again for a bisection, after its run %d", task_id, after_run)
        return Result("rerun")

    async def dependencies(self, task_id: str) -> list[Relative]:
        """The tasks ``task_id`` depends on (``task``, then each one's definition)."""
        found = []
        for dep in (await self.queue.task(task_id)).get("dependencies", []):
            definition = await self.queue.task(dep)
            runs = ((await self.queue.status(dep))["status"].get("runs")) or []
            found.append(self._relative(dep, definition, bool(runs)))
        return found

    async def dependents(self, task_id: str) -> list[Relative]:
        """The tasks that depend on ``task_id`` (``listDependentTasks``, paged)."""
        return [
            self._relative(item["status"]["taskId"], item["task"], bool(item["status"].get("runs")))
            for item in await dependents(self.queue, task_id)
        ]

    async def created_ms(self, task_id: str) -> int | None:
        """When ``task_id`` was created (its definition's ``created``, ms); None when the queue
        no longer has it (404: past its expiry)."""
        try:
            definition = await self.queue.task(task_id)
        except TaskclusterFailure as exc:
            if http_status(exc) != 404:
                raise
            return None
        return parse_time_ms(definition["created"])

    def _relative(self, task_id: str, definition: Mapping[str, Any], ran: bool) -> Relative:
        keys = keys_from_routes(definition.get("routes", []), self.prefix)
        order = None
        if keys and self.rank_tag is not None:
            with contextlib.suppress(InvalidInput):
                order = rank_order(definition.get("tags") or {}, self.rank_tag)
        deadline = parse_time_ms(definition["deadline"]) if definition.get("deadline") else 0
        return Relative(task_id, keys, order, deadline, ran)

    async def prioritize(self, task_id: str) -> Result:
        """Move an unresolved task to the front of its task queue (``changeTaskPriority`` to
        ``highest``: a bisection's probe or confirmation, which a sheriff waits for, should not
        wait behind the backlog): ``raised`` (or already so), ``refused`` when the queue or the
        credentials do not offer it (401, 403: the scope
        ``queue:change-task-priority:<taskId>``; 404: a queue without the method), ``gone``
        when the task is resolved, ``kept`` when the queue will not change a task it resolved
        before, rerun since (release 106: 409 once its dependency resolver has handled the
        resolution; said once in the log)."""
        try:
            await self.queue.changeTaskPriority(task_id, {"newPriority": PROBE_PRIORITY})
        except TaskclusterFailure as exc:
            status = http_status(exc)
            if status not in (401, 403, 404, 409):
                raise
            log.debug("changeTaskPriority %s: HTTP %s: %s", task_id, status, exc)
            if status != 409:
                return Result("refused")
            return await self._not_raised(task_id)
        return Result("raised")

    async def _not_raised(self, task_id: str) -> Result:
        """The queue answered 409 to raising ``task_id``: at that priority already (a probe's
        rerun), resolved, or resolved before and pending or running again (a rerun)."""
        priority = (await self.queue.task(task_id)).get("priority")
        if priority == PROBE_PRIORITY:
            return Result("raised")
        run = await self._latest(task_id)
        if run is None or run["state"] in RESOLVED:
            return Result("gone")
        if not self.kept_said:
            self.kept_said = True
            log.warning(
                "the queue will not raise the priority of %s, a task it resolved before and "
                "runs again (a bisection's rerun): it waits at priority %s like any "
                "task; said once",
                task_id,
                priority,
            )
        return Result("kept")

    async def cancel(self, entry: Entry, run: Mapping[str, Any] | None = None) -> Result:
        """Cancel a running victim, unless it has run longer than the rule protects. Its worker
        learns at its next ``reclaimTask`` (409) and stops."""
        run = run or await self._latest(entry.victim)
        if run is None or run["state"] in RESOLVED:
            canceled = run is not None and run.get("reasonResolved") == "canceled"
            return Result("canceled" if canceled else "gone")
        if run["state"] == "pending" or self._ours(run):
            return await self.supersede(dataclasses.replace(entry, supersede_running=False))
        started = parse_time_ms(run["started"]) if run.get("started") else 0
        ran = _ms(self.clock()) - started
        if entry.protect_ms >= 0 and (not started or ran > entry.protect_ms):
            log.info("not canceling %s: it has run %.0f s", entry.victim, ran / 1000)
            return Result("protected", started_ms=started)
        definition = definition_json(await self.queue.task(entry.victim))
        cascaded = await self.cascade(entry) if entry.cascade == "cancel" else ()
        run_id = int(run["runId"])
        try:
            done = await self.queue.cancelTask(entry.victim)
        except TaskclusterFailure as exc:
            if http_status(exc) != 409:
                raise
            return Result("gone", cascaded=cascaded)
        after = next((r for r in done["status"]["runs"] if r["runId"] == run_id), run)
        if after["state"] != "exception":
            # Its worker resolved it first (the queue's cancel then changes nothing): it is
            # its own result, and the dependents canceled for it run after all if it passed.
            return await self._not_canceled(entry, after["state"], cascaded)
        # On the canceled run: the queue takes an artifact a while after an exception.
        await self._link(entry, run_id)
        log.info("%s canceled, superseded by %s (%s)", entry.victim, entry.primary, entry.reason)
        return Result(
            "canceled",
            saved="running",
            started_ms=started,
            definition=definition,
            cascaded=cascaded,
        )

    async def _not_canceled(self, entry: Entry, state: str, cascaded: Sequence[str]) -> Result:
        """A running victim its worker resolved ``state`` before the cancel reached the queue:
        ``gone``; the dependents the cascade canceled for it run again if it completed (a
        failed one's would never have been scheduled)."""
        again = []
        if state == "completed":
            for task_id in cascaded:
                try:
                    await self.queue.rerunTask(task_id)
                    again.append(task_id)
                except TaskclusterFailure as exc:
                    if http_status(exc) != 409:  # past its deadline
                        raise
        log.info(
            "%s was resolved %s by its worker before it could be canceled; %d dependents "
            "canceled with it run again",
            entry.victim,
            state,
            len(again),
        )
        return Result("gone")

    async def cascade(self, entry: Entry) -> tuple[str, ...]:
        """Cancel every unresolved task that depends on the victim, transitively, the deepest
        first: canceling a task resolves it, which would schedule its ``all-resolved``
        dependents if they were still waiting."""
        found: list[tuple[str, str]] = []
        seen = {entry.victim}
        todo = [entry.victim]
        while todo and len(seen) < MAX_CASCADE:
            for item in await dependents(self.queue, todo.pop(0)):
                task_id = item["status"]["taskId"]
                if task_id not in seen:
                    seen.add(task_id)
                    todo.append(task_id)
                    found.append((task_id, item["status"]["state"]))
        canceled: list[str] = []
        for task_id, state in reversed(found):
            if state in RESOLVED:
                continue
            try:
                await self.queue.cancelTask(task_id)
                canceled.append(task_id)
            except TaskclusterFailure as exc:
                if http_status(exc) != 409:  # past its deadline: resolved anyway
                    raise
        if canceled:
            log.info("canceled %d dependents of %s", len(canceled), entry.victim)
        return tuple(canceled)

    # -- helpers ----------------------------------------------------------------------------
    def _why(self, entry: Entry) -> Why:
        return Why(
            rule=f"policy rule {entry.rule!r} on key {entry.key}: {entry.reason}",
            service=self.public_url,
        )

    async def _release(self, claim: Claim) -> None:
        try:
            await claim.queue.reportException(
                claim.task_id, str(claim.run_id), {"reason": "worker-shutdown"}
            )
        except TaskclusterFailure as exc:
            if http_status(exc) != 409:
                raise

    async def restate(
        self, decision: Decision, final: tuple[str, int], public_url: str | None = None
    ) -> bool:
        """Rewrite the log and ``public/superseded-by.json`` of a run the enforcer ended for
        ``decision.by``, which was superseded in turn since: they name ``final``, the end of
        the chain, whose result now stands for it (as the service's page of the task does).
        Only a run ended ``exception`` takes artifacts after its resolution (for a while);
        best effort: False when the queue refuses."""
        if decision.resolved_as not in ("canceled", "exception/superseded"):
            return False
        victim, run_id = decision.task_id, decision.run
        why = Why(
            rule=f"policy rule {decision.rule!r} on key {decision.key}: {decision.reason}; "
            f"task {decision.by} superseded it first, and was superseded in turn: task "
            f"{final[0]} ends the chain",
            service=public_url or self.public_url,
        )
        body = notice.render(
            victim,
            run_id,
            final,
            decision.resolved_as,
            decision.resolved_why,
            why,
            root_url=self.conn.root_url,
            by=self.by,
        )
        try:
            task = await self.queue.task(victim)
            for name, content, content_type in (
                (SUPERSEDED_BY, superseded_by_json(*final), JSON),
                (notice.LOG, body, notice.TEXT),
            ):
                created = await self.queue.createArtifact(
                    victim,
                    str(run_id),
                    name,
                    {"storageType": "s3", "expires": task["expires"], "contentType": content_type},
                )
                response = await self.http.put(
                    created["putUrl"], content=content, headers={"content-type": content_type}
                )
                response.raise_for_status()
        except (TaskclusterFailure, httpx.HTTPError) as exc:
            log.info(
                "could not name %s on %s/%d as its final primary: %s", final[0], victim, run_id, exc
            )
            return False
        return True

    async def _link(self, entry: Entry, run_id: int) -> None:
        """``public/superseded-by.json`` on a run another worker holds, with the enforcer's own
        credentials (``queue:create-artifact:<taskId>/<runId>``); best effort."""
        task = await self.queue.task(entry.victim)
        try:
            created = await self.queue.createArtifact(
                entry.victim,
                str(run_id),
                SUPERSEDED_BY,
                {"storageType": "s3", "expires": task["expires"], "contentType": JSON},
            )
            response = await self.http.put(
                created["putUrl"],
                content=superseded_by_json(entry.primary, entry.primary_run),
                headers={"content-type": JSON},
            )
            response.raise_for_status()
        except (TaskclusterFailure, httpx.HTTPError) as exc:
            log.warning("no %s on %s/%d: %s", SUPERSEDED_BY, entry.victim, run_id, exc)


def missed(run: Mapping[str, Any]) -> Result:
    """A victim a worker claimed before the enforcer could: it runs (no supersede-running)."""
    return Result("missed", winner=f"{run.get('workerGroup')}/{run.get('workerId')}")


def _ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)
