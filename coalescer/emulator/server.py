"""``create_app``: the queue emulator as an ASGI app, its API routes served by the endpoint
handlers (:mod:`coalescer.emulator.endpoints`) through the request plumbing of
:mod:`coalescer.emulator.app`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount

from coalescer.emulator import ui
from coalescer.emulator.app import api_route, control_routes, internal_error, not_found
from coalescer.emulator.endpoints import HANDLERS, not_implemented
from coalescer.emulator.runtime import Emulator, EmulatorOptions
from coalescer.schemas import load_reference

#: Seconds the server keeps an idle connection open (uvicorn's ``timeout_keep_alive``; its
#: default is 5). Longer than its clients keep one (aiohttp 15 s, httpx 5 s), so that a client
#: never sends a request on a connection the server is closing at that moment, which a client
#: without retries (the tests') reports as a connection it could not establish.
KEEP_ALIVE_SECONDS = 75


def create_app(emulator: Emulator | EmulatorOptions | None = None) -> Starlette:
    """The emulator as an ASGI app; its lifespan runs the publisher and the periodic checks."""
    if not isinstance(emulator, Emulator):
        emulator = Emulator(emulator)
    running = emulator
    entries = load_reference("api.json")["entries"]
    api = [api_route(e, HANDLERS.get(e["name"], not_implemented), running) for e in entries]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        running.loop = asyncio.get_running_loop()
        await running.publisher.start()
        ticker = asyncio.create_task(running.run_ticker(), name="emulator-ticker")
        try:
            yield
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            await running.publisher.stop()

    app = Starlette(
        routes=[Mount("/api/queue/v1", routes=api), *control_routes(running), *ui.routes(running)],
        lifespan=lifespan,
        exception_handlers={HTTPException: not_found, Exception: internal_error},
    )
    app.state.emulator = running
    return app
