"""The job state machine.

The states themselves are :class:`danlu.states.JobState` (one vocabulary for
the service and its clients); this module holds the table of allowed
transitions. Every change of a job's state in the service goes through
:func:`transition`, which refuses a transition the table does not list, so the
states the API reports always follow the documented lifecycle, and
:func:`next_state`, the pure decision of what follows an attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from danlu.errors import Conflict
from danlu.states import ACTIVE, FINAL, JobState

__all__ = ["ACTIVE", "FINAL", "Ending", "JobState", "Next", "TRANSITIONS", "next_state", "transition"]

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.running, JobState.cancelled}),
    JobState.running: frozenset(
        {
            JobState.succeeded,
            JobState.failed,
            JobState.cancelled,
            JobState.queued,
            JobState.preempted,
            JobState.timed_out,
        }
    ),
    JobState.preempted: frozenset({JobState.queued, JobState.cancelled, JobState.succeeded}),
    JobState.succeeded: frozenset(),
    JobState.failed: frozenset(),
    JobState.cancelled: frozenset(),
    JobState.timed_out: frozenset(),
}


def transition(current: str | JobState, new: str | JobState) -> JobState:
    """Check a transition and return the new state; raise Conflict if not allowed."""
    current, new = JobState(current), JobState(new)
    if new not in TRANSITIONS[current]:
        if current.final:
            raise Conflict(f"the job already ended ({current.value})", reason="already_final")
        raise Conflict(f"a {current.value} job cannot become {new.value}", reason="bad_transition")
    return new


@dataclass(frozen=True)
class Ending:
    """How an attempt ended, as far as deciding what comes next needs to know."""

    state: str  # how the runner (or the backend) says the attempt ended
    reason: str = ""
    infrastructure: bool = False
    interrupted: bool = False  # the workbench or the service stopped under it: not the job's failure


@dataclass(frozen=True)
class Next:
    """What follows an attempt: the job's next state, and how the attempt is recorded."""

    state: JobState
    reason: str
    failure: str  # "" | "user" | "infrastructure"
    attempt_state: str
    attempt_reason: str
    retry_in: float | None = None  # seconds of backoff before a retry
    retry_number: int = 0


def next_state(
    job_state: str | JobState,
    ending: Ending,
    *,
    stopping: str | None,
    preempt_reason: str,
    retries: int,
    failures_before: int,
    limit_seconds: float,
    backoff_seconds: float,
    resumes: str | None = None,
) -> Next:
    """Decide what follows an attempt of a running or preempted job (a pure function).

    ``stopping`` is why the service was stopping the attempt (cancelled, preempted, timed_out),
    ``failures_before`` the infrastructure failures of earlier attempts, ``retries`` the job's
    allowance, ``resumes`` where a preempted job resumes (the checkpoint it reported). In order:
    success wins; then what the service was doing (a cancel, a time limit, a preemption, which
    requeues without counting against the allowance); an interruption requeues without counting; an
    error in the user's code fails the job; an infrastructure failure retries after
    ``backoff × 2^(n-1)`` (at most an hour) while the allowance lasts, else fails the job.
    """
    job_state = JobState(job_state)
    if ending.state == "succeeded":
        return Next(JobState.succeeded, "", "", "succeeded", "")
    if stopping == "cancelled" or ending.state == "cancelled":
        reason = ending.reason if ending.reason and ending.reason != "cancelled" else "cancelled"
        return Next(JobState.cancelled, reason, "", "cancelled", reason)
    if stopping == "timed_out" or ending.state == "timed_out":
        reason = f"ran longer than its limit of {limit_seconds:g} s and was stopped"
        return Next(JobState.timed_out, reason, "", "timed_out", reason)
    if job_state == JobState.preempted or stopping == "preempted" or ending.state == "preempted":
        where = resumes or "(checkpoint in $DANLU_CHECKPOINT_DIR)"  # a checkpoint it reported, else the folder
        reason = f"{preempt_reason}; back in the queue{'; ' if resumes else ' '}{where}"
        return Next(JobState.queued, reason, "", "preempted", reason)
    if ending.interrupted:
        return Next(JobState.queued, f"{ending.reason}; runs again", "", "failed", ending.reason)
    if not ending.infrastructure:
        reason = f"error in your code: {ending.reason}"
        return Next(JobState.failed, reason, "user", "failed", reason)
    failures = failures_before + 1
    if failures <= retries:
        delay = min(3600.0, backoff_seconds * 2 ** (failures - 1))
        reason = f"retry {failures} of {retries} after an infrastructure failure: {ending.reason}"
        return Next(JobState.queued, reason, "infrastructure", "failed", ending.reason, delay, failures)
    reason = f"infrastructure failure: {ending.reason}"
    return Next(JobState.failed, reason, "infrastructure", "failed", reason)
