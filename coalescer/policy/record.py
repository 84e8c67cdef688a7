"""The record of a search under way (``co:{K}:bs``, JSON, under the failed primary) and what
it says. Pure: no IO.

``decide.lua`` writes it when a primary fails, with the victims held for it, held victims or
none; :class:`coalescer.policy.bisecting.Searcher` moves it on one step at a time (each step a
compare-and-set, ``settle.lua``'s ``search`` mode)::

    {"primary", "primaryRun", "rule", "cascade", "protect", "supersedeRunning",
     "confirm": the most reruns confirming a failure (bisect-confirm; 0 when absent),
     "confidence": how probable a failure must be a breakage (bisect-confidence),
     "flake": the key's flake rate, estimated from its findings at the search's first step,
     "deadline": ms (the primary's), "ended": ms,
     "longest": ms (the longest run seen, the primary's first),
     "victims": [[taskId, heldRunId, deadline_ms], ...]   (oldest first),
     "results": [{"i", "run", "attempt", "passed": true | false | null (dropped), "ended": ms,
                  "trusted": true (a failure not confirmed: no scope to rerun; optional),
                  "known": true (what an earlier search found failing first, with its
                  "probability", and "suspect": true when it named no culprit: no run;
                  optional)}, ...],
     "parallel": runs at once (bisect-parallel; 1 when absent),
     "rounds": waves of runs so far (a run started while none of the search's ran begins one),
     "probes": [{"i", "run", "since", "attempt"}, ...]   (the runs under way; an older record
               has one, or null, as "probe"),
     "gap": {taskId: [[dependency, its key, its last run], ...]}   (the pushes among
               "victims" that nothing holds, each with the dependencies it lacks),
     "floor": [taskId, runId]   (the newest push of the key that passed, below the primary),
     "unplaced": [taskId, ...]   (tasks of the gap never scheduled that no rank tag places:
               the search names no culprit)}

Push ``i`` is victim ``i`` (oldest first); push ``n`` (``len(victims)``) is the primary. The
search is the record replayed into a :class:`~coalescer.bisection.Bisection` (:func:`replay`);
what it found, once over, is :func:`finding_of` (as :mod:`coalescer.store.bisections` keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from coalescer import verdicts
from coalescer.bisection import Bisection
from coalescer.model import format_time_ms
from coalescer.verdicts import Verdict


def replay(doc: Mapping[str, Any]) -> Bisection:
    """The search as its record says it stands."""
    confirm = int(doc.get("confirm", 0))
    search = Bisection.start(
        len(doc["victims"]),
        confirm,
        from_ms(doc["ended"]),
        confidence=float(doc.get("confidence", verdicts.DEFAULT_CONFIDENCE)),
        flake=float(doc.get("flake", verdicts.DEFAULT_FLAKE)),
        parallel=int(doc.get("parallel", 1)),
    )
    for result in doc["results"]:
        if result["passed"] is None:
            search.drop(result["i"])
        elif result.get("known"):
            search.believe(result["i"])
        elif result.get("trusted"):
            search.trust(result["i"])
        else:
            search.record(result["i"], result["passed"], from_ms(result["ended"]))
    return search


def known_broken(doc: Mapping[str, Any], findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results a search starts with: the pushes of its gap an earlier search of the key
    found failing first, in the run it named (failed, and not run since), as probably broken
    as this search asks: its culprit, or the suspect of a search left inconclusive by pushes
    it could not see (``suspect``: this search never names it, as nothing it ran made it a
    culprit; named, a flaky key's suspects were wrong). Known broken (``known``, with that
    search's ``probability``), they are not run again. A key that stays broken fails push
    after push, and no push of it has passed since (the gap's floor is below them): the search
    starts from what was found, instead of running the same pushes again for every failing
    primary."""
    confidence = float(doc.get("confidence", verdicts.DEFAULT_CONFIDENCE))
    named: dict[tuple[str, int], tuple[float | None, bool]] = {}
    for f in findings:
        if f.get("verdict") == "culprit" and f.get("culprit"):
            run = f["culprit"]
            named[run["taskId"], int(run["runId"])] = (f.get("probability"), False)
        elif f.get("suspect") and (f.get("probability") or 0) >= confidence:
            run = f["suspect"]
            named.setdefault((run["taskId"], int(run["runId"])), (f.get("probability"), True))
    gap = doc.get("gap", {})
    return [
        {"i": i, "run": run, "attempt": 0, "passed": False, "known": True}
        | {"ended": int(doc["ended"]), "probability": named[task_id, run][0]}
        | ({"suspect": True} if named[task_id, run][1] else {})
        for i, (task_id, run, _) in enumerate(doc["victims"])
        if task_id in gap and (task_id, run) in named
    ]


def victims(record: str) -> set[str]:
    """The victims of one search under way, from its record (as
    :func:`coalescer.store.policy.searches` reads it)."""
    return {v[0] for v in orjson.loads(record)["victims"]}


