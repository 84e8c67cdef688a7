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


def _ephemeral() -> range:
    """The kernel's ephemeral ports (outgoing connections take them at any moment)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port_pair(offset: int) -> int:
    """A free port ``p`` whose companion ``p + offset`` is free too, for servers that listen on
    both: a Redis Cluster node's bus (+10000), a RabbitMQ node's distribution port (+20000).

    Both are drawn below the kernel's ephemeral ports where there is room (from 10000), so that
    no outgoing connection takes one between this check and the server's bind (a RabbitMQ node
    then stops at boot: ``dist_port_already_used``); else from 20000-45000, the companion
    within 65535.
    """
    ephemeral = _ephemeral()
    low, high = (10000, ephemeral.start - offset - 1)
    if high - low < 1000:
        low, high = 20000, 45000
    for _ in range(200):
        port = random.randint(low, high)
        pair = (port, port + offset)
        if all(p not in _RABBITMQ_CLI and _bindable(p) for p in pair):
            return port
    raise RuntimeError(f"no free port pair (p, p+{offset}) on 127.0.0.1")
