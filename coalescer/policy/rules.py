"""Superseding policies: the policy file, parsed and validated into frozen rules. Pure: no IO
beyond reading the file in :func:`load`.

A policy file (YAML or TOML) lists rules; the first rule whose pattern matches a coalescing key
decides how that key supersedes. A key no rule matches keeps today's protocol (``on-claim``)::

    rules:
      - keys: "mozilla-central.build.*"      # a glob, or a list of globs
        strategy: latest-wins                # on-claim | latest-wins | first-wins
        supersede-running: true              # latest-/first-wins: cancel running victims too
        protect-running-after: 10m           # never cancel a task that has run longer
        age: 0                               # decide only when the oldest pending task has
        size: 0                              #   waited > age s and > size tasks are pending
        on-primary-failure: supersede        # or release: hold victims until the primary ends;
                                             #   or bisect: search them for the first failure
        bisect-confirm: 3                    # with bisect: the most reruns confirming a failure
        bisect-confidence: 0.99              # with bisect: rerun a failure until it is this
                                             #   probably a breakage (coalescer.verdicts)
        bisect-parallel: 2                   # with bisect: runs of the search at once
        hold-by: claim                       # with release/bisect: or priority: victims wait
                                             #   pending at the lowest priority, unclaimed
        cascade: cancel                      # or leave: what happens to a victim's dependents

Globs match dotted keys: ``*`` matches within one word, ``**`` across words, ``?`` one
character. Durations are seconds, or a number with ``s``, ``m``, ``h`` or ``d``.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import tomllib
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from coalescer.errors import ConfigError
from coalescer.verdicts import DEFAULT_CONFIDENCE, DEFAULT_CONFIRM, DEFAULT_PARALLEL

E = TypeVar("E", bound=enum.StrEnum)


class Strategy(enum.StrEnum):
    """How a key's tasks supersede each other."""

    #: today's protocol (docs/explanation/protocol.md): a worker asks when it claims; nothing
    #: happens on arrival
    ON_CLAIM = "on-claim"
    #: the newest live task supersedes every older pending one at once
    LATEST_WINS = "latest-wins"
    #: the oldest live task (running first) supersedes every later pending duplicate
    FIRST_WINS = "first-wins"


class PrimaryFailure(enum.StrEnum):
    """``supersede``: victims are resolved at once, whatever becomes of the primary.
    ``release``: victims are claimed and held until the primary ends; they are superseded
    when it completes, released (retried) when it fails or ends in exception.
    ``bisect``: victims are held as with ``release``; when the primary fails, a few of them
    run to locate the first failing push (:mod:`coalescer.bisection`), each failure confirmed
    until it is ``bisect-confidence`` probably a breakage (at most ``bisect-confirm`` reruns),
    and the rest are superseded by the result that stands for
    them."""

    SUPERSEDE = "supersede"
    RELEASE = "release"
    BISECT = "bisect"


class HoldBy(enum.StrEnum):
    """How victims are held until their primary ends (``on-primary-failure: release`` or
    ``bisect``): ``claim``ed by the enforcer, their claims renewed, a release costing one of
    their retries; or left pending at the lowest ``priority`` (``changeTaskPriority``), where
    an idle worker may still run them, and raised back when they must run. A victim already
    at the lowest priority, or on a queue without the method, is claimed."""

    CLAIM = "claim"
    PRIORITY = "priority"


