"""Pipelines over a Redis Cluster, and the lean query connection on one.

redis-py refuses scripts in its cluster pipelines, and this store writes through scripts. A
:class:`ClusterPipeline` queues commands like a pipeline, then sends each node its own commands,
in their order, in one round trip per node, every node at once. Every script touches keys of one
hash slot only (see ``keys.py``), so each runs whole on the node that owns its slot.

:class:`ClusterRouter` gives the query hot path the lean connection of ``pipelined.py`` on a
Cluster: one per node, each command sent to the node redis-py's slot map names.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any
from urllib.parse import unquote, urlparse

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from coalescer.store.admission import POOL_SIZE
from coalescer.store.pipelined import PipelinedClient, ReplyError

#: How many times one pipeline follows a changed slot map (a failover, a moved slot) before it
#: gives up: the store then reports Redis unavailable, and its callers retry.
REROUTES = 3
#: How long a pipeline whose writes must outlive a failover waits for a replica to hold them.
REPLICATION_WAIT_MS = 2000


class NotReplicated(RedisError):
    """A master ran a pipeline's writes, but its replica did not acknowledge them in time: a
    failover may lose them, so they are not reported done (the caller applies them again)."""


def not_sent(exc: BaseException) -> bool:
    """Whether ``exc`` (raised by a node's pipeline) came before any command was sent: the
    connection could not be made (refused, no route, timed out connecting). redis-py checks a
    pooled connection before it uses one, so any other connection error or timeout comes after
    the commands were written, and the node may have run them."""
    message = str(exc)
    return isinstance(exc, OSError | RedisConnectionError | RedisTimeoutError) and (
        " connecting to " in message or message.startswith("Timeout connecting")
    )


class NodeClients:
    """One plain client per cluster node, with the credentials of ``REDIS_URL``, and the reads
    of the slot map they are chosen by."""

    def __init__(self, redis_url: str) -> None:
        parts = urlparse(redis_url)
        self._username = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password else None
        self._ssl = parts.scheme == "rediss"
        self._clients: dict[str, aioredis.Redis] = {}
        #: whether each node had a replica (not failed) when it last answered a pipeline
        #: whose writes had to be replicated; unknown means it may
        self.replicas: dict[str, bool] = {}
        self._reading: asyncio.Future[None] | None = None

    async def refresh(self, cluster: RedisCluster) -> None:
        """Read ``cluster``'s slot map anew. In a failover every pipeline under way finds the
        map stale at once (up to one per admitted round trip); they share one read, started by
        the first and awaited by those that ask while it is under way, instead of each asking
        the nodes and building its own 16,384-slot tables. A read's error reaches every one of
        them; one caller cancelled does not cancel the read for the others."""
        reading = self._reading
        if (
            reading is None
            or reading.done()
            or reading.get_loop() is not asyncio.get_running_loop()
        ):
            reading = self._reading = asyncio.ensure_future(cluster.nodes_manager.initialize())
            # Retrieved here too: its callers may all have been cancelled.
            reading.add_done_callback(lambda read: read.cancelled() or read.exception())
        await asyncio.shield(reading)

    def get(self, node: ClusterNode) -> aioredis.Redis:
        if node.name not in self._clients:
            self._clients[node.name] = aioredis.Redis(
                host=node.host,
                port=int(node.port),
                username=self._username,
                password=self._password,
                ssl=self._ssl,
                socket_connect_timeout=5,
                socket_timeout=10,
                # As many round trips at once as the store lets in (Store.admission), which
                # may all go to this node; redis-py's default pool is smaller.
                max_connections=POOL_SIZE,
                # Never sent again by redis-py: after a timeout the node may have run them.
                retry=Retry(NoBackoff(), 0),
            )
        return self._clients[node.name]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


def routing_key(name: str, args: tuple[Any, ...]) -> Any:
    """The key whose slot decides the node for a pipeline call ``name(*args)``: a script's
    first key, ``XREADGROUP``'s first stream (after its group and consumer names), else the
    first argument."""
    if name in ("evalsha", "eval"):
        return args[2]
    if name == "xreadgroup":
        return next(iter(args[2]))
    return args[0]


class ClusterPipeline:
    """Queue commands as on a redis-py pipeline; :meth:`execute` returns results in order.

    With ``replicated``, a node's writes count as done only once a replica of it holds them,
    when the node has one: Redis replicates asynchronously, and a master answers writes its
    replica never receives when a failover replaces it first. The case seen: a master frozen
    longer than the node timeout, its replica promoted meanwhile; thawed, it ran the writes
    waiting in its socket and answered them before it learned that it had lost its slots,
    then rejoined as a replica and dropped them. So each node is sent, in the same round
    trip, ``CLUSTER NODES`` (its own view of its replicas at the moment of the writes: the
    frozen master still counts its replica as its own) before the writes and ``WAIT 1`` after
    them, and the pipeline raises :class:`NotReplicated` when the node has a replica that did
    not acknowledge them, instead of reporting them done. A node with no replica that is not
    marked failed has nothing to wait for; whether a node has one is remembered from its last
    answer, so that such a node is not sent a ``WAIT`` that could only time out.
    """

    def __init__(
        self, cluster: RedisCluster, nodes: NodeClients, *, replicated: bool = False
    ) -> None:
        self._cluster = cluster
        self._nodes = nodes
        self._replicated = replicated
        self._calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any, **kwargs: Any) -> None:
            self._calls.append((name, args, kwargs))

        return queue

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Run the queued commands, each on the node that owns its slot.

        Commands are sent again only where the node surely did not run them: it answered
        ``MOVED``/``ASK``, or no connection to it could be made. That means the slot map is
        stale (a failover, a slot moved): the map is read anew and those commands go to the
        node it names, up to :data:`REROUTES` times. A node that timed out or dropped the
        connection after the commands were written may have run them, and not every command is
        idempotent (``HINCRBY`` counters, ``list.lua``'s census): that error is raised, after
        the map is read anew, for the caller to handle as any unavailable store (the
        commands other nodes ran stay run)."""
        await self._cluster.initialize()
        results: list[Any] = [None] * len(self._calls)
        todo = list(range(len(self._calls)))
        for attempt in range(REROUTES + 1):
            stale, unreachable, in_doubt = await self._send(todo, results)
            if in_doubt is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._nodes.refresh(self._cluster)
                raise in_doubt
            if not stale and unreachable is None:
                break
            if attempt == REROUTES:
                if unreachable is not None:
                    raise unreachable
                break
            await self._nodes.refresh(self._cluster)
            todo = stale
        if raise_on_error:
            for reply in results:
                if isinstance(reply, Exception):
                    raise reply
        return results

    async def _send(
        self, todo: list[int], results: list[Any]
    ) -> tuple[list[int], RedisError | OSError | None, RedisError | OSError | None]:
        """Send the commands ``todo`` (one pipeline per node, every node at once) and put their
        replies in ``results``. Returns the commands to send again (redirected, or on a node
        no connection could be made to), the last error that made a node unreachable, and the
        last error after which a node may have run its commands (see :func:`not_sent`)."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for i in todo:
            name, args, _ = self._calls[i]
            key = routing_key(name, args)
            node = self._cluster.get_node_from_key(key.decode() if isinstance(key, bytes) else key)
            assert node is not None
            by_node.setdefault(node.name, (node, []))[1].append(i)

        async def run(node: ClusterNode, indexes: list[int]) -> tuple[list[int], Any]:
            pipe = self._nodes.get(node).pipeline(transaction=False)
            wait = self._replicated and self._nodes.replicas.get(node.name, True)
            if self._replicated:
                pipe.execute_command("CLUSTER", "NODES")
            for i in indexes:
                name, args, kwargs = self._calls[i]
                getattr(pipe, name)(*args, **kwargs)
            if wait:  # on the same connection: WAIT covers the writes this connection made
                pipe.execute_command("WAIT", 1, REPLICATION_WAIT_MS)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                return indexes, exc
            if not self._replicated:
                return indexes, replies
            view = replies.pop(0)
            acknowledged = replies.pop() if wait else None
            replicas = healthy_replicas(view)
            self._nodes.replicas[node.name] = replicas != 0
            ran = any(not isinstance(r, MovedError | AskError) for r in replies)
            if ran and replicas != 0 and not (isinstance(acknowledged, int) and acknowledged):
                return indexes, NotReplicated(
                    f"no replica of {node.name} acknowledged the writes within "
                    f"{REPLICATION_WAIT_MS} ms ({acknowledged!r})"
                )
            return indexes, replies

        stale: list[int] = []
        unreachable: RedisError | OSError | None = None
        in_doubt: RedisError | OSError | None = None
        for indexes, replies in await asyncio.gather(*(run(n, ix) for n, ix in by_node.values())):
            if isinstance(replies, (RedisError, OSError)):
                if not_sent(replies):
                    stale += indexes
                    unreachable = replies
                else:
                    in_doubt = replies
                continue
            for i, reply in zip(indexes, replies, strict=True):
                results[i] = reply
                if isinstance(reply, (MovedError, AskError)):
                    stale.append(i)
        return sorted(stale), unreachable, in_doubt


def healthy_replicas(view: Any) -> int | None:
    """How many replicas a node's ``CLUSTER NODES`` answer lists for the node itself that are
    not marked failed (``fail``; a node only suspected, ``fail?``, still counts), or ``None``
    when the answer is not one (an error): then a replica may exist."""
    if isinstance(view, bytes):
        view = view.decode()
    if isinstance(view, str):
        rows = [line.split() for line in view.splitlines()]
        nodes = [(r[0], r[2].split(","), r[3]) for r in rows if len(r) > 3]
    elif isinstance(view, dict):  # older redis-py versions parse it
        nodes = [(n["node_id"], str(n["flags"]).split(","), n["master_id"]) for n in view.values()]
    else:
        return None
    me = next((node_id for node_id, flags, _ in nodes if "myself" in flags), None)
    if me is None:
        return None
    return sum(
        1
        for _, flags, master in nodes
        if master == me and not {"fail", "noaddr", "handshake"} & set(flags)
    )


class ClusterRouter:
    """:class:`PipelinedClient` connections to every node of a Cluster, used as one: a command
    goes to the node that owns its first key's slot, as redis-py's slot map says.

    While slots move, a node answers ``MOVED`` or ``ASK``; that reply surfaces as
    :class:`~coalescer.store.pipelined.ReplyError` and the store falls back to redis-py, which
    follows the redirection and refreshes the map this router reads.
    """

    def __init__(self, cluster: RedisCluster, redis_url: str, *, timeout: float = 10.0) -> None:
        self._cluster = cluster
        self._url = urlparse(redis_url)
        self._timeout = timeout
        self._clients: dict[str, PipelinedClient] = {}

    def execute(self, *args: Any) -> Awaitable[Any]:
        """``args`` as for :meth:`PipelinedClient.execute`; keys start after ``EVALSHA``'s
        script and key count, after the command name otherwise."""
        key = args[3] if args[0] in ("EVALSHA", "EVAL") else args[1]
        try:
            node = self._cluster.get_node_from_key(key)
        except (RedisClusterException, RedisError) as exc:  # no slot map yet: redis-py makes it
            raise ReplyError(f"no node known for {key!r}: {exc}") from exc
        if node is None:
            raise ReplyError(f"no node known for {key!r}")
        client = self._clients.get(node.name)
        if client is None:
            client = self._clients[node.name] = PipelinedClient(
                self._node_url(node), timeout=self._timeout
            )
        return client.execute(*args)

    def _node_url(self, node: ClusterNode) -> str:
        auth = self._url.netloc.rpartition("@")[0]
        netloc = f"{auth}@{node.host}:{node.port}" if auth else f"{node.host}:{node.port}"
        return self._url._replace(netloc=netloc, path="").geturl()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
