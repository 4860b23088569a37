"""What the parts of a job's life share: the admission state, its one lock, and the service's background tasks.

:class:`Core` holds the in-memory admission :class:`~danlu.hub.service.admission.model.Model` (a view of
the database, rebuilt from it after a restart or an error), the pending workloads, the scheduler's last
decision and estimates, whether the workbench drains, and the one ``asyncio.Lock`` that serializes every
change of the model or of the rows it mirrors. It also keeps the service's background tasks (so that
stopping the service cancels them) and, for log followers, an event per job that is set when the job ends.
It holds nothing else: the database, the settings, the backend and the rest are given to each part that
needs them (:class:`~danlu.hub.service.manager.JobManager` wires them).
"""

from __future__ import annotations

import asyncio
import datetime as dt

from sqlalchemy import select

from danlu.hub.service.admission import quotas
from danlu.hub.service.admission.model import Model
from danlu.hub.service.admission.workloads import Decision, Request, Workload
from danlu.hub.service.jobs import checkpoints
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Attempt, Flag, Job, QueueSetting


def ts(value) -> float:
    """Seconds since the epoch of a naive UTC datetime (the database's), whatever this machine's zone."""
    return value.replace(tzinfo=dt.timezone.utc).timestamp() if value else 0.0


def workload_of(job: Job, attempt: Attempt | None = None) -> Workload:
    """A job as the admission model sees it (with the devices of ``attempt`` when it holds them)."""
    wl = Workload(
        job.id,
        job.queue,
        job.priority,
        ts(job.created_at),
        Request(job.gpus, job.gpu_type, job.cpu, job.memory),
        job.owner,
    )
    if attempt is not None:
        wl.flavor = attempt.flavor
        wl.devices = tuple(attempt.devices or ())
        wl.admitted_at = ts(attempt.started_at)
        wl.checkpointed_at = ts(checkpoints.saved_at(job))
    return wl


def overrides_of(s) -> dict[str, dict]:
    """Queue name -> the admins' live changes of it (and whether it is held)."""
    return {q.name: {**q.changes, "held": q.held} for q in s.scalars(select(QueueSetting))}


class Core:
    def __init__(self, model: Model, *, draining: bool = False):
        self.model = model
        self.pending: dict[str, Workload] = {}
        self.plan = Decision()
        self.estimates: dict[str, float] = {}
        self.draining = draining
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.closing = False
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def load(cls, database: Database, settings, inventory) -> Core:
        """The admission model danlu.yaml and the admins' live changes make (at start-up, before any request)."""
        quotas.check(settings, inventory)
        with database.sessions() as s:
            overrides = overrides_of(s)
            drain = s.get(Flag, "drain")
        draining = bool(drain and isinstance(drain.value, dict) and drain.value.get("on"))
        return cls(quotas.build_model(settings, inventory, overrides), draining=draining)

    # tasks and events -------------------------------------------------------------------------
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def ended(self, job_id: str) -> asyncio.Event:
        """An event set when the job reaches a final state (for log followers)."""
        return self._ended.setdefault(job_id, asyncio.Event())

    def mark_ended(self, job_id: str) -> None:
        event = self._ended.pop(job_id, None)
        if event is not None:
            event.set()

    # the model ---------------------------------------------------------------------------------
    def pending_by_queue(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for wl in self.pending.values():
            counts[wl.team] = counts.get(wl.team, 0) + 1
        return counts
