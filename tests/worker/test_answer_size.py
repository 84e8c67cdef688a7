"""A superseder's answer is capped after decoding, and decoding stays within the cap: a gzip
bomb (64 KiB inflating to 64 MiB) leaves the worker's memory bounded and its task running
alone; an honest compressed answer is read as usual."""

from __future__ import annotations

import dataclasses
import gzip
import tracemalloc
import zlib
from collections.abc import Sequence

import orjson
import pytest
from starlette.responses import Response

from coalescer.emulator.harness import QueueEmulator
from coalescer.worker import Claim, Options, Outcome, Superseded
from coalescer.worker.protocol import COMPLETED
from tests.worker.support import Superseder, Tasks, claim_work, make_shim

INFLATED = 64 << 20


def gzip_bomb() -> bytes:
    """``{"supersedes": ["`` and 64 MiB of spaces, gzip-compressed, built in small pieces."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    out = [packer.compress(b'{"supersedes": ["')]
    block = b" " * (1 << 20)
    out += [packer.compress(block) for _ in range(INFLATED >> 20)]
    out.append(packer.flush())
    return b"".join(out)


async def ran(claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
    return COMPLETED


@pytest.mark.timeout(60)
async def test_a_gzip_bomb_runs_the_task_alone_in_bounded_memory(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    bomb = gzip_bomb()
    assert len(bomb) < INFLATED // 500

    async def answer(key: str, task_id: str) -> Response:
        return Response(bomb, media_type="application/json", headers={"content-encoding": "gzip"})

    superseder.answer = answer
    initial, newer = tasks.create(), tasks.create()
    options = dataclasses.replace(options, timeout=30.0)
    async with make_shim(queue_emulator, options) as shim:
        [work] = await claim_work(shim)
        tracemalloc.start()
        try:
            report = await shim.run(work, ran)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert report.alone == "bad-answer"
    assert report.primary == (initial, 0) and report.superseded == []
    assert tasks.last_run(initial)["state"] == "completed"
    assert tasks.status(newer)["state"] == "pending"
    # The answer cap is 1 MiB; everything else the run allocates stays well under 16 MiB.
    assert options.max_answer_bytes == 1 << 20
    assert peak < 16 << 20, f"peak {peak / 2**20:.1f} MiB while reading the answer"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_compressed_answer_is_read(
    encoding: str,
    queue_emulator: QueueEmulator,
    options: Options,
    tasks: Tasks,
    superseder: Superseder,
) -> None:
    old, new = tasks.create(), tasks.create()

    async def answer(key: str, task_id: str) -> Response:
        body = orjson.dumps({"supersedes": [old, new]})
        packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
        return Response(
            packed, media_type="application/json", headers={"content-encoding": encoding}
        )

    superseder.answer = answer
    async with make_shim(queue_emulator, options) as shim:
        [work] = await claim_work(shim)
        report = await shim.run(work, ran)
    assert report.alone is None
    assert report.primary == (new, 0) and report.superseded == [(old, 0)]


async def test_an_unknown_encoding_runs_the_task_alone(
    queue_emulator: QueueEmulator, options: Options, tasks: Tasks, superseder: Superseder
) -> None:
    async def answer(key: str, task_id: str) -> Response:
        return Response(b"\x00\x01", headers={"content-encoding": "br"})

    superseder.answer = answer
    initial = tasks.create()
    async with make_shim(queue_emulator, options) as shim:
        [work] = await claim_work(shim)
        report = await shim.run(work, ran)
    assert report.alone == "bad-answer" and report.primary == (initial, 0)
