"""What the API says about a job: its JSON model, and small helpers on job notebooks.

Everything here comes from the database and the admission model: nothing is
read from the job's folder, so a job cannot change what its record says.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re

from danlu.hub.service.models import Job, isoformat, utcnow

JOB_ID = re.compile(r"^[0-9a-f]{12}$")


def cell_sha256(nb: dict) -> tuple[str, str]:
    """(cell id, sha256 of its source) of the job's cell: tagged ``danlu-cell``, else the last code cell."""
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    tagged = [c for c in code if "danlu-cell" in c.get("metadata", {}).get("tags", [])]
    cell = (tagged or code)[-1]
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    return cell.get("id", ""), hashlib.sha256(source.encode()).hexdigest()


def _tracking(job: Job) -> dict:
    """The job's tracking health, as its runner reported it."""
    data = job.tracking if isinstance(job.tracking, dict) else {}
    notes = [n for n in data.get("notes") or [] if isinstance(n, str)][:20]
    run_id = data.get("run_id") or job.mlflow_run_id
    dropped = data.get("points_dropped") or 0
    if run_id is None:
        health = "pending" if job.state in ("queued", "running", "preempted") else "none"
    else:
        health = "degraded" if dropped or notes else "ok"
    return {"state": health, "run_id": run_id, "experiment_id": data.get("experiment_id"),
            "points_sent": data.get("points_sent") or 0, "points_dropped": dropped, "notes": notes}


def inputs_of(job: Job) -> list[dict]:
    """The catalog versions a job named when it was submitted (without those its code asked for later)."""
    return [{"ref": d["name"], "dataset": d["dataset"], "version": d["version"], "digest": d["digest"],
             "context": d.get("context") or "training"}
            for d in job.datasets or [] if d.get("dataset") and d.get("version")]  # a pinned path has a digest too


def job_to_dict(core, job: Job, inputs: list[dict] | None = None) -> dict:
    """The job's API model; ``inputs``: its ``dataset_uses`` (catalog.uses_of_job), else what it was submitted with."""
    settings = core.settings
    base = f"{settings.public_url}/services/danlu/api/v1/jobs/{job.id}"
    tracking = _tracking(job)
    run_id, experiment_id = tracking["run_id"], tracking["experiment_id"]
    attempts = [{
        "number": a.number, "state": a.state, "reason": a.reason, "failure": a.failure or None,
        "devices": list(a.devices or []), "gpu_type": a.flavor, "exit_code": a.exit_code,
        "started_at": isoformat(a.started_at), "finished_at": isoformat(a.finished_at),
    } for a in job.attempts]
    end = job.finished_at or (utcnow() if job.state in ("running", "preempted") else None)
    reason = job.reason
    estimate = None
    state = job.backend_state if isinstance(job.backend_state, dict) else {}
    position = core.plan.positions.get(job.id) if job.state == "queued" else None
    if job.state == "queued" and core.backend.queues:  # the backend's queue answers (Kueue's reason, position)
        reason, position = reason or "waiting for admission", state.get("position")
    elif job.state == "queued":
        reason = core.plan.waiting.get(job.id, reason or "waiting for admission")
        if job.id in core.estimates:
            estimate = isoformat(dt.datetime.fromtimestamp(core.estimates[job.id], dt.timezone.utc)
                                 .replace(tzinfo=None))
    running = job.attempts[-1] if job.attempts and job.state in ("running", "preempted") else None
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "state": job.state, "reason": reason,
        "failure": job.failure or None, "profile": job.profile, "queue": job.queue,
        "priority": job.priority_class or None, "priority_value": job.priority,
        "resources": {"nproc": job.nproc, "nodes": job.nnodes, "gpus": job.gpus, "gpu_type": job.gpu_type,
                      "cpu": job.cpu, "memory": job.memory},
        "retries": job.retries, "timeout_seconds": job.timeout_seconds,
        "parameters": job.parameters, "experiment": job.experiment,
        "datasets": [d["name"] for d in job.datasets], "source": job.source,
        "inputs": inputs if inputs is not None else inputs_of(job),
        "devices": list(running.devices or []) if running else [],
        "attempts": attempts,
        "created_at": isoformat(job.created_at), "started_at": isoformat(job.started_at),
        "finished_at": isoformat(job.finished_at), "retry_at": isoformat(job.not_before),
        "elapsed_seconds": round((end - job.started_at).total_seconds(), 3) if job.started_at and end else None,
        "queue_position": position,
        "estimated_start": estimate,
        "mlflow_run_id": run_id,
        "tracking": tracking,
        "mlflow_run_url": (f"{settings.public_url}/services/mlflow/#/experiments/{experiment_id}/runs/{run_id}"
                           if run_id and experiment_id else None),
        "output_url": f"{base}/output", "logs_url": f"{base}/logs",
        # where the user's own server finds the job's TensorBoard files (the lab extension's tabs), if anywhere
        "tensorboard_dir": core.backend.tensorboard_dir(job.id),
        "runner": ("warm" if state.get("warm") else "cold") if "pid" in state else None,
        "reproduces": job.reproduces,  # the job this one re-runs (POST /jobs/{id}/reproduce)
    }
