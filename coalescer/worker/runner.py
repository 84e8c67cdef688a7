"""The reference worker: claims from a task queue and runs command payloads, with superseding.

A payload is ``{"command": [...], "env": {...}, "maxRunTime": s, "supersederUrl": ...}``. The
command runs in a fresh directory with a minimal environment (never the worker's own, which
holds its credentials) plus ``env``, ``TASK_ID``, ``RUN_ID`` and ``COALESCER_SUPERSEDES_FILE``.
Exit 0 is *completed*, anything else *failed*, as is running past ``maxRunTime``; a payload the
worker cannot run is an exception ``malformed-payload``, the reason in the log. The log
(worker lines and the command's output) is uploaded as ``public/logs/live.log``; with a
:class:`~coalescer.worker.livelog.LiveLogServer`, that artifact first refers to the log served
live, and at the end to its copy ``public/logs/live_backing.log``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from taskcluster.exceptions import TaskclusterFailure

from coalescer import scratch
from coalescer.backoff import Backoff
from coalescer.errors import InvalidInput
from coalescer.worker.claims import Claim
from coalescer.worker.livelog import TEXT, LiveLogServer, TaskLog
from coalescer.worker.protocol import (
    COMPLETED,
    FAILED,
    SUPERSEDES_FILE_ENV,
    Outcome,
    supersedes_view,
)
from coalescer.worker.resolve import put_artifact, put_reference
from coalescer.worker.shim import Report, Shim, Superseded

log = logging.getLogger("coalescer.worker")

LIVE_LOG = "public/logs/live.log"
LIVE_BACKING_LOG = "public/logs/live_backing.log"
DEFAULT_MAX_RUN_TIME = 3600.0


class MalformedPayload(InvalidInput):
    """The task's payload is not one this worker can run."""


@dataclasses.dataclass(frozen=True)
class CommandPayload:
    command: tuple[str, ...]
    env: Mapping[str, str]
    max_run_time: float
    #: Run, in the task's directory and environment, when the task is stopped before its end
    #: (its claim canceled, e.g. superseded by a newer task, or the worker shutting down).
    on_cancel: tuple[str, ...] = ()


#: Seconds a canceled command (and its ``onCancel`` hook) gets before it is killed.
CANCEL_GRACE = 10.0

#: Seconds the output of a command that has exited is still read: a process it left running
#: may hold the output open for good, which must neither stall the run nor leak the pipe.
OUTPUT_GRACE = 2.0


def parse_payload(payload: Any) -> CommandPayload:
    """Check a command payload, or MalformedPayload saying what is wrong with it."""
    if not isinstance(payload, Mapping):
        raise MalformedPayload("the payload is not an object")
    command = payload.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise MalformedPayload("payload.command must be a non-empty list of strings")
    env = payload.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise MalformedPayload("payload.env must map strings to strings")
    limit = payload.get("maxRunTime", DEFAULT_MAX_RUN_TIME)
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
        raise MalformedPayload("payload.maxRunTime must be a positive number of seconds")
    on_cancel = payload.get("onCancel", [])
    if not isinstance(on_cancel, list) or not all(isinstance(a, str) for a in on_cancel):
        raise MalformedPayload("payload.onCancel must be a list of strings")
    return CommandPayload(tuple(command), dict(env), float(limit), tuple(on_cancel))


