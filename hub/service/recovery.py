"""Stopping the workbench without losing jobs (or leaving GPUs held).

When ``danlu up`` stops, every process it started must end -- running jobs
included. :func:`interrupt_running_jobs` ends each running job's process tree
and puts the job back in the queue with the interrupted attempt kept in its
history, so the next ``danlu up`` runs it again (a job that checkpoints to
``$DANLU_CHECKPOINT_DIR`` resumes from there). It works on the jobs database
directly because the jobs service has already stopped by then.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, select

from danlu import proctree
from danlu.hub.service.ledger import Ledger
from danlu.hub.service.models import Allocation, Job, ServerUsage, make_sessionmaker, utcnow
from danlu.hub.service.states import JobState, transition
from danlu.jobdir import JobDir

log = logging.getLogger(__name__)


def interrupt_running_jobs(settings, grace: float | None = None) -> list[str]:
    grace = settings.jobs["grace_period_seconds"] if grace is None else grace
    sessions = make_sessionmaker(settings.jobs_database_url)
    interrupted = []
    with sessions() as s, s.begin():
        for job in s.scalars(select(Job).where(Job.state.in_([JobState.running.value, JobState.preempted.value]))):
            state = job.backend_state or {}
            proctree.kill_matching(state.get("pid"), state.get("create_time"), {"DANLU_JOB_ID": job.id}, grace=grace)
            jd = JobDir(settings.jobs_dir / job.id)
            status = jd.status()
            attempt = job.attempts[-1] if job.attempts else None
            ended = bool(status) and (status.get("state") in ("succeeded", "cancelled") or (
                status.get("state") == "failed" and not status.get("infrastructure")))
            if job.state == JobState.running.value and ended:
                # it ended on its own just before we stopped: record that, do not run it again
                job.state = transition(job.state, status["state"]).value
                job.reason = status.get("reason", "")
                job.finished_at = utcnow()
                job.mlflow_run_id = status.get("mlflow_run_id") or job.mlflow_run_id
                if attempt is not None:
                    attempt.state, attempt.reason, attempt.finished_at = job.state, job.reason, utcnow()
            else:
                if attempt is not None:
                    attempt.state = "failed"
                    attempt.reason = "interrupted: the workbench stopped"
                    attempt.finished_at = utcnow()
                job.state = transition(job.state, JobState.queued).value
                job.reason = "interrupted when the workbench stopped; runs again at the next start"
                interrupted.append(job.id)
                job.queued_at = utcnow()
            Ledger([]).release(s, "job", job.id)
        # every server has stopped with the hub: the GPUs they held are free again
        s.execute(delete(Allocation).where(Allocation.holder_kind == "server"))
        for row in s.scalars(select(ServerUsage).where(ServerUsage.ended_at.is_(None))):
            row.ended_at = utcnow()
    for job_id in interrupted:
        log.info("job %s interrupted and requeued", job_id)
    return interrupted
