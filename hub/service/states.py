"""The job state machine.

The states themselves are :class:`danlu.states.JobState` (one vocabulary for
the service and its clients); this module holds the table of allowed
transitions. Every change of a job's state in the service goes through
:func:`transition`, which refuses a transition the table does not list, so the
states the API reports always follow the documented lifecycle.
"""

from __future__ import annotations

from danlu.errors import Conflict
from danlu.states import ACTIVE, FINAL, JobState

__all__ = ["ACTIVE", "FINAL", "JobState", "TRANSITIONS", "transition"]

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.queued: frozenset({JobState.running, JobState.cancelled}),
    JobState.running: frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.queued,
                                 JobState.preempted, JobState.timed_out}),
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
