from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coalescer import cli
from coalescer.errors import ConfigError
from coalescer.settings import Settings, amqp_url


def test_defaults_serve_the_embedded_store_on_localhost() -> None:
    s = Settings.from_environ({})
    assert (s.redis_url, s.host, s.port, s.route_prefix, s.max_list) == (
        None,
        "127.0.0.1",
        8000,
        "coalesce.v1",
        32,
    )
    assert s.ingest_token is None


def test_secrets_never_print() -> None:
    s = Settings.from_environ({"COALESCER_INGEST_TOKEN": "hunter2", "PULSE_URL": "amqp://u:pw@h/"})
    assert "hunter2" not in repr(s) and "pw@" not in repr(s)
    assert s.ingest_token is not None and s.ingest_token.reveal() == "hunter2"


@pytest.mark.parametrize(
    "env,message",
    [
        ({"PORT": "http"}, "PORT must be a whole number"),
        ({"COALESCER_MAX_LIST": "0"}, "at least 1"),
        ({"COALESCER_ROUTE_PREFIX": "a..b"}, "dotted route prefix"),
        ({"PULSE_URL": "http://x"}, "amqp://"),
        ({"PULSE_URL": "amqp://u:pw@h:99999/"}, r"no usable port .*amqp://u:\*\*\*@h"),
        ({"PULSE_URL": "amqps://h:abc/"}, "no usable port"),
        ({"PULSE_URL": "amqp:///"}, "names no host"),
        ({"PULSE_URL": "amqp://h/?heartbeat=soon"}, "heartbeat must be a whole number"),
        ({"PULSE_URL": "amqps://h/?cafile=/no/such/ca.pem"}, "cafile '/no/such/ca.pem' is not"),
        ({"PULSE_URL": "amqps://h/?cafile=/"}, "cafile '/' is not a readable file"),
        ({"COALESCER_REDIS_TLS_VERIFY": "maybe"}, "true or false"),
        ({"COALESCER_LEARN_UNKNOWN": "maybe"}, "COALESCER_LEARN_UNKNOWN must be true or false"),
        ({"COALESCER_LEARN_TIMEOUT": "soon"}, "must be a number of seconds"),
        ({"COALESCER_LEARN_TIMEOUT": "0"}, "more than 0 and at most 60"),
        ({"COALESCER_LEARN_TIMEOUT": "nan"}, "more than 0 and at most 60"),
        ({"COALESCER_UPKEEP_SECONDS": "0"}, "COALESCER_UPKEEP_SECONDS must be more than 0"),
        ({"COALESCER_UPKEEP_SECONDS": "3601"}, "more than 0 and at most 3600, not 3601"),
        ({"COALESCER_CONNECTION_REPORT_SECONDS": "often"}, "must be a number of seconds"),
        ({"COALESCER_CONNECTION_REPORT_SECONDS": "-1"}, "more than 0 and at most 3600"),
        ({"COALESCER_LOG_LEVEL": "LOUD"}, "COALESCER_LOG_LEVEL must be one of DEBUG, INFO"),
        ({"COALESCER_LOG_FORMAT": "yaml"}, "COALESCER_LOG_FORMAT must be one of json, text"),
        ({"WEB_CONCURRENCY": "two"}, "WEB_CONCURRENCY must be a whole number from 1 to 256"),
        ({"WEB_CONCURRENCY": "257"}, "WEB_CONCURRENCY must be a whole number from 1 to 256"),
        ({"SOURCE_COMMIT": "abc def"}, "SOURCE_COMMIT must be a commit id or a ref name"),
        ({"PROMETHEUS_MULTIPROC_DIR": "/no/such/dir"}, "must name a folder this process can"),
    ],
)
def test_bad_settings_say_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_environ(env)


def test_tls_verification_can_be_turned_off_for_self_signed_redis() -> None:
    off = {"COALESCER_REDIS_TLS_VERIFY": "false"}
    assert Settings.from_environ({**off, "REDIS_URL": "rediss://:p@h:6380"}).redis_url == (
        "rediss://:p@h:6380?ssl_cert_reqs=none"
    )
    assert Settings.from_environ({**off, "REDIS_URL": "redis://h/0"}).redis_url == "redis://h/0"
    assert Settings.from_environ({"REDIS_URL": "rediss://h"}).redis_url == "rediss://h"


def test_unknown_tasks_are_learned_from_the_queue_unless_turned_off() -> None:
    s = Settings.from_environ({"TASKCLUSTER_ROOT_URL": "https://tc.example.com/"})
    assert (s.taskcluster_root_url, s.learn_unknown, s.learn_timeout) == (
        "https://tc.example.com",
        True,
        2.0,
    )
    off = Settings.from_environ(
        {"COALESCER_LEARN_UNKNOWN": "False", "COALESCER_LEARN_TIMEOUT": "0.5"}
    )
    assert (off.learn_unknown, off.learn_timeout) == (False, 0.5)
    assert Settings.from_environ({"COALESCER_LEARN_UNKNOWN": "yes"}).learn_unknown is True


