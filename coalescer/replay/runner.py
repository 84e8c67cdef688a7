"""Replaying one history under several configurations, side by side, through the real index.

Each configuration gets its own pool model and its own namespace of coalescing keys in one
store (``replay.<run>.<n>.<key>``), so the configurations replay concurrently and a real Redis
shared with other data is not disturbed; the namespace is deleted afterwards. The index sees
every event at the moment the model makes it happen (no ingest lag), through the service's own
scripts: on claim, ``apply.lua`` then ``snapshot.lua`` and :func:`coalescer.model.supersedes`,
as the service answers ``GET /<key>?taskId=``; under a policy, :meth:`Store.apply
<coalescer.store.Store.apply>` with the policy, whose ``decide.lua`` decides on arrival with each
key's own rule, and the enforcer's own code carries the decisions out on the pool
(:mod:`~coalescer.replay.enforcing`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections.abc import Callable, Sequence
from functools import lru_cache

from coalescer import model
from coalescer.errors import ConfigError, InvalidInput
from coalescer.policy import HoldBy, Policy, PrimaryFailure, Rule, Strategy, rules
from coalescer.replay.enforcing import PoolEnforcer
from coalescer.replay.history import History, TaskSpec
from coalescer.replay.pool import Outcome, Pool
from coalescer.store import Store
from coalescer.store.replay import apply_and_ask, drop, drop_census, holds_nothing
from coalescer.verdicts import DEFAULT_CONFIRM, DEFAULT_PARALLEL

#: The service's default cap on an answer's length.
CAP = 32


#: Superseding policy strategies a configuration may replay (decided on arrival).
POLICIES = ("latest-wins", "first-wins")


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """One way to run the pool: no superseding; the protocol on claim, with tc-coalesce's
    thresholds (supersede only when more than ``size`` tasks are pending and the oldest waited
    more than ``age`` seconds); a policy strategy deciding on arrival for every key, with the
    same thresholds; or a policy file (``rules``, named ``label``), each key with its own rule,
    as ``coalescer enforce`` reads it.

    ``on_failure`` is what a worker does with its secondaries when its primary fails
    (``--on-primary-failure``; ``None``: the default, ``supersede``), with ``bisect_confirm``
    for ``bisect``; for ``latest-wins``/``first-wins``, the rule's ``on-primary-failure`` and
    ``bisect-confirm`` (the enforcer's search)."""

    supersede: bool
    age: int | None = None
    size: int | None = None
    strategy: str = "on-claim"
    rules: Policy | None = None
    label: str = ""
    on_failure: PrimaryFailure | None = None
    bisect_confirm: int = DEFAULT_CONFIRM
    #: With ``bisect`` under a policy strategy: the enforcer's runs at once.
    bisect_parallel: int = DEFAULT_PARALLEL
    #: With ``release`` or ``bisect`` under a policy strategy: how the enforcer holds victims.
    hold_by: HoldBy = HoldBy.CLAIM

    @property
    def on_arrival(self) -> bool:
        """Whether any key decides on arrival."""
        return self.supersede and self.policy().decides

    @property
    def name(self) -> str:
        if not self.supersede:
            return "off"
        if self.rules is not None:
            return f"policy {self.label}"
        age = "" if self.age is None else f" age>{self.age}s"
        size = "" if self.size is None else f" size>{self.size}"
        failure = "" if self.on_failure is None else f", {self.on_failure}"
        if self.on_failure is PrimaryFailure.BISECT and self.bisect_confirm != DEFAULT_CONFIRM:
            failure += f" confirm {self.bisect_confirm}"
        if self.on_failure is PrimaryFailure.BISECT and self.bisect_parallel != DEFAULT_PARALLEL:
            failure += f" parallel {self.bisect_parallel}"
        if self.hold_by is not HoldBy.CLAIM:
            failure += f" hold-by {self.hold_by}"
        if self.strategy in POLICIES:
            return self.strategy + age + size + failure
        return "on-claim" + (age + size or " always") + failure

    @classmethod
    def parse(cls, text: str) -> Config:
        """``off``; ``on-claim``, ``latest-wins`` or ``first-wins``, each optionally followed
        by ``,age=S,size=N``; or ``age=S,size=N`` alone (on claim). Either threshold may be
        left out. Any but ``off`` may add ``,on-primary-failure=supersede|release|bisect``
        and, with ``bisect``, ``,bisect-confirm=N`` (the most reruns confirming a failure, 3 by
        default): the worker's search on claim, the enforcer's with ``latest-wins`` and
        ``first-wins``, whose ``release`` and ``bisect`` take ``,hold-by=claim|priority``."""
        parts = [p.strip() for p in text.split(",")]
        if parts == ["off"]:
            return cls(False)
        strategy = "on-claim"
        if parts[0] in ("on-claim", *POLICIES):
            strategy, parts = parts[0], parts[1:]
        found: dict[str, str] = {}
        for part in parts:
            m = re.fullmatch(
                r"(age|size|bisect-confirm|bisect-parallel)\s*=\s*(\d+)|(on-primary-failure)\s*=\s*"
                r"(supersede|release|bisect)|(hold-by)\s*=\s*(claim|priority)",
                part,
            )
            name = m and (m.group(1) or m.group(3) or m.group(5))
            if not m or not name or name in found:
                raise InvalidInput(
                    f"bad configuration {text!r}: use off, on-claim, latest-wins or first-wins, "
                    "optionally with age=SECONDS,size=N (e.g. age=3600,size=5) and "
                    "on-primary-failure=supersede|release|bisect (bisect-confirm=N, "
                    "bisect-parallel=N; hold-by=claim|priority)"
                )
            found[name] = m.group(2) or m.group(4) or m.group(6)
        failure = found.get("on-primary-failure")
        on_failure = None if failure is None else PrimaryFailure(failure)
        for name in ("bisect-confirm", "bisect-parallel"):
            if name in found and on_failure is not PrimaryFailure.BISECT:
                raise InvalidInput(f"bad configuration {text!r}: {name} needs bisect")
        hold_by = HoldBy(found.get("hold-by", "claim"))
        if "hold-by" in found and (
            strategy not in POLICIES
            or on_failure not in (PrimaryFailure.RELEASE, PrimaryFailure.BISECT)
        ):
            raise InvalidInput(
                f"bad configuration {text!r}: hold-by needs latest-wins or first-wins with "
                "on-primary-failure=release or bisect (the enforcer holds the victims)"
            )
        parallel = int(found.get("bisect-parallel", DEFAULT_PARALLEL))
        if not 1 <= parallel <= 32:
            raise InvalidInput(f"bad configuration {text!r}: bisect-parallel is 1 to 32")
        return cls(
            True,
            None if "age" not in found else int(found["age"]),
            None if "size" not in found else int(found["size"]),
            strategy,
            on_failure=on_failure,
            bisect_confirm=int(found.get("bisect-confirm", DEFAULT_CONFIRM)),
            bisect_parallel=parallel,
            hold_by=hold_by,
        )

    @classmethod
    def from_policy(cls, policy: Policy, label: str) -> Config:
        """A policy file's configuration: each key with its own rule (on-claim keys ask when
        claimed, without thresholds: those are the worker's, in its ``supersederUrl``)."""
        return cls(True, rules=policy, label=label)

    def policy(self) -> Policy:
        """The rules each key follows: the file's, or one rule for every key."""
        if self.rules is not None:
            return self.rules
        if not self.supersede:
            return rules.Policy()
        return _one_rule(
            self.strategy,
            self.age,
            self.size,
            self.on_failure,
            self.bisect_confirm,
            self.bisect_parallel,
            self.hold_by,
        )

    def rule_for(self, task: TaskSpec) -> Rule:
        """The rule a task follows: its first key's (the one its worker would ask about)."""
        return self.policy().rule_for(task.keys[0]) if task.keys else rules.ON_CLAIM


@lru_cache(maxsize=64)
def _one_rule(
    strategy: str,
    age: int | None,
    size: int | None,
    on_failure: PrimaryFailure | None = None,
    confirm: int = DEFAULT_CONFIRM,
    parallel: int = DEFAULT_PARALLEL,
    hold_by: HoldBy = HoldBy.CLAIM,
) -> Policy:
    rule: dict[str, object] = {"name": strategy, "keys": "**", "strategy": strategy}
    if strategy != Strategy.ON_CLAIM:  # on claim, the thresholds are the worker's question's
        rule |= {k: v for k, v in (("age", age), ("size", size)) if v is not None}
        if on_failure is not None:
            rule["on-primary-failure"] = str(on_failure)
        if on_failure is PrimaryFailure.BISECT:
            rule["bisect-confirm"] = confirm
            rule["bisect-parallel"] = parallel
        if hold_by is not HoldBy.CLAIM:
            rule["hold-by"] = str(hold_by)
    return rules.parse({"rules": [rule]}, "replay")


class StoreIndex:
    """The :class:`~coalescer.replay.pool.Index` of one configuration, on a real store."""

    def __init__(self, store: Store, namespace: str, config: Config) -> None:
        self.store = store
        self.namespace = namespace
        self.config = config
        self.buffer: list[model.TaskEvent] = []
        self.used: set[str] = set()

    def key(self, task: TaskSpec) -> tuple[str, ...]:
        return tuple(self.namespace + k for k in task.keys)

    def asks(self, task: TaskSpec) -> bool:
        return True

    def record(
        self, task: TaskSpec, run: int, state: str, at_ms: int, since_ms: int, reason: str
    ) -> None:
        if state not in ("pending", "running") and not self.config.on_arrival:
            return  # a resolution changes no answer: the task left the pending set when claimed
        keys = self.key(task)
        self.buffer.append(
            model.TaskEvent(
                task_id=task.task_id,
                run_id=run,
                state=state,
                keys=keys,
                order=task.order,
                deadline_ms=task.deadline_ms,
                pending_since_ms=since_ms,
                reason=reason,
                started_ms=at_ms if state == "running" else 0,
                resolved_ms=at_ms if state not in ("pending", "running") else 0,
            )
        )
        self.used.update(keys)

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

    async def enforce(self, pool: Pool, now_ms: int) -> None:
        """Nothing is decided on arrival on claim."""

    async def forget(self) -> None:
        await drop(self.store, sorted(self.used))


class PolicyIndex(StoreIndex):
    """A policy configuration: every event goes through :meth:`Store.apply` with the policy,
    so ``decide.lua`` decides with each key's rule as the service does; the decisions, read
    from the keys' outboxes, are carried out at once by the enforcer's own code on the pool
    (:class:`~coalescer.replay.enforcing.PoolEnforcer`), as an enforcer without lag would.
    Workers ask on claim only for tasks whose key's rule is ``on-claim``."""

    def __init__(self, store: Store, namespace: str, config: Config) -> None:
        super().__init__(store, namespace, config)
        self.policy = _Namespaced(config.policy(), namespace)
        self.enforcer = PoolEnforcer(store, namespace, config.policy())

    def asks(self, task: TaskSpec) -> bool:
        return not self.config.rule_for(task).decides

    async def _flush(self, now_ms: int) -> set[str]:
        events, self.buffer = self.buffer, []
        if events:
            await self.store.apply(events, now_ms=now_ms, policy=self.policy)
        return {k for ev in events for k in ev.keys}

    async def ask(self, task: TaskSpec, now_ms: int) -> list[str]:
        # Events on deciding keys must reach decide.lua (its running set), not apply.lua alone.
        await self._flush(now_ms)
        return await super().ask(task, now_ms)

    async def enforce(self, pool: Pool, now_ms: int) -> None:
        # Carrying out decisions makes events (superseded, held, released and pending again),
        # which may be decided on in turn: until nothing is left at this instant.
        while await self.enforcer.round(pool, now_ms, await self._flush(now_ms)):
            pass


class _Namespaced:
    """A policy for namespaced keys: each key gets the rule of its name without the prefix."""

    def __init__(self, policy: Policy, namespace: str) -> None:
        self.inner, self.namespace = policy, namespace

    def script_args(self, key: str) -> list[str | int] | None:
        return self.inner.script_args(key.removeprefix(self.namespace))


async def replay(
    history: History,
    configs: Sequence[Config],
    store: Store,
    *,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Replay ``history`` once per configuration, concurrently; outcomes in ``configs`` order.

    A policy needs the embedded store or an empty database: its decisions go through the
    outbox that a live ``coalescer enforce`` would carry out on the real queue.
    """
    scratch = any(c.on_arrival for c in configs) and not store.embedded
    if scratch:
        if not await holds_nothing(store):
            raise ConfigError(
                "policy replays write decisions to the outbox that a live enforcer carries "
                "out: replay them on the embedded store or on an empty Redis database"
            )
    run = uuid.uuid4().hex[:8]

    async def one(n: int, config: Config) -> Outcome:
        index: StoreIndex | None = None
        if config.supersede:
            kind = PolicyIndex if config.on_arrival else StoreIndex
            index = kind(store, f"replay.{run}.{n}.", config)
        try:
            return await Pool(
                history,
                index,
                seed=seed,
                progress=progress,
                on_failure=config.on_failure or PrimaryFailure.SUPERSEDE,
                bisect_confirm=config.bisect_confirm,
            ).run()
        finally:
            if index is not None:
                await index.forget()

    try:
        return list(await asyncio.gather(*(one(n, c) for n, c in enumerate(configs))))
    finally:
        if scratch:
            # The policy's writes counted the index's size as the service's ingest does; on
            # the scratch database that count is the replay's alone.
            await drop_census(store)
