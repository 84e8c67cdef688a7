"""The soak's run: set up the store, the broker proxies and the processes; stream pushes,
bursts and probes while faults are injected; stop, settle, check, report."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import re
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import httpx
import taskcluster.aio

from coalescer.ingest.topology import dead_letter_names
from coalescer.policy.record import victims
from coalescer.store import Store, open_store
from coalescer.store import policy as outbox
from tests.ports import free_port
from tests.soak import checker, report
from tests.soak.cast import Cast
from tests.soak.config import Config
from tests.soak.faults import Faults, Injected
from tests.soak.load import BUILD_QUEUE, MANUAL_QUEUE, TEST_QUEUE, Prober, Pusher, Scenario
from tests.soak.stores import Cluster, OneRedis
from tests.tcp_proxy import TcpProxy

TOKEN = "soak-ingest-token"
#: ``lw.*``: latest-wins, running tasks left alone; ``sr.*``: running ones canceled too, unless
#: they ran over 3 s (their tasks run 3 to 10 s); ``bi.*``: a failed primary's victims
#: bisected by the enforcer; ``bp.*``: the same, its victims waiting at the lowest priority
#: (``hold-by: priority``; every task is at ``low``). The other keys are on-claim: the
#: workers bisect (their ``--on-primary-failure bisect``).
POLICY = """\
rules:
  - {keys: 'lw.*', strategy: latest-wins}
  - {keys: 'sr.*', strategy: latest-wins, supersede-running: true, protect-running-after: 3s}
  - {keys: 'bi.*', strategy: latest-wins, on-primary-failure: bisect}
  - {keys: 'bp.*', strategy: latest-wins, on-primary-failure: bisect, hold-by: priority}
