"""Private scratch directories that outlive no process for long: each is named after the process
that made it (``<prefix><pid>@<host>-<random>``), and the next process to make one with the same
prefix on the same host removes those whose process is gone (SIGKILLed, or killed by the
kernel's OOM killer, it could not remove its own). A directory of a process still running, or
of another host sharing the temporary directory, is left alone."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def sweep(prefix: str) -> list[Path]:
    """Remove the directories ``prefix`` names that a process of this host left when it died;
    the ones removed."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)@" + re.escape(_host()) + "-")
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*@*-*"):
        found = pattern.match(path.name)
        if found and path.is_dir() and not _running(int(found.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d scratch directories of stopped processes: %s*", len(removed), prefix)
    return removed


def make(prefix: str) -> Path:
    """A new private directory (removing what dead processes left under ``prefix``)."""
    sweep(prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}@{_host()}-"))


@contextlib.contextmanager
def directory(prefix: str) -> Iterator[Path]:
    """:func:`make`, removed at the end."""
    path = make(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
