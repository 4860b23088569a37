"""The job state machine.

One enum, :class:`JobState`, and the table of allowed transitions. Every
change of a job's state in the service goes through :func:`transition`, which
refuses a transition the table does not list, so the states the API reports
always follow the documented lifecycle.
"""

from __future__ import annotations

import enum

from danlu.errors import Conflict


class JobState(str, enum.Enum):
    """Where a job is in its life.

    ``queued``
        Accepted and waiting for admission (free GPUs, a CPU-job slot).
        -> ``running`` when admitted and started; -> ``cancelled`` on cancel.
    ``running``
        Its runner process exists.
        -> ``succeeded`` when every rank's notebook executed without error;
        -> ``failed`` when the user's code raised, or the runner was killed or
        lost; -> ``cancelled`` on cancel; -> ``queued`` when the workbench
        stops under it (the interrupted attempt stays in its history).
    ``succeeded``, ``failed``, ``cancelled``
        Final. Logs, the output notebook and the MLflow run stay available.
    """

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL


FINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.running, JobState.cancelled}),
    JobState.running: frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.queued}),
    JobState.succeeded: frozenset(),
    JobState.failed: frozenset(),
    JobState.cancelled: frozenset(),
}


def transition(current: str | JobState, new: str | JobState) -> JobState:
    """Check a transition and return the new state; raise Conflict if not allowed."""
    current, new = JobState(current), JobState(new)
    if new not in TRANSITIONS[current]:
        if current.final:
            raise Conflict(f"the job already ended ({current.value})", reason="already_final")
        raise Conflict(f"a {current.value} job cannot become {new.value}", reason="bad_transition")
    return new
