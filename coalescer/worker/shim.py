"""The shim: claim all, run the newest, resolve the rest.

:meth:`Shim.run` takes one claim from ``claimWork`` and an ``execute`` coroutine function:

1. ask the task's superseder (allow-listed, with a timeout), or run the task alone;
2. claim each listed task's current pending run, in parallel, after checking its definition;
3. run ``execute`` on the highest-indexed held task (the primary), keeping every claim alive;
4. resolve each secondary as superseded, with ``public/superseded-by.json``; then give the
   primary ``public/supersedes.json`` and its own resolution. After a failed primary, with
   ``on_primary_failure`` ``bisect``, the secondaries are bisected first
   (:mod:`coalescer.worker.culprit`): a few run, the others are superseded by the run that
   stands for them; the finding is then reported to the superseder service
   (``POST /v1/bisections``, with ``Options.report_token``).

If the primary's claim is lost (canceled) or ``stop`` is set (worker shutdown), ``execute`` is
cancelled and the held runs are released with ``worker-shutdown`` so that the queue retries
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any

import aiohttp
import httpx

from coalescer.verdicts import DEFAULT_FLAKE
from coalescer.worker import findings, notice, superseder
from coalescer.worker.allow import AmbiguousUrl, canonical_url, url_allowed
from coalescer.worker.claims import (
    Claim,
    Clock,
    Connection,
    Keeper,
    claim_listed,
    parse_time,
    utcnow,
)
from coalescer.worker.culprit import Finding, Search
from coalescer.worker.notice import Why
from coalescer.worker.protocol import (
    SUPERSEDES,
    Options,
    Outcome,
    Resolution,
    SupersederError,
    choose_primary,
    given_back,
    query_url,
    secondary_fate,
    superseder_url,
    supersedes_json,
)
from coalescer.worker.resolve import Resolver

log = logging.getLogger("coalescer.worker")
#: The key's newest findings its flake rate is read from, as the enforcer does.
FLAKE_FINDINGS = 50
#: Seconds the shim keeps an idle HTTP connection (to the superseder, to artifact storage):
#: less than servers keep one (``coalescer serve`` 5 s by default, uvicorn 5 s), so that it
#: never sends a query on a connection the server is closing at that moment, which would fail.
KEEP_IDLE_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Superseded:
    """A task the primary may supersede, as the primary sees it."""

    task_id: str
    run_id: int
    task: Mapping[str, Any]


Execute = Callable[[Claim, Sequence[Superseded]], Coroutine[Any, Any, Outcome]]


@dataclasses.dataclass
class TaskSet:
    """The runs held for one claim from ``claimWork``: ``listed`` is the superseder's list,
    oldest first (just the initial task when running alone, ``alone`` saying why)."""

    initial: Claim
    listed: list[str]
    held: dict[str, Claim]
    alone: str | None = None

    @property
    def primary(self) -> Claim:
        return self.held[choose_primary(self.listed, set(self.held))]

    @property
    def secondaries(self) -> list[Claim]:
        primary = self.primary
        return [self.held[t] for t in self.listed if t in self.held and t != primary.task_id]


@dataclasses.dataclass
class Report:
    """What became of a task set: which run ran and how, and what happened to the others."""

    primary: tuple[str, int]
    outcome: Outcome | None = None
    superseded: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    released: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    #: Secondaries whose claim was lost, or whose resolution failed: forgotten.
    dropped: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    #: How each secondary the primary was to supersede was ended, and why.
    resolutions: dict[tuple[str, int], Resolution] = dataclasses.field(default_factory=dict)
    alone: str | None = None
    #: ``canceled`` when the primary's claim was lost, ``shutdown`` when stopped,
    #: ``duplicate`` when another task set of this worker already held the claimed run.
    aborted: str | None = None
    #: With ``--on-primary-failure bisect``, after a failed primary: what the search found.
    bisection: Finding | None = None


def _ref(claim: Claim) -> tuple[str, int]:
    return (claim.task_id, claim.run_id)


class Shim:
    """Superseding for one worker. Use as ``async with Shim(...) as shim``.

    ``credentials`` are the worker's own (``claimTask`` needs ``queue:claim-task:<queue>`` and
    ``queue:worker-id:<group>/<id>``); every held run is then driven with its own temporary
    credentials. ``clock`` tells the queue's time (tests drive the emulator's).
    """

    def __init__(
        self,
        *,
        root_url: str,
        credentials: Mapping[str, Any] | None,
        worker_group: str,
        worker_id: str,
        options: Options | None = None,
        clock: Clock = utcnow,
        max_retries: int = 5,
    ) -> None:
        self.root_url = root_url.rstrip("/")
        self.worker_group = worker_group
        self.worker_id = worker_id
        self.options = options or Options()
        self.clock = clock
        self._credentials = credentials
        self._max_retries = max_retries
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Shim:
        session = await self._stack.enter_async_context(aiohttp.ClientSession())
        self.http = await self._stack.enter_async_context(
            httpx.AsyncClient(limits=httpx.Limits(keepalive_expiry=KEEP_IDLE_SECONDS))
        )
        self.conn = Connection(self.root_url, session, self._max_retries)
        self.queue: Any = self.conn.queue(self._credentials)
        self.resolver = Resolver(
            self.http,
            self.queue,
            self.options.supersede_as,
            root_url=self.root_url,
            by=f"worker {self.worker_group}/{self.worker_id}",
        )
        #: Task ids held by any task set of this worker, so two sets never hold the same run.
        self.held: set[str] = set()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    def claim(self, response: Mapping[str, Any]) -> Claim:
        """A :class:`Claim` of a ``claimWork``/``claimTask`` response's task run."""
        return Claim(response, self.conn, self.clock(), self.options.reclaim_fraction)

    async def _select(self, initial: Claim) -> TaskSet:
        """Ask the superseder and claim what it lists; never fails for the superseder's sake.
        Every run it holds is in ``self.held`` when it returns, and none when it raises."""
        held = {initial.task_id: initial}
        try:
            try:
                listed = await superseder.ask(
                    self.http, initial.task_id, initial.task, self.options
                )
            except SupersederError as exc:
                log.info("running %r alone: %s", initial, exc, extra={"task_id": initial.task_id})
                return TaskSet(initial, [initial.task_id], held, exc.reason)
            except Exception as exc:  # whatever it is, superseding must not block the task
                log.exception("running %r alone: asking the superseder broke", initial)
                return TaskSet(initial, [initial.task_id], held, f"error: {exc!r}")
            spare = self.resolver.superseding.would_release
            why = await spare(initial.task_id)
            if why is None and given_back(initial.status):
                why = "its previous run was given back: it runs itself"
            if why is not None:
                # As a secondary it could only be released (again): claim nothing newer, so
                # that it runs.
                log.info("%r supersedes no newer task: %s", initial, why)
                listed = listed[: listed.index(initial.task_id) + 1]
            await claim_listed(
                self.queue,
                self.conn,
                listed,
                initial,
                held,
                self.held,
                options=self.options,
                worker_group=self.worker_group,
                worker_id=self.worker_id,
                clock=self.clock,
                spare=spare,
            )
        except BaseException:
            # Cancelled (or broken) halfway: whatever was claimed goes back to the queue.
            await asyncio.shield(self._release_all(list(held.values())))
            self.held.difference_update(held)
            raise
        taskset = TaskSet(initial, listed, held)
        log.info(
            "task set of %r: running %r, superseding %d of %d listed",
            initial,
            taskset.primary,
            len(held) - 1,
            len(listed),
            extra={"task_id": initial.task_id},
        )
        return taskset

    async def run(
        self,
        response: Mapping[str, Any],
        execute: Execute,
        *,
        stop: asyncio.Event | None = None,
    ) -> Report:
        """Select the task set of ``response``, run its primary with ``execute`` and resolve
        everything held. ``execute`` gets the primary's claim (use ``claim.queue`` for its
        artifacts: it always holds the newest credentials) and the tasks it may supersede."""
        initial = self.claim(response)
        if initial.task_id in self.held:
            # Another task set of this worker claimed the run (claimTask is idempotent for the
            # same worker, so both calls "succeeded"): it is that set's to run or supersede.
            log.warning("%r is already held by another task set of this worker", initial)
            return Report(_ref(initial), aborted="duplicate")
        self.held.add(initial.task_id)
        try:
            taskset = await self._select(initial)
        except BaseException:
            self.held.discard(initial.task_id)
            raise
        try:
            return await self._run(taskset, execute, stop)
        finally:
            self.held.difference_update(taskset.held)

    async def _run(self, taskset: TaskSet, execute: Execute, stop: asyncio.Event | None) -> Report:
        primary = taskset.primary
        lost = asyncio.Event()
        changed = asyncio.Event()

        def on_lost(claim: Claim) -> None:
            changed.set()
            if claim is primary:
                lost.set()

        keeper = Keeper(self.clock, self.options, on_lost)
        for claim in taskset.held.values():
            keeper.keep(claim)
        view = [Superseded(c.task_id, c.run_id, c.task) for c in taskset.secondaries]
        started = self.clock()
        job = asyncio.create_task(execute(primary, view), name=f"execute {primary!r}")
        waiters = [asyncio.create_task(lost.wait())]
        if stop is not None:
            waiters.append(asyncio.create_task(stop.wait()))
        report = Report(_ref(primary), alone=taskset.alone)
        try:
            await asyncio.wait([job, *waiters], return_when=asyncio.FIRST_COMPLETED)
            if job.done():
                report.outcome = self._outcome(job, primary)
                if self._bisects(taskset, report.outcome):

                    def run(claim: Claim) -> Coroutine[Any, Any, Outcome]:
                        return execute(claim, view if claim is primary else [])

                    flake = await self._flake(taskset)
                    search = Search(
                        [*taskset.secondaries, primary],
                        report.outcome,
                        run=run,
                        resolver=self.resolver,
                        clock=self.clock,
                        confirm=self.options.bisect_confirm,
                        confidence=self.options.bisect_confidence,
                        flake=flake,
                        longest=self.clock() - started,
                        explain=lambda claim, by, found: self._located(taskset, claim, by, found),
                        changed=changed,
                        stop=stop,
                        concurrency=self.options.claim_concurrency,
                        gap=lambda after, before: self._gap(taskset, after, before),
                    )
                    ledger = await search()
                    report.outcome, report.aborted = ledger.outcome, ledger.aborted
                    report.bisection = ledger.finding
                    report.superseded += ledger.superseded
                    report.released += ledger.released
                    report.dropped += ledger.dropped
                    report.resolutions.update(ledger.resolutions)
                else:
                    await self._conclude(taskset, report.outcome, report)
            else:
                report.aborted = "canceled" if lost.is_set() else "shutdown"
                log.warning("stopping %r: %s", primary, report.aborted)
                await _cancel(job)
                held = taskset.secondaries + ([primary] if report.aborted == "shutdown" else [])
                await self._release_into(report, held)
        except BaseException:
            await _cancel(job)
            await asyncio.shield(self._release_all(list(taskset.held.values())))
            raise
        finally:
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            await keeper.close()
        if report.bisection is not None and report.aborted is None:
            await self._report(taskset, report.bisection)
        return report

    def _outcome(self, job: asyncio.Task[Outcome], primary: Claim) -> Outcome:
        try:
            return job.result()
        except Exception:
            log.exception("running %r failed inside the worker", primary)
            return Outcome("exception", "internal-error")

    async def _conclude(self, taskset: TaskSet, outcome: Outcome, report: Report) -> None:
        """Secondaries first (superseded or released), then the primary's artifacts and
        resolution."""
        primary = taskset.primary
        secondaries = taskset.secondaries
        report.dropped.extend(_ref(c) for c in secondaries if c.lost)
        live = [c for c in secondaries if not c.done]
        if secondary_fate(outcome, self.options.on_primary_failure) == "supersede":
            bound = asyncio.Semaphore(max(1, self.options.claim_concurrency))

            async def one(claim: Claim) -> Resolution | None:
                async with bound:
                    return await self.resolver.supersede(claim, primary, self._why(taskset, claim))

            results = await asyncio.gather(*(one(c) for c in live))
            for claim, done in zip(live, results, strict=True):
                if done is None:
                    report.dropped.append(_ref(claim))
                    continue
                report.resolutions[_ref(claim)] = done
                (report.superseded if done.superseded else report.released).append(_ref(claim))
        else:
            await self._release_into(report, live)
        artifacts = [(SUPERSEDES, supersedes_json(report.superseded))] if report.superseded else []
        if not await self.resolver.resolve(primary, outcome, artifacts):
            report.aborted = "canceled"

    def _bisects(self, taskset: TaskSet, outcome: Outcome) -> bool:
        """Whether the secondaries are bisected: a failed primary, ``bisect`` configured, and
        some secondary still held."""
        fate = secondary_fate(outcome, self.options.on_primary_failure)
        return fate == "bisect" and any(not c.done for c in taskset.secondaries)

    def _findings_at(self, taskset: TaskSet, *, allowed: bool = True) -> tuple[str, str] | None:
        """The key and the service's ``/v1/bisections`` URL the task's ``supersederUrl`` names,
        when it is under an allowed prefix (or, with ``allowed`` false, whatever its path: on
        the origin of the superseder the shim asked, with no token); else None."""
        task = taskset.initial.task
        routes, prefix = list(task.get("routes") or []), self.options.route_prefix
        url = superseder_url(task)
        key = findings.reported_key(url, routes, prefix)
        target = findings.report_url(url, routes, prefix)
        if key is None or target is None:
            return None
        target = canonical_url(target)
        return (key, target) if not allowed or url_allowed(target, self.options.allow) else None

    async def _gap(
        self, taskset: TaskSet, after: str | None, before: str
    ) -> dict[str, tuple[float, str]] | None:
        """What the service's index knows of the key's tasks between ``after`` and ``before``
        (``GET /v1/bisections/gap``, no token needed): ``{taskId: (order, state)}``, None when
        it cannot say: also when ``after`` (or, without it, ``before``) was created before the
        index began to know every task (``knownSince``: the store was new or emptied since),
        as tasks between may then have ended unseen."""
        try:
            at = self._findings_at(taskset, allowed=False)
            if at is None:
                return None
            params = {"key": at[0], "before": before, **({"after": after} if after else {})}
            async with asyncio.timeout(self.options.timeout):
                response = await self.http.get(f"{at[1]}/gap", params=params)
            response.raise_for_status()
            body = response.json()
            base = after or before
            since = parse_time(str(body["knownSince"]))
            if parse_time(str(taskset.held[base].task["created"])) < since:
                log.info(
                    "the service's index knows every task of the key only since %s, after %s "
                    "was created: tasks between it and %s may have ended unseen",
                    body["knownSince"],
                    base,
                    before,
                )
                return None
            return {t["taskId"]: (float(t["order"]), str(t["state"])) for t in body["tasks"]}
        except Exception as exc:  # it cannot say: the search's culprit stays a suspect
            log.info("the tasks between %s and %s not read: %s", after, before, exc)
            return None

    async def _flake(self, taskset: TaskSet) -> float:
        """The key's flake rate, from the findings the superseder service holds for it
        (``GET /v1/bisections?key=K``, no token needed); the prior's when the service cannot
        say (not asked under an allowed prefix, slow, or answering something else)."""
        try:
            at = self._findings_at(taskset)
            if at is None:
                return DEFAULT_FLAKE
            key, target = at
            async with asyncio.timeout(self.options.timeout):
                response = await self.http.get(
                    target, params={"key": key, "limit": str(FLAKE_FINDINGS)}
                )
            rate = findings.flake_rate(response.json() if response.status_code == 200 else None)
        except Exception as exc:  # best effort: the prior is a fine answer
            log.info("flake rate of %r's key not read, the prior's used: %s", taskset.primary, exc)
            return DEFAULT_FLAKE
        log.info("bisection after %r: the key's flake rate is %.3f", taskset.primary, rate)
        return rate

    async def _report(self, taskset: TaskSet, found: Finding) -> None:
        """Report a bisection's finding to the superseder service (``POST /v1/bisections``),
        for its API, pages and metrics. Best effort, once every held run is resolved: a
        failure is a warning, never a change to the tasks. The token goes only to a URL under
        an allowed prefix (``--superseder-allow``), as the superseder's own URL does."""
        token = self.options.report_token
        if token is None:
            log.debug("bisection finding not reported: no report token (--report-token-env)")
            return
        task = taskset.initial.task
        routes = list(task.get("routes") or [])
        prefix = self.options.route_prefix
        try:
            url = superseder_url(task)
            key = findings.reported_key(url, routes, prefix)
            target = findings.report_url(url, routes, prefix)
            if key is None or target is None:
                raise AmbiguousUrl(f"its supersederUrl {url} names none of its {prefix}.* keys")
            target = canonical_url(target)
            if not url_allowed(target, self.options.allow):
                raise AmbiguousUrl(f"{target} is not under an allowed prefix (--superseder-allow)")
        except (SupersederError, AmbiguousUrl) as exc:
            log.warning("bisection finding after %r not reported: %s", taskset.primary, exc)
            return
        body = findings.finding_json(
            found,
            key=key,
            by=f"worker {self.worker_group}/{self.worker_id}",
            primary=_ref(taskset.primary),
            located=self.clock(),
            listed=taskset.listed,
        )
        headers = {"authorization": f"Bearer {token.reveal()}"}
        try:
            async with asyncio.timeout(self.options.timeout):
                response = await self.http.post(
                    target, json=body, headers=headers, follow_redirects=False
                )
        except TimeoutError:
            log.warning(
                "bisection finding not reported: %s did not answer within %g s",
                target,
                self.options.timeout,
            )
            return
        except Exception as exc:  # best effort: whatever it is, the tasks are done
            log.warning(
                "bisection finding not reported to %s: %s: %s", target, type(exc).__name__, exc
            )
            return
        if response.status_code != 200:
            log.warning(
                "bisection finding not reported: %s answered HTTP %d: %s",
                target,
                response.status_code,
                response.text[:300],
            )
            return
        log.info(
            "bisection finding after %r reported to %s",
            taskset.primary,
            target,
            extra={"task_id": taskset.primary.task_id},
        )

    def _located(self, taskset: TaskSet, claim: Claim, stand_in: Claim, found: Finding) -> Why:
        """Why ``claim`` is superseded by ``stand_in`` after a bisection, for its log."""
        url = superseder_url(taskset.initial.task)
        failing = found.culprit or found.suspect
        if failing is None:
            role = "the primary, whose failure did not come back when run again"
        elif stand_in.task_id == failing[0]:
            role = "the culprit: the first failing task" if found.culprit else "the first failing"
        else:
            role = "the last good task"
        return Why(
            rule=notice.located(
                taskset.primary.task_id,
                found.held,
                found.extra_runs,
                found.culprit,
                found.last_good,
                stand_in.task_id,
                found.suspect,
            ),
            order=notice.listed_order(taskset.listed, claim.task_id, stand_in.task_id, role),
            service=notice.service_base(
                url, list(taskset.initial.task.get("routes") or []), self.options.route_prefix
            ),
        )

    def _why(self, taskset: TaskSet, claim: Claim) -> Why:
        """Why ``claim`` is superseded, for its log: the superseder's answer and the order."""
        url = superseder_url(taskset.initial.task)
        asked = notice.shown_url(query_url(url, taskset.initial.task_id))
        primary = taskset.primary.task_id
        return Why(
            rule=f"the superseder answered {asked} with {len(taskset.listed)} tasks of the same "
            "coalescing key, oldest first; a worker runs the newest it can claim and supersedes "
            "the older ones (any age/size thresholds are in that URL)",
            order=notice.listed_order(taskset.listed, claim.task_id, primary),
            service=notice.service_base(
                url, list(taskset.initial.task.get("routes") or []), self.options.route_prefix
            ),
        )

    async def _release_into(self, report: Report, claims: Sequence[Claim]) -> None:
        results = await asyncio.gather(*(self.resolver.release(c) for c in claims))
        for claim, ok in zip(claims, results, strict=True):
            (report.released if ok else report.dropped).append(_ref(claim))

    async def _release_all(self, claims: Sequence[Claim]) -> None:
        await asyncio.gather(*(self.resolver.release(c) for c in claims), return_exceptions=True)


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)
