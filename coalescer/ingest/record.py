"""Recording applied events for ``coalescer replay --events``: one Pulse-shaped message
(``{exchange, routingKey, CC, payload}``, as ``POST /v1/events`` takes) per JSON line.

Bounded: once the file reaches ``max_bytes`` it is renamed ``FILE.1`` (replacing the previous
one) and a new ``FILE`` begins, so at most two files of about ``max_bytes`` each exist.
Recording never holds or fails ingestion: lines are written by one background thread, in the
order they were given; a write that fails, or a batch that finds too many batches still
waiting, is logged and counted (``coalescer_record_failures``), and ingestion goes on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Iterable

import orjson
from prometheus_client import Counter

from coalescer.ingest.events import Message
from coalescer.logs import Throttled

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 << 20
#: Batches waiting to be written at most; beyond that a batch is dropped, not waited for.
MAX_BACKLOG = 1000

FAILURES = Counter(
    "coalescer_record_failures",
    "Events that could not be recorded (a failed write, or the writer too far behind)",
)


def to_json(message: Message) -> dict[str, object]:
    """The message as ``POST /v1/events`` and ``coalescer replay --events`` read it."""
    return {
        "exchange": message.exchange,
        "routingKey": message.routing_key,
        "CC": list(message.routes),
        "payload": message.payload,
    }


class Recorder:
    """Appends messages to ``path`` as JSON lines, rotating once at ``max_bytes``."""

    def __init__(self, path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.path = path
        self.max_bytes = max_bytes
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="record")
        self._backlog = 0
        self._lock = threading.Lock()
        self._file: int | None = None
        self._size = 0
        self._behind_log = Throttled(log)  # the caller's thread
        self._failed_log = Throttled(log)  # the writer's

    def record(self, messages: Iterable[Message]) -> None:
        """Queue ``messages`` for writing and return at once."""
        data = b"".join(orjson.dumps(to_json(m)) + b"\n" for m in messages)
        count = data.count(b"\n")
        if not count:
            return
        with self._lock:
            if self._backlog >= MAX_BACKLOG:
                FAILURES.inc(count)
                self._behind_log.log(
                    logging.WARNING, "recorder too far behind: %d events dropped", count
                )
                return
            self._backlog += 1
        self._writer.submit(self._write, data, count)

    def close(self) -> None:
        """Write what is queued, then close the file."""
        self._writer.shutdown(wait=True)
        if self._file is not None:
            os.close(self._file)
            self._file = None

    # -- the writer thread --------------------------------------------------------------------
    def _write(self, data: bytes, count: int) -> None:
        try:
            if self._file is None:
                self._open()
            if self._size and self._size + len(data) > self.max_bytes:
                self._rotate()
            assert self._file is not None
            view = memoryview(data)
            while view:
                view = view[os.write(self._file, view) :]
            self._size += len(data)
        except OSError as exc:
            FAILURES.inc(count)
            self._failed_log.log(
                logging.ERROR, "could not record %d events in %s: %s", count, self.path, exc
            )
            self._drop_file()  # the next write opens the file afresh
        finally:
            with self._lock:
                self._backlog -= 1

    def _open(self) -> None:
        self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._file).st_size

    def _rotate(self) -> None:
        self._drop_file()
        os.replace(self.path, self.path + ".1")
        self._open()

    def _drop_file(self) -> None:
        if self._file is not None:
            try:
                os.close(self._file)
            finally:
                self._file = None
