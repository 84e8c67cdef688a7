"""The soak's processes: each a command in its own process group, logging to a file, kept by
name so that a fault can SIGKILL it and the runner restart it with the same command, as a
platform restarts a crashed process. Their resident memory is sampled from ``/proc``."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


@dataclasses.dataclass
class Member:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes]
    starts: int = 1


class Cast:
    """Started processes by name; all stopped (their whole groups) by :meth:`stop_all`."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.members: dict[str, Member] = {}
        self.exits: list[tuple[float, str, int]] = []  # unexpected exits: (time, name, code)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as out:
            return subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: SIGKILL reaches serve's workers too
            )

    def start(self, name: str, args: list[str], env: dict[str, str], *, module: str = "") -> None:
        """Run ``coalescer <args>`` (or ``python -m <module> <args>``) as ``name``."""
        argv = [sys.executable, "-m", module or "coalescer.cli", *args]
        self.members[name] = Member(name, argv, env, self._spawn(name, argv, env))

    def restart(self, name: str) -> None:
        member = self.members[name]
        self._reap(member)
        with open(self.logs / f"{name}.log", "ab") as out:
            out.write(f"\n---- soak: restarted at {time.time():.3f} ----\n".encode())
        member.proc = self._spawn(name, member.argv, member.env)
        member.starts += 1

    def kill(self, name: str) -> None:
        """SIGKILL the process and its group (no chance to clean up)."""
        member = self.members[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(member.proc.pid, signal.SIGKILL)
        member.proc.wait(10)

    def stop(self, name: str, timeout: float = 30.0) -> int | None:
        """SIGTERM the process's group and wait for it to exit; its exit code (``None``: it
        outlived ``timeout`` and was SIGKILLed)."""
        member = self.members[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(member.proc.pid, signal.SIGTERM)
        try:
            return member.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._reap(member)
            return None

    def _reap(self, member: Member) -> None:
        if member.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(member.proc.pid, signal.SIGKILL)
            member.proc.wait(10)

    def dead(self) -> list[str]:
        """The members that exited on their own (not killed by a fault); recorded and listed."""
        found = []
        for name, member in self.members.items():
            code = member.proc.poll()
            if code is not None and code != -signal.SIGKILL:
                found.append(name)
                self.exits.append((time.time(), name, code))
        return found

    def pid(self, name: str) -> int:
        return self.members[name].proc.pid

    def rss(self, name: str) -> int:
        """Resident bytes of the process and its children (serve's web processes)."""
        total = 0
        for pid in _tree(self.pid(name)):
            total += _rss(pid)
        return total

    def output(self, name: str, tail: int = 3000) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-tail:]

    def stop_all(self, order: list[str] | None = None) -> None:
        names = [n for n in order or [] if n in self.members]
        names += [n for n in self.members if n not in names]
        for name in names:
            proc = self.members[name].proc
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for name in names:
            member = self.members[name]
            try:
                member.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            self._reap(member)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(member.proc.pid, signal.SIGKILL)  # stragglers of the group


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
                todo.extend(int(c) for c in children)
    return found


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
