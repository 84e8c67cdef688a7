"""``coalescer listen`` through a whole broker restart: a RabbitMQ node of the test's own (the
shared one serves the rest of the suite) is stopped and started again under a running consumer,
which reconnects by itself, finds its durable queue and loses no event."""

# The prefix fixture is shared with test_pulse.py by importing it, which pytest supports and ruff
# takes for a redefinition.
# ruff: noqa: F811

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest

from coalescer.store import Store
from tests.conftest import make_message
from tests.integration.test_pulse import (  # noqa: F401  (fixture)
    Broker,
    eventually,
    ids,
    needs_rabbitmqctl,
    prefix,
    routes,
)
from tests.integration.test_pulse_process import Listen, pending_count
from tests.ports import free_port_pair

#: Where Debian's package keeps the server's own scripts (``/usr/sbin``'s wrappers switch to the
#: ``rabbitmq`` user, and with it to the shared node's files).
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")


class Node:
    """A RabbitMQ node of this test's own: its name, ports, data and logs under ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        server = RABBITMQ_BIN / "rabbitmq-server"
        if not server.exists():
            pytest.fail(f"{server} not found: apt-get install rabbitmq-server")
        self.workdir = workdir
        self.name = f"coalescer-{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port_pair(20000)
        (workdir / "enabled_plugins").write_text("[].\n")  # no management listener to collide
        self.env = {
            **os.environ,
            "HOME": str(workdir),  # the node's Erlang cookie, shared with rabbitmqctl below
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.port + 20000),
            "RABBITMQ_MNESIA_BASE": str(workdir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(workdir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(workdir / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(workdir / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(workdir / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(workdir / "pid"),
        }
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _run(self, *argv: str, timeout: float = 90) -> None:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            logs = "\n".join(
                p.read_text(errors="replace")[-3000:] for p in self.workdir.glob("log/*.log")
            )
            pytest.fail(f"{' '.join(argv)} failed: {done.stdout}{done.stderr}\n{logs}")

    def start(self) -> None:
        ctl = str(RABBITMQ_BIN / "rabbitmqctl")
        self._run(str(RABBITMQ_BIN / "rabbitmq-server"), "-detached")
        self._run(ctl, "-n", self.name, "wait", str(self.workdir / "pid"), "--timeout", "60")

    def stop(self) -> None:
        self._run(str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, "stop")

    def kill(self) -> None:
        """Whatever is left of the node, at the end of the test."""
        pid_file = self.workdir / "pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    workdir = tmp_path / "rabbitmq"
    workdir.mkdir()
    started = Node(workdir)
    started.start()
    yield started
    started.kill()


@pytest.fixture
async def publisher(node: Node, prefix: str) -> AsyncIterator[Broker]:
    connection = await aio_pika.connect(node.url)
    broker = Broker(connection, prefix)
    await broker.setup()
    yield broker
    if not broker.connection.is_closed:
        await broker.connection.close()


async def reconnect(broker: Broker, url: str) -> None:
    """The publisher's side of the restart: a new connection, the same durable exchanges."""
    broker.connection = await aio_pika.connect(url)
    await broker.setup()


@needs_rabbitmqctl
async def test_the_consumer_rides_out_a_broker_restart_and_loses_nothing(
    node: Node,
    publisher: Broker,
    store: Store,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COALESCER_", "PULSE_"))}
    env.update(
        REDIS_URL=redis_url,
        PULSE_URL=node.url,
        PULSE_QUEUE=publisher.queue,
        COALESCER_ROUTE_PREFIX=prefix,
        COALESCER_LOG_FORMAT="text",
    )
    tasks = ids(3000)
    messages = [make_message(t, routes=routes(prefix, "k")) for t in tasks]
    listen = Listen(env, tmp_path / "listen.log")
    try:
        await listen.started()
        await publisher.publish_all(messages[:1000])
        await eventually(lambda: _reached(store, 1000), what="the first thousand")
        # A burst the consumer cannot have finished when the broker goes down: what is left of
        # it waits, persistent, in the durable queue.
        await publisher.publish_all(messages[1000:2000])
        await publisher.connection.close()
        node.stop()
        assert listen.proc.poll() is None, listen.output()

        node.start()
        await reconnect(publisher, node.url)
        await publisher.publish_all(messages[2000:])
        await eventually(lambda: _reached(store, len(tasks)), within=60, what="every event")
        assert listen.proc.poll() is None
        assert "reconnected to the broker; consuming again" in listen.output()
        assert await publisher.depth() == 0
        assert await publisher.dead() == []
        listen.proc.send_signal(signal.SIGTERM)
        assert await listen.exited() == 0, listen.output()
    finally:
        listen.kill()
    assert await pending_count(store) == len(tasks)


async def _reached(store: Store, count: int) -> bool:
    return await pending_count(store) >= count
