"""The jobs service's core: accept, admit, start, watch, cancel and recover jobs.

:class:`JobManager` is everything the REST handlers call, with no HTTP in it.
A submission is fully validated before anything is written; then its files
(``input.ipynb``, ``job.json``) are written and its row committed. A single
admission pass (:meth:`JobManager.schedule`, serialized by a lock) asks the
:class:`~danlu.hub.service.scheduler.Scheduler` what fits, reserves devices in
the ledger and marks jobs running in one transaction, then starts them through
the backend. Each running job has a watcher task that records its outcome.
After a restart, :meth:`JobManager.recover` re-attaches watchers to the jobs
that were running, so a job started before the service died still ends with
its state, log and output recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import shutil
import uuid
from pathlib import Path, PurePosixPath

import nbformat
from sqlalchemy import func, select

from danlu.errors import Forbidden, NotFound, PolicyError, ValidationError
from danlu.hub import accounts
from danlu.hub.backends.base import Outcome
from danlu.hub.service import validation
from danlu.hub.service.models import Attempt, Job, isoformat, utcnow
from danlu.hub.service.scheduler import Candidate, Plan, Scheduler, Snapshot
from danlu.hub.service.states import FINAL, JobState, transition
from danlu.jobdir import JobDir, read_json

JOB_ID = re.compile(r"^[0-9a-f]{12}$")
QUEUES = ("default",)


def cell_sha256(nb: dict) -> tuple[str, str]:
    """(cell id, sha256 of its source) of the job's cell: tagged ``danlu-cell``, else the last code cell."""
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    tagged = [c for c in code if "danlu-cell" in c.get("metadata", {}).get("tags", [])]
    cell = (tagged or code)[-1]
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    return cell.get("id", ""), hashlib.sha256(source.encode()).hexdigest()


