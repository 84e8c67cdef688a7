"""Activity over time, for the pages' charts: fixed-size rings of time buckets. Pure.

A *series* is a ring of :attr:`Retention.buckets` buckets, each :attr:`Retention.bucket_ms`
wide (by default a minute each for 24 hours). The bucket that starts at ``start_ms`` lives in
slot ``start_ms // bucket_ms % buckets`` and holds ``start_ms|value``; a newer bucket takes the
slot over, an older one finds it taken and is dropped. So a series never holds more than
``buckets`` entries, and whatever is older than the retention falls out by itself.

Series (:data:`SERIES`):

* ``pending``    — pending tasks, sampled by the background upkeep (a gauge: the newest
  sample in the bucket);
* ``superseded`` — tasks resolved ``exception``/``superseded``, counted when ingest applies
  their resolution (a redelivered event is stale, so it never counts twice);
* ``saved_ms``   — the worker time those superseded tasks would have taken, estimated
  (:class:`Durations`);
* ``answers``    — superseding queries answered, counted by the web process's flusher.

What the service counts waits in a :class:`Tally` in the process and is written in batches by
the writes it does anyway (the counters of ingest, the flush of answers).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence

from coalescer.errors import ConfigError

PENDING, SUPERSEDED, SAVED_MS, ANSWERS = "pending", "superseded", "saved_ms", "answers"
SERIES = (PENDING, SUPERSEDED, SAVED_MS, ANSWERS)
#: Series whose bucket holds a sample (the newest wins), not a sum.
GAUGES = frozenset({PENDING})

#: ``(series, bucket start ms)``
Slot = tuple[str, int]
#: The pages' charts span at least this long (and two buckets), however recent the first
#: bucket kept: a young service's charts span its own age, not hours with one point.
SHOWN_AT_LEAST_MS = 10 * 60_000
#: A key's ring has buckets this many times as wide as the ring over every key.
KEY_FACTOR = 5
#: A gauge is written when it changes, and at least every ``CARRY`` buckets: a bucket without
#: a sample shows the last one before it, up to ``CARRY`` buckets back.
CARRY = 10


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """How much history is kept: ``buckets`` buckets of ``bucket_ms`` each."""

    bucket_ms: int = 60_000
    buckets: int = 1440

    def __post_init__(self) -> None:
        if self.bucket_ms < 1000:
            raise ConfigError("a history bucket must be at least one second wide")
        if not 2 <= self.buckets <= 100_000:
            raise ConfigError("the history must keep 2 to 100000 buckets")

    @property
    def span_ms(self) -> int:
        return self.bucket_ms * self.buckets

    def start(self, at_ms: int) -> int:
        """The start of the bucket that holds ``at_ms``."""
        return at_ms - at_ms % self.bucket_ms

    def slot(self, start_ms: int) -> int:
        return start_ms // self.bucket_ms % self.buckets

    def oldest(self, now_ms: int) -> int:
        """The start of the oldest bucket still kept at ``now_ms``."""
        return self.start(now_ms) - (self.buckets - 1) * self.bucket_ms

    def per_key(self) -> Retention:
        """The rings of single keys: the same span in :data:`KEY_FACTOR` times wider buckets,
        so that many busy keys stay small in Redis."""
        factor = min(KEY_FACTOR, self.buckets // 2)
        return Retention(self.bucket_ms * factor, self.buckets // factor)


class Tally:
    """What the process counted and has not written yet, by ``(series, bucket start)``.

    :meth:`take` hands the counts over for a write and forgets them; a write that failed
    gives them back with :meth:`restore`, so nothing is lost and nothing is written twice."""

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        self._counts: collections.Counter[Slot] = collections.Counter()

    def add(self, series: str, at_ms: int, amount: int = 1) -> None:
        if amount:
            self._counts[(series, self.retention.start(at_ms))] += amount

    def add_each(self, series: str, times_ms: Iterable[int]) -> None:
        """One for each of ``times_ms`` (the flush of a second's answers: cheaper than
        :meth:`add` one at a time)."""
        width = self.retention.bucket_ms
        for start, n in collections.Counter(at - at % width for at in times_ms).items():
            self._counts[(series, start)] += n

    def take(self) -> dict[Slot, int]:
        counts, self._counts = dict(self._counts), collections.Counter()
        return counts

    def restore(self, counts: Mapping[Slot, int]) -> None:
        self._counts.update(counts)

    def __bool__(self) -> bool:
        return bool(self._counts)


class Durations:
    """Recent run durations per coalescing key, from the resolutions ingest applies; their
    median is the estimate of the worker time a superseded task of the key would have taken.

    Bounded: :data:`PER_KEY` durations for each of the :data:`KEYS` most recently seen keys.
    Kept in the process: after a restart, a key's superseded tasks count no time saved until
    one of its runs has completed or failed."""

    PER_KEY = 20
    KEYS = 2048

    def __init__(self) -> None:
        self._runs: collections.OrderedDict[str, collections.deque[int]] = collections.OrderedDict()

    def add(self, key: str, duration_ms: int) -> None:
        runs = self._runs.get(key)
        if runs is None:
            runs = self._runs[key] = collections.deque(maxlen=self.PER_KEY)
            while len(self._runs) > self.KEYS:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(key)
        runs.append(duration_ms)

    def estimate(self, keys: Iterable[str]) -> int | None:
        """The median recent run time of the first of ``keys`` with any, else ``None``."""
        for key in keys:
            runs = self._runs.get(key)
            if runs:
                return int(statistics.median(runs))
        return None


class Sampler:
    """Which gauge samples are worth writing: those that changed since the last one written,
    or were last written :data:`CARRY` buckets ago or more (so that idle keys cost nothing).

    Remembers the keys of the last round only (:meth:`due`, :meth:`wrote` then :meth:`done`
    each round), and at most :data:`KEYS` of them, so that the process's memory does not grow
    with the index: a key beyond them is written every round. A sample whose write failed is
    due again."""

    #: Keys remembered at most (about 150 bytes each).
    KEYS = 10_000

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        self._written: dict[str, tuple[int, int]] = {}  # key -> (value, bucket start)
        self._seen: set[str] = set()

    def due(self, samples: Iterable[tuple[str, int]], now_ms: int) -> list[tuple[str, int]]:
        """The ``samples`` to write (:meth:`wrote` once they are written)."""
        start = self.retention.start(now_ms)
        horizon = CARRY * self.retention.bucket_ms
        out = []
        for key, value in samples:
            last = self._written.get(key)
            if last is not None:
                self._seen.add(key)
            if last is None or last[0] != value or start - last[1] >= horizon:
                out.append((key, value))
        return out

    def wrote(self, samples: Iterable[tuple[str, int]], now_ms: int) -> None:
        start = self.retention.start(now_ms)
        for key, value in samples:
            if key in self._written or len(self._written) < self.KEYS:
                self._written[key] = (value, start)
                self._seen.add(key)

    def done(self) -> None:
        """The end of a round: forget the keys it did not see (forgotten keys)."""
        self._written = {k: v for k, v in self._written.items() if k in self._seen}
        self._seen = set()


@dataclasses.dataclass(frozen=True, slots=True)
class Series:
    """One series over a window: ``points`` are ``(bucket start ms, value)``, oldest first,
    one per bucket; ``None`` where a gauge was not sampled."""

    name: str
    points: tuple[tuple[int, float | None], ...]

    @property
    def total(self) -> float:
        return sum(v for _, v in self.points if v is not None)

    @property
    def latest(self) -> float | None:
        return next((v for _, v in reversed(self.points) if v is not None), None)


def decode(
    raw: Mapping[str, str], retention: Retention, *, now_ms: int, since_ms: int | None = None
) -> dict[str, Series]:
    """The ring's fields (``<series>:<slot>`` → ``start|value``) as one :class:`Series` each,
    from ``since_ms`` (at most the retention) to the bucket holding ``now_ms``; a gauge's
    samples are carried forward (:func:`_carried`)."""
    first = retention.oldest(now_ms)
    if since_ms is not None:
        first = max(first, retention.start(since_ms))
    last = retention.start(now_ms)
    values: dict[str, dict[int, float]] = {name: {} for name in SERIES}
    for field, entry in raw.items():
        name, _, _ = field.partition(":")
        start, _, value = entry.partition("|")
        try:
            at, amount = int(start), float(value)
        except ValueError:
            continue
        if name in values and at <= last:
            values[name][at] = amount
    starts = range(first, last + 1, retention.bucket_ms)
    out = {}
    for name, got in values.items():
        if name in GAUGES:
            out[name] = Series(name, tuple(_carried(got, starts, retention.bucket_ms)))
        else:
            out[name] = Series(name, tuple((at, got.get(at, 0.0)) for at in starts))
    return out


def _carried(
    samples: Mapping[int, float], starts: range, width: int
) -> Iterable[tuple[int, float | None]]:
    """A gauge per bucket: its sample, else the one before it up to :data:`CARRY` buckets
    back (samples are written when they change), else ``None``."""
    before = [at for at in samples if at < starts.start]
    last: tuple[int, float] | None = None
    if before:
        at = max(before)
        last = (at, samples[at])
    for at in starts:
        if at in samples:
            last = (at, samples[at])
        if last is not None and at - last[0] < CARRY * width:
            yield at, last[1]
        else:
            yield at, None


def first_activity(raw: Mapping[str, str]) -> int | None:
    """The start of the oldest bucket the ring holds, if any."""
    starts = []
    for entry in raw.values():
        start = entry.partition("|")[0]
        if start.isdigit():
            starts.append(int(start))
    return min(starts, default=None)


def rebin(series: Series, width: int) -> Series:
    """``width`` buckets as one: counts summed, a gauge's newest sample kept."""
    if width <= 1:
        return series
    points: list[tuple[int, float | None]] = []
    pts: Sequence[tuple[int, float | None]] = series.points
    for i in range(0, len(pts), width):
        chunk = pts[i : i + width]
        if series.name in GAUGES:
            sampled = [v for _, v in chunk if v is not None]
            points.append((chunk[0][0], sampled[-1] if sampled else None))
        else:
            points.append((chunk[0][0], sum(v or 0.0 for _, v in chunk)))
    return Series(series.name, tuple(points))