class Worker:
    """Claims up to ``capacity`` tasks at a time from ``task_queue_id`` and runs each task set
    through ``shim``; serves the primaries' logs live on ``livelog`` when given."""

    def __init__(
        self,
        shim: Shim,
        task_queue_id: str,
        capacity: int = 1,
        livelog: LiveLogServer | None = None,
    ) -> None:
        self.shim = shim
        self.task_queue_id = task_queue_id
        self.capacity = max(1, capacity)
        self.livelog = livelog
        #: The latest task sets' reports, newest last (bounded: a worker runs for days).
        self.reports: collections.deque[Report] = collections.deque(maxlen=1000)

    async def run(self, stop: asyncio.Event) -> None:
        """Claim and run tasks until ``stop`` is set; then release what is held and return."""
        running: set[asyncio.Task[None]] = set()
        stopped = asyncio.create_task(stop.wait())
        backoff = Backoff(0.5, maximum=30.0)
        try:
            while not stop.is_set():
                free = self.capacity - len(running)
                if free <= 0:
                    await asyncio.wait({stopped, *running}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                poll = asyncio.create_task(self._claim_work(free))
                await asyncio.wait({poll, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not poll.done():
                    # Claims already made server-side would expire unseen: let the long poll
                    # end (it is bounded), so that whatever it returns can be released.
                    await asyncio.wait({poll}, timeout=30)
                    poll.cancel()
                try:
                    claims = await poll
                except asyncio.CancelledError:
                    break
                except TaskclusterFailure as exc:
                    log.warning("claimWork failed: %s", exc)
                    await asyncio.wait({stopped}, timeout=backoff.next())
                    continue
                backoff.reset()
                if stop.is_set():
                    await self._release(claims)
                    break
                for response in claims:
                    task = asyncio.create_task(self._handle(response, stop))
                    running.add(task)
                    task.add_done_callback(running.discard)
        finally:
            stopped.cancel()
            await asyncio.gather(stopped, *running, return_exceptions=True)

    async def _claim_work(self, count: int) -> list[Mapping[str, Any]]:
        answer = await self.shim.queue.claimWork(
            self.task_queue_id,
            {
                "tasks": count,
                "workerGroup": self.shim.worker_group,
                "workerId": self.shim.worker_id,
            },
        )
        return list(answer.get("tasks", []))

    async def _release(self, claims: Sequence[Mapping[str, Any]]) -> None:
        # A run another task set holds came back only because claims are idempotent: skip it.
        held = [self.shim.claim(r) for r in claims if r["status"]["taskId"] not in self.shim.held]
        await asyncio.gather(*(self.shim.resolver.release(c) for c in held))

    async def _handle(self, response: Mapping[str, Any], stop: asyncio.Event) -> None:
        try:
            report = await self.shim.run(response, self.execute, stop=stop)
        except Exception:
            log.exception("task set of %s broke", response.get("status", {}).get("taskId"))
            return
        self.reports.append(report)
        log.info("task set done: %s", report)

    async def execute(self, claim: Claim, supersedes: Sequence[Superseded]) -> Outcome:
        """Run the primary's command; upload its log; return how it ended.

        With a live log server, ``public/logs/live.log`` refers to the log served live while
        the command runs; at the end (also when the task is stopped before it), the log is
        uploaded as ``public/logs/live_backing.log`` and ``live.log`` refers to that instead,
        so that it outlives this worker.

        A run confirming a failure (``claim.attempt`` > 0, ``--on-primary-failure bisect``)
        runs under the same claim: its log starts with the earlier attempts' log, so that the
        uploaded log (replaced, as the queue allows for the same artifact) shows them all."""
        with TaskLog() as tlog:
            if claim.attempt:
                await self._earlier(claim, tlog)
            if self.livelog is None:
                outcome = await self._logged_run(claim, supersedes, tlog)
                await self._upload(claim, tlog)
                return outcome
            with self.livelog.publish(tlog) as url:
                try:
                    await put_reference(claim, LIVE_LOG, url, TEXT)
                except Exception as exc:  # the task runs all the same, its log kept at the end
                    log.error("could not create the live log artifact of %r: %s", claim, exc)
                try:
                    return await self._logged_run(claim, supersedes, tlog)
                finally:
                    tlog.finish()
                    await self._upload(claim, tlog, backing=True)

    async def _earlier(self, claim: Claim, tlog: TaskLog) -> None:
        """Copy the log of the claim's earlier attempts into ``tlog``, and say why it runs
        again."""
        name = LIVE_LOG if self.livelog is None else LIVE_BACKING_LOG
        url = claim.queue.buildUrl("getArtifact", claim.task_id, str(claim.run_id), name)
        try:
            response = await self.shim.http.get(url, follow_redirects=True)
            response.raise_for_status()
            tlog.write(response.content)
        except httpx.HTTPError as exc:
            tlog.line(f"the log of the earlier attempts could not be fetched: {exc}")
        tlog.line(
            f"attempt {claim.attempt + 1} of run {claim.run_id}: running again to confirm the "
            "failure (bisect-confirm); the result of this attempt is the run's"
        )

    async def _logged_run(
        self, claim: Claim, supersedes: Sequence[Superseded], tlog: TaskLog
    ) -> Outcome:
        tlog.line(f"task {claim.task_id} run {claim.run_id} on {self.shim.worker_id}")
        for other in supersedes:
            tlog.line(f"may supersede {other.task_id} run {other.run_id}")
        try:
            payload = parse_payload(claim.task.get("payload"))
            outcome = await self._run_command(claim, payload, supersedes, tlog)
        except MalformedPayload as exc:
            tlog.line(f"malformed payload: {exc}")
            outcome = Outcome("exception", "malformed-payload")
        tlog.line(f"resolving {outcome.reason or outcome.state}")
        return outcome

    async def _upload(self, claim: Claim, tlog: TaskLog, *, backing: bool = False) -> None:
        """The log as ``live.log``; or, when ``backing``, as ``live_backing.log`` with
        ``live.log`` referring to it."""
        try:
            if not backing:
                await put_artifact(self.shim.http, claim, LIVE_LOG, tlog.contents(), TEXT)
                return
            await put_artifact(self.shim.http, claim, LIVE_BACKING_LOG, tlog.contents(), TEXT)
            url = claim.queue.buildUrl(
                "getArtifact", claim.task_id, str(claim.run_id), LIVE_BACKING_LOG
            )
            await put_reference(claim, LIVE_LOG, url, TEXT)
        except Exception as exc:
            log.error("could not upload the log of %r: %s", claim, exc)

    async def _run_command(
        self,
        claim: Claim,
        payload: CommandPayload,
        supersedes: Sequence[Superseded],
        tlog: TaskLog,
    ) -> Outcome:
        with scratch.directory("coalescer-task-") as path:
            workdir = str(path)
            view = os.path.join(workdir, ".supersedes.json")
            data = supersedes_view([(s.task_id, s.run_id, s.task) for s in supersedes])
            await asyncio.to_thread(Path(view).write_bytes, data)
            env = {
                "PATH": os.environ.get("PATH", os.defpath),
                "HOME": workdir,
                "LANG": "C.UTF-8",
                **payload.env,
                "TASK_ID": claim.task_id,
                "RUN_ID": str(claim.run_id),
                SUPERSEDES_FILE_ENV: view,
            }
            tlog.line(f"running {list(payload.command)!r}")
            try:
                proc, output = await _start(payload.command, workdir, env, tlog)
            except OSError as exc:
                raise MalformedPayload(f"cannot start {payload.command[0]!r}: {exc}") from exc
            try:
                async with asyncio.timeout(payload.max_run_time):
                    code = await proc.wait()
            except TimeoutError:
                tlog.line(f"maxRunTime of {payload.max_run_time:g} s exceeded: killed")
                return FAILED
            except asyncio.CancelledError:
                await _stop_canceled(proc, payload, env, workdir, tlog)
                raise
            finally:
                with contextlib.suppress(ProcessLookupError):  # what it left running too
                    os.killpg(proc.pid, signal.SIGKILL)
                if proc.returncode is None:
                    await asyncio.shield(proc.wait())
                await asyncio.shield(output.close())
        tlog.line(f"exit code {code}")
        return COMPLETED if code == 0 else FAILED


async def _stop_canceled(
    proc: asyncio.subprocess.Process,
    payload: CommandPayload,
    env: Mapping[str, str],
    workdir: str,
    tlog: TaskLog,
) -> None:
    """The cancel hook: SIGTERM to the command's process group so that it can clean up, the
    payload's ``onCancel`` command if any, both within :data:`CANCEL_GRACE` seconds; whatever
    is still running then is killed by the caller."""
    tlog.line(f"canceled: SIGTERM to the command, {CANCEL_GRACE:g} s to clean up")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        async with asyncio.timeout(CANCEL_GRACE):
            if payload.on_cancel:
                tlog.line(f"running onCancel {list(payload.on_cancel)!r}")
                hook, output = await _start(payload.on_cancel, workdir, env, tlog)
                try:
                    await hook.wait()
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(hook.pid, signal.SIGKILL)
                    if hook.returncode is None:
                        await hook.wait()
                    await output.close()
                tlog.line(f"onCancel exit code {hook.returncode}")
            await proc.wait()
    except TimeoutError:
        tlog.line("cancel grace over: killing what is left")
    except OSError as exc:
        tlog.line(f"cannot run onCancel: {exc}")


async def _start(
    argv: Sequence[str], workdir: str, env: Mapping[str, str], tlog: TaskLog
) -> tuple[asyncio.subprocess.Process, _Output]:
    """Start ``argv`` in a process group of its own, its output and error copied into ``tlog``."""
    read_end, write_end = os.pipe()
    # The worker's copy of the write end is closed at the end of the block: the command's stays.
    with os.fdopen(write_end, "wb", buffering=0) as writer:
        output = await _Output.follow(read_end, tlog)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=workdir,
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=writer,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed as a whole
            )
        except BaseException:
            writer.close()  # then the copy ends at once
            await output.close()
            raise
    return proc, output


class _Output:
    """A command's output and error, copied into the task's log as they come, through a pipe the
    worker owns so that it can stop reading once the command is over, even while a process the
    command left running (in a session of its own, out of reach of the kill of its process
    group) holds the pipe open."""

    def __init__(self, transport: asyncio.ReadTransport, copy: asyncio.Task[None], tlog: TaskLog):
        self._transport = transport
        self._copy = copy
        self._tlog = tlog

    @classmethod
    async def follow(cls, fd: int, tlog: TaskLog) -> _Output:
        """Copy what arrives on the pipe's read end ``fd`` (owned from now on) into ``tlog``."""
        reader = asyncio.StreamReader()
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )

        async def copy() -> None:
            while chunk := await reader.read(65536):
                tlog.write(chunk)

        return cls(transport, asyncio.create_task(copy()), tlog)

    async def close(self) -> None:
        """Once the command is over: copy what is left, until the pipe's end or for at most
        :data:`OUTPUT_GRACE` seconds, then close the pipe."""
        try:
            await asyncio.wait({self._copy}, timeout=OUTPUT_GRACE)
            if not self._copy.done():
                self._copy.cancel()
                self._tlog.line(
                    "a process the command left running still holds the command's output:"
                    " no longer read"
                )
        finally:
            self._transport.close()
