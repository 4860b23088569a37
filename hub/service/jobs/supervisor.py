"""The execution manager: start admitted attempts, watch them, stop them, record how they ended.

:class:`Supervisor` is the only part of the service that calls the backend
for a running job. Starting an attempt hands the backend a typed
:class:`~danlu.hub.backends.base.Launch` with a fresh job token (only its
hash is stored); the backend records where the attempt runs before the
runner can start, and the supervisor marks it launched once the runner has
its launch message, so a service killed in between never leaves two runners
for one attempt (:meth:`recover`). Each attempt has a watcher that waits,
first, for the scheduler to say it runs (at once, unless a backend's own
queue holds it: :meth:`~danlu.hub.service.jobs.scheduler.Scheduler.admitted`),
then for its processes to end, has the backend end what they left, and then
:meth:`finalize` records the end in one transaction: the runner's own report
if it made one, else what the backend saw, decided by the pure
:func:`~danlu.hub.service.states.next_state`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

from danlu.hub.backends.base import Backend, Launch, Outcome
from danlu.hub.options import JobsConfig
from danlu.hub.service.jobs import attempts, checkpoints
from danlu.hub.service.jobs.attempts import ACTIVE_STATES
from danlu.hub.service.jobs.core import Core, ts, workload_of
from danlu.hub.service.metrics import Metrics
from danlu.hub.service.states import Ending, JobState, next_state, transition
from danlu.hub.service.store import audit
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Attempt, Job, utcnow
from danlu.states import ATTEMPT_ENDINGS

if TYPE_CHECKING:
    from danlu.hub.service.jobs.scheduler import Scheduler

RECORD_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)  # seconds between tries to record an attempt's end


class Supervisor:
    #: set by the scheduler when it is made: it says whether an attempt runs yet, and runs the next pass
    scheduler: Scheduler

    def __init__(
        self,
        core: Core,
        *,
        database: Database,
        backend: Backend,
        settings,
        ledger: Ledger,
        metrics: Metrics,
        mlflow,
        service_api: str,
        log: logging.Logger,
    ):
        self.core = core
        self.database = database
        self.backend = backend
        self.settings = settings
        self.ledger = ledger
        self.metrics = metrics
        #: MLflow for jobs: a job's owner becomes an MLflow user before the job starts
        self.mlflow = mlflow
        #: where runners reach the runner API (``.../api/v1``)
        self.service_api = service_api
        self.log = log
        self.watchers: dict[str, asyncio.Task] = {}
        self.starting: dict[str, asyncio.Task] = {}  # job id -> its attempt's start, while it runs
        #: job id -> (why its processes are being stopped, the reason to record)
        self.stopping: dict[str, tuple[str, str]] = {}

    # starting ------------------------------------------------------------------------------
    def launch(self, start: dict) -> None:
        """Start an admitted attempt in the background (a submission does not wait for runners)."""
        job_id = start["id"]
        task = self.core.spawn(self.start(start))
        self.starting[job_id] = task
        task.add_done_callback(lambda t: self.starting.pop(job_id, None) if self.starting.get(job_id) is t else None)

    async def settled(self, job_id: str, state: dict, patience: float = 30.0) -> dict:
        """The attempt's state once its start is over (a stop may come while it starts); the database's."""
        task = self.starting.get(job_id)
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), patience)
            except asyncio.TimeoutError:
                task.cancel()  # whatever it recorded is in the database; the stop ends it
            except Exception:  # noqa: BLE001 - the start's own failure is its business
                pass
        fresh = await self.database.read(attempts.state_of, job_id)
        return fresh if fresh else state

    async def start(self, start: dict) -> None:
        """Start an admitted attempt (its row says running); on failure, record that it could not start."""
        job_id = start["id"]
        recorded: dict = {}
        try:
            if not start["kernel_name"]:
                raise RuntimeError("its profile no longer exists (profiles.yaml changed)")
            account = self.settings.account(start["owner"])
            if self.mlflow is not None:
                await self.mlflow.ensure_user(start["owner"])
            launch = Launch(
                job_id=job_id,
                attempt=start["attempt"],
                owner=start["owner"],
                kernel_name=start["kernel_name"],
                nproc=start["nproc"],
                nnodes=start.get("nnodes", 1),
                devices=tuple(start["devices"]),
                run_as=account,
                api_url=self.service_api,
                token=start["token"],
                queue=start["queue"],
                priority_class=start["priority_class"],
                profile=start["profile"],
                gpus=start["gpus"],
                gpu_type=start["gpu_type"],
                cpu=start["cpu"],
                memory=start["memory"],
                timeout_seconds=start["timeout_seconds"],
            )

            async def record(state: dict) -> None:
                recorded.update(state, attempt=start["attempt"])
                await self.database.write(attempts.save_state, job_id, start["attempt"], dict(recorded))

            state = await self.backend.start(launch, record)
            state = {**state, "launched": True, "attempt": start["attempt"]}
            await self.database.write(attempts.save_state, job_id, start["attempt"], state)
        except Exception as e:  # noqa: BLE001 - whatever it was, the job must not stay running
            self.log.exception("starting job %s failed", job_id)
            if recorded:  # a runner may exist: it goes before the job's GPUs are given back
                try:
                    await self.backend.cancel(job_id, recorded, 1.0, reason="cancelled")
                    await self.backend.cleanup(job_id, recorded)
                except Exception:  # noqa: BLE001
                    self.log.exception("ending the runner of job %s after its failed start failed", job_id)
            # an attempt a backend's own queue held is the job's running one from now on, so its end is recorded
            await self.database.write(attempts.admit, job_id, start["attempt"])
            await self.finalize(
                job_id,
                Outcome("failed", f"could not start: {e}", infrastructure=True, authoritative=True),
                start["attempt"],
            )
            return
        self.watch(job_id, state)

    def watch(self, job_id: str, state: dict) -> None:
        task = asyncio.ensure_future(self._watch(job_id, state))
        self.watchers[job_id] = task
        task.add_done_callback(lambda _t: self.watchers.pop(job_id, None) if self.watchers.get(job_id) is _t else None)

    async def _watch(self, job_id: str, state: dict) -> None:
        backend = self.backend
        try:
            if not await self.scheduler.admitted(job_id, state):
                return
            await backend.wait(job_id, state)
            outcome = await backend.poll(job_id, state)
            while outcome is None:
                await asyncio.sleep(0.5)
                outcome = await backend.poll(job_id, state)
            if outcome.state == "preempted" and job_id not in self.stopping:
                await self._drain(job_id, state, outcome)
            await backend.cleanup(job_id, state)
            await self.finalize(job_id, outcome, state.get("attempt"))
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("watching job %s failed", job_id)
            await self.finalize(
                job_id, Outcome("failed", "the service lost track of it", infrastructure=True), state.get("attempt")
            )

    # stopping -------------------------------------------------------------------------------
    async def stop(self, job_id: str, state: dict, grace: float, why: str, reason: str = "") -> None:
        """End a running attempt (cancel, preemption, time limit); the runner learns ``why`` from the service."""
        self.stopping[job_id] = (why, reason or why)
        try:
            state = await self.settled(job_id, state)
            await self.database.write(attempts.set_stop, job_id, why, grace, state.get("attempt"))
            await self.backend.cancel(job_id, state, grace, reason=why)
        except Exception:
            self.log.exception("stopping job %s (%s) failed", job_id, why)
        if job_id not in self.watchers:  # nothing else will notice
            await self.finalize(job_id, Outcome(why, reason or why), state.get("attempt"))

    async def _drain(self, job_id: str, state: dict, outcome: Outcome) -> None:
        """A preemption the backend's own queue made (a Kueue eviction): record it as this service's own
        preemptions are, so the attempt's runner, asking why it got SIGTERM, is told and gives the job's code
        its grace to save, and keep the attempt (its token) until its processes are gone or the grace is over."""
        grace = self.settings.jobs.preemption_grace_seconds
        self.stopping[job_id] = ("preempted", outcome.reason)
        await self.database.write(attempts.set_stop, job_id, "preempted", grace, state.get("attempt"))
        deadline = asyncio.get_running_loop().time() + grace + 10.0
        while await self.backend.draining(job_id, state) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.5)

    async def cancel(self, job_id: str, state: dict, reason: str) -> None:
        """Cancel a running attempt now: end its processes (with the grace period), then record it."""
        grace = self.settings.jobs.grace_period_seconds
        self.stopping[job_id] = ("cancelled", reason)
        state = await self.settled(job_id, state)
        await self.database.write(attempts.set_stop, job_id, "cancelled", grace, state.get("attempt"))
        await self.backend.cancel(job_id, state, grace, reason="cancelled")
        await self.backend.cleanup(job_id, state)
        await self.finalize(job_id, Outcome("cancelled", reason), state.get("attempt"))
        watcher = self.watchers.pop(job_id, None)
        if watcher is not None:
            watcher.cancel()

    def checkpointed(self, job_id: str, saved: dict) -> None:
        """The job saved a checkpoint: the admission model's victim choice sees it (while it holds resources)."""
        wl = self.core.model.admitted.get(job_id)
        if wl is not None:
            wl.checkpointed_at = ts(checkpoints.saved_at(SimpleNamespace(checkpoint=saved)))

    def reap_after_report(self, job_id: str, number: int, seconds: float = 30.0) -> None:
        """A runner's last act is its ``finished`` report; if attempt ``number`` still runs ``seconds`` later,
        it is ended (only that attempt: a later one of the same job is left alone)."""

        async def reap():
            await asyncio.sleep(seconds)
            state = await self.database.read(attempts.state_of, job_id, number)
            if state is not None:
                self.log.warning("job %s reported its end %g s ago and still runs: ending it", job_id, seconds)
                await self.backend.cancel(job_id, state, 5.0, reason="finished")

        self.core.spawn(reap())

    # the end of an attempt ----------------------------------------------------------------------
    async def finalize(self, job_id: str, outcome: Outcome, attempt: int | None = None) -> None:
        """Record how an attempt ended (idempotent), free what it held, decide what comes next.

        With ``attempt``, only if that attempt is still the job's current one. Recording is retried
        (the database may be busy or restarting); if it keeps failing, the job is failed with the
        reason in a transaction of its own, so a job never stays running with nothing behind it.
        """
        for delay in RECORD_RETRIES:
            try:
                await self._finalize_once(job_id, outcome, attempt)
                break
            except Exception as e:  # noqa: BLE001 - retried, then recorded as the job's failure
                self.log.exception("recording the end of job %s failed (%s); retrying in %g s", job_id, e, delay)
                await asyncio.sleep(delay)
        else:
            why = f"the service could not record how its attempt ended ({outcome.state}: {outcome.reason})"
            try:
                await self._finalize_once(job_id, Outcome("failed", why, infrastructure=True), attempt)
            except Exception:  # noqa: BLE001 - the database is gone: rewatch_orphans tries again later
                self.log.exception("job %s could not be recorded at all; it is watched again later", job_id)
                return
        await self.scheduler.schedule()

    async def _finalize_once(self, job_id: str, outcome: Outcome, attempt: int | None) -> None:
        core = self.core
        async with core.lock:
            done = await self.database.write(
                _finalize, job_id, outcome, self.stopping.get(job_id), self.settings.jobs, self.ledger, attempt
            )
            if done is None:
                return
            self.stopping.pop(job_id, None)
            state, reason, workload = done
            if outcome.state == "failed":
                failure = "infrastructure" if outcome.infrastructure else "user"
                self.metrics.attempts_failed.labels(workload.team, failure).inc()
            core.model.release(job_id)
            if state == JobState.queued.value:
                core.pending[job_id] = workload
            else:
                self.metrics.finished.labels(workload.team, state).inc()
                core.mark_ended(job_id)
            self.log.info("job %s %s%s", job_id, state, f": {reason}" if reason else "")
        if self.mlflow is not None:  # the attempt's MLflow credentials end with it
            ended = await self.database.read(_ended_attempt, job_id)
            if ended is not None:
                await self.mlflow.expire(job_id, *ended)

    async def rewatch_orphans(self) -> None:
        """Active attempts that nothing watches (a watcher that failed, a recording that failed): watch again."""
        for job_id, state, _preempted, _stop in await self.database.read(attempts.active, self.scheduler.owns_queues):
            if job_id not in self.watchers and state.get("launched"):
                self.log.warning("job %s is active with no watcher: watching it again", job_id)
                self.watch(job_id, state)

    # restarts ------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Re-attach to attempts that were running when the service stopped (before it serves runners)."""
        owns_queues = self.scheduler.owns_queues
        for job_id, state, preempted, stop in await self.database.read(attempts.active, owns_queues):
            if owns_queues and not state.get("launched"):
                # the service stopped while submitting it: whatever reached the cluster goes, and it is
                # handed over again (not counted)
                await self.backend.cancel(job_id, state, 1.0, reason="interrupted")
                await self.database.write(attempts.admit, job_id, state.get("attempt"))
                await self.finalize(
                    job_id,
                    Outcome("failed", "the service stopped while submitting it", interrupted=True, authoritative=True),
                )
                continue
            if not state.get("launched") and not state.get("spec_fetched"):
                # the service stopped between admitting it and handing it to a runner: that runner never
                # ran it (and can no longer fetch its spec): end what exists and requeue, not counted
                await self.database.write(attempts.abandon, job_id)
                await self.backend.cancel(job_id, state, 1.0, reason="interrupted")
                await self.finalize(
                    job_id, Outcome("failed", "the service stopped while starting it", interrupted=True)
                )
                continue
            self.backend.load_state(job_id, state)
            self.log.info("re-attaching to job %s", job_id)
            if preempted or stop:
                why = "preempted" if preempted else stop
                jobs = self.settings.jobs
                grace = jobs.preemption_grace_seconds if why == "preempted" else jobs.grace_period_seconds
                self.core.spawn(self.stop(job_id, state, grace, why))
            self.watch(job_id, state)

    async def close(self) -> None:
        for task in list(self.watchers.values()):
            task.cancel()


