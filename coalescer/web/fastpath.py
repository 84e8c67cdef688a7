"""The superseding query's fast path: the one way in that skips the ASGI request cycle.

``web/server.py``'s protocol offers each plain keep-alive ``GET`` to :meth:`FastPath.start` as
soon as its head is parsed. A well-formed superseding query (``GET /<key>?taskId=``) that the
store can read on its lean connection starts that read at once and comes back as
:class:`Answering`; the protocol writes the answer from the reply's callback, without a
request cycle, an asyncio task or ASGI messages. Everything else is ``None`` here and goes
through uvicorn's ordinary request cycle to the Starlette app, where the route
``/{path:keypath}`` (:class:`~coalescer.web.api.KeyEndpoint`) answers it: bad input (its 400
says what is wrong), HTTP/1.0, a request pipelined behind another, the embedded store, a task
to learn from the queue.

A store failure met on the fast path goes the same way, carried in the scope
(:data:`~coalescer.web.api.FAILED`): the endpoint raises it, and Starlette's exception handlers
answer it as for any route, without asking the store again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from starlette.datastructures import State

from coalescer.errors import InvalidInput, StoreUnavailable
from coalescer.web import api


class Answering(NamedTuple):
    """A query taken on the fast path: the store's pending ``reply``, and ``finish``, which
    turns the done reply into the answer's body, the store's failure (for the ordinary path to
    answer), or ``None`` (the ordinary path answers: a script to reload, a task to learn)."""

    reply: asyncio.Future[Any]
    finish: Callable[[asyncio.Future[Any]], bytes | StoreUnavailable | None]


class FastPath:
    """The fast path of the app whose ``state`` it reads (its store, settings and learner)."""

    def __init__(self, state: State) -> None:
        self.state = state

    def start(self, path: str, query_string: bytes) -> Answering | None:
        """Start answering ``GET <path>?<query_string>``; ``None`` unless it is a well-formed
        superseding query that the store can read on its lean connection."""
        if b"taskId=" not in query_string or not api.KEY_PATH.fullmatch(key_path := path[1:]):
            return None
        state = self.state
        try:
            query = api.parse(state, key_path, query_string)
        except InvalidInput:
            return None
        if query is None:
            return None
        now_ms = int(time.time() * 1000)
        reply = state.store.snapshot_soon(
            query.key, query.task_id, now_ms=now_ms, cap=query.cap, wait=query.age is not None
        )
        if reply is None:
            return None
        return Answering(reply, partial(self._finish, query, now_ms))

    def _finish(
        self, query: api.Query, now_ms: int, reply: asyncio.Future[Any]
    ) -> bytes | StoreUnavailable | None:
        try:
            snap = self.state.store.snapshot_of(reply)
        except StoreUnavailable as exc:
            return exc
        if snap is None or (snap.newer is None and self.state.learner is not None):
            return None
        return api.finish(self.state, query, now_ms, snap)
