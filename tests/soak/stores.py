"""The soak's Redis: one ``redis-server`` of its own (:class:`OneRedis`), or a Cluster of three
masters with a replica each (:class:`Cluster`); the store faults act on them."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tests.ports import free_port_pair
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


class Cluster:
    """Three masters with a replica each on loopback (``cluster-node-timeout`` 3 s, so that a
    killed master's replica takes over within seconds). No persistence: a node restarted after
    a kill comes back empty and rejoins as its successor's replica."""

    NODE_TIMEOUT_MS = 3000

    def __init__(self, rng: random.Random, masters: int = 3) -> None:
        self.rng = rng
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError(
                "redis-server and redis-cli are needed: apt-get install redis-server"
            )
        self.server, self.cli = server, cli
        self.workdir = Path(tempfile.mkdtemp(prefix="coalescer-soak-cluster-"))
        self.ports = [free_port_pair(10000) for _ in range(masters * 2)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.frozen: set[int] = set()
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def _argv(self, port: int) -> list[str]:
        return [
            self.server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
            "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS), "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--loglevel", "warning",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.workdir / f"node-{port}.log"),
        ]  # fmt: skip

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def start(self) -> None:
        for port in self.ports:
            self.procs[port] = subprocess.Popen(self._argv(port), stdout=subprocess.DEVNULL)
        self._until(lambda: all(self._answers(p) for p in self.ports), 15, "the nodes to start")
        subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self._until(self._ok, 30, "the cluster to be ready")
        self._until(self._synced, 30, "the replicas to sync")

    def _synced(self) -> bool:
        """Every replica's link to its master up (a replica never synced is not promoted)."""
        for port in self.ports:
            if port in self.frozen or not self._answers(port):
                return False
            with self._client(port) as client:
                info = client.info("replication")
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def _answers(self, port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                pass
            with self._client(port) as client:
                return bool(client.ping())
        except (OSError, redis.RedisError):
            return False

    def _ok(self) -> bool:
        """The cluster says ok, and as many masters serve slots as it was created with."""
        port = next(p for p in self.ports if p not in self.frozen and self._answers(p))
        with self._client(port) as client:
            if client.cluster("info").get("cluster_state") != "ok":
                return False
        return len(self.masters()) == len(self.ports) // 2

    def _until(self, check: Callable[[], bool], within: float, what: str) -> None:
        give_up = time.monotonic() + within
        while not check():
            if time.monotonic() > give_up:
                logs = "\n".join(p.read_text()[-800:] for p in self.workdir.glob("node-*.log"))
                raise RuntimeError(f"timed out waiting for {what}:\n{logs}")
            time.sleep(0.2)

    def masters(self) -> list[int]:
        """The ports of the masters that answer and serve slots."""
        found = []
        for port in self.ports:
            if port in self.frozen or not self._answers(port):
                continue
            with self._client(port) as client:
                info = client.execute_command("ROLE")
            if info[0] in (b"master", "master") and self._serves_slots(port):
                found.append(port)
        return found

    def _serves_slots(self, port: int) -> bool:
        with self._client(port) as client:
            for line in client.execute_command("CLUSTER", "NODES").decode().splitlines():
                fields = line.split()
                if "myself" in fields[2]:
                    return len(fields) > 8
        return False

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def freeze(self) -> str:
        port = self.rng.choice(self.masters())
        os.kill(self.procs[port].pid, signal.SIGSTOP)
        self.frozen.add(port)
        return f"master {port}"

    def master_of(self, key: str) -> int:
        """The port of the master serving ``key``'s slot."""
        with self._client(self.ports[0]) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        port = self._serving(slot)
        assert port is not None, f"no master serves slot {slot}"
        return port

    def _serving(self, slot: int) -> int | None:
        """The port of the master of ``slot`` as a node other than the frozen ones sees it."""
        live = next(p for p in self.ports if p not in self.frozen and self._answers(p))
        with self._client(live) as client:
            for first, last, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if first <= slot <= last:
                    return int(master[1])
        return None

    def freeze_port(self, port: int) -> None:
        os.kill(self.procs[port].pid, signal.SIGSTOP)
        self.frozen.add(port)

    def failed_over(self, key: str, port: int, within: float = 30) -> None:
        """Wait until a node other than ``port`` serves ``key``'s slot and the cluster is ok
        without it (its replica promoted while it is frozen)."""
        with self._client(next(p for p in self.ports if p != port)) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        self._until(
            lambda: self._serving(slot) not in (None, port) and self._ok_without(port),
            within,
            f"a replica of {port} to be promoted",
        )

    def demoted(self, port: int, within: float = 30) -> None:
        """Wait until the node at ``port`` is a replica in sync with its master."""

        def synced() -> bool:
            if not self._answers(port):
                return False
            with self._client(port) as client:
                info = client.info("replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"

        self._until(synced, within, f"{port} to rejoin as a replica")

    def thaw(self) -> None:
        for port in list(self.frozen):
            os.kill(self.procs[port].pid, signal.SIGCONT)
            self.frozen.discard(port)

    def fill(self) -> str:
        """Every master over its ``maxmemory`` (set under what it uses): writes refused OOM."""
        for port in self.masters():
            with self._client(port) as client:
                used = int(client.info("memory")["used_memory"])
                client.config_set("maxmemory", max(1, used - 256 * 1024))
        return "every master's maxmemory set under its use"

    def unfill(self) -> None:
        for port in self.ports:
            if port not in self.frozen and self._answers(port):
                with self._client(port) as client:
                    client.config_set("maxmemory", 0)

    def read_only(self, dead_port: int) -> str:
        raise RuntimeError("REPLICAOF is not allowed in cluster mode")

    def writable(self) -> None:
        pass

    def restart_empty(self) -> str:
        """The index lost: every master flushed (FLUSHALL reaches the replicas too)."""
        for port in self.masters():
            with self._client(port) as client:
                client.flushall()
        return "every master flushed (the index lost)"

    def replicated(self, within_ms: int = 10_000) -> None:
        """Every write made so far on every master is held by its replica too. ``WAIT`` counts
        the replicas that acknowledged the writes *of the connection it is sent on*, so each
        master is first sent a write of its own (on a key of a slot it serves), then ``WAIT``
        on that connection: the replication stream is ordered, so everything before that write
        is covered. (``WAIT`` on a fresh connection answers at once, without waiting for a
        replica still catching up after its sync.)"""
        for port in self.masters():
            with self._client(port) as client:
                for n in itertools.count():
                    try:  # a key of another master's slot is answered MOVED
                        client.set(f"replicated:{{{n}}}", b"1", px=60_000)
                        break
                    except redis.ResponseError:
                        continue
                if client.execute_command("WAIT", 1, within_ms) < 1:
                    raise RuntimeError(f"master {port}'s replica did not catch up")

    def kill_master(self) -> str:
        """SIGKILL a master; wait for its replica's promotion, then restart it (empty: it
        rejoins as a replica)."""
        # not the node every process is given as REDIS_URL: a process restarting meanwhile
        # could not find the cluster
        port = self.rng.choice([p for p in self.masters() if p != self.ports[0]])
        started = time.monotonic()
        self.procs[port].kill()
        self.procs[port].wait(10)
        try:
            self._until(
                lambda: len(self.masters()) == len(self.ports) // 2 and self._ok_without(port),
                30,
                "a replica's promotion",
            )
            promoted = time.monotonic() - started
        finally:  # back, promoted or not
            self.procs[port] = subprocess.Popen(self._argv(port), stdout=subprocess.DEVNULL)
        self._until(self._ok, 30, "the killed master to rejoin")
        self._until(self._synced, 30, "the rejoined node to sync")
        return f"master {port} killed, replica promoted in {promoted:.1f} s, rejoined"

    def _ok_without(self, port: int) -> bool:
        live = next(
            p for p in self.ports if p != port and p not in self.frozen and self._answers(p)
        )
        with self._client(live) as client:
            return bool(client.cluster("info").get("cluster_state") == "ok")

    def healthy(self) -> None:
        self.thaw()
        self.unfill()
        self._until(self._ok, 30, "the cluster to be whole")