def probes_under_way(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The search's runs under way, each ``{"i", "run", "since", "attempt"}`` (a record
    written before several could run at once has one, or none, as ``probe``)."""
    if "probes" not in doc:
        single = doc.pop("probe", None)
        doc["probes"] = [] if single is None else [single]
    probes: list[dict[str, Any]] = doc["probes"]
    return probes


def push_task(doc: Mapping[str, Any], i: int) -> str:
    """Push ``i``'s taskId (the primary is push ``n``)."""
    victims = doc["victims"]
    return str(doc["primary"] if i == len(victims) else victims[i][0])


def push_deadline(doc: Mapping[str, Any], i: int) -> int | None:
    """Push ``i``'s deadline (ms); None when the record does not say (an older one)."""
    victims = doc["victims"]
    if i < len(victims):
        return int(victims[i][2])
    return None if doc.get("deadline") is None else int(doc["deadline"])


def push_held_run(doc: Mapping[str, Any], i: int) -> int:
    """The run of push ``i`` the search began with: the one held (the primary's failed one)."""
    victims = doc["victims"]
    return int(doc["primaryRun"] if i == len(victims) else victims[i][1])


def push_last_run(doc: Mapping[str, Any], i: int) -> int:
    """Push ``i``'s latest run the search knows of: its last result's, or the one held."""
    for result in reversed(doc["results"]):
        if result["i"] == i:
            return int(result["run"])
    return push_held_run(doc, i)


def believed(doc: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    """The pushes the search took as known broken from earlier searches (:func:`known_broken`),
    each with its result (that search's ``probability``, and ``suspect``)."""
    return {int(r["i"]): r for r in doc["results"] if r.get("known")}


def floor_ref(doc: Mapping[str, Any], culprit: int | None) -> dict[str, Any] | None:
    """With no push of the search passing below the culprit, the newest of the key that passed
    before it (the gap's floor), when the search has one."""
    floor = doc.get("floor")
    if culprit is None or floor is None:
        return None
    return {"taskId": floor[0], "runId": int(floor[1])}


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def dump(doc: Mapping[str, Any]) -> str:
    return orjson.dumps(doc).decode()


def ref(doc: Mapping[str, Any], i: int, run: int | None = None) -> dict[str, Any]:
    """Push ``i``'s run ``run`` as a finding names it; by default the run whose result is its
    verdict (its last result's), else the one held (the primary's failed one)."""
    if run is None:
        ran = [int(r["run"]) for r in doc["results"] if r["i"] == i and r["passed"] is not None]
        run = ran[-1] if ran else push_held_run(doc, i)
    return {"taskId": push_task(doc, i), "runId": run}


def located_ms(doc: Mapping[str, Any]) -> int:
    """When the search found what it found: its last result (ms)."""
    return max((int(r["ended"]) for r in doc["results"]), default=int(doc["ended"]))


def finding_of(
    key: str,
    doc: Mapping[str, Any],
    search: Bisection,
    verdict: Verdict | None,
    named: int | None,
    stands_for: list[dict[str, Any]],
    by: str,
) -> dict[str, Any]:
    """What the search over ``doc`` found, as :func:`coalescer.store.bisections.record` keeps
    it: its ``verdict`` and the culprit it ``named`` (None: none), which may be less than the
    search alone says (a push outside it contradicts the culprit), and the victims each run
    stands for."""
    n = len(doc["victims"])
    results = doc["results"]
    culprit, good = search.culprit, search.last_good
    # Pushes known broken from earlier searches, each as probably as that search found.
    known = believed(doc)

    def probability(i: int) -> float:
        earlier = known.get(i, {}).get("probability")
        return search.probability(i) if earlier is None else float(earlier)

    def failed_first(i: int) -> int:
        """The run of push ``i`` whose failure a confirmation did not reproduce."""
        if i == n:
            return int(doc["primaryRun"])
        return next(int(r["run"]) for r in results if r["i"] == i and not r.get("attempt"))

    ran = [
        r for r in results if r["passed"] is not None and not (r.get("trusted") or r.get("known"))
    ]
    primary = ref(doc, n, int(doc["primaryRun"]))
    first = {"attempt": 0, "passed": False, "ended": format_time_ms(int(doc["ended"]))}
    gap = doc.get("gap", {})
    return {
        "key": key,
        "by": by,
        "primary": primary,
        "held": n - len(gap),
        "gap": len(gap),
        "verdict": str(verdict),
        "culprit": None if named is None else ref(doc, named),
        "suspect": None if culprit is None or culprit == named else ref(doc, culprit),
        "probability": None if culprit is None else round(probability(culprit), 6),
        "flake": round(search.flake, 6),
        "lastGood": ref(doc, good) if good is not None else floor_ref(doc, culprit),
        "runs": [primary | first]
        + [
            ref(doc, r["i"], r["run"])
            | {
                "attempt": r.get("attempt", 0),
                "passed": r["passed"],
                "ended": format_time_ms(r["ended"]),
            }
            for r in ran
        ],
        "intermittent": [ref(doc, i, failed_first(i)) for i in sorted(search.intermittent)],
        "standsFor": stands_for,
        "extraRuns": len(ran),
        # Waves of runs, each started while none of the search's ran: what a sheriff waits for
        # (runs at once share a round).
        "rounds": int(doc.get("rounds", 0)),
        "located": format_time_ms(located_ms(doc)),
    }
