"""A Pulse backlog for the ingest benchmarks: real-shaped messages (pending, running and
completed for n/3 tasks over 100 coalescing keys), published to the queue's exchanges with
aio-pika, 500 at a time."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aio_pika
import orjson
import taskcluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's message builders

from tests.conftest import make_message
from tests.integration.test_pulse import primary_key

Message = dict[str, Any]


def messages(prefix: str, n: int) -> list[Message]:
    """``n`` messages routed under ``prefix.key0`` .. ``prefix.key99``."""
    out = []
    for i in range(n // 3 + 1):
        task = taskcluster.slugid.nice()
        for state in ("pending", "running", "completed"):
            out.append(make_message(task, state, routes=(f"{prefix}.key{i % 100}",)))
    return out[:n]


async def publish(
    exchange_for: Callable[[Message], aio_pika.abc.AbstractExchange], backlog: list[Message]
) -> float:
    """Publish ``backlog``, each message to ``exchange_for(message)``; the seconds it took."""
    started = time.monotonic()
    for start in range(0, len(backlog), 500):
        await asyncio.gather(
            *(
                exchange_for(m).publish(
                    aio_pika.Message(
                        orjson.dumps(m["payload"]),
                        headers={"CC": m["CC"]},
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    ),
                    routing_key=primary_key(m),
                )
                for m in backlog[start : start + 500]
            )
        )
    return time.monotonic() - started
