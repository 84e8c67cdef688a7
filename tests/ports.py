"""Free loopback ports for the servers the tests start."""

from __future__ import annotations

import os
import random
import socket

#: RabbitMQ's command-line tools take ports from this range for their Erlang distribution.
_RABBITMQ_CLI = range(35672, 35683)


#: Ports already handed out by this process (two servers started together never share one).
_handed: set[int] = set()


def free_port() -> int:
    """A port nothing listens on right now, for one server a test starts.

    Drawn at random below the kernel's ephemeral ports (no outgoing connection takes it before
    the server binds it), from this process's own slice (:func:`_slice`): two tests that run at
    once, in other workers or in the other pass of ``make test``, never draw the same port,
    and this process never hands one out twice.
    """
    share = _slice()
    for _ in range(500):
        port = random.randrange(share.start, share.stop)
        if port not in _handed and port not in _RABBITMQ_CLI and _bindable(port):
            _handed.add(port)
            return port
    _handed.clear()  # a long session has used its slice up: ports handed out long ago are free
    return free_port()


def _slice() -> range:
    """One of 16 slices of the ports between 10000 and the ephemeral range: by pytest-xdist
    worker (``gw0``, ``gw1``, ...) and by pass (``make test`` runs the lowest-versions pass
    beside the newest with ``TEST_PASS=lowest``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = (int(worker) if worker.isdigit() else 0) % 8
    if os.environ.get("TEST_PASS") == "lowest":
        index += 8
    low, high = 10000, _ephemeral().start
    if high - low < 16 * 100:
        low, high = 20000, 45000
    size = (high - low) // 16
    return range(low + index * size, low + (index + 1) * size)


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
