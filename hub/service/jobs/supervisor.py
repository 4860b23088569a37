"""The execution manager: start admitted attempts, watch them, stop them, record how they ended.

:class:`Supervisor` is the only part of the service that calls the backend
for a running job. Starting an attempt hands the backend a typed
:class:`~danlu.hub.backends.base.Launch` with a fresh job token (only its
hash is stored); the backend records where the attempt runs before the
runner can start, and the supervisor marks it launched once the runner has
its launch message, so a service killed in between never leaves two runners
for one attempt (:meth:`recover`). Each attempt has a watcher that waits for
its processes to end, has the backend end what they left, and then
:meth:`finalize` records the end in one transaction: the runner's own report
if it made one, else what the backend saw, decided by the pure
:func:`~danlu.hub.service.states.next_state`.
"""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy import select

from danlu.hub.backends.base import Launch, Outcome
from danlu.hub.service.jobs.core import Core, workload_of
from danlu.hub.service.states import ACTIVE, Ending, JobState, next_state, transition
from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import Attempt, Job, utcnow
from danlu.states import ATTEMPT_ENDINGS

ACTIVE_STATES = [s.value for s in ACTIVE]
RECORD_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)  # seconds between tries to record an attempt's end


def _latest(job: Job) -> Attempt | None:
    return job.attempts[-1] if job.attempts else None


