"""The soak's mutation check: is each invariant worth the bugs it is meant to catch?

Each :class:`Mutant` is one small bug a user would care about, written as exact edits of the
product's source. For each, the project is copied to a scratch directory, the bug applied there,
and the short soak run on the copy (first on ``PYTHONPATH``, so that every process the soak
starts runs the bug) with a fixed seed; the mutant is *caught* when the soak reports at least
one violation. The unmodified copy runs first and must report none, or a catch means nothing.

    python -m tests.soak.mutants [--store redis|cluster] [--seed 1179] [--only NAME,...] [--list]

``make soak-check`` runs it (through ``scripts/with_services.py``); it prints the table of
results and exits 1 when a mutant escaped or the unmodified soak failed. Soaks run one at a
time. Add a mutant with each new invariant: the bug it exists to catch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the faults' seed: the 60 s soak of ``make test``'s (tests/integration/test_soak.py), whose
#: faults hit the store as well as the processes and the broker
SEED = 1179
#: not copied to the scratch directory
IGNORED = (".git", ".venv*", "build", "site", "__pycache__", "*.pyc", ".*_cache", "soak-report-*")


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``path``; ``old`` must occur exactly ``count`` times."""

    path: str
    old: str
    new: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    bug: str  # what a user would see
    catches: str  # the invariant meant to catch it
    edits: tuple[Edit, ...]
    #: the soak's duration for this bug, when the short soak's is too short to see it surely
    duration: float | None = None


_LW_PRIMARY = """\
  if strategy == 'latest-wins' then
    for _, c in ipairs(pending) do
      if primary == nil or before(primary, c) then primary = c end
    end
    for _, c in ipairs(running) do
      if primary == nil or before(primary, c) then primary = c end
    end
  else
"""
_CANCEL = "await self.cancel(entry, got) if entry.supersede_running else missed(got)"
_COMPLETED = """\
        if self.mode is SupersedeAs.COMPLETED:
            done = Resolution("completed", "--resolve-superseded-as completed")
            await put_artifact(self._http, claim, SUPERSEDED_BY, superseded_by_json(*primary))
"""
_COMPLETED_BARE = """\
        if self.mode in (SupersedeAs.COMPLETED, SupersedeAs.AUTO):
            done = Resolution("completed", "--resolve-superseded-as completed")
"""

