"""What the API says about a job: its JSON model, and small helpers on job notebooks."""

from __future__ import annotations

import hashlib
import re

from danlu.hub.service.models import Job, isoformat, utcnow
from danlu.jobdir import read_json

JOB_ID = re.compile(r"^[0-9a-f]{12}$")


def cell_sha256(nb: dict) -> tuple[str, str]:
    """(cell id, sha256 of its source) of the job's cell: tagged ``danlu-cell``, else the last code cell."""
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    tagged = [c for c in code if "danlu-cell" in c.get("metadata", {}).get("tags", [])]
    cell = (tagged or code)[-1]
    source = cell.get("source", "")
    source = "".join(source) if isinstance(source, list) else source
    return cell.get("id", ""), hashlib.sha256(source.encode()).hexdigest()


def job_to_dict(manager, job: Job) -> dict:
    settings = manager.settings
    base = f"{settings.public_url}/services/danlu/api/v1/jobs/{job.id}"
    run = read_json(manager.jobdir(job.id).run_file) or {} if job.mlflow_run_id is None or job.state == "running" \
        else {}
    run_id = job.mlflow_run_id or run.get("run_id")
    experiment_id = job.backend_state.get("mlflow_experiment_id") or run.get("experiment_id")
    attempts = [{
        "number": a.number, "state": a.state, "reason": a.reason, "failure": a.failure or None,
        "devices": list(a.devices or []), "gpu_type": a.flavor, "exit_code": a.exit_code,
        "started_at": isoformat(a.started_at), "finished_at": isoformat(a.finished_at),
    } for a in job.attempts]
    end = job.finished_at or (utcnow() if job.state in ("running", "preempted") else None)
    reason = job.reason
    estimate = None
    if job.state == "queued":
        reason = manager.plan.waiting.get(job.id, reason or "waiting for admission")
        if job.id in manager.estimates:
            import datetime as dt

            estimate = isoformat(dt.datetime.fromtimestamp(manager.estimates[job.id], dt.timezone.utc)
                                 .replace(tzinfo=None))
    running = job.attempts[-1] if job.attempts and job.state in ("running", "preempted") else None
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "state": job.state, "reason": reason,
        "failure": job.failure or None, "profile": job.profile, "queue": job.queue,
        "priority": job.priority_class or None, "priority_value": job.priority,
        "resources": {"nproc": job.nproc, "gpus": job.gpus, "gpu_type": job.gpu_type, "cpu": job.cpu,
                      "memory": job.memory},
        "retries": job.retries, "timeout_seconds": job.timeout_seconds,
        "parameters": job.parameters, "experiment": job.experiment,
        "datasets": [d["name"] for d in job.datasets], "source": job.source,
        "devices": list(running.devices or []) if running else [],
        "attempts": attempts,
        "created_at": isoformat(job.created_at), "started_at": isoformat(job.started_at),
        "finished_at": isoformat(job.finished_at), "retry_at": isoformat(job.not_before),
        "elapsed_seconds": round((end - job.started_at).total_seconds(), 3) if job.started_at and end else None,
        "queue_position": manager.plan.positions.get(job.id) if job.state == "queued" else None,
        "estimated_start": estimate,
        "mlflow_run_id": run_id,
        "mlflow_run_url": (f"{settings.public_url}/services/mlflow/#/experiments/{experiment_id}/runs/{run_id}"
                           if run_id and experiment_id else None),
        "output_url": f"{base}/output", "logs_url": f"{base}/logs",
        # where TensorBoard finds the job's event files (the lab extension's TensorBoard tabs read it)
        "tensorboard_dir": str(manager.jobdir(job.id).tensorboard_dir.absolute()),
        "runner": ("warm" if job.backend_state.get("warm") else "cold") if "pid" in job.backend_state else None,
    }
