"""A throwaway three-node Redis Cluster on loopback, for the tests and the cluster benchmark."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.ports import free_port_pair


class ClusterFailed(RuntimeError):
    """The cluster could not be started; the message says why (with the nodes' logs)."""


@contextlib.contextmanager
def redis_cluster(nodes: int = 3) -> Iterator[str]:
    """Start ``nodes`` masters sharing the 16384 slots; yields a ``redis://`` URL of one."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise ClusterFailed("redis-server and redis-cli are needed: apt-get install redis-server")
    workdir = Path(tempfile.mkdtemp(prefix="coalescer-cluster-"))
    ports, procs = _start(server, workdir, nodes)
    try:
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports)]
        subprocess.run(
            [*create, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while not _ready(cli, ports[0]):
            if time.monotonic() > deadline:
                raise ClusterFailed(f"the cluster did not become ready:\n{_logs(workdir, ports)}")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _start(
    server: str, workdir: Path, nodes: int
) -> tuple[list[int], list[subprocess.Popen[bytes]]]:
    """The nodes, up and answering. A port checked free can be taken before a node binds it
    (a busy machine's outgoing connections draw from the same range as a node's bus port): a
    node that could not bind is started again on other ports, a few times."""
    for attempt in range(3):
        ports = [free_port_pair(10000) for _ in range(nodes)]  # each node's bus is port + 10000
        procs = [
            subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(workdir / f"nodes-{port}.conf"), "--save", "",
                 "--appendonly", "no", "--dir", str(workdir), "--loglevel", "warning",
                 "--logfile", str(workdir / f"node-{port}.log")],
                stdout=subprocess.DEVNULL,
            )
            for port in ports
        ]  # fmt: skip
        deadline = time.monotonic() + 10
        while not all(_up(port) for port in ports):
            if any(proc.poll() is not None for proc in procs) or time.monotonic() > deadline:
                logs = _logs(workdir, ports)
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.wait(timeout=10)
                if "Address already in use" in logs and attempt < 2:
                    break  # taken meanwhile: other ports
                raise ClusterFailed(f"the cluster's nodes did not start:\n{logs}")
            time.sleep(0.05)
        else:
            return ports, procs
    raise AssertionError("unreachable")


def _logs(workdir: Path, ports: list[int]) -> str:
    lines = []
    for port in ports:
        log = workdir / f"node-{port}.log"
        lines.append(f"node {port}: {log.read_text() if log.exists() else '(no log)'}")
    return "\n".join(lines)


def _up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _ready(cli: str, port: int) -> bool:
    out = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True)
    return "cluster_state:ok" in out.stdout
