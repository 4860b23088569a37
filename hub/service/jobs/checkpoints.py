"""A job's checkpoints as the service knows them: the last one its runner reported, and requests to save now.

The job's code saves its own checkpoints (``danlu.resumable``, or plain code in ``$DANLU_CHECKPOINT_DIR``); after
each committed one, rank 0 tells the runner API ``{"event": "checkpoint", "step": N}`` (:func:`step_of` checks
it). The service keeps only the last one on the job's row -- its step, when the service heard of it (the
service's clock, not the job's) and the attempt that saved it -- so it outlives the attempt and a restart of
the service. It shows in the job's view (:func:`view`), in the reason of a preemption (:func:`resumes`), and
as data for the admission model, which prefers as victims the jobs that would lose the least work
(:attr:`~danlu.hub.service.admission.workloads.Workload.checkpointed_at`). ``POST /jobs/{id}/checkpoint``
counts a request to save now (:func:`request_save`); the job's code sees the count in the runner API's
``GET .../stop`` (``save``) and saves when it grows.
"""

from __future__ import annotations

import datetime as dt

from danlu.errors import Conflict, UsageError
from danlu.hub.service.store import audit
from danlu.hub.service.store.orm import Attempt, Job, utcnow

MAX_STEP = 2**53  # what every JSON reader holds exactly
EVENT_FIELDS = frozenset({"event", "step"})


def step_of(body: dict) -> int:
    """The step of a ``checkpoint`` event; a 400 naming the field otherwise (the attempt is not failed for it:
    telling the service is best effort, the checkpoint itself is saved)."""
    extra = sorted(set(body) - EVENT_FIELDS)
    if extra:
        raise UsageError(
            f"a checkpoint event has no field '{str(extra[0])[:40]}'",
            field=str(extra[0])[:40],
            reason="invalid_field",
            fix='send {"event": "checkpoint", "step": <the step it saved>}',
        )
    step = body.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise UsageError(
            f"step must be a whole number from 0 to {MAX_STEP}, got {str(step)[:40]}",
            field="step",
            reason="invalid_field",
            fix="send the step of the checkpoint just saved",
        )
    return step


def record(job: Job, attempt: Attempt, step: int) -> dict:
    """Keep ``step`` as the job's last checkpoint, saved now by ``attempt`` (in the caller's transaction)."""
    job.checkpoint = {"step": step, "saved_at": utcnow().isoformat(), "attempt": attempt.number}
    return job.checkpoint


def saved_at(job) -> dt.datetime | None:
    """When the service heard of the job's last checkpoint (naive UTC, as the database keeps times)."""
    data = job.checkpoint if isinstance(job.checkpoint, dict) else None
    if not data or not isinstance(data.get("saved_at"), str):
        return None
    try:
        return dt.datetime.fromisoformat(data["saved_at"])
    except ValueError:
        return None


def view(job, final: bool) -> dict | None:
    """The job view's ``checkpoint``: its step, its age in seconds (until now; for a job that ended, until it
    ended, so that an ended job's view stays the same) and the attempt that saved it; None if none."""
    when = saved_at(job)
    if when is None:
        return None
    until = (job.finished_at if final else None) or utcnow()
    return {
        "step": int(job.checkpoint.get("step") or 0),
        "age_seconds": round(max(0.0, (until - when).total_seconds()), 3),
        "attempt": int(job.checkpoint.get("attempt") or 0),
    }


def resumes(job: Job) -> str | None:
    """Where a preempted job resumes, for its reason: ``resumes from its checkpoint at step N``; None if it
    reported no checkpoint."""
    if saved_at(job) is None or not isinstance(job.checkpoint, dict):
        return None
    return f"resumes from its checkpoint at step {int(job.checkpoint.get('step') or 0)}"


def request_save(s, job_id: str, who: str) -> int:
    """Count a request that the running job ``job_id`` save now (audited); the number of requests so far."""
    job = s.get(Job, job_id)
    if job is None or job.state != "running":
        state = job.state if job is not None else "gone"
        raise Conflict(
            f"job {job_id} is {state}: only a running job can save a checkpoint",
            reason="not_running",
            fix="ask again once it runs (danlu jobs show JOB says its state); a preempted job saves on its own",
        )
    job.save_requests = (job.save_requests or 0) + 1
    audit.append(
        s, who, "checkpoint", job_id, before={"save": job.save_requests - 1}, after={"save": job.save_requests}
    )
    return job.save_requests
