"""Ties in a key's order are broken by taskId byte by byte, as Redis orders a sorted set's
members and as the model sorts, whatever locale the Redis server runs under: Lua compares
strings with the server's ``strcoll``, and under en_US.UTF-8 that puts 'a' before 'B'."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from coalescer import model
from coalescer.model import TaskEvent
from coalescer.store import Store, open_store
from tests.policy.support import rule
from tests.redis_server import RedisServer, redis_server

pytestmark = pytest.mark.integration

NOW = 1_893_456_000_000
#: Byte order: A1 < C1 < b1. en_US.UTF-8 collation: A1 < b1 < C1.
TIED = ("A1", "b1", "C1")


@pytest.fixture(scope="module")
def en_us(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a process under en_US.UTF-8, compiled here from Debian's locale
    definitions (scripts/with_services.py installs them for the suite)."""
    where = tmp_path_factory.mktemp("locale")
    made = subprocess.run(
        ["localedef", "-i", "en_US", "-f", "UTF-8", str(where / "en_US.UTF-8")],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.fail(f"cannot compile en_US.UTF-8 (apt-get install locales): {made.stderr}")
    return {"LC_ALL": "en_US.UTF-8", "LOCPATH": str(where)}


@pytest.fixture
def server(en_us: dict[str, str]) -> Iterator[RedisServer]:
    with redis_server(env=en_us) as s:
        # The premise: this server's Lua collates as the locale does, not byte by byte.
        assert s.client.eval("return tostring('a' < 'B')", 0) == b"true"
        yield s


@pytest_asyncio.fixture
async def store(server: RedisServer) -> AsyncIterator[Store]:
    s = await open_store(server.url, grace_seconds=3600)
    yield s
    await s.close()


def ev(task_id: str, state: str = "pending") -> TaskEvent:
    return TaskEvent(task_id, 0, state, ("k",), 5.0, NOW + 3_600_000, NOW - 60_000)


async def test_a_tied_initial_task_is_placed_by_byte_order(store: Store) -> None:
    a, b, c = TIED
    await store.apply([ev(a), ev(b), ev(c), ev(c, "running")], now_ms=NOW)
    snap = await store.snapshot("k", c, now_ms=NOW, cap=32)
    assert (snap.newer, snap.newest) == (1, [b, a])
    assert model.supersedes(c, snap, now_ms=NOW) == ([a, c, b], "ok")
    for initial in (a, b):  # pending initial tasks, among the ties
        snap = await store.snapshot("k", initial, now_ms=NOW, cap=32)
        assert model.supersedes(initial, snap, now_ms=NOW)[0] == [a, b]


async def test_latest_wins_picks_the_last_of_tied_tasks_by_byte_order(
    store: Store, server: RedisServer
) -> None:
    for task_id in TIED:
        await store.apply([ev(task_id)], now_ms=NOW, policy=rule("k", strategy="latest-wins"))
    entries: Any = server.client.xrange("co:{k}:o")
    victims = {fields[b"v"].decode() for _, fields in entries}
    assert victims == {"A1", "C1"}
    assert [t.task_id for t in await store.pending("k", now_ms=NOW)] == ["b1"]
