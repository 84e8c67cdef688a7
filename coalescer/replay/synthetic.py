"""Synthetic histories: pushes through a day, each a build and its tests, with a seeded RNG.

Each push creates, per platform, one build task (key ``build.<platform>``, task queue
``replay/build-<platform>``) and ``suites`` test tasks that depend on it (keys
``test.<platform>.<suite>``, task queue ``replay/test-<platform>``). Pushes arrive as a Poisson
process whose rate follows :data:`DAILY` (busy working hours, quiet nights); run times are
log-normal around the given medians. The same arguments and seed give the same history.

A history starts at midnight UTC, or, when shorter than :data:`PEAK_HOUR` hours, ends at the
peak hour instead (a one-hour history is 09:00-10:00): a short history holds the morning's
pushes, not the quiet night's. From ``PEAK_HOUR`` hours on the start stays at midnight, so a
longer history is the same as before.

Regressions and intermittent failures (both off by default): a push breaks each of its keys
that passes with probability ``regression_rate``, and the breakage lasts ``1 .. fix_after``
pushes of that key (uniformly drawn), the push after it fixing it; every task of a broken push
fails (:attr:`TaskSpec.broken <coalescer.replay.history.TaskSpec.broken>`). Any other run fails
with probability ``intermittent_rate``, drawn per run by the pool model
(:attr:`History.intermittent <coalescer.replay.history.History.intermittent>`). Regressions
are drawn from their own seeded stream, so a history without them is the same as before.

Flaky tests (off by default): a ``flaky_share`` of the keys, chosen from a seeded stream of its
own, fails ``flaky_rate`` of its runs on top of the intermittent rate
(:attr:`History.flaky <coalescer.replay.history.History.flaky>`); a ``flaky_regressions``
share of the regressions, drawn from another stream as each begins, fails only some runs of its
broken pushes, at a rate drawn between :data:`FLAKY_REGRESSION_RATES` for that regression
(:attr:`History.broken_rates <coalescer.replay.history.History.broken_rates>`). Neither
changes the pushes, the tasks, their run times or which pushes are broken.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import random
import uuid

from coalescer.errors import InvalidInput
from coalescer.replay.history import History, TaskSpec, priority_rank

#: Push rate by hour of day (UTC), as a share of the peak rate.
DAILY = (
    *(0.15, 0.1, 0.1, 0.1, 0.15, 0.25, 0.4, 0.6, 0.8, 0.95, 1.0, 1.0),
    *(0.9, 1.0, 1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2),
)
#: The hour the daily peak begins: a history shorter than this ends there.
PEAK_HOUR = DAILY.index(max(DAILY))
HOUR_MS = 3_600_000
#: The history's clock: midnight, 2030-01-01 UTC.
EPOCH_MS = 1_893_456_000_000
#: A flaky regression's broken pushes fail a share of their runs drawn in this range.
FLAKY_REGRESSION_RATES = (0.3, 0.7)
#: Every task's priority: an integration branch's (a project's own choice; nothing here
#: depends on which, but ``hold-by: priority`` needs one above the lowest to park victims).
PRIORITY = priority_rank("low")


@dataclasses.dataclass(frozen=True, slots=True)
class Synthetic:
    hours: float = 24.0
    pushes_per_hour: float = 12.0
    platforms: int = 2
    suites: int = 3
    build_minutes: float = 30.0
    test_minutes: float = 12.0
    #: Spread of run times: the log-normal's sigma.
    spread: float = 0.3
    build_workers: int = 5
    test_workers: int = 6
    deadline_hours: float = 24.0
    seed: int = 0
    #: Probability that a push breaks a key that passes (per push and key).
    regression_rate: float = 0.0
    #: A breakage lasts 1 .. fix_after pushes of its key (uniformly drawn).
    fix_after: int = 3
    #: Probability that a run of a task that is not broken fails all the same.
    intermittent_rate: float = 0.0
    #: Share of the keys that are flaky, and the share of their runs that fail.
    flaky_share: float = 0.0
    flaky_rate: float = 0.0
    #: Share of the regressions whose broken pushes fail only some runs.
    flaky_regressions: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hours", "pushes_per_hour", "build_minutes", "test_minutes"):
            if not getattr(self, name) > 0:
                raise InvalidInput(f"synthetic {name} must be positive")
        for name in ("platforms", "build_workers", "test_workers"):
            if getattr(self, name) < 1:
                raise InvalidInput(f"synthetic {name} must be at least 1")
        if self.suites < 0 or self.spread < 0:
            raise InvalidInput("synthetic suites and spread must not be negative")
        rates = ("regression_rate", "intermittent_rate", "flaky_share", "flaky_rate")
        for name in (*rates, "flaky_regressions"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidInput(f"synthetic {name} must be between 0 and 1")
        if self.fix_after < 1:
            raise InvalidInput("synthetic fix_after must be at least 1")

    @property
    def tasks_per_push(self) -> int:
        return self.platforms * (1 + self.suites)

    @property
    def start_hour(self) -> float:
        """The hour of the day the history starts: midnight, or late enough for a short
        history to end at :data:`PEAK_HOUR` (the same at ``PEAK_HOUR`` hours, either way)."""
        return max(0.0, PEAK_HOUR - self.hours)


def parse_flaky(value: str) -> tuple[float, float]:
    """``--flaky SHARE:RATE``: the share of keys that are flaky, the share of runs they fail
    (``0, 0`` for an empty value)."""
    if not value:
        return 0.0, 0.0
    share, colon, rate = value.partition(":")
    try:
        found = float(share), float(rate)
    except ValueError:
        found = (-1.0, -1.0)
    if not colon or not all(0 <= x <= 1 for x in found):
        raise InvalidInput(
            f"--flaky {value!r}: expected SHARE:RATE, two numbers between 0 and 1 (e.g. 0.25:0.1)"
        )
    return found


def push_times(spec: Synthetic, rng: random.Random) -> list[int]:
    """Push arrival times (ms since midnight), a Poisson process thinned by the daily profile,
    from :attr:`Synthetic.start_hour` for :attr:`Synthetic.hours`."""
    peak = spec.pushes_per_hour / HOUR_MS
    t = spec.start_hour * HOUR_MS
    end = t + spec.hours * HOUR_MS
    times: list[int] = []
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return times
        if rng.random() < DAILY[int(t // HOUR_MS) % 24]:
            times.append(int(t))


class Regressions:
    """Which pushes of each key are broken: a key that passes breaks with probability
    ``rate`` at each push, for ``1 .. fix_after`` pushes. Its own seeded stream; whether a
    regression is flaky, and its rate, from another."""

    def __init__(self, spec: Synthetic) -> None:
        self.rate, self.fix_after = spec.regression_rate, spec.fix_after
        self.flaky = spec.flaky_regressions
        self.rng = random.Random(f"{spec.seed}/regressions")
        self.flaky_rng = random.Random(f"{spec.seed}/flaky-regressions")
        self.left: dict[str, int] = {}  # broken pushes still to come, per key
        self.fails: dict[str, float] = {}  # the current regression's failure rate, per key

    def broken(self, key: str) -> float:
        """The share of runs of the next push of ``key`` that fail through a regression: 0
        when it is not broken, 1 when every run fails."""
        left = self.left.get(key, 0)
        if not left and self.rate and self.rng.random() < self.rate:
            left = self.rng.randint(1, self.fix_after)
            flaky = self.flaky and self.flaky_rng.random() < self.flaky
            self.fails[key] = self.flaky_rng.uniform(*FLAKY_REGRESSION_RATES) if flaky else 1.0
        self.left[key] = max(0, left - 1)
        return self.fails[key] if left > 0 else 0.0


def flaky_keys(spec: Synthetic, keys: list[str]) -> dict[str, float]:
    """The flaky keys and their rate: ``flaky_share`` of ``keys`` (at least one when the share
    is not 0), chosen from a seeded stream of their own."""
    if not spec.flaky_share:
        return {}
    count = max(1, round(spec.flaky_share * len(keys)))
    chosen = random.Random(f"{spec.seed}/flaky").sample(sorted(keys), count)
    return {key: spec.flaky_rate for key in sorted(chosen)}


def generate(spec: Synthetic) -> History:
    rng = random.Random(spec.seed)
    regressions = Regressions(spec)
    tasks: list[TaskSpec] = []

    def task_id() -> str:
        raw = uuid.UUID(int=rng.getrandbits(128), version=4).bytes
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def duration(minutes: float) -> int:
        return max(1000, int(minutes * 60_000 * math.exp(rng.gauss(0, spec.spread))))

    deadline = int(spec.deadline_hours * HOUR_MS)
    workers: dict[str, int] = {}
    rates: dict[str, float] = {}  # a flaky regression's broken tasks

    def broken(task_id: str, key: str) -> bool:
        rate = regressions.broken(key)
        if 0 < rate < 1:
            rates[task_id] = rate
        return rate > 0

    pushes = push_times(spec, rng)
    if not pushes:
        raise InvalidInput(empty(spec))
    for push, at in enumerate(pushes, start=1):
        at += EPOCH_MS
        for p in range(spec.platforms):
            platform = f"p{p + 1}"
            build_queue, test_queue = f"replay/build-{platform}", f"replay/test-{platform}"
            workers[build_queue] = spec.build_workers
            workers[test_queue] = spec.test_workers
            build_id = task_id()
            build = TaskSpec(
                task_id=build_id,
                task_queue=build_queue,
                keys=(f"build.{platform}",),
                order=float(push),
                scheduled_ms=at,
                deadline_ms=at + deadline,
                priority=PRIORITY,
                duration_ms=duration(spec.build_minutes),
                broken=broken(build_id, f"build.{platform}"),
            )
            tasks.append(build)
            for s in range(spec.suites):
                test_id = task_id()
                tasks.append(
                    TaskSpec(
                        task_id=test_id,
                        task_queue=test_queue,
                        keys=(f"test.{platform}.s{s + 1}",),
                        order=float(push),
                        scheduled_ms=at,
                        deadline_ms=at + deadline,
                        priority=PRIORITY,
                        dependencies=(build.task_id,),
                        duration_ms=duration(spec.test_minutes),
                        broken=broken(test_id, f"test.{platform}.s{s + 1}"),
                    )
                )
    source = f"synthetic (seed {spec.seed})"
    if spec.regression_rate or spec.intermittent_rate:
        source = (
            f"synthetic (seed {spec.seed}; regressions {spec.regression_rate:g} a push, fixed "
            f"within {spec.fix_after}; intermittent {spec.intermittent_rate:g} a run)"
        )
    flaky = flaky_keys(spec, sorted({k for t in tasks for k in t.keys}))
    if flaky or spec.flaky_regressions:
        source = source.removesuffix(")") + (
            f"; flaky: {len(flaky)} keys at {spec.flaky_rate:g} a run, "
            f"{spec.flaky_regressions:g} of regressions)"
        )
    return History.build(
        tasks,
        workers=workers,
        source=source,
        intermittent=spec.intermittent_rate,
        flaky=flaky,
        broken_rates=rates,
    )


def empty(spec: Synthetic) -> str:
    """Why a synthetic history holds no push, and what to give for one."""
    start = spec.start_hour
    expected = sum(
        DAILY[int(h) % 24] * (min(h + 1, start + spec.hours) - max(h, start))
        for h in range(int(start), math.ceil(start + spec.hours))
    )
    return (
        f"the synthetic history drew no push in its {spec.hours:g} h from {_clock(start)} UTC "
        f"(about {expected * spec.pushes_per_hour:.2g} expected at {spec.pushes_per_hour:g} "
        "pushes an hour at the peak): give more --hours or --pushes-per-hour, or another --seed"
    )


def _clock(hour: float) -> str:
    minutes = round(hour * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"
