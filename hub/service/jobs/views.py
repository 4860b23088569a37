"""What the API says about a job: its JSON model, built for many jobs at once and kept encoded once it ended.

Everything here comes from the database and the scheduler: nothing is read from the job's folder, so a job
cannot change what its record says. :meth:`Views.to_dict` is the model; for a queued job, why it waits, its
place in the queue and when it may start are the scheduler's answer (:meth:`Scheduler.explain
<danlu.hub.service.jobs.scheduler.Scheduler.explain>`), whichever admits jobs. A listing's jobs come as
:class:`~danlu.hub.service.store.rows.Stored` values (one select per table), and :class:`ViewCache` keeps the
encoded view of each job in a final state with the values it was built from: a view is served from the cache
only while the database still holds exactly those values, so no write, by whatever path, is hidden. A view
says nothing about who asks for it; which jobs a caller may see is decided before any view is read
(:mod:`~danlu.hub.service.store.listing`, :mod:`~danlu.hub.service.manager`).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import typing
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

from danlu.hub.service.jobs import checkpoints
from danlu.hub.service.states import FINAL
from danlu.hub.service.store.orm import Job, isoformat, utcnow
from danlu.hub.service.store.rows import ATTEMPT_COLUMNS, JSON_COLUMNS, VIEW_COLUMNS, Stored

#: the encoded views kept, about 4 KiB each with what they were built from (20 MiB in all): every job that
#: 200 users with 20 each poll, and an admin's page of 1000; beyond that, the least recently read are built
#: again when read
MAX_CACHED = 5_000
#: the most bytes of encoded views the cache keeps, and the largest one it keeps at all
MAX_CACHED_BYTES = 64 * 2**20
MAX_CACHED_VIEW = 256 * 1024
_FINAL = frozenset(s.value for s in FINAL)


class Explanation(NamedTuple):
    """Why a queued job waits, its place in its queue (1-based) and when it may start (seconds since the
    epoch), each None where the scheduler cannot say."""

    reason: str
    position: int | None = None
    estimated_start: float | None = None


class Explains(Protocol):
    def explain(self, job: Any) -> Explanation: ...


def _tracking(job: Job) -> dict:
    """The job's tracking health, as its runner reported it."""
    data = job.tracking if isinstance(job.tracking, dict) else {}
    notes = [n for n in data.get("notes") or [] if isinstance(n, str)][:20]
    run_id = data.get("run_id") or job.mlflow_run_id
    dropped = data.get("points_dropped") or 0
    if run_id is None:
        health = "pending" if job.state in ("queued", "running", "preempted") else "none"
    else:
        health = "degraded" if dropped or notes else "ok"
    return {
        "state": health,
        "run_id": run_id,
        "experiment_id": data.get("experiment_id"),
        "points_sent": data.get("points_sent") or 0,
        "points_dropped": dropped,
        "notes": notes,
    }


def inputs_of(job: Job) -> list[dict]:
    """The catalog versions a job named when it was submitted (without those its code asked for later)."""
    return [
        {
            "ref": d["name"],
            "dataset": d["dataset"],
            "version": d["version"],
            "digest": d["digest"],
            "context": d.get("context") or "training",
        }
        for d in job.datasets or []
        if d.get("dataset") and d.get("version")
    ]  # a pinned path has a digest too


