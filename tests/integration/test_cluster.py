"""The index on a real three-node Redis Cluster, started for this module."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coalescer.model import TaskEvent
from coalescer.settings import Settings
from coalescer.store import Store, open_store
from coalescer.web.app import create_app
from tests.ports import free_port_pair
from tests.web.conftest import AUTH, at, ids

NOW = 1_893_456_000_000


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        pytest.fail("redis-server and redis-cli are needed: apt-get install redis-server")
    workdir = tempfile.mkdtemp(prefix="coalescer-cluster-")
    ports = [free_port_pair(10000) for _ in range(3)]
    procs = [
        subprocess.Popen(
            [
                server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"{workdir}/nodes-{port}.conf",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
                "--loglevel",
                "warning",
                "--logfile",
                f"{workdir}/node-{port}.log",
            ],
            stdout=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        deadline = time.monotonic() + 10
        while not all(_up(port) for port in ports):
            exited = [p for p, proc in zip(ports, procs, strict=True) if proc.poll() is not None]
            if exited or time.monotonic() > deadline:
                pytest.fail(f"the cluster's nodes did not start:\n{_logs(workdir, ports)}")
            time.sleep(0.05)
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{p}" for p in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while not _ready(cli, ports[0]):
            if time.monotonic() > deadline:
                pytest.fail("the cluster did not become ready")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _logs(workdir: str, ports: list[int]) -> str:
    lines = []
    for port in ports:
        log = Path(workdir) / f"node-{port}.log"
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


@pytest.fixture
async def cluster_store(cluster_url: str) -> AsyncIterator[Store]:
    store = await open_store(cluster_url, grace_seconds=3600)
    yield store
    await store.client.flushall()
    await store.close()


def ev(task: str, order: float, key: str, state: str = "pending") -> TaskEvent:
    return TaskEvent(task, 0, state, (key,), order, NOW + 3_600_000, NOW)


async def test_a_cluster_is_recognised_and_keys_spread_over_its_nodes(cluster_store: Store) -> None:
    assert cluster_store.fast is None  # the lean connection speaks to one node only
    keys = [f"k{i}" for i in range(20)]
    await cluster_store.apply([ev(f"t{i}", 1.0, key) for i, key in enumerate(keys)], now_ms=NOW)
    nodes = {cluster_store.client.get_node_from_key(f"co:{{{k}}}:p").name for k in keys}  # type: ignore[attr-defined]
    assert len(nodes) == 3
    counts = await cluster_store.pending_counts(keys, now_ms=NOW)
    assert set(counts.values()) == {1}


async def test_events_and_answers_on_a_cluster(cluster_store: Store) -> None:
    await cluster_store.apply([ev("a", 1, "x"), ev("b", 2, "x"), ev("c", 3, "x")], now_ms=NOW)
    await cluster_store.apply([ev("b", 2, "x", "running"), ev("b", 2, "x", "pending")], now_ms=NOW)
    assert [t.task_id for t in await cluster_store.pending("x", now_ms=NOW)] == ["a", "c"]
    snap = await cluster_store.snapshot("x", "b", now_ms=NOW, cap=32)
    assert (snap.pending, snap.newer, snap.newest) == (2, 1, ["c", "a"])


async def test_the_http_api_over_a_cluster(
    cluster_url: str, cluster_store: Store, message: Callable[..., dict[str, Any]]
) -> None:
    settings = Settings.from_environ({"REDIS_URL": cluster_url, "COALESCER_INGEST_TOKEN": "s3cret"})
    app = create_app(settings, cluster_store)
    a, b = ids(2)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        posted = await c.post(
            "/v1/events",
            json=[message(t, scheduled=at(i)) for i, t in enumerate((a, b))],
            headers=AUTH,
        )
        assert [r["status"] for r in posted.json()["results"]] == ["applied", "applied"]
        assert (await c.get(f"/k?taskId={a}")).json() == {"supersedes": [a, b]}
        assert (await c.get("/v1/stats")).json()["pending_count"] == "2"
