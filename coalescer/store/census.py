"""The index's limits (``COALESCER_MAX_KEYS``, ``COALESCER_MAX_TASKS``) and what a process knows
of how close the index is to them.

The limits are held where events are applied, without a round trip of their own: every ingest
batch's ``list.lua`` call (in the slot of ``co:keys``) answers how many keys the index lists and
how many tasks it tracks, and this process's next batch decides from those figures which of its
keys may be new (``apply.lua``'s ``admit`` argument). ``apply.lua`` then refuses, atomically,
only what would grow the index: a task new to a key refused a new task, or any task of a key
that holds nothing and was refused a new key. What the index holds keeps updating.

Tracked tasks are counted by the upkeep round (``{co:keys}:census`` ``tracked``) plus what
ingest added since (``added``, which every batch adds to in the next batch's ``list.lua``
call); a round resets ``added``. Batches in flight at once share the room left between them,
so the limits hold within the batches other processes have in flight at the same moment.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The index's limits: keys listed, and tasks tracked (a task once per key it is under)."""

    keys: int
    tasks: int


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """What one batch may add within the limits, reserved until :meth:`Census.release`."""

    #: How many of the batch's keys may be new: its first ones.
    keys: int
    #: How many tasks new to their key the batch may add, and of those, each ``apply.lua``
    #: call's share (the first calls' first).
    tasks: int
    per_call: tuple[int, ...]
    #: Tasks added and events refused before, that this batch counts in the store.
    unsent: tuple[int, int]


@dataclasses.dataclass(slots=True)
class Census:
    """What this process knows of the index's size, and what it refused (for the metrics, the
    log and the heartbeat)."""

    #: Keys listed and tasks tracked as the last batch (or :meth:`seen`) found them; ``None``
    #: until then.
    keys: int | None = None
    tasks: int | None = None
    #: Keys and tasks that batches in flight may add (reserved when sent, released on the
    #: reply).
    reserved: int = 0
    reserved_tasks: int = 0
    #: Tasks this process added, and events it refused, that the store has not counted yet.
    unsent: int = 0
    unsent_refused: int = 0
    #: Events refused under a key, since start: for a new key, for a new task.
    refused_keys: int = 0
    refused_tasks: int = 0
    #: When the last refusal happened (``time.time()``), 0 if never.
    refused_at: float = 0.0
    #: The limits the last batch was held to.
    limits: Limits | None = None

    def admitted(self, count: int, limits: Limits | None) -> int:
        """How many of a batch's ``count`` keys may be new (the first ones), reserved until
        :meth:`settle`."""
        if limits is None:
            return count
        self.limits = limits
        if self.keys is None:
            room = count  # not known yet: this batch's reply says
        else:
            room = max(0, min(count, limits.keys - self.keys - self.reserved))
        self.reserved += room
        return room

    def tasks_admitted(self, count: int, limits: Limits | None) -> int:
        """How many tasks new to their key a batch of ``count`` (event, key) pairs may add,
        reserved until :meth:`settle`."""
        if limits is None:
            return count
        self.limits = limits
        if self.tasks is None:
            room = count
        else:
            room = max(0, min(count, limits.tasks - self.tasks - self.reserved_tasks))
        self.reserved_tasks += room
        return room

    def reserve(self, keys: int, calls: Sequence[int], limits: Limits | None) -> Reservation:
        """Reserve room for a batch of ``keys`` keys whose events go in ``apply.lua`` calls of
        ``calls`` events each: the first keys may be new, as many as there is room for (none
        when no task may be added: a new key holds one), and each call may add as many new
        tasks as it has events, while the room for tasks lasts."""
        budget = self.tasks_admitted(sum(calls), limits)
        room = self.admitted(keys, limits) if budget else 0
        per_call = []
        left = budget
        for size in calls:
            per_call.append(min(size, left))
            left -= per_call[-1]
        return Reservation(room, budget, tuple(per_call), self.take_unsent())

    def release(self, held: Reservation, listed: tuple[int, int] | None, added: int) -> None:
        """A batch's reply, or its failure (``listed`` ``None``, nothing ``added``):
        :meth:`settle` for ``held``. What the batch was to count in the store is counted with
        the next one unless its ``list.lua`` call ran."""
        unsent = None if listed is not None else held.unsent
        self.settle(held.keys, held.tasks, listed, added, unsent=unsent)

    def take_unsent(self) -> tuple[int, int]:
        """The tasks added and events refused to count in the store with the next batch."""
        out = (self.unsent, self.unsent_refused)
        self.unsent = self.unsent_refused = 0
        return out

    def settle(
        self,
        reserved: int,
        reserved_tasks: int,
        listed: tuple[int, int] | None,
        added: int,
        *,
        unsent: tuple[int, int] | None = None,
    ) -> None:
        """A batch's reply: ``reserved`` keys and ``reserved_tasks`` released, ``listed`` (keys, tasks) as
        ``list.lua`` counted them (``None``: not called), ``added`` tasks new to their key;
        ``unsent``: what the batch was to count and did not (counted with the next)."""
        self.reserved = max(0, self.reserved - reserved)
        self.reserved_tasks = max(0, self.reserved_tasks - reserved_tasks)
        if listed is not None:
            self.keys, self.tasks = listed
        if unsent is not None:
            self.unsent += unsent[0]
            self.unsent_refused += unsent[1]
        self.unsent += added
        if self.tasks is not None:
            self.tasks += added

    def refused(self, keys: int, tasks: int) -> None:
        if keys or tasks:
            self.refused_keys += keys
            self.refused_tasks += tasks
            self.unsent_refused += keys + tasks
            self.refused_at = time.time()

    def seen(self, keys: int, tasks: int, limits: Limits | None) -> None:
        """Figures read outside a batch (the store's watch), and the limits ingest was held to
        (this process's own when it ingests)."""
        self.keys, self.tasks = keys, tasks
        if limits is not None and self.limits is None:
            self.limits = limits

    def reached(self) -> list[str]:
        """The limits the index is at, as last seen (``keys``, ``tasks``)."""
        if self.limits is None:
            return []
        out = []
        if self.keys is not None and self.keys >= self.limits.keys:
            out.append("keys")
        if self.tasks is not None and self.tasks >= self.limits.tasks:
            out.append("tasks")
        return out
