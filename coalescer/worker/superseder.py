"""Asking a superseder: one GET with a total deadline, an allow-list and a size limit.

The size limit holds for the decoded answer, and memory stays within it: a compressed answer is
inflated chunk by chunk, never to more than the limit (a small gzip "bomb" can inflate a
thousandfold).

Every way this can go wrong ends in :class:`~coalescer.worker.protocol.SupersederError`, so the
caller has one thing to catch before running the claimed task alone: superseding must never
block work.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from coalescer.worker.allow import AmbiguousUrl, canonical_url, url_allowed
from coalescer.worker.protocol import (
    Options,
    SupersederError,
    parse_answer,
    query_url,
    superseder_url,
)


async def fetch_answer(http: httpx.AsyncClient, url: str, task_id: str, *, max_bytes: int) -> bytes:
    """The body of ``GET <url>?taskId=<task_id>``; redirects are not followed, since they
    could lead outside the allow-list. The caller sets the deadline."""
    target = query_url(url, task_id)
    headers = {"accept": "application/json", "accept-encoding": "gzip, deflate"}
    try:
        async with http.stream("GET", target, follow_redirects=False, headers=headers) as response:
            if response.status_code != 200:
                raise SupersederError(
                    "bad-status", f"the superseder answered HTTP {response.status_code}"
                )
            inflate = _inflater(response.headers.get("content-encoding", ""))
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += inflate(chunk, max_bytes + 1 - len(body))
                if len(body) > max_bytes:
                    raise SupersederError(
                        "bad-answer", f"the superseder's answer exceeds {max_bytes} bytes"
                    )
            return bytes(body)
    except httpx.HTTPError as exc:
        raise SupersederError("unavailable", f"the superseder is unreachable: {exc!r}") from exc


def _inflater(encoding: str) -> Callable[[bytes, int], bytes]:
    """``inflate(chunk, at_most)``: the next decoded bytes of a body in ``encoding`` (identity,
    gzip or deflate), never more than ``at_most`` of them."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return lambda chunk, at_most: chunk[:at_most]
    if name not in ("gzip", "x-gzip", "deflate"):
        raise SupersederError(
            "bad-answer", f"the answer's Content-Encoding {encoding!r} is not gzip"
        )
    # gzip, or deflate in its zlib wrapper (RFC 9110); 32 + 15 takes either header.
    decoder = zlib.decompressobj(32 + zlib.MAX_WBITS)

    def inflate(chunk: bytes, at_most: int) -> bytes:
        try:
            return decoder.decompress(chunk, at_most)
        except zlib.error as exc:
            raise SupersederError("bad-answer", f"the answer does not decompress: {exc}") from exc

    return inflate


async def ask(
    http: httpx.AsyncClient, task_id: str, task: Mapping[str, Any], options: Options
) -> list[str]:
    """The task set a superseder proposes for the claimed ``task_id``, oldest first.

    Raises SupersederError (with a reason to log) when the task has no ``supersederUrl``, the
    URL is not under an allowed prefix, or the superseder is down, slow or talking nonsense.
    """
    given = superseder_url(task)
    try:
        url = canonical_url(given)  # what is checked is what is fetched
    except AmbiguousUrl as exc:
        raise SupersederError("not-allowed", f"supersederUrl {given!r} is refused: {exc}") from None
    if not url_allowed(url, options.allow):
        raise SupersederError(
            "not-allowed", f"supersederUrl {given!r} is not under an allowed prefix"
        )
    try:
        async with asyncio.timeout(options.timeout):
            body = await fetch_answer(http, url, task_id, max_bytes=options.max_answer_bytes)
    except TimeoutError:
        raise SupersederError(
            "timeout", f"the superseder did not answer within {options.timeout:g} s"
        ) from None
    return parse_answer(body, task_id, order=options.order, max_tasks=options.max_tasks)
