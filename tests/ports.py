"""Free loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A port nothing listens on right now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port() -> int:
    """A port for a Redis Cluster node: it also listens on ``port + 10000`` (its bus).

    The kernel's ephemeral ports reach 60999, where the bus port would not exist, so the
    port is drawn from 20000-45000 and both it and its bus port must be free.
    """
    for _ in range(200):
        port = random.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair (p, p+10000) for a Redis Cluster node on 127.0.0.1")
