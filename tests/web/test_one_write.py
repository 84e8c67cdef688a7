"""The HTTP protocol sends a 200 response's head and body in one write, and nothing else late."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from coalescer.web.server import OneWrite

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return f"extra {name}"


def corked() -> tuple[OneWrite, Recorder]:
    raw = Recorder()
    return OneWrite(cast(asyncio.Transport, raw)), raw


async def test_a_200_head_and_its_body_leave_in_one_write() -> None:
    t, raw = corked()
    t.write(HEAD)
    assert raw.writes == []
    t.write(b"{}")
    assert raw.writes == [HEAD + b"{}"]
    await asyncio.sleep(0)
    assert raw.writes == [HEAD + b"{}"]


async def test_a_head_alone_leaves_by_the_end_of_the_loop_iteration() -> None:
    t, raw = corked()
    t.write(HEAD)
    await asyncio.sleep(0)
    assert raw.writes == [HEAD]
    t.write(b"{}")  # a body streamed later follows it
    assert raw.writes == [HEAD, b"{}"]


async def test_other_writes_go_straight_through() -> None:
    t, raw = corked()
    refusal = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n"
    t.write(refusal)
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")  # a whole response at once
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert raw.writes == [
        refusal,
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        b"HTTP/1.1 100 Continue\r\n\r\n",
    ]
    assert t.get_extra_info("peername") == "extra peername"


async def test_closing_sends_a_held_head_first_and_aborting_drops_it() -> None:
    t, raw = corked()
    t.write(HEAD)
    t.close()
    assert raw.writes == [HEAD] and raw.closed
    t, raw = corked()
    t.write(HEAD)
    t.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.closed