MUTANTS = (
    Mutant(
        "shim-runs-oldest",
        "the worker shim runs the oldest held task",
        "only newer supersedes older",
        (
            Edit(
                "coalescer/worker/protocol.py",
                "    for task_id in reversed(listed):\n        if task_id in held:",
                "    for task_id in listed:\n        if task_id in held:",
            ),
        ),
    ),
    Mutant(
        "latest-wins-keeps-oldest",
        "latest-wins keeps the oldest pending task",
        "only newer supersedes older",
        (
            Edit(
                "coalescer/store/scripts/decide.lua",
                _LW_PRIMARY,
                "  if strategy == 'latest-wins' then\n"
                "    for _, c in ipairs(pending) do\n"
                "      if primary == nil or before(c, primary) then primary = c end\n"
                "    end\n"
                "  else\n",
            ),
            Edit(
                "coalescer/store/scripts/decide.lua",
                "(strategy == 'first-wins' or before(c, primary))",
                "(strategy == 'first-wins' or strategy == 'latest-wins')",
            ),
        ),
    ),
    Mutant(
        "answer-newest-first",
        "the superseding answer lists newest first",
        "only newer supersedes older",
        (
            Edit(
                "coalescer/model.py",
                'return [*reversed(older), initial, *reversed(newer)], "ok"',
                'return [*newer, initial, *older], "ok"',
            ),
        ),
    ),
    Mutant(
        "completed-with-link",
        "a superseded run resolved `completed` (with `superseded-by.json`)",
        "superseded runs never pass; no task that did not run reads completed",
        (
            Edit(
                "coalescer/worker/resolve.py",
                "        if self.mode is SupersedeAs.COMPLETED:\n",
                "        if self.mode in (SupersedeAs.COMPLETED, SupersedeAs.AUTO):\n",
            ),
        ),
    ),
    Mutant(
        "completed-without-link",
        "a superseded run resolved `completed` without `superseded-by.json`",
        "no task that did not run reads completed",
        (
            Edit(
                "coalescer/worker/resolve.py",
                _COMPLETED,
                _COMPLETED_BARE,
            ),
        ),
    ),
    Mutant(
        "listen-drops-1-in-50",
        "`listen` drops 1 event in 50, acknowledged as applied",
        "every event acknowledged was applied",
        (
            Edit(
                "coalescer/ingest/pulse.py",
                "            if event is not None:\n                events.append(event)",
                "            if event is not None and __import__('random').random() >= 1 / 50:\n"
                "                events.append(event)",
            ),
        ),
    ),
    Mutant(
        "listen-drops-1-in-200",
        "`listen` drops 1 event in 200, acknowledged as applied",
        "every event acknowledged was applied",
        (
            Edit(
                "coalescer/ingest/pulse.py",
                "            if event is not None:\n                events.append(event)",
                "            if event is not None and __import__('random').random() >= 1 / 200:\n"
                "                events.append(event)",
            ),
        ),
        # Only a lost resolution leaves a trace (a later event of the task makes up for a lost
        # pending or running one): about 1 event in 2 here, so 60 s (some 1,300 events) find
        # 3 on average and miss them all about once in 25 runs; 120 s, once in 600.
        duration=120.0,
    ),
    Mutant(
        "enforcer-cancels-running",
        "the enforcer cancels a running victim although its rule has no `supersede-running`",
        "no running task canceled unless its rule allows it",
        (
            Edit(
                "coalescer/policy/actions.py",
                _CANCEL,
                "await self.cancel(entry, got)",
                count=2,
            ),
        ),
    ),
    Mutant(
        "rules-supersede-running",
        "every rule decides as if `supersede-running` were set",
        "no running task canceled unless its rule allows it",
        (
            Edit(
                "coalescer/policy/rules.py",
                "            int(self.supersede_running),",
                "            1,",
            ),
        ),
    ),
    Mutant(
        "protection-ignored",
        "`protect-running-after` ignored (when deciding and when canceling)",
        "no running task canceled unless its rule allows it",
        (
            Edit(
                "coalescer/store/scripts/decide.lua",
                "  if protect < 0 then\n    return false",
                "  if true then\n    return false",
            ),
            Edit(
                "coalescer/policy/actions.py",
                "if entry.protect_ms >= 0 and (not started or ran > entry.protect_ms):",
                "if False:",
            ),
        ),
    ),
    Mutant(
        "culprit-is-last-good",
        "the bisection names the last good push instead of the first failing one",
        "every culprit is where the breakage began",
        (
            Edit(
                "coalescer/bisection.py",
                "            return None\n        return self.bad\n",
                "            return None\n        return self.good if self.good >= 0 else self.bad\n",
            ),
        ),
    ),
    Mutant(
        "failures-trusted",
        "the bisection trusts every failure (`bisect-confirm` ignored)",
        "no flaky key gets a culprit",
        (
            Edit(
                "coalescer/bisection.py",
                "        search = cls(\n            n=n, confirm=confirm,",
                "        confirm = 0\n        search = cls(\n            n=n, confirm=confirm,",
            ),
        ),
    ),
    Mutant(
        "serve-leaks",
        "`serve` leaks about 100 KB per query",
        "memory flat",
        (
            Edit("coalescer/web/api.py", "\ndef parse(", "\n_LEAK = []\n\n\ndef parse("),
            Edit(  # every superseding query, on the server's fast path or not, is parsed here
                "coalescer/web/api.py",
                "    started = time.perf_counter()\n    params = _query(query_string)\n",
                '    _LEAK.append(b"x" * 100_000)\n'
                "    started = time.perf_counter()\n    params = _query(query_string)\n",
            ),
        ),
    ),
)


def copy_project(into: Path) -> Path:
    """The working tree as it is (uncommitted changes included), without caches and venvs."""
    shutil.copytree(ROOT, into, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)
    return into


def apply(root: Path, mutant: Mutant) -> None:
    for edit in mutant.edits:
        path = root / edit.path
        text = path.read_text()
        found = text.count(edit.old)
        if found != edit.count:
            raise SystemExit(
                f"mutant {mutant.name}: {edit.path} holds its text {found} times, not "
                f"{edit.count}: the source moved on; update tests/soak/mutants.py"
            )
        path.write_text(text.replace(edit.old, edit.new))


@dataclasses.dataclass
class Outcome:
    name: str
    bug: str
    violations: int
    invariants: dict[str, int]
    seconds: float
    error: str = ""

    @property
    def caught(self) -> bool:
        return self.violations > 0