class Supervisor:
    def __init__(self, core: Core):
        self.core = core
        self.watchers: dict[str, asyncio.Task] = {}
        self.starting: dict[str, asyncio.Task] = {}  # job id -> its attempt's start, while it runs
        #: job id -> (why its processes are being stopped, the reason to record)
        self.stopping: dict[str, tuple[str, str]] = {}
        self.schedule = None  # set by the manager: a coroutine function that runs an admission pass

    # starting ------------------------------------------------------------------------------
    def launch(self, start: dict) -> None:
        """Start an admitted attempt in the background (a submission does not wait for runners)."""
        job_id = start["id"]
        task = self.core.spawn(self.start(start))
        self.starting[job_id] = task
        task.add_done_callback(lambda t: self.starting.pop(job_id, None) if self.starting.get(job_id) is t
                               else None)

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
        fresh = await self.core.read(_state_of, job_id)
        return fresh if fresh else state

    async def start(self, start: dict) -> None:
        """Start an admitted attempt (its row says running); on failure, record that it could not start."""
        core, job_id = self.core, start["id"]
        recorded: dict = {}
        try:
            if not start["kernel_name"]:
                raise RuntimeError("its profile no longer exists (profiles.yaml changed)")
            account = core.settings.account(start["owner"])
            if core.mlflow is not None:
                await core.mlflow.ensure_user(start["owner"])
            launch = Launch(job_id=job_id, attempt=start["attempt"], owner=start["owner"],
                            kernel_name=start["kernel_name"], nproc=start["nproc"], nnodes=start.get("nnodes", 1),
                            devices=tuple(start["devices"]),
                            run_as=account, api_url=core.service_api, token=start["token"],
                            queue=start["queue"], priority_class=start["priority_class"], profile=start["profile"],
                            gpus=start["gpus"], gpu_type=start["gpu_type"], cpu=start["cpu"],
                            memory=start["memory"], timeout_seconds=start["timeout_seconds"])

            async def record(state: dict) -> None:
                recorded.update(state, attempt=start["attempt"])
                await core.db(_save_state, job_id, start["attempt"], dict(recorded))

            state = await core.backend.start(launch, record)
            state = {**state, "launched": True, "attempt": start["attempt"]}
            await core.db(_save_state, job_id, start["attempt"], state)
        except Exception as e:  # noqa: BLE001 - whatever it was, the job must not stay running
            core.log.exception("starting job %s failed", job_id)
            if recorded:  # a runner may exist: it goes before the job's GPUs are given back
                try:
                    await core.backend.cancel(job_id, recorded, 1.0, reason="cancelled")
                    await core.backend.cleanup(job_id, recorded)
                except Exception:  # noqa: BLE001
                    core.log.exception("ending the runner of job %s after its failed start failed", job_id)
            if core.backend.queues:
                await core.db(_admit, job_id, start["attempt"])
            await self.finalize(job_id, Outcome("failed", f"could not start: {e}", infrastructure=True,
                                                authoritative=True), start["attempt"])
            return
        self.watch(job_id, state)

    # a backend with its own queue -------------------------------------------------------------
    async def watch_queued(self, job_id: str, state: dict) -> bool:
        """Until a queueing backend admits the attempt: record its answer (why, position). True once
        admitted (the job is running), False if the attempt ended meanwhile (it was cancelled, or it
        ended before it was admitted, which is finalized here)."""
        core, backend, number = self.core, self.core.backend, state.get("attempt")
        last = None
        while True:
            current = await core.read(_handed_state, job_id, number)
            if current is None:
                return await core.read(_state_of, job_id, number) is not None  # running now, or gone
            answer = await backend.admission(job_id, state)
            if answer.admitted:
                await core.db(_admit, job_id, number)
                return True
            outcome = await backend.poll(job_id, state)
            if outcome is not None:  # it ended before it was admitted (deleted, refused by the cluster)
                await core.db(_admit, job_id, number)
                await backend.cleanup(job_id, state)
                await self.finalize(job_id, outcome, number)
                return False
            if (answer.reason, answer.position) != last:
                last = (answer.reason, answer.position)
                await core.db(_queued_answer, job_id, number, answer.reason, answer.position)
            await asyncio.sleep(getattr(backend, "poll_interval", 1.0))

    def watch(self, job_id: str, state: dict) -> None:
        task = asyncio.ensure_future(self._watch(job_id, state))
        self.watchers[job_id] = task
        task.add_done_callback(lambda _t: self.watchers.pop(job_id, None) if self.watchers.get(job_id) is _t
                               else None)

    async def _watch(self, job_id: str, state: dict) -> None:
        backend = self.core.backend
        try:
            if backend.queues and not await self.watch_queued(job_id, state):
                return
            await backend.wait(job_id, state)
            outcome = await backend.poll(job_id, state)
            while outcome is None:
                await asyncio.sleep(0.5)
                outcome = await backend.poll(job_id, state)
            await backend.cleanup(job_id, state)
            await self.finalize(job_id, outcome, state.get("attempt"))
        except asyncio.CancelledError:
            raise
        except Exception:
            self.core.log.exception("watching job %s failed", job_id)
            await self.finalize(job_id, Outcome("failed", "the service lost track of it", infrastructure=True),
                                state.get("attempt"))

    # stopping -------------------------------------------------------------------------------
    async def stop(self, job_id: str, state: dict, grace: float, why: str, reason: str = "") -> None:
        """End a running attempt (cancel, preemption, time limit); the runner learns ``why`` from the service."""
        self.stopping[job_id] = (why, reason or why)
        try:
            state = await self.settled(job_id, state)
            await self.core.db(_set_stop, job_id, why, grace, state.get("attempt"))
            await self.core.backend.cancel(job_id, state, grace, reason=why)
        except Exception:
            self.core.log.exception("stopping job %s (%s) failed", job_id, why)
        if job_id not in self.watchers:  # nothing else will notice
            await self.finalize(job_id, Outcome(why, reason or why), state.get("attempt"))

    async def cancel(self, job_id: str, state: dict, reason: str) -> None:
        """Cancel a running attempt now: end its processes (with the grace period), then record it."""
        core = self.core
        grace = core.settings.jobs["grace_period_seconds"]
        self.stopping[job_id] = ("cancelled", reason)
        state = await self.settled(job_id, state)
        await core.db(_set_stop, job_id, "cancelled", grace, state.get("attempt"))
        await core.backend.cancel(job_id, state, grace, reason="cancelled")
        await core.backend.cleanup(job_id, state)
        await self.finalize(job_id, Outcome("cancelled", reason), state.get("attempt"))
        watcher = self.watchers.pop(job_id, None)
        if watcher is not None:
            watcher.cancel()

    def reap_after_report(self, job_id: str, number: int, seconds: float = 30.0) -> None:
        """A runner's last act is its ``finished`` report; if attempt ``number`` still runs ``seconds`` later,
        it is ended (only that attempt: a later one of the same job is left alone)."""
        async def reap():
            await asyncio.sleep(seconds)
            state = await self.core.read(_state_of, job_id, number)
            if state is not None:
                self.core.log.warning("job %s reported its end %g s ago and still runs: ending it", job_id, seconds)
                await self.core.backend.cancel(job_id, state, 5.0, reason="finished")

        self.core.spawn(reap())

    # the end of an attempt ----------------------------------------------------------------------
    async def finalize(self, job_id: str, outcome: Outcome, attempt: int | None = None) -> None:
        """Record how an attempt ended (idempotent), free what it held, decide what comes next.

        With ``attempt``, only if that attempt is still the job's current one. Recording is retried
        (the database may be busy or restarting); if it keeps failing, the job is failed with the
        reason in a transaction of its own, so a job never stays running with nothing behind it.
        """
        core = self.core
        for delay in RECORD_RETRIES:
            try:
                await self._finalize_once(job_id, outcome, attempt)
                break
            except Exception as e:  # noqa: BLE001 - retried, then recorded as the job's failure
                core.log.exception("recording the end of job %s failed (%s); retrying in %g s", job_id, e, delay)
                await asyncio.sleep(delay)
        else:
            why = f"the service could not record how its attempt ended ({outcome.state}: {outcome.reason})"
            try:
                await self._finalize_once(job_id, Outcome("failed", why, infrastructure=True), attempt)
            except Exception:  # noqa: BLE001 - the database is gone: rewatch_orphans tries again later
                core.log.exception("job %s could not be recorded at all; it is watched again later", job_id)
                return
        if self.schedule is not None:
            await self.schedule()

    async def _finalize_once(self, job_id: str, outcome: Outcome, attempt: int | None) -> None:
        core = self.core
        async with core.lock:
            done = await core.db(_finalize, job_id, outcome, self.stopping.get(job_id), core.settings.jobs,
                                 core.ledger, attempt)
            if done is None:
                return
            self.stopping.pop(job_id, None)
            state, reason, workload = done
            core.model.release(job_id)
            if state == JobState.queued.value:
                core.pending[job_id] = workload
            else:
                core.metrics.finished.labels(workload.team, state).inc()
                core.mark_ended(job_id)
            core.log.info("job %s %s%s", job_id, state, f": {reason}" if reason else "")

    async def rewatch_orphans(self) -> None:
        """Active attempts that nothing watches (a watcher that failed, a recording that failed): watch again."""
        core = self.core
        for job_id, state, _preempted, _stop in await core.read(_active, core.backend.queues):
            if job_id not in self.watchers and state.get("launched"):
                core.log.warning("job %s is active with no watcher: watching it again", job_id)
                self.watch(job_id, state)

    # restarts ------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Re-attach to attempts that were running when the service stopped (before it serves runners)."""
        core = self.core
        for job_id, state, preempted, stop in await core.read(_active, core.backend.queues):
            if core.backend.queues and not state.get("launched"):
                # the service stopped while submitting it: whatever reached the cluster goes, and it is
                # handed over again (not counted)
                await core.backend.cancel(job_id, state, 1.0, reason="interrupted")
                await core.db(_admit, job_id, state.get("attempt"))
                await self.finalize(job_id, Outcome("failed", "the service stopped while submitting it",
                                                    interrupted=True, authoritative=True))
                continue
            if not state.get("launched") and not state.get("spec_fetched"):
                # the service stopped between admitting it and handing it to a runner: that runner never
                # ran it (and can no longer fetch its spec): end what exists and requeue, not counted
                await core.db(_abandon, job_id)
                await core.backend.cancel(job_id, state, 1.0, reason="interrupted")
                await self.finalize(job_id, Outcome("failed", "the service stopped while starting it",
                                                    interrupted=True))
                continue
            core.backend.load_state(job_id, state)
            core.log.info("re-attaching to job %s", job_id)
            if preempted or stop:
                why = "preempted" if preempted else stop
                grace = core.settings.jobs["preemption_grace_seconds" if why == "preempted" else
                                          "grace_period_seconds"]
                core.spawn(self.stop(job_id, state, grace, why))
            self.watch(job_id, state)

    async def close(self) -> None:
        for task in list(self.watchers.values()):
            task.cancel()


