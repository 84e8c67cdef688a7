"""Run a command with a real Redis and RabbitMQ reachable, for the test suite.

Redis: ``COALESCER_TEST_REDIS_URL`` or ``REDIS_URL`` if set; else a throwaway ``redis-server``
on a free loopback port, stopped afterwards (and ``COALESCER_TEST_REDIS_OWN=1``: under
pytest-xdist each worker then starts one of its own, see tests/conftest.py). RabbitMQ: ``COALESCER_TEST_AMQP_URL`` or
``PULSE_URL`` if set; else the local broker on 127.0.0.1:5672 (started if installed but
stopped). A browser for the page tests: ``COALESCER_TEST_CHROMIUM`` if set, else Debian's
``chromium``. The en_US locale's definition, for a Redis run under it. Whatever is missing is
installed with apt-get (without recommended packages) when running as root, else named.
The command then runs with both URLs and the browser's path in its environment.

    python scripts/with_services.py pytest -q
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from urllib.parse import urlsplit


def say(message: str) -> None:
    print(f"[services] {message}", file=sys.stderr, flush=True)


def reachable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for(host: str, port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if reachable(host, port):
            return True
        time.sleep(0.2)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: How long an install waits for another apt-get to let go of the package lock.
APT_LOCK_SECONDS = 600


def install(package: str, why: str) -> bool:
    """Install Debian's ``package`` with apt-get when running as root; whether it was tried."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return False
    say(f"{why}: installing Debian's {package} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Another apt-get (a second test run setting up beside this one) holds the package lock
    # for a while: wait for it instead of failing.
    apt = ["apt-get", "-o", f"DPkg::Lock::Timeout={APT_LOCK_SECONDS}"]
    subprocess.run([*apt, "update", "-qq"], check=False, env=env)
    # Without recommends: chromium alone would bring about 115 packages the tests never use.
    install = [*apt, "install", "-y", "-qq", "--no-install-recommends", package]
    subprocess.run(install, check=True, env=env)
    return True


def ensure_binary(binary: str, package: str, hint: str | None = None) -> str:
    found = shutil.which(binary) or (
        f"/usr/sbin/{binary}" if os.path.exists(f"/usr/sbin/{binary}") else None
    )
    if found:
        return found
    if install(package, f"{binary} not found"):
        found = shutil.which(binary) or f"/usr/sbin/{binary}"
        if os.path.exists(found):
            return found
    if hint is None:
        name = "COALESCER_TEST_REDIS_URL" if "redis" in binary else "COALESCER_TEST_AMQP_URL"
        hint = f"point {name} at a running server"
    sys.exit(
        f"[services] {binary} is needed for the tests. Install it with "
        f"'sudo apt-get install {package}', or {hint}."
    )


def start_redis() -> tuple[str, subprocess.Popen[bytes], str]:
    binary = ensure_binary("redis-server", "redis-server")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="coalescer-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    if not wait_for("127.0.0.1", port, 10):
        proc.kill()
        sys.exit("[services] redis-server did not start within 10 s")
    say(f"started a throwaway redis-server on 127.0.0.1:{port}")
    return f"redis://127.0.0.1:{port}/0", proc, workdir


def ensure_rabbitmq() -> str:
    if reachable("127.0.0.1", 5672):
        return "amqp://guest:guest@127.0.0.1:5672/"
    binary = ensure_binary("rabbitmq-server", "rabbitmq-server")
    say("RabbitMQ is not running on 127.0.0.1:5672: starting it")
    subprocess.run([binary, "-detached"], check=False)
    if not wait_for("127.0.0.1", 5672, 60):
        sys.exit("[services] RabbitMQ did not start on 127.0.0.1:5672 within 60 s")
    return "amqp://guest:guest@127.0.0.1:5672/"


def ensure_chromium() -> str:
    """A headless browser for the page tests: ``COALESCER_TEST_CHROMIUM`` if set, else Debian's
    chromium (installed if missing). Playwright drives it; its own browser downloads are not
    used (no network here but the package registries)."""
    given = os.environ.get("COALESCER_TEST_CHROMIUM")
    if given:
        return given
    return ensure_binary("chromium", "chromium", "set COALESCER_TEST_CHROMIUM to a Chromium binary")


#: What tests/integration/test_collation.py compiles en_US.UTF-8 from (localedef), to run a
#: Redis whose Lua compares strings by a collation that is not byte order.
LOCALE_SOURCE = "/usr/share/i18n/locales/en_US"


def ensure_locale_source() -> None:
    if os.path.exists(LOCALE_SOURCE) or install("locales", f"{LOCALE_SOURCE} not found"):
        return
    sys.exit(
        f"[services] {LOCALE_SOURCE} is needed for the tests (a Redis run under en_US.UTF-8). "
        "Install it with 'sudo apt-get install locales'."
    )


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit(__doc__)
    env = dict(os.environ)
    redis_proc = None
    workdir = None
    redis_url = env.get("COALESCER_TEST_REDIS_URL") or env.get("REDIS_URL")
    if not redis_url:
        redis_url, redis_proc, workdir = start_redis()
        # Throwaway servers are fine here: under pytest-xdist each worker starts its own.
        env["COALESCER_TEST_REDIS_OWN"] = "1"
    amqp_url = env.get("COALESCER_TEST_AMQP_URL") or env.get("PULSE_URL") or ensure_rabbitmq()
    env["COALESCER_TEST_REDIS_URL"] = redis_url
    env["COALESCER_TEST_AMQP_URL"] = amqp_url
    if any("pytest" in arg for arg in argv):  # not for benchmarks
        env["COALESCER_TEST_CHROMIUM"] = ensure_chromium()  # the browser test
        ensure_binary("openssl", "openssl")  # certificates for the amqps test
        ensure_locale_source()  # a Redis under a locale that does not collate byte by byte
        if urlsplit(amqp_url).hostname in ("127.0.0.1", "localhost", "::1"):
            # the tests that cut connections and start a broker node of their own
            ensure_binary("rabbitmqctl", "rabbitmq-server")
    env.pop("REDIS_URL", None)
    try:
        return subprocess.call(argv, env=env)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
