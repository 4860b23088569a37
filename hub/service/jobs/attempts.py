"""An attempt's rows: the database work shared by whatever starts, watches, hands over or hears from attempts.

Each function runs on the database's threads with a session (:class:`~danlu.hub.service.store.database.Database`)
and looks only at the job's *current* attempt: news about an earlier attempt of the same job changes nothing.
A *handed-over* attempt is one that a backend with its own queue (Kueue) holds, not yet admitted: its job is
still ``queued``; :func:`admit` makes it the job's running attempt once that queue admits it (or once it ends
before, so that its end can be recorded as any other).
"""

from __future__ import annotations

from sqlalchemy import select

from danlu.hub.service.states import ACTIVE, JobState, transition
from danlu.hub.service.store.orm import Attempt, Job, utcnow

ACTIVE_STATES = [s.value for s in ACTIVE]


def latest(job: Job) -> Attempt | None:
    return job.attempts[-1] if job.attempts else None


def handed(job: Job | None) -> Attempt | None:
    """The current attempt of a queued job that a queueing backend holds (submitted, not yet admitted)."""
    attempt = latest(job) if job is not None else None
    if (
        job is None
        or attempt is None
        or job.state != JobState.queued.value
        or attempt.finished_at is not None
        or attempt.state != JobState.queued.value
    ):
        return None
    return attempt


def _handed(job: Job | None, number: int | None) -> Attempt | None:
    """:func:`handed`, if it is attempt ``number``."""
    attempt = handed(job)
    return attempt if attempt is not None and attempt.number == number else None


def handed_over(job: Job) -> bool:
    """A queued job whose current attempt a queueing backend holds (submitted, not yet admitted)."""
    return handed(job) is not None


def handed_state(s, job_id: str, number: int | None) -> dict | None:
    """The backend state of a job a queueing backend holds with attempt ``number``, not yet admitted."""
    job = s.get(Job, job_id)
    return dict(job.backend_state or {}) if _handed(job, number) is not None else None


def queued_answer(s, job_id: str, number: int | None, reason: str, position: int | None) -> None:
    job = s.get(Job, job_id)
    if _handed(job, number) is not None:
        job.reason = reason or job.reason
        job.backend_state = {**(job.backend_state or {}), "position": position}


def admit(s, job_id: str, number: int | None) -> bool:
    """The backend's queue admitted the attempt (or its runner already runs): the job is running."""
    job = s.get(Job, job_id)
    attempt = _handed(job, number)
    if attempt is None:
        return False
    job.state = transition(job.state, JobState.running).value
    job.reason = ""
    job.started_at = job.started_at or utcnow()
    attempt.state = JobState.running.value
    attempt.started_at = utcnow()
    job.backend_state = {k: v for k, v in (job.backend_state or {}).items() if k != "position"}
    return True


def save_state(s, job_id: str, attempt: int, state: dict) -> None:
    job = s.get(Job, job_id)
    current = latest(job) if job is not None else None
    if (
        job is not None
        and current is not None
        and current.number == attempt
        and (job.state in ACTIVE_STATES or handed_over(job))
    ):
        job.backend_state = {**(job.backend_state or {}), **state}


def state_of(s, job_id: str, number: int | None = None) -> dict | None:
    """The backend state of the job's current attempt (of attempt ``number``, if still current), while active."""
    job = s.get(Job, job_id)
    if job is None or job.state not in ACTIVE_STATES:
        return None
    attempt = latest(job)
    if number is not None and (attempt is None or attempt.number != number or attempt.finished_at is not None):
        return None
    return dict(job.backend_state or {})


def set_stop(s, job_id: str, why: str, grace: float, number: int | None = None) -> None:
    job = s.get(Job, job_id)
    attempt = latest(job) if job is not None else None
    if attempt is not None and attempt.finished_at is None and number in (None, attempt.number):
        attempt.stop_reason, attempt.stop_grace = why, float(grace)


def abandon(s, job_id: str) -> None:
    job = s.get(Job, job_id)
    attempt = latest(job) if job is not None else None
    if attempt is not None:
        attempt.token_hash = ""  # its runner API calls are refused from now on


def active(s, queued_too: bool = False) -> list[tuple]:
    """Jobs with an attempt in the backend's hands (with ``queued_too``, those a queueing backend holds too)."""
    out = []
    states = ACTIVE_STATES + ([JobState.queued.value] if queued_too else [])
    for job in s.scalars(select(Job).where(Job.state.in_(states))):
        if job.state == JobState.queued.value and not handed_over(job):
            continue
        attempt = latest(job)
        out.append(
            (
                job.id,
                dict(job.backend_state or {}),
                job.state == JobState.preempted.value,
                attempt.stop_reason if attempt is not None else "",
            )
        )
    return out
