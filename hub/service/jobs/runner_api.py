"""The runner API: the one channel through which a running job tells the service anything.

A runner authenticates every call with its attempt's job token (the service
keeps only its sha256, cleared when the attempt ends), which binds it to one
attempt of one job: it can fetch that attempt's spec, ask why it is being
stopped (and whether its owner asked it to save now), report that it saved a checkpoint
(:mod:`~.checkpoints`), report its MLflow run, what only the job knows of its provenance
(the seed its code set, git's dirty state, a plain dataset's digest:
:func:`~.provenance.merge_report`) and how it ended, and -- for
``danlu.dataset`` in its code -- resolve a catalog version as the job's owner
(whose name and groups come from the job's row, never from the request),
which is recorded as a use of the version. Nothing it sends can change who or
what runs, or any other job's record. Reports are validated
against the OpenAPI document (``RunnerEvent``); an authenticated runner that
sends something invalid gets a 422 and its attempt fails with a reason that
says so, unless a valid report follows.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from pathlib import Path

from sqlalchemy import select

from danlu.digests import TRAINING
from danlu.errors import Conflict, DanluError, Forbidden, Unreachable, ValidationError
from danlu.hub.backends.base import Backend
from danlu.hub.service import jsonbody, validation
from danlu.hub.service.auth import Principal
from danlu.hub.service.datasets.catalog import Catalog, manifest_of, record_uses
from danlu.hub.service.formats import JOB_TOKEN
from danlu.hub.service.jobs import checkpoints, outputs, provenance
from danlu.hub.service.jobs.attempts import ACTIVE_STATES, admit, handed_over
from danlu.hub.service.jobs.supervisor import Supervisor
from danlu.hub.service.mlflow_client import EVALUATIONS, run_tags
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Job, JobInput

log = logging.getLogger("danlu.jobs")

REFUSED = "this token does not belong to a running attempt of this job"
TOKEN_FIX = "the runner API is for a job's runner, with 'Authorization: Bearer <its attempt's job token>'"


class RunnerApi:
    def __init__(
        self,
        supervisor: Supervisor,
        datasets: Catalog,
        *,
        database: Database,
        backend: Backend,
        settings,
        profiles,
        mlflow,
    ):
        self.supervisor = supervisor
        self.datasets = datasets
        self.database = database
        self.backend = backend
        self.settings = settings
        self.profiles = profiles
        self.mlflow = mlflow
        self.outputs = outputs.OutputStore(settings.state_dir, database)

    async def spec(self, job_id: str, attempt: int, token: str) -> dict:
        digest = _hash(token)
        # the notebook is read and parsed on a reader thread; the writer only notes the first fetch
        spec = await self.database.read(_spec, job_id, attempt, digest)
        if not spec.pop("fetched"):
            await self.database.write(_fetched, job_id, attempt, digest)
        owner = spec["owner"]
        home = self.backend.user_home(owner) or str(self.settings.user_home(owner))
        spec.update(
            {
                "kernel_name": self.profiles.get(spec["profile"]).kernel_name,
                "cwd": str(Path(home) / spec["cwd_relative"]),
                "env": {"HOME": home, "USER": owner},
                "mlflow_env": await self._open_run(spec, digest) if self.mlflow is not None else {},
            }
        )
        return spec

    async def _open_run(self, spec: dict, digest: str) -> dict:
        """The job's run, made by the service (the first attempt's; later ones resume it), and this attempt's
        credentials for it alone; recorded as the job's run, the only one its reports may name. MLflow away
        or refusing: the job runs untracked, and its tracking notes say why."""
        if not self.mlflow.tracking_uri:
            return {}
        known = spec["tracking"]
        parameters = spec["parameters"] if isinstance(spec["parameters"], dict) else {}
        evaluated = parameters.get("model_name") if spec["experiment"].startswith(EVALUATIONS) else None
        try:
            opened = await self.mlflow.open_run(
                spec["job_id"],
                spec["attempt"],
                spec["owner"],
                spec["experiment"],
                known.get("run_id"),
                run_tags(spec),
                models=[evaluated] if isinstance(evaluated, str) else [],
            )
        except (Unreachable, DanluError) as e:
            log.warning("job %s: its MLflow run was not opened: %s", spec["job_id"], e)
            return {"MLFLOW_TRACKING_URI": self.mlflow.tracking_uri} if self.mlflow.tracking_uri else {}
        spec["tracking"] = {"run_id": opened["run_id"], "experiment_id": opened["experiment_id"]}
        await self.database.write(_set_run, spec["job_id"], spec["attempt"], digest, spec["tracking"])
        return opened["env"]

    async def sweep(self) -> None:
        """At start-up: the MLflow users of attempts that ended while the service was away are deleted."""
        if self.mlflow is None:
            return

        def running(s):  # as _attempt accepts them: active, or handed over to a backend's queue
            jobs = s.scalars(select(Job).where(Job.state.in_((*ACTIVE_STATES, "queued"))))
            return {(j.id, j.attempts[-1].number) for j in jobs if j.attempts and _live(j)}

        try:
            gone = await self.mlflow.sweep(await self.database.read(running))
        except (Unreachable, DanluError) as e:
            log.warning("the MLflow users of ended attempts were not swept: %s", e)
            return
        if gone:
            log.info("deleted the MLflow users of %d attempts that ended while the service was away", gone)

    async def expire(self, job_id: str, attempt: int, run_id: str | None) -> None:
        """The attempt ended: its MLflow credentials stop working."""
        if self.mlflow is not None:
            await self.mlflow.expire(job_id, attempt, run_id)

    async def stop(self, job_id: str, attempt: int, token: str) -> dict:
        """Why the attempt is being stopped and its grace, and ``save``: how many times its owner asked it to
        save a checkpoint now (its code saves when the number grows)."""
        reason, grace, save = await self.database.read(_stop, job_id, attempt, _hash(token))
        return {"reason": reason or None, "grace": grace, "save": save}

    async def output(self, job_id: str, attempt: int, token: str, rank: int, body: bytes) -> dict:
        """Keep rank ``rank``'s executed notebook, from a runner whose folder the service cannot read (a pod)."""
        nproc, owner = await self.database.read(_nproc, job_id, attempt, _hash(token))
        if rank >= nproc:
            raise ValidationError(f"job {job_id} has ranks 0-{nproc - 1}", field="rank", reason="no_such_rank")
        notebook = await asyncio.to_thread(jsonbody.parse_json, body, max_bytes=validation.MAX_OUTPUT)
        if not isinstance(notebook, dict) or not isinstance(notebook.get("cells"), list):
            raise ValidationError("the output is not a notebook (a JSON object with a list of cells)", field="body")
        await self.outputs.keep(job_id, owner, rank, body)  # within the owner's bound (413 beyond)
        return {"kept": len(body)}

    async def event(self, job_id: str, attempt: int, token: str, body) -> dict:
        digest = _hash(token)
        await self.database.read(_check, job_id, attempt, digest)
        if isinstance(body, dict) and body.get("event") == "checkpoint":  # a bad one is refused, never fails it
            saved = await self.database.write(_checkpoint, job_id, attempt, digest, checkpoints.step_of(body))
            self.supervisor.checkpointed(job_id, saved)
            return {"recorded": "checkpoint"}
        try:
            validation.check_schema("RunnerEvent", body)
        except ValidationError as e:
            await self.database.write(_invalid, job_id, attempt, digest, str(e))
            raise
        await self.database.write(_record, job_id, attempt, digest, body)
        if body["event"] == "finished":
            self.supervisor.reap_after_report(job_id, attempt)
        return {"recorded": body["event"]}

    async def owner(self, job_id: str, attempt: int, token: str) -> Principal:
        """The job's owner as a principal with no scopes (a job gets no admin's override), if the token is this
        attempt's; their groups are looked up again when they are needed, the job's own as the fallback."""
        owner, groups = await self.database.read(_owner, job_id, attempt, _hash(token))
        return Principal(name=owner, kind="user", groups=tuple(groups))

    async def dataset(self, job_id: str, attempt: int, token: str, owner: Principal, body) -> dict:
        """``danlu.dataset`` in a job: the version ``body["ref"]`` as the owner may read it, its manifest to
        verify against, and a recorded use. The token was checked (:meth:`owner`) before the body was read."""
        validation.check_schema("RunnerDatasetRequest", body)
        entry = await self.datasets.resolve(owner, body["ref"], "ref")
        context = body.get("context", TRAINING)
        manifest = await self.database.read(manifest_of, entry["dataset"], entry["version"])
        await self.database.write(_use, job_id, attempt, _hash(token), {**entry, "context": context})
        return {
            "ref": entry["name"],
            "dataset": entry["dataset"],
            "version": entry["version"],
            "digest": entry["digest"],
            "path": entry["path"],
            "context": context,
            "manifest": manifest,
        }


