"""``coalescer listen`` against a RabbitMQ node of the test's own (the shared one serves the rest
of the suite): through a whole broker restart, which it rides out by itself, finding its durable
queue and losing no event; and over TLS (``amqps://``), with a certificate it must verify."""

# The prefix fixture is shared with test_pulse.py by importing it, which pytest supports and ruff
# takes for a redefinition.
# ruff: noqa: F811

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
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
from tests.integration.test_pulse_process import Listen, listen_environ, pending_count
from tests.ports import free_port, free_port_pair

#: The node's tools start an Erlang VM each, and the node boots: slow on a busy machine.
pytestmark = pytest.mark.timeout(420)

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
        self.tls_port = free_port()
        self.ca = make_certificates(workdir)
        (workdir / "rabbitmq.conf").write_text(
            f"listeners.ssl.default = {self.tls_port}\n"
            f"ssl_options.cacertfile = {self.ca}\n"
            f"ssl_options.certfile = {workdir / 'server.pem'}\n"
            f"ssl_options.keyfile = {workdir / 'server.key'}\n"
            "ssl_options.verify = verify_none\n"
            "ssl_options.fail_if_no_peer_cert = false\n"
        )
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
            "ERL_CRASH_DUMP": str(workdir / "erl_crash.dump"),  # not in the checkout
        }
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self.tls_url = f"amqps://guest:guest@127.0.0.1:{self.tls_port}/"

    def _run(self, *argv: str, timeout: float = 200) -> None:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            logs = "\n".join(
                p.read_text(errors="replace")[-3000:] for p in self.workdir.glob("log/*.log")
            )
            pytest.fail(f"{' '.join(argv)} failed: {done.stdout}{done.stderr}\n{logs}")

    def start(self) -> None:
        ctl = str(RABBITMQ_BIN / "rabbitmqctl")
        self._run(str(RABBITMQ_BIN / "rabbitmq-server"), "-detached")
        # A node boots in about 2 s on a quiet machine, and took over a minute on a busy one.
        self._run(ctl, "-n", self.name, "wait", str(self.workdir / "pid"), "--timeout", "180")

    def stop(self) -> None:
        self._run(str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.name, "stop")

    def kill(self) -> None:
        """SIGKILL the node (a crash, or whatever is left at the end of the test); returns once
        it is gone."""
        pid_file = self.workdir / "pid"
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            return
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        pytest.fail(f"the broker node (pid {pid}) outlived SIGKILL")


def make_certificates(workdir: Path) -> Path:
    """A private CA and a server certificate for 127.0.0.1 it signed; returns the CA's file."""

    if shutil.which("openssl") is None:
        pytest.fail("openssl not found: apt-get install openssl")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=coalescer test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (workdir / "san.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    )
    return workdir / "ca.pem"


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
@pytest.mark.parametrize("down", ["stop", "kill"])
async def test_the_consumer_rides_out_a_broker_restart_and_loses_nothing(
    down: str,
    node: Node,
    publisher: Broker,
    store: Store,
    redis_url: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    env = listen_environ(node.url, redis_url, publisher.queue, prefix)
    tasks = ids(3000)
    messages = [make_message(t, routes=routes(prefix, "k")) for t in tasks]
    listen = Listen(env, tmp_path / "listen.log")
    try:
        await listen.started()
        await publisher.publish_all(messages[:1000])
        await eventually(lambda: _reached(store, 1000), what="the first thousand")
        # A burst the consumer cannot have finished when the broker goes down: what is left of
        # it waits, persistent (and confirmed: on disk), in the durable queue, whether the
        # broker stops or crashes (SIGKILL).
        await publisher.publish_all(messages[1000:2000])
        await publisher.connection.close()
        if down == "stop":
            node.stop()
        else:
            node.kill()
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


@needs_rabbitmqctl
async def test_amqps_with_a_verified_certificate(
    node: Node, publisher: Broker, store: Store, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    tasks = ids(50)
    env = listen_environ(f"{node.tls_url}?cafile={node.ca}", redis_url, publisher.queue, prefix)
    listen = Listen(env, tmp_path / "listen.log")
    try:
        await listen.started()
        await publisher.publish_all([make_message(t, routes=routes(prefix, "k")) for t in tasks])
        await eventually(lambda: _reached(store, len(tasks)), what="every event over TLS")
        listen.proc.send_signal(signal.SIGTERM)
        assert await listen.exited() == 0, listen.output()
    finally:
        listen.kill()


@needs_rabbitmqctl
async def test_an_untrusted_certificate_stops_listen_with_a_clear_message(
    node: Node, publisher: Broker, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    env = listen_environ(node.tls_url, redis_url, publisher.queue, prefix)
    listen = Listen(env, tmp_path / "listen.log")
    try:
        assert await listen.exited(within=30) == 2, listen.output()
    finally:
        listen.kill()
    assert "certificate this machine does not trust" in listen.output()
    assert "SSL_CERT_FILE" in listen.output()


async def _reached(store: Store, count: int) -> bool:
    return await pending_count(store) >= count
