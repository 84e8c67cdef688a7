"""Pure parts of the store's fault handling: which Redis errors are the server's condition, the
throttled log, the supervisor of background tasks, and what the health report says."""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis.exceptions

from coalescer.errors import ConfigError, StoreRejected, StoreUnavailable
from coalescer.health import FAILING_AFTER, Health, Supervisor, limits_message
from coalescer.logs import Throttled
from coalescer.model import format_time_ms
from coalescer.store import IndexState
from coalescer.store.census import Limits
from coalescer.store.pipelined import ReplyError
from coalescer.store.redis import condition, store_error


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (
            redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            ),
            "full",
        ),
        (
            redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
            "read-only",
        ),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), "loading"),
        (
            redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots"),
            "misconf",
        ),
        (redis.exceptions.ResponseError("BUSY Redis is busy running a script."), "busy"),
        (redis.exceptions.ClusterDownError("The cluster is down"), "cluster-down"),
        (
            redis.exceptions.ResponseError("TRYAGAIN Multiple keys request during rehashing"),
            "try-again",
        ),
        (redis.exceptions.NoScriptError("No matching script."), "no-script"),
        (redis.exceptions.ConnectionError("Connection refused"), "unreachable"),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), "timeout"),
        (ConnectionResetError("reset by peer"), "unreachable"),
        # redis-py's pipelines prefix the command: the code is what follows "caused error: "
        (
            redis.exceptions.ResponseError(
                "Command # 3 (EVALSHA ab 5 co:{k}:t) of pipeline caused error: OOM command not "
                "allowed when used memory > 'maxmemory'. script: ab, on @user_script:12."
            ),
            "full",
        ),
        (redis.exceptions.ResponseError("NOPERM this user has no permissions"), "no-permission"),
        # A slot moved (a Cluster failover): redis-py strips the code from MovedError's text.
        (redis.exceptions.MovedError("8579 127.0.0.1:41628"), "moved"),
        (redis.exceptions.AskError("8579 127.0.0.1:41628"), "moved"),
        (ReplyError("MOVED 8579 127.0.0.1:41628"), "moved"),
    ],
)
def test_the_server_s_condition_is_never_the_command_s_fault(exc: Exception, reason: str) -> None:
    assert condition(exc) == reason
    error = store_error(exc)
    assert isinstance(error, StoreUnavailable) and error.reason == reason


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ResponseError(
            "ERR user_script:40: attempt to compare nil with number script: ab, on @user_script:40."
        ),
        redis.exceptions.ResponseError(
            "WRONGTYPE Operation against a key holding the wrong kind of value"
        ),
        redis.exceptions.DataError("Invalid input of type: 'NoneType'"),
        # "BUSY" inside a message is not the BUSY code
        redis.exceptions.ResponseError("ERR Error running script: BUSYGROUP"),
    ],
)
def test_a_refused_command_is_rejected_not_unavailable(exc: Exception) -> None:
    assert condition(exc) is None
    assert isinstance(store_error(exc), StoreRejected)


def test_a_throttled_log_says_how_many_lines_it_held_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("coalescer.logs.time.monotonic", lambda: clock[0])
    throttled = Throttled(logging.getLogger("t"), every=10.0)
    with caplog.at_level(logging.ERROR):
        for _ in range(500):  # one outage second: 500 failed requests
            throttled.log(logging.ERROR, "store unavailable")
            clock[0] += 0.002
        clock[0] += 10
        throttled.log(logging.ERROR, "store unavailable")
    assert [r.getMessage() for r in caplog.records] == [
        "store unavailable",
        "store unavailable (499 more like this in the last 11 s)",
    ]


async def test_a_failing_periodic_job_is_retried_and_recovers() -> None:
    health = Health()
    supervisor = Supervisor(health)
    calls = 0
    recovered = asyncio.Event()

    async def job() -> None:
        nonlocal calls
        calls += 1
        if calls <= FAILING_AFTER:
            raise StoreUnavailable("Redis is full", reason="full")
        recovered.set()

    supervisor.every("job", 0.001, job)
    await asyncio.wait_for(recovered.wait(), 10)
    await supervisor.stop()
    loop = health.loops["job"]
    assert loop.total_failures == FAILING_AFTER and loop.failures == 0
    assert loop.last_ok is not None and not loop.failing
    report = health.report()
    assert report["checks"]["background"] == "ok"
    # An instant, as every instant in the JSON API.
    assert report["details"]["background"]["job"]["lastOk"] == format_time_ms(
        int(loop.last_ok * 1000)
    )