# database work (runs on the database thread pool) ---------------------------------------------
def _ending(attempt: Attempt | None, outcome: Outcome, stopping: tuple[str, str] | None, stopped: bool) -> Ending:
    """How the attempt ended: the runner's report if it made a valid one, else what the backend saw.

    A runner cannot claim a stop the service did not make (``stopped``): "preempted" or "cancelled"
    from a job nobody stopped would requeue or end it without counting against its retries.
    """
    report = attempt.report if attempt is not None and isinstance(attempt.report, dict) else {}
    if report.get("state") in ATTEMPT_ENDINGS and not outcome.authoritative:
        state, reason = report["state"], str(report.get("reason") or "")
        if state in ("cancelled", "preempted", "timed_out") and not stopped:
            return Ending("failed", f"the job reported '{state}' but nothing stopped it", False)
        ending = Ending(state, reason, bool(report.get("infrastructure")))
    else:
        ending = Ending(outcome.state, outcome.reason, outcome.infrastructure, outcome.interrupted)
    if stopping is not None and stopping[0] == "cancelled" and ending.state != "succeeded":
        ending = Ending("cancelled", stopping[1])
    return ending


def _ended_attempt(s, job_id: str) -> tuple[int, str | None] | None:
    job = s.get(Job, job_id)
    attempt = attempts.latest(job) if job is not None else None
    return (attempt.number, job.mlflow_run_id) if attempt is not None else None


