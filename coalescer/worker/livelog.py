"""The task's log, on disk, and serving it live over HTTP while the task runs.

:class:`TaskLog` keeps a run's log (worker lines and the command's output) in an anonymous
temporary file, capped at :data:`MAX_LOG_BYTES`: memory stays small however much a task prints,
and any number of readers can follow the file, each from its own descriptor.

:class:`LiveLogServer` serves each published log at ``http://HOST:PORT/log/<token>``: a GET
gets what is written so far and then, on the same chunked response, whatever follows, until the
log is finished. The token (``secrets.token_urlsafe``) is the only way in, so logs cannot be
enumerated; the server keeps no access log, so tokens do not end up in logs either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator
from types import TracebackType

from aiohttp import web

MAX_LOG_BYTES = 16 << 20
TEXT = "text/plain; charset=utf-8"
_CHUNK = 64 << 10


class TaskLog:
    """A run's log in a temporary file, up to :data:`MAX_LOG_BYTES`. Use as ``with TaskLog()``:
    the file is gone when the block ends (readers still following keep their own descriptor)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="coalescer-log-")
        self.size = 0
        #: True once nothing more will be written: readers stop at the end.
        self.finished = False
        self._grown = asyncio.Event()

    def __enter__(self) -> TaskLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish()
        self._file.close()

    def line(self, text: str) -> None:
        self.write(f"[coalescer-worker] {text}\n".encode())

    def write(self, chunk: bytes) -> None:
        room = MAX_LOG_BYTES - self.size
        if self.finished or room <= 0:
            return
        data = chunk[:room]
        if len(chunk) > room:
            data += b"\n[coalescer-worker] log truncated\n"
        # Local writes of at most a pipe read: not worth a thread.
        self._file.write(data)
        self._file.flush()
        self.size += len(data)
        self._wake()

    def finish(self) -> None:
        """Nothing more will be written: readers get the rest and stop."""
        self.finished = True
        self._wake()

    def contents(self) -> bytes:
        return os.pread(self._file.fileno(), self.size, 0)

    def reader(self) -> LogReader:
        """A reader from the start of the log; it works after the log is closed too. Close it."""
        return LogReader(self, os.dup(self._file.fileno()))

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()


class LogReader:
    """Follows a :class:`TaskLog` from its start, on a descriptor of its own."""

    def __init__(self, log: TaskLog, fd: int) -> None:
        self._log = log
        self._fd = fd
        self._offset = 0

    async def next(self) -> bytes:
        """The next chunk of the log, waiting for one; ``b""`` once the log is finished and
        read to its end."""
        while True:
            grown, size, finished = self._log._grown, self._log.size, self._log.finished
            if self._offset < size:
                # Recently written, so read from the page cache: not worth a thread either.
                chunk = os.pread(self._fd, min(_CHUNK, size - self._offset), self._offset)
                self._offset += len(chunk)
                return chunk
            if finished:
                return b""
            await grown.wait()

    def close(self) -> None:
        os.close(self._fd)


class LiveLogServer:
    """Serves published task logs over HTTP from this process. Use as ``async with``.

    ``host`` is the name users reach this worker by, as it appears in the URLs; ``bind`` the
    address to listen on (default: ``host``). Port 0 takes any free port. Entering raises
    ``OSError`` when the address cannot be listened on (e.g. the port is in use).
    """

    def __init__(self, host: str, port: int, *, bind: str | None = None) -> None:
        self.host = host
        self.port = port
        self.bind = bind or host
        self.base_url = ""
        self._logs: dict[str, TaskLog] = {}
        app = web.Application()
        app.router.add_get("/log/{token}", self._serve, allow_head=False)
        # handler_cancellation: a reader that disconnects while waiting for output goes at once.
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0
        )

    async def __aenter__(self) -> LiveLogServer:
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.bind, self.port).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        port = self._runner.addresses[0][1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.base_url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._runner.cleanup()

    @contextlib.contextmanager
    def publish(self, log: TaskLog) -> Iterator[str]:
        """Serve ``log`` at a new unguessable URL, which this block yields, until it ends."""
        token = secrets.token_urlsafe(32)
        self._logs[token] = log
        try:
            yield f"{self.base_url}/log/{token}"
        finally:
            del self._logs[token]

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        log = self._logs.get(request.match_info["token"])
        if log is None:
            raise web.HTTPNotFound()
        reader = log.reader()
        try:
            response = web.StreamResponse(
                headers={
                    "content-type": TEXT,
                    "cache-control": "no-store",
                    "access-control-allow-origin": "*",  # log viewers in web pages
                }
            )
            await response.prepare(request)
            while chunk := await reader.next():
                await response.write(chunk)
            await response.write_eof()
        except ConnectionError:
            pass  # the reader went away; the task does not care
        finally:
            reader.close()
        return response
