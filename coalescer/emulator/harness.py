"""Run an emulator on a loopback port in a background thread, and drive it from a test.

:class:`QueueEmulator` is what the ``queue_emulator`` pytest fixture yields; it can also be used
directly as a context manager::

    with QueueEmulator() as emulator:
        queue = emulator.queue()
        task_id = emulator.create_task()
        ...
        emulator.clock.advance(1200)  # past takenUntil: the claim expires now
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine, MutableSequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, TypeVar

import uvicorn

from coalescer.emulator.clock import Clock, format_time
from coalescer.emulator.messages import select
from coalescer.emulator.runtime import Emulator, EmulatorOptions
from coalescer.emulator.server import KEEP_ALIVE_SECONDS, create_app

T = TypeVar("T")

#: Options for tests: short long-polls, frequent expiry checks, an HTTP-controllable clock.
TEST_OPTIONS = EmulatorOptions(
    claim_work_timeout=1.0, tick_interval=0.05, controllable_clock=True, keep_published=None
)


class ClockControl:
    """The emulator's clock, as seen from the test's thread."""

    def __init__(self, harness: QueueEmulator) -> None:
        self._harness = harness

    def now(self) -> datetime:
        return self._harness.emulator.clock.now()

    def advance(self, seconds: float) -> datetime:
        """Move time forward and run the queue's background work (what became due, then the
        dependency resolver: dependents scheduled, ``task-group-resolved``) before returning (on
        the server loop, so the resulting messages are already in ``published``);
        ``advance(0)`` just runs it now."""
        emulator = self._harness.emulator
        return self._harness.call(lambda: emulator.advance(seconds))


class QueueEmulator:
    """An emulator served by uvicorn from a background thread (see module docstring)."""

    def __init__(
        self, options: EmulatorOptions | None = None, *, clock: Clock | None = None
    ) -> None:
        self.emulator = Emulator(options or TEST_OPTIONS, clock=clock)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        #: what the taskcluster client takes as ``rootUrl``
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.clock = ClockControl(self)
        config = uvicorn.Config(
            create_app(self.emulator),
            log_level="warning",
            access_log=False,
            lifespan="on",
            ws="none",  # no websockets: their legacy module warns on import
            http="h11",
            loop="asyncio",
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="queue-emulator", daemon=True)
        self._error: BaseException | None = None

    @property
    def published(self) -> MutableSequence[dict[str, Any]]:
        """Every Pulse message emitted so far, oldest first (``{exchange, routingKey, CC,
        payload}``)."""
        return self.emulator.publisher.published

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start() or stop() in the test's thread
            self._error = exc

    def start(self, timeout: float = 10.0) -> QueueEmulator:
        self._thread.start()
        give_up = time.monotonic() + timeout
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the queue emulator did not start: {self._error!r}")
            if time.monotonic() > give_up:
                raise RuntimeError("the queue emulator did not start in time")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> QueueEmulator:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the server's event loop (where the state lives) and return its result."""

        async def run() -> T:
            return fn()

        return self.run(run(), timeout)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run ``coroutine`` on the server's event loop and wait for its result."""
        loop = self.emulator.loop
        if loop is None:
            coroutine.close()
            raise RuntimeError("the queue emulator is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    # -- helpers for tests -----------------------------------------------------------------------

    def queue(self, credentials: dict[str, str] | None = None, **options: Any) -> Any:
        """A synchronous ``taskcluster.Queue`` for this emulator (no retries: errors surface)."""
        import taskcluster

        return taskcluster.Queue(self.client_options(credentials, **options))

    def aio_queue(
        self, credentials: dict[str, str] | None = None, *, session: Any = None, **options: Any
    ) -> Any:
        """A ``taskcluster.aio.Queue`` for this emulator (no retries: errors surface)."""
        import taskcluster.aio

        return taskcluster.aio.Queue(self.client_options(credentials, **options), session=session)

    def client_options(
        self, credentials: dict[str, str] | None = None, **options: Any
    ) -> dict[str, Any]:
        """Options for any taskcluster client class: ``rootUrl``, ``maxRetries=0``, credentials."""
        out: dict[str, Any] = {"rootUrl": self.root_url, "maxRetries": 0}
        out["credentials"] = credentials or {"clientId": "tester", "accessToken": "no-secret"}
        return out | options

    def task_definition(self, **overrides: Any) -> dict[str, Any]:
        """A valid createTask body, timed by the emulator's clock; ``overrides`` replace keys."""
        now = self.clock.now()
        definition: dict[str, Any] = {
            "taskQueueId": "emulator-test/worker",
            "created": format_time(now),
            "deadline": format_time(now + timedelta(hours=1)),
            "payload": {},
            "metadata": {
                "name": "an emulator test task",
                "description": "made by coalescer.emulator.harness",
                "owner": "tester@example.com",
                "source": "https://example.com/coalescer",
            },
        }
        definition.update(overrides)
        return definition

    def create_task(self, task_id: str | None = None, **overrides: Any) -> str:
        """Create a task through the API; returns its taskId."""
        import taskcluster

        task_id = task_id or taskcluster.slugid.nice()
        self.queue().createTask(task_id, self.task_definition(**overrides))
        return task_id

    def messages(self, kind: str | None = None, task_id: str | None = None) -> list[dict[str, Any]]:
        """Published messages, filtered by exchange short name (``task-pending``) and taskId
        (which leaves out a task group's messages: they name no task)."""
        return select(self.published, kind, task_id)

    def wait_for_message(
        self, kind: str, task_id: str | None = None, *, timeout: float = 5.0
    ) -> dict[str, Any]:
        """The first message matching, polling until ``timeout`` seconds have passed."""
        give_up = time.monotonic() + timeout
        while not (found := self.messages(kind, task_id)):
            if time.monotonic() > give_up:
                raise TimeoutError(f"no {kind} message for {task_id or 'any task'} in {timeout}s")
            time.sleep(0.01)
        return found[0]
