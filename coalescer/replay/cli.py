"""``coalescer replay``: replay a task history under several superseding configurations."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from tqdm import tqdm

from coalescer.errors import ConfigError, InvalidInput
from coalescer.replay.history import History
from coalescer.settings import Settings, redis_url

if TYPE_CHECKING:
    from coalescer.replay.links import Evidence
    from coalescer.replay.pool import Outcome
    from coalescer.replay.runner import Config


def register(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="show what superseding would save and cost on a task history",
        description="Replay a task history (synthetic by default, or recorded Pulse messages, "
        "or task groups read from a queue) against a modelled worker pool, once per "
        "configuration, through the service's own index, and compare them side by side.",
    )
    source = p.add_argument_group("history (synthetic unless --events or --task-group)")
    source.add_argument(
        "--events",
        metavar="FILE",
        help="Pulse messages: JSON lines, or a JSON array (the body of POST /v1/events)",
    )
    source.add_argument(
        "--task-group",
        action="append",
        default=[],
        metavar="ID",
        help="a task group to read from the queue (TASKCLUSTER_ROOT_URL); repeatable",
    )
    source.add_argument(
        "--recorded",
        metavar="FILE",
        help="a history recorded with --save: its task groups, links and findings as the "
        "queue and the service answered them, replayed without either",
    )
    source.add_argument(
        "--save",
        metavar="FILE",
        help="with --task-group: keep what the queue and the service answered in FILE, for "
        "--recorded to replay anywhere",
    )
    source.add_argument(
        "--service",
        metavar="URL",
        help="a coalescer service whose lineage (GET /v1/tasks/<taskId>) says which recorded "
        "runs its enforcer superseded or canceled",
    )
    source.add_argument(
        "--enforcer-identity",
        action="append",
        default=[],
        metavar="GROUP/ID",
        help="the workerGroup/workerId coalescer enforce claims as: every run it resolved was "
        "superseded (default: coalescer/enforcer); repeatable",
    )
    synth = p.add_argument_group("synthetic history")
    synth.add_argument(
        "--hours",
        type=float,
        default=24.0,
        help="length of history (24); it starts at midnight UTC (a quiet night, then the day's "
        "peak from 10:00), or, when shorter than 10 hours, ends at 10:00: --hours 1 replays "
        "09:00-10:00, at nearly the peak rate",
    )
    synth.add_argument("--pushes-per-hour", type=float, default=12.0, help="at the daily peak (12)")
    synth.add_argument("--platforms", type=int, default=2, help="builds per push (2)")
    synth.add_argument("--suites", type=int, default=3, help="tests per build (3)")
    synth.add_argument("--build-minutes", type=float, default=30.0, help="median build (30)")
    synth.add_argument("--test-minutes", type=float, default=12.0, help="median test (12)")
    synth.add_argument("--build-workers", type=int, default=5, help="per build queue (5)")
    synth.add_argument("--test-workers", type=int, default=6, help="per test queue (6)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (0)")
    synth.add_argument(
        "--regressions",
        type=float,
        default=0.0,
        metavar="RATE",
        help="probability that a push breaks a key that passes (0: none)",
    )
    synth.add_argument(
        "--fix-after",
        type=int,
        default=3,
        metavar="N",
        help="a breakage lasts 1 to N pushes of its key, drawn at random (3)",
    )
    synth.add_argument(
        "--intermittent",
        type=float,
        default=0.0,
        metavar="RATE",
        help="probability that any other run fails (0: none)",
    )
    synth.add_argument(
        "--flaky",
        default="",
        metavar="SHARE:RATE",
        help="that share of the keys (chosen at random) fails that share of its runs, on top "
        "of --intermittent (e.g. 0.25:0.1; none by default)",
    )
    synth.add_argument(
        "--flaky-regressions",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="that share of the regressions fails only some runs of its broken pushes, at a "
        "rate drawn between 0.3 and 0.7 for each (0: every run fails)",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="C",
        help="off; on-claim, latest-wins or first-wins, optionally with ,age=SECONDS,size=N "
        "(tc-coalesce's thresholds); or age=SECONDS,size=N alone (on claim); any with "
        ",on-primary-failure=supersede|release|bisect (on claim: the worker's flag; "
        "latest-wins, first-wins: the enforcer's), bisect with ,bisect-confirm=N (reruns "
        "confirming a failure, 3 by default), the enforcer's release and bisect with "
        ",hold-by=claim|priority; repeatable; off is always replayed first, as "
        "the baseline (default: off, age=3600,size=5, on-claim, or off alone with --policy)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FILE",
        help="a policy file (YAML, or TOML for .toml), as coalescer enforce reads it: each key "
        "replayed with its own rule; repeatable, each file a configuration",
    )
    p.add_argument(
        "--workers",
        action="append",
        default=[],
        metavar="[QUEUE=]N",
        help="workers of a task queue, or of every queue the history does not size; repeatable",
    )
    p.add_argument("--redis-url", help="replay on this Redis (default: the embedded store)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--html", metavar="FILE", help="write an HTML report with charts here")
    p.set_defaults(handler=_replay)


def parse_workers(values: list[str]) -> tuple[dict[str, int], int | None]:
    per_queue: dict[str, int] = {}
    default: int | None = None
    for value in values:
        queue, _, count = value.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--workers {value!r}: expected N or QUEUE=N with N ≥ 1")
        if queue:
            per_queue[queue] = int(count)
        else:
            default = int(count)
    return per_queue, default


def _replay(args: argparse.Namespace, settings: Settings) -> int:
    from coalescer.policy import rules
    from coalescer.replay import metrics, report, runner, sheriffs

    redis_url(args.redis_url, "--redis-url")
    defaults = [] if args.policy else ["age=3600,size=5", "on-claim"]
    try:
        configs = [runner.Config.parse(c) for c in args.config or defaults]
    except InvalidInput as exc:
        raise ConfigError(str(exc)) from exc
    for file in args.policy:
        if not Path(file).is_file():
            raise ConfigError(f"--policy {file!r}: no such file")
    files = [runner.Config.from_policy(rules.load(f), Path(f).name) for f in args.policy]
    configs = [runner.Config(False), *(c for c in configs if c.supersede), *files]
    workers, default = parse_workers(args.workers)
    history = _history(args, settings, workers, default)
    _unchecked(history)
    for note in history.notes:
        print(f"coalescer replay: {note}", file=sys.stderr)
    started = time.monotonic()
    outcomes = asyncio.run(_run(history, configs, args.redis_url, settings))
    seconds = time.monotonic() - started
    summaries: list[metrics.Summary] = []
    for config, outcome in zip(configs, outcomes, strict=True):
        base = summaries[0].worker_hours if summaries else None
        summaries.append(
            metrics.summarize(
                history,
                config.name,
                outcome,
                base,
                rule_of=config.rule_for,
                baseline=outcomes[0],
            )
        )
    references: tuple[sheriffs.Reference, ...] = ()
    if report.can_fail(history):
        base = sheriffs_base(configs)
        references = tuple(
            sheriffs.reference(history, outcomes[base], configs[base].name, way)
            for way in (sheriffs.LINEAR, sheriffs.MOZCI)
        )
    result = report.Report(history, tuple(summaries), seconds, references)
    if args.html:
        try:
            Path(args.html).write_text(report.html(result))
        except OSError as exc:
            raise ConfigError(f"cannot write {args.html}: {exc.strerror}") from exc
    if args.json:
        sys.stdout.write(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(report.table(result))
        if args.html:
            print(f"\nHTML report: {args.html}")
    return 0


def sheriffs_base(configs: list[Config]) -> int:
    """The configuration whose failures the reference columns work on: the first that
    supersedes without searching after a failed primary (what sheriffs backfill today), else
    the first that supersedes, else ``off``."""
    from coalescer.policy import PrimaryFailure

    plain = (None, PrimaryFailure.SUPERSEDE)
    found = [n for n, c in enumerate(configs) if c.supersede]
    searchless = (n for n in found if configs[n].on_failure in plain and not configs[n].rules)
    return next(searchless, found[0] if found else 0)


def _history(
    args: argparse.Namespace, settings: Settings, workers: dict[str, int], default: int | None
) -> History:
    from coalescer.replay import recorded, sources, synthetic

    prefix, rank_tag = settings.route_prefix, settings.rank_tag
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per link read is noise here
    try:
        evidence = _evidence(args, settings)
        if args.events:
            with open(args.events, "rb") as lines:
                return sources.from_events(
                    sources.read_events(lines),
                    prefix=prefix,
                    rank_tag=rank_tag,
                    workers=workers,
                    default_workers=default,
                    source=f"recorded events ({Path(args.events).name})",
                    evidence=evidence,
                )
        if args.recorded:
            answers = recorded.Answers.load(args.recorded)
            stored, replayed, groups = recorded.replaying(answers)
            return sources.from_task_groups(
                stored,
                groups,
                prefix=answers.prefix or prefix,
                rank_tag=rank_tag,
                workers=workers,
                default_workers=default,
                evidence=replayed,
                source=f"recorded history ({Path(args.recorded).name})",
            )
        if args.task_group:
            if evidence.queue is None:
                raise ConfigError("--task-group needs TASKCLUSTER_ROOT_URL")
            queue, kept = evidence.queue, None
            if args.save:
                queue, kept = recorded.recording(queue, evidence)
            history = sources.from_task_groups(
                queue,
                args.task_group,
                prefix=prefix,
                rank_tag=rank_tag,
                workers=workers,
                default_workers=default,
                evidence=kept or evidence,
            )
            if kept is not None:
                kept.answers.prefix = prefix
                try:
                    kept.answers.save(args.save)
                except OSError as exc:
                    raise ConfigError(f"cannot write {args.save}: {exc.strerror}") from exc
            return history
        if args.save:
            raise ConfigError("--save needs --task-group")
        flaky_share, flaky_rate = synthetic.parse_flaky(args.flaky)
        spec = synthetic.Synthetic(
            hours=args.hours,
            pushes_per_hour=args.pushes_per_hour,
            platforms=args.platforms,
            suites=args.suites,
            build_minutes=args.build_minutes,
            test_minutes=args.test_minutes,
            build_workers=args.build_workers,
            test_workers=args.test_workers,
            seed=args.seed,
            regression_rate=args.regressions,
            fix_after=args.fix_after,
            intermittent_rate=args.intermittent,
            flaky_share=flaky_share,
            flaky_rate=flaky_rate,
            flaky_regressions=args.flaky_regressions,
        )
        history = synthetic.generate(spec)
        return dataclasses.replace(history, workers={**history.workers, **workers})
    except OSError as exc:
        raise ConfigError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    except InvalidInput as exc:
        raise ConfigError(str(exc)) from exc


def _evidence(args: argparse.Namespace, settings: Settings) -> Evidence:
    """How the recorded history's superseded runs are told: the enforcer's identities, the
    queue (``TASKCLUSTER_ROOT_URL``) for their ``superseded-by.json``, the service's lineage."""
    from coalescer.replay.links import Evidence
    from coalescer.replay.runs import ENFORCER, parse_identity

    try:
        identities = frozenset(map(parse_identity, args.enforcer_identity)) or {ENFORCER}
    except ValueError as exc:
        raise ConfigError(f"--enforcer-identity {exc}") from exc
    queue = None
    if settings.taskcluster_root_url and (args.events or args.task_group):
        import taskcluster

        queue = taskcluster.Queue(
            {"rootUrl": settings.taskcluster_root_url, **taskcluster.optionsFromEnvironment()}
        )
    service = args.service
    if service is not None and not service.startswith(("http://", "https://")):
        raise ConfigError(f"--service {service!r}: expected an http:// or https:// URL")
    return Evidence(frozenset(identities), queue, service)


