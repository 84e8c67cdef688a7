"""Settings, read from the environment (12-factor) into one frozen dataclass.

Heroku's names are kept (``PORT``, ``REDIS_URL``); ours are prefixed ``COALESCER_``.
Nothing is read at import time: call :meth:`Settings.from_environ`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from coalescer.errors import ConfigError
from coalescer.history import Retention

if TYPE_CHECKING:
    from coalescer.policy.rules import Policy


class Secret:
    """A string that never prints itself."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def redact_url(url: str) -> str:
    """``redis://user:pw@host`` → ``redis://user:***@host``, for logs."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


#: ``COALESCER_LOG_LEVEL``'s values (any case), as the logging module names its levels.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: ``COALESCER_LOG_FORMAT``'s values (any case): one JSON object per line, or plain text.
LOG_FORMATS = ("json", "text")
#: More web processes than this is a typo, not a machine.
MAX_WORKERS = 256

_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


@dataclasses.dataclass(frozen=True)
class Settings:
    redis_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    route_prefix: str = "coalesce.v1"
    rank_tag: str | None = None
    max_list: int = 32
    grace_seconds: int = 3600
    #: ``COALESCER_MAX_KEYS``: coalescing keys the index holds at most; an event that would
    #: add another is not indexed under it (``limited``: its key answers ``[taskId]``)
    max_keys: int = 100_000
    #: ``COALESCER_MAX_TASKS``: tasks the index tracks at most (a task once per key it is
    #: under); an event of another task is not indexed (``limited``)
    max_tasks: int = 2_000_000
    #: ``COALESCER_MAX_FINDINGS``: bisection findings kept at most over every key (each for 30
    #: days); ``POST /v1/bisections`` refuses another (``507``)
    max_findings: int = 10_000
    ingest_token: Secret | None = None
    max_body_bytes: int = 1 << 20
    #: ``COALESCER_MAX_HEADER_BYTES``: largest request head (request line and headers)
    max_header_bytes: int = 16 << 10
    #: ``COALESCER_HEAD_TIMEOUT``: seconds a request head may take to arrive, once begun
    head_timeout: float = 10.0
    #: ``COALESCER_IDLE_TIMEOUT``: whole seconds a connection may wait for a request (its
    #: first, or its next: uvicorn's keep-alive timeout)
    idle_timeout: int = 5
    #: ``COALESCER_CONNECTION_REPORT_SECONDS``: while connections keep being closed (idle, slow
    #: heads, over the cap), seconds between the log's summaries of them
    connection_report_seconds: float = 10.0
    #: ``COALESCER_MAX_CONNECTIONS``: connections a web process keeps open at most; ``None``:
    #: 10,000, or fewer when its file descriptor limit allows fewer (coalescer.web.connections)
    max_connections: int | None = None
    taskcluster_root_url: str | None = None
    #: ``COALESCER_PUBLIC_URL``: the service's URL as people reach it, for the links in the logs
    #: of runs the enforcer supersedes
    public_url: str | None = None
    #: ``COALESCER_LEARN_UNKNOWN``: ask the queue about a queried task the index does not know
    #: (only with ``TASKCLUSTER_ROOT_URL``; see coalescer.ingest.learn)
    learn_unknown: bool = True
    #: ``COALESCER_LEARN_TIMEOUT``: seconds a query waits for the queue's answer at most
    learn_timeout: float = 2.0
    #: ``COALESCER_QUERY_TIMEOUT``: seconds a superseding query waits for Redis at most, below
    #: a worker's superseder timeout (docker-worker's was 5 s), so that workers get a clear
    #: 503 and run their task alone instead of timing out
    query_timeout: float = 2.0
    pulse_url: Secret | None = None
    pulse_queue: str | None = None
    pulse_prefetch: int = 2048
    pulse_max_length: int = 1_000_000
    #: ``COALESCER_RECORD_FILE``: append every applied event here (see coalescer.ingest.record)
    record_file: str | None = None
    #: ``COALESCER_RECORD_MAX_BYTES``: rotate the record file once at this size
    record_max_bytes: int = 256 << 20
    log_level: str = "INFO"
    log_json: bool = True
    #: ``COALESCER_POLICY_FILE``, read and validated at start (see coalescer.policy.rules)
    policy_file: str | None = None
    policy: Policy | None = None
    #: ``COALESCER_HISTORY_BUCKET_SECONDS``: the width of a bucket of the pages' charts
    history_bucket_seconds: int = 60
    #: ``COALESCER_HISTORY_BUCKETS``: how many buckets are kept (a minute each for 24 hours)
    history_buckets: int = 1440
    #: ``COALESCER_UPKEEP_SECONDS``: seconds between the upkeep's rounds (forget the keys whose
    #: tasks have all expired, count the index for ``/metrics``, sample the pages' charts)
    upkeep_seconds: float = 15.0
    #: ``WEB_CONCURRENCY`` (the PaaS convention): web processes of ``coalescer serve`` when
    #: ``--workers`` is not given
    web_concurrency: int = 1
    #: ``SOURCE_COMMIT``: the commit ``/__version__`` names (the Dockerfile's build argument)
    source_commit: str = "unknown"
    #: ``PROMETHEUS_MULTIPROC_DIR``: where web processes keep their metrics for ``/metrics`` to
    #: add up (prometheus-client reads it from the environment too)
    prometheus_multiproc_dir: str | None = None
    #: ``COALESCER_SERVE_PID``, set by ``serve --workers N`` for its web processes: its pid
    serve_pid: int = 0

    @property
    def retention(self) -> Retention:
        """The history kept for the pages' charts (see coalescer.history)."""
        return Retention(self.history_bucket_seconds * 1000, self.history_buckets)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value not in (None, "") else None

        def integer(name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise ConfigError(f"{name} must be a whole number, not {raw!r}") from None
            if value < minimum:
                raise ConfigError(f"{name} must be at least {minimum}, not {value}")
            if maximum is not None and value > maximum:
                raise ConfigError(f"{name} must be at most {maximum}, not {value}")
            return value

        def flag(name: str, default: bool) -> bool:
            raw = get(name)
            if raw is None:
                return default
            if raw.lower() not in _FLAGS:
                raise ConfigError(f"{name} must be true or false, not {raw!r}")
            return _FLAGS[raw.lower()]

        def seconds(name: str, default: float, maximum: float = 60) -> float:
            raw = get(name)
            if raw is None:
                return default
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{name} must be a number of seconds, not {raw!r}") from None
            if not 0 < value <= maximum:
                raise ConfigError(f"{name} must be more than 0 and at most {maximum:g}, not {raw}")
            return value

        def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
            raw = get(name)
            if raw is None:
                return default
            value = raw.strip().lower()
            if value not in (c.lower() for c in choices):
                raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {raw!r}")
            return value

        prefix = get("COALESCER_ROUTE_PREFIX") or cls.route_prefix
        if not _PREFIX_RE.fullmatch(prefix):
            raise ConfigError(f"COALESCER_ROUTE_PREFIX {prefix!r} is not a dotted route prefix")
        token = get("COALESCER_INGEST_TOKEN")
        pulse = amqp_url(get("PULSE_URL"))
        values: dict[str, Any] = dict(
            redis_url=_redis_url(get("REDIS_URL"), verify=flag("COALESCER_REDIS_TLS_VERIFY", True)),
            host=get("COALESCER_HOST") or cls.host,
            port=integer("PORT", cls.port, 0),
            route_prefix=prefix,
            rank_tag=get("COALESCER_RANK_TAG"),
            max_list=integer("COALESCER_MAX_LIST", cls.max_list, 1),
            grace_seconds=integer("COALESCER_GRACE_SECONDS", cls.grace_seconds, 0),
            max_keys=integer("COALESCER_MAX_KEYS", cls.max_keys, 1, 100_000_000),
            max_findings=integer("COALESCER_MAX_FINDINGS", cls.max_findings, 1, 10_000_000),
            max_tasks=integer("COALESCER_MAX_TASKS", cls.max_tasks, 1, 1_000_000_000),
            ingest_token=Secret(token) if token else None,
            max_body_bytes=integer("COALESCER_MAX_BODY_BYTES", cls.max_body_bytes, 1024),
            max_header_bytes=integer("COALESCER_MAX_HEADER_BYTES", cls.max_header_bytes, 1024),
            head_timeout=seconds("COALESCER_HEAD_TIMEOUT", cls.head_timeout),
            idle_timeout=integer("COALESCER_IDLE_TIMEOUT", cls.idle_timeout, 1, 3600),
            max_connections=(
                integer("COALESCER_MAX_CONNECTIONS", 0, 16, 1_000_000)
                if get("COALESCER_MAX_CONNECTIONS")
                else None
            ),
            connection_report_seconds=seconds(
                "COALESCER_CONNECTION_REPORT_SECONDS", cls.connection_report_seconds, 3600
            ),
            taskcluster_root_url=(get("TASKCLUSTER_ROOT_URL") or "").rstrip("/") or None,
            public_url=_http_url("COALESCER_PUBLIC_URL", get("COALESCER_PUBLIC_URL")),
            learn_unknown=flag("COALESCER_LEARN_UNKNOWN", cls.learn_unknown),
            learn_timeout=seconds("COALESCER_LEARN_TIMEOUT", cls.learn_timeout),
            query_timeout=seconds("COALESCER_QUERY_TIMEOUT", cls.query_timeout),
            pulse_url=Secret(pulse) if pulse else None,
            pulse_queue=get("PULSE_QUEUE"),
            pulse_prefetch=integer("COALESCER_PULSE_PREFETCH", cls.pulse_prefetch, 1),
            pulse_max_length=integer("COALESCER_PULSE_MAX_LENGTH", cls.pulse_max_length, 1),
            record_file=get("COALESCER_RECORD_FILE"),
            record_max_bytes=integer("COALESCER_RECORD_MAX_BYTES", cls.record_max_bytes, 1024),
            log_level=choice("COALESCER_LOG_LEVEL", cls.log_level, LOG_LEVELS).upper(),
            log_json=choice("COALESCER_LOG_FORMAT", "json", LOG_FORMATS) == "json",
            policy_file=get("COALESCER_POLICY_FILE"),
            history_bucket_seconds=integer(
                "COALESCER_HISTORY_BUCKET_SECONDS", cls.history_bucket_seconds, 1
            ),
            history_buckets=integer("COALESCER_HISTORY_BUCKETS", cls.history_buckets, 2),
            upkeep_seconds=seconds("COALESCER_UPKEEP_SECONDS", cls.upkeep_seconds, 3600),
            web_concurrency=workers("WEB_CONCURRENCY", get("WEB_CONCURRENCY"), cls.web_concurrency),
            source_commit=_commit(get("SOURCE_COMMIT")) or cls.source_commit,
            serve_pid=integer("COALESCER_SERVE_PID", 0, 0),
            prometheus_multiproc_dir=_directory(
                "PROMETHEUS_MULTIPROC_DIR", get("PROMETHEUS_MULTIPROC_DIR")
            ),
        )
        if values["history_buckets"] > 100_000:
            raise ConfigError("COALESCER_HISTORY_BUCKETS must be at most 100000")
        if values["policy_file"] is not None:
            from coalescer.policy.rules import load

            values["policy"] = load(values["policy_file"])
        return cls(**values)


#: What a Redis URL setting accepts, for its error message.
REDIS_URL_FORM = (
    "redis://[:password@]host[:port][/db] (rediss:// for TLS, unix:///path.sock), db 0-15"
)


def redis_url(url: str | None, name: str = "REDIS_URL") -> str | None:
    """A Redis URL setting (``name``), refused in one line when no client could use it: another
    scheme, no host, a port that is not one, or a database outside Redis's default 16."""
    if url is None:
        return None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    db = parts.path.strip("/")
    if parts.scheme == "unix":
        ok = bool(parts.path)
    else:
        number = db.isascii() and db.isdigit() and int(db) <= 15
        ok = parts.scheme in ("redis", "rediss") and bool(parts.hostname) and port != 0
        ok = ok and (db == "" or number)
    if not ok:
        raise ConfigError(f"{name} must be {REDIS_URL_FORM}, not {redact_url(url)!r}")
    return url


def workers(name: str, raw: str | None, default: int = 1) -> int:
    """A number of web processes (``WEB_CONCURRENCY``, ``serve --workers``): 1 to
    :data:`MAX_WORKERS`."""
    if raw is None:
        return default
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_WORKERS:
        raise ConfigError(f"{name} must be a whole number from 1 to {MAX_WORKERS}, not {raw!r}")
    return int(raw)


def _commit(value: str | None) -> str | None:
    """``SOURCE_COMMIT``: a commit id or a ref name, shown as is on ``/__version__``."""
    if value is None:
        return None
    if len(value) > 200 or not value.isascii() or not value.isprintable() or " " in value:
        raise ConfigError(f"SOURCE_COMMIT must be a commit id or a ref name, not {value[:40]!r}")
    return value


def _directory(name: str, path: str | None) -> str | None:
    """A setting naming a folder the process writes to: one that exists and is writable."""
    if path is None:
        return None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} must name a folder this process can write to, not {path!r}")
    return path