class Cascade(enum.StrEnum):
    """What happens to tasks that depend on a victim: ``cancel`` them (transitively, before
    the victim is resolved), or ``leave`` them to the queue's rules."""

    CANCEL = "cancel"
    LEAVE = "leave"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule of a policy file. Times are in milliseconds; ``None`` means no threshold."""

    name: str
    patterns: tuple[str, ...]
    strategy: Strategy = Strategy.ON_CLAIM
    supersede_running: bool = False
    protect_running_after_ms: int | None = None
    age_ms: int | None = None
    size: int | None = None
    on_primary_failure: PrimaryFailure = PrimaryFailure.SUPERSEDE
    cascade: Cascade = Cascade.CANCEL
    #: With ``on-primary-failure: bisect``: the most reruns confirming a failure (0: trust it).
    bisect_confirm: int = DEFAULT_CONFIRM
    #: With ``on-primary-failure: bisect``: how probable a failure must be a breakage.
    bisect_confidence: float = DEFAULT_CONFIDENCE
    #: With ``on-primary-failure: bisect``: the search's runs at once.
    bisect_parallel: int = DEFAULT_PARALLEL
    #: With ``on-primary-failure: release`` or ``bisect``: how victims are held.
    hold_by: HoldBy = HoldBy.CLAIM

    @property
    def decides(self) -> bool:
        """Whether decisions are taken when events arrive (anything but ``on-claim``)."""
        return self.strategy is not Strategy.ON_CLAIM

    def script_args(self) -> list[str | int]:
        """The rule as ``decide.lua`` takes it (see its header)."""
        return [
            self.name,
            str(self.strategy),
            -1 if self.age_ms is None else self.age_ms,
            -1 if self.size is None else self.size,
            int(self.supersede_running),
            -1 if self.protect_running_after_ms is None else self.protect_running_after_ms,
            # Both release and bisect hold the victims until the primary ends (1, 2); with
            # bisect, its failure starts a search over them (coalescer.policy.bisecting).
            _HOLD[self.on_primary_failure],
            str(self.cascade),
            # With bisect: reruns confirming each failure the search would narrow on, and the
            # confidence they aim for (coalescer.verdicts).
            self.bisect_confirm if self.on_primary_failure is PrimaryFailure.BISECT else 0,
            repr(self.bisect_confidence),
            self.bisect_parallel,
        ]


ON_CLAIM = Rule(name="default", patterns=("**",))
#: ``decide.lua``'s ``hold`` argument per ``on-primary-failure``.
_HOLD = {PrimaryFailure.SUPERSEDE: 0, PrimaryFailure.RELEASE: 1, PrimaryFailure.BISECT: 2}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Rules in file order; :meth:`rule_for` returns the first that matches a key."""

    rules: tuple[Rule, ...] = ()
    source: str = ""

    def rule_for(self, key: str) -> Rule:
        return _match(self, key)

    def script_args(self, key: str) -> list[str | int] | None:
        """``decide.lua``'s rule arguments for ``key``, or ``None`` for ``on-claim`` keys."""
        rule = self.rule_for(key)
        return rule.script_args() if rule.decides else None

    @property
    def decides(self) -> bool:
        return any(rule.decides for rule in self.rules)


@lru_cache(maxsize=65536)
def _match(policy: Policy, key: str) -> Rule:
    # Cached: ingest asks once per (event, key), and a key's rule never changes in a process.
    for rule in policy.rules:
        if any(_glob(p).fullmatch(key) for p in rule.patterns):
            return rule
    return ON_CLAIM


@lru_cache(maxsize=1024)
def _glob(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


# -- parsing -------------------------------------------------------------------------------------
_FIELDS = {
    "keys",
    "name",
    "strategy",
    "supersede-running",
    "protect-running-after",
    "age",
    "size",
    "on-primary-failure",
    "bisect-confirm",
    "bisect-confidence",
    "bisect-parallel",
    "hold-by",
    "cascade",
}
_DECIDING_ONLY = _FIELDS - {"keys", "name", "strategy"}
_PATTERN_RE = re.compile(r"^[A-Za-z0-9_~+:@*?.-]+$")
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)?$")
_UNITS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse(doc: Any, source: str = "<policy>") -> Policy:
    """A :class:`Policy` from a parsed document, or ConfigError naming what is wrong where."""
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{source}: the policy must be a mapping with a 'rules' list")
    extra = set(doc) - {"rules"}
    if extra:
        raise ConfigError(f"{source}: unknown top-level field(s) {', '.join(sorted(extra))}")
    raw = doc.get("rules", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{source}: 'rules' must be a list")
    rules = tuple(_rule(item, f"{source}: rule {n}", n) for n, item in enumerate(raw, 1))
    names = [r.name for r in rules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{source}: rule names must be unique; repeated: {', '.join(dupes)}")
    return Policy(rules, source)


def _rule(item: Any, where: str, number: int) -> Rule:
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where}: a rule must be a mapping")
    unknown = set(item) - _FIELDS
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))} "
            f"(known: {', '.join(sorted(_FIELDS))})"
        )
    patterns = _patterns(item.get("keys"), where)
    where = f"{where} (keys {', '.join(patterns)})"
    strategy = _choice(item.get("strategy", "on-claim"), Strategy, "strategy", where)
    if strategy is Strategy.ON_CLAIM:
        given = sorted(set(item) & _DECIDING_ONLY)
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(
                f"{where}: {', '.join(given)} only {verb} to latest-wins and first-wins; "
                "an on-claim key's worker passes age/size in its supersederUrl"
            )
    name = item.get("name", f"rule-{number}")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", name):
        raise ConfigError(f"{where}: 'name' must be 1-64 letters, digits or _.:- characters")
    running = item.get("supersede-running", False)
    if not isinstance(running, bool):
        raise ConfigError(f"{where}: 'supersede-running' must be true or false")
    protect = _duration(item.get("protect-running-after"), "protect-running-after", where)
    size = item.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ConfigError(f"{where}: 'size' must be a whole number >= 0")
    on_failure = _choice(
        item.get("on-primary-failure", "supersede"), PrimaryFailure, "on-primary-failure", where
    )
    for field in ("bisect-confirm", "bisect-confidence", "bisect-parallel"):
        if field in item and on_failure is not PrimaryFailure.BISECT:
            raise ConfigError(f"{where}: '{field}' only applies to on-primary-failure: bisect")
    if "hold-by" in item and on_failure is PrimaryFailure.SUPERSEDE:
        raise ConfigError(
            f"{where}: 'hold-by' only applies to on-primary-failure: release or bisect"
        )
    confirm = item.get("bisect-confirm", DEFAULT_CONFIRM)
    if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 0:
        raise ConfigError(f"{where}: 'bisect-confirm' must be a whole number >= 0")
    confidence = item.get("bisect-confidence", DEFAULT_CONFIDENCE)
    if (
        isinstance(confidence, bool)
        or not isinstance(confidence, int | float)
        or not 0.5 <= confidence < 1
    ):
        raise ConfigError(f"{where}: 'bisect-confidence' must be a number from 0.5 to below 1")
    parallel = item.get("bisect-parallel", DEFAULT_PARALLEL)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or not 1 <= parallel <= 32:
        raise ConfigError(f"{where}: 'bisect-parallel' must be a whole number from 1 to 32")
    return Rule(
        name=name,
        patterns=patterns,
        strategy=strategy,
        supersede_running=running,
        protect_running_after_ms=protect,
        age_ms=_duration(item.get("age"), "age", where),
        size=size,
        on_primary_failure=on_failure,
        cascade=_choice(item.get("cascade", "cancel"), Cascade, "cascade", where),
        bisect_confirm=confirm,
        bisect_confidence=float(confidence),
        bisect_parallel=parallel,
        hold_by=_choice(item.get("hold-by", "claim"), HoldBy, "hold-by", where),
    )


