"""The policy file: parsing, validation with clear errors, matching keys to rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalescer.cli import main
from coalescer.errors import ConfigError
from coalescer.policy.rules import Cascade, PrimaryFailure, Strategy, load, loads
from coalescer.settings import Settings

YAML = """
rules:
  - name: builds
    keys: ["mozilla-central.build.*", "try.**"]
    strategy: latest-wins
    supersede-running: true
    protect-running-after: 10m
    on-primary-failure: release
    cascade: leave
  - keys: "mozilla-central.**"
    strategy: first-wins
    age: 90s
    size: 2
  - keys: "**"
    strategy: on-claim
"""


def test_a_yaml_policy_parses_into_rules_matched_first_wins() -> None:
    policy = loads(YAML, "p.yaml", toml=False)
    builds = policy.rule_for("mozilla-central.build.linux")
    assert builds.name == "builds"
    assert builds.strategy is Strategy.LATEST_WINS
    assert builds.supersede_running and builds.protect_running_after_ms == 600_000
    assert builds.on_primary_failure is PrimaryFailure.RELEASE
    assert builds.cascade is Cascade.LEAVE
    assert policy.rule_for("try.a.b.c").name == "builds"
    # `*` stays within one word: a deeper key falls through to the next rule.
    deeper = policy.rule_for("mozilla-central.build.linux.opt")
    assert (deeper.name, deeper.strategy, deeper.age_ms, deeper.size) == (
        "rule-2",
        Strategy.FIRST_WINS,
        90_000,
        2,
    )
    assert deeper.cascade is Cascade.CANCEL  # the default
    assert policy.rule_for("elsewhere").strategy is Strategy.ON_CLAIM
    assert policy.script_args("elsewhere") is None


def test_a_key_no_rule_matches_keeps_the_on_claim_protocol() -> None:
    policy = loads("rules: [{keys: 'a.*', strategy: latest-wins}]", "p", toml=False)
    assert policy.rule_for("b.c").strategy is Strategy.ON_CLAIM
    assert policy.rule_for("a.b").decides and not policy.rule_for("a").decides


def test_a_toml_policy_reads_the_same(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text('[[rules]]\nkeys = "k.*"\nstrategy = "latest-wins"\nage = 30\n')
    rule = load(path).rule_for("k.x")
    assert (rule.strategy, rule.age_ms) == (Strategy.LATEST_WINS, 30_000)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: [{keys: k, strategy: latest}]", "'strategy' is 'latest'; expected one of"),
        ("rules: [{strategy: latest-wins}]", "'keys' (a glob or a list of globs) is required"),
        ("rules: [{keys: k, strategy: latest-wins, cascde: leave}]", "unknown field(s) cascde"),
        ("rules: [{keys: k, age: 10}]", "age only applies to latest-wins and first-wins"),
        ("rules: [{keys: k, age: 10, size: 2}]", "age, size only apply to latest-wins and"),
        ("rules: [{keys: k, strategy: first-wins, age: soon}]", "'age' is 'soon'; expected"),
        ("rules: [{keys: k, strategy: first-wins, size: -1}]", "'size' must be a whole number"),
        ("rules: [{keys: 'a b', strategy: first-wins}]", "key pattern 'a b' may hold"),
        ("rules: [{keys: k, strategy: first-wins, on-primary-failure: retry}]", "expected one"),
        ("rules: {keys: k}", "'rules' must be a list"),
        ("rules: [{keys: a, name: x}, {keys: b, name: x}]", "repeated: x"),
        ("rules: [{keys: k}\n", "not valid YAML"),
        ("other: 1", "unknown top-level field(s) other"),
    ],
)
def test_a_bad_policy_is_refused_with_a_message_naming_the_rule(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loads(text, "policy.yaml", toml=False)
    assert message in str(caught.value)
    assert str(caught.value).startswith("policy.yaml")


def test_settings_load_the_policy_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    settings = Settings.from_environ({"COALESCER_POLICY_FILE": str(path)})
    assert settings.policy is not None and settings.policy.rule_for("try.x").name == "builds"
    path.write_text("rules: [{keys: k, strategy: nope}]")
    with pytest.raises(ConfigError, match=r"rule 1 \(keys k\): 'strategy' is 'nope'"):
        Settings.from_environ({"COALESCER_POLICY_FILE": str(path)})
    with pytest.raises(ConfigError, match=r"^COALESCER_POLICY_FILE '.*missing.yaml' not found$"):
        Settings.from_environ({"COALESCER_POLICY_FILE": str(tmp_path / "missing.yaml")})
    with pytest.raises(ConfigError, match=r"^COALESCER_POLICY_FILE '.*' cannot be read: Is a dir"):
        Settings.from_environ({"COALESCER_POLICY_FILE": str(tmp_path)})


def test_policy_check_prints_the_rules_or_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COALESCER_POLICY_FILE", raising=False)
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    assert main(["policy", "check", str(path), "--key", "try.x"]) == 0
    out = capsys.readouterr().out
    assert "builds: mozilla-central.build.*, try.** -> latest-wins; running too" in out
    assert "try.x: builds (latest-wins)" in out
    path.write_text("rules: [{keys: k, strategy: nope}]")
    assert main(["policy", "check", str(path)]) == 2
    assert "'strategy' is 'nope'" in capsys.readouterr().err


def test_policy_check_names_the_file_it_was_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COALESCER_POLICY_FILE", raising=False)
    missing = str(tmp_path / "nope.yaml")
    assert main(["policy", "check", missing]) == 2
    assert capsys.readouterr().err == f"coalescer: policy file {missing!r} not found\n"
    path = tmp_path / "p.yaml"
    path.write_text(YAML)
    binary = tmp_path / "p.bin"
    binary.write_bytes(b"rules: [\xff]")
    assert main(["policy", "check", str(binary)]) == 2
    assert f"policy file {str(binary)!r} cannot be read: 'utf-8' codec" in capsys.readouterr().err
    assert main(["policy", "check", str(path), "--key", "a b"]) == 1
    captured = capsys.readouterr()
    assert "malformed coalescing key 'a b'" in captured.err
    assert captured.out == ""  # refused before anything is shown
