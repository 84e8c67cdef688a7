"""The pure core: task events, versions, ordering and input validation. No IO here.

A task's *version* is ``(runId, rank)`` with pending < running < resolved. The index applies an
event only when its version is newer than the one it holds, so duplicated and re-ordered
deliveries change nothing. A task's *order* within a key comes from the event data (the first
run's ``scheduled`` time, or a numeric tag), never from arrival time; ties go by taskId.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from coalescer.errors import InvalidInput

#: Taskcluster's taskId: a v4 UUID as URL-safe base64 without padding (task-status.json).
#: Anchored for the API schema; validate with ``fullmatch``, since ``$`` also matches before
#: a trailing newline.
TASK_ID_RE = re.compile(
    r"^[A-Za-z0-9_-]{8}[Q-T][A-Za-z0-9_-][CGKOSWaeimquy26-][A-Za-z0-9_-]{10}[AQgw]$"
)
#: A coalescing key: dotted words of route characters. A URL path's ``/`` reads as ``.``.
KEY_RE = re.compile(r"^[A-Za-z0-9_~+:@-]+(\.[A-Za-z0-9_~+:@-]+)*$")
MAX_KEY_LENGTH = 200
#: The most routes a task can have (``task.json``: ``routes.maxItems``), so the most ``CC``
#: routes a queue message can carry.
MAX_ROUTES = 64
#: runId for an exception that resolved a task before any run (deadline): newer than any run.
TERMINAL_RUN = 1001


class Rank(enum.IntEnum):
    PENDING = 1
    RUNNING = 2
    RESOLVED = 3


STATE_RANKS = {
    "pending": Rank.PENDING,
    "running": Rank.RUNNING,
    "completed": Rank.RESOLVED,
    "failed": Rank.RESOLVED,
    "exception": Rank.RESOLVED,
}
#: Each state's rank as a plain number, for ingest's per-event work (comparing ``Rank``
#: members costs more than comparing ints).
STATE_RANK_NUMBERS = {state: int(rank) for state, rank in STATE_RANKS.items()}


class TaskEvent(NamedTuple):
    """One task transition as the index needs it, for every coalescing key of the task.

    A named tuple: ingest makes one per event, and a tuple is made in a fraction of a frozen
    dataclass's time (bench/ingest.py)."""

    task_id: str
    run_id: int
    state: str
    keys: tuple[str, ...]
    order: float
    deadline_ms: int
    pending_since_ms: int
    reason: str = ""
    #: When the reported run started and resolved (0: not yet, or unknown). Superseding
    #: policies protect long-running tasks and estimate run durations from these.
    started_ms: int = 0
    resolved_ms: int = 0

    @property
    def rank(self) -> Rank:
        return STATE_RANKS[self.state]

    @property
    def version(self) -> tuple[int, int]:
        return (self.run_id, int(self.rank))


def parse_time_ms(value: str) -> int:
    """An RFC 3339 date-time (``2030-01-01T00:00:00.000Z``) as milliseconds since the epoch."""
    try:
        return _parse_time_ms(value)
    except TypeError:  # unhashable, so not a string
        raise InvalidInput(f"not an RFC 3339 date-time: {value!r}") from None


@functools.lru_cache(maxsize=16_384)
def _parse_time_ms(value: str) -> int:
    # Remembered: every message about a task repeats its deadline and its runs' times.
    try:
        # Python 3.11's reads a trailing ``Z``; four or five of these per ingested event.
        parsed = datetime.fromisoformat(value)
    except (ValueError, TypeError):
        raise InvalidInput(f"not an RFC 3339 date-time: {value!r}") from None
    if parsed.tzinfo is None:
        raise InvalidInput(f"date-time without a time zone: {value!r}")
    return int(parsed.timestamp() * 1000)


