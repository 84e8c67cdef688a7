"""Free loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket

#: RabbitMQ's command-line tools take ports from this range for their Erlang distribution.
_RABBITMQ_CLI = range(35672, 35683)


def free_port() -> int:
    """A port nothing listens on right now (the kernel's choice, outside RabbitMQ's CLI range)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _RABBITMQ_CLI:
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_pair(offset: int) -> int:
    """A free port ``p`` whose companion ``p + offset`` is free too, for servers that listen on
    both: a Redis Cluster node's bus (+10000), a RabbitMQ node's distribution port (+20000).

    The kernel's ephemeral ports reach 60999, where the companion might not exist, so ``p`` is
    drawn from 20000-45000.
    """
    for _ in range(200):
        port = random.randint(20000, 45000)
        pair = (port, port + offset)
        if all(p not in _RABBITMQ_CLI and _bindable(p) for p in pair):
            return port
    raise RuntimeError(f"no free port pair (p, p+{offset}) on 127.0.0.1")
