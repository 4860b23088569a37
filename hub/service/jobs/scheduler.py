"""Who admits jobs, chosen once at start-up: Danlu's own admission passes, or a backend's own queue (Kueue).

:class:`Scheduler` is what the rest of the service asks about admission, whichever admits:
:meth:`~Scheduler.schedule` runs a pass, :meth:`~Scheduler.explain` says why a queued job waits (its reason,
position and estimated start), :meth:`~Scheduler.admitted` tells the supervisor when a started attempt runs,
and :attr:`~Scheduler.owns_queues` / :attr:`~Scheduler.multi_node` say what the queues and jobs may be. Its
loop (:meth:`~Scheduler.run_forever`) runs a pass after every event that can change the answer and every
``interval`` seconds, stops jobs past their time limit, samples GPU utilization and, every minute, rolls
usage up and expires old samples (:mod:`~danlu.hub.service.usage.rollups`).

:class:`DanluScheduler` runs one pass at a time under the core's lock: the pure admission
:class:`~danlu.hub.service.admission.model.Model` decides, then the whole decision is recorded in one
transaction (ledger rows, ``queued -> running`` with a new attempt and the hash of its job token,
``running -> preempted`` with an audit record). Only after the commit does the supervisor start the admitted
attempts and stop the victims. A pass that cannot be recorded leaves nothing behind: the model is rebuilt
from the database and the next pass decides again.

:class:`QueueingScheduler` is for a backend that queues attempts itself (``Backend.queues``, Kubernetes with
Kueue): every eligible queued job is handed over at once, with an open attempt and its token, and stays
``queued`` with the queue's own answer (its reason and position) until that queue admits it; Danlu's model
decides nothing, and admins change the queues through the cluster, not through Danlu.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import statistics
import time

from sqlalchemy import select

from danlu.hub.backends.base import Backend
from danlu.hub.service.admission import quotas
from danlu.hub.service.admission.workloads import Decision, Request, Workload
from danlu.hub.service.jobs import attempts
from danlu.hub.service.jobs.attempts import ACTIVE_STATES, handed_over
from danlu.hub.service.jobs.core import Core, overrides_of, ts, workload_of
from danlu.hub.service.jobs.supervisor import Supervisor
from danlu.hub.service.jobs.views import Explanation
from danlu.hub.service.metrics import Metrics
from danlu.hub.service.states import JobState, transition
from danlu.hub.service.store import audit
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Attempt, Job, ServerUsage, isoformat, utcnow
from danlu.hub.service.usage import rollups
from danlu.hub.service.usage.reports import sample_gpus

DRAINING = "the workbench is draining: no job starts until an admin ends it"
WAITING = "waiting for admission"


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Scheduler:
    """What every way of admitting jobs shares (see the module's docs); subclasses implement :meth:`schedule`."""

    #: seconds between two NVML samples of the detected GPUs (JobsServiceApp.gpu_sample_interval)
    sample_interval = 30.0
    #: whether the queues are another system's (Kueue's): then Danlu changes no quota, hold or priority itself
    owns_queues = False
    #: whether a job may span several nodes (only a cluster's queue gangs them)
    multi_node = False

    def __init__(
        self,
        core: Core,
        supervisor: Supervisor,
        *,
        database: Database,
        backend: Backend,
        settings,
        profiles,
        inventory,
        ledger: Ledger,
        metrics: Metrics,
        log: logging.Logger,
    ):
        self.core = core
        self.supervisor = supervisor
        self.database = database
        self.backend = backend
        self.settings = settings
        self.profiles = profiles
        self.inventory = inventory
        self.ledger = ledger
        self.metrics = metrics
        self.log = log
        supervisor.scheduler = self

    async def schedule(self, rebuild: bool = False) -> None:
        """One pass: start (or hand over) what may start now, stop what must make room.

        Under the core's lock: unless the workbench drains, :meth:`_pass_locked` decides on the queued jobs and
        records its decision in one transaction; a pass that fails leaves nothing behind, as the model is
        rebuilt from the database and the next pass decides again. Only after the lock is released does the
        supervisor start attempts and stop victims."""
        core = self.core
        if core.closing:
            return
        async with core.lock:
            if rebuild:
                await self.rebuild_locked()
            if core.draining:
                core.plan = Decision(waiting={jid: DRAINING for jid in core.pending})
                return
            backoff = await self.database.read(_backoff)
            try:
                starts, stops = await self._pass_locked(time.time(), backoff)
            except Exception:
                self.log.exception("recording a pass failed; rebuilding the queue from the database")
                await self.rebuild_locked()
                return
            self.observe()
        for start in starts:  # in the background: a submission does not wait for runners to start
            self.supervisor.launch(start)
        grace = self.settings.jobs.preemption_grace_seconds
        for job_id, state, why in stops:
            core.spawn(self.supervisor.stop(job_id, state, grace, "preempted", why))

    async def _pass_locked(self, now: float, backoff: dict) -> tuple[list[dict], list[tuple]]:
        """Decide and record one pass (the core's lock held): what starts, and what is stopped with why."""
        raise NotImplementedError

    def explain(self, job) -> Explanation:
        """Why a queued job waits, its position and when it may start."""
        raise NotImplementedError

    async def admitted(self, job_id: str, state: dict) -> bool:
        """Return once a started attempt runs: True, or False if it ended before (and was recorded)."""
        return True

    def observe(self) -> None:
        oldest: dict[str, float] = {}
        for wl in self.core.pending.values():
            oldest[wl.team] = min(wl.created, oldest.get(wl.team, wl.created))
        self.metrics.observe_model(self.core.model, self.core.pending_by_queue(), oldest)

    async def rebuild_locked(self) -> None:
        """Rebuild the admission model from the database (after a live change, an error, or a restart)."""
        self.core.model, self.core.pending = await self.database.read(
            _rebuild, self.settings, self.inventory, self.log, not self.owns_queues
        )

    def _start_of(self, job: Job, attempt: Attempt, token: str) -> dict:
        """What the supervisor needs to start an attempt (a Launch, less what only it knows)."""
        return {
            "id": job.id,
            "attempt": attempt.number,
            "devices": list(attempt.devices or []),
            "nproc": job.nproc,
            "nnodes": job.nnodes,
            "owner": job.owner,
            "kernel_name": _kernel_name(self.profiles, job.profile),
            "token": token,
            "queue": job.queue,
            "priority_class": job.priority_class or "",
            "profile": job.profile,
            "gpus": job.gpus,
            "gpu_type": job.gpu_type,
            "cpu": job.cpu,
            "memory": job.memory,
            "timeout_seconds": job.timeout_seconds or self.settings.jobs.max_runtime_seconds,
        }

    # time limits -----------------------------------------------------------------------------
    async def check_timeouts(self) -> None:
        """Stop running jobs that outran their limit."""
        jobs = self.settings.jobs
        late = await self.database.read(_late, jobs.max_runtime_seconds)
        for job_id, state in late:
            if job_id in self.supervisor.stopping:
                continue
            self.supervisor.stopping[job_id] = ("timed_out", "timed_out")
            self.core.spawn(self.supervisor.stop(job_id, state, jobs.grace_period_seconds, "timed_out"))

    # usage rollups ---------------------------------------------------------------------------------
    async def roll_up(self) -> None:
        """Roll up the hours that are over, six hours at a time on the writer thread (other writes go between
        passes) until caught up, then expire the raw samples the policy no longer keeps. A task of its own:
        catching up after an upgrade takes a while, and admission passes go on meanwhile."""
        core = self.core
        try:
            while not core.closing and await self.database.write(rollups.roll_up, utcnow()):
                await asyncio.sleep(0)
            keep = self.settings.usage.sample_retention_days
            while (
                not core.closing
                and await self.database.write(rollups.expire_samples, utcnow(), keep) >= rollups.EXPIRE_BATCH
            ):
                await asyncio.sleep(0)
        except Exception:
            self.log.exception("rolling usage up failed (the next try is in a minute)")

    # the loop -----------------------------------------------------------------------------------
    async def run_forever(self, interval: float = 2.0) -> None:
        core = self.core
        sampled, orphans, rolled, rolling = 0.0, time.monotonic(), 0.0, None
        while not core.closing:
            try:
                await asyncio.wait_for(core.wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            core.wake.clear()
            try:
                await self.check_timeouts()
                await self.schedule()
                if time.monotonic() - sampled > self.sample_interval:
                    sampled = time.monotonic()
                    samples = await self.database.write(sample_gpus, self.inventory)
                    self.metrics.observe_devices(self.inventory, samples)
                if time.monotonic() - orphans > 60:
                    orphans = time.monotonic()
                    await self.supervisor.rewatch_orphans()
                if time.monotonic() - rolled > 60 and (rolling is None or rolling.done()):
                    rolled = time.monotonic()
                    rolling = core.spawn(self.roll_up())
            except Exception:
                self.log.exception("admission pass failed")


class DanluScheduler(Scheduler):
    """Danlu's own admission: Kueue's semantics in the pure model, one pass at a time (see the module's docs)."""

    async def _pass_locked(self, now: float, backoff: dict) -> tuple[list[dict], list[tuple]]:
        """The model decides over the jobs not waiting out a retry; the decision is recorded in one transaction."""
        core = self.core
        started = time.perf_counter()
        eligible = [w for jid, w in core.pending.items() if jid not in backoff or ts(backoff[jid][0]) <= now]
        decision = core.model.cycle(eligible, now)
        for jid, (when, why) in backoff.items():
            if jid in core.pending and ts(when) > now:
                decision.waiting[jid] = (
                    f"{why} (at {isoformat(when)[11:19]} UTC)" if why else f"retrying at {isoformat(when)}"
                )
        tokens = {wl.id: secrets.token_urlsafe(32) for wl in decision.admitted}
        starts, stops = await self.database.write(self._record_pass, decision, tokens, now)
        for wl in decision.admitted:
            core.pending.pop(wl.id, None)
        core.plan = decision
        await self._estimate(now)
        self.metrics.cycle.observe(time.perf_counter() - started)
        return starts, stops

    def explain(self, job) -> Explanation:
        plan = self.core.plan
        return Explanation(
            plan.waiting.get(job.id, job.reason or WAITING), plan.positions.get(job.id), self.core.estimates.get(job.id)
        )

    async def _estimate(self, now: float) -> None:
        """Estimated start times of waiting jobs, from running jobs' history and limits."""
        core = self.core
        waiting = [w for w in core.pending.values() if w.id in core.plan.waiting]
        if not waiting or len(waiting) > 500:
            core.estimates = {}
            return
        ends, durations = await self.database.read(
            _durations, list(core.model.admitted), [w.id for w in waiting], now, self.settings.jobs.max_runtime_seconds
        )
        core.estimates = core.model.estimate(waiting, ends, durations, now)

    def _record_pass(self, s, decision: Decision, tokens: dict, now: float):
        """The pass's decision, recorded in one transaction (on the writer thread)."""
        starts, stops = [], []
        metrics = self.metrics
        for wl in decision.admitted:
            job = s.get(Job, wl.id)
            for device in wl.devices:
                self.ledger.claim(s, device, "job", job.id, job.owner, wl.flavor)
            job.state = transition(job.state, JobState.running).value
            job.reason = ""
            job.not_before = None
            job.started_at = job.started_at or utcnow()
            job.backend_state = {}
            attempt = Attempt(
                number=len(job.attempts) + 1,
                state="running",
                devices=list(wl.devices),
                flavor=wl.flavor,
                token_hash=token_hash(tokens[wl.id]),
            )
            job.attempts.append(attempt)
            metrics.admitted.labels(job.queue).inc()
            metrics.wait.labels(job.queue).observe(max(0.0, now - ts(job.queued_at or job.created_at)))
            starts.append(self._start_of(job, attempt, tokens[wl.id]))
        for victim, preemptor in decision.preempted:
            job = s.get(Job, victim.id)
            by = s.get(Job, preemptor.id)
            why = f"preempted by job {by.id} of {by.owner} ({by.queue}, priority {by.priority_class or by.priority})"
            job.state = transition(job.state, JobState.preempted).value
            job.reason = why
            metrics.preempted.labels(job.queue).inc()
            audit.append(
                s,
                "danlu",
                "preempt",
                job.id,
                before={"state": "running"},
                after={"state": "preempted", "by": by.id, "reason": why},
            )
            stops.append((job.id, dict(job.backend_state or {}), why))
        return starts, stops


class QueueingScheduler(Scheduler):
    """Admission by the backend's own queue (Kueue): hand every eligible job over (see the module's docs)."""

    owns_queues = True
    multi_node = True

    async def _pass_locked(self, now: float, backoff: dict) -> tuple[list[dict], list[tuple]]:
        """Submit every queued job not waiting out a retry to the backend at once.

        The job stays ``queued`` (its reason and position are the backend's, see :meth:`admitted`) with an
        open attempt and its token; no admission model runs here, and the backend's queue preempts."""
        core = self.core
        ready = [jid for jid in core.pending if jid not in backoff or ts(backoff[jid][0]) <= now]
        tokens = {jid: secrets.token_urlsafe(32) for jid in ready}
        starts = await self.database.write(self._record_hand_over, ready, tokens)
        for jid in ready:
            core.pending.pop(jid, None)
        core.plan = Decision(
            waiting={jid: f"retrying at {isoformat(backoff[jid][0])}" for jid in core.pending if jid in backoff}
        )
        return starts, []

    def explain(self, job) -> Explanation:
        """The backend's queue answers: Kueue's reason and position, as :meth:`admitted` recorded them."""
        state = job.backend_state if isinstance(job.backend_state, dict) else {}
        return Explanation(job.reason or WAITING, state.get("position"))

    async def admitted(self, job_id: str, state: dict) -> bool:
        """Until the backend's queue admits the attempt: record its answer (why, position). True once admitted
        (the job is running), False if the attempt ended meanwhile (it was cancelled, or it ended before it was
        admitted, which is finalized here)."""
        backend, number = self.backend, state.get("attempt")
        last = None
        while True:
            current = await self.database.read(attempts.handed_state, job_id, number)
            if current is None:  # running now, or gone
                return await self.database.read(attempts.state_of, job_id, number) is not None
            answer = await backend.admission(job_id, state)
            if answer.admitted:
                await self.database.write(attempts.admit, job_id, number)
                return True
            outcome = await backend.poll(job_id, state)
            if outcome is not None:  # it ended before it was admitted (deleted, refused by the cluster)
                await self.database.write(attempts.admit, job_id, number)
                await backend.cleanup(job_id, state)
                await self.supervisor.finalize(job_id, outcome, number)
                return False
            if (answer.reason, answer.position) != last:
                last = (answer.reason, answer.position)
                await self.database.write(attempts.queued_answer, job_id, number, answer.reason, answer.position)
            await asyncio.sleep(getattr(backend, "poll_interval", 1.0))

    def _record_hand_over(self, s, ready: list[str], tokens: dict) -> list[dict]:
        starts = []
        for job_id in ready:
            job = s.get(Job, job_id)
            if job is None or job.state != JobState.queued.value:
                continue
            attempt = Attempt(
                number=len(job.attempts) + 1,
                state=JobState.queued.value,
                devices=[],
                token_hash=token_hash(tokens[job_id]),
            )
            job.attempts.append(attempt)
            job.not_before = None
            job.backend_state = {"attempt": attempt.number}
            job.reason = f"submitted to the cluster's queue {job.queue}"
            starts.append(self._start_of(job, attempt, tokens[job_id]))
        return starts


# database work (runs on the database thread pool) ---------------------------------------------
def _backoff(s) -> dict:
    return {
        j.id: (j.not_before, j.reason)
        for j in s.scalars(select(Job).where(Job.state == JobState.queued.value, Job.not_before.is_not(None)))
    }


def _kernel_name(profiles, slug: str) -> str | None:
    try:
        return profiles.get(slug).kernel_name
    except Exception:  # noqa: BLE001 - a profile removed since: the start fails and says so
        return None


def _rebuild(s, settings, inventory, log: logging.Logger, restore_jobs: bool):
    """The model danlu.yaml, the admins' changes and what runs make, and the workloads that wait in it
    (``restore_jobs`` False: a backend's queue holds the jobs, and the model accounts for servers only)."""
    model = quotas.build_model(settings, inventory, overrides_of(s))
    if restore_jobs:
        for job in s.scalars(select(Job).where(Job.state.in_(ACTIVE_STATES))):
            wl = workload_of(job, job.attempts[-1] if job.attempts else None)
            wl.stopping = job.state == JobState.preempted.value
            try:
                model.restore(wl)
            except ValueError as e:
                log.error("job %s: %s", job.id, e)
    for row in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None))):
        if row.team in model.teams:
            server = Workload(
                f"server:{row.holder}",
                row.team,
                1 << 40,
                ts(row.started_at),
                Request(len(row.devices), row.flavor, 0.0, 0.0),
                row.owner,
                kind="server",
            )
            server.flavor, server.devices = row.flavor, tuple(row.devices)
            model.restore(server)
    pending = {
        job.id: workload_of(job)
        for job in s.scalars(select(Job).where(Job.state == JobState.queued.value))
        if not handed_over(job)
    }
    return model, pending


