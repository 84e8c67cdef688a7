"""Emulator time: the system clock plus an offset that tests can move forward.

Every decision in :mod:`coalescer.emulator.state` takes ``now`` from here, so a test can jump
past a ``takenUntil`` or a ``deadline`` without sleeping. Times are kept at millisecond
precision, as the real queue (JavaScript ``Date``) does, so that a time written to JSON and read
back compares equal.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta


def truncate(when: datetime) -> datetime:
    """``when`` in UTC, cut to whole milliseconds."""
    when = when.astimezone(UTC)
    return when.replace(microsecond=when.microsecond // 1000 * 1000)


def format_time(when: datetime) -> str:
    """``2030-01-01T00:00:00.000Z``, the shape of JavaScript's ``Date.toJSON()``."""
    when = truncate(when)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 date-time (as the schemas' ``format: date-time`` allows)."""
    when = datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return truncate(when)


class Clock:
    """A clock that can be advanced (and optionally frozen) by tests.

    By default it follows the system clock, shifted by everything :meth:`advance` added, so an
    emulator left alone behaves like a real queue. ``frozen=True`` stops it between advances,
    which makes recorded timestamps exact. Safe to call from several threads.
    """

    def __init__(self, start: datetime | None = None, *, frozen: bool = False) -> None:
        self._lock = threading.Lock()
        self._frozen = frozen
        real = datetime.now(UTC)
        # The offset is what ``start`` asked for; a frozen clock counts from ``start`` only.
        self._offset = (start - real) if start is not None else timedelta(0)
        self._base = truncate(start or real)

    def now(self) -> datetime:
        """The current emulator time (UTC, millisecond precision)."""
        with self._lock:
            if self._frozen:
                return self._base
            return truncate(datetime.now(UTC) + self._offset)

    def advance(self, seconds: float) -> datetime:
        """Move time forward by ``seconds`` (never backwards: claims and deadlines only move on)."""
        if seconds < 0:
            raise ValueError("the emulator clock only moves forward")
        with self._lock:
            self._offset += timedelta(seconds=seconds)
            self._base = truncate(self._base + timedelta(seconds=seconds))
        return self.now()
