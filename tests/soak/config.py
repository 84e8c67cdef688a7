"""A soak's settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Config:
    duration: float
    store: str
    report_dir: Path
    seed: int
    amqp_url: str
    rate: float = 4.0  # pushes a second
    burst: int = 40  # tasks pushed at once, every burst_every seconds
    burst_every: float = 15.0
    settle: float = 90.0  # longest wait for the queue to have nothing pending or running
    only: tuple[str, ...] = ()  # draw only these kinds of fault (all when empty)
    min_faults: int = 5  # faults go on past the duration until this many were injected
