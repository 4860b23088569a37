"""What the parts of the jobs service share: settings, the database, the admission model, one lock.

:class:`Core` holds the state that the submission, the scheduler, the
supervisor, the queue admin and the server reservations all work on: the
in-memory admission :class:`~danlu.hub.service.admission.model.Model` (a view of
the database, rebuilt from it after a restart or an error), the pending
workloads and the last decision, and the one ``asyncio.Lock`` that
serializes every change of the model or of the rows it mirrors. Database work
runs on threads, never on the event loop, so a slow disk or a busy PostgreSQL
cannot freeze the service's other requests: writes one at a time on one thread
(:meth:`Core.db`), reads on a few others (:meth:`Core.read`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import select

from danlu.hub.service.admission import quotas
from danlu.hub.service.admission.model import Decision, Request, Workload
from danlu.hub.service.metrics import Metrics
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Attempt, Flag, Job, QueueSetting

T = TypeVar("T")


def ts(value) -> float:
    """Seconds since the epoch of a naive UTC datetime (the database's), whatever this machine's zone."""
    return value.replace(tzinfo=dt.timezone.utc).timestamp() if value else 0.0


def workload_of(job: Job, attempt: Attempt | None = None) -> Workload:
    """A job as the admission model sees it (with the devices of ``attempt`` when it holds them)."""
    wl = Workload(job.id, job.queue, job.priority, ts(job.created_at),
                  Request(job.gpus, job.gpu_type, job.cpu, job.memory), job.owner)
    if attempt is not None:
        wl.flavor = attempt.flavor
        wl.devices = tuple(attempt.devices or ())
        wl.admitted_at = ts(attempt.started_at)
    return wl


class Core:
    def __init__(self, *, settings, profiles, inventory, sessions, backend, groups, log: logging.Logger | None = None,
                 service_api: str = "", mlflow=None):
        self.settings = settings
        self.profiles = profiles
        self.inventory = inventory
        self.ledger = Ledger(inventory)
        self.sessions = sessions
        self.backend = backend
        self.groups = groups
        self.log = log or logging.getLogger("danlu.jobs")
        self.metrics = Metrics()
        #: where runners reach the runner API (``.../api/v1``)
        self.service_api = service_api
        #: MLflow for jobs: tracking URI and the credentials of a job's owner (danlu.hub.mlflow_auth)
        self.mlflow = mlflow
        quotas.check(settings, inventory)
        with self.sessions() as s:
            overrides = {q.name: {**q.changes, "held": q.held} for q in s.scalars(select(QueueSetting))}
            drain = s.get(Flag, "drain")
        self.model = quotas.build_model(settings, inventory, overrides)
        self.draining = bool(drain and isinstance(drain.value, dict) and drain.value.get("on"))
        self.pending: dict[str, Workload] = {}
        self.plan = Decision()
        self.estimates: dict[str, float] = {}
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()
        self.closing = False
        self._ended: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task] = set()
        # writes one at a time (no read-modify-write of a row can lose another's change, and SQLite never waits
        # on itself); reads beside them
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="danlu-db-write")
        self._reads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="danlu-db-read")

    # the database, off the event loop ------------------------------------------------------
    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(session, *args)`` in one transaction on the database's writer thread."""
        def work():
            with self.sessions() as s, s.begin():
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self._writes, work)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(session, *args)``, which only reads, on the database's reader threads."""
        def work():
            with self.sessions() as s:
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self._reads, work)

    def close(self) -> None:
        self._writes.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)

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

    def observe(self) -> None:
        self.metrics.observe_model(self.model, self.pending_by_queue())
