"""``on-primary-failure: bisect`` in ``coalescer enforce``: the IO around
:mod:`coalescer.bisection`.

When a primary fails, ``decide.lua`` turns every victim held for it (down its chains) into a
``bisecting`` one, still held and renewed, and writes the search's record under the primary
(``co:{K}:bs``, JSON)::

    {"primary", "primaryRun", "rule", "cascade", "protect", "supersedeRunning",
     "ended": ms, "longest": ms (the longest run seen, the primary's first),
     "victims": [[taskId, heldRunId, deadline_ms], ...]   (oldest first),
     "results": [{"i", "run", "passed": true | false | null (dropped), "ended": ms}, ...],
     "probe": {"i", "run", "since": ms} | null}

The search is the record replayed into a :class:`~coalescer.bisection.Bisection`. Each step of
:meth:`Searcher.carry_on` reads it, decides one thing and writes the new record with the
victims' lineage changes in one compare-and-set (``settle.lua``'s ``search`` mode); the queue
call follows, and is repeated harmlessly until its effect is seen. So an event seen twice, a
step taken twice, or an enforcer that dies between two steps changes nothing or resumes.

* A probe: the middle victim is released (``reportException worker-shutdown``: a new pending
  run, which a worker runs) and becomes ``probing``; its lineage hides it from decisions, so it
  is not superseded again. Its result is the index's record of a newer run: ``completed``
  passes, ``failed`` fails, ``exception`` (or its deadline passed) drops it from the search.
* The enforcer trusts failures (``bisect-confirm`` is treated as 0): a failed run is resolved
  and only the deprecated ``rerunTask`` could run it again.
* A victim whose deadline comes within twice the longest run seen is released to run itself.
* At the end every victim that did not run is superseded by the run whose result stands for it
  (outbox ``supersede`` entries, carried out as any other), those nothing stands for are
  released, and the finding is recorded (:func:`coalescer.store.bisections.record`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from coalescer import observe
from coalescer.bisection import Bisection, stand_ins
from coalescer.model import format_time_ms
from coalescer.policy.actions import QueueActions
from coalescer.store import Store, bisections
from coalescer.store import lineage as records
from coalescer.store import policy as outbox

log = logging.getLogger("coalescer.policy")

#: Steps one call takes at most (a search takes a few per probe).
MAX_STEPS = 64
BY = "coalescer enforce"


def replay(doc: Mapping[str, Any]) -> Bisection:
    """The search as its record says it stands (bisect-confirm 0)."""
    search = Bisection.start(len(doc["victims"]), 0, _when(doc["ended"]))
    for result in doc["results"]:
        if result["passed"] is None:
            search.drop(result["i"])
        else:
            search.record(result["i"], result["passed"], _when(result["ended"]))
    return search


def _when(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def _dump(doc: Mapping[str, Any]) -> str:
    return orjson.dumps(doc).decode()


class Searcher:
    """Carries on a key's bisections; ``now_ms`` is the queue's time."""

    def __init__(self, store: Store, actions: QueueActions, now_ms: Callable[[], int]) -> None:
        self.store = store
        self.actions = actions
        self.now_ms = now_ms

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
        search = replay(doc)
        now = self.now_ms()
        if doc["probe"] is not None:
            return await self._await_probe(key, primary, raw, doc, now)
        margin = 2 * int(doc["longest"])
        left = [
            i for i in range(len(doc["victims"])) if i not in search.ran and i not in search.dropped
        ]
        states = {}
        for i in left:
            found = await records.decision(self.store, key, doc["victims"][i][0])
            states[i] = None if found is None else found.state
        # Out of the search: claims lost (the victim runs itself, or ran), deadlines too close.
        gone = [i for i in left if states[i] != "bisecting"]
        due = [i for i in left if states[i] == "bisecting" and doc["victims"][i][2] <= now + margin]
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
            ]
            if due:
                log.warning(
                    "bisection after %s: releasing %s, whose deadline comes first",
                    primary,
                    ", ".join(doc["victims"][i][0] for i in due),
                )
            return await self._write(key, primary, raw, doc, moves)
        probe = search.next()
        if probe is None:
            return await self._conclude(key, primary, raw, doc, search)
        victim, run, _ = doc["victims"][probe.index]
        doc["probe"] = {"i": probe.index, "run": run, "since": now}
        move = outbox.Move(victim, "bisecting", "probing")
        if not await self._write(key, primary, raw, doc, [move]):
            return True  # taken meanwhile: look again
        await self.actions.release(self._entry(key, doc, victim, run))
        log.info(
            "bisection after %s: %s runs (push %d of %d)",
            primary,
            victim,
            probe.index + 1,
            len(doc["victims"]),
        )
        return True

    async def _await_probe(
        self, key: str, primary: str, raw: str, doc: dict[str, Any], now: int
    ) -> bool:
        i, run = doc["probe"]["i"], doc["probe"]["run"]
        victim, _, deadline = doc["victims"][i]
        record = (await self.store.known(key, [victim])).get(victim)
        passed: bool | None
        if record is None or now > deadline:
            passed = None  # forgotten, or past its deadline: no verdict
        elif record.run_id > run and record.state in ("completed", "failed"):
            passed = record.state == "completed"
        elif record.state == "exception" and (
            record.run_id > run or record.reason != "worker-shutdown"
        ):
            passed = None  # ended in an exception: no verdict on the code
        else:
            # Not over yet. Repeat the release: it does nothing once the run was given back.
            await self.actions.release(self._entry(key, doc, victim, run))
            return False
        ran = record.run_id if record is not None else run
        doc["results"].append({"i": i, "run": ran, "passed": passed, "ended": now})
        doc["longest"] = max(int(doc["longest"]), now - int(doc["probe"]["since"]))
        doc["probe"] = None
        return await self._write(key, primary, raw, doc, [outbox.Move(victim, "probing", "ran")])

    async def _conclude(
        self, key: str, primary: str, raw: str, doc: dict[str, Any], search: Bisection
    ) -> bool:
        victims = doc["victims"]
        n = len(victims)
        runs = {r["i"]: r["run"] for r in doc["results"] if r["passed"] is not None}

        def ref(i: int) -> dict[str, Any]:
            if i == n:
                return {"taskId": primary, "runId": doc["primaryRun"]}
            return {"taskId": victims[i][0], "runId": runs[i]}

        stood = stand_ins(search)
        culprit, good = search.culprit, search.last_good
        moves: list[outbox.Move] = []
        stands_for: list[dict[str, Any]] = []
        for i, (victim, run, _) in enumerate(victims):
            if i in search.ran or i in search.dropped:
                continue
            if i in stood:
                by = ref(stood[i])
                role = (
                    "the culprit (the first failing push)"
                    if stood[i] == culprit
                    else ("the last good push" if stood[i] == good else "the failed primary")
                )
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
        ended = [r["ended"] for r in doc["results"]]
        located = max(ended, default=int(doc["ended"]))
        finding: dict[str, Any] = {
            "key": key,
            "by": BY,
            "primary": ref(n),
            "held": n,
            "culprit": None if culprit is None else ref(culprit),
            "lastGood": None if good is None else ref(good),
            "runs": [
                ref(n) | {"attempt": 0, "passed": False, "ended": format_time_ms(int(doc["ended"]))}
            ]
            + [
                ref(r["i"])
                | {"attempt": 0, "passed": r["passed"], "ended": format_time_ms(r["ended"])}
                for r in doc["results"]
                if r["passed"] is not None
            ],
            "intermittent": [],
            "standsFor": stands_for,
            "extraRuns": len(runs),
            "located": format_time_ms(located),
        }
        await bisections.record(self.store, finding, located)
        if not await self._write(key, primary, raw, None, moves):
            return True
        observe.bisection_recorded(finding, "enforcer")
        if culprit is not None:
            log.info(
                "culprit located: task %s run %d is the first failing of %d tasks held by %s; "
                "last good %s; %d extra runs",
                finding["culprit"]["taskId"],
                finding["culprit"]["runId"],
                n,
                primary,
                "none" if good is None else f"task {victims[good][0]} run {runs[good]}",
                len(runs),
                extra={"task_id": finding["culprit"]["taskId"]},
            )
        else:
            log.info("bisection after %s located no culprit (%d tasks held)", primary, n)
        return True

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
            record=None if doc is None else _dump(doc),
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