#: Characters a URL written into public logs may not hold: whitespace, control characters, and
#: those RFC 3986 never allows unescaped (a viewer may render them as HTML or Markdown).
_UNSAFE_IN_URL = re.compile(r'[\x00-\x20\x7f-\x9f<>"`{}|\\^]')


def _http_url(name: str, url: str | None) -> str | None:
    """An ``http(s)://host...`` setting without its trailing slash, refused with a clear
    message otherwise. It becomes links people click, in the logs of every run superseded: a
    user and password, a query or fragment, spaces, control or escape characters are refused
    (the message does not repeat the value: it may hold a password)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name} must be an http:// or https:// URL with a host, not {url!r}")
    if "@" in parts.netloc:
        raise ConfigError(
            f"{name} must not hold a user or password: it is written into public logs"
        )
    if _UNSAFE_IN_URL.search(url):
        raise ConfigError(
            f'{name} must not hold spaces, control characters or any of <>"`{{}}|\\^: '
            "percent-encode them"
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError(f"{name} must be the service's base URL, without a query or fragment")
    return url.rstrip("/")


def _redis_url(url: str | None, *, verify: bool) -> str | None:
    """``REDIS_URL``, told not to verify the server's certificate when
    ``COALESCER_REDIS_TLS_VERIFY=false`` (Heroku Redis: TLS with a self-signed certificate, and
    a URL the add-on sets)."""
    url = redis_url(url)
    if verify or url is None or not url.startswith("rediss://") or "ssl_cert_reqs=" in url:
        return url
    return url + ("&" if "?" in url else "?") + "ssl_cert_reqs=none"


def amqp_url(url: str | None, name: str = "PULSE_URL") -> str | None:
    """An AMQP URL setting (``name``), refused with a clear message when no client could use
    it."""
    if url is None:
        return None
    if not url.startswith(("amqp://", "amqps://")):
        raise ConfigError(f"{name} must start with amqp:// or amqps://")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    if port == 0:
        raise ConfigError(f"{name} has no usable port (1-65535): {redact_url(url)}")
    if not parts.hostname:
        raise ConfigError(f"{name} names no host: {redact_url(url)}")
    query = parse_qs(parts.query)
    for heartbeat in query.get("heartbeat", []):
        if not heartbeat.isdigit():
            raise ConfigError(
                f"{name}'s heartbeat must be a whole number of seconds, not {heartbeat!r}"
            )
    # A CA file that cannot be read is no broker's fault: retrying would never reach one.
    for cafile in query.get("cafile", []):
        if not os.access(cafile, os.R_OK) or not os.path.isfile(cafile):
            raise ConfigError(f"{name}'s cafile {cafile!r} is not a readable file")
    return url


def queue_credentials() -> dict[str, str]:
    """The queue credentials in the environment (``TASKCLUSTER_CLIENT_ID``,
    ``TASKCLUSTER_ACCESS_TOKEN``, ``TASKCLUSTER_CERTIFICATE``), as the official client reads
    them; empty when none are set."""
    import taskcluster

    creds: dict[str, str] = taskcluster.optionsFromEnvironment({}).get("credentials", {})
    return creds
