"""``coalescer demo``: the emulator, the service and workers as real processes; it shows
superseding as it happens, stops by itself after ``--duration`` and cleanly on Ctrl-C."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from coalescer.demo.processes import free_port as demo_free_port
from tests.ports import free_port

#: A primary's line: ``0:05  linux64-tests    ran PrilqfdLTxqZ3OkHgV4Cfw, superseding 2 older:
#: …``, with whole ids, then the URL of its page on the service.
RAN = re.compile(
    r"(\S+)\s+ran ([\w-]{22}), superseding (\d+) older: ([\w-]{22}(?:, [\w-]{22})*)\n"
    r"\s+(http://\S+/tasks/\S+)"
)


def closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class DemoProcess:
    """``coalescer demo`` as a subprocess, its output collected as it comes."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port, self.emulator_port = free_port(), free_port()
        self.argv = [
            sys.executable,
            "-m",
            "coalescer.cli",
            "demo",
            "--port",
            str(self.port),
            "--emulator-port",
            str(self.emulator_port),
            "--log-dir",
            str(tmp_path / "demo-logs"),
            *args,
        ]
        self.output = ""
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def service(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> DemoProcess:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while chunk := await self.proc.stdout.read(4096):
            self.output += chunk.decode(errors="replace")

    async def wait_for(self, pattern: re.Pattern[str] | str, within: float) -> re.Match[str]:
        give_up = time.monotonic() + within
        while not (found := re.search(pattern, self.output)):
            assert self.proc is not None
            if self.proc.returncode is not None or time.monotonic() > give_up:
                raise AssertionError(f"no {pattern!r} in the demo's output:\n{self.output}")
            await asyncio.sleep(0.1)
        return found

    async def exited(self, within: float) -> int:
        assert self.proc is not None and self._reader is not None
        try:
            code = await asyncio.wait_for(self.proc.wait(), within)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise AssertionError(f"the demo did not exit in {within} s:\n{self.output}") from None
        await self._reader
        return code

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
            await self.exited(45)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_the_demo_shows_superseding_and_stops_by_itself(tmp_path: Path) -> None:
    demo = await DemoProcess(tmp_path, "--duration", "25", "--interval", "0.5").start()
    try:
        await demo.wait_for(f"Open {demo.service}/", within=40)
        await rebuilt_without_banner(demo.service)
        ran = await demo.wait_for(RAN, within=30)
        assert ran.group(1) in ("linux64-tests", "windows11-tests", "macos-build")
        assert int(ran.group(3)) >= 1 and ran.group(5).startswith(demo.service + "/tasks/")
        assert len(ran.group(4).split(", ")) == int(ran.group(3))
        assert await demo.exited(within=60) == 0
    finally:
        await demo.stop()
    done = re.search(r"Done: pushed (\d+) tasks; (\d+) ran, superseding (\d+)\.", demo.output)
    assert done, demo.output
    pushed, ran_count, superseded = map(int, done.groups())
    assert pushed >= 20 and ran_count >= 1 and superseded >= 1
    assert closed(demo.port) and closed(demo.emulator_port)
    logs = sorted(p.name for p in (tmp_path / "demo-logs").iterdir())
    assert logs == ["emulator.log", "service.log", "worker-1.log", "worker-2.log"]


async def rebuilt_without_banner(service: str, within: float = 20) -> None:
    """The service's embedded store is rebuilt from the emulator at start: the heartbeat's
    index check turns ok, and the pages stop saying that superseding is incomplete."""
    give_up = time.monotonic() + within
    async with httpx.AsyncClient(base_url=service, timeout=5) as http:
        while (await http.get("/__heartbeat__")).json()["checks"]["index"] != "ok":
            assert time.monotonic() < give_up, (await http.get("/__heartbeat__")).text
            await asyncio.sleep(0.1)
        page = await http.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 200 and "Superseding is incomplete" not in page.text


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_ctrl_c_stops_the_demo_and_everything_it_started(tmp_path: Path) -> None:
    demo = await DemoProcess(tmp_path, "--duration", "600", "--workers", "1").start()
    try:
        await demo.wait_for(f"Open {demo.service}/", within=40)
        assert demo.proc is not None
        demo.proc.send_signal(signal.SIGINT)
        assert await demo.exited(within=45) == 0
    finally:
        await demo.stop()
    assert "Done: pushed" in demo.output and "Traceback" not in demo.output
    assert closed(demo.port) and closed(demo.emulator_port)


@pytest.mark.integration
def test_the_port_probe_takes_a_port_a_finished_demo_left_in_time_wait() -> None:
    """A demo run again within a minute finds its ports free: the previous run's connections
    linger in TIME_WAIT on them, which keeps no server from listening there."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server side closes first: its end waits in TIME_WAIT
            client.recv(1)
    assert not _bindable_without_reuse(port)  # the lingering connection is there
    assert demo_free_port(port) == port
    with socket.socket() as listening:  # a port a server listens on is still refused
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", port))
        listening.listen()
        assert demo_free_port(port) != port


def _bindable_without_reuse(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