async def test_a_crashing_service_is_restarted_and_a_config_error_stops_it() -> None:
    health = Health()
    supervisor = Supervisor(health)
    runs = 0

    async def service() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("a bug")
        raise ConfigError("PULSE_URL refused the credentials")

    task = supervisor.service("pulse", service)
    await asyncio.wait_for(task, 10)  # one restart after 1 s, then the setting stops it
    loop = health.loops["pulse"]
    assert runs == 2 and loop.restarts == 1 and loop.failing
    assert loop.stopped == "PULSE_URL refused the credentials"
    assert health.report()["checks"]["background"] == "error"
    assert any("PULSE_URL refused" in alert for alert in health.alerts())


async def test_an_expected_crash_is_logged_as_one_line_and_a_bug_with_its_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = Supervisor(Health(), jitter=0)  # waits of exactly 1 s, then 2 s
    runs = 0

    async def service() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise StoreRejected("the queue is down")
        if runs == 2:
            raise RuntimeError("a bug")

    with caplog.at_level(logging.ERROR, logger="coalescer.health"):
        task = supervisor.service("rebuild", service, expected=(StoreRejected,))
        await asyncio.wait_for(task, 10)  # restarts after 1 s and 2 s, then returns
    expected, bug = caplog.records
    assert expected.getMessage() == "rebuild stopped; restarting in 1 s: the queue is down"
    assert expected.exc_info is None
    assert bug.getMessage() == "rebuild stopped; restarting in 2 s" and bug.exc_info is not None


def test_the_health_report_says_what_is_wrong() -> None:
    health = Health()
    assert health.report()["checks"] == {
        "writable": "ok",
        "eviction": "ok",
        "limits": "ok",
        "index": "unknown",
        "background": "ok",
    }
    assert health.alerts() == []
    health.store_down, health.store_error = "full", "OOM command not allowed"
    health.eviction = "allkeys-lru"
    health.index = IndexState("lost", 1_795_000_000_000, None, True)
    health.limited = limits_message(120, 400, Limits(keys=100, tasks=1000))
    report = health.report()
    assert report["checks"] == {
        "writable": "error",
        "eviction": "warning",
        "limits": "warning",
        "index": "warning",
        "background": "ok",
    }
    assert "noeviction" in report["details"]["eviction"]
    assert "reconcile --rebuild" in report["details"]["index"]
    assert report["details"]["limits"].startswith("120 keys of COALESCER_MAX_KEYS=100; events ")
    assert len(health.alerts()) == 4


def test_the_limits_are_reached_at_either_one() -> None:
    limits = Limits(keys=100, tasks=1000)
    assert limits_message(99, 999, limits) is None
    assert "tasks of new keys" in (limits_message(100, 0, limits) or "")
    assert "of new tasks" in (limits_message(5, 1000, limits) or "")


async def test_stop_ends_a_job_whose_library_turns_the_cancel_into_another_error() -> None:
    """redis-py answers a command cancelled mid-flight with a connection error: the supervisor
    must still stop, not sleep and try again."""
    supervisor = Supervisor(Health())
    started = asyncio.Event()

    async def job() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise StoreUnavailable("Redis connection lost: cancelled") from None

    supervisor.every("job", 30.0, job)
    await started.wait()
    await asyncio.wait_for(supervisor.stop(), 5)


def test_the_embedded_store_says_it_starts_empty_not_that_redis_lost_data() -> None:
    health = Health(index=IndexState("lost", 1_795_000_000_000, None, True), embedded=True)
    (alert,) = health.alerts()
    assert "embedded store started empty" in alert and "Redis new, restarted" not in alert


def test_the_embedded_store_without_a_queue_names_both_ways_to_a_complete_index() -> None:
    health = Health(index=IndexState("lost", 1_795_000_000_000, None, True), embedded=True)
    detail = health.report()["details"]["index"]
    assert "set TASKCLUSTER_ROOT_URL so that `coalescer serve` rebuilds the index" in detail
    assert "(REDIS_URL) and run `coalescer reconcile --rebuild`" in detail


def test_the_embedded_store_rebuilding_itself_says_so_instead_of_advising_a_command() -> None:
    health = Health(
        index=IndexState("lost", 1_795_000_000_000, None, True), embedded=True, rebuilds=True
    )
    (alert,) = health.alerts()
    assert "rebuilt the index from the queue (TASKCLUSTER_ROOT_URL), which it is doing" in alert
    assert "reconcile" not in alert and "set TASKCLUSTER_ROOT_URL" not in alert


def test_redis_losing_the_index_advises_reconcile_rebuild() -> None:
    health = Health(index=IndexState("lost", 1_795_000_000_000, None, True))
    assert health.report()["details"]["index"].endswith("run `coalescer reconcile --rebuild`")
