"""Finding the culprit: the bisection of the pushes a failed primary held. Pure: no IO.

A primary failed; it held ``n`` older tasks of its key (the *victims*, ``0 .. n-1``, oldest
first); the primary is push ``n``. Which push broke it? Run the middle one: if it fails, the
first failing push is it or older; if it passes, newer. :class:`Bisection` keeps what is known:

* ``good``: the newest push known to pass (-1: none), ``bad``: the oldest known to fail above
  it (``n`` at the start: the primary). A gap can hold more than one breakage (a push broke
  the key, a later one fixed it, another broke it again): a pass seen above a failure (runs at
  once, results in any order) means the primary's breakage began above that pass, and the
  search goes on there; the older failure is another breakage, fixed since.
* :meth:`Bisection.next` says what to run (:class:`Probe`: a push and its attempt), and
  :meth:`Bisection.record` takes the result. Once ``bad - good == 1`` among the pushes still
  in the search, ``bad`` is the culprit and ``good`` the last good push.
* With ``parallel`` above 1, :meth:`Bisection.probes` hands out that many runs at once: the
  pushes left are cut into ``parallel + 1`` near-equal parts (an n-ary search), the primary's
  confirmation beside the first cut; a slot that frees cuts the longest stretch left between
  the pushes still running; results may come back in any order. Beside a probe's failure
  awaiting its confirmation, on a key no flakier than the prior (``flake`` at most
  :data:`~coalescer.verdicts.DEFAULT_FLAKE`), the other slots cut only the pushes below it:
  it is most likely a breakage, and a confirmation that passes widens the search again.
* A failure is confirmed by reruns before the search narrows on it, as many as it takes for the
  push to be broken with probability ``confidence`` given the key's ``flake`` rate
  (:mod:`coalescer.verdicts`), and at most ``confirm``: a rerun that passes makes the push
  *intermittent* and good; a push still short of ``confidence`` once the reruns are spent
  counts as failed, and the search's verdict is then *inconclusive*. With ``confirm`` 0 every
  failure is trusted. The primary's own failure is confirmed first (when there is anything to
  search): if its confirmation passes and no push failed for good (the verdict is *flaky*),
  the primary's result stands for every victim. A push that failed for good beside it (runs
  at once) is a breakage the primary's push fixed: the search goes on below it
  (:attr:`Bisection.top`), and the primary stands for the victims above it.
* :meth:`Bisection.believe` knows a push broken without running it (what an earlier search
  found failing first): the search looks only below it.
* :meth:`Bisection.drop` takes a push out of the search that gave no verdict (its claim was
  lost, its deadline came, it ended in an exception): it runs itself, stood for by nobody.

Bound on the runs beyond the primary's first, one run at a time: each push the search probes
is the middle of the pushes left, so at most ``ceil(log2(n + 1))`` pushes are probed; each costs one run if it
passes, and at most ``1 + confirm`` otherwise; the primary's confirmations cost at most
``confirm`` (:func:`max_runs`). With ``parallel`` p: at most ``ceil(log(n + 1, p + 1))``
rounds of at most p pushes each.

What stands for a victim that did not run (:func:`stand_ins`): older than the last good, the
last good push (its pass stands for the older ones); newer than the culprit, the culprit (its
failure does), up to :attr:`Bisection.top`; above that, the primary (its pass: its failure did
not come back); nothing for a dropped one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta

from coalescer.verdicts import DEFAULT_CONFIDENCE, DEFAULT_FLAKE, Verdict, broken_probability


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    """Run push ``index`` (``n``: the primary); ``attempt`` 0 is its first run, ``k`` its
    ``k``-th confirmation."""

    index: int
    attempt: int


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """A run the search made (the primary's first run included), and when it ended."""

    index: int
    attempt: int
    passed: bool
    ended: datetime | None = None


def failures_to_believe(
    confirm: int, confidence: float = DEFAULT_CONFIDENCE, flake: float = DEFAULT_FLAKE
) -> int:
    """How many failing runs in a row make a search believe a push broken: enough to reach
    ``confidence`` at ``flake``, and at most ``1 + confirm`` (1 with ``confirm`` 0)."""
    k = 1
    while k <= confirm and broken_probability(k, 0, flake) < confidence:
        k += 1
    return k


def max_runs(n: int, confirm: int) -> int:
    """The most runs a search over ``n`` victims makes beyond the primary's first run."""
    if n <= 0:
        return 0
    return confirm + (1 + confirm) * math.ceil(math.log2(n + 1))


@dataclasses.dataclass
class Bisection:
    """The search over ``n`` victims after the primary (push ``n``) failed. Build it with
    :meth:`start`."""

    n: int
    confirm: int
    #: How probable a failure must be a breakage before the search narrows on it.
    confidence: float = DEFAULT_CONFIDENCE
    #: Runs at once: the pushes left are split into ``parallel + 1`` parts.
    parallel: int = 1
    #: The key's flake rate: the share of a good push's runs that fail all the same.
    flake: float = DEFAULT_FLAKE
    good: int = -1
    bad: int = 0
    runs: list[Run] = dataclasses.field(default_factory=list)
    #: Pushes taken out of the search (no verdict): they run themselves.
    dropped: set[int] = dataclasses.field(default_factory=set)
    #: Pushes whose failure a confirmation did not reproduce: treated as good.
    intermittent: set[int] = dataclasses.field(default_factory=set)
    #: Pushes with a verdict: True passed, False failed.
    verdicts: dict[int, bool] = dataclasses.field(default_factory=dict)
    #: Failed pushes whose reruns were spent short of ``confidence``.
    unsure: set[int] = dataclasses.field(default_factory=set)
    #: Failed pushes believed without their confirmation (:meth:`trust`), or without a run
    #: (:meth:`believe`).
    trusted: set[int] = dataclasses.field(default_factory=set)
    #: Failed pushes awaiting a confirmation, with their failures in a row so far.
    _failures: dict[int, int] = dataclasses.field(default_factory=dict, init=False)

    @classmethod
    def start(
        cls,
        n: int,
        confirm: int = 1,
        ended: datetime | None = None,
        *,
        confidence: float = DEFAULT_CONFIDENCE,
        flake: float = DEFAULT_FLAKE,
        parallel: int = 1,
    ) -> Bisection:
        """The search once the primary's first run failed (``ended`` then)."""
        if n < 0 or confirm < 0 or parallel < 1:
            raise ValueError("n and confirm must be >= 0, parallel >= 1")
        if not 0 < confidence < 1 or not 0 < flake < 1:
            raise ValueError("confidence and flake must be between 0 and 1, exclusive")
        search = cls(
            n=n, confirm=confirm, confidence=confidence, flake=flake, parallel=parallel, bad=n
        )
        search.runs.append(Run(n, 0, False, ended))
        if n:
            search._failed(n, 1)
        else:
            search.verdicts[n] = False
        return search

    def probability(self, index: int) -> float:
        """The probability that push ``index`` is broken, from its runs so far."""
        fails = sum(1 for r in self.runs if r.index == index and not r.passed)
        passes = sum(1 for r in self.runs if r.index == index and r.passed)
        return broken_probability(fails, passes, self.flake)

    def _failed(self, index: int, failures: int) -> None:
        """Push ``index`` has failed ``failures`` runs in a row: confirm it again, or settle."""
        if not self.confirm:
            self._verdict(index, False)  # trusted, as asked
        elif broken_probability(failures, 0, self.flake) >= self.confidence:
            self._verdict(index, False)
        elif failures <= self.confirm:
            self._failures[index] = failures
        else:
            self.unsure.add(index)
            self._verdict(index, False)

    @property
    def candidates(self) -> list[int]:
        """The pushes the culprit may still be, apart from ``bad``: those between the last
        good and the first bad that are still in the search."""
        return [i for i in range(self.good + 1, self.bad) if i not in self.dropped]

    def probes(self, running: Collection[int] = ()) -> list[Probe]:
        """What to run now, beside the pushes already ``running`` (handed out, their result not
        in yet): at most ``parallel`` runs at once. Failures awaiting a confirmation come
        first (the primary's first of all: with ``parallel`` 1 nothing else runs until it is
        confirmed); the other slots split the pushes left into equal parts (one slot: the
        middle push). Empty when the search is over, or all it needs is running."""
        slots = self.parallel - len(running)
        confirming = sorted(self._failures, key=lambda i: (i != self.n, i))
        out = [Probe(i, self._failures[i]) for i in confirming if i not in running][:slots]
        if self.n not in self.verdicts and (self.parallel == 1 or self.n not in self._failures):
            return out  # the primary is being confirmed (one at a time), or was dropped
        if self.top is None:
            return out  # the primary's failure was intermittent, and nothing failed for good
        # The slots not taken by confirmations split what is left, those running included: a
        # push handed out before is one of the points, not a reason to move them. Pushes
        # running elsewhere in it (handed out beside a confirmation that has ended since) are
        # cuts of their own: the free slots take the middles of the longest stretches left.
        candidates = self.candidates
        left = [i for i in candidates if i not in self._failures]
        # A probe's failure awaiting its confirmation is most likely a breakage (on a key no
        # flakier than the prior): the other slots narrow below it meanwhile.
        doubtful = [i for i in self._failures if i != self.n and i in candidates]
        if doubtful and self.flake <= DEFAULT_FLAKE:
            left = [i for i in left if i < min(doubtful)]
        free = max(0, slots - len(out))
        points = _cut(left, [], self.parallel - len(confirming))
        inside = [i for i in running if i in left]
        if not set(inside) <= set(points):
            points = _cut(left, inside, free)
        return out + [Probe(i, 0) for i in points if i not in running][:free]

    def next(self) -> Probe | None:
        """What to run next, one run at a time; None when the search is over."""
        found = self.probes()
        return found[0] if found else None

    @property
    def done(self) -> bool:
        return self.next() is None

    def record(self, index: int, passed: bool, ended: datetime | None = None) -> None:
        """The result of running push ``index`` (``ended`` then): a probe :meth:`probes` gave,
        whatever has been learned since."""
        if (index in self.verdicts and index not in self._failures) or index in self.dropped:
            raise ValueError(f"push {index} has a verdict already, or is out of the search")
        if not 0 <= index <= self.n:
            raise ValueError(f"push {index} is not in the search")
        attempt = self._failures.get(index, 0)
        if index == self.n and not attempt:
            raise ValueError("the primary's first run is the search's start")
        self.runs.append(Run(index, attempt, passed, ended))
        if passed:
            if self._failures.pop(index, 0):
                self.intermittent.add(index)
            self._verdict(index, True)
            return
        self._failed(index, self._failures.pop(index, 0) + 1)

    def _verdict(self, index: int, passed: bool) -> None:
        self.verdicts[index] = passed
        top = self.top
        if top is None:
            return  # nothing failed for good: no breakage to search for
        self.good = max((i for i, ok in self.verdicts.items() if ok and i < top), default=-1)
        self.bad = min(
            (i for i, ok in self.verdicts.items() if not ok and self.good < i <= top), default=top
        )

    @property
    def top(self) -> int | None:
        """The push whose breakage the search looks for: the primary; once its failure did
        not come back, the newest push below it that failed for good (None: none did)."""
        if self.verdicts.get(self.n) is not True:
            return self.n
        return max((i for i, ok in self.verdicts.items() if ok is False), default=None)

    def trust(self, index: int) -> None:
        """Believe the failure of push ``index`` that awaits a confirmation as it stands (the
        queue would not run it again): no run, the push failed."""
        if index not in self._failures:
            raise ValueError(f"push {index} awaits no confirmation")
        self._failures.pop(index)
        self.trusted.add(index)
        self._verdict(index, False)

    def believe(self, index: int) -> None:
        """Know push ``index`` broken without running it (what an earlier search found failing
        first, not run since): it failed for good."""
        if index in self.verdicts or index in self.dropped or not 0 <= index < self.n:
            raise ValueError(f"push {index} has a verdict already, or is not a victim")
        self.trusted.add(index)
        self._verdict(index, False)

    def drop(self, index: int) -> None:
        """Take push ``index`` out of the search: it gave no verdict and runs itself."""
        if index in self.verdicts:
            raise ValueError(f"push {index} has a verdict already")
        self._failures.pop(index, None)
        self.dropped.add(index)

    @property
    def ran(self) -> set[int]:
        """The pushes that ran (the primary included)."""
        return {run.index for run in self.runs}

    @property
    def culprit(self) -> int | None:
        """Where the breakage the search found began: the oldest push that failed for good
        above the last good, once the search is over; None while it runs, when nothing failed
        for good (the primary's failure was intermittent), or when the primary was dropped."""
        if not self.done or self.top is None or self.n in self.dropped:
            return None
        return self.bad

    @property
    def verdict(self) -> Verdict | None:
        """How the search ended (None while it runs): a culprit sure enough, *flaky* (the
        primary's failure did not come back, and no push failed for good) or *inconclusive*
        (the culprit's failure not sure enough once its reruns were spent, or the primary
        taken out of the search)."""
        if not self.done:
            return None
        culprit = self.culprit
        if culprit is None and self.verdicts.get(self.n) is True:
            return Verdict.FLAKY
        if culprit is None or culprit in self.unsure or (self.confirm and self.n in self.unsure):
            return Verdict.INCONCLUSIVE
        return Verdict.CULPRIT

    @property
    def named(self) -> int | None:
        """The culprit to blame: :attr:`culprit` when the verdict is :attr:`Verdict.CULPRIT`."""
        return self.culprit if self.verdict is Verdict.CULPRIT else None

    @property
    def last_good(self) -> int | None:
        """The newest push that passed below the culprit, once located; else None."""
        if self.culprit is None or self.good < 0:
            return None
        return self.good

    @property
    def keep(self) -> set[int]:
        """The pushes that ran and may yet stand for others, or are being confirmed: their
        claims stay held. Any other push that ran can be resolved with its own result."""
        held = {self.n} if self.verdicts.get(self.n) is True else set()
        if self.top is not None:
            held |= {self.bad, self.good} - {-1}
        return held | set(self._failures)


def _cut(left: list[int], cuts: list[int], more: int) -> list[int]:
    """Up to ``more`` pushes of ``left`` (in order) that, beside the ``cuts`` already made
    (pushes of ``left`` running), leave the shortest stretches of pushes between cuts: each
    the middle of the longest stretch left (the newer one on a tie). With no cuts, they split
    ``left`` near-evenly (one: its middle push)."""
    if not cuts:  # an n-ary split: ``more + 1`` near-equal parts
        k = min(max(more, 0), len(left))
        return [left[(j * (len(left) + 1)) // (k + 1) - 1] for j in range(1, k + 1)]
    at = sorted(left.index(c) for c in cuts)
    found: list[int] = []
    for _ in range(more):
        bounds = [-1, *at, len(left)]
        gap, j = max((bounds[j + 1] - bounds[j] - 1, j) for j in range(len(bounds) - 1))
        if gap <= 0:
            break
        middle = (bounds[j] + bounds[j + 1]) // 2
        found.append(left[middle])
        at = sorted([*at, middle])
    return found


def stand_ins(search: Bisection) -> dict[int, int]:
    """Who stands for each victim that did not run, once the search is over: ``{victim:
    push}``. Victims that were dropped, or that nothing stands for, are left out."""
    if not search.done:
        raise ValueError("the search is not over")
    ran, out = search.ran, search.dropped
    waiting = [i for i in range(search.n) if i not in ran and i not in out]
    top = search.top
    if top is None:  # intermittent primary, nothing failed for good: it stands for all
        return dict.fromkeys(waiting, search.n)
    if search.culprit is None:
        return {}
    found: dict[int, int] = {}
    for i in waiting:
        if i < search.good:
            found[i] = search.good
        elif i > top:  # above a breakage a passing primary fixed: the primary stands
            found[i] = search.n
        elif i > search.bad:
            found[i] = search.bad
    return found


def contradicted(
    good: float | None, culprit: float, known: Mapping[str, tuple[float, str]]
) -> list[str]:
    """The tasks whose fate leaves a culprit at order ``culprit`` unsure, with the last good
    at order ``good`` (None: none): tasks of the key outside the search, ordered below the
    culprit and above the newest task known to pass below it, that did not pass (failed,
    running or pending, or ended without a result of their own). With any, the culprit may
    not be the first failing push after a passing one, whatever the search's own runs said.
    ``known``: taskId -> (order, state), as the index holds them."""
    low = float("-inf") if good is None else good
    passed = [order for order, state in known.values() if state == "completed" and order < culprit]
    floor = max([low, *passed])
    return sorted(
        task_id
        for task_id, (order, state) in known.items()
        if state != "completed" and floor < order < culprit
    )


def expiring(deadlines: Mapping[int, datetime], now: datetime, margin: timedelta) -> list[int]:
    """The pushes whose deadline comes within ``margin`` of ``now``: held any longer, the
    queue would end them before they ran or were stood for."""
    return sorted(i for i, deadline in deadlines.items() if deadline <= now + margin)
