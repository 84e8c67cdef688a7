"""Superseding policies per key: decide on arrival, enforce on the queue, keep the lineage.

* :mod:`~coalescer.policy.rules` — the policy file, parsed and validated (pure).
* :mod:`~coalescer.policy.actions` — carrying out one decision on the queue, idempotently.
* :mod:`~coalescer.policy.enforcer` — ``coalescer enforce``: the outbox consumer.
* :mod:`~coalescer.policy.bisecting` — ``on-primary-failure: bisect``: the enforcer's search.
* :mod:`~coalescer.policy.record` — a search's record, and what it says (pure).
* :mod:`~coalescer.policy.embedded` — the enforcer inside ``coalescer serve`` (embedded store).
* :mod:`~coalescer.policy.lineage` — what superseded a task, what it superseded, chains.
* :mod:`~coalescer.policy.cli` — ``coalescer enforce`` and ``coalescer policy check``.

The decisions themselves are taken in Redis, atomically with the event they follow
(``coalescer/store/scripts/decide.lua``); see ``docs/reference/policy-file.md``.
"""

from __future__ import annotations

from coalescer.policy.rules import Cascade, HoldBy, Policy, PrimaryFailure, Rule, Strategy, load

__all__ = ["Cascade", "HoldBy", "Policy", "PrimaryFailure", "Rule", "Strategy", "load"]
