"""How sure a culprit search is of a push: flake-aware verdicts. Pure: no IO.

A failing run says less on a flaky key than on a steady one. The search therefore weighs each
push's runs against its key's *flake rate* ``f`` (the share of runs of a good push that fail
all the same), under a two-state model:

* a **broken** push fails every run (a regression that fails only some runs is outside this
  model: a pass then makes it look good);
* a **good** push fails each run independently with probability ``f``.

Before its runs, a push of the search is as likely broken as good (:data:`PRIOR_BROKEN`: the
culprit is equally likely on either side of a push in the middle of the gap). After ``k``
failing runs and no pass, Bayes' rule gives the probability that it is broken::

    P(broken | k failures) = odds / (1 + odds),   odds = PRIOR_ODDS * (1 / f) ** k

and one pass makes it good (a broken push never passes). A search confirms a failure (runs the
push again) until that probability reaches the rule's ``bisect-confidence`` (default 0.99), a
run passes, or the rule's ``bisect-confirm`` reruns are spent. On a key failing 2% of its good
runs, two failures give 0.9996 (one confirmation, as a fixed single confirmation did); at 10%,
also two (0.990); at 20%, three (0.992).

The flake rate of a key is estimated from what its searches saw (:func:`flake_rate`): the runs
that failed and then passed when run again (a finding's ``intermittent`` list) among the runs
of good pushes, with a Beta(1, 19) prior (a mean of 5% worth 20 runs), so that a key with no
history is treated as a little flaky, and one whose failures keep coming back as steady.

This follows the approach of flake-aware culprit finding (Henderson et al., "Flake Aware
Culprit Finding", ICST 2023): rerun a failure until the posterior that the push is at fault is
high enough, and say *flaky* or *inconclusive* rather than blame a push on too little evidence.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any

#: Before its runs, a push of the search is as likely broken as good.
PRIOR_BROKEN = 0.5
#: Beta prior of a key's flake rate: ``(flaky failures, steady runs)`` it is worth.
FLAKE_PRIOR = (1.0, 19.0)
#: A key's flake rate with no history (the prior's mean).
DEFAULT_FLAKE = FLAKE_PRIOR[0] / (FLAKE_PRIOR[0] + FLAKE_PRIOR[1])
#: Default ``bisect-confidence``: how probable a failure must be a breakage to be believed.
DEFAULT_CONFIDENCE = 0.99
#: Default ``bisect-confirm``: the most reruns confirming one failure. Spent only as needed:
#: on a key failing up to 10% of its good runs, one.
DEFAULT_CONFIRM = 3
#: Default ``bisect-parallel``: the runs a search makes at once (an n-ary split).
DEFAULT_PARALLEL = 2


class Verdict(enum.StrEnum):
    """How a search ended."""

    #: A culprit, at least as probable as the rule's confidence.
    CULPRIT = "culprit"
    #: The failure did not come back: no push to blame.
    FLAKY = "flaky"
    #: The runs allowed were spent (or the search stopped) before anything was sure enough.
    INCONCLUSIVE = "inconclusive"


def broken_probability(failures: int, passes: int, flake: float) -> float:
    """The probability that a push is broken after ``failures`` failing and ``passes``
    passing runs, on a key whose good runs fail with probability ``flake``."""
    if failures < 0 or passes < 0:
        raise ValueError("run counts must be >= 0")
    if not 0 < flake < 1:
        raise ValueError("flake must be between 0 and 1, exclusive")
    if passes:
        return 0.0
    odds = PRIOR_BROKEN / (1 - PRIOR_BROKEN) * (1 / flake) ** failures
    return odds / (1 + odds)


def flake_rate(findings: Iterable[Mapping[str, Any]]) -> float:
    """A key's flake rate, estimated from its searches' findings (the posterior mean): each
    entry of a finding's ``intermittent`` list is a failure that did not come back; the runs of
    good pushes are those that passed, and those failures."""
    flaky = steady = 0
    for finding in findings:
        intermittent = finding.get("intermittent") or []
        flaky += len(intermittent)
        steady += sum(1 for run in finding.get("runs") or [] if run.get("passed") is True)
    a, b = FLAKE_PRIOR
    return (a + flaky) / (a + b + flaky + steady)
