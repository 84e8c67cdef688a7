"""Replaying one history under several configurations, side by side, through the real index.

Each configuration gets its own pool model and its own namespace of coalescing keys in one
store (``replay.<run>.<n>.<key>``), so the configurations replay concurrently and a real Redis
shared with other data is not disturbed; the namespace is forgotten afterwards. The index sees
every event at the moment the model makes it happen (no ingest lag), through
:meth:`Store.apply <coalescer.store.Store.apply>`; a worker's question is answered by
:meth:`Store.snapshot <coalescer.store.Store.snapshot>` and :func:`coalescer.model.supersedes`,
as the service answers ``GET /<key>?taskId=``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Callable, Sequence

from coalescer import model
from coalescer.errors import InvalidInput
from coalescer.replay.history import History, TaskSpec
from coalescer.replay.pool import Outcome, Pool
from coalescer.store import Store
from coalescer.store.replay import apply_and_ask

#: The service's default cap on an answer's length.
CAP = 32


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One way to run the pool: no superseding, or the protocol with tc-coalesce's thresholds
    (supersede only when more than ``size`` tasks are pending and the oldest waited more than
    ``age`` seconds)."""

    supersede: bool
    age: int | None = None
    size: int | None = None

    @property
    def name(self) -> str:
        if not self.supersede:
            return "off"
        age = "" if self.age is None else f" age>{self.age}s"
        size = "" if self.size is None else f" size>{self.size}"
        return "on-claim" + (age + size or " always")

    @classmethod
    def parse(cls, text: str) -> Config:
        """``off``, ``on-claim`` (no thresholds) or ``age=S,size=N`` (either may be left out)."""
        text = text.strip()
        if text == "off":
            return cls(False)
        if text in ("on-claim", "always"):
            return cls(True)
        found: dict[str, int] = {}
        for part in text.split(","):
            m = re.fullmatch(r"\s*(age|size)\s*=\s*(\d+)\s*", part)
            if not m or m.group(1) in found:
                raise InvalidInput(
                    f"bad configuration {text!r}: use off, on-claim, or age=SECONDS,size=N "
                    "(e.g. age=3600,size=5)"
                )
            found[m.group(1)] = int(m.group(2))
        return cls(True, found.get("age"), found.get("size"))


class StoreIndex:
    """The :class:`~coalescer.replay.pool.Index` of one configuration, on a real store."""

    def __init__(self, store: Store, namespace: str, config: Config) -> None:
        self.store = store
        self.namespace = namespace
        self.config = config
        self.buffer: list[model.TaskEvent] = []
        self.used: dict[str, set[str]] = {}

    def key(self, task: TaskSpec) -> tuple[str, ...]:
        return tuple(self.namespace + k for k in task.keys)

    def record(self, task: TaskSpec, state: str, at_ms: int, since_ms: int, reason: str) -> None:
        if state not in ("pending", "running"):
            return  # a resolution changes no answer: the task left the pending set when claimed
        keys = self.key(task)
        self.buffer.append(
            model.TaskEvent(
                task_id=task.task_id,
                run_id=0,
                state=state,
                keys=keys,
                order=task.order,
                deadline_ms=task.deadline_ms,
                pending_since_ms=since_ms,
                reason=reason,
                started_ms=at_ms if state == "running" else 0,
            )
        )
        for k in keys:
            self.used.setdefault(k, set()).add(task.task_id)

    async def ask(self, task: TaskSpec, now_ms: int) -> list[str]:
        events, self.buffer = self.buffer, []
        key = self.key(task)[0]
        snap = await apply_and_ask(self.store, events, key, task.task_id, now_ms=now_ms, cap=CAP)
        answer, _ = model.supersedes(
            task.task_id,
            snap,
            now_ms=now_ms,
            age=self.config.age,
            size=self.config.size,
            cap=CAP,
        )
        return answer

    async def forget(self) -> None:
        for key, ids in self.used.items():
            await self.store.forget(key, sorted(ids))
            await self.store.forget_key(key)


async def replay(
    history: History,
    configs: Sequence[Config],
    store: Store,
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Replay ``history`` once per configuration, concurrently; outcomes in ``configs`` order."""
    run = uuid.uuid4().hex[:8]

    async def one(n: int, config: Config) -> Outcome:
        index = StoreIndex(store, f"replay.{run}.{n}.", config) if config.supersede else None
        try:
            return await Pool(history, index, seed=seed, progress=progress).run()
        finally:
            if index is not None:
                await index.forget()

    return list(await asyncio.gather(*(one(n, c) for n, c in enumerate(configs))))
