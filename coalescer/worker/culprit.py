"""Finding the culprit after a failed primary (``--on-primary-failure bisect``): the IO around
:mod:`coalescer.bisection`.

Every held claim stays alive (the shim's :class:`~coalescer.worker.claims.Keeper` reclaims them
all). The search asks for one push at a time; its task runs with the same ``execute`` as a
primary of its own, under its own claim; a confirmation runs ``execute`` again under the same
claim (``claim.attempt`` says which attempt it is) before its result is reported. A run that
can no longer stand for others is resolved with its own result at once, so at most the last
good task and the culprit are held to the end; then every victim that did not run is
superseded by the run that stands for it, and those get ``public/supersedes.json``. A culprit is
named only if every task of the key between the last good task and it that the search did not
hold passed, as the service's index says (``GET /v1/bisections/gap``): else it is a suspect.

A victim whose deadline would come before the search is over is released (``worker-shutdown``)
to run itself (the margin is twice the longest run so far). A victim whose claim is lost, or
whose run ends in an exception, is taken out of the search. A shutdown, or the primary's claim
lost, stops the search: runs that have a result are reported with it, the rest released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from coalescer.bisection import Bisection, contradicted, expiring, stand_ins
from coalescer.concurrency import all_ended
from coalescer.verdicts import DEFAULT_CONFIDENCE, DEFAULT_FLAKE, Verdict
from coalescer.worker.claims import Claim, Clock, parse_time
from coalescer.worker.notice import Why
from coalescer.worker.protocol import SUPERSEDES, Outcome, Resolution, supersedes_json
from coalescer.worker.resolve import Resolver

log = logging.getLogger("coalescer.worker")

Ref = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One run of the search (the primary's first included): a task run, its attempt (0, or
    ``k`` for the ``k``-th confirmation), whether it passed, and when it ended."""

    task_id: str
    run_id: int
    attempt: int
    passed: bool
    ended: datetime | None


@dataclasses.dataclass
class Finding:
    """What the bisection found, in ``Report.bisection``. ``culprit`` is None when the
    primary's failure did not come back (``intermittent`` holds it) or the search stopped."""

    held: int
    culprit: Ref | None = None
    last_good: Ref | None = None
    #: How the search ended (None: it stopped), the first failing push when it is not sure
    #: enough to be the culprit, and the probability that the one named is broken.
    verdict: Verdict | None = None
    suspect: Ref | None = None
    probability: float | None = None
    #: The key's flake rate the search weighed failures with.
    flake: float = DEFAULT_FLAKE
    runs: list[Attempt] = dataclasses.field(default_factory=list)
    #: Task runs whose failure a confirmation did not reproduce: treated as passed.
    intermittent: list[Ref] = dataclasses.field(default_factory=list)
    #: Each superseded victim and the run whose result stands for it.
    stood_for: dict[Ref, Ref] = dataclasses.field(default_factory=dict)
    #: Tasks of the key between the last good and the first failing task held that did not
    #: pass (outside the search, or dropped from it): the culprit is then only a suspect.
    between: list[str] = dataclasses.field(default_factory=list)

    @property
    def extra_runs(self) -> int:
        """Runs beyond the primary's first."""
        return max(0, len(self.runs) - 1)


#: Why ``claim`` is superseded by ``stand_in``, given what the search found.
Explain = Callable[[Claim, Claim, Finding], Why]
Run = Callable[[Claim], Coroutine[Any, Any, Outcome]]
#: The superseder service's index, asked for the key's tasks between the last good task
#: (None: none) and the first failing one: ``{taskId: (order, state)}``, None when it cannot
#: say.
Gap = Callable[[str | None, str], Awaitable[Mapping[str, tuple[float, str]] | None]]
#: What stands for the index's answer when the service cannot give one.
UNKNOWN = "(the superseder service could not say what lies between)"


@dataclasses.dataclass
class Ledger:
    """What became of the held runs, for the shim's report."""

    finding: Finding
    outcome: Outcome
    superseded: list[Ref] = dataclasses.field(default_factory=list)
    released: list[Ref] = dataclasses.field(default_factory=list)
    dropped: list[Ref] = dataclasses.field(default_factory=list)
    resolutions: dict[Ref, Resolution] = dataclasses.field(default_factory=dict)
    aborted: str | None = None


class _Stop(Exception):
    """The search stops: ``shutdown`` or ``canceled`` (the primary's claim was lost)."""


def _ref(claim: Claim) -> Ref:
    return (claim.task_id, claim.run_id)


