"""A running emulator: options, clock, state and publisher, and what ties them together.

Every state change goes through :meth:`Emulator.apply`, which first applies whatever became due
(claim expiry, deadlines, task expiry: the lazy check on every request), then the operation, then
hands the resulting messages to the publisher and wakes long-polling claimWork calls. The
periodic :meth:`Emulator.tick` does the same due-check when no requests come, and is the
dependency resolver that schedules dependents and publishes ``task-group-resolved`` after
resolutions (within ``tick_interval``, as the real queue's does within seconds). It all runs on one
event loop, so no locks are needed around the state.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, MutableSequence
from datetime import datetime, timedelta
from typing import Any

from coalescer.emulator.clock import Clock
from coalescer.emulator.messages import Message
from coalescer.emulator.publisher import AmqpSink, HttpSink, Publisher, Sink
from coalescer.emulator.state import Outcome, QueueState, Timing


@dataclasses.dataclass(frozen=True)
class EmulatorOptions:
    """How an emulator behaves. The defaults are the real queue's where it has one."""

    #: accept ``reason: "superseded"`` (validate reportException with the v39 schema), as
    #: Taskcluster did before v40; a current queue answers 400
    legacy: bool = False
    #: the longest a claimWork call waits for work, in seconds
    claim_work_timeout: float = 20.0
    #: seconds from a claim or reclaim to its takenUntil
    claim_timeout: float = 1200.0
    #: seconds temporary credentials stay valid after their takenUntil
    credential_grace: float = 60.0
    #: seconds after reportException during which artifacts may still be created
    artifact_grace: float = 1200.0
    #: seconds after its deadline at which an unresolved task is resolved deadline-exceeded
    #: (the real queue's ``deadlineDelay``)
    deadline_delay: float = 60.0
    #: seconds between background passes: expired claims, deadlines and tasks, then the
    #: dependency resolver (dependents scheduled, ``task-group-resolved``)
    tick_interval: float = 1.0
    #: serve ``POST /emulator/v1/clock`` so that HTTP clients can move time forward
    controllable_clock: bool = False
    #: AMQP URL to publish Pulse messages to (exchanges ``exchange/taskcluster-queue/v1/*``)
    pulse_url: str | None = None
    #: a coalescer's ``POST /v1/events`` URL to send the messages to
    publish_to: str | None = None
    #: bearer token for ``publish_to`` (COALESCER_INGEST_TOKEN)
    ingest_token: str | None = dataclasses.field(default=None, repr=False)
    #: how many published messages to keep for ``GET /emulator/v1/messages`` (None: all)
    keep_published: int | None = 10_000

    def timing(self) -> Timing:
        return Timing(
            claim_timeout=timedelta(seconds=self.claim_timeout),
            credential_grace=timedelta(seconds=self.credential_grace),
            artifact_grace=timedelta(seconds=self.artifact_grace),
            deadline_delay=timedelta(seconds=self.deadline_delay),
        )

    def sinks(self) -> list[Sink]:
        sinks: list[Sink] = []
        if self.pulse_url:
            sinks.append(AmqpSink(self.pulse_url))
        if self.publish_to:
            sinks.append(HttpSink(self.publish_to, self.ingest_token))
        return sinks


class Emulator:
    """One emulated queue. Build it, then serve it with :func:`coalescer.emulator.server.create_app`."""

    def __init__(
        self,
        options: EmulatorOptions | None = None,
        *,
        clock: Clock | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.options = options or EmulatorOptions()
        self.clock = clock or Clock()
        self.state = QueueState(self.options.timing())
        if publisher is None:
            keep = self.options.keep_published
            record: MutableSequence[dict[str, Any]] = (
                [] if keep is None else collections.deque(maxlen=keep)
            )
            publisher = Publisher(self.options.sinks(), published=record)
        self.publisher = publisher
        #: the event loop serving this emulator, once its app has started (see ``harness``)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._work = asyncio.Event()

    def apply(self, operation: Callable[[datetime], Outcome]) -> Any:
        """Run ``operation(now)`` after whatever became due; publish what both produced."""
        now = self.clock.now()
        self._emit(self.state.expire(now))
        try:
            body, messages = operation(now)
        finally:
            self.state.changed()
        self._emit(messages)
        return body

    def read(self, query: Callable[[], Any]) -> Any:
        """Answer ``query()`` after whatever became due; it must not change the state."""
        self._emit(self.state.expire(self.clock.now()))
        return query()

    def tick(self) -> None:
        """The queue's background work: apply what became due by now (claim expiry, deadlines,
        task expiry), then let the dependency resolver schedule the dependents of the tasks
        resolved since, and publish ``task-group-resolved``."""
        now = self.clock.now()
        self._emit(self.state.expire(now))
        self._emit(self.state.resolve_dependencies(now))

    def advance(self, seconds: float) -> datetime:
        """Move the clock forward and run the background work (:meth:`tick`); returns the new
        time."""
        now = self.clock.advance(seconds)
        self.tick()
        return now

    def work_signal(self) -> asyncio.Event:
        """An event set the next time some task becomes pending (for long-polling claimWork)."""
        return self._work

    def _emit(self, messages: list[Message]) -> None:
        if not messages:
            return
        self.publisher.publish(messages)
        if any(message.kind == "task-pending" for message in messages):
            # Wake every waiter, and give later waiters a fresh event to wait on.
            self._work.set()
            self._work = asyncio.Event()

    async def run_ticker(self) -> None:
        """Call :meth:`tick` every ``tick_interval`` seconds, forever."""
        while True:
            await asyncio.sleep(self.options.tick_interval)
            self.tick()
