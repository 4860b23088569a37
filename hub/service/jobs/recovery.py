"""Stopping the workbench without losing jobs (or leaving GPUs held).

When ``danlu up`` stops, every process it started must end -- running jobs
included. :func:`interrupt_running_jobs` ends each running attempt's
processes and puts its job back in the queue with the interrupted attempt
kept in its history, so the next ``danlu up`` runs it again (a job that
checkpoints to ``$DANLU_CHECKPOINT_DIR`` resumes from there). An attempt
whose runner had just reported success, a cancel or an error in the user's
code keeps that outcome instead. It works on the jobs database directly
because the jobs service has already stopped by then; every job is handled
in a transaction of its own, so one malformed row cannot keep the others
running.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, select

from danlu import env, proctree
from danlu.hub.service.states import ACTIVE, JobState, transition
from danlu.hub.service.store.database import make_sessionmaker
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Allocation, Job, ServerUsage, utcnow

log = logging.getLogger(__name__)
ACTIVE_STATES = [s.value for s in ACTIVE]


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _end_processes(job_id: str, state: dict, grace: float) -> None:
    created = state.get("create_time")
    markers = [{env.JOB_ID: job_id}]
    if isinstance(state.get("runner_id"), str):
        markers.append({env.RUNNER_ID: state["runner_id"]})
    proctree.kill_matching(
        _int(state.get("pid")),
        created if isinstance(created, (int, float)) else None,
        markers,
        grace=grace,
        uid=_int(state.get("uid")),
    )
    proctree.kill_cgroup(state.get("cgroup"))  # a local attempt's cgroup: what detached from both


def _interrupt(s, job_id: str) -> bool:
    """Record how one running job's attempt ended; True if it goes back to the queue."""
    job = s.get(Job, job_id)
    if job is None or job.state not in ACTIVE_STATES:
        return False
    attempt = job.attempts[-1] if job.attempts else None
    report = attempt.report if attempt is not None and isinstance(attempt.report, dict) else {}
    ended = report.get("state") in ("succeeded", "cancelled") or (
        report.get("state") == "failed" and not report.get("infrastructure")
    )
    now = utcnow()
    requeued = False
    if job.state == JobState.running.value and ended:
        # it ended on its own just before we stopped: record that, do not run it again
        state = report["state"]
        job.state = transition(job.state, state).value
        job.reason = str(report.get("reason") or "")
        if state == "failed":
            job.reason, job.failure = f"error in your code: {job.reason}", "user"
        job.finished_at = now
        if attempt is not None:
            attempt.state, attempt.reason, attempt.finished_at = state, job.reason, now
    else:
        if attempt is not None:
            attempt.state, attempt.reason, attempt.finished_at = "failed", "interrupted: the workbench stopped", now
        job.state = transition(job.state, JobState.queued).value
        job.reason = "interrupted when the workbench stopped; runs again at the next start"
        job.queued_at = now
        requeued = True
    if attempt is not None:
        attempt.token_hash = ""
    tracking = job.tracking if isinstance(job.tracking, dict) else {}
    job.mlflow_run_id = tracking.get("run_id") if isinstance(tracking.get("run_id"), str) else job.mlflow_run_id
    Ledger([]).release(s, "job", job.id)
    return requeued


def interrupt_running_jobs(settings, grace: float | None = None) -> list[str]:
    grace = settings.jobs.grace_period_seconds if grace is None else grace
    sessions = make_sessionmaker(settings.jobs_database_url)
    with sessions() as s:
        running = [(j.id, j.backend_state) for j in s.scalars(select(Job).where(Job.state.in_(ACTIVE_STATES)))]
    interrupted = []
    for job_id, state in running:
        try:
            _end_processes(job_id, state if isinstance(state, dict) else {}, grace)
        except Exception:  # noqa: BLE001 - the job is requeued all the same; danlu up's last sweep ends the rest
            log.exception("ending the processes of job %s failed", job_id)
        try:
            with sessions() as s, s.begin():
                if _interrupt(s, job_id):
                    interrupted.append(job_id)
        except Exception:  # noqa: BLE001 - one bad row must not keep the other jobs from being requeued
            log.exception("requeuing job %s failed", job_id)
    with sessions() as s, s.begin():
        # every server has stopped with the hub: the GPUs they held are free again
        s.execute(delete(Allocation).where(Allocation.holder_kind == "server"))
        for row in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None))):
            row.ended_at = utcnow()
    for job_id in interrupted:
        log.info("job %s interrupted and requeued", job_id)
    return interrupted