def _hash(token: str) -> str:
    if not isinstance(token, str) or not JOB_TOKEN.match(token):
        raise DanluError(REFUSED, status=401, reason="bad_job_token", fix=TOKEN_FIX)
    return hashlib.sha256(token.encode()).hexdigest()


def _attempt(s, job_id: str, number: int, digest: str):
    job = s.get(Job, job_id)
    attempt = job.attempts[-1] if job is not None and job.attempts else None
    if (
        attempt is None
        or not (job.state in ACTIVE_STATES or handed_over(job))
        or attempt.number != number
        or not attempt.token_hash
        or not hmac.compare_digest(attempt.token_hash, digest)
    ):
        raise Forbidden(REFUSED, reason="bad_job_token", fix=TOKEN_FIX)
    if handed_over(job):  # its runner runs: the backend's queue admitted it before the watcher saw that
        admit(s, job_id, number)
    return job, attempt


def _live(job: Job) -> bool:
    return job.state in ACTIVE_STATES or handed_over(job)


def _check(s, job_id: str, number: int, digest: str) -> None:
    _attempt(s, job_id, number, digest)


def _owner(s, job_id: str, number: int, digest: str) -> tuple[str, list]:
    job, _attempt_row = _attempt(s, job_id, number, digest)
    return job.owner, [g for g in job.groups or [] if isinstance(g, str)]


