"""The enforcer of a replayed policy: ``coalescer enforce``'s own :class:`Enforcer
<coalescer.policy.enforcer.Enforcer>`, carrying out the outbox entries that ``decide.lua``
wrote, on the pool model instead of a queue.

Only the queue calls are modelled (:class:`PoolActions`, in place of
:class:`coalescer.policy.actions.Actions`): which entries are stale, which primary ends a
chain, and what the lineage records are the enforcer's code. Each action answers as its
counterpart does on a queue, from where the victim stands in the pool:

* ``supersede``: a pending (or enforcer-held) victim is resolved superseded, its unresolved
  dependents canceled with ``cascade: cancel``; a victim running on a worker is canceled with
  ``supersede-running``, else left to run (``missed``); a resolved one is ``gone``.
* ``hold``: a pending victim is claimed and held by the enforcer until its primary ends;
  ``park`` (``hold-by: priority``) leaves it pending at the lowest priority instead, where an
  idle worker may run it (a victim there already is held).
* ``release``: a held victim resolves ``exception/worker-shutdown`` and is pending again in a
  new run (the queue's retry); a parked one is pending already, and gets its own priority back
  (a probe is raised next instead); that run is an extra one (its primary failed, or a
  bisection runs it).
* ``cancel``: a running victim is canceled, unless it has run longer than the rule protects;
  its worker stops at once (no reclaim lag is modelled).
* ``rerun``: a task resolved (with its own result, or superseded) is pending again in a new
  run (an extra one), and one never scheduled is scheduled, unless it has a newer run already
  or its deadline passed (``gone``).
* ``dependencies``, ``dependents``: the history's task graph, with the configuration's keys.

``on-primary-failure: bisect`` is the enforcer's own search too
(:class:`~coalescer.policy.bisecting.Searcher`, with the rule's ``bisect-confirm``): a probe is
a released victim, a confirmation a rerun of the task that failed, which a worker of the pool
claims and runs like any task, its result the model's (broken, recorded failed, or an
intermittent failure drawn for that run); the search's next step follows that result's event.
Each search that ends becomes a :class:`~coalescer.replay.pool.Search` of the outcome, from the
finding it recorded.

The enforcer acts at the instant of the decision: no poll interval, no queue latency.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import orjson

from coalescer.model import parse_time_ms
from coalescer.policy.actions import PARKED_PRIORITY, PROBE_PRIORITY, Relative, Result
from coalescer.policy.enforcer import Enforcer
from coalescer.policy.rules import Policy
from coalescer.replay import pool as model
from coalescer.replay.history import priority_name, priority_rank
from coalescer.store import Store, bisections
from coalescer.store import policy as outbox
from coalescer.store.policy import Entry

#: The replay's consumer name in the outboxes' consumer group.
CONSUMER = "replay"


class PoolActions:
    """:class:`coalescer.policy.actions.Actions` on the pool model, at the pool's clock; its
    keys are the replayed configuration's (``namespace`` before each)."""

    def __init__(self, namespace: str = "") -> None:
        self.pool: model.Pool | None = None
        self.now_ms = 0
        self.namespace = namespace

    def _at(self, entry: Entry) -> tuple[model.Pool, int, int]:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        return self.pool, self.pool.pos[entry.victim], self.pool.pos[entry.primary]

    async def _running(self, pool: model.Pool, entry: Entry) -> Result:
        """A victim that started meanwhile: canceled if the rule supersedes running tasks, else
        missed (it runs to its end)."""
        if entry.supersede_running:
            return await self.cancel(entry)
        pool.out.missed += 1
        return Result("missed")

    async def supersede(self, entry: Entry) -> Result:
        pool, i, primary = self._at(entry)
        where = pool.where(i)
        if where == model.RUNNING:
            return await self._running(pool, entry)
        if where == model.RESOLVED_BY_ENFORCER:
            return Result("superseded")
        if where not in (model.PENDING, model.HELD_BY_ENFORCER):
            return Result("gone")
        cascaded = pool.unresolved_dependents(i) if entry.cascade == "cancel" else ()
        pool.supersede(i, primary, self.now_ms)
        return Result("superseded", saved="pending", cascaded=cascaded)

    async def hold(self, entry: Entry) -> Result:
        pool, i, _ = self._at(entry)
        where = pool.where(i)
        if where == model.RUNNING:
            return await self._running(pool, entry)
        if where == model.HELD_BY_ENFORCER:
            return Result("held", due_ms=pool.tasks[i].deadline_ms)
        if where != model.PENDING:
            return Result("gone")
        pool.hold(i, self.now_ms)
        return Result("held", due_ms=pool.tasks[i].deadline_ms)

    async def park(self, entry: Entry) -> Result:
        pool, i, _ = self._at(entry)
        lowest = priority_rank(PARKED_PRIORITY)
        if pool.where(i) != model.PENDING or pool.priority[i] <= lowest or i in pool.reran:
            return await self.hold(entry)
        own = priority_name(pool.priority[i])
        pool.prioritize(i, lowest)
        return Result(
            "held",
            due_ms=pool.tasks[i].deadline_ms,
            definition=orjson.dumps({"priority": own}).decode(),
        )

    async def renew(self, victim: str, priority: str | None = None) -> Result:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        i = self.pool.pos[victim]
        where = self.pool.where(i)
        parked = priority not in (None, PARKED_PRIORITY) and where in (model.PENDING, model.RUNNING)
        if where != model.HELD_BY_ENFORCER and not parked:
            return Result("lost")
        return Result("held", due_ms=self.pool.tasks[i].deadline_ms)

    async def release(self, entry: Entry, priority: str | None = None) -> Result:
        pool, i, _ = self._at(entry)
        where = pool.where(i)
        if where == model.HELD_BY_ENFORCER:
            pool.release(i, self.now_ms)
            pool.after_failure.add(i)  # its next run is an extra one
        elif where == model.PENDING and pool.priority[i] == priority_rank(PARKED_PRIORITY):
            # Parked: it runs where it waits, at its own priority again unless a probe.
            pool.after_failure.add(i)
            if priority not in (None, PARKED_PRIORITY):
                pool.prioritize(i, priority_rank(priority))
                return Result("released", offer=True)
        return Result("released")

    async def rerun(self, task_id: str, after_run: int) -> Result:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        pool = self.pool
        i = pool.pos[task_id]
        waiting = pool.out.state[i] == model.State.WAITING
        if pool.out.runs[i] - 1 > after_run or not (waiting or pool.out.state[i] in model.RESOLVED):
            return Result("rerun")
        if pool.tasks[i].deadline_ms <= self.now_ms:
            return Result("gone")
        pool.rerun(i, self.now_ms)
        return Result("rerun")

    async def dependencies(self, task_id: str) -> list[Relative]:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        pool = self.pool
        deps = pool.tasks[pool.pos[task_id]].dependencies
        return [self._relative(pool, pool.pos[d]) for d in deps if d in pool.pos]

    async def dependents(self, task_id: str) -> list[Relative]:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        pool = self.pool
        return [self._relative(pool, d) for d in pool.dependents.get(pool.pos[task_id], ())]

    def _relative(self, pool: model.Pool, i: int) -> Relative:
        task = pool.tasks[i]
        keys = tuple(self.namespace + k for k in task.keys)
        return Relative(task.task_id, keys, task.order, task.deadline_ms, pool.out.runs[i] > 0)

    async def prioritize(self, task_id: str) -> Result:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        i, top = self.pool.pos[task_id], priority_rank(PROBE_PRIORITY)
        if self.pool.priority[i] == top:
            return Result("raised")
        if self.pool.out.state[i] in model.RESOLVED:
            return Result("gone")
        if i in self.pool.reran:
            return Result("kept")  # resolved before: the queue keeps its priority
        self.pool.prioritize(i, top)
        return Result("raised")

    async def created_ms(self, task_id: str) -> int | None:
        assert self.pool is not None, "PoolActions used outside Pool.run"
        return self.pool.tasks[self.pool.pos[task_id]].scheduled_ms

    async def cancel(self, entry: Entry) -> Result:
        pool, i, primary = self._at(entry)
        where = pool.where(i)
        if where in (model.PENDING, model.HELD_BY_ENFORCER):
            return await self.supersede(dataclasses.replace(entry, supersede_running=False))
        if where != model.RUNNING:
            canceled = where == model.RESOLVED_BY_ENFORCER and pool.out.state[i] == (
                model.State.CANCELED
            )
            return Result("canceled" if canceled else "gone")
        started = pool.started_ms(i)
        if entry.protect_ms >= 0 and self.now_ms - started > entry.protect_ms:
            return Result("protected", started_ms=started)
        cascaded = pool.unresolved_dependents(i) if entry.cascade == "cancel" else ()
        pool.cancel(i, primary, self.now_ms)
        return Result("canceled", saved="running", started_ms=started, cascaded=cascaded)


