"""The loop the end-to-end test needs: a queue emulator that accepts ``superseded`` (as
docker-worker's queue did), and the service on a free port, on the test's event loop (where the
store is)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn

from coalescer.emulator.harness import TEST_OPTIONS
from coalescer.emulator.runtime import EmulatorOptions
from coalescer.settings import Settings
from coalescer.store import Store
from coalescer.web.app import create_app


@pytest.fixture
def queue_emulator_options() -> EmulatorOptions:
    return dataclasses.replace(TEST_OPTIONS, legacy=True)


@pytest.fixture
async def service(settings: Settings, store: Store) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        create_app(settings, store), log_level="warning", lifespan="on", ws="none", http="h11"
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(10):
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event to wait on)
            await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await serving
    sock.close()