"""
#: what :data:`POLICY` lets the enforcer do to each key's running tasks, for the checker
RULES = {"sr.": checker.Rule(supersede_running=True, protect_ms=3000)}
KEYS = (
    [f"k{i}" for i in range(20)]
    + [f"lw.{i}" for i in range(4)]
    + [f"sr.{i}" for i in range(2)]
    + [f"bi.{i}" for i in range(2)]
    + ["bp.0"]
)
#: the keys pushes are drawn from: the ``sr.*`` ones twice as often (a push every 4 s or so on
#: each, its tasks running 3 to 10 s), so that newer pushes meet running ones both before and
#: after the protection's 3 s
PUSHED = KEYS + [f"sr.{i}" for i in range(2)]
#: regressions injected (each begins a quarter into the run), and flaky keys
REGRESSIONS, FLAKY = ("k7", "bi.0", "bp.0"), ("k13", "bi.1")
#: the faults after which the index may have lost what it had applied: an emptied store, and a
#: Cluster master killed whose replica was not promoted (it came back empty); a promoted
#: replica holds every write acknowledged (the store waits for it on ingest)
INDEX_LOST = ("redis-restart-empty", "cluster-master-kill")


def lost_index(fault: Injected) -> bool:
    if fault.kind == "cluster-master-kill":
        return "promoted" not in fault.detail
    return fault.kind in INDEX_LOST


WORKERS = [
    ("w-build-1", BUILD_QUEUE),
    ("w-build-2", BUILD_QUEUE),
    ("w-build-3", BUILD_QUEUE),
    ("w-test-1", TEST_QUEUE),
]
SAMPLED = ("serve", "listen-1", "listen-2", "enforce-1")


def rule_of(key: str) -> checker.Rule:
    return next((rule for prefix, rule in RULES.items() if key.startswith(prefix)), checker.Rule())


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if inspect.isawaitable(result) else result


def _with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{auth}127.0.0.1:{port}"))


class Soak:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        config.report_dir.mkdir(parents=True, exist_ok=True)
        self.logs = config.report_dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.cast = Cast(self.logs)
        self.store: OneRedis | Cluster = (
            Cluster(random.Random(config.seed + 3)) if config.store == "cluster" else OneRedis()
        )
        self.tag = uuid.uuid4().hex[:10]
        self.prefix = f"coalesce.soak{self.tag}"
        self.pulse_queue = f"queue/guest/coalescer-soak-{self.tag}"
        self.queue_port, self.web_port = free_port(), free_port()
        self.root = f"http://127.0.0.1:{self.queue_port}"
        self.service = f"http://127.0.0.1:{self.web_port}"
        self.samples: list[tuple[float, str, int, int]] = []
        self.bursts: list[tuple[float, float]] = []
        self.findings = checker.Findings()
        self.notes: list[str] = []
        marks = config.report_dir.resolve() / "marks"
        for sub in ("ran", "flaky"):
            (marks / sub).mkdir(parents=True, exist_ok=True)
        paired = tuple(k for k in KEYS if k.startswith("lw."))
        self.scenario = Scenario(marks, REGRESSIONS, FLAKY, slow=("sr.",), paired=paired)

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("COALESCER_", "PULSE_", "TASKCLUSTER_", "REDIS_URL"))
        }
        env.update(
            REDIS_URL=self.store.url,
            PULSE_URL=self.config.amqp_url,
            PULSE_QUEUE=self.pulse_queue,
            COALESCER_ROUTE_PREFIX=self.prefix,
            COALESCER_RANK_TAG="push",
            COALESCER_LOG_FORMAT="text",
            COALESCER_INGEST_TOKEN=TOKEN,
            COALESCER_POLICY_FILE=str(self.config.report_dir / "policy.yaml"),
            TASKCLUSTER_ROOT_URL=self.root,
            TASKCLUSTER_CLIENT_ID="soak",
            TASKCLUSTER_ACCESS_TOKEN="no-secret",
        )
        env.update(extra)
        return env

    async def run(self) -> int:
        (self.config.report_dir / "policy.yaml").write_text(POLICY)
        amqp = urlsplit(self.config.amqp_url)
        started = time.time()
        self.store.start()
        try:
            async with (
                TcpProxy(amqp.hostname or "127.0.0.1", amqp.port or 5672) as p1,
                TcpProxy(amqp.hostname or "127.0.0.1", amqp.port or 5672) as p2,
            ):
                self.proxies = [p1, p2]
                try:
                    await self._start_cast()
                    await self._soak()
                    await self._check()
                finally:
                    self.cast.stop_all(order=[n for n, _ in WORKERS] + ["enforce-1", "enforce-2"])
        finally:
            with contextlib.suppress(Exception):
                await self._delete_queues()
            self.store.stop()
        return report.write(self, started)

    async def _start_cast(self) -> None:
        cast, env = self.cast, self.env
        listen_env = [env(PULSE_URL=_with_port(self.config.amqp_url, p.port)) for p in self.proxies]
        cast.start("listen-1", ["listen", "--declare-exchanges"], listen_env[0])
        await self._until(
            lambda: "consuming queue/" in cast.output("listen-1", 100_000), 30, "listen to start"
        )
        cast.start("listen-2", ["listen", "--declare-exchanges"], listen_env[1])
        cast.start("serve", ["serve", "--workers", "2", "--port", str(self.web_port)], env())
        cast.start(
            "emulator",
            ["--port", str(self.queue_port), "--pulse-url", self.config.amqp_url],
            env(),
            module="tests.soak.emulator",
        )
        for name in ("enforce-1", "enforce-2"):
            cast.start(
                name, ["enforce", "--consumer", name, "--lease", "5", "--poll", "0.2"], env()
            )
        async with httpx.AsyncClient(timeout=2) as http:
            for url in (f"{self.service}/__lbheartbeat__", f"{self.root}/api/queue/v1/ping"):
                await self._until_http(http, url)
        for name, queue in WORKERS:
            cast.start(
                name,
                [
                    "worker",
                    "--task-queue-id",
                    queue,
                    "--worker-group",
                    "soak",
                    "--worker-id",
                    name,
                    "--superseder-allow",
                    f"{self.service}/",
                    "--on-primary-failure",
                    "bisect",
                ],
                env(),
            )

    async def _until(
        self,
        check: Callable[[], bool | Awaitable[bool]],
        within: float,
        what: str,
        every: float = 0.1,
    ) -> None:
        """Poll ``check`` (plain or async) every ``every`` seconds until it holds; fail when a
        process exited on its own or after ``within`` seconds."""
        give_up = time.monotonic() + within
        while not await _value(check()):
            if dead := self.cast.dead():
                raise RuntimeError(f"{dead} exited:\n{self.cast.output(dead[0])}")
            if time.monotonic() > give_up:
                raise RuntimeError(f"waited {within:.0f} s in vain for {what}")
            await asyncio.sleep(every)

    async def _until_http(self, http: httpx.AsyncClient, url: str) -> None:
        async def answers() -> bool:
            try:
                return (await http.get(url)).status_code == 200
            except httpx.HTTPError:
                return False

        await self._until(answers, 30, f"{url} to answer")

    async def _soak(self) -> None:
        config = self.config
        self.pusher = Pusher(self.root, self.service, self.prefix, PUSHED, self.rng, self.scenario)
        self.prober = Prober(self.service, self.pusher, random.Random(config.seed + 1))
        killable = ["serve", "listen-1", "listen-2", "enforce-1", "enforce-2"]
        self.faults = Faults(
            cast=self.cast,
            store=self.store,
            proxies=self.proxies,
            killable=killable + [n for n, _ in WORKERS],
            service=self.service,
            token=TOKEN,
            prefix=self.prefix,
            rng=random.Random(config.seed + 2),
            rebuild=self._rebuild,
            publish_raw=self._publish_raw,
        )
        if isinstance(self.store, Cluster):
            cluster = self.store
            del self.faults.menu["redis-readonly"]  # REPLICAOF is refused in cluster mode

            async def kill_master() -> str:
                return await asyncio.to_thread(cluster.kill_master)

            self.faults.menu["cluster-master-kill"] = kill_master
            self.faults.weights["cluster-master-kill"] = 2
        if config.only:
            self.faults.menu = {k: v for k, v in self.faults.menu.items() if k in config.only}
        self.amqp = await aio_pika.connect(config.amqp_url)
        stop = asyncio.Event()
        self.t0 = time.time()
        end = self.t0 + config.duration
        background = [
            asyncio.create_task(self.pusher.stream(stop, config.rate)),
            asyncio.create_task(self.prober.run(stop)),
            asyncio.create_task(self._bursts(stop)),
            asyncio.create_task(self._sample(stop)),
            asyncio.create_task(self._watch(stop)),
            asyncio.create_task(self._regressions(stop, self.t0 + config.duration / 4)),
            asyncio.create_task(self._scenario(self._claimed_first(stop, config.duration / 3))),
        ]
        faults = asyncio.create_task(
            self.faults.run(until=end - min(10, config.duration / 6), at_least=config.min_faults)
        )
        try:
            await asyncio.sleep(max(0.0, end - time.time()))
            await faults
        finally:
            stop.set()
            faults.cancel()
            await asyncio.gather(*background, faults, return_exceptions=True)
        self.ended = time.time()
        await asyncio.to_thread(self.store.healthy)
        for name, member in self.cast.members.items():
            if member.proc.poll() is not None:
                self.cast.restart(name)

    async def _bursts(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.burst_every)
                return
            start = time.time()
            await self.pusher.burst(self.config.burst)
            self.bursts.append((start, time.time() + 3.0))

    async def _regressions(self, stop: asyncio.Event, at: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, at - time.time()))
            return
        await asyncio.gather(*(self.pusher.regression(key) for key in REGRESSIONS))

    async def _scenario(self, scenario: Awaitable[None]) -> None:
        """Run a scenario; one that could not be played is said in the report's notes."""
        try:
            await scenario
        except Exception as exc:
            self.notes.append(f"a scenario could not be played: {exc!r}")

    async def _claimed_first(self, stop: asyncio.Event, after: float) -> None:
        """A victim claimed by a worker after its superseding was decided, before the enforcer
        carries it out: surely once per soak, since the race it stands for is rare. With both
        enforcers stopped, two pushes on ``lw.claimed`` (a rule without ``supersede-running``)
        are decided on arrival; the soak claims the older one as a worker and marks it started,
        then lets the enforcers go on: they must leave it running (``missed``)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, self.t0 + after - time.time()))
            return
        key = "lw.claimed"
        queue = taskcluster.aio.Queue({"rootUrl": self.root}, session=None)
        enforcers = [self.cast.pid(name) for name in ("enforce-1", "enforce-2")]
        pushed: list[str] = []

        async def resolved() -> bool:  # what it pushed (and a retry, its claim expired
            # meanwhile) runs as a worker would run it, whether the scenario was played or not
            states = [(await queue.status(t))["status"]["state"] for t in pushed]
            if all(s in ("completed", "failed", "exception") for s in states):
                return True
            if (claim := await self._claim_manual(queue)) is not None:
                await self._report_completed(queue, claim)
            return False

        async with httpx.AsyncClient(timeout=10) as http:
            try:
                try:
                    for pid in enforcers:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGSTOP)
                    for _ in range(2):
                        created = await self.pusher.create(http, key, MANUAL_QUEUE)
                        if created is None:
                            raise RuntimeError("a task on lw.claimed could not be created")
                        pushed.append(created)
                    older, newer = pushed

                    async def decided() -> bool:  # the older one's lineage names the newer
                        with contextlib.suppress(httpx.HTTPError):
                            r = await http.get(f"{self.service}/v1/tasks/{older}")
                            return r.status_code == 200 and str(newer) in r.text
                        return False

                    # a loaded machine, a master failing over: the decision may take a while
                    await self._until(decided, 90, "the superseding on lw.claimed to be decided")
                    claim = await self._claim_manual(queue)
                    if claim is None or claim["status"]["taskId"] != older:
                        raise RuntimeError(f"the older task on lw.claimed was not claimed: {claim}")
                finally:
                    for pid in enforcers:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGCONT)

                async def acted() -> bool:
                    said = "".join(self.cast.output(n, 10**7) for n in ("enforce-1", "enforce-2"))
                    state = (await queue.status(older))["status"]["state"]
                    return f"{older} missed" in said or state != "running"

                await self._until(acted, 30, "the enforcers to act on the claimed victim")
                await self._report_completed(queue, claim)
                self.notes.append(f"{older} was claimed before its superseding was carried out")
            finally:
                if pushed:
                    await self._until(resolved, 60, "the tasks on lw.claimed to resolve")

    async def _claim_manual(self, queue: Any) -> dict[str, Any] | None:
        """Claim the oldest task of the manual queue as a worker (None: none is pending); its
        command's mark says so."""
        got = await queue.claimWork(
            MANUAL_QUEUE, {"workerGroup": "soak", "workerId": "soak-manual", "tasks": 1}
        )
        if not got["tasks"]:
            return None
        [claim] = got["tasks"]
        task_id, run_id = claim["status"]["taskId"], claim["runId"]
        (self.scenario.marks / "ran" / f"{task_id}.{run_id}").touch()
        return claim

    async def _report_completed(self, queue: Any, claim: dict[str, Any]) -> None:
        task_id, run_id = claim["status"]["taskId"], claim["runId"]
        if (await queue.status(task_id))["status"]["runs"][run_id]["state"] != "running":
            return  # the bug this scenario is here for (a canceled run): the checker says so
        worker = taskcluster.aio.Queue(
            {"rootUrl": self.root, "credentials": claim["credentials"]}, session=None
        )
        await worker.reportCompleted(task_id, str(run_id))

    async def _sample(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.time()
            for name in SAMPLED:
                self.samples.append((now, name, self.cast.pid(name), self.cast.rss(name)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _watch(self, stop: asyncio.Event) -> None:
        """A platform's restarts: a process that exits on its own is a violation, restarted."""
        while not stop.is_set():
            for name in self.cast.dead():
                if name in self.faults.killed:
                    continue
                self.findings.add(
                    "no process exits on its own",
                    f"{name} exited ({self.cast.members[name].proc.returncode}): "
                    f"{self.cast.output(name, 1500)}",
                )
                self.cast.restart(name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def _coalescer(self, *args: str) -> str:
        timeout = 120.0
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "coalescer.cli",
            *args,
            env=self.env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return f"timed out after {timeout:.0f} s"
        text = out.decode(errors="replace")
        record = f"---- {' '.join(args)} (exit {proc.returncode})\n{text}\n"
        with (self.logs / "reconcile.log").open("a") as log:
            log.write(record)
        return text

    async def _rebuild(self) -> str:
        out = await self._coalescer(
            "reconcile",
            "--rebuild",
            "--no-progress",
            "--task-queue-id",
            BUILD_QUEUE,
            "--task-queue-id",
            TEST_QUEUE,
            "--task-queue-id",  # the claimed-first scenario's: its decision is rebuilt too
            MANUAL_QUEUE,
        )
        return (out.strip().splitlines() or ["(no output)"])[-1][-300:]

    async def _publish_raw(self, cc: str, body: bytes) -> None:
        channel = await self.amqp.channel()
        try:
            exchange = await channel.get_exchange("exchange/taskcluster-queue/v1/task-pending")
            await exchange.publish(
                aio_pika.Message(body=body, headers={"CC": [cc]}, content_type="application/json"),
                routing_key="primary.soak",
            )
        finally:
            await channel.close()

    async def _settle(self, queue: checker.Queue) -> None:
        """Until no task is pending or running and the enforcers have nothing left to do: no
        decision to carry out, no bisection under way (between a confirmation's end and its
        rerun, the queue has nothing pending or running for a moment)."""
        left: dict[str, dict[str, Any]] = {}
        busy: list[str] = []
        store = await open_store(self.store.url, grace_seconds=3600, query_timeout=30)
        names = sorted({p.key for p in self.pusher.tasks.values()})

        async def settled() -> bool:
            nonlocal left, busy
            left = await checker.unsettled(queue, self.pusher.tasks)
            if left:
                return False
            work = await outbox.outstanding(store, names)
            busy = [key for key, (entries, under_way) in work.items() if entries or under_way]
            return not busy

        try:
            try:  # a status read of every task each time: once a second is enough
                await self._until(settled, self.config.settle, "the soak to settle", every=1.0)
            except RuntimeError as exc:  # the time ran out, or a process exited: said, checked
                self.notes.append(str(exc)[:1500])
            self.findings.counts["settle seconds"] = round(time.time() - self.ended, 1)
            if left:
                self.notes.append(
                    f"{len(left)} tasks still pending or running after {self.config.settle:.0f} s"
                )
                await self._describe(left, store)
            elif busy:
                self.notes.append(
                    f"the enforcers still had work on {', '.join(busy)} "
                    f"after {self.config.settle:.0f} s"
                )
        finally:
            await store.close()
        await self._drain_pulse_queue()

    async def _describe(self, left: dict[str, dict[str, Any]], store: Store) -> None:
        """Say who holds each task left unsettled (the queue's claim), what the service
        recorded of it (its lineage: held for which primary, probing for which search) and
        which of its key's searches under way list it among their victims."""
        async with httpx.AsyncClient(timeout=10) as http:
            for task_id, status in sorted(left.items())[:10]:
                lineage = ""
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get(f"{self.service}/v1/tasks/{task_id}")
                    lineage = r.text[:800] if r.status_code == 200 else f"HTTP {r.status_code}"
                key = self.pusher.tasks[task_id].key
                under_way = await outbox.searches(store, key)
                listing = [p for p, raw in under_way.items() if task_id in victims(raw)]
                self.notes.append(
                    f"unsettled: {task_id} ({key}) {checker.holder(status)}; lineage: "
                    f"{lineage}; searches under way on {key}: {sorted(under_way)}, "
                    f"those listing it: {listing}"
                )

    async def _drain_pulse_queue(self) -> None:
        """Until every published message is applied and acknowledged: the queue holds none
        ready, then both ``listen`` stop (SIGTERM: each applies and acknowledges what it was
        delivered, and the broker requeues whatever it was not), and the queue still holds none.
        Otherwise they start again and take the rest."""
        listens = ("listen-1", "listen-2")
        async with self.amqp.channel() as channel:
            for _ in range(5):
                give_up = time.monotonic() + 30
                while (
                    await channel.declare_queue(self.pulse_queue, passive=True)
                ).declaration_result.message_count:
                    if time.monotonic() > give_up:
                        self.notes.append("the Pulse queue still held messages after 30 s")
                        return
                    await asyncio.sleep(0.2)
                for name in listens:
                    code = await asyncio.to_thread(self.cast.stop, name)
                    if code != 0:
                        self.findings.add(
                            "listen stops cleanly",
                            f"{name} stopped with {code}: {self.cast.output(name, 1500)}",
                        )
                declared = await channel.declare_queue(self.pulse_queue, passive=True)
                if not declared.declaration_result.message_count:
                    return
                for name in listens:
                    self.cast.restart(name)
            self.notes.append("messages requeued after every stop of listen, 5 times")

    async def _check(self) -> None:
        findings = self.findings
        async with httpx.AsyncClient(timeout=60) as http:
            queue = checker.Queue(http, self.root)
            await self._settle(queue)
            tasks = self.pusher.tasks
            statuses = await checker.check_queue(queue, tasks, findings)
            ran = self.scenario.ran()
            checker.check_cancels(tasks, statuses, ran, rule_of, findings)
            checker.check_completed_ran(tasks, statuses, ran, findings)
            checker.check_culprits(tasks, await self._culprits(http), findings)
        lost = [f.end for f in self.faults.log if lost_index(f)]
        older = checker.check_index(
            tasks, statuses, await self._index(), max(lost, default=0.0) + 1.0, findings
        )
        if older:  # what the final reconcile fixes
            self.notes.append(
                f"{len(older)} tasks from before the index was last lost are held otherwise "
                "than the queue has them: " + "; ".join(older[:10])
            )
        self._check_reconcile(await self._coalescer("reconcile", "--no-progress"))
        dead = await self._dead_letters()
        checker.check_dead_letters(dead, self.faults.sent.bad_pulse, findings)
        self.peak = checker.check_memory(self.samples, findings)
        findings.counts["events published"] = await self._published()
        await self.amqp.close()

    async def _culprits(self, http: httpx.AsyncClient) -> list[checker.Culprit]:
        """The culprits named in the workers' and enforcers' logs, and on the service's task
        lineage of every task of a key with a regression or flaky tasks."""
        found = []
        for name in [n for n, _ in WORKERS] + ["enforce-1", "enforce-2"]:
            found += checker.culprits_in_log(name, self.cast.output(name, 10**9))
        watched = set(REGRESSIONS + FLAKY)
        for task_id, pushed in self.pusher.tasks.items():
            if pushed.key in watched:
                r = await http.get(f"{self.service}/v1/tasks/{task_id}")
                if r.status_code == 200:
                    found += checker.culprits_in_lineage(task_id, r.json())
        return found

    async def _index(self) -> dict[str, dict[str, tuple[int, str]]]:
        """What the index holds for each soak key: taskId → (runId, state)."""
        store = await open_store(self.store.url, grace_seconds=3600, query_timeout=30)
        try:
            keys = {p.key for p in self.pusher.tasks.values()}
            return {
                key: {t: (r.run_id, r.state) for t, r in (await store.all_known(key)).items()}
                for key in sorted(keys)
            }
        finally:
            await store.close()

    def _check_reconcile(self, out: str) -> None:
        found = re.search(
            r"reconciled (\d+) tasks.*?(\d+) fixed.*?(\d+) removed.*?(\d+) failed", out
        )
        if not found:
            self.findings.add("the index equals the queue", f"reconcile said: {out[-500:]}")
            return
        _, fixed, _, failed = map(int, found.groups())
        self.findings.counts["reconcile"] = found.group(0)
        if fixed or failed:
            fixes = [line for line in out.splitlines() if "fixed" in line or "could not" in line]
            self.findings.add(
                "the index equals the queue", f"{found.group(0)}\n" + "\n".join(fixes[-20:])
            )
        ours = set(self.pusher.tasks)
        for task_id in re.findall(r"removed task (\S+):", out):
            if task_id in ours:
                self.findings.add(
                    "the index equals the queue",
                    f"reconcile removed {task_id}, which the queue knows",
                )

    async def _dead_letters(self) -> list[bytes]:
        found = []
        async with self.amqp.channel() as channel:
            queue = await channel.declare_queue(
                dead_letter_names(self.pulse_queue)[1], passive=True
            )
            while (got := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
                found.append(got.body)
        return found

    async def _published(self) -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.get(f"{self.root}/emulator/v1/messages")
            return len(r.json()["messages"])

    async def _delete_queues(self) -> None:
        connection = await aio_pika.connect(self.config.amqp_url)
        async with connection, connection.channel() as channel:
            dead_exchange, dead_queue = dead_letter_names(self.pulse_queue)
            await channel.queue_delete(self.pulse_queue)
            await channel.queue_delete(dead_queue)
            await channel.exchange_delete(dead_exchange)