def _finalize(s, job_id: str, outcome: Outcome, stopping, jobs: JobsConfig, ledger, number: int | None = None):
    job = s.get(Job, job_id)
    if job is None or job.state not in ACTIVE_STATES:
        return None
    attempt = attempts.latest(job)
    if number is not None and (attempt is None or attempt.number != number):
        return None  # an earlier attempt's late news
    ledger.release(s, "job", job_id)
    why = stopping[0] if stopping else (attempt.stop_reason if attempt is not None else "") or None
    stopped = bool(why) or job.state == JobState.preempted.value
    failures = sum(1 for a in job.attempts[:-1] if a.failure == "infrastructure")
    nxt = next_state(
        job.state,
        _ending(attempt, outcome, stopping, stopped),
        stopping=why,
        preempt_reason=(outcome.reason if outcome.state == "preempted" and outcome.authoritative else job.reason),
        retries=job.retries,
        failures_before=failures,
        limit_seconds=job.timeout_seconds or jobs.max_runtime_seconds,
        backoff_seconds=jobs.retry_backoff_seconds,
        resumes=checkpoints.resumes(job),
    )
    now = utcnow()
    if attempt is not None:
        attempt.state, attempt.failure, attempt.reason = nxt.attempt_state, nxt.failure, nxt.attempt_reason
        report = attempt.report if isinstance(attempt.report, dict) else {}
        code = report.get("exit_code") if "exit_code" in report else outcome.exit_code
        attempt.exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
        attempt.finished_at = now
        attempt.token_hash = ""
    tracking = job.tracking if isinstance(job.tracking, dict) else {}
    job.mlflow_run_id = tracking.get("run_id") or job.mlflow_run_id
    job.state = transition(job.state, nxt.state).value
    job.reason = nxt.reason
    job.failure = nxt.failure if nxt.state == JobState.failed else ""
    if nxt.retry_in is not None:
        job.not_before = now + dt.timedelta(seconds=nxt.retry_in)
        audit.append(
            s,
            "danlu",
            "retry",
            job.id,
            before={"attempt": len(job.attempts)},
            after={
                "retry": nxt.retry_number,
                "of": job.retries,
                "after_seconds": nxt.retry_in,
                "reason": nxt.attempt_reason,
            },
        )
    if nxt.state == JobState.queued:
        job.queued_at = now
    else:
        job.finished_at = now
    return job.state, job.reason, workload_of(job)