# database work (runs on the database thread pool) ---------------------------------------------
def handed_over(job: Job) -> bool:
    """A queued job whose current attempt a queueing backend holds (submitted, not yet admitted)."""
    attempt = _latest(job)
    return (job.state == JobState.queued.value and attempt is not None and attempt.finished_at is None
            and attempt.state == JobState.queued.value)


def _handed_state(s, job_id: str, number: int | None) -> dict | None:
    """The backend state of a job a queueing backend holds with attempt ``number``, not yet admitted."""
    job = s.get(Job, job_id)
    if job is None or not handed_over(job) or _latest(job).number != number:
        return None
    return dict(job.backend_state or {})


def _queued_answer(s, job_id: str, number: int | None, reason: str, position: int | None) -> None:
    job = s.get(Job, job_id)
    if job is not None and handed_over(job) and _latest(job).number == number:
        job.reason = reason or job.reason
        job.backend_state = {**(job.backend_state or {}), "position": position}


def _admit(s, job_id: str, number: int | None) -> bool:
    """The backend's queue admitted the attempt (or its runner already runs): the job is running."""
    job = s.get(Job, job_id)
    if job is None or not handed_over(job) or _latest(job).number != number:
        return False
    attempt = _latest(job)
    job.state = transition(job.state, JobState.running).value
    job.reason = ""
    job.started_at = job.started_at or utcnow()
    attempt.state = JobState.running.value
    attempt.started_at = utcnow()
    job.backend_state = {k: v for k, v in (job.backend_state or {}).items() if k != "position"}
    return True


