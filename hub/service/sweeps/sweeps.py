"""Sweeps: a set of ordinary jobs of one owner, from one cell, searched and pruned by Optuna.

:class:`Sweeps` is the manager's facade ``manager.sweeps``: :meth:`~Sweeps.create` checks everything
(:func:`.space.parse_request`, the trials' job by a dry run of the service's own submission) before
anything is stored or queued; :meth:`~Sweeps.page`, :meth:`~Sweeps.view` and :meth:`~Sweeps.stop` answer for
the owner (404 for anyone else's; admins see and stop all). The loop (:meth:`~Sweeps.run_forever`, begun by
the manager's recovery, so a restarted service picks its running sweeps up again) advances each running
sweep in turn (:mod:`.loop`): trials are submitted through the same path as ``POST /jobs``, as the
owner's jobs at the sweep's priority, at most ``parallel`` not yet ended; each running trial's objective
history is read from its MLflow run and reported to Optuna, which prunes; a pruned trial's job is
cancelled at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import PurePosixPath

from danlu.errors import Conflict, DanluError, Forbidden, NotFound, UsageError
from danlu.hub import scopes
from danlu.hub.service import validation
from danlu.hub.service.auth import Principal
from danlu.hub.service.formats import JOB_ID
from danlu.hub.service.store.orm import Sweep
from danlu.hub.service.sweeps import records, tracking
from danlu.hub.service.sweeps.engine import Engine, storage_url_for
from danlu.hub.service.sweeps.loop import advance
from danlu.hub.service.sweeps.space import parse_request, placeholder

MAX_TRIALS = 1000
MAX_PARALLEL = 64
INTERVAL = 5.0
STATES = ("running", "succeeded", "stopped", "failed")


def owner_principal(owner: str) -> Principal:
    """Whom a sweep's trials are submitted as: its owner, as a plain user (an admin's rights are not carried)."""
    return Principal(owner, "user", frozenset({f"{scopes.WRITE}!user={owner}", f"{scopes.READ}!user={owner}"}))


def sweep_principal(sweep_id: str, owner: str) -> Principal:
    """Who cancels a sweep's trials (pruned, stopped): the sweep, with its owner's right to their jobs."""
    return Principal(f"sweep:{sweep_id}", "service", frozenset({f"{scopes.WRITE}!user={owner}"}))


class Sweeps:
    def __init__(self, *, database, settings, submission, cancel, mlflow, log: logging.Logger | None = None):
        self.database = database
        self.settings = settings
        self.submission = submission
        #: ``cancel(principal, job_id)``: the manager's own cancel, for pruned and stopped trials
        self.cancel = cancel
        self.mlflow = mlflow if mlflow is not None and getattr(mlflow, "registry", None) is not None else None
        self.log = log or logging.getLogger("danlu.jobs")
        self.engine = Engine(storage_url_for(settings.jobs_database_url), self.log)
        #: where trials' objective histories are read: their MLflow runs (``history(trial, metric)``)
        self.source = tracking.MlflowObjective(self.mlflow) if self.mlflow is not None else None
        self.max_trials, self.max_parallel, self.interval = MAX_TRIALS, MAX_PARALLEL, INTERVAL
        self.lock = asyncio.Lock()  # one change of sweeps at a time: the loop's tick, a creation's first trials, a stop
        self.wake = asyncio.Event()

    def bound(self, *, max_trials: int, max_parallel: int, interval: float, storage_url: str | None = None) -> None:
        """The workbench's limits and the loop's interval (JobsServiceApp's options)."""
        self.max_trials, self.max_parallel, self.interval = max_trials, max_parallel, interval
        if storage_url:
            self.engine.close()
            self.engine = Engine(storage_url, self.log)

    def close(self) -> None:
        self.engine.close()

    # the API -----------------------------------------------------------------------------------------
    async def create(self, principal, body) -> tuple[int, dict]:
        """Check a sweep (400 naming the field), store it, and begin its first trials; 201 with its view."""
        if not principal.is_user:
            raise Forbidden(
                "only users start sweeps; this token belongs to a service",
                reason="not_a_user",
                fix="start it with a user's token (JUPYTERHUB_API_TOKEN in their server, or /hub/token)",
            )
        spec = parse_request(body, max_trials=self.max_trials, max_parallel=self.max_parallel)
        validation.check_schema("SweepSubmission", body)  # the rest: types, unknown fields, the job's own schema
        if self.source is None:
            raise DanluError(
                "sweeps read each trial's objective from its MLflow run, and this jobs service has no MLflow",
                status=409,
                reason="no_mlflow",
                fix="run the workbench with its MLflow (danlu up starts one)",
            )
        job = {k: v for k, v in spec.job.items() if k != "dry_run"}
        owner = principal.name
        priority = job.get("priority") or lowest_priority(self.settings)
        stem = PurePosixPath(str((job.get("source") or {}).get("notebook_path") or "")).stem
        experiment = job.get("experiment") or f"{owner}/{stem or 'jobs'}"
        template = {**job, "priority": priority, "experiment": experiment}
        probe = {**template, "parameters": {**job.get("parameters", {}), **placeholder(spec.space)}, "dry_run": True}
        try:  # every check of a submission, on one trial's job: nothing is written
            await self.submission.submit(owner_principal(owner) if not principal.admin else principal, probe)
        except DanluError as e:  # named as the sweep's field: the trials' job
            e.field = f"job.{e.field}" if e.field and e.field != "body" else "job"
            raise
        sweep_id = uuid.uuid4().hex[:12]
        sweep = Sweep(
            id=sweep_id,
            owner=owner,
            name=spec.name or f"sweep-{sweep_id[:6]}",
            state="running",
            reason="",
            spec=records.spec_data(spec, priority),
            template=json.dumps(template),
            study=f"danlu-sweep-{sweep_id}",
            experiment=experiment,
            best={},
            notes=[],
        )
        await self.engine.call(self.engine.study, sweep.study, spec)
        if self.mlflow is not None:
            await self._parent(sweep)
        await self.database.write(records.insert, sweep)
        self.log.info("sweep %s started by %s: %d trials of %s", sweep_id, owner, spec.trials, spec.objective)
        async with self.lock:
            await advance(self, sweep_id)
        return 201, self._with_url(await self.database.read(records.view, sweep_id), sweep)

    async def _parent(self, sweep: Sweep) -> None:
        try:
            run_id, experiment_id = await tracking.create_parent(
                self.mlflow,
                {
                    "id": sweep.id,
                    "owner": sweep.owner,
                    "name": sweep.name,
                    "experiment": sweep.experiment,
                    "spec": sweep.spec,
                },
            )
        except DanluError as e:
            self.log.warning("sweep %s: no parent run in MLflow: %s", sweep.id, e)
            sweep.notes = [f"MLflow did not make the sweep's parent run ({e}); trials are tracked on their own"]
            return
        sweep.parent_run_id = run_id
        sweep.spec = {**sweep.spec, "experiment_id": experiment_id}

    async def get(self, principal, sweep_id: str) -> Sweep:
        """A sweep the caller may see; 404 otherwise (never 403)."""
        if not isinstance(sweep_id, str) or not JOB_ID.match(sweep_id):
            raise UsageError(
                f"'{str(sweep_id)[:40]}' is not a sweep id (12 hex digits)",
                field="id",
                reason="bad_id",
                fix="use an id from 'danlu sweeps list' or GET /sweeps",
            )
        sweep = await self.database.read(records.row, sweep_id)
        if sweep is None or not principal.can_read(sweep.owner):
            raise NotFound(
                f"sweep {sweep_id} not found",
                reason="no_such_sweep",
                field="id",
                fix="see the sweeps you may read with 'danlu sweeps list' or GET /sweeps",
            )
        return sweep

    async def page(self, principal, *, owner: str | None = None, state: str | None = None, limit: int = 100) -> dict:
        """The sweeps the caller may see (admins: everyone's, or ``owner``'s), newest first."""
        if owner and owner != principal.name and not principal.admin:
            raise Forbidden(
                "only admins can list other users' sweeps",
                reason="not_admin",
                field="owner",
                fix=f"leave owner out, or ask for owner={principal.name}",
            )
        if state is not None and state not in STATES:
            raise UsageError(f"unknown sweep state '{state[:40]}'", field="state", fix=f"use {', '.join(STATES)}")
        who = (owner or None) if principal.admin else principal.name
        return {"sweeps": await self.database.read(records.listing, who, state, limit)}

    async def view(self, principal, sweep_id: str) -> dict:
        sweep = await self.get(principal, sweep_id)
        out = await self.database.read(records.view, sweep.id)
        return self._with_url(out, sweep)

    def _with_url(self, out: dict, sweep: Sweep) -> dict:
        experiment_id = sweep.spec.get("experiment_id")
        out["mlflow_run_url"] = (
            f"{self.settings.public_url}/services/mlflow/#/experiments/{experiment_id}/runs/{sweep.parent_run_id}"
            if sweep.parent_run_id and experiment_id
            else None
        )
        return out

    async def stop(self, principal, sweep_id: str) -> dict:
        """Stop a running sweep: its queued and running trials are cancelled (409 if it has ended)."""
        sweep = await self.get(principal, sweep_id)
        if not principal.can_write(sweep.owner):
            raise NotFound(f"sweep {sweep_id} not found", reason="no_such_sweep", field="id")
        async with self.lock:
            snap = await self.database.read(records.snapshot, sweep.id)
            if snap["state"] != "running":
                raise Conflict(
                    f"sweep {sweep.id} is {snap['state']}, not running",
                    reason="not_running",
                    fix="only a running sweep can be stopped",
                )
            await self.end(snap, "stopped", f"stopped by {principal.name}", actor=principal.name)
        return await self.view(principal, sweep.id)

    # the loop ------------------------------------------------------------------------------------------
    async def end(self, snap: dict, state: str, reason: str, actor: str = "danlu") -> None:
        """End a sweep: cancel its trials' jobs that have not ended, fail them in Optuna, close the parent run."""
        if not await self.database.write(records.end_sweep, snap["id"], state, reason, actor):
            return
        who = sweep_principal(snap["id"], snap["owner"])
        for trial in snap["trials"]:
            if trial["state"] == records.ACTIVE and trial["job_id"] and trial["job_state"] not in records.FINAL_JOBS:
                await self.cancel_job(who, trial["job_id"])
        await self.engine.call(self.engine.fail_running, snap["study"], snap["model"])
        if self.mlflow is not None and snap["parent_run_id"]:
            try:
                await tracking.finish(self.mlflow, snap["parent_run_id"], state)
            except DanluError as e:
                self.log.warning("sweep %s: its parent run was not ended: %s", snap["id"], e)
        self.log.info("sweep %s %s: %s", snap["id"], state, reason)

    async def cancel_job(self, who, job_id: str) -> None:
        try:
            await self.cancel(who, job_id)
        except DanluError as e:  # it ended meanwhile (409): nothing to cancel
            self.log.info("trial job %s was not cancelled: %s", job_id, e)

    async def tick(self) -> None:
        """Advance every running sweep once."""
        for sweep_id in await self.database.read(records.running_ids):
            async with self.lock:
                try:
                    await advance(self, sweep_id)
                except Exception:  # noqa: BLE001 - one sweep's trouble must not stop the others'
                    self.log.exception("advancing sweep %s failed; it is tried again", sweep_id)

    async def run_forever(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the database may be restarting: the next tick tries again
                self.log.exception("the sweeps' loop failed; it goes on")
            try:
                await asyncio.wait_for(self.wake.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
            self.wake.clear()


def lowest_priority(settings) -> str | None:
    """The sweep's default priority: the workbench's lowest priority class (None: the default class)."""
    classes = dict(settings.priority_classes or {})  # name -> value
    return min(classes, key=lambda name: (classes[name], name)) if classes else None
