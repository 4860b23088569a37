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
        Accepted and waiting for admission (its team's quota, free devices, a held queue, a drain).
        -> ``running`` when admitted and started; -> ``cancelled`` on cancel.
    ``running``
        Its runner process exists.
        -> ``succeeded`` when every rank's notebook executed without error;
        -> ``failed`` when the user's code raised (``failure: user``), or the
        runner was killed or lost and no retry is left (``failure:
        infrastructure``); -> ``queued`` when such an infrastructure failure
        leaves a retry (after a backoff) or the workbench stops under it;
        -> ``preempted`` when a higher-priority job or a team reclaiming its
        quota needs its resources; -> ``timed_out`` when it outruns its
        limit; -> ``cancelled`` on cancel. Every ending attempt stays in the
        job's history.
    ``preempted``
        It got SIGTERM (and its grace period to checkpoint into
        ``$DANLU_CHECKPOINT_DIR``); -> ``queued`` once its processes are gone.
        -> ``cancelled`` on cancel; -> ``succeeded`` if it finished on its own
        first.
    ``succeeded``, ``failed``, ``cancelled``, ``timed_out``
        Final. Logs, the output notebook and the MLflow run stay available.
    """

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    preempted = "preempted"
    timed_out = "timed_out"

    @property
    def final(self) -> bool:
        return self in FINAL


FINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timed_out})

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