def test_the_upkeep_and_the_connection_report_wait_15_and_10_s_unless_set() -> None:
    s = Settings.from_environ({})
    assert (s.upkeep_seconds, s.connection_report_seconds) == (15.0, 10.0)
    s = Settings.from_environ(
        {"COALESCER_UPKEEP_SECONDS": "0.5", "COALESCER_CONNECTION_REPORT_SECONDS": "120"}
    )
    assert (s.upkeep_seconds, s.connection_report_seconds) == (0.5, 120.0)


def test_the_history_kept_for_the_charts_is_a_day_of_minutes_unless_set() -> None:
    from coalescer.history import Retention

    assert Settings.from_environ({}).retention == Retention(60_000, 1440)
    s = Settings.from_environ(
        {"COALESCER_HISTORY_BUCKET_SECONDS": "5", "COALESCER_HISTORY_BUCKETS": "720"}
    )
    assert s.retention == Retention(5000, 720) and s.retention.span_ms == 3_600_000
    with pytest.raises(ConfigError, match="COALESCER_HISTORY_BUCKETS must be at least 2"):
        Settings.from_environ({"COALESCER_HISTORY_BUCKETS": "1"})
    with pytest.raises(ConfigError, match="COALESCER_HISTORY_BUCKETS must be at most 100000"):
        Settings.from_environ({"COALESCER_HISTORY_BUCKETS": "100001"})
    with pytest.raises(ConfigError, match="COALESCER_HISTORY_BUCKET_SECONDS must be at least 1"):
        Settings.from_environ({"COALESCER_HISTORY_BUCKET_SECONDS": "0"})


def test_an_amqp_url_flag_is_checked_as_the_setting_is() -> None:
    with pytest.raises(ConfigError, match="--pulse-url has no usable port"):
        amqp_url("amqp://h:0/", "--pulse-url")
    assert amqp_url("amqps://u:pw@h:5671/vhost?heartbeat=30") == (
        "amqps://u:pw@h:5671/vhost?heartbeat=30"
    )


def test_an_amqps_url_naming_a_readable_ca_file_is_taken(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    url = f"amqps://u:pw@h/?cafile={ca}"
    assert Settings.from_environ({"PULSE_URL": url}).pulse_url is not None


@pytest.mark.parametrize("url", ["coalescer.example.com", "ftp://x", "http://", "/tasks"])
def test_a_public_url_that_is_no_http_url_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="COALESCER_PUBLIC_URL must be an http"):
        Settings.from_environ({"COALESCER_PUBLIC_URL": url})
    good = Settings.from_environ({"COALESCER_PUBLIC_URL": "https://svc.example/base/"})
    assert good.public_url == "https://svc.example/base"


def test_log_settings_are_read_in_any_case_and_never_silently_mean_another() -> None:
    s = Settings.from_environ({"COALESCER_LOG_LEVEL": "debug", "COALESCER_LOG_FORMAT": "JSON"})
    assert (s.log_level, s.log_json) == ("DEBUG", True)
    assert Settings.from_environ({"COALESCER_LOG_FORMAT": "Text"}).log_json is False
    assert Settings.from_environ({}).log_json is True


def test_the_process_settings_are_read_here_too(tmp_path: Path) -> None:
    s = Settings.from_environ(
        {
            "WEB_CONCURRENCY": " 3 ",
            "SOURCE_COMMIT": "0123abc",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        }
    )
    assert (s.web_concurrency, s.source_commit, s.prometheus_multiproc_dir) == (
        3,
        "0123abc",
        str(tmp_path),
    )
    defaults = Settings.from_environ({})
    assert (defaults.web_concurrency, defaults.source_commit) == (1, "unknown")
    assert defaults.prometheus_multiproc_dir is None


def _commands() -> list[list[str]]:
    """Every leaf command of ``coalescer``, with a placeholder for each required argument."""
    found = []

    def walk(parser: argparse.ArgumentParser, argv: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            required = []
            for action in parser._actions:
                if action.required:
                    required += [*action.option_strings[:1], "x"]
            found.append(argv + required)
        for sub in subs:
            for name, child in sub.choices.items():
                walk(child, [*argv, name])

    walk(cli.build_parser(), [])
    return found


@pytest.mark.parametrize("name,value", [("COALESCER_LOG_LEVEL", "LOUD"), ("WEB_CONCURRENCY", "x")])
def test_a_bad_setting_stops_every_command_in_one_line_with_exit_2(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = _commands()
    assert ["serve"] in commands and ["policy", "check"] in commands  # the walk works
    monkeypatch.setenv(name, value)
    for argv in commands:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"coalescer: {name} must be ") and err.count("\n") == 1, argv


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("https://user:pw@svc.example/", "must not hold a user or password"),
        ("https://svc.example/a b", "must not hold spaces, control characters"),
        ("https://svc.example/\x1b[31mred", "must not hold spaces, control characters"),
        ("https://svc.example/<img/src=x>", "must not hold spaces, control characters"),
        ("https://svc.example/base?x=[a](https://evil.example)", "without a query or fragment"),
        ("https://svc.example/base#top", "without a query or fragment"),
    ],
)
def test_a_public_url_that_would_put_secrets_or_markup_in_public_logs_is_refused(
    url: str, said: str
) -> None:
    with pytest.raises(ConfigError, match="COALESCER_PUBLIC_URL must ") as caught:
        Settings.from_environ({"COALESCER_PUBLIC_URL": url})
    assert said in str(caught.value)
    assert "pw" not in str(caught.value)