def format_time_ms(ms: int) -> str:
    """Milliseconds since the epoch as the queue writes date-times, and as the JSON API gives
    every instant: ISO 8601 in UTC with milliseconds (``2030-01-01T00:00:00.000Z``)."""
    seconds, millis = divmod(int(ms), 1000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{millis:03d}Z"


def check_task_id(value: str) -> str:
    if not TASK_ID_RE.fullmatch(value):
        raise InvalidInput(
            f"malformed taskId {value!r}: expected a slugid (a v4 UUID in 22 URL-safe base64 "
            "characters, as taskcluster.slugid.nice() makes, e.g. fN1SbArXTPSVFNUvaOlinQ)"
        )
    return value


def key_from_path(path: str) -> str:
    """The coalescing key named by a URL path: ``build/linux/master`` → ``build.linux.master``."""
    key = path.strip("/").replace("/", ".")
    return check_key(key)


def check_key(key: str) -> str:
    if not key:
        raise InvalidInput("missing coalescing key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidInput(f"coalescing key longer than {MAX_KEY_LENGTH} characters")
    if not KEY_RE.fullmatch(key):
        raise InvalidInput(
            f"malformed coalescing key {key!r}: use letters, digits and _~+:@- "
            "in dot- or slash-separated words"
        )
    return key


def keys_from_routes(routes: list[str] | tuple[str, ...], prefix: str) -> tuple[str, ...]:
    """The coalescing keys of a task, in route order without repeats: every route
    ``<prefix>.K`` (``route.`` CC form accepted)."""
    # Remembered: every message about a task names the same routes.
    return _keys_of_routes(tuple(routes), prefix)


@functools.lru_cache(maxsize=4096)
def _keys_of_routes(routes: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    head = prefix + "."
    found: dict[str, None] = {}  # ordered, and linear in the number of routes
    for route in routes:
        route = route.removeprefix("route.")
        if route.startswith(head):
            key = route[len(head) :]
            if key and len(key) <= MAX_KEY_LENGTH and KEY_RE.fullmatch(key):
                found[key] = None
    return tuple(found)


def rank_order(tags: Mapping[str, Any], rank_tag: str) -> float:
    """A task's order from its tag ``rank_tag`` (``COALESCER_RANK_TAG``)."""
    raw: Any = tags.get(rank_tag)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise InvalidInput(
            f"task tag {rank_tag!r} (COALESCER_RANK_TAG) is missing or not a number: {raw!r}"
        ) from None
    if not abs(value) < 2**53:
        raise InvalidInput(f"task tag {rank_tag!r} is out of range: {raw!r}")
    return value


def passes_thresholds(
    pending: int, oldest_wait_s: float | None, age: int | None, size: int | None
) -> bool:
    """tc-coalesce's rule: supersede only when *more* than ``size`` tasks are pending and the
    longest-waiting one has waited *more* than ``age`` seconds."""
    if pending == 0:
        return False
    if size is not None and pending <= size:
        return False
    return not (age is not None and (oldest_wait_s is None or oldest_wait_s <= age))


class KeySnapshot(NamedTuple):
    """What the store reads for one query, in one round trip (a named tuple: one per query).

    ``newest``: the newest pending taskIds (up to the cap), newest first. ``newer``: how many
    pending tasks other than the initial one come after it in the key's order; ``None`` when
    the index does not know the initial task. ``initial_resolved``: the initial task's newest
    known run is resolved.
    """

    pending: int
    oldest_since_ms: int | None
    newest: list[str]
    newer: int | None = None
    initial_resolved: bool = False


def supersedes(
    initial: str,
    snap: KeySnapshot,
    *,
    now_ms: int,
    age: int | None = None,
    size: int | None = None,
    cap: int = 32,
) -> tuple[list[str], str]:
    """The ``supersedes`` answer for ``initial``, oldest first, and why it has that shape.

    The answer holds the newest ``cap - 1`` other pending tasks and the initial task, placed by
    its own order. Reasons: ``unknown`` (the index has not seen the initial task: answering more
    could make an older task supersede a newer one), ``threshold`` (age/size not exceeded),
    ``ok``.
    """
    if snap.newer is None:
        return [initial], "unknown"
    wait = None if snap.oldest_since_ms is None else (now_ms - snap.oldest_since_ms) / 1000
    if not passes_thresholds(snap.pending, wait, age, size):
        return [initial], "threshold"
    others = [t for t in snap.newest if t != initial][: cap - 1]
    newer, older = others[: snap.newer], others[snap.newer :]
    return [*reversed(older), initial, *reversed(newer)], "ok"


def docker_worker_list(
    initial: str,
    snap: KeySnapshot,
    *,
    now_ms: int,
    age: int | None = None,
    size: int | None = None,
    cap: int = 32,
) -> tuple[list[str], str]:
    """The answer for an unmodified docker-worker, *newest first*, and why it has that shape.

    docker-worker runs the first task of the list it claimed, and runs alone unless its own
    task is listed: so this is :func:`supersedes` reversed, the initial task included whether
    it is pending or running. When the index holds the initial task's newest known run as
    resolved (``resolved``), the answer is the initial task alone: either the index has not seen
    the run the worker holds (a retry), or the queue resolved the task under the worker (e.g.
    canceled); neither makes it safe to let that claim supersede others.
    """
    if snap.initial_resolved:
        return [initial], "resolved"
    answer, reason = supersedes(initial, snap, now_ms=now_ms, age=age, size=size, cap=cap)
    answer.reverse()
    return answer, reason


def compat_list(snap: KeySnapshot, *, now_ms: int, age: int, size: int) -> list[str]:
    """tc-coalesce's ``/v1/list/<age>/<size>/<key>``: every pending task, newest first, or
    nothing when a threshold is not exceeded."""
    wait = None if snap.oldest_since_ms is None else (now_ms - snap.oldest_since_ms) / 1000
    if not passes_thresholds(snap.pending, wait, age, size):
        return []
    return snap.newest
