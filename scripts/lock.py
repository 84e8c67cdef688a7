"""The two files pinned from ``pyproject.toml``'s ranges, by ``uv pip compile``.

* ``requirements.txt``: the deploy lock. The runtime dependencies at the newest versions the
  ranges allowed when it was last refreshed, each with the hashes of its files, for every
  platform (``--universal``). What a Heroku-style build and ``deploy/Dockerfile`` install.
  Resolved together with the test extra (as constraints), so that the suite can run on exactly
  these versions: a test tool's cap (schemathesis on jsonschema-rs) caps what ships too.
* ``constraints-lowest.txt``: the lowest-direct resolution. Every direct dependency, the test
  extra's included, at its declared lower bound (what lies beneath at the newest that allows),
  for Linux and Python 3.11: what ``make test`` installs into ``.venv-lowest`` to run the suite
  a second time, at the bottom of the ranges.

    python scripts/lock.py           write both (``make lock``)
    python scripts/lock.py --check   exit 1, saying what differs, if either is out of date

Each file is regenerated with its current pins as preferences (uv keeps a pin the ranges still
allow), so a release on the registry changes nothing and ``--check`` fails only when
``pyproject.toml`` asks for something the files do not hold. ``make lock`` after editing the
ranges; ``rm requirements.txt && make lock`` to move every pin to the newest release.
Comment lines (uv's annotations) are not compared: only pins and hashes.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.11"

#: file -> the options of ``uv pip compile`` that make it.
FILES: dict[str, list[str]] = {
    "requirements.txt": ["--universal", "--generate-hashes"],
    "constraints-lowest.txt": [
        "--extra",
        "test",
        "--resolution",
        "lowest-direct",
        "--python-platform",
        "linux",
    ],
}

HEADER = {
    "requirements.txt": (
        "# The deploy lock: coalescer's runtime dependencies, pinned with hashes from\n"
        "# pyproject.toml by scripts/lock.py (`make lock`; `make test` checks it is current).\n"
        "# Install with `pip install --require-hashes -r requirements.txt`, then coalescer itself\n"
        "# (`pip install --no-deps .`, or run it from the source tree: `python -m coalescer`).\n"
    ),
    "constraints-lowest.txt": (
        "# The lowest-direct resolution of pyproject.toml (the test extra included): every direct\n"
        "# dependency at its lower bound. Made by scripts/lock.py (`make lock`); `make test`\n"
        "# runs the suite again in .venv-lowest, installed under these constraints.\n"
    ),
}


def uv() -> str:
    found = shutil.which("uv", path=os.path.dirname(sys.executable)) or shutil.which("uv")
    if not found:
        sys.exit("[lock] uv is needed: pip install -e '.[test]'")
    return found


def compile_to(name: str, out: Path) -> None:
    """``name`` compiled into ``out``, whose current pins (if any) are preferred."""
    command = [uv(), "pip", "compile", "pyproject.toml", "--quiet", "--no-header"]
    command += ["--python-version", PYTHON, *FILES[name], "--output-file", str(out)]
    if name == "requirements.txt":
        # The runtime and the test extra resolved together first (the current pins preferred):
        # the deploy lock then holds versions the whole suite can be installed with.
        together = out.with_name("with-test.txt")
        if out.exists():
            shutil.copyfile(out, together)
        _run(
            [
                uv(),
                "pip",
                "compile",
                "pyproject.toml",
                "--quiet",
                "--no-header",
                "--extra",
                "test",
                "--universal",
                "--python-version",
                PYTHON,
                "--output-file",
                str(together),
            ],
            f"{name} (with the test extra)",
        )
        command += ["--constraint", str(together)]
    _run(command, name)
    out.write_text(HEADER[name] + out.read_text())


def _run(command: list[str], what: str) -> None:
    # From the registry (PyPI, or UV_INDEX_URL): uv's --offline resolves from whatever its
    # cache happens to hold, which is not the lowest version a new bound allows.
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"[lock] uv pip compile failed for {what}:\n{done.stderr}")


def pins(text: str) -> list[str]:
    return [
        line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        sys.exit(__doc__)
    stale = []
    with tempfile.TemporaryDirectory(prefix="coalescer-lock-") as tmp:
        for name in FILES:
            current = ROOT / name
            fresh = Path(tmp) / name
            if current.exists():
                shutil.copyfile(current, fresh)
            compile_to(name, fresh)
            old = current.read_text() if current.exists() else ""
            if pins(old) == pins(fresh.read_text()):
                if not check and old != fresh.read_text():
                    shutil.copyfile(fresh, current)  # annotations only
                continue
            if check:
                stale.append(name)
                diff = difflib.unified_diff(
                    pins(old), pins(fresh.read_text()), name, f"{name} (from pyproject.toml)"
                )
                sys.stderr.writelines(line + "\n" for line in list(diff)[:40])
            else:
                shutil.copyfile(fresh, current)
                print(f"[lock] wrote {name}", file=sys.stderr)
    if stale:
        print(
            f"[lock] {', '.join(stale)} out of date with pyproject.toml: run `make lock` "
            "and commit the result",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
