"""``coalescer`` — the command line: serve, listen, reconcile, worker, emulator, demo.

Errors become one-line messages and exit codes: 2 for bad settings or arguments, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from coalescer import __version__, scratch
from coalescer.errors import CoalescerError, ConfigError
from coalescer.settings import Settings, workers

if TYPE_CHECKING:
    from starlette.applications import Starlette

log = logging.getLogger("coalescer")
#: How ``serve --workers`` tells its worker processes its pid (see _end_with_serve).
_SERVE_PID = "COALESCER_SERVE_PID"
_PR_SET_PDEATHSIG = 1

#: Modules that add their own subcommands with ``register(subparsers)``.
PLUGINS = (
    "coalescer.ingest.cli",
    "coalescer.worker.cli",
    "coalescer.emulator.cli",
    "coalescer.policy.cli",
    "coalescer.replay.cli",
    "coalescer.demo",
)


def _workers(args: argparse.Namespace, settings: Settings) -> int:
    """``--workers``, else ``WEB_CONCURRENCY`` (the PaaS convention), else 1."""
    if args.workers is None:
        return settings.web_concurrency
    return workers("--workers", str(args.workers))


def _port(args: argparse.Namespace, settings: Settings) -> int:
    port, name = (settings.port, "PORT") if args.port is None else (args.port, "--port")
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name} must be from 1 to 65535 (0: any free port), not {port}")
    return port


def worker_app() -> Starlette:
    """The app of one ``serve --workers N`` process (uvicorn's factory, called in each)."""
    from coalescer import logs
    from coalescer.web.app import create_app

    settings = Settings.from_environ()
    _end_with_serve(settings.serve_pid)
    logs.setup(settings.log_level, settings.log_json)
    return create_app(settings)


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.web.app import create_app
    from coalescer.web.connections import ConnectionLimits
    from coalescer.web.server import bind, hold, serve

    host = args.host or settings.host
    port = _port(args, settings)
    processes = _workers(args, settings)
    if processes > 1 and settings.redis_url is None:
        raise ConfigError(
            f"{processes} worker processes need REDIS_URL: the embedded store lives in one process"
        )
    limits = hold(
        ConnectionLimits(
            head_timeout=settings.head_timeout,
            idle_timeout=settings.idle_timeout,
            max_connections=settings.max_connections,
            report_seconds=settings.connection_report_seconds,
        )
    )
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    log.info(
        "serving on http://%s:%d (store: %s, %s)",
        f"[{host}]" if ":" in host else host,
        bound,
        "redis" if settings.redis_url else "embedded",
        f"{processes} worker processes" if processes > 1 else "one process",
    )
    try:
        if processes == 1:
            serve(
                create_app(settings),
                sock=sock,
                max_header_bytes=settings.max_header_bytes,
                limits=limits,
            )
        else:
            os.environ[_SERVE_PID] = str(os.getpid())
            with _metrics_dir(settings):
                serve(
                    f"{__name__}:worker_app",
                    sock=sock,
                    max_header_bytes=settings.max_header_bytes,
                    workers=processes,
                    limits=limits,
                )
    finally:
        sock.close()
    return 0


def _end_with_serve(serve_pid: int) -> None:
    """Have this worker process told to stop (SIGTERM) when ``serve`` ends, even killed
    outright (SIGKILL, when it cannot stop its workers): Linux's parent-death signal. A
    worker whose ``serve`` is already gone stops at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if serve_pid and os.getppid() != serve_pid:
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _metrics_dir(settings: Settings) -> Iterator[None]:
    """A private ``PROMETHEUS_MULTIPROC_DIR`` for the worker processes, so that ``/metrics``
        adds up every process's counters; removed at the end (or by the next ``serve`` if this one
    is killed). One already set is used as is (a
        process manager's, shared by several ``serve``): it is not emptied. (The worker processes
        read it through their :class:`Settings`, prometheus-client from their environment.)"""
    if settings.prometheus_multiproc_dir:
        yield
        return
    with scratch.directory("coalescer-metrics-") as path:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
        try:
            yield
        finally:
            del os.environ["PROMETHEUS_MULTIPROC_DIR"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coalescer",
        description="A superseder service for Taskcluster-style task queues, its worker shim, "
        "a queue emulator and their tools.",
    )
    parser.add_argument("--version", action="version", version=f"coalescer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="run the superseder web service",
        description="Serve the superseding queries (GET /<key>?taskId=), the pages, /metrics, "
        "the health checks and POST /v1/events, on the index in REDIS_URL (or, unset, an "
        "embedded store in this process, rebuilt from the queue at start when "
        "TASKCLUSTER_ROOT_URL is set). With PULSE_URL and the embedded store it also consumes "
        "the queue's events itself. Stops cleanly on SIGTERM.",
    )
    serve.add_argument("--host", help="interface to bind (default COALESCER_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default PORT or 8000; 0: any free port)")
    serve.add_argument(
        "--workers",
        help="web processes sharing the port (default WEB_CONCURRENCY or 1); more than one "
        "needs REDIS_URL",
    )
    serve.set_defaults(handler=_serve)
    for name in PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    _complete_help(parser)
    return parser


def _complete_help(parser: argparse.ArgumentParser) -> None:
    """Give every command a description (its one-line help, when it has none of its own) and
    append ``(default X)`` to the help of every option whose help does not say its default yet,
    so that ``--help`` and the generated reference show them all."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                line = helps.get(name)
                if not sub.description and line and line != argparse.SUPPRESS:
                    sub.description = f"{line[:1].upper()}{line[1:]}."
                _complete_help(sub)
            continue
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        if action.required:
            action.help = f"{action.help} (required)" if action.help else "required"
            continue
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS):
            continue
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        text = action.help or ""
        if "default" in text or f"({shown})" in text or f"({shown} " in text:
            continue
        action.help = f"{text} (default {shown})" if text else f"default {shown}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_environ()
    except ConfigError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 2
    from coalescer import logs

    logs.setup(settings.log_level, settings.log_json)
    handler: Callable[[argparse.Namespace, Settings], int] = args.handler
    try:
        return handler(args, settings)
    except ConfigError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 2
    except CoalescerError as exc:
        print(f"coalescer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
