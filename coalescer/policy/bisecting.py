"""``on-primary-failure: bisect`` in ``coalescer enforce``: the IO around
:mod:`coalescer.bisection`.

When a primary fails, ``decide.lua`` turns every victim held for it (down its chains) into a
``bisecting`` one, still held and renewed, and writes the search's record under the primary
(``co:{K}:bs``, JSON; its fields: :mod:`coalescer.policy.record`), held victims or none.

The search is the record replayed into a :class:`~coalescer.bisection.Bisection`, with the
key's flake rate (:func:`coalescer.verdicts.flake_rate` of its recent findings) written into
the record once, at the search's first step, so that every step weighs failures alike. Each
step of
:meth:`Searcher.carry_on` reads it, decides one thing and writes the new record with the
victims' lineage changes in one compare-and-set (``settle.lua``'s ``search`` mode); the queue
call follows, and is repeated harmlessly until its effect is seen. So an event seen twice, a
step taken twice, or an enforcer that dies between two steps changes nothing or resumes.

* The gap (:meth:`Searcher._widen`, at the first step): the pushes of the key between the
  newest that passed and the primary that nothing held, superseded or canceled by a decision,
  failed on their own, or never run because a decision superseded their dependency (found
  through the primary's dependencies and ``listDependentTasks``), join the search, held
  victims older than that pass leave it (superseded by it). A push of the gap is probed by
  taking it, and the dependencies it lacks, from their keys' decisions (``settle.lua``'s
  ``reserve``: ``probing``), running those dependencies again, then it (``rerunTask``, or the
  queue schedules it); nothing holds it, so nothing is superseded or released for it at the
  end. What an earlier search of the key found failing first enters the search known broken
  (:func:`~coalescer.policy.record.known_broken`), not run again. With nothing held and no
  gap, the record is dropped at once: no search.
* Probes and confirmations jump the queue: right after a victim is released or a task rerun
  for the search, its priority is raised to ``highest`` (``changeTaskPriority``). A queue or
  credentials without it (401, 403, 404) leave the priority as it is, said once in the log.
* A probe (``attempt`` 0): the middle victim is released (``reportException worker-shutdown``:
  a new pending run, which a worker runs) and becomes ``probing``; its lineage hides it from
  decisions, so it is not superseded again. Its result is the index's record of a newer run:
  ``completed`` passes, ``failed`` fails, ``exception`` (or its deadline passed) drops it from
  the search.
* A confirmation (``attempt`` k > 0, ``bisect-confirm`` >= k): a failure the search would
  narrow on (the primary's, a probe's), not yet ``confidence`` probably a breakage, is run
  again (``rerunTask``, a new run of the resolved
  task) before it is believed; its result is the index's record of a run newer than the failed
  one, as a probe's. ``failed`` again: the failure stands; ``completed``: it was intermittent,
  the push is good. The primary stays hidden from decisions while its search is under way
  (``decide.lua``), and a victim stays ``probing`` until its failure is confirmed. Without the
  scope to rerun (401, 403) the failure is trusted (a ``trusted`` result, no run), said once
  in the log; a task the queue will not rerun (409), or whose deadline comes within the margin
  below, is taken out of the search.
* A victim whose deadline comes within twice the longest run seen is released to run itself.
* At the end every victim that did not run is superseded by the run whose result stands for it
  (outbox ``supersede`` entries, carried out as any other), those nothing stands for are
  released, and the finding is recorded (:func:`coalescer.store.bisections.record`), its
  intermittent failures included, with its ``verdict`` (``culprit``, ``flaky``: the primary's
  failure did not come back, or ``inconclusive``: the culprit's failure not sure enough once
  its reruns were spent; then the finding names it ``suspect``, not ``culprit``) and the
  ``probability`` that the push it names is broken.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from coalescer import observe, verdicts
from coalescer.bisection import Bisection, contradicted, stand_ins
from coalescer.model import format_time_ms
from coalescer.policy.actions import QueueActions
from coalescer.policy.record import (
    believed,
    dump,
    finding_of,
    known_broken,
    located_ms,
    probes_under_way,
    push_deadline,
    push_last_run,
    push_task,
    ref,
    replay,
)
from coalescer.store import Store, bisections
from coalescer.store import lineage as records
from coalescer.store import policy as outbox
from coalescer.verdicts import Verdict

log = logging.getLogger("coalescer.policy")

#: Steps one call takes at most (a search takes a few per probe).
MAX_STEPS = 64
#: The key's findings its flake rate is estimated from (the newest).
FLAKES = 50
DAY_MS = 86_400_000
#: Pushes of the gap a search adds at most to those the primary held (the newest first).
MAX_GAP = 32
#: Runs the enforcer remembers raising (:meth:`Searcher._raise`) before it forgets them all.
MAX_RAISED = 10_000
#: Lineage states of a task superseded or canceled by a decision: a search may run it again.
_ENDED_BY_DECISION = frozenset({"superseded", "canceled", "ran"})
#: A run's states that are results.
RESULTS = frozenset({"completed", "failed"})
BY = "coalescer enforce"


class Searcher:
    """Carries on a key's bisections; ``now_ms`` is the queue's time. ``known_since``: when the
    index began to know every task (ms): by default the index's marker (``since_ms``, when the
    store was found new or emptied); the replay, which feeds the index its whole history, gives
    0."""

    def __init__(
        self,
        store: Store,
        actions: QueueActions,
        now_ms: Callable[[], int],
        known_since: Callable[[], Awaitable[int]] | None = None,
        parks: Callable[[str], bool] = lambda rule: False,
    ) -> None:
        self.store = store
        self.actions = actions
        self.now_ms = now_ms
        #: Whether the named rule leaves victims waiting at the lowest priority, where a
        #: worker may run them on its own (``hold-by: priority``).
        self.parks = parks
        self.known_since = known_since or self._marker_since
        #: Whether the queue refused a rerun for lack of scope (said once in the log).
        self.refused = False
        #: Whether the queue refused to raise a priority (said once in the log).
        self.unraised = False
        #: The search's runs raised so far, (taskId, runId): a step repeated while the index
        #: awaits a run's event raises nothing again (:meth:`_raise`).
        self.raised: set[tuple[str, int]] = set()

    async def _marker_since(self) -> int:
        return (await self.store.index_state(self.now_ms())).since_ms

    async def carry_on(self, key: str, primary: str) -> int:
        """Take every step of ``primary``'s search that can be taken now; how many."""
        done = 0
        for _ in range(MAX_STEPS):
            raw = (await outbox.searches(self.store, key)).get(primary)
            if raw is None or not await self._step(key, primary, raw):
                break
            done += 1
        return done

    async def _step(self, key: str, primary: str, raw: str) -> bool:
        doc = orjson.loads(raw)
        if "flake" not in doc:
            # Once, before anything runs: the key's flake rate from what its searches saw, and
            # the pushes of the gap the primary did not hold.
            findings = await bisections.recent(self.store, key, FLAKES)
            doc["flake"] = verdicts.flake_rate(findings)
            moves = await self._widen(key, primary, doc)
            if not doc["victims"]:
                # Nothing held, no gap: the failure is the push's own result; no search.
                await self._searched(key, primary, doc)
                return await self._write(key, primary, raw, None, moves)
            for known in known_broken(doc, findings):
                doc["results"].append(known)
                log.info(
                    "bisection after %s: %s, the %s an earlier search named, has not passed "
                    "since: the search starts from it",
                    primary,
                    push_task(doc, known["i"]),
                    "suspect" if known.get("suspect") else "culprit",
                    extra={"task_id": push_task(doc, known["i"])},
                )
            return await self._write(key, primary, raw, doc, moves)
        probes = probes_under_way(doc)
        now = self.now_ms()
        for under_way in list(probes):
            if await self._await_probe(key, primary, raw, doc, now, under_way):
                return True
        search = replay(doc)
        running = {int(p["i"]) for p in probes}
        margin = 2 * int(doc["longest"])
        left = [
            i
            for i in range(len(doc["victims"]))
            if i not in search.ran
            and i not in search.dropped
            and i not in search.verdicts
            and i not in running
        ]
        gap = doc.get("gap", {})
        states: dict[int, str | None] = {}
        for i in left:
            if doc["victims"][i][0] in gap:
                states[i] = "gap"  # resolved or never scheduled: nothing holds it
                continue
            found = await records.decision(self.store, key, doc["victims"][i][0])
            states[i] = None if found is None else found.state
        # Out of the search: claims lost (the victim runs itself, or ran), deadlines too close.
        gone = [i for i in left if states[i] not in ("bisecting", "gap")]
        due = [
            i
            for i in left
            if states[i] in ("bisecting", "gap") and doc["victims"][i][2] <= now + margin
        ]
        if gone or due:
            for i in gone + due:
                search.drop(i)
                doc["results"].append({"i": i, "run": doc["victims"][i][1], "passed": None})
                doc["results"][-1]["ended"] = now
            moves = [
                outbox.Move(
                    doc["victims"][i][0],
                    "bisecting",
                    "settling",
                    "release",
                    reason="its deadline comes before the bisection ends: it runs itself",
                    emit=True,
                )
                for i in due
                if states[i] == "bisecting"
            ]
            if due:
                log.warning(
                    "bisection after %s: releasing %s, whose deadline comes first",
                    primary,
                    ", ".join(doc["victims"][i][0] for i in due),
                )
            return await self._write(key, primary, raw, doc, moves)
        # Victims a worker ran on its own meanwhile: their results are taken as probes' are,
        # at no cost, where they narrow the search (a failure outside it would only cost a
        # confirmation).
        held = [i for i in left if states[i] == "bisecting" and self.parks(doc["rule"])]
        top = search.top
        ran = [
            i
            for i, state in (await self._own_runs(key, doc, held, RESULTS)).items()
            if top is not None
            and i < top
            and (state == "completed" or search.good < i < search.bad)
        ]
        if ran:
            for i in ran:
                probes.append({"i": i, "run": doc["victims"][i][1], "since": now, "attempt": 0})
            moves = [outbox.Move(doc["victims"][i][0], "bisecting", "probing") for i in ran]
            return await self._write(key, primary, raw, doc, moves)
        todo = search.probes(running)
        if not todo:
            if probes:
                return False  # what the search needs is running
            return await self._conclude(key, primary, raw, doc, search)
        probe = todo[0]
        if probe.attempt:
            return await self._confirm(key, primary, raw, doc, probe.index, probe.attempt, now)
        victim, run, _ = doc["victims"][probe.index]
        doc["rounds"] = int(doc.get("rounds", 0)) + (not probes)
        probes.append({"i": probe.index, "run": run, "since": now, "attempt": 0})
        if victim in gap:
            if not await self._write(key, primary, raw, doc, []):
                return True
            if await self._run_gap(key, primary, doc, probe.index, run, now) == "out":
                await self._result(key, primary, dump(doc), doc, probe.index, run, 0, None, now)
            return True
        move = outbox.Move(victim, "bisecting", "probing")
        if not await self._write(key, primary, raw, doc, [move]):
            return True  # taken meanwhile: look again
        await self.actions.release(self._entry(key, doc, victim, run))
        await self._raise(primary, victim, run + 1)
        log.info(
            "bisection after %s: %s runs (push %d of %d)",
            primary,
            victim,
            probe.index + 1,
            len(doc["victims"]),
        )
        return True

    async def _own_runs(
        self, key: str, doc: Mapping[str, Any], held: list[int], states: frozenset[str]
    ) -> dict[int, str]:
        """The victims among ``held`` whose run in the index is the one they were held in,
        in one of ``states`` (by index, that state): a worker took them on its own (one
        waiting at the lowest priority, ``hold-by: priority``)."""
        ids = [doc["victims"][i][0] for i in held]
        known = await self.store.known(key, ids) if ids else {}
        return {
            i: record.state
            for i, task_id in zip(held, ids, strict=True)
            if (record := known.get(task_id)) is not None
            and record.run_id == doc["victims"][i][1]
            and record.state in states
        }

    async def _widen(self, key: str, primary: str, doc: dict[str, Any]) -> list[outbox.Move]:
        """Add to the search the pushes of the gap the primary did not hold: every task of the
        key between the newest that passed and the primary that a decision superseded or
        canceled, or that failed on its own, and, through the primary's dependencies, the
        tasks never scheduled because a decision superseded their dependency (found with
        ``listDependentTasks``; placed by their rank tag). Each is run again when probed,
        after the dependencies it lacks (``doc["gap"]``: taskId -> ``[[dependency, its key,
        its last run], ...]``). The newest :data:`MAX_GAP` at most. A held victim older than
        the newest push that passed is out of the search: that pass stands for it (the
        moves returned supersede it)."""
        known = await self.store.all_known(key)
        top = known.get(primary)
        if top is None:
            return []
        # Held by this search, or failed primaries of other searches (theirs to rerun).
        held = {v[0] for v in doc["victims"]} | set(await outbox.searches(self.store, key))
        passed = [r for r in known.values() if r.state == "completed" and r.order < top.order]
        floor = max(passed, key=lambda r: (r.order, r.task_id)) if passed else None
        low = float("-inf") if floor is None else floor.order
        moves = []
        if floor is not None:
            doc["floor"] = [floor.task_id, floor.run_id]
            below = [v for v in doc["victims"] if v[0] in known and known[v[0]].order < low]
            for victim, _, _ in below:
                why = f"bisection after {primary} failed: {floor.task_id} passed, newer"
                moves.append(
                    outbox.Move(
                        victim,
                        "bisecting",
                        "settling",
                        "supersede",
                        floor.task_id,
                        floor.run_id,
                        why,
                        emit=True,
                    )
                )
            doc["victims"] = [v for v in doc["victims"] if v not in below]
        found: dict[str, tuple[float, int, int]] = {}  # taskId -> (order, run, deadline)
        between = [r for r in known.values() if low < r.order < top.order and r.task_id not in held]
        for r in sorted(between, key=lambda r: (r.order, r.task_id), reverse=True):
            if len(found) >= MAX_GAP:
                break  # the newest of a long gap
            if r.state == "exception":
                if not await self._ended_by_decision(key, r.task_id):
                    continue  # ended by a person, or the queue: not the search's to run
            elif r.state != "failed":
                continue  # pending or running elsewhere: its own result will come
            found[r.task_id] = (r.order, r.run_id, r.deadline_ms)
        needs: dict[str, list[list[Any]]] = {}
        unplaced: set[str] = set()
        for dep in await self.actions.dependencies(primary):
            if not dep.keys:
                continue
            dkey = dep.keys[0]
            dknown = await self.store.all_known(dkey)
            mine = dknown.get(dep.task_id)
            if mine is None:
                continue
            dlow = float("-inf")
            if floor is not None:
                for gdep in await self.actions.dependencies(floor.task_id):
                    if gdep.keys[:1] == (dkey,) and gdep.task_id in dknown:
                        dlow = dknown[gdep.task_id].order
            older = sorted(
                (b for b in dknown.values() if dlow < b.order < mine.order),
                key=lambda b: (b.order, b.task_id),
                reverse=True,
            )
            for b in older:
                if len(found) >= MAX_GAP:
                    break
                if b.state == "completed":
                    continue  # its dependents were scheduled: the key's index knows them
                for t in await self.actions.dependents(b.task_id):
                    if key not in t.keys or t.task_id in held:
                        continue
                    if t.task_id not in found:
                        record = known.get(t.task_id)
                        if record is not None and record.state == "exception":
                            # Canceled with its dependency (cascade), or by a person.
                            at = (record.order, record.run_id, record.deadline_ms)
                        elif record is None and not t.ran and t.order is not None:
                            at = (t.order, -1, t.deadline_ms)  # never scheduled
                        elif record is None and not t.ran:
                            # Never scheduled, and no rank tag places it: a push of the gap
                            # the search cannot see, so it names no culprit.
                            unplaced.add(t.task_id)
                            continue
                        else:
                            continue  # its result is its own
                        if not low < at[0] < top.order:
                            continue
                        found[t.task_id] = at
                    needs.setdefault(t.task_id, []).append([b.task_id, dkey, b.run_id])
        if unplaced:
            doc["unplaced"] = sorted(unplaced)[:MAX_GAP]
        if not found:
            return moves
        newest = sorted(found, key=lambda t: (found[t][0], t), reverse=True)[:MAX_GAP]
        rows = [[t, found[t][1], found[t][2]] for t in newest]

        def place(row: list[Any]) -> tuple[float, str]:
            at = found.get(row[0])
            record = known.get(row[0])
            order = at[0] if at else (record.order if record else float("-inf"))
            return (order, str(row[0]))

        doc["victims"] = sorted([*doc["victims"], *rows], key=place)
        doc["gap"] = {t: needs.get(t, []) for t in newest}
        log.info(
            "bisection after %s: %d pushes of the gap beyond the %d it held run again if "
            "probed (superseded, canceled or never scheduled earlier)",
            primary,
            len(newest),
            len(doc["victims"]) - len(newest),
        )
        return moves

    async def _run_gap(
        self, key: str, primary: str, doc: Mapping[str, Any], i: int, run: int, now: int
    ) -> str:
        """Move push ``i`` of the gap toward a run of its own for the search: its
        dependencies that did not complete run again first (each taken from its key's
        decisions, and raised), then it runs again (``rerunTask``, which also schedules a task
        that never was), raised. ``wait`` while that is under way; ``out`` when it cannot
        run (a dependency failed, the queue refused, a decision is under way about it, or its
        deadline comes first)."""
        task_id, _, deadline = doc["victims"][i]
        if deadline <= now + 2 * int(doc["longest"]):
            return "out"
        why = f"run again for the bisection after {primary} failed"

        async def take(of: str, task: str, after: int) -> bool:
            """``task`` of key ``of`` taken from its decisions for its run after ``after``."""
            return await outbox.reserve(
                self.store,
                of,
                task,
                run=after + 1,
                by=primary,
                rule=doc["rule"],
                reason=why,
                now_ms=now,
                expire_ms=deadline,
            )

        # Taken from the key's decisions first: its run may come of its dependencies' own.
        if not await take(key, task_id, run):
            return "out"
        for dep, dkey, drun in doc["gap"][task_id]:
            record = (await self.store.known(dkey, [dep])).get(dep)
            state = "" if record is None else record.state
            if state == "completed" and record is not None and record.run_id >= drun:
                continue
            if record is not None and record.run_id > drun:
                return "out" if state in ("failed", "exception") else "wait"
            if state in ("pending", "running"):
                # Under way by itself (it may hold others, as any primary): its end schedules
                # the push, or a decision supersedes it and it is run again then. Pending
                # behind the backlog, it is raised: the search waits for it.
                if state == "pending" and record is not None:
                    await self._raise(primary, dep, record.run_id)
                return "wait"
            if state == "failed" or not await self._ended_by_decision(dkey, dep, primary):
                return "out"  # broken, or ended by a person or the queue: nothing to learn
            # Taken from its key's decisions, then run again.
            if not await take(dkey, dep, drun):
                return "out"
            done = await self.actions.rerun(dep, drun)
            if done.state != "rerun":
                return "out"
            await self._raise(primary, dep, drun + 1)
            return "wait"
        done = await self.actions.rerun(task_id, run)
        if done.state != "rerun":
            return "out"
        if await self._raise(primary, task_id, run + 1):
            log.info(
                "bisection after %s: %s runs again (push %d of %d)",
                primary,
                task_id,
                i + 1,
                len(doc["victims"]),
            )
        return "wait"

    async def _searched(self, key: str, primary: str, doc: Mapping[str, Any]) -> None:
        """Mark the primary ``ran`` in its key's lineage before its search's record goes, so
        that its failure, delivered again, starts no second search (``decide.lua``)."""
        now = self.now_ms()
        until = int(doc.get("deadline") or now) + DAY_MS  # past the index's own memory of it
        common = {"by": primary, "rule": doc["rule"], "now_ms": now, "expire_ms": until}
        run = int(doc["primaryRun"])
        why = "its failure was searched"
        await outbox.reserve(self.store, key, primary, run=run, reason=why, **common)
        await outbox.reserve(self.store, key, primary, run=run, reason=why, undo=True, **common)

    async def _ended_by_decision(self, key: str, task_id: str, searcher: str = "") -> bool:
        """Whether a decision (superseded, canceled) ended ``task_id``'s run, so that a search
        may run it again, or the search after ``searcher`` took it for that already."""
        decided = await records.decision(self.store, key, task_id)
        if decided is None:
            return False
        return decided.state in _ENDED_BY_DECISION or (
            decided.state == "probing" and decided.by == searcher
        )

    async def _confirm(
        self, key: str, primary: str, raw: str, doc: dict[str, Any], i: int, attempt: int, now: int
    ) -> bool:
        """Push ``i`` failed: run it again (``rerunTask``) before the search narrows on it,
        unless its deadline comes within the margin (then it is out of the search)."""
        task_id, run = push_task(doc, i), push_last_run(doc, i)
        deadline = push_deadline(doc, i)
        if deadline is not None and deadline <= now + 2 * int(doc["longest"]):
            log.warning(
                "bisection after %s: %s's failure is not confirmed, its deadline comes first: "
                "it is out of the search",
                primary,
                task_id,
            )
            return await self._result(key, primary, raw, doc, i, run, attempt, None, now)
        rerun = {"i": i, "run": run, "since": now, "attempt": attempt}
        doc["rounds"] = int(doc.get("rounds", 0)) + (not doc["probes"])
        doc["probes"].append(rerun)
        if not await self._write(key, primary, raw, doc, []):
            return True  # taken meanwhile: look again
        log.info(
            "bisection after %s: %s runs again to confirm the failure of its run %d "
            "(confirmation %d)",
            primary,
            task_id,
            run,
            attempt,
            extra={"task_id": task_id},
        )
        taken = await self._rerun(key, primary, dump(doc), doc, now, rerun)
        return True if taken is None else taken

    async def _rerun(
        self,
        key: str,
        primary: str,
        raw: str,
        doc: dict[str, Any],
        now: int,
        probe: Mapping[str, Any],
    ) -> bool | None:
        """Ask the queue for the rerun ``probe`` (a confirmation) awaits: None once it is
        there (asked for now, or before); else the step taken in its place, the failure
        trusted (no scope to rerun) or the push out of the search (the queue refuses)."""
        i, run, attempt = int(probe["i"]), int(probe["run"]), int(probe["attempt"])
        task_id = push_task(doc, i)
        done = await self.actions.rerun(task_id, run)
        if done.state == "rerun":
            await self._raise(primary, task_id, run + 1)
            return None
        if done.state == "refused":
            if not self.refused:
                self.refused = True
                log.warning(
                    "bisection after %s: the queue refused to rerun %s (the enforcer's "
                    "credentials need queue:rerun-task:<schedulerId>/<taskGroupId>/<taskId>): "
                    "failures are trusted unconfirmed, as with bisect-confirm 0; said once",
                    primary,
                    task_id,
                )
            return await self._result(key, primary, raw, doc, i, run, attempt, False, now, True)
        log.warning(
            "bisection after %s: the queue will not rerun %s (past its deadline, or out of "
            "runs): it is out of the search",
            primary,
            task_id,
        )
        return await self._result(key, primary, raw, doc, i, run, attempt, None, now)

    async def _raise(self, primary: str, task_id: str, run: int) -> bool:
        """Move the search's run ``run`` of ``task_id`` to the front of its task queue, once
        (steps repeat while the index awaits the run's event): whether it was asked now."""
        if (task_id, run) in self.raised:
            return False
        if len(self.raised) >= MAX_RAISED:
            self.raised.clear()  # at worst, one more call for each run under way
        self.raised.add((task_id, run))
        done = await self.actions.prioritize(task_id)
        if done.state == "refused" and not self.unraised:
            self.unraised = True
            log.warning(
                "bisection after %s: the queue did not raise the priority of %s (the "
                "enforcer's credentials need queue:change-task-priority:<taskId>, on a queue "
                "that offers changeTaskPriority): probes wait in the queue like any task; "
                "said once",
                primary,
                task_id,
            )
        return True

    async def _await_probe(
        self,
        key: str,
        primary: str,
        raw: str,
        doc: dict[str, Any],
        now: int,
        probe: Mapping[str, Any],
    ) -> bool:
        """Record ``probe``'s result once it is in: whether a step was taken."""
        i, run, attempt = int(probe["i"]), int(probe["run"]), int(probe.get("attempt", 0))
        task_id, deadline = push_task(doc, i), push_deadline(doc, i)
        gap = doc.get("gap", {})
        record = (await self.store.known(key, [task_id])).get(task_id)
        passed: bool | None
        if record is None and task_id in gap and not attempt:
            # Never scheduled yet: its dependencies run again first.
            if await self._run_gap(key, primary, doc, i, run, now) != "out":
                return False
            passed = None
        elif record is None or (deadline is not None and now > deadline):
            passed = None  # forgotten, or past its deadline: no verdict
        elif record.state in ("completed", "failed") and (
            record.run_id > run or (record.run_id == run and not attempt and task_id not in gap)
        ):
            # A held victim's probe is a newer run (its claim released); a victim that waited
            # unclaimed at the lowest priority runs in the run it was held in.
            passed = record.state == "completed"
        elif task_id in gap and not attempt:
            if record.run_id > run and record.state == "exception":
                passed = None  # no verdict on the code
            elif record.run_id > run:
                if record.state == "pending":
                    # Scheduled by the queue once its dependencies completed: to the front.
                    await self._raise(primary, task_id, record.run_id)
                return False  # pending or running
            elif await self._run_gap(key, primary, doc, i, run, now) == "out":
                passed = None
            else:
                return False
        elif attempt:
            # A confirmation: its run is newer than the failed one.
            if record.run_id > run and record.state == "exception":
                passed = None  # no verdict on the code
            elif record.run_id > run:
                return False  # pending or running
            else:
                # Not rerun yet, as far as the index knows: ask (nothing twice, the queue's
                # status says whether it was).
                taken = await self._rerun(key, primary, raw, doc, now, probe)
                return False if taken is None else taken
        elif record.state == "exception" and (
            record.run_id > run or record.reason != "worker-shutdown"
        ):
            passed = None  # ended in an exception: no verdict on the code
        else:
            # Not over yet. Repeat the release: it does nothing once the run was given back.
            await self.actions.release(self._entry(key, doc, task_id, run))
            return False
        ran = record.run_id if record is not None else run
        return await self._result(key, primary, raw, doc, i, ran, attempt, passed, now)

    async def _result(
        self,
        key: str,
        primary: str,
        raw: str,
        doc: dict[str, Any],
        i: int,
        run: int,
        attempt: int,
        passed: bool | None,
        now: int,
        trusted: bool = False,
    ) -> bool:
        """Record push ``i``'s result (run ``run``, attempt ``attempt``; ``passed`` None: out of
        the search); a victim that has its verdict, or is out, has ``ran``."""
        result: dict[str, Any] = {"i": i, "run": run, "attempt": attempt, "passed": passed}
        result["ended"] = now
        if trusted:
            result["trusted"] = True
        doc["results"].append(result)
        for ended in [p for p in doc["probes"] if int(p["i"]) == i]:
            doc["longest"] = max(int(doc["longest"]), now - int(ended["since"]))
        doc["probes"] = [p for p in doc["probes"] if int(p["i"]) != i]
        moves = []
        if i < len(doc["victims"]):
            after = replay(doc)
            if i in after.verdicts or i in after.dropped:
                moves.append(outbox.Move(doc["victims"][i][0], "probing", "ran"))
        return await self._write(key, primary, raw, doc, moves)

    async def _conclude(
        self, key: str, primary: str, raw: str, doc: dict[str, Any], search: Bisection
    ) -> bool:
        victims = doc["victims"]
        n = len(victims)
        stood = stand_ins(search)
        culprit, good = search.culprit, search.last_good
        verdict, named = search.verdict, search.named
        if named is not None:
            # The search ran only what the primary held: a push between the last good and the
            # culprit that has a result of its own elsewhere makes the culprit unsure.
            known = {
                r.task_id: (r.order, r.state) for r in (await self.store.all_known(key)).values()
            }

            def order(i: int) -> float:
                return known.get(push_task(doc, i), (float("nan"), ""))[0]

            # A push between the last good and the culprit that did not pass leaves the
            # culprit unsure: one outside the search, or one the search dropped.
            ours = {push_task(doc, i) for i in range(n + 1)}
            outside = {t: k for t, k in known.items() if t not in ours}
            against = contradicted(None if good is None else order(good), order(named), outside)
            against += [
                push_task(doc, i)
                for i in sorted(search.dropped)
                if (good is None or good < i)
                and i < named
                and known.get(push_task(doc, i), (0.0, ""))[1] != "completed"
                and push_task(doc, i) not in against
            ]
            against += doc.get("unplaced", [])
            if against:
                verdict, named = Verdict.INCONCLUSIVE, None
                log.info(
                    "bisection after %s: %s did not pass, between the last good and the first "
                    "failing push it found (out of the search, outside it, or never scheduled "
                    "with nothing to place it): inconclusive",
                    primary,
                    ", ".join(against[:5]),
                )
            elif unseen := await self._unseen_below(doc, named, good, known):
                verdict, named = Verdict.INCONCLUSIVE, None
                floor, since = unseen
                log.info(
                    "bisection after %s: %s, below which no push was found failing, was created "
                    "before the index began to know every task (%s: the store was new or "
                    "emptied then); pushes between it and the first failing push may have "
                    "ended unseen: inconclusive",
                    primary,
                    floor,
                    format_time_ms(since),
                )
        if named is not None and believed(doc).get(named, {}).get("suspect"):
            # The earlier search's suspect, and nothing this one ran made it more.
            log.info(
                "bisection after %s: it ends on %s, an earlier search's suspect: inconclusive",
                primary,
                push_task(doc, named),
            )
            verdict, named = Verdict.INCONCLUSIVE, None
        intermittent_primary = search.verdicts.get(n) is True
        moves: list[outbox.Move] = []
        stands_for: list[dict[str, Any]] = []
        gap = doc.get("gap", {})
        left = [
            i
            for i, (victim, _, _) in enumerate(victims)
            if i not in search.ran and i not in search.dropped and victim not in gap
        ]
        # (A victim the enforcer claimed runs in its held run too: only one waiting unclaimed
        # can have been taken by a worker.)
        parked = left if self.parks(doc["rule"]) else []
        running = set(await self._own_runs(key, doc, parked, RESULTS | {"running"}))
        for i, (victim, run, _) in enumerate(victims):
            if i in search.ran or i in search.dropped or victim in gap:
                continue  # a push of the gap that did not run is left as it was
            if i in running:
                # Waiting at the lowest priority, a worker took it meanwhile: its result is
                # its own, and, as a probe's, starts no search of its own.
                moves.append(outbox.Move(victim, "bisecting", "ran"))
                continue
            if i in stood:
                by = ref(doc, stood[i])
                if stood[i] == culprit:
                    role = "the culprit (the first failing push)"
                elif stood[i] == good:
                    role = "the last good push"
                elif stood[i] == n and intermittent_primary:
                    role = "the primary, whose failure did not come back when it ran again"
                else:
                    role = "the failed primary"
                why = f"bisection after {primary} failed: {by['taskId']} is {role}"
                moves.append(
                    outbox.Move(
                        victim,
                        "bisecting",
                        "settling",
                        "supersede",
                        by["taskId"],
                        by["runId"],
                        why,
                        emit=True,
                    )
                )
                stands_for.append({"taskId": victim, "runId": run, "by": by})
            else:
                why = f"bisection after {primary} failed: no result stands for it"
                moves.append(
                    outbox.Move(victim, "bisecting", "settling", "release", reason=why, emit=True)
                )
        finding = finding_of(key, doc, search, verdict, named, stands_for, BY)
        located = located_ms(doc)
        await bisections.record(self.store, finding, located)
        await self._searched(key, primary, doc)
        if not await self._write(key, primary, raw, None, moves):
            return True
        for dep, dkey, _ in {(d, k, 0) for needs in gap.values() for d, k, _ in needs}:
            # The dependencies the search ran again go back to their keys' decisions.
            await outbox.reserve(
                self.store,
                dkey,
                dep,
                run=0,
                by=primary,
                rule=doc["rule"],
                reason="",
                now_ms=self.now_ms(),
                expire_ms=0,
                undo=True,
            )
        observe.bisection_recorded(finding, "enforcer")
        if culprit is not None:
            named = finding["culprit"] or finding["suspect"]
            last = finding["lastGood"]
            log.info(
                "%s: task %s run %d is the first failing of %d tasks held by %s and %d of "
                "the gap (broken with probability %.4f at a flake rate of %.3f); last good %s; "
                "%d extra runs, %d intermittent",
                "culprit located" if finding["culprit"] else "inconclusive, suspect",
                named["taskId"],
                named["runId"],
                finding["held"],
                primary,
                finding["gap"],
                finding["probability"],
                search.flake,
                "none" if last is None else f"task {last['taskId']} run {last['runId']}",
                finding["extraRuns"],
                len(search.intermittent),
                extra={"task_id": named["taskId"]},
            )
        elif intermittent_primary:
            log.info(
                "bisection after %s: flaky, no push to blame: its failure did not come back "
                "when it ran again; it stands for the %d tasks it held",
                primary,
                finding["held"],
            )
        else:
            log.info(
                "bisection after %s located no culprit (%d tasks held, %d of the gap)",
                primary,
                finding["held"],
                finding["gap"],
            )
        return True

    async def _unseen_below(
        self,
        doc: Mapping[str, Any],
        named: int,
        good: int | None,
        known: Mapping[str, tuple[float, str]],
    ) -> tuple[str, int] | None:
        """Whether the index may not know every push between the culprit ``named`` and the
        push below it that passed (the newest known to pass below the culprit, the last good
        or the gap's floor; without any, the culprit itself) because that push was created
        before the index began to know every task (the store was new, or emptied and rebuilt
        from what was live then): pushes between it and the culprit may have ended unseen, and
        one of them may have been the first to fail. ``(that push, when the index's knowledge
        began)``, or None when the index knew of the key's tasks since before it."""
        culprit = known.get(push_task(doc, named), (float("nan"), ""))[0]
        below = {t for t, (o, state) in known.items() if state == "completed" and o < culprit}
        if good is not None:
            below.add(push_task(doc, good))
        if doc.get("floor"):
            below.add(str(doc["floor"][0]))
        placed = [(known[t][0], t) for t in below if t in known and known[t][0] < culprit]
        base = max(placed)[1] if placed else push_task(doc, named)
        since = await self.known_since()
        created = await self.actions.created_ms(base)
        return None if created is not None and created >= since else (base, since)

    async def _write(
        self,
        key: str,
        primary: str,
        raw: str,
        doc: Mapping[str, Any] | None,
        moves: list[outbox.Move],
    ) -> bool:
        rule = orjson.loads(raw)
        return await outbox.search_step(
            self.store,
            key,
            primary,
            expected=raw,
            record=None if doc is None else dump(doc),
            now_ms=self.now_ms(),
            moves=moves,
            cascade=rule["cascade"],
            protect_ms=int(rule["protect"]),
            supersede_running=bool(rule["supersedeRunning"]),
        )

    def _entry(self, key: str, doc: Mapping[str, Any], victim: str, run: int) -> outbox.Entry:
        return outbox.Entry(
            id="",
            key=key,
            action="release",
            victim=victim,
            run=run,
            primary=doc["primary"],
            primary_run=doc["primaryRun"],
            rule=doc["rule"],
            reason="bisection",
            cascade=doc["cascade"],
            protect_ms=int(doc["protect"]),
            supersede_running=bool(doc["supersedeRunning"]),
        )