def _use(s, job_id: str, number: int, digest: str, entry: dict) -> None:
    _attempt(s, job_id, number, digest)  # still this attempt's, in the transaction that records the use
    record_uses(s, job_id, number, [entry])


def _nproc(s, job_id: str, number: int, digest: str) -> tuple[int, str]:
    """The job's ranks (processes on every node) and its owner."""
    job, _attempt_row = _attempt(s, job_id, number, digest)
    return int(job.nproc) * int(job.nnodes or 1), job.owner


def _spec(s, job_id: str, number: int, digest: str) -> dict:
    found = s.get(Job, job_id)
    admitting = found is not None and handed_over(found)  # the write (_fetched) records the admission
    job, attempt = _attempt(s, job_id, number, digest)
    notebook = s.get(JobInput, job_id)
    if notebook is None:
        raise DanluError(f"job {job_id} has no notebook on record", status=409, reason="no_input")
    tracking = job.tracking if isinstance(job.tracking, dict) else {}
    return {
        "fetched": bool((job.backend_state or {}).get("spec_fetched")) and not admitting,
        "job_id": job.id,
        "attempt": attempt.number,
        "name": job.name,
        "owner": job.owner,
        "profile": job.profile,
        "nproc": job.nproc,
        "nnodes": job.nnodes,
        "gpus": job.gpus // max(1, job.nnodes),  # per node
        "devices": list(attempt.devices or []),
        "queue": job.queue,
        "parameters": job.parameters,
        "notebook": json.loads(notebook.notebook),
        "cwd_relative": job.cwd,
        "datasets": [
            {**d, "manifest": manifest_of(s, d["dataset"], d["version"])} if d.get("dataset") else d
            for d in job.datasets or []
        ],
        "experiment": job.experiment,
        "source": job.source,
        "cell_sha256": job.cell_sha256,
        "environment": (job.provenance or {}).get("environment") if isinstance(job.provenance, dict) else None,
        "tracking": {
            "run_id": tracking.get("run_id") or job.mlflow_run_id,
            "experiment_id": tracking.get("experiment_id"),
        },
    }


def _fetched(s, job_id: str, number: int, digest: str) -> None:
    job, _attempt_row = _attempt(s, job_id, number, digest)
    job.backend_state = {**(job.backend_state or {}), "spec_fetched": True}


def _stop(s, job_id: str, number: int, digest: str) -> tuple[str, float, int]:
    job, attempt = _attempt(s, job_id, number, digest)
    reason = attempt.stop_reason or ("preempted" if job.state == "preempted" else "")
    return reason, float(attempt.stop_grace or 0.0), int(job.save_requests or 0)


def _checkpoint(s, job_id: str, number: int, digest: str, step: int) -> dict:
    job, attempt = _attempt(s, job_id, number, digest)
    return checkpoints.record(job, attempt, step)


def _set_run(s, job_id: str, number: int, digest: str, known: dict) -> None:
    job, _attempt_row = _attempt(s, job_id, number, digest)
    tracking = job.tracking if isinstance(job.tracking, dict) else {}
    job.tracking = {**tracking, **known}
    job.mlflow_run_id = known["run_id"]


def _tracking(job: Job, data: dict) -> dict:
    """What a runner reports of its tracking, about the run the service made for the job and no other:
    a report naming another run is refused (409), so no job can claim a run it did not make."""
    run_id = data.get("run_id")
    if run_id and run_id != job.mlflow_run_id:
        raise Conflict(
            f"run {str(run_id)[:40]} is not job {job.id}'s MLflow run"
            + (f" ({job.mlflow_run_id})" if job.mlflow_run_id else " (the service made none)"),
            reason="not_this_jobs_run",
            field="run_id",
            fix="a job reports the run the service made for it (its spec's tracking.run_id)",
        )
    out = {k: data.get(k) for k in ("points_sent", "points_dropped", "notes")}
    return {**out, "run_id": job.mlflow_run_id, "experiment_id": (job.tracking or {}).get("experiment_id")}


def _record(s, job_id: str, number: int, digest: str, body: dict) -> None:
    job, attempt = _attempt(s, job_id, number, digest)
    if body["event"] == "tracking":
        job.tracking = _tracking(job, body)
    elif body["event"] == "provenance":
        job.provenance = provenance.merge_report(job.provenance, body)
    else:
        tracking = _tracking(job, body["tracking"]) if body.get("tracking") else None
        attempt.report = {k: body.get(k) for k in ("state", "reason", "exit_code", "infrastructure", "notes")}
        if tracking is not None:
            job.tracking = tracking


def _invalid(s, job_id: str, number: int, digest: str, problem: str) -> None:
    _job, attempt = _attempt(s, job_id, number, digest)
    report = attempt.report if isinstance(attempt.report, dict) else {}
    if not report.get("state"):
        attempt.report = {
            "state": "failed",
            "reason": f"the job sent an invalid report ({problem[:300]})",
            "infrastructure": False,
            "exit_code": None,
            "notes": [],
        }
