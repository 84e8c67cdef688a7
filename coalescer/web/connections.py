"""How many connections a ``coalescer serve`` process keeps open, and how long a client may keep
one waiting: what uvicorn does not bound by itself.

uvicorn closes a keep-alive connection only once it has answered on it (``timeout_keep_alive``):
a connection that never sends a request, or sends its head a byte at a time, is held for ever,
and a process holds as many as its file descriptors allow; past that, the accept loop closes
every new connection at once, new clients included. (uvicorn's ``limit_concurrency`` answers
``503`` to new requests once that many connections are open: it keeps the new clients out, not
the idle ones.)

Each web process has a :class:`Gate`, which its connections (server.py's protocol) report to:

* a connection that sends no request within ``idle_timeout`` of connecting is closed (after a
  response, uvicorn's keep-alive timeout closes it, with the same setting);
* a connection whose request head is not complete ``head_timeout`` after it began is answered
  ``408`` and closed, however steadily its bytes come;
* at most ``max_connections`` are open: a connection over the cap closes the one that has waited
  longest for its client (idle, or sending a head), so that new clients keep being answered;
  when every other one has a request in flight, the new one is closed instead;
* what is closed is counted (``coalescer_connections_shed_total{reason}``) and logged: the first
  at once, then one summary every ``report_seconds`` (``COALESCER_CONNECTION_REPORT_SECONDS``)
  while it goes on.

:func:`plan` keeps the cap, with uvicorn's accept backlog and what the process needs besides,
below the process's limit of open files, raising its soft limit when the hard limit allows.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Protocol

from coalescer.errors import ConfigError
from coalescer.observe import CONNECTIONS_LIMIT, CONNECTIONS_OPEN, CONNECTIONS_SHED

log = logging.getLogger("coalescer.web")

#: The cap when ``COALESCER_MAX_CONNECTIONS`` is unset (and the descriptor limit allows it).
DEFAULT_MAX_CONNECTIONS = 10_000
#: Descriptors a web process needs besides its clients' connections: its Redis pool (up to 256
#: connections), the queue's client, the listening socket, logs, metrics files.
RESERVED_FILES = 512
#: uvicorn's default accept backlog, the most :func:`backlog` gives.
MAX_BACKLOG = 2048

IDLE = "idle"
SLOW_HEAD = "slow_head"
OVER_LIMIT = "over_limit"
REFUSED = "refused"
#: What the summary lines call the connections closed, by reason.
_NOUNS = {
    IDLE: "idle (COALESCER_IDLE_TIMEOUT={idle_timeout})",
    SLOW_HEAD: "slow heads (COALESCER_HEAD_TIMEOUT={head_timeout:g})",
    OVER_LIMIT: "waiting longest, for new ones (COALESCER_MAX_CONNECTIONS={max_connections})",
    REFUSED: "new, every other one busy (COALESCER_MAX_CONNECTIONS={max_connections})",
}


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The limits of one web process (``max_connections`` ``None``: no cap), uvicorn's accept
    ``backlog`` that goes with them (:func:`backlog`), and the seconds between the log's
    summaries of the connections closed."""

    head_timeout: float = 10.0
    idle_timeout: int = 5
    max_connections: int | None = None
    backlog: int = MAX_BACKLOG
    report_seconds: float = 10.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a web process runs with: its connection cap, uvicorn's accept backlog, and the soft
    limit of open files that holds both and everything else."""

    max_connections: int
    backlog: int
    files: int


def backlog(cap: int) -> int:
    """The accept backlog for ``cap`` connections: the event loop accepts a full backlog at once
    before the gate sees any, so these descriptors are counted apart."""
    return min(MAX_BACKLOG, max(64, cap // 4))


def files_needed(cap: int) -> int:
    return cap + backlog(cap) + RESERVED_FILES


def plan(wanted: int | None, soft: int, hard: int, unlimited: int = -1) -> Plan:
    """The cap for ``wanted`` connections (``None``: the default, lowered to what ``soft`` and
    ``hard``, the process's limits of open files, allow); raises :class:`ConfigError` when
    ``wanted`` cannot be held under ``hard`` or the limit leaves too little room to serve."""
    cap = DEFAULT_MAX_CONNECTIONS if wanted is None else wanted
    need = files_needed(cap)
    if soft == unlimited or need <= soft:
        return Plan(cap, backlog(cap), soft)
    files = need if hard == unlimited else min(hard, need)
    if need <= files:
        return Plan(cap, backlog(cap), files)
    if wanted is not None:
        raise ConfigError(
            f"COALESCER_MAX_CONNECTIONS={wanted} needs {need} open files (with "
            f"{backlog(wanted)} connections waiting to be accepted and {RESERVED_FILES} for the "
            f"rest), more than this process may open ({files}, ulimit -n): lower it or raise "
            "the limit"
        )
    low, high = 0, cap  # the largest cap that fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if files_needed(middle) <= files else (low, middle - 1)
    if low < 16:
        raise ConfigError(
            f"this process may open {files} files (ulimit -n): too few to serve; raise the "
            f"limit to at least {files_needed(16)}"
        )
    return Plan(low, backlog(low), files)


class Connection(Protocol):
    """What the gate asks of a connection."""

    def waiting(self) -> bool:
        """Open, and waiting for its client: idle, or reading a request head."""

    def shed(self) -> str:
        """Close it for the gate; returns the client's address, for the log."""


class Gate:
    """The open connections of one web process, the one waiting longest for its client first;
    what is closed, counted and logged."""

    def __init__(self, limits: ConnectionLimits, loop: asyncio.AbstractEventLoop) -> None:
        self.limits = limits
        self._loop = loop
        self._open: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        #: ``touch(connection)``: it has just begun a request (the hot path: a bound method)
        self.touch = self._open.move_to_end
        self._held: collections.Counter[str] = collections.Counter()
        self._report: asyncio.TimerHandle | None = None
        if limits.max_connections is not None:
            CONNECTIONS_LIMIT.set(limits.max_connections)

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: Connection) -> bool:
        """Count a new connection in; over the cap, close the one waiting longest for its
        client. ``False``: every other one has a request in flight, close this one."""
        self._open[connection] = None
        CONNECTIONS_OPEN.inc()
        cap = self.limits.max_connections
        if cap is None or len(self._open) <= cap:
            return True
        # Connections already closed (their loss not yet seen) and busy ones go to the back.
        for _ in range(len(self._open) - 1):
            oldest = next(iter(self._open))
            self._open.move_to_end(oldest)
            if oldest is not connection and oldest.waiting():
                self.closed(OVER_LIMIT, oldest.shed())
                return True
        return False

    def forget(self, connection: Connection) -> None:
        """The connection is closed."""
        if self._open.pop(connection, False) is None:
            CONNECTIONS_OPEN.dec()

    def closed(self, reason: str, peer: str) -> None:
        """Count and log a connection closed for ``reason`` (one of :data:`_NOUNS`)."""
        CONNECTIONS_SHED.labels(reason).inc()
        if self._report is not None:
            self._held[reason] += 1
            return
        level = logging.WARNING if reason in (OVER_LIMIT, REFUSED) else logging.INFO
        log.log(level, "closed a connection from %s: %s", peer, self._why(reason))
        self._report = self._loop.call_later(self.limits.report_seconds, self._summary)

    def _summary(self) -> None:
        held, self._held = self._held, collections.Counter()
        if not held:
            self._report = None
            return
        level = logging.WARNING if held.keys() & {OVER_LIMIT, REFUSED} else logging.INFO
        total = sum(held.values())
        log.log(
            level,
            "closed %d more connection%s in the last %g s: %s",
            total,
            "" if total == 1 else "s",
            self.limits.report_seconds,
            ", ".join(
                f"{n} {_NOUNS[r].format(**dataclasses.asdict(self.limits))}"
                for r, n in sorted(held.items())
            ),
        )
        self._report = self._loop.call_later(self.limits.report_seconds, self._summary)

    def _why(self, reason: str) -> str:
        limits = self.limits
        if reason == IDLE:
            return (
                f"no request within {limits.idle_timeout} s of connecting (COALESCER_IDLE_TIMEOUT)"
            )
        if reason == SLOW_HEAD:
            return (
                f"request head not complete {limits.head_timeout:g} s after it began "
                "(COALESCER_HEAD_TIMEOUT)"
            )
        if reason == OVER_LIMIT:
            return (
                f"{limits.max_connections} connections open (COALESCER_MAX_CONNECTIONS): the one "
                "waiting longest for its client makes room for a new one"
            )
        return (
            f"{limits.max_connections} connections open (COALESCER_MAX_CONNECTIONS), each with "
            "a request in flight"
        )
