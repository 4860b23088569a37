"""The jobs service's core: accept, admit, start, watch, preempt, retry, time out and recover jobs.

:class:`JobManager` is everything the REST handlers call, with no HTTP in it.
A submission is fully validated before anything is written; then its files
(``input.ipynb``, ``job.json``) are written and its row committed. Admission is
the in-memory :class:`~danlu.hub.service.admission.Model` (Kueue's semantics)
kept in step with the database: one pass at a time (a lock) asks the model what
to admit and whom to preempt, records it in one transaction (ledger rows, job
states, attempts, audit records), then starts and stops processes through the
backend. Each running job has a watcher task that records how its attempt
ended: an infrastructure failure with retries left goes back to the queue after
a backoff, a preempted job goes back once its processes are gone. After a
restart, :meth:`JobManager.recover` rebuilds the model and re-attaches to the
jobs that were running.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import shutil
import statistics
import time
import uuid
from pathlib import Path, PurePosixPath

import nbformat
from sqlalchemy import func, select

from danlu.errors import Conflict, Forbidden, NotFound, PolicyError, Unreachable, ValidationError
from danlu.hub import accounts
from danlu.hub.backends.base import Outcome
from danlu.hub.service import audit, quotas, validation
from danlu.hub.service.admission import Decision, Request, Workload
from danlu.hub.service.ledger import Ledger
from danlu.hub.service.metrics import Metrics
from danlu.hub.service.models import Attempt, Flag, Job, QueueSetting, ServerUsage, isoformat, utcnow
from danlu.hub.service.states import FINAL, JobState, transition
from danlu.jobdir import JobDir, read_json

from .jobinfo import JOB_ID, cell_sha256, job_to_dict  # noqa: F401 - re-exported for handlers

RUNNING = (JobState.running.value, JobState.preempted.value)


def _ts(value) -> float:
    return value.timestamp() if value else 0.0


class JobManager:
    def __init__(self, *, settings, profiles, inventory, sessions, backend, groups, log: logging.Logger | None = None,
                 mlflow_users=None):
        self.settings = settings
        self.mlflow_users = mlflow_users  # danlu.hub.mlflow_auth.MlflowUsers; None: MLflow without permissions
        self.profiles = profiles
        self.inventory = inventory
        self.ledger = Ledger(inventory)
        self.sessions = sessions
        self.backend = backend
        self.groups = groups
        self.log = log or logging.getLogger("danlu.jobs")
        self.metrics = Metrics()
        quotas.check(settings, inventory)
        with self.sessions() as s:
            overrides = {q.name: {**q.changes, "held": q.held} for q in s.scalars(select(QueueSetting))}
            drain = s.get(Flag, "drain")
        self.model = quotas.build_model(settings, inventory, overrides)
        self.draining = bool(drain and drain.value.get("on"))
        self.pending: dict[str, Workload] = {}
        self.plan = Decision()
        self.estimates: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._watchers: dict[str, asyncio.Task] = {}
        self._stopping: dict[str, str] = {}  # job id -> why its processes are being stopped
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    # reading -----------------------------------------------------------------
    def jobdir(self, job_id: str) -> JobDir:
        return JobDir(self.settings.jobs_dir / job_id)

    def get(self, principal, job_id: str, *, write: bool = False) -> Job:
        """A job the caller may see (and, with ``write``, control); 404 otherwise, never 403."""
        if not JOB_ID.match(job_id or ""):
            raise ValidationError(f"'{job_id}' is not a job id (12 hex digits)", field="id", reason="bad_id")
        with self.sessions() as s:
            job = s.get(Job, job_id)
            allowed = job is not None and (principal.can_write(job.owner) if write else principal.can_read(job.owner))
            if not allowed:
                raise NotFound(f"job {job_id} not found", reason="no_such_job")
            s.expunge(job)
            return job

    def list(self, principal, *, states: list[str] | None = None, owner: str | None = None,
             queue: str | None = None, limit: int = 200) -> list[Job]:
        if owner and owner != principal.name and not principal.admin:
            raise Forbidden("only admins can list other users' jobs", reason="not_admin", field="owner")
        for state in states or []:
            if state not in JobState.__members__:
                raise ValidationError(f"unknown state '{state}'", field="state",
                                      fix=f"use {', '.join(JobState.__members__)}")
        with self.sessions() as s:
            query = select(Job).order_by(Job.created_at.desc()).limit(limit)
            if not principal.admin:
                query = query.where(Job.owner == principal.name)
            elif owner:
                query = query.where(Job.owner == owner)
            if states:
                query = query.where(Job.state.in_(states))
            if queue:
                query = query.where(Job.queue == queue)
            return list(s.scalars(query))

    def to_dict(self, job: Job) -> dict:
        return job_to_dict(self, job)

    def ended(self, job_id: str) -> asyncio.Event:
        """An event set when the job reaches a final state (for log followers)."""
        return self._ended.setdefault(job_id, asyncio.Event())

    def _mark_ended(self, job_id: str) -> None:
        event = self._ended.pop(job_id, None)
        if event is not None:
            event.set()

    # submission ------------------------------------------------------------------
    def _resolve_dataset(self, value: str, workdir: Path, field: str) -> dict:
        if ":" in value and value.split(":", 1)[0] in self.settings.dataset_roots:
            root, rel = value.split(":", 1)
            path = self.settings.dataset_roots[root] / rel
        else:
            path = workdir / value
        if not path.exists():
            raise ValidationError(f"{field}: dataset '{value}' does not exist", field=field, reason="no_dataset",
                                  fix="paths are relative to the notebook's folder (cwd), or <root>:<path>")
        return {"name": value, "path": str(path)}

    async def submit(self, principal, body) -> tuple[int, dict]:
        if not isinstance(body, dict):
            raise ValidationError("the request body must be a JSON object", field="body")
        validation.check_schema("JobSubmission", body)
        if not principal.is_user:
            raise Forbidden("only users submit jobs; this token belongs to a service", reason="not_a_user")
        owner = principal.name
        jobs = self.settings.jobs
        nb = body["notebook"]
        node = validation.check_notebook(nb)
        params = body.get("parameters", {})
        validation.check_parameters(params)
        resources = {"nproc": 1, "gpus": 0, **body.get("resources", {})}
        if resources["nproc"] > jobs["max_nproc"]:
            raise ValidationError(f"resources.nproc must be at most {jobs['max_nproc']}, got {resources['nproc']}",
                                  field="resources.nproc", reason="too_many_processes")
        if resources["gpus"] > self.ledger.total:
            raise PolicyError(f"resources.gpus: {resources['gpus']} GPUs asked, the workbench has {self.ledger.total}",
                              field="resources.gpus", reason="not_enough_gpus")
        if resources.get("gpu_type") and resources["gpu_type"] not in self.model.devices:
            raise ValidationError(f"resources.gpu_type: no GPUs of flavor '{resources['gpu_type']}' here",
                                  field="resources.gpu_type", fix=f"flavors: {', '.join(self.model.devices) or 'none'}")
        if "memory" in resources:
            resources["memory"] = validation.check_size(resources["memory"], "resources.memory")
        retries = body.get("retries", jobs["default_retries"])
        if retries > jobs["max_retries"]:
            raise ValidationError(f"retries must be at most {jobs['max_retries']}", field="retries")
        timeout = body.get("timeout_seconds")
        if timeout is not None and timeout > jobs["max_runtime_seconds"]:
            raise ValidationError(f"timeout_seconds must be at most {jobs['max_runtime_seconds']} (the workbench's "
                                  "max runtime)", field="timeout_seconds")
        cwd = validation.safe_relative_path(body.get("cwd", "."), "cwd")
        for i, ds in enumerate(body.get("datasets", [])):
            validation.check_dataset(ds, f"datasets[{i}]", self.settings.dataset_roots)
        source = dict(body.get("source", {}))
        if source.get("notebook_path"):
            source["notebook_path"] = validation.safe_relative_path(source["notebook_path"], "source.notebook_path")
        account = self.settings.account(owner)  # refuses a user without a Unix account when they are on
        groups = await self.groups.groups_of(owner, fallback=principal.groups)
        profile = self.profiles.authorize(body.get("profile"), groups, admin=principal.admin, gpus=resources["gpus"],
                                          gpu_field="resources.gpus")
        queue = quotas.queue_for(self.settings, body.get("queue"), groups, admin=principal.admin)
        priority_class, priority = quotas.priority_of(self.settings, body.get("priority"))
        request = quotas.request_for(resources, resources["nproc"], profile)
        probe = Workload("(new)", queue, priority, time.time(), request, owner)
        never = self.model.impossible(probe)
        if never:
            raise PolicyError(f"this job could never start: {never}", reason="never_fits", field="resources")
        home = self.settings.user_home(owner)
        if account is None:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)  # users may submit before ever starting a server
        workdir = home / cwd
        if not workdir.is_dir():
            raise ValidationError(f"cwd: folder '{cwd}' does not exist in your home", field="cwd", reason="no_folder")
        datasets = [self._resolve_dataset(ds, workdir, f"datasets[{i}]")
                    for i, ds in enumerate(body.get("datasets", []))]
        stem = PurePosixPath(source.get("notebook_path") or "").stem
        experiment = body.get("experiment") or f"{owner}/{stem or 'jobs'}"
        await self._check_mlflow(owner, experiment, principal.admin)
        name = body.get("name") or (re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-.")[:60] or "job")
        cell_id, sha = cell_sha256(nb)
        source.setdefault("cell_id", cell_id)
        # the job runs on its profile's kernel, whatever the notebook was saved with
        node.metadata["kernelspec"] = {"name": profile.kernel_name, "display_name": profile.display_name,
                                       "language": "python"}
        node.metadata.setdefault("language_info", {"name": "python"})
        if body.get("dry_run"):
            return 200, await self._dry_run(node, params, profile, resources, probe)

        job_id = uuid.uuid4().hex[:12]
        jd = JobDir.create(self.settings.jobs_dir, job_id)
        spec = {
            "id": job_id, "owner": owner, "name": name, "profile": profile.slug, "kernel_name": profile.kernel_name,
            "nproc": resources["nproc"], "gpus": resources["gpus"], "parameters": params, "queue": queue,
            "experiment": experiment,
            "cwd": str(workdir), "home": str(home), "datasets": datasets, "source": source, "cell_sha256": sha,
            # addresses that change between starts (MLflow's port) reach the runner in its environment
            "env": {"HOME": str(home), "USER": owner},
            "run_as": account.to_dict() if account else None,
        }
        now = utcnow()
        try:
            nbformat.write(node, str(jd.input_notebook))
            jd.write_spec(spec)
            for path in (jd.path, jd.input_notebook, jd.spec_file):
                accounts.give(path, account)
            async with self._lock:
                with self.sessions() as s, s.begin():
                    job = Job(id=job_id, owner=owner, name=name, state=JobState.queued.value, reason="",
                              profile=profile.slug, queue=queue, priority=priority, priority_class=priority_class,
                              nproc=resources["nproc"], gpus=request.gpus, gpu_type=request.gpu_flavor,
                              cpu=request.cpu, memory=request.memory, retries=retries, timeout_seconds=timeout,
                              parameters=params, experiment=spec["experiment"], datasets=datasets, source=source,
                              cwd=cwd, groups=list(groups), created_at=now, queued_at=now)
                    s.add(job)
                    audit.append(s, owner, "submit", job_id, after={
                        "queue": queue, "priority": priority_class, "profile": profile.slug, "resources": resources,
                        "name": name})
                self.pending[job_id] = self._workload(job)
        except BaseException:
            shutil.rmtree(jd.path, ignore_errors=True)
            raise
        self.log.info("job %s submitted by %s (%s, queue %s, %s)", job_id, owner, profile.slug, queue, resources)
        await self.schedule()
        with self.sessions() as s:
            return 201, self.to_dict(s.get(Job, job_id))

    async def _check_mlflow(self, owner: str, experiment: str, admin: bool) -> None:
        """MLflow integration (danlu.hub.mlflow_auth): the owner exists in MLflow and may log to the experiment."""
        if self.mlflow_users is None:
            return

        async def user_exists(name: str) -> bool:
            return await self.groups.user(name) is not None

        try:
            await self.mlflow_users.ensure_user(owner)
        except Unreachable as e:  # the job runs anyway and reports MLflow's absence
            self.log.warning("could not make %s an MLflow user: %s", owner, e)
        await self.mlflow_users.check_experiment(experiment, owner, admin, user_exists)

    async def _dry_run(self, node, params: dict, profile, resources: dict, probe: Workload) -> dict:
        from papermill.parameterize import parameterize_notebook

        # what papermill's load_notebook_node does before parameterizing
        node.metadata.setdefault("papermill", {})
        for cell in node.cells:
            cell.metadata.setdefault("tags", [])
        rendered = parameterize_notebook(node, params, report_mode=False, kernel_name=profile.kernel_name,
                                         language="python") if params else node
        async with self._lock:
            import copy

            sim = copy.deepcopy(self.model)
            decision = sim.cycle([copy.copy(w) for w in self.pending.values()] + [probe], time.time(), preempt=True)
        admitted = any(w.id == probe.id for w in decision.admitted)
        if self.draining:
            admitted, reason = False, "the workbench is draining: no job starts until an admin ends it"
        else:
            reason = "would start now" if admitted else decision.waiting.get(probe.id, "would wait")
        return {"dry_run": True, "admitted": admitted, "reason": reason, "queue": probe.team,
                "queue_position": decision.positions.get(probe.id), "profile": profile.slug, "resources": resources,
                "notebook": dict(rendered)}

    # admission -------------------------------------------------------------------
    def _workload(self, job: Job, attempt: Attempt | None = None) -> Workload:
        wl = Workload(job.id, job.queue, job.priority, _ts(job.created_at),
                      Request(job.gpus, job.gpu_type, job.cpu, job.memory), job.owner)
        if attempt is not None:
            wl.flavor = attempt.flavor
            wl.devices = tuple(attempt.devices or ())
            wl.admitted_at = _ts(attempt.started_at)
        return wl

    async def schedule(self) -> None:
        """One admission pass: start what fits now, preempt what must make room."""
        if self._closing:
            return
        async with self._lock:
            started = time.perf_counter()
            now = time.time()
            if self.draining:
                self.plan = Decision(waiting={jid: "the workbench is draining: no job starts until an admin "
                                                   "ends it" for jid in self.pending})
                return
            with self.sessions() as s:
                backoff = {j.id: (j.not_before, j.reason) for j in s.scalars(
                    select(Job).where(Job.state == JobState.queued.value, Job.not_before.is_not(None)))}
            eligible = [w for jid, w in self.pending.items()
                        if jid not in backoff or _ts(backoff[jid][0]) <= now]
            decision = self.model.cycle(eligible, now)
            for jid, (when, why) in backoff.items():
                if jid in self.pending and _ts(when) > now:
                    decision.waiting[jid] = f"{why} (at {isoformat(when)[11:19]} UTC)" if why else \
                        f"retrying at {isoformat(when)}"
            starts, stops = [], []
            try:
                with self.sessions() as s, s.begin():
                    for wl in decision.admitted:
                        job = s.get(Job, wl.id)
                        for device in wl.devices:
                            self.ledger.claim(s, device, "job", job.id, job.owner, wl.flavor)
                        job.state = transition(job.state, JobState.running).value
                        job.reason = ""
                        job.not_before = None
                        job.started_at = job.started_at or utcnow()
                        attempt = Attempt(number=len(job.attempts) + 1, state="running", devices=list(wl.devices),
                                          flavor=wl.flavor)
                        job.attempts.append(attempt)
                        self.metrics.admitted.labels(job.queue).inc()
                        waited = now - _ts(job.queued_at or job.created_at)
                        self.metrics.wait.labels(job.queue).observe(max(0.0, waited))
                        starts.append({"id": job.id, "attempt": attempt.number, "devices": list(wl.devices),
                                       "nproc": job.nproc, "kernel_name": self.profiles.get(job.profile).kernel_name})
                    for victim, preemptor in decision.preempted:
                        job = s.get(Job, victim.id)
                        by = s.get(Job, preemptor.id)
                        why = (f"preempted by job {by.id} of {by.owner} ({by.queue}, priority "
                               f"{by.priority_class or by.priority})")
                        job.state = transition(job.state, JobState.preempted).value
                        job.reason = why
                        self._stopping[job.id] = "preempted"
                        self.metrics.preempted.labels(job.queue).inc()
                        audit.append(s, "danlu", "preempt", job.id, before={"state": "running"},
                                     after={"state": "preempted", "by": by.id, "reason": why})
                        stops.append((job.id, dict(job.backend_state)))
            except Exception:
                self.log.exception("recording an admission pass failed; rebuilding the queue from the database")
                self._rebuild()
                return
            for wl in decision.admitted:
                self.pending.pop(wl.id, None)
            self.plan = decision
            self._estimate(now)
            self.metrics.observe_model(self.model, self._pending_by_queue())
            self.metrics.cycle.observe(time.perf_counter() - started)
        for start in starts:
            await self._start(start)
        for job_id, state in stops:
            self._spawn(self._stop(job_id, state, self.settings.jobs["preemption_grace_seconds"], "preempted"))

    def _pending_by_queue(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for wl in self.pending.values():
            counts[wl.team] = counts.get(wl.team, 0) + 1
        return counts

    def _expected_duration(self, s, job: Job, history: dict) -> float:
        limit = float(job.timeout_seconds or self.settings.jobs["max_runtime_seconds"])
        key = (job.owner, job.name)
        if key not in history:
            rows = s.execute(select(Attempt.started_at, Attempt.finished_at).join(Job).where(
                Job.owner == job.owner, Job.name == job.name, Attempt.state == "succeeded")
                .order_by(Attempt.finished_at.desc()).limit(20))
            durations = [(f - b).total_seconds() for b, f in rows if f and b]
            history[key] = statistics.median(durations) if durations else None
        return min(limit, history[key]) if history[key] else limit

    def _estimate(self, now: float) -> None:
        """Estimated start times of waiting jobs, from running jobs' history and limits."""
        waiting = [w for w in self.pending.values() if w.id in self.plan.waiting]
        if not waiting or len(waiting) > 500:
            self.estimates = {}
            return
        history: dict = {}
        ends, durations = {}, {}
        with self.sessions() as s:
            for job in s.scalars(select(Job).where(Job.id.in_(list(self.model.admitted)))):
                start = _ts(job.attempts[-1].started_at) if job.attempts else now
                ends[job.id] = max(now, start + self._expected_duration(s, job, history))
            for job in s.scalars(select(Job).where(Job.id.in_([w.id for w in waiting]))):
                durations[job.id] = self._expected_duration(s, job, history)
        self.estimates = self.model.estimate(waiting, ends, durations, now)

    async def _start(self, start: dict) -> None:
        try:
            state = await self.backend.start(start)
        except Exception as e:
            self.log.exception("starting job %s failed", start["id"])
            await self.finalize(start["id"], Outcome("failed", f"could not start: {e}", infrastructure=True))
            return
        with self.sessions() as s, s.begin():
            job = s.get(Job, start["id"])
            job.backend_state = {**job.backend_state, **state}
        self._watch(start["id"], state)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _watch(self, job_id: str, state: dict) -> None:
        task = asyncio.ensure_future(self._watch_job(job_id, state))
        self._watchers[job_id] = task
        task.add_done_callback(lambda _t: self._watchers.pop(job_id, None))

    async def _watch_job(self, job_id: str, state: dict) -> None:
        try:
            await self.backend.wait(job_id, state)
            outcome = await self.backend.poll(job_id, state)
            while outcome is None:
                await asyncio.sleep(0.5)
                outcome = await self.backend.poll(job_id, state)
            await self.finalize(job_id, outcome)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("watching job %s failed", job_id)

    async def _stop(self, job_id: str, state: dict, grace: float, why: str) -> None:
        """End a running job's processes (cancel, preemption, timeout); its watcher records the end."""
        try:
            await self.backend.cancel(job_id, state, grace, reason=why)
        except Exception:
            self.log.exception("stopping job %s (%s) failed", job_id, why)
        if job_id not in self._watchers:  # nothing else will notice
            await self.finalize(job_id, Outcome(why, why))

    async def finalize(self, job_id: str, outcome: Outcome) -> None:
        """Record how an attempt ended (idempotent), free what it held, and decide what comes next."""
        async with self._lock:
            stopping = self._stopping.pop(job_id, None)
            with self.sessions() as s, s.begin():
                job = s.get(Job, job_id)
                if job is None or job.state not in RUNNING:
                    return
                attempt = job.attempts[-1] if job.attempts else None
                self.ledger.release(s, "job", job_id)
                self.model.release(job_id)
                run = read_json(self.jobdir(job_id).run_file) or {}
                job.mlflow_run_id = outcome.mlflow_run_id or run.get("run_id") or job.mlflow_run_id
                if run.get("experiment_id"):
                    job.backend_state = {**job.backend_state, "mlflow_experiment_id": run["experiment_id"]}
                state, reason, failure, ended_as = self._next_state(s, job, outcome, stopping)
                if attempt is not None:
                    attempt.state, attempt.failure = ended_as, failure
                    attempt.reason = outcome.reason if state == JobState.queued.value and failure else reason
                    attempt.exit_code, attempt.finished_at = outcome.exit_code, utcnow()
                job.state = transition(job.state, state).value
                job.reason = reason
                job.failure = failure if state == JobState.failed.value else ""
                if state == JobState.queued.value:
                    job.queued_at = utcnow()
                    self.pending[job_id] = self._workload(job)
                else:
                    job.finished_at = utcnow()
                    self.metrics.finished.labels(job.queue, state).inc()
            self.log.info("job %s %s%s", job_id, state, f": {reason}" if reason else "")
            if state != JobState.queued.value:
                self._mark_ended(job_id)
        await self.schedule()

    def _next_state(self, s, job: Job, outcome: Outcome, stopping: str | None) -> tuple[str, str, str, str]:
        """(job state, reason, failure kind, how the attempt ended) after an attempt ended."""
        jobs = self.settings.jobs
        if outcome.state == "succeeded":
            return "succeeded", "", "", "succeeded"
        if stopping == "cancelled" or outcome.state == "cancelled":
            return "cancelled", outcome.reason or "cancelled", "", "cancelled"
        if stopping == "timed_out" or outcome.state == "timed_out":
            limit = job.timeout_seconds or jobs["max_runtime_seconds"]
            return "timed_out", f"ran longer than its limit of {limit} s and was stopped", "", "timed_out"
        if job.state == JobState.preempted.value or stopping == "preempted" or outcome.state == "preempted":
            return ("queued", f"{job.reason}; back in the queue (checkpoint in $DANLU_CHECKPOINT_DIR)", "",
                    "preempted")
        if not outcome.infrastructure:
            return "failed", f"error in your code: {outcome.reason}", "user", "failed"
        failures = 1 + sum(1 for a in job.attempts[:-1] if a.failure == "infrastructure")
        if failures <= job.retries:
            delay = min(3600.0, jobs["retry_backoff_seconds"] * 2 ** (failures - 1))
            job.not_before = utcnow() + dt.timedelta(seconds=delay)
            audit.append(s, "danlu", "retry", job.id, before={"attempt": len(job.attempts)},
                         after={"retry": failures, "of": job.retries, "after_seconds": delay,
                                "reason": outcome.reason})
            return "queued", (f"retry {failures} of {job.retries} after an infrastructure failure: "
                              f"{outcome.reason}"), "infrastructure", "failed"
        return "failed", f"infrastructure failure: {outcome.reason}", "infrastructure", "failed"

    async def cancel(self, principal, job_id: str) -> dict:
        job = self.get(principal, job_id, write=True)
        if JobState(job.state) in FINAL:
            transition(job.state, JobState.cancelled)  # raises 409 with the reason
        who = principal.name
        if job.state == JobState.queued.value:
            async with self._lock:
                with self.sessions() as s, s.begin():
                    row = s.get(Job, job_id)
                    if row.state != JobState.queued.value:
                        raise Conflict(f"job {job_id} started meanwhile; cancel it again", reason="raced")
                    row.state = transition(row.state, JobState.cancelled).value
                    row.reason = f"cancelled by {who} while queued"
                    row.finished_at = utcnow()
                    audit.append(s, who, "cancel", job_id, before={"state": "queued"}, after={"state": "cancelled"})
                self.pending.pop(job_id, None)
                self.metrics.finished.labels(row.queue, "cancelled").inc()
            self._mark_ended(job_id)
        else:
            await self.audit_event(who, "cancel", job_id, before={"state": job.state}, after={"state": "cancelled"})
            self._stopping[job_id] = "cancelled"
            await self.backend.cancel(job_id, job.backend_state, self.settings.jobs["grace_period_seconds"],
                                      reason="cancelled")
            await self.finalize(job_id, Outcome("cancelled", f"cancelled by {who}"))
            watcher = self._watchers.pop(job_id, None)
            if watcher is not None:
                watcher.cancel()
        await self.schedule()
        with self.sessions() as s:
            return self.to_dict(s.get(Job, job_id))

    async def check_timeouts(self) -> None:
        """Stop running jobs that outran their limit."""
        now = utcnow()
        with self.sessions() as s:
            running = list(s.scalars(select(Job).where(Job.state == JobState.running.value)))
            late = []
            for job in running:
                limit = job.timeout_seconds or self.settings.jobs["max_runtime_seconds"]
                started = job.attempts[-1].started_at if job.attempts else None
                if started and (now - started).total_seconds() > limit and job.id not in self._stopping:
                    late.append((job.id, dict(job.backend_state)))
        for job_id, state in late:
            self._stopping[job_id] = "timed_out"
            self._spawn(self._stop(job_id, state, self.settings.jobs["grace_period_seconds"], "timed_out"))

    async def audit_event(self, actor: str, action: str, target: str, before=None, after=None) -> dict:
        """Append to the audit log outside an admission pass (one writer at a time keeps the chain whole)."""
        async with self._lock:
            with self.sessions() as s, s.begin():
                return audit.to_dict(audit.append(s, actor, action, target, before=before, after=after))

    def record_profiles(self, profiles) -> None:
        """Audit a change of the governed profiles since the service last started."""
        now = {p.slug: {"display_name": p.display_name, "environment": p.environment, "groups": list(p.groups),
                        "gpus": list(p.gpu_choices), "requirements": p.requirements_digest()} for p in profiles}
        with self.sessions() as s, s.begin():
            flag = s.get(Flag, "profiles")
            before = flag.value.get("profiles", {}) if flag else None
            if before == now:
                return
            changed = {slug for slug in set(now) | set(before or {}) if (before or {}).get(slug) != now.get(slug)}
            audit.append(s, "danlu", "change_profiles", profiles.source,
                         before={slug: (before or {}).get(slug) for slug in sorted(changed)},
                         after={slug: now.get(slug) for slug in sorted(changed)})
            s.merge(Flag(key="profiles", value={"profiles": now}))

    # admin operations -----------------------------------------------------------------
    def _require_admin(self, principal) -> None:
        if not principal.admin:
            raise Forbidden("this is an admin operation", reason="not_admin")

    async def reprioritize(self, principal, job_id: str, priority: str) -> dict:
        self._require_admin(principal)
        job = self.get(principal, job_id)
        if JobState(job.state) in FINAL:
            raise Conflict(f"job {job_id} already ended ({job.state})", reason="already_final")
        name, value = quotas.priority_of(self.settings, priority)
        async with self._lock:
            with self.sessions() as s, s.begin():
                row = s.get(Job, job_id)
                before = {"priority": row.priority_class, "value": row.priority}
                row.priority_class, row.priority = name, value
                audit.append(s, principal.name, "reprioritize", job_id, before=before,
                             after={"priority": name, "value": value})
            for wl in (self.pending.get(job_id), self.model.admitted.get(job_id)):
                if wl is not None:
                    wl.reprioritize(value)
        await self.schedule()
        with self.sessions() as s:
            return self.to_dict(s.get(Job, job_id))

    def queues(self, principal) -> list[dict]:
        """Every queue: quota, use, borrowing, held; everyone may see them (no other user's jobs)."""
        out = []
        pending = self._pending_by_queue()
        specs = quotas.team_specs(self.settings, self._overrides())
        for team in self.model.teams.values():
            usage = {r: v for r, v in self.model.used[team.name].items() if v}
            out.append({
                "name": team.name, "cohort": team.cohort, "held": team.held,
                "quota": specs.get(team.name, {}).get("quota") or _gpu_amounts(team.nominal),
                "borrowing_limit": specs.get(team.name, {}).get("borrowing_limit") or {},
                "lending_limit": specs.get(team.name, {}).get("lending_limit") or {},
                "usage": _gpu_amounts(usage), "pending": pending.get(team.name, 0),
                "running": sum(1 for w in self.model.admitted.values() if w.team == team.name and w.kind == "job"),
                "servers": sum(1 for w in self.model.admitted.values() if w.team == team.name and w.kind == "server"),
                "borrowing": {k[4:]: v - team.nominal.get(k, 0) for k, v in usage.items()
                              if k.startswith("gpu/") and v > team.nominal.get(k, 0)},
            })
        return out

    def _overrides(self) -> dict:
        with self.sessions() as s:
            return {q.name: {**q.changes, "held": q.held} for q in s.scalars(select(QueueSetting))}

    async def change_queue(self, principal, name: str, changes: dict) -> dict:
        """Change a team's quota or limits live (validated against the schema of danlu.yaml's teams)."""
        self._require_admin(principal)
        if name not in self.model.teams:
            raise NotFound(f"no queue '{name}'", field="name", fix=f"queues: {', '.join(self.model.teams)}")
        if not self.settings.teams:
            raise Conflict("the default queue holds the whole machine; define teams in danlu.yaml to set quotas",
                           reason="no_teams")
        validation.check_team_change(changes, self.model.devices)
        async with self._lock:
            with self.sessions() as s, s.begin():
                row = s.get(QueueSetting, name) or QueueSetting(name=name, changes={}, held=False)
                current = quotas.team_specs(self.settings, self._overrides()).get(name, {})
                # a change names what changes: other flavors, cpu and memory keep their values
                merged = {section: _merge(current.get(section) or {}, amounts) for section, amounts in changes.items()}
                row.changes = {**row.changes, **merged}
                s.merge(row)
                audit.append(s, principal.name, "change_quota", name,
                             before={k: current.get(k) for k in changes}, after=merged)
            self._rebuild()
        await self.schedule()
        return next(q for q in self.queues(principal) if q["name"] == name)

    async def reset_queue(self, principal, name: str) -> dict:
        """Drop an admin's live changes to a queue: danlu.yaml's values apply again."""
        self._require_admin(principal)
        if name not in self.model.teams:
            raise NotFound(f"no queue '{name}'", field="name", fix=f"queues: {', '.join(self.model.teams)}")
        async with self._lock:
            with self.sessions() as s, s.begin():
                row = s.get(QueueSetting, name)
                before = dict(row.changes) if row else {}
                if row is not None:
                    row.changes = {}
                audit.append(s, principal.name, "reset_quota", name, before=before,
                             after={k: (self.settings.teams.get(name) or {}).get(k) for k in before})
            self._rebuild()
        await self.schedule()
        return next(q for q in self.queues(principal) if q["name"] == name)

    async def hold(self, principal, name: str, held: bool) -> dict:
        self._require_admin(principal)
        if name not in self.model.teams:
            raise NotFound(f"no queue '{name}'", field="name", fix=f"queues: {', '.join(self.model.teams)}")
        async with self._lock:
            with self.sessions() as s, s.begin():
                row = s.get(QueueSetting, name) or QueueSetting(name=name, changes={}, held=False)
                before = row.held
                row.held = held
                s.merge(row)
                audit.append(s, principal.name, "hold" if held else "release", name, before={"held": before},
                             after={"held": held})
            self.model.teams[name].held = held
        await self.schedule()
        return next(q for q in self.queues(principal) if q["name"] == name)

    async def drain(self, principal, on: bool) -> dict:
        self._require_admin(principal)
        async with self._lock:
            with self.sessions() as s, s.begin():
                before = self.draining
                flag = s.get(Flag, "drain") or Flag(key="drain", value={})
                flag.value = {"on": on, "by": principal.name, "at": isoformat(utcnow())}
                s.merge(flag)
                audit.append(s, principal.name, "drain" if on else "undrain", "workbench",
                             before={"draining": before}, after={"draining": on})
            self.draining = on
        await self.schedule()
        return {"draining": on}

    def _rebuild(self) -> None:
        """Rebuild the admission model from the database (after a live change, or to recover from an error)."""
        model = quotas.build_model(self.settings, self.inventory, self._overrides())
        pending = {}
        with self.sessions() as s:
            for job in s.scalars(select(Job).where(Job.state.in_(RUNNING))):
                attempt = job.attempts[-1] if job.attempts else None
                wl = self._workload(job, attempt)
                wl.stopping = job.state == JobState.preempted.value
                try:
                    model.restore(wl)
                except ValueError as e:
                    self.log.error("job %s: %s", job.id, e)
            for row in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None))):
                if row.team in model.teams:
                    server = Workload(f"server:{row.holder}", row.team, 1 << 40, _ts(row.started_at),
                                      Request(len(row.devices), row.flavor, 0.0, 0.0), row.owner, kind="server")
                    server.flavor, server.devices = row.flavor, tuple(row.devices)
                    model.restore(server)
            for job in s.scalars(select(Job).where(Job.state == JobState.queued.value)):
                pending[job.id] = self._workload(job)
        self.model, self.pending = model, pending

    # restarts -------------------------------------------------------------------
    async def recover(self) -> None:
        """Rebuild the model and re-attach to jobs that were running when the service stopped."""
        async with self._lock:
            self._rebuild()
        with self.sessions() as s:
            running = list(s.scalars(select(Job).where(Job.state.in_(RUNNING))))
        for job in running:
            self.backend.load_state(job.id, job.backend_state)
            self.log.info("re-attaching to %s job %s", job.state, job.id)
            if job.state == JobState.preempted.value:
                self._stopping[job.id] = "preempted"
                self._spawn(self._stop(job.id, dict(job.backend_state), self.settings.jobs["preemption_grace_seconds"],
                                       "preempted"))
            self._watch(job.id, job.backend_state)
        await self.schedule()

    async def run_forever(self, interval: float = 2.0) -> None:
        samples = 0.0
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.check_timeouts()
                await self.schedule()
                if time.monotonic() - samples > 30:
                    samples = time.monotonic()
                    from danlu.hub.service.usage import sample_gpus

                    with self.sessions() as s, s.begin():
                        sample_gpus(s, self.inventory)
            except Exception:
                self.log.exception("admission pass failed")

    async def stop(self) -> None:
        self._closing = True
        for task in list(self._watchers.values()) + list(self._tasks):
            task.cancel()
        await self.backend.shutdown()

    # notebook servers ----------------------------------------------------------
    async def allocate_server(self, holder: str, owner: str, gpus: int, profile: str = "",
                              groups=()) -> list[int]:
        """Reserve GPUs for a server from its owner's team quota, now or never (servers do not queue)."""
        team = quotas.queue_for(self.settings, None, groups, admin=True) if self.settings.teams else "default"
        if self.settings.teams:
            mine = [t for t in self.settings.teams if t in set(groups)]
            if not mine:
                raise PolicyError(f"{owner} is in no team, so has no GPU quota for a server", reason="no_team",
                                  field="gpus", fix="ask an admin to add you to a team, or start without GPUs")
            team = mine[0]
        async with self._lock:
            await self._release_server_locked(holder)
            server = Workload(f"server:{holder}", team, 1 << 40, time.time(), Request(gpus, None, 0.0, 0.0), owner,
                              kind="server")
            ok, why = self.model.try_server(server)
            if not ok:
                raise Conflict(f"no room for {gpus} GPUs for the server: {why.removeprefix('waiting for ')}",
                               reason="gpus_busy", field="gpus", fix="pick fewer GPUs, or wait for jobs to finish")
            with self.sessions() as s, s.begin():
                for device in server.devices:
                    self.ledger.claim(s, device, "server", holder, owner, server.flavor)
                s.add(ServerUsage(holder=holder, owner=owner, team=team, profile=profile, flavor=server.flavor,
                                  devices=list(server.devices)))
            self.metrics.observe_model(self.model, self._pending_by_queue())
        return list(server.devices)

    async def _release_server_locked(self, holder: str) -> None:
        self.model.release(f"server:{holder}")
        with self.sessions() as s, s.begin():
            self.ledger.release(s, "server", holder)
            for row in s.scalars(select(ServerUsage).where(ServerUsage.holder == holder,
                                                           ServerUsage.ended_at.is_(None))):
                row.ended_at = utcnow()

    async def release_server(self, holder: str) -> None:
        async with self._lock:
            await self._release_server_locked(holder)
        await self.schedule()

    async def idle_gpu_servers(self) -> list[dict]:
        """Servers holding GPUs with no activity for ``usage.idle_server_minutes``, for admins to act on
        (the idle culler stops any server after ``hub.idle_timeout_seconds``)."""
        import datetime as dt

        minutes = self.settings.usage["idle_server_minutes"]
        with self.sessions() as s:
            holding = list(s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None))))
        idle = []
        for row in holding:
            user, _, name = row.holder.partition(":")
            model = await self.groups.user(user)
            server = ((model or {}).get("servers") or {}).get(name, {})
            last = server.get("last_activity")
            if not last:
                continue
            seen = dt.datetime.fromisoformat(last.replace("Z", "+00:00")).astimezone(dt.timezone.utc)
            quiet = (dt.datetime.now(dt.timezone.utc) - seen).total_seconds() / 60
            if quiet >= minutes:
                idle.append({"server": row.holder, "owner": row.owner, "team": row.team, "gpus": len(row.devices),
                             "devices": row.devices, "idle_minutes": round(quiet, 1)})
        return idle

    def counts(self) -> dict:
        with self.sessions() as s:
            return dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())


def _merge(current: dict, change: dict) -> dict:
    out = {**current, **{k: v for k, v in change.items() if k != "gpus"}}
    if "gpus" in change:
        out["gpus"] = {**(current.get("gpus") or {}), **change["gpus"]}
    return out


def _gpu_amounts(resources: dict) -> dict:
    out: dict = {}
    for key, value in resources.items():
        if key.startswith("gpu/"):
            out.setdefault("gpus", {})[key[4:]] = value
        else:
            out[key] = value
    return out

