"""The set of known coalescing keys, kept bounded: what to forget, how to count, how to page.

A key is known while the index holds any of its tasks. Each task is kept until its deadline
plus the grace period, so a key's data expires with the newest deadline it holds; the upkeep
round (:mod:`coalescer.upkeep`) then forgets the key. Nothing here does IO: the store reads and
writes (:mod:`coalescer.store.keyset`), these functions decide.

Every anonymous endpoint costs O(page), not O(keys): the totals behind ``/metrics`` and
``/v1/stats`` are counted in the background in bounded steps (:class:`Tally`) and read as one
record, except for an index small enough to count in one step, which is counted when asked.
"""

from __future__ import annotations

import dataclasses

from coalescer.errors import InvalidInput

#: Keys per step of the upkeep round (one round trip each) and per page of the overview.
STEP = 500
PAGE_SIZE = 100
#: An index with at most this many keys is counted when ``/metrics`` or ``/v1/stats`` asks.
COUNT_INLINE = 1000
#: ``GET /v1/list`` (tc-coalesce's): the keys with pending tasks among this many most recently
#: active keys.
LIST_CAP = 1000
#: Keys a filtered overview examines per page (the next page goes on from there).
SEARCH_BUDGET = 5000
#: A task's page looks for the task under this many most recently active keys (one round
#: trip), unless told its key (``?key=``).
TASK_PAGE_KEYS = 1000


def expires_ms(deadline_ms: int, grace_ms: int) -> int:
    """When the index forgets a task: its deadline plus the grace period."""
    return deadline_ms + grace_ms


def outlived(newest_deadline_ms: int | None, *, now_ms: int, grace_ms: int) -> bool:
    """Whether a key whose newest known deadline is ``newest_deadline_ms`` (``None``: it holds
    no task) has nothing left to know at ``now_ms``."""
    return newest_deadline_ms is None or expires_ms(newest_deadline_ms, grace_ms) <= now_ms


@dataclasses.dataclass(slots=True)
class Tally:
    """Totals over keys, added up step by step."""

    with_pending: int = 0
    pending: int = 0
    oldest_since_ms: int | None = None
    #: Tasks tracked, under every key (the census behind ``COALESCER_MAX_TASKS``).
    tracked: int = 0

    def add(self, pending: int, oldest_since_ms: int | None) -> None:
        """Count one key with ``pending`` tasks, the oldest pending since ``oldest_since_ms``."""
        if not pending:
            return
        self.with_pending += 1
        self.pending += pending
        if oldest_since_ms is not None and (
            self.oldest_since_ms is None or oldest_since_ms < self.oldest_since_ms
        ):
            self.oldest_since_ms = oldest_since_ms


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """The index's totals: ``keys`` known now; the others as counted from ``counted_ms`` on
    (``None``: not counted yet, the others then mean nothing)."""

    keys: int
    counted_ms: int | None = None
    with_pending: int = 0
    pending: int = 0
    oldest_since_ms: int | None = None

    def age_seconds(self, now_ms: int) -> float:
        return 0.0 if self.counted_ms is None else max(0.0, (now_ms - self.counted_ms) / 1000)

    def oldest_wait_seconds(self, now_ms: int) -> float:
        if self.oldest_since_ms is None:
            return 0.0
        return max(0.0, (now_ms - self.oldest_since_ms) / 1000)


def page_number(raw: str | None) -> int:
    """``?page=``: 1 when absent; a clear error unless a whole number from 1 on."""
    if raw is None or raw == "":
        return 1
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9 or int(raw) < 1:
        raise InvalidInput("query parameter 'page' must be a whole number from 1 on")
    return int(raw)


def cursor(raw: str | None) -> int:
    """``?after=``: where a filtered overview goes on (0: from the start)."""
    if raw is None or raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19:  # Redis takes 64 bits
        raise InvalidInput("query parameter 'after' must be the cursor a previous page gave")
    return int(raw)


def page_range(page: int, size: int = PAGE_SIZE) -> tuple[int, int]:
    """Ranks ``(start, stop)`` (inclusive, most recent first) of ``page`` (from 1)."""
    start = (page - 1) * size
    return start, start + size - 1
