"""coalescer: a superseder service for Taskcluster-style task queues, and its worker shim."""

from __future__ import annotations

__version__ = "0.1.0"
