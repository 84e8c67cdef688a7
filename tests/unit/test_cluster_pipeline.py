"""ClusterPipeline sends a node's commands again only where the node surely did not run them:
a counter is never counted twice after a timeout."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MovedError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.store.cluster import (
    ClusterPipeline,
    NodeClients,
    healthy_replicas,
    not_sent,
    routing_key,
)


class Node:
    def __init__(self, name: str) -> None:
        self.name = name


class Cluster:
    """A slot map: every key on ``owner``, which a refresh (``nodes_manager.initialize``)
    replaces by ``after``."""

    def __init__(self, owner: Node, after: Node) -> None:
        self.owner, self.after = owner, after
        self.refreshes = 0
        self.nodes_manager = Manager(self)

    async def initialize(self) -> None:  # the map is made at the first call
        return None

    def get_node_from_key(self, key: str) -> Node:
        return self.owner


class Manager:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        #: set: a refresh reads the nodes' answer at once; clear: it waits for it
        self.answer = asyncio.Event()
        self.answer.set()

    async def initialize(self) -> None:
        self.cluster.refreshes += 1
        await self.answer.wait()
        self.cluster.owner = self.cluster.after


class Server:
    """A node's counters, and how it answers: ``run`` (runs the commands and replies), ``lost``
    (runs them, then the reply times out), ``refused`` (no connection), ``moved``."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.counters: dict[str, int] = {}
        self.pipelines = 0
        #: set once ``awaited`` pipelines have been sent
        self.sent, self.awaited = asyncio.Event(), 0


class Pipe:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args))

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        server = self.server
        server.pipelines += 1
        if server.pipelines == server.awaited:
            server.sent.set()
        if server.how == "refused":
            raise RedisConnectionError("Error 111 connecting to 10.0.0.1:7000. Connection refused.")
        if server.how == "moved":
            return [MovedError("1234 10.0.0.2:7001") for _ in self.calls]
        replies = []
        for name, args in self.calls:
            assert name == "hincrby"
            server.counters[args[1]] = server.counters.get(args[1], 0) + args[2]
            replies.append(server.counters[args[1]])
        if server.how == "lost":
            raise RedisTimeoutError("Timeout reading from 10.0.0.1:7000")
        return replies


class Nodes(NodeClients):
    def __init__(self, servers: dict[str, Server]) -> None:
        super().__init__("redis://127.0.0.1:7000")
        self.servers = servers

    def get(self, node: Node) -> Any:
        server = self.servers[node.name]

        class Client:
            def pipeline(self, transaction: bool = False) -> Pipe:
                return Pipe(server)

        return Client()


def pipeline(first: str, then: str = "run") -> tuple[ClusterPipeline, Cluster, Server, Server]:
    old, new = Server(first), Server(then)
    cluster = Cluster(Node("old"), Node("new"))
    pipe = ClusterPipeline(cluster, Nodes({"old": old, "new": new}))  # type: ignore[arg-type]
    pipe.hincrby("{co:keys}:stats", "answers", 1)
    pipe.hincrby("{co:keys}:stats", "events", 5)
    return pipe, cluster, old, new


async def test_a_timeout_after_the_commands_were_written_is_raised_never_resent() -> None:
    pipe, cluster, old, new = pipeline("lost")
    with pytest.raises(RedisTimeoutError):
        await pipe.execute()
    assert old.counters == {"answers": 1, "events": 5} and old.pipelines == 1
    assert new.pipelines == 0  # counted once, on the node that ran them
    assert cluster.refreshes == 1  # the next call goes by a fresh slot map


async def test_a_node_that_refuses_the_connection_gets_its_commands_sent_to_the_new_owner() -> None:
    pipe, cluster, old, new = pipeline("refused")
    assert await pipe.execute() == [1, 5]
    assert old.counters == {} and new.counters == {"answers": 1, "events": 5}
    assert cluster.refreshes == 1


