"""The only package that talks to Redis: key names, Lua scripts, and the store's domain actions."""

from __future__ import annotations

from coalescer.store.redis import Outcome, Store, open_store
from coalescer.store.views import TaskRecord

__all__ = ["Outcome", "Store", "TaskRecord", "open_store"]