class Search:
    """One bisection. ``claims`` are the victims, oldest first, then the primary; ``changed``
    is set whenever a claim is lost."""

    def __init__(
        self,
        claims: Sequence[Claim],
        outcome: Outcome,
        *,
        run: Run,
        resolver: Resolver,
        clock: Clock,
        confirm: int,
        confidence: float = DEFAULT_CONFIDENCE,
        flake: float = DEFAULT_FLAKE,
        longest: timedelta,
        explain: Explain,
        changed: asyncio.Event,
        stop: asyncio.Event | None,
        concurrency: int = 8,
        gap: Gap | None = None,
    ) -> None:
        self.claims = list(claims)
        self.n = len(self.claims) - 1
        self.primary = self.claims[-1]
        self.search = Bisection.start(self.n, confirm, clock(), confidence=confidence, flake=flake)
        self.outcomes: dict[int, Outcome] = {self.n: outcome}
        self.ledger = Ledger(Finding(self.n), outcome)
        self._run, self._resolver, self._clock = run, resolver, clock
        self._longest, self._explain = longest, explain
        self._changed, self._stop = changed, stop
        self._bound = asyncio.Semaphore(max(1, concurrency))
        self._gap = gap

    async def __call__(self) -> Ledger:
        try:
            while True:
                await self._take_out()
                probe = self.search.next()
                if probe is None:
                    break
                await self._probe(probe.index, probe.attempt)
                await self._settle()
        except _Stop as stop:
            self.ledger.aborted = str(stop)
            log.warning("bisection after %r stopped: %s", self.primary, stop)
            await self._give_back()
            self._find()
            return self.ledger
        await self._check_gap()
        self._find()
        await self._conclude()
        return self.ledger

    async def _check_gap(self) -> None:
        """A worker runs only what it held: a task of the key between the last good and the
        culprit may have run on another worker, or be running or pending there. The culprit is
        named only when every such task the search did not run passed, as the service's index
        says (:func:`~coalescer.bisection.contradicted`); else, or when the service cannot say,
        the verdict is inconclusive and the culprit a suspect."""
        search = self.search
        if search.named is None or self._gap is None:
            return
        culprit, good = search.named, search.last_good
        known = await self._gap(
            None if good is None else self.claims[good].task_id, self.claims[culprit].task_id
        )
        if known is None:
            between = [UNKNOWN]
        else:
            ours = {c.task_id for c in self.claims}
            outside = {t: k for t, k in known.items() if t not in ours}
            between = contradicted(None, float("inf"), outside)
            between += [
                self.claims[i].task_id
                for i in sorted(search.dropped)
                if (good is None or good < i)
                and i < culprit
                and known.get(self.claims[i].task_id, (0.0, ""))[1] != "completed"
            ]
        if between:
            self.ledger.finding.between = between
            log.info(
                "bisection after %r: %s did not pass, between the last good and the first "
                "failing task held: inconclusive",
                self.primary,
                ", ".join(between[:5]),
            )

    async def _probe(self, index: int, attempt: int) -> None:
        claim = self.claims[index]
        claim.attempt = attempt
        started = self._clock()
        outcome = await self._attempt(claim)
        self._longest = max(self._longest, self._clock() - started)
        if outcome is None:  # its claim was lost while it ran
            if index == self.n:
                raise _Stop("canceled")
            self.search.drop(index)
            self.ledger.dropped.append(_ref(claim))
            return
        self.outcomes[index] = outcome
        if index == self.n:
            self.ledger.outcome = outcome
        if outcome.state == "exception":  # no verdict on the code: it stands for nobody
            self.search.drop(index)
            await self._resolve(index)
            return
        self.search.record(index, outcome.state == "completed", self._clock())

    async def _attempt(self, claim: Claim) -> Outcome | None:
        """Run ``claim``'s task once; None when its claim is lost meanwhile. Raises _Stop on
        shutdown (the run is released) or when the primary's claim is lost."""
        job = asyncio.create_task(self._run(claim), name=f"bisect {claim!r}")
        stopped = asyncio.create_task(self._stop.wait()) if self._stop else None
        try:
            while True:
                self._changed.clear()
                if claim.lost:
                    await _cancel(job)
                    return None
                if self.primary.lost:
                    await _cancel(job)
                    await self._release(claim)
                    raise _Stop("canceled")
                changed = asyncio.create_task(self._changed.wait())
                waits = {job, changed} | ({stopped} if stopped else set())
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                await _cancel(changed)
                if job.done():
                    try:
                        return job.result()
                    except Exception:
                        log.exception("running %r failed inside the worker", claim)
                        return Outcome("exception", "internal-error")
                if stopped is not None and stopped.done():
                    await _cancel(job)
                    await self._release(claim)
                    raise _Stop("shutdown")
        finally:
            await _cancel(job)
            if stopped is not None:
                await _cancel(stopped)

    async def _take_out(self) -> None:
        """Before each run: stop when asked to; drop lost claims; release what would reach its
        deadline before the search ends, or resolve it when it has a result."""
        if self._stop is not None and self._stop.is_set():
            raise _Stop("shutdown")
        if self.primary.lost:
            raise _Stop("canceled")
        search = self.search
        for i, claim in enumerate(self.claims):
            if claim.lost and i not in search.verdicts and i not in search.dropped:
                search.drop(i)
                self.ledger.dropped.append(_ref(claim))
        now = self._clock()
        held = {
            i: parse_time(c.task["deadline"])
            for i, c in enumerate(self.claims)
            if not c.done and i not in search.dropped
        }
        for i in expiring(held, now, 2 * self._longest):
            claim = self.claims[i]
            log.warning("%r reaches its deadline before the bisection ends", claim)
            if i not in search.verdicts:
                search.drop(i)
            if i in self.outcomes:
                await self._resolve(i)
            else:
                await self._release(claim)

    async def _settle(self) -> None:
        """Resolve, with its own result, every run that can no longer stand for others."""
        keep = self.search.keep
        for i in sorted(self.outcomes):
            if i not in keep and not self.claims[i].done:
                await self._resolve(i)

    async def _resolve(self, index: int, artifacts: Sequence[tuple[str, bytes]] = ()) -> None:
        claim = self.claims[index]
        if claim.done:
            return
        if not await self._resolver.resolve(claim, self.outcomes[index], artifacts):
            self.ledger.dropped.append(_ref(claim))

    async def _release(self, claim: Claim) -> None:
        ok = await self._resolver.release(claim)
        (self.ledger.released if ok else self.ledger.dropped).append(_ref(claim))

    def _find(self) -> None:
        search, finding = self.search, self.ledger.finding
        finding.runs = [
            Attempt(*_ref(self.claims[r.index]), r.attempt, r.passed, r.ended) for r in search.runs
        ]
        finding.intermittent = [_ref(self.claims[i]) for i in sorted(search.intermittent)]
        finding.flake = search.flake
        if self.ledger.aborted is not None:
            return
        finding.verdict = search.verdict
        if finding.between:
            finding.verdict = Verdict.INCONCLUSIVE
        if search.culprit is not None:
            finding.probability = round(search.probability(search.culprit), 6)
            if search.named is None or finding.between:
                finding.suspect = _ref(self.claims[search.culprit])
            else:
                finding.culprit = _ref(self.claims[search.named])
            if search.last_good is not None:
                finding.last_good = _ref(self.claims[search.last_good])

    async def _conclude(self) -> None:
        """Victims first, superseded by what stands for them; then the runs that stand."""
        finding = self.ledger.finding
        stood = stand_ins(self.search)

        async def one(victim: int, push: int) -> None:
            claim, stand_in = self.claims[victim], self.claims[push]
            if claim.done:
                return
            if stand_in.lost:  # its result cannot be linked to: the victim runs itself
                async with self._bound:
                    await self._release(claim)
                return
            async with self._bound:
                done = await self._resolver.supersede(
                    claim, stand_in, self._explain(claim, stand_in, finding)
                )
            if done is None:
                self.ledger.dropped.append(_ref(claim))
                return
            self.ledger.resolutions[_ref(claim)] = done
            if done.superseded:
                self.ledger.superseded.append(_ref(claim))
                finding.stood_for[_ref(claim)] = _ref(stand_in)
            else:
                self.ledger.released.append(_ref(claim))

        # Every victim's resolution ends before an error of one is raised: none is left running
        # behind the shim's clean-up.
        await all_ended(*(one(v, p) for v, p in sorted(stood.items())))
        for push in sorted(self.outcomes):
            by = _ref(self.claims[push])
            mine = [
                _ref(self.claims[v])
                for v in sorted(stood)
                if finding.stood_for.get(_ref(self.claims[v])) == by
            ]
            await self._resolve(push, [(SUPERSEDES, supersedes_json(mine))] if mine else [])
        await self._give_back()
        if finding.culprit is not None:
            good = finding.last_good
            log.info(
                "culprit located: task %s run %d is the first failing of %d tasks held by %r; "
                "last good %s; %d extra runs, %d intermittent",
                *finding.culprit,
                self.n,
                self.primary,
                f"task {good[0]} run {good[1]}" if good else "none",
                finding.extra_runs,
                len(finding.intermittent),
                extra={"task_id": finding.culprit[0]},
            )
        elif finding.suspect is not None:
            log.info(
                "bisection after %r: inconclusive: task %s run %d is the first failing of the "
                "%d tasks it held, not named the culprit; %d extra runs",
                self.primary,
                *finding.suspect,
                self.n,
                finding.extra_runs,
                extra={"task_id": finding.suspect[0]},
            )
        else:
            log.info(
                "bisection after %r: its failure did not come back; it stands for the %d "
                "tasks it held",
                self.primary,
                self.n,
            )

    async def _give_back(self) -> None:
        """Whatever is still held: reported with its result if it ran, else released."""
        for i, claim in enumerate(self.claims):
            if claim.done:
                continue
            if i in self.outcomes:
                await self._resolve(i)
            else:
                await self._release(claim)


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