def _patterns(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        raise ConfigError(f"{where}: 'keys' (a glob or a list of globs) is required")
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}: 'keys' must be a glob or a non-empty list of globs")
    for p in items:
        if not isinstance(p, str) or not _PATTERN_RE.fullmatch(p):
            raise ConfigError(f"{where}: key pattern {p!r} may hold key characters and * ** ? only")
    return tuple(items)


def _choice(raw: Any, kind: type[E], field: str, where: str) -> E:
    try:
        return kind(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise ConfigError(f"{where}: '{field}' is {raw!r}; expected one of {allowed}") from None


def _duration(raw: Any, field: str, where: str) -> int | None:
    """Milliseconds from ``90``, ``90s``, ``10m``, ``2h`` or ``1d``."""
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise ConfigError(f"{where}: '{field}' must be a duration like 90, 90s, 10m or 2h")
    if isinstance(raw, int | float):
        seconds = float(raw)
    else:
        found = _DURATION_RE.fullmatch(str(raw).strip())
        if not found:
            raise ConfigError(
                f"{where}: '{field}' is {raw!r}; expected a duration like 90, 90s, 10m or 2h"
            )
        seconds = float(found.group(1)) * _UNITS[found.group(2)]
    if seconds < 0:
        raise ConfigError(f"{where}: '{field}' must not be negative")
    return int(seconds * 1000)


def loads(text: str, source: str, *, toml: bool) -> Policy:
    """Parse policy text (TOML when ``toml``, else YAML)."""
    try:
        doc = tomllib.loads(text) if toml else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{source}: not valid {'TOML' if toml else 'YAML'}: {exc}") from None
    return parse(doc, source)


def load(path: str | Path, *, named_by: str = "COALESCER_POLICY_FILE") -> Policy:
    """Read and validate a policy file (``.toml`` is TOML, anything else YAML). ``named_by``
    says where the path came from, for the message when it cannot be read."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{named_by} {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{named_by} {str(path)!r} cannot be read: {why}") from None
    return loads(text, str(path), toml=file.suffix.lower() == ".toml")


def describe(policy: Policy) -> list[str]:
    """One line per rule, for ``coalescer policy check`` and the logs."""
    lines = []
    for rule in policy.rules:
        bits = [str(rule.strategy)]
        if rule.decides:
            if rule.supersede_running:
                bits.append("running too")
            if rule.protect_running_after_ms is not None:
                bits.append(f"protects runs over {rule.protect_running_after_ms / 1000:g}s")
            if rule.age_ms is not None or rule.size is not None:
                bits.append(f"age>{(rule.age_ms or 0) / 1000:g}s size>{rule.size or 0}")
            bits.append(f"on primary failure {rule.on_primary_failure}")
            if rule.on_primary_failure is PrimaryFailure.BISECT:
                bits.append(
                    f"bisect confirm {rule.bisect_confirm}, confidence {rule.bisect_confidence:g}, "
                    f"{rule.bisect_parallel} at once"
                )
            bits.append(f"cascade {rule.cascade}")
        lines.append(f"{rule.name}: {', '.join(rule.patterns)} -> {'; '.join(bits)}")
    return lines