class JobManager:
    def __init__(self, *, settings, profiles, ledger, sessions, backend, groups, log: logging.Logger | None = None):
        self.settings = settings
        self.profiles = profiles
        self.ledger = ledger
        self.sessions = sessions
        self.backend = backend
        self.groups = groups
        self.log = log or logging.getLogger("danlu.jobs")
        self.scheduler = Scheduler()
        self.plan = Plan()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._watchers: dict[str, asyncio.Task] = {}
        self._cancelling: set[str] = set()
        self._ended: dict[str, asyncio.Event] = {}
        self._stopping = False

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
             limit: int = 200) -> list[Job]:
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
            return list(s.scalars(query))

    def run_info(self, job: Job) -> dict:
        return read_json(self.jobdir(job.id).run_file) or {}

    def to_dict(self, job: Job) -> dict:
        base = f"{self.settings.public_url}/services/danlu/api/v1/jobs/{job.id}"
        run = self.run_info(job) if job.mlflow_run_id is None or job.state == "running" else {}
        run_id = job.mlflow_run_id or run.get("run_id")
        experiment_id = job.backend_state.get("mlflow_experiment_id") or run.get("experiment_id")
        attempts = [{
            "number": a.number, "state": a.state, "reason": a.reason, "devices": list(a.devices or []),
            "exit_code": a.exit_code, "started_at": isoformat(a.started_at), "finished_at": isoformat(a.finished_at),
        } for a in job.attempts]
        end = job.finished_at or (utcnow() if job.state == "running" else None)
        reason = job.reason
        if job.state == "queued":
            reason = self.plan.waiting.get(job.id, reason or "waiting for admission")
        return {
            "id": job.id, "name": job.name, "owner": job.owner, "state": job.state, "reason": reason,
            "profile": job.profile, "queue": job.queue,
            "resources": {"nproc": job.nproc, "gpus": job.gpus},
            "parameters": job.parameters, "experiment": job.experiment,
            "datasets": [d["name"] for d in job.datasets], "source": job.source,
            "devices": list(job.attempts[-1].devices or []) if job.attempts and job.state == "running" else [],
            "attempts": attempts,
            "created_at": isoformat(job.created_at), "started_at": isoformat(job.started_at),
            "finished_at": isoformat(job.finished_at),
            "elapsed_seconds": round((end - job.started_at).total_seconds(), 3) if job.started_at and end else None,
            "queue_position": self.plan.positions.get(job.id) if job.state == "queued" else None,
            "mlflow_run_id": run_id,
            "mlflow_run_url": (f"{self.settings.public_url}/services/mlflow/#/experiments/{experiment_id}/runs/{run_id}"
                               if run_id and experiment_id else None),
            "output_url": f"{base}/output", "logs_url": f"{base}/logs",
            "runner": ("warm" if job.backend_state.get("warm") else "cold") if "pid" in job.backend_state else None,
        }

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
        nb = body["notebook"]
        node = validation.check_notebook(nb)
        params = body.get("parameters", {})
        validation.check_parameters(params)
        resources = {"nproc": 1, "gpus": 0, **body.get("resources", {})}
        max_nproc = self.settings.jobs["max_nproc"]
        if resources["nproc"] > max_nproc:
            raise ValidationError(f"resources.nproc must be at most {max_nproc}, got {resources['nproc']}",
                                  field="resources.nproc", reason="too_many_processes")
        if resources["gpus"] > self.ledger.total:
            raise PolicyError(f"resources.gpus: {resources['gpus']} GPUs asked, the workbench has {self.ledger.total}",
                              field="resources.gpus", reason="not_enough_gpus")
        queue = body.get("queue", "default")
        if queue not in QUEUES:
            raise ValidationError(f"unknown queue '{queue}'", field="queue", fix=f"use one of: {', '.join(QUEUES)}")
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
        home = self.settings.user_home(owner)
        if account is None:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)  # users may submit before ever starting a server
        workdir = home / cwd
        if not workdir.is_dir():
            raise ValidationError(f"cwd: folder '{cwd}' does not exist in your home", field="cwd", reason="no_folder")
        datasets = [self._resolve_dataset(ds, workdir, f"datasets[{i}]")
                    for i, ds in enumerate(body.get("datasets", []))]
        stem = PurePosixPath(source.get("notebook_path") or "").stem
        name = body.get("name") or (re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-.")[:60] or "job")
        cell_id, sha = cell_sha256(nb)
        source.setdefault("cell_id", cell_id)

        # the job runs on its profile's kernel, whatever the notebook was saved with
        node.metadata["kernelspec"] = {"name": profile.kernel_name, "display_name": profile.display_name,
                                       "language": "python"}
        node.metadata.setdefault("language_info", {"name": "python"})
        if body.get("dry_run"):
            return 200, await self._dry_run(node, params, profile, resources)

        job_id = uuid.uuid4().hex[:12]
        jd = JobDir.create(self.settings.jobs_dir, job_id)
        spec = {
            "id": job_id, "owner": owner, "name": name, "profile": profile.slug, "kernel_name": profile.kernel_name,
            "nproc": resources["nproc"], "gpus": resources["gpus"], "parameters": params, "queue": queue,
            "experiment": body.get("experiment") or f"{owner}/{stem or 'jobs'}",
            "cwd": str(workdir), "home": str(home), "datasets": datasets, "source": source, "cell_sha256": sha,
            # addresses that change between starts (MLflow's port) reach the runner in its environment
            "env": {"HOME": str(home), "USER": owner},
            "run_as": account.to_dict() if account else None,
        }
        try:
            nbformat.write(node, str(jd.input_notebook))
            jd.write_spec(spec)
            for path in (jd.path, jd.input_notebook, jd.spec_file):
                accounts.give(path, account)
            with self.sessions() as s, s.begin():
                s.add(Job(id=job_id, owner=owner, name=name, state=JobState.queued.value, reason="",
                          profile=profile.slug, queue=queue, nproc=resources["nproc"], gpus=resources["gpus"],
                          parameters=params, experiment=spec["experiment"], datasets=datasets, source=source,
                          cwd=cwd, groups=list(groups)))
        except BaseException:
            shutil.rmtree(jd.path, ignore_errors=True)
            raise
        self.log.info("job %s submitted by %s (%s, %s)", job_id, owner, profile.slug, resources)
        await self.schedule()
        with self.sessions() as s:
            return 201, self.to_dict(s.get(Job, job_id))

    async def _dry_run(self, node, params: dict, profile, resources: dict) -> dict:
        from papermill.parameterize import parameterize_notebook

        # what papermill's load_notebook_node does before parameterizing
        node.metadata.setdefault("papermill", {})
        for cell in node.cells:
            cell.metadata.setdefault("tags", [])
        rendered = parameterize_notebook(node, params, report_mode=False, kernel_name=profile.kernel_name,
                                         language="python") if params else node
        with self.sessions() as s:
            snapshot = self._snapshot(s)
            queued = self._queued(s)
        probe = Candidate(id="(dry run)", gpus=resources["gpus"], nproc=resources["nproc"])
        plan = self.scheduler.plan(snapshot, queued + [probe])
        admitted = probe.id in plan.admit
        return {"dry_run": True, "admitted": admitted,
                "reason": "would start now" if admitted else plan.waiting.get(probe.id, "would wait"),
                "queue_position": plan.positions.get(probe.id), "profile": profile.slug, "resources": resources,
                "notebook": dict(rendered)}

    # admission -------------------------------------------------------------------
    def _snapshot(self, s) -> Snapshot:
        running_cpu = s.scalar(select(func.count()).select_from(Job).where(
            Job.state == JobState.running.value, Job.gpus == 0)) or 0
        return Snapshot(free_gpus=len(self.ledger.free(s)), total_gpus=self.ledger.total,
                        running_cpu_jobs=running_cpu, max_cpu_jobs=self.settings.jobs["max_running_cpu_jobs"])

    def _queued(self, s) -> list[Candidate]:
        rows = s.execute(select(Job.id, Job.gpus, Job.nproc, Job.queue).where(
            Job.state == JobState.queued.value).order_by(Job.created_at, Job.id))
        return [Candidate(id=r.id, gpus=r.gpus, nproc=r.nproc, queue=r.queue) for r in rows]

    async def schedule(self) -> None:
        """One admission pass: start every queued job that fits now."""
        if self._stopping:
            return
        async with self._lock:
            starts = []
            with self.sessions() as s, s.begin():
                plan = self.scheduler.plan(self._snapshot(s), self._queued(s))
                for job_id in plan.admit:
                    job = s.get(Job, job_id)
                    devices = self.ledger.allocate(s, "job", job_id, job.owner, job.gpus)
                    if devices is None:  # changed under us; next pass
                        continue
                    job.state = transition(job.state, JobState.running).value
                    job.reason = ""
                    job.started_at = job.started_at or utcnow()
                    attempt = Attempt(number=len(job.attempts) + 1, state="running", devices=devices)
                    job.attempts.append(attempt)
                    starts.append({"id": job.id, "attempt": attempt.number, "devices": devices, "nproc": job.nproc,
                                   "kernel_name": self.profiles.get(job.profile).kernel_name})
                self.plan = plan
            for start in starts:
                await self._start(start)

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

    async def finalize(self, job_id: str, outcome: Outcome) -> None:
        """Record how an attempt ended (idempotent) and free what it held."""
        if job_id in self._cancelling and outcome.state != "cancelled":
            return  # cancel() records the outcome itself
        async with self._lock:
            with self.sessions() as s, s.begin():
                job = s.get(Job, job_id)
                if job is None or job.state != JobState.running.value:
                    return
                state = outcome.state if outcome.state in ("succeeded", "failed", "cancelled") else "failed"
                attempt = job.attempts[-1] if job.attempts else None
                if attempt is not None:
                    attempt.state, attempt.reason = state, outcome.reason
                    attempt.exit_code, attempt.finished_at = outcome.exit_code, utcnow()
                self.ledger.release(s, "job", job_id)
                job.state = transition(job.state, state).value
                job.reason = outcome.reason
                job.finished_at = utcnow()
                run = self.run_info(job)
                job.mlflow_run_id = outcome.mlflow_run_id or run.get("run_id") or job.mlflow_run_id
                if run.get("experiment_id"):
                    job.backend_state = {**job.backend_state, "mlflow_experiment_id": run["experiment_id"]}
            self.log.info("job %s %s%s", job_id, state, f": {outcome.reason}" if outcome.reason else "")
        self._mark_ended(job_id)
        await self.schedule()

    async def cancel(self, principal, job_id: str) -> dict:
        job = self.get(principal, job_id, write=True)
        if JobState(job.state) in FINAL:
            transition(job.state, JobState.cancelled)  # raises 409 with the reason
        who = principal.name
        if job.state == JobState.queued.value:
            async with self._lock:
                with self.sessions() as s, s.begin():
                    row = s.get(Job, job_id)
                    row.state = transition(row.state, JobState.cancelled).value
                    row.reason = f"cancelled by {who} while queued"
                    row.finished_at = utcnow()
            self._mark_ended(job_id)
        else:
            self._cancelling.add(job_id)
            try:
                await self.backend.cancel(job_id, job.backend_state, self.settings.jobs["grace_period_seconds"])
                await self.finalize(job_id, Outcome("cancelled", f"cancelled by {who}"))
            finally:
                self._cancelling.discard(job_id)
            watcher = self._watchers.pop(job_id, None)
            if watcher is not None:
                watcher.cancel()
        await self.schedule()
        with self.sessions() as s:
            return self.to_dict(s.get(Job, job_id))

    # restarts -------------------------------------------------------------------
    async def recover(self) -> None:
        """Re-attach to jobs that were running when the service stopped."""
        with self.sessions() as s:
            running = list(s.scalars(select(Job).where(Job.state == JobState.running.value)))
        for job in running:
            self.backend.load_state(job.id, job.backend_state)
            self.log.info("re-attaching to running job %s", job.id)
            self._watch(job.id, job.backend_state)
        await self.schedule()

    async def run_forever(self, interval: float = 2.0) -> None:
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.schedule()
            except Exception:
                self.log.exception("admission pass failed")

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._watchers.values()):
            task.cancel()
        await self.backend.shutdown()

    # notebook servers ----------------------------------------------------------
    async def allocate_server(self, holder: str, owner: str, gpus: int) -> list[int]:
        async with self._lock:
            with self.sessions() as s, s.begin():
                self.ledger.release(s, "server", holder)
                devices = self.ledger.allocate(s, "server", holder, owner, gpus)
                if devices is None:
                    free = len(self.ledger.free(s))
                    from danlu.errors import Conflict

                    raise Conflict(f"{gpus} GPUs asked for the server, {free} of {self.ledger.total} free",
                                   reason="gpus_busy", field="gpus", fix="pick fewer GPUs or wait for jobs to finish")
        return devices

    async def release_server(self, holder: str) -> None:
        async with self._lock:
            with self.sessions() as s, s.begin():
                self.ledger.release(s, "server", holder)
        await self.schedule()