def _save_state(s, job_id: str, attempt: int, state: dict) -> None:
    job = s.get(Job, job_id)
    latest = _latest(job) if job is not None else None
    if job is not None and latest is not None and latest.number == attempt and (job.state in ACTIVE_STATES
                                                                                or handed_over(job)):
        job.backend_state = {**(job.backend_state or {}), **state}


def _state_of(s, job_id: str, number: int | None = None) -> dict | None:
    """The backend state of the job's current attempt (of attempt ``number``, if still current), while active."""
    job = s.get(Job, job_id)
    if job is None or job.state not in ACTIVE_STATES:
        return None
    attempt = _latest(job)
    if number is not None and (attempt is None or attempt.number != number or attempt.finished_at is not None):
        return None
    return dict(job.backend_state or {})


def _set_stop(s, job_id: str, why: str, grace: float, number: int | None = None) -> None:
    job = s.get(Job, job_id)
    attempt = _latest(job) if job is not None else None
    if attempt is not None and attempt.finished_at is None and number in (None, attempt.number):
        attempt.stop_reason, attempt.stop_grace = why, float(grace)


def _abandon(s, job_id: str) -> None:
    job = s.get(Job, job_id)
    attempt = _latest(job) if job is not None else None
    if attempt is not None:
        attempt.token_hash = ""  # its runner API calls are refused from now on


def _active(s, queued_too: bool = False) -> list[tuple]:
    """Jobs with an attempt in the backend's hands (with ``queued_too``, those a queueing backend holds too)."""
    out = []
    states = ACTIVE_STATES + ([JobState.queued.value] if queued_too else [])
    for job in s.scalars(select(Job).where(Job.state.in_(states))):
        if job.state == JobState.queued.value and not handed_over(job):
            continue
        attempt = _latest(job)
        out.append((job.id, dict(job.backend_state or {}), job.state == JobState.preempted.value,
                    attempt.stop_reason if attempt is not None else ""))
    return out


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


def _finalize(s, job_id: str, outcome: Outcome, stopping, jobs: dict, ledger, number: int | None = None):
    job = s.get(Job, job_id)
    if job is None or job.state not in ACTIVE_STATES:
        return None
    attempt = _latest(job)
    if number is not None and (attempt is None or attempt.number != number):
        return None  # an earlier attempt's late news
    ledger.release(s, "job", job_id)
    why = stopping[0] if stopping else (attempt.stop_reason if attempt is not None else "") or None
    stopped = bool(why) or job.state == JobState.preempted.value
    failures = sum(1 for a in job.attempts[:-1] if a.failure == "infrastructure")
    nxt = next_state(job.state, _ending(attempt, outcome, stopping, stopped), stopping=why,
                     preempt_reason=(outcome.reason if outcome.state == "preempted" and outcome.authoritative
                                     else job.reason),
                     retries=job.retries, failures_before=failures,
                     limit_seconds=job.timeout_seconds or jobs["max_runtime_seconds"],
                     backoff_seconds=jobs["retry_backoff_seconds"])
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
        audit.append(s, "danlu", "retry", job.id, before={"attempt": len(job.attempts)},
                     after={"retry": nxt.retry_number, "of": job.retries, "after_seconds": nxt.retry_in,
                            "reason": nxt.attempt_reason})
    if nxt.state == JobState.queued:
        job.queued_at = now
    else:
        job.finished_at = now
    return job.state, job.reason, workload_of(job)