def soak(
    root: Path, report: Path, args: argparse.Namespace, duration: float
) -> tuple[int, dict[str, int], str]:
    """Run the short soak on the copy at ``root``: (violations, by invariant, error)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    argv = [
        sys.executable, "-m", "tests.soak", "--duration", str(duration),
        "--settle", str(args.settle), "--seed", str(args.seed), "--store", args.store,
        "--report", str(report),
    ]  # fmt: skip
    with open(report.with_suffix(".out"), "w") as out:
        try:
            done = subprocess.run(
                argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                timeout=duration + args.settle + 400,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return 0, {}, "the soak timed out"
    try:
        body = json.loads((report / "report.json").read_text())
    except (OSError, ValueError):
        tail = report.with_suffix(".out").read_text(errors="replace")[-600:]
        return 0, {}, f"no report (exit {done.returncode}): {tail}"
    by = Counter(v["invariant"] for v in body["violations"])
    return len(body["violations"]), dict(by), ""


def run_one(name: str, bug: str, mutant: Mutant | None, args: argparse.Namespace) -> Outcome:
    started = time.time()
    with tempfile.TemporaryDirectory(prefix=f"coalescer-mutant-{name}-") as scratch:
        root = copy_project(Path(scratch) / "project")
        if mutant is not None:
            apply(root, mutant)
        report = args.report / name
        shutil.rmtree(report, ignore_errors=True)
        duration = (mutant and mutant.duration) or args.duration
        violations, by, error = soak(root, report, args, duration)
    bug = bug if duration == args.duration else f"{bug} ({duration:g} s soak)"
    return Outcome(name, bug, violations, by, time.time() - started, error)


def table(outcomes: list[Outcome], args: argparse.Namespace) -> str:
    lines = [
        f"soak: {args.duration:g} s on {args.store}, seed {args.seed}",
        "",
        "| injected bug | caught? | violations (by invariant) |",
        "|---|---|---|",
    ]
    for o in outcomes:
        by = "; ".join(f"{k}: {n}" for k, n in sorted(o.invariants.items(), key=lambda i: -i[1]))
        if o.name == "unmodified":
            mark = "✔ none" if not o.violations and not o.error else "✘ VIOLATIONS"
        else:
            mark = f"✔ {o.violations}" if o.caught else "✘ 0"
        lines.append(f"| {o.bug} | {mark} | {o.error or by or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.mutants", description=__doc__)
    parser.add_argument("--store", choices=("redis", "cluster"), default="redis")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="longest wait for the queue to settle (default 25 s; 90 s on a Cluster, where the "
        "enforcer's bisections after the regression take longer)",
    )
    parser.add_argument("--only", default="", help="these mutants only (comma-separated)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmodified soak")
    parser.add_argument("--report", type=Path, default=Path("build/soak-check"))
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    if args.settle is None:
        args.settle = 90.0 if args.store == "cluster" else 25.0
    only = set(filter(None, args.only.split(",")))
    chosen = [m for m in MUTANTS if not only or m.name in only]
    if unknown := only - {m.name for m in MUTANTS}:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    if args.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.bug} (caught by: {m.catches})")
        return 0
    args.report = args.report.resolve()
    args.report.mkdir(parents=True, exist_ok=True)
    for m in chosen:  # every edit still applies, before an hour of soaks
        with tempfile.TemporaryDirectory() as scratch:
            for edit in m.edits:
                (Path(scratch) / edit.path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / edit.path, Path(scratch) / edit.path)
            apply(Path(scratch), m)
    outcomes = []
    runs: list[tuple[str, str, Mutant | None]] = [(m.name, m.bug, m) for m in chosen]
    if not args.no_baseline:
        runs.insert(0, ("unmodified", "none (the product as it is)", None))
    for name, bug, mutant in runs:
        print(f"soak-check: {name} ...", flush=True)
        outcome = run_one(name, bug, mutant, args)
        outcomes.append(outcome)
        print(
            f"soak-check: {name}: {outcome.violations} violations in {outcome.seconds:.0f} s "
            f"{outcome.invariants or outcome.error}",
            flush=True,
        )
    text = table(outcomes, args)
    (args.report / "table.md").write_text(text + "\n")
    print(text)
    bad = [
        o.name
        for o in outcomes
        if o.error or (o.caught if o.name == "unmodified" else not o.caught)
    ]
    if bad:
        print(f"soak-check: FAILED: {', '.join(bad)}")
        return 1
    print(f"soak-check: every mutant caught ({len(chosen)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
