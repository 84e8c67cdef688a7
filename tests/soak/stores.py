"""The soak's Redis: one ``redis-server`` of its own (:class:`OneRedis`), or a Cluster of three
masters with a replica each (:class:`Cluster`); the store faults act on them."""

from __future__ import annotations

from tests.redis_server import RedisServer


class OneRedis:
    def __init__(self) -> None:
        self.server = RedisServer("--maxmemory-policy", "noeviction")

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def freeze(self) -> str:
        self.server.freeze()
        return "redis"

    def thaw(self) -> None:
        self.server.thaw()

    def fill(self) -> str:
        return f"redis filled with {self.server.fill()} keys"

    def unfill(self) -> None:
        self.server.unfill()

    def read_only(self, dead_port: int) -> str:
        self.server.client.replicaof("127.0.0.1", dead_port)
        return "redis (REPLICAOF a dead address)"

    def writable(self) -> None:
        self.server.client.replicaof("NO", "ONE")

    def restart_empty(self) -> str:
        self.server.restart_empty()
        return "redis restarted empty"

    def healthy(self) -> None:
        """Whatever a fault left behind undone: thawed, writable, no memory limit."""
        self.server.thaw()
        self.server.client.replicaof("NO", "ONE")
        self.server.unfill()