class Views:
    """The API models of jobs: :meth:`to_dict` of a row, :meth:`encoded` of a listing's stored jobs."""

    def __init__(self, public_url: str, scheduler: Explains, backend, size: int = MAX_CACHED):
        self.public_url = public_url
        self.scheduler = scheduler
        self.backend = backend
        self.cache = ViewCache(size)

    def to_dict(self, job, inputs: list[dict] | None = None) -> dict:
        """The job's API model; ``inputs``: its ``dataset_uses`` (catalog.uses_of_job), else what it was submitted
        with."""
        base = f"{self.public_url}/services/danlu/api/v1/jobs/{job.id}"
        tracking = _tracking(job)
        run_id, experiment_id = tracking["run_id"], tracking["experiment_id"]
        attempts = [
            {
                "number": a.number,
                "state": a.state,
                "reason": a.reason,
                "failure": a.failure or None,
                "devices": list(a.devices or []),
                "gpu_type": a.flavor,
                "exit_code": a.exit_code,
                "started_at": isoformat(a.started_at),
                "finished_at": isoformat(a.finished_at),
            }
            for a in job.attempts
        ]
        end = job.finished_at or (utcnow() if job.state in ("running", "preempted") else None)
        reason, position, estimate = job.reason, None, None
        state = job.backend_state if isinstance(job.backend_state, dict) else {}
        if job.state == "queued":
            reason, position, when = self.scheduler.explain(job)
            if when is not None:
                estimate = isoformat(dt.datetime.fromtimestamp(when, dt.timezone.utc).replace(tzinfo=None))
        running = job.attempts[-1] if job.attempts and job.state in ("running", "preempted") else None
        return {
            "id": job.id,
            "name": job.name,
            "owner": job.owner,
            "state": job.state,
            "reason": reason,
            "failure": job.failure or None,
            "profile": job.profile,
            "queue": job.queue,
            "priority": job.priority_class or None,
            "priority_value": job.priority,
            "resources": {
                "nproc": job.nproc,
                "nodes": job.nnodes,
                "gpus": job.gpus,
                "gpu_type": job.gpu_type,
                "cpu": job.cpu,
                "memory": job.memory,
            },
            "retries": job.retries,
            "timeout_seconds": job.timeout_seconds,
            "parameters": job.parameters,
            "experiment": job.experiment,
            "datasets": [d["name"] for d in job.datasets],
            "source": job.source,
            "inputs": inputs if inputs is not None else inputs_of(job),
            "devices": list(running.devices or []) if running else [],
            "attempts": attempts,
            "created_at": isoformat(job.created_at),
            "started_at": isoformat(job.started_at),
            "finished_at": isoformat(job.finished_at),
            "retry_at": isoformat(job.not_before),
            "elapsed_seconds": round((end - job.started_at).total_seconds(), 3) if job.started_at and end else None,
            "queue_position": position,
            "estimated_start": estimate,
            "mlflow_run_id": run_id,
            "tracking": tracking,
            "mlflow_run_url": (
                f"{self.public_url}/services/mlflow/#/experiments/{experiment_id}/runs/{run_id}"
                if run_id and experiment_id
                else None
            ),
            "output_url": f"{base}/output",
            "outputs_pruned": state.get("outputs_pruned"),  # the jobs service's bounds pruned it (jobs.outputs)
            "logs_url": f"{base}/logs",
            # where the user's own server finds the job's TensorBoard files (the lab extension's tabs), if anywhere
            "tensorboard_dir": self.backend.tensorboard_dir(job.id),
            "runner": ("warm" if state.get("warm") else "cold") if "pid" in state else None,
            "reproduces": job.reproduces,  # the job this one re-runs (POST /jobs/{id}/reproduce)
            "checkpoint": checkpoints.view(job, job.state in _FINAL),  # its last, as its runner reported it
        }

    def of_stored(self, stored: Stored) -> dict:
        """:meth:`to_dict` of a :class:`~danlu.hub.service.store.rows.Stored` job, with its dataset uses as its
        inputs."""
        n = len(VIEW_COLUMNS)
        job = SimpleNamespace(
            **dict(zip(VIEW_COLUMNS, stored.job[:n], strict=True)),
            **{c: _decoded(t) for c, t in zip(JSON_COLUMNS, stored.job[n:], strict=True)},
        )
        job.attempts = [SimpleNamespace(**dict(zip(ATTEMPT_COLUMNS, a, strict=True))) for a in stored.attempts]
        for a in job.attempts:
            a.devices = _decoded(a.devices)
        inputs = [
            {"ref": f"{d}@{v}", "dataset": d, "version": v, "digest": digest, "context": context}
            for d, v, digest, context in stored.uses
        ]  # as catalog.use_to_dict says a use
        return self.to_dict(job, inputs)

    def encoded(self, jobs: list[Stored]) -> list[str]:
        """``json.dumps`` of each job's view, in order (ended jobs' from :attr:`cache` while they hold)."""
        return self.cache.encoded(jobs, self.of_stored)


def _decoded(text: str | None):
    return json.loads(text) if text is not None else None


class ViewCache:
    """The encoded views of jobs in a final state, each with the stored values it was built from.

    A final job's view depends on its row, its attempts and its dataset uses alone (the scheduler's
    positions and the clock only show in queued and running jobs' views, which are always built anew),
    and most of a listing is jobs that ended long ago. An entry is served only while what the database
    holds equals what it was built from, so a runner's late report, an admin's change or a migration
    shows at the next read, with no invalidation to forget. The least recently used go first beyond
    ``size`` entries or ``max_bytes`` of text; a view over :data:`MAX_CACHED_VIEW` is never kept. Used from
    the reader threads, hence the lock.
    """

    def __init__(self, size: int = MAX_CACHED, max_bytes: int = MAX_CACHED_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[Stored, str]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def encoded(self, jobs: list[Stored], build) -> list[str]:
        """``json.dumps`` of each job's view (``build(stored)``), in order."""
        out: list[str | None] = [None] * len(jobs)
        with self._lock:
            for i, stored in enumerate(jobs):
                entry = self._entries.get(stored.id)
                if entry is not None and entry[0] == stored:
                    self._entries.move_to_end(stored.id)
                    out[i] = entry[1]
                    self.hits += 1
        built: list[tuple[Stored, str]] = []
        for i, stored in enumerate(jobs):
            if out[i] is None:
                out[i] = text = json.dumps(build(stored))
                if stored.state in _FINAL and len(text) <= MAX_CACHED_VIEW:
                    built.append((stored, text))
        if built:
            with self._lock:
                self.misses += len(built)
                for stored, text in built:
                    old = self._entries.pop(stored.id, None)
                    self.bytes += len(text) - (len(old[1]) if old else 0)
                    self._entries[stored.id] = (stored, text)
                while self._entries and (len(self._entries) > self.size or self.bytes > self.max_bytes):
                    self.bytes -= len(self._entries.popitem(last=False)[1][1])
        return typing.cast(list[str], out)  # every one built above
