"""The names of a job's states: one enum for the service, the clients and the lab extension.

:class:`JobState` is the vocabulary; the jobs service's state machine (which
transitions are allowed, what follows an attempt) lives in
:mod:`danlu.hub.service.states`, which imports it. The lab extension's
``JobState`` type and ``FINAL_STATES`` (``extensions/lab/src/tokens.ts``) are
checked against these by ``tests/test_vocabulary.py``.
"""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    """Where a job is in its life.

    ``queued``
        Accepted and waiting for admission (its team's quota, free devices, a held queue, a drain).
        -> ``running`` when admitted and started; -> ``cancelled`` on cancel.
    ``running``
        Admitted: its runner was started.
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


#: states after which nothing changes
FINAL = frozenset({JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timed_out})
#: their names, for clients that read a job's state from the API
FINAL_STATES = frozenset(state.value for state in FINAL)
#: states in which a job holds resources and has processes (or had, until they are gone)
ACTIVE = frozenset({JobState.running, JobState.preempted})
#: how an attempt can end, as its runner reports it
ATTEMPT_ENDINGS = ("succeeded", "failed", "cancelled", "preempted", "timed_out")