async def test_a_redirected_command_is_sent_again_to_the_node_named() -> None:
    pipe, cluster, old, new = pipeline("moved")
    assert await pipe.execute() == [1, 5]
    assert (old.counters, new.counters) == ({}, {"answers": 1, "events": 5})
    assert cluster.refreshes == 1


async def test_pipelines_that_find_the_map_stale_at_once_share_one_read_of_it() -> None:
    old, new = Server("moved"), Server("run")
    cluster = Cluster(Node("old"), Node("new"))
    cluster.nodes_manager.answer.clear()  # the nodes are slow to answer, as in a failover
    nodes = Nodes({"old": old, "new": new})
    pipes = []
    for _ in range(50):
        pipe = ClusterPipeline(cluster, nodes)  # type: ignore[arg-type]
        pipe.hincrby("{co:keys}:stats", "answers", 1)
        pipes.append(asyncio.ensure_future(pipe.execute()))
    old.awaited = 50
    async with asyncio.timeout(10):  # every one redirected, each waiting for a fresh map
        await old.sent.wait()
    cancelled = pipes.pop()
    cancelled.cancel()  # one caller gone: the read goes on for the others
    cluster.nodes_manager.answer.set()
    assert [await p for p in pipes] == [[n] for n in range(1, 50)]
    assert cluster.refreshes == 1
    assert cancelled.cancelled() and new.counters == {"answers": 49}
    # A map found stale after that read ended is read again.
    cluster.owner = Node("old")
    pipe = ClusterPipeline(cluster, nodes)  # type: ignore[arg-type]
    pipe.hincrby("{co:keys}:stats", "answers", 1)
    assert await pipe.execute() == [50]
    assert cluster.refreshes == 2


async def test_redis_py_s_errors_before_and_after_sending_are_told_apart() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = aioredis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0))
    pipe = client.pipeline(transaction=False)
    pipe.hincrby("k", "f", 1)
    with pytest.raises(RedisConnectionError) as refused:
        await pipe.execute()
    await client.aclose()
    assert not_sent(refused.value)
    assert not_sent(RedisTimeoutError("Timeout connecting to server"))
    assert not not_sent(RedisTimeoutError("Timeout reading from 10.0.0.1:7000"))
    assert not not_sent(RedisConnectionError("Connection closed by server."))


def test_a_command_goes_to_the_node_of_its_key_not_of_its_first_argument() -> None:
    assert routing_key("evalsha", ("sha", 2, "{k}:a", "{k}:b", 7)) == "{k}:a"
    assert routing_key("xreadgroup", ("enforce", "enforce-1", {"{k}:o": ">"})) == "{k}:o"
    assert routing_key("hincrby", ("{co:keys}:stats", "answers", 1)) == "{co:keys}:stats"


NODES = b"""\
aaa 127.0.0.1:7001@17001 slave mmm 0 1795774612097 1 connected
bbb 127.0.0.1:7002@17002 slave,fail mmm 0 1795774612097 1 connected
ccc 127.0.0.1:7003@17003 slave,fail? mmm 0 1795774612097 1 connected
ddd 127.0.0.1:7004@17004 slave ooo 0 1795774612097 2 connected
mmm 127.0.0.1:7000@17000 myself,master - 0 1795774610000 1 connected 0-8191
ooo 127.0.0.1:7005@17005 master - 0 1795774611194 2 connected 8192-16383
"""


def test_a_node_s_replicas_are_those_its_own_view_does_not_mark_failed() -> None:
    # ccc is only suspected (fail?): a failover may still promote it, so it counts
    assert healthy_replicas(NODES) == 2
    assert healthy_replicas(NODES.replace(b" mmm 0", b" ooo 0")) == 0
    parsed = {
        "127.0.0.1:7000": {"node_id": "mmm", "flags": "myself,master", "master_id": "-"},
        "127.0.0.1:7001": {"node_id": "aaa", "flags": "slave", "master_id": "mmm"},
    }
    assert healthy_replicas(parsed) == 1  # as older redis-py versions parse it
    assert healthy_replicas(RedisConnectionError("gone")) is None  # unknown: may have one