def _late(s, max_runtime: float) -> list:
    now = utcnow()
    late = []
    for job in s.scalars(select(Job).where(Job.state == JobState.running.value)):
        limit = job.timeout_seconds or max_runtime
        started = job.attempts[-1].started_at if job.attempts else None
        if started and (now - started).total_seconds() > limit:
            late.append((job.id, dict(job.backend_state or {})))
    return late


def _durations(s, running: list[str], waiting: list[str], now: float, max_runtime: float):
    history: dict = {}

    def expected(job: Job) -> float:
        limit = float(job.timeout_seconds or max_runtime)
        key = (job.owner, job.name)
        if key not in history:
            rows = s.execute(
                select(Attempt.started_at, Attempt.finished_at)
                .join(Job)
                .where(Job.owner == job.owner, Job.name == job.name, Attempt.state == "succeeded")
                .order_by(Attempt.finished_at.desc())
                .limit(20)
            )
            durations = [(f - b).total_seconds() for b, f in rows if f and b]
            history[key] = statistics.median(durations) if durations else None
        return min(limit, history[key]) if history[key] else limit

    ends, durations = {}, {}
    for job in s.scalars(select(Job).where(Job.id.in_(running))):
        start = ts(job.attempts[-1].started_at) if job.attempts else now
        ends[job.id] = max(now, start + expected(job))
    for job in s.scalars(select(Job).where(Job.id.in_(waiting))):
        durations[job.id] = expected(job)
    return ends, durations
