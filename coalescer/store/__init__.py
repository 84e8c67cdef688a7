"""The only package that talks to Redis: key names, Lua scripts, and the store's domain actions."""

from __future__ import annotations

from coalescer.store.redis import IndexState, Outcome, Store, open_store
from coalescer.store.views import TaskRecord

__all__ = ["IndexState", "Outcome", "Store", "TaskRecord", "open_store"]
