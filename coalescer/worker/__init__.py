"""The worker shim: claim all, run the newest, resolve the rest — and a reference worker.

* :mod:`~coalescer.worker.protocol` — the pure decisions and the options.
* :mod:`~coalescer.worker.superseder` — asking a superseder.
* :mod:`~coalescer.worker.claims` — claiming, reclaiming, each claim's newest credentials.
* :mod:`~coalescer.worker.resolve` — artifacts and resolutions.
* :mod:`~coalescer.worker.shim` — :class:`Shim`, tying them together.
* :mod:`~coalescer.worker.runner` — the reference worker running command payloads.
* :mod:`~coalescer.worker.livelog` — the reference worker's task logs, served live over HTTP.
"""

from __future__ import annotations

from coalescer.worker.claims import Claim
from coalescer.worker.protocol import (
    COMPLETED,
    FAILED,
    OnPrimaryFailure,
    Options,
    Order,
    Outcome,
    Resolution,
    SupersedeAs,
    SupersederError,
)
from coalescer.worker.shim import Report, Shim, Superseded, TaskSet

__all__ = [
    "COMPLETED",
    "FAILED",
    "Claim",
    "OnPrimaryFailure",
    "Options",
    "Order",
    "Outcome",
    "Report",
    "Resolution",
    "Shim",
    "SupersedeAs",
    "Superseded",
    "SupersederError",
    "TaskSet",
]