def _unchecked(history: History) -> None:
    """Say, on stderr, how many recorded runs may have been superseded unbeknown."""
    if history.unchecked:
        print(
            f"coalescer replay: {history.unchecked} recorded runs (canceled, or completed while "
            "their worker held another task of their key) may have been superseded, but no "
            "link could be read for them: set TASKCLUSTER_ROOT_URL to read their "
            "superseded-by.json, or give --service; they are replayed as they ended",
            file=sys.stderr,
        )


async def _run(
    history: History, configs: list[Config], redis_url: str | None, settings: Settings
) -> list[Outcome]:
    from coalescer.replay import runner
    from coalescer.store import open_store

    # The embedded store is the right one here: its production warning would only mislead.
    logging.getLogger("coalescer.store.embedded").setLevel(logging.ERROR)
    # The modelled enforcer's lines (releases before a deadline, culprits) are the report's.
    logging.getLogger("coalescer.policy").setLevel(logging.ERROR)
    store = await open_store(redis_url, grace_seconds=settings.grace_seconds)
    bar = tqdm(
        total=len(history.tasks) * len(configs),
        unit="task",
        desc="replaying",
        disable=None,
        file=sys.stderr,
    )
    try:
        return await runner.replay(history, configs, store, progress=bar.update)
    finally:
        bar.close()
        await store.close()
