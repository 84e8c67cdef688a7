"""``coalescer listen`` as a real process: SIGTERM drains and keeps the queue, SIGKILL between the
index write and the ack loses nothing and the redelivery changes nothing, a connection closed by
the broker is reopened."""

# The broker and prefix fixtures are shared with test_pulse.py by importing them, which pytest
# supports and ruff takes for redefinitions.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import pytest

from coalescer.store import Store
from tests.conftest import make_message
from tests.integration.test_pulse import (  # noqa: F401  (fixtures)
    Broker,
    bind_queue,
    broker,
    close_connection,
    eventually,
    ids,
    needs_rabbitmqctl,
    prefix,
    routes,
)
from tests.ports import free_port

#: ``coalescer listen`` that SIGKILLs itself right after its first index write, before any ack.
CRASH_AFTER_WRITE = """
import os, signal, sys
from coalescer import cli
from coalescer.store.redis import Store

write = Store.apply

async def apply_then_die(self, events, **kwargs):
    outcomes = await write(self, events, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
    return outcomes

Store.apply = apply_then_die
sys.exit(cli.main(["listen", "--declare-exchanges"]))
"""


class Listen:
    """A ``coalescer listen`` process, its output in a file."""

    def __init__(self, env: dict[str, str], log: Path, code: str | None = None) -> None:
        self.log = log
        args = ["-c", code] if code else ["-m", "coalescer.cli", "listen", "--declare-exchanges"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, *args], env=env, stdout=out, stderr=out)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    async def started(self) -> None:
        await eventually(
            lambda: _true("consuming queue/" in self.output() or self._died()),
            what="listen to start",
        )
        assert self.proc.poll() is None, self.output()

    def _died(self) -> bool:
        return self.proc.poll() is not None

    async def exited(self, within: float = 30.0) -> int:
        await eventually(lambda: _true(self._died()), within=within, what="listen to exit")
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


async def _true(value: bool) -> bool:
    return value


@pytest.fixture
def processes() -> Iterator[list[Listen]]:
    started: list[Listen] = []
    yield started
    for p in started:
        p.kill()


def listen_environ(url: str, redis_url: str, queue: str, prefix: str) -> dict[str, str]:
    """The environment of a ``coalescer listen`` on ``url``'s ``queue``, for route ``prefix``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(
        REDIS_URL=redis_url,
        PULSE_URL=url,
        PULSE_QUEUE=queue,
        COALESCER_ROUTE_PREFIX=prefix,
        COALESCER_LOG_FORMAT="text",
    )
    return env


@pytest.fixture
def listen_env(redis_url: str, amqp_url: str, prefix: str, broker: Broker) -> dict[str, str]:
    return listen_environ(amqp_url, redis_url, broker.queue, prefix)


async def pending_count(store: Store) -> int:
    return (await store.pending_counts(["k"]))["k"]


async def test_sigterm_drains_and_keeps_the_queue(
    listen_env: dict[str, str],
    store: Store,
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    n = 5000
    await bind_queue(broker, prefix)
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in ids(n)])
    listen = Listen(listen_env, tmp_path / "listen.log")
    processes.append(listen)
    await listen.started()
    await eventually(lambda: _positive(pending_count(store)), what="a first write")
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0, listen.output()
    assert "stopped consuming" in listen.output()
    # Every message was either applied and acknowledged, or is back in the kept queue: no
    # delivery was written and left unacknowledged, none was lost.
    applied, left = await pending_count(store), await broker.depth()
    assert applied + left == n and applied > 0
    stats = await store.stats()
    assert int(stats["events_applied"]) == applied
    assert await broker.dead() == []


async def _positive(count: Awaitable[int]) -> bool:
    return await count > 0


async def test_sigkill_between_write_and_ack_loses_nothing_and_the_redelivery_changes_nothing(
    listen_env: dict[str, str],
    store: Store,
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    tasks = ids(200)
    await bind_queue(broker, prefix)
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks])
    # Batches smaller than the backlog: the crash leaves some events written, others not.
    small_batches = {**listen_env, "COALESCER_PULSE_PREFETCH": "64"}
    crashing = Listen(small_batches, tmp_path / "crash.log", code=CRASH_AFTER_WRITE)
    processes.append(crashing)
    assert await crashing.exited() == -signal.SIGKILL, crashing.output()
    written = await pending_count(store)
    assert 0 < written < len(tasks)
    before = await store.known("k", tasks)
    # Nothing was acknowledged: once the broker sees the connection gone, all are back.
    await eventually(lambda: _equal(broker.depth(), len(tasks)), what="the deliveries requeued")

    listen = Listen(listen_env, tmp_path / "listen.log")
    processes.append(listen)
    await listen.started()
    await eventually(lambda: _equal(pending_count(store), len(tasks)), what="every event applied")
    # The counters are written after the batch is acknowledged: they follow the index closely.
    await eventually(lambda: _equal(counted(store), len(tasks)), what="every event counted")
    stats = await store.stats()
    assert (int(stats["events_stale"]), int(stats["events_applied"])) == (
        written,
        len(tasks) - written,
    )
    after = await store.known("k", tasks)
    assert {t: after[t] for t in before} == before  # the redelivered writes changed nothing
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0


async def counted(store: Store) -> int:
    stats = await store.stats()  # a counter not yet incremented is absent from the hash
    return int(stats.get("events_stale", 0)) + int(stats.get("events_applied", 0))


async def _equal(got: Awaitable[int], expected: int) -> bool:
    return await got == expected


@needs_rabbitmqctl
async def test_a_connection_closed_by_the_broker_is_reopened(
    listen_env: dict[str, str],
    store: Store,
    broker: Broker,
    prefix: str,
    tmp_path: Path,
    processes: list[Listen],
) -> None:
    tasks = ids(400)
    listen = Listen(listen_env, tmp_path / "listen.log")
    processes.append(listen)
    await listen.started()
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks[:200]])
    await eventually(lambda: _equal(pending_count(store), 200), what="the first half")
    name = f"coalescer {socket.gethostname()} pid {listen.proc.pid}"
    assert await asyncio.to_thread(close_connection, name) >= 1
    await broker.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks[200:]])
    await eventually(lambda: _equal(pending_count(store), 400), what="the second half")
    assert listen.proc.poll() is None
    started = time.monotonic()
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0 and time.monotonic() - started < 15


async def test_a_broker_that_is_down_is_one_warning_per_retry(
    redis_url: str, prefix: str, tmp_path: Path, processes: list[Listen]
) -> None:
    down = f"amqp://guest:guest@127.0.0.1:{free_port()}/"  # nothing listens there
    listen = Listen(listen_environ(down, redis_url, "queue/guest/down", prefix), tmp_path / "l")
    processes.append(listen)

    async def retried_twice() -> bool:
        return listen.output().count("retrying in") >= 2

    await eventually(retried_twice, what="two retries")
    listen.proc.send_signal(signal.SIGTERM)
    assert await listen.exited() == 0
    lines = listen.output().splitlines()
    about_the_broker = [line for line in lines if "127.0.0.1" in line or "aiormq" in line]
    retries = [line for line in lines if "unreachable" in line and "retrying in" in line]
    assert about_the_broker == retries and len(retries) >= 2, lines
    assert all(" WARNING " in line and ":***@" in line for line in retries), retries
    assert not [line for line in lines if " ERROR " in line], lines