class PoolEnforcer:
    """The enforcer's outbox consumer and bisections for one replayed configuration's keys."""

    def __init__(self, store: Store, namespace: str = "", policy: Policy | None = None) -> None:
        self.store = store
        self.actions = PoolActions(namespace)
        self.enforcer = Enforcer(
            store,
            self.actions,
            policy=policy,
            consumer=CONSUMER,
            clock=self._clock,
            known_since=self._since,
        )
        #: Keys whose outbox held entries when last looked at.
        self.busy: set[str] = set()
        #: Keys with a bisection under way when last looked at.
        self.searching: set[str] = set()

    async def _since(self) -> int:
        """The index is fed the whole history: it knows every task from the start."""
        return 0

    def _clock(self) -> datetime:
        return datetime.fromtimestamp(self.actions.now_ms / 1000, UTC)

    async def round(self, pool: model.Pool, now_ms: int, touched: set[str]) -> bool:
        """Carry out every entry of the ``touched`` (and still busy) keys' outboxes, in order,
        then take the steps of their bisections that can be taken now, as ``coalescer
        enforce`` does; whether anything was done."""
        self.actions.pool, self.actions.now_ms = pool, now_ms
        names = sorted(touched | self.busy | self.searching)
        if not names:
            return False
        waiting = await outbox.outstanding(self.store, names)
        self.busy = {k for k in names if waiting[k][0]}
        handled = False
        for key in sorted(self.busy):
            for entry in await outbox.read(self.store, key, CONSUMER):
                await self.enforcer.handle(entry)
                handled = True
        # A search starts with an event of its key (its primary failed) and moves on with
        # events of its probes: only keys touched now, or searching already, can have a step.
        for key in names:
            if waiting[key][1] and (key in touched or key in self.searching):
                handled = await self._search(pool, key) or handled
        return handled

    async def _search(self, pool: model.Pool, key: str) -> bool:
        """Carry on ``key``'s bisections; each that ended is added to the outcome."""
        under_way = await outbox.searches(self.store, key)
        done = 0
        for primary in under_way:
            done += await self.enforcer.searcher.carry_on(key, primary)
        left = await outbox.searches(self.store, key)
        for primary in under_way.keys() - left.keys():
            started = int(orjson.loads(under_way[primary])["ended"])
            await self._ended(pool, key, primary, started)
        if left:
            self.searching.add(key)
        else:
            self.searching.discard(key)
        if done:
            self.busy.add(key)  # a step may have left entries (a probe's end, the last step's)
        return done > 0

    async def _ended(self, pool: model.Pool, key: str, primary: str, started_ms: int) -> None:
        found = [
            f
            for f in await bisections.for_task(self.store, [key], primary)
            if f["primary"]["taskId"] == primary
        ]
        if not found:
            return  # not recorded: nothing to report (cannot happen: recorded before it ends)
        finding = found[-1]

        def index(ref: dict[str, object] | None) -> int:
            return -1 if ref is None else pool.pos[str(ref["taskId"])]

        pool.out.searches.append(
            model.Search(
                primary=pool.pos[primary],
                culprit=index(finding["culprit"]),
                last_good=index(finding["lastGood"]),
                started_ms=started_ms,
                ended_ms=parse_time_ms(finding["located"]),
                runs=int(finding["extraRuns"]),
                suspect=index(finding.get("suspect")),
                rounds=int(finding.get("rounds", -1)),
            )
        )
