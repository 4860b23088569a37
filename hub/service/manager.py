"""The jobs service's facade: everything the HTTP handlers call, with no HTTP in it.

:class:`JobManager` wires the parts of a job's life around one :class:`~danlu.hub.service.jobs.core.Core`
-- :class:`~danlu.hub.service.jobs.supervisor.Supervisor` (the execution manager), the scheduler (the
``scheduler_class`` chosen at start-up: Danlu's own admission or a backend's own queue),
:class:`~danlu.hub.service.jobs.submission.Submission`,
:class:`~danlu.hub.service.jobs.reproduction.Reproduction` -- and answers for a caller about jobs: who may
see or control which job (404, never 403, for someone else's), reading a job's log and notebooks through the
backend, usage, allocations, profiles, lineage. The rest is reached through its named facades, each doing
its own authorization: :attr:`datasets` (the catalog), :attr:`models` (the model registry), :attr:`queues`
(queue administration), :attr:`servers` (notebook servers' GPUs), :attr:`sweeps` (hyperparameter sweeps),
:attr:`audit` (the audit log) and :attr:`runner_api` (what a job's runner may ask and tell). Authorization
lives here and in the facades, not in the handlers.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import os

from sqlalchemy import func, select

from danlu.errors import Conflict, DanluError, Forbidden, NotFound, ValidationError
from danlu.hub.backends.base import Backend, FileRefused
from danlu.hub.service.auth import ADMIN_FIX, require_admin
from danlu.hub.service.datasets.catalog import Catalog, uses_of_jobs
from danlu.hub.service.formats import JOB_ID
from danlu.hub.service.jobs import checkpoints, outputs
from danlu.hub.service.jobs.attempts import handed_over
from danlu.hub.service.jobs.core import Core
from danlu.hub.service.jobs.experiments import experiments_of
from danlu.hub.service.jobs.queues import Queues
from danlu.hub.service.jobs.reproduction import Reproduction
from danlu.hub.service.jobs.runner_api import RunnerApi
from danlu.hub.service.jobs.scheduler import Scheduler
from danlu.hub.service.jobs.servers import Servers
from danlu.hub.service.jobs.submission import Submission
from danlu.hub.service.jobs.supervisor import Supervisor
from danlu.hub.service.jobs.views import Views
from danlu.hub.service.metrics import Metrics
from danlu.hub.service.registry.lineage import model_lineage
from danlu.hub.service.registry.versions import ModelRegistry
from danlu.hub.service.states import FINAL, JobState, transition
from danlu.hub.service.store import audit, listing
from danlu.hub.service.store.audit import AuditLog
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Job, JobInput, utcnow
from danlu.hub.service.store.rows import STORED_COLUMNS, stored
from danlu.hub.service.sweeps.sweeps import Sweeps
from danlu.hub.service.usage import reports as usage


class JobManager:
    def __init__(
        self,
        *,
        settings,
        profiles,
        inventory,
        database: Database,
        backend: Backend,
        groups,
        scheduler_class: type[Scheduler],
        mlflow=None,
        service_api: str = "",
        log: logging.Logger | None = None,
    ):
        self.settings = settings
        self.profiles = profiles
        self.database = database
        self.backend = backend
        self.groups = groups
        self.mlflow = mlflow
        self.log = log = log or logging.getLogger("danlu.jobs")
        self.metrics = metrics = Metrics()
        self.gpu_culler = None  # the GPU-aware culler, where the service runs one (danlu.hub.service.jobs.gpuculling)
        self.ledger = ledger = Ledger(inventory)
        self.core = core = Core.load(database, settings, inventory)
        shared = {"database": database, "settings": settings}
        self.supervisor = Supervisor(
            core,
            **shared,
            backend=backend,
            ledger=ledger,
            metrics=metrics,
            mlflow=mlflow,
            service_api=service_api,
            log=log,
        )
        self.scheduler = scheduler_class(
            core,
            self.supervisor,
            **shared,
            backend=backend,
            profiles=profiles,
            inventory=inventory,
            ledger=ledger,
            metrics=metrics,
            log=log,
        )
        self.datasets = Catalog(database, settings=settings, groups=groups, log=log)
        self.submission = Submission(
            core,
            self.scheduler,
            self.datasets,
            **shared,
            profiles=profiles,
            groups=groups,
            ledger=ledger,
            backend=backend,
            mlflow=mlflow,
            log=log,
        )
        self.runner_api = RunnerApi(
            self.supervisor, self.datasets, **shared, backend=backend, profiles=profiles, mlflow=mlflow
        )
        self.queues = Queues(core, self.scheduler, **shared, inventory=inventory)
        self.servers = Servers(core, self.scheduler, **shared, ledger=ledger, groups=groups)
        self.reproduction = Reproduction(
            self.submission, self.datasets, database=database, profiles=profiles, groups=groups, mlflow=mlflow
        )
        self.models = ModelRegistry(self.submission, **shared, groups=groups, mlflow=mlflow, log=log)
        self.audit = AuditLog(database, settings.state_dir)
        self.usage_cache = usage.Cache()
        self.views = Views(settings.public_url, self.scheduler, backend)
        self.sweeps = Sweeps(**shared, submission=self.submission, cancel=self.cancel, mlflow=mlflow, log=log)

    @property
    def draining(self) -> bool:
        return self.core.draining

    # reading ----------------------------------------------------------------------------------
    async def get(self, principal, job_id: str, *, write: bool = False) -> Job:
        """A job the caller may see (and, with ``write``, control); 404 otherwise, never 403."""
        if not isinstance(job_id, str) or not JOB_ID.match(job_id):
            raise ValidationError(f"'{str(job_id)[:40]}' is not a job id (12 hex digits)", field="id", reason="bad_id")
        job = await self.database.read(lambda s: s.get(Job, job_id))
        allowed = job is not None and (principal.can_write(job.owner) if write else principal.can_read(job.owner))
        if not allowed:
            raise NotFound(
                f"job {job_id} not found",
                reason="no_such_job",
                field="id",
                fix="see the jobs you may read with 'danlu jobs list' or GET /jobs",
            )
        return job

    def _listing(
        self, principal, states: list[str] | None, owner: str | None, cursor: str | None
    ) -> tuple[str | None, listing.Key | None]:
        """Whose jobs a listing may read (None: everyone's, for admins) and the key it starts below; 403 for a
        user asking for another's, 400 for an unknown state or a bad cursor, before anything is read."""
        if owner and owner != principal.name and not principal.admin:
            raise Forbidden(
                "only admins can list other users' jobs",
                reason="not_admin",
                field="owner",
                fix=f"leave owner out, or ask for owner={principal.name}",
            )
        for state in states or []:
            if state not in JobState.__members__:
                raise ValidationError(
                    f"unknown state '{state[:40]}'", field="state", fix=f"use {', '.join(JobState.__members__)}"
                )
        after = listing.decode_cursor(cursor) if cursor is not None else None
        return ((owner or None) if principal.admin else principal.name), after

    async def page(
        self,
        principal,
        *,
        states: list[str] | None = None,
        owner: str | None = None,
        queue: str | None = None,
        limit: int = 200,
        cursor: str | None = None,
    ) -> tuple[list[Job], str | None]:
        """A page of the jobs the caller may see, newest first, and the cursor of the next page (None: the last)."""
        who, after = self._listing(principal, states, owner, cursor)
        jobs, last = await self.database.read(
            lambda s: listing.page(s, owner=who, states=list(states or []), queue=queue, limit=limit, after=after)
        )
        return jobs, (listing.encode_cursor(last) if last is not None else None)

    async def page_json(
        self,
        principal,
        *,
        states: list[str] | None = None,
        owner: str | None = None,
        queue: str | None = None,
        limit: int = 200,
        cursor: str | None = None,
    ) -> str:
        """:meth:`page` with :meth:`views` of its jobs, as the body of ``GET /jobs`` (JSON text, the same bytes).

        Read, built and encoded in one go on a reader thread: what its jobs' views show, read with the
        page itself, then their attempts and dataset uses (a select each, no ORM objects), and each view
        encoded, or taken from the views' cache when the job has ended and its stored values are those the
        cached view was built from. Which jobs are on the page is decided by the caller's filter
        alone; the cache only ever answers for those.
        """
        who, after = self._listing(principal, states, owner, cursor)

        def body(s) -> str:
            found, last = listing.rows(
                s, STORED_COLUMNS, owner=who, states=list(states or []), queue=queue, limit=limit, after=after
            )
            jobs = stored(s, [row for _key, row in found])
            return listing.encode_page(
                self.views.encoded(jobs), listing.encode_cursor(last) if last is not None else None
            )

        return await self.database.read(body)

    async def list(self, principal, **kwargs) -> builtins.list[Job]:
        """The first page (or the page at ``cursor``) of :meth:`page`, without the next cursor."""
        return (await self.page(principal, **kwargs))[0]

    async def experiments(self, principal, owner: str | None = None) -> builtins.list[dict]:
        """The MLflow experiments holding a user's job runs (the caller's, or for admins anyone's)."""
        owner = owner or principal.name
        if owner != principal.name and not principal.admin:
            raise Forbidden(
                "only admins can list other users' experiments",
                reason="not_admin",
                field="owner",
                fix=f"leave owner out, or ask for owner={principal.name}",
            )
        return await self.database.read(experiments_of, owner)

    async def views_of(self, jobs: builtins.list[Job]) -> builtins.list[dict]:
        """The API models of ``jobs``, with the dataset versions each used (one query for all), built on a
        reader thread: a page of 1000 jobs costs the event loop nothing but the wait."""

        def build(s):
            uses = uses_of_jobs(s, [j.id for j in jobs])
            return [self.views.to_dict(j, uses.get(j.id, [])) for j in jobs]

        return await self.database.read(build)

    async def job_view(self, principal, job_id: str) -> dict:
        """The API model of a job the caller may see (404 otherwise)."""
        return (await self.views_of([await self.get(principal, job_id)]))[0]

    async def job_dict(self, job_id: str) -> dict:
        return (await self.views_of([await self.database.read(lambda s: s.get(Job, job_id))]))[0]

    async def input_notebook(self, principal, job_id: str) -> tuple[Job, bytes]:
        job = await self.get(principal, job_id)
        row = await self.database.read(lambda s: s.get(JobInput, job.id))
        if row is None:
            raise NotFound(f"job {job.id} has no notebook on record", reason="no_output")
        return job, row.notebook.encode()

    def _files_state(self, job: Job) -> dict:
        """The backend state to read a job's files with: whose files they must be, even before it started."""
        state = dict(job.backend_state or {}) if isinstance(job.backend_state, dict) else {}
        if not isinstance(state.get("uid"), int):
            try:
                account = self.settings.account(job.owner) if self.settings.unix_accounts else None
            except DanluError:  # the account is gone: nothing in that folder is anyone's we would serve
                return {**state, "uid": -1}
            state["uid"] = account.uid if account is not None else os.geteuid()
        return state

    async def read_log(self, job: Job, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to ``limit`` bytes of the job's log from ``offset``, and its size (409 for a file the backend will
        not serve)."""
        try:
            return await self.backend.read_log(job.id, self._files_state(job), offset, limit)
        except FileRefused as e:
            raise DanluError(
                f"job {job.id}'s log cannot be served: {e}",
                status=409,
                reason="unsafe_file",
                fix="the job replaced its log with something that is not a plain file",
            ) from None

    async def read_output(self, job: Job, rank: int, offset: int, limit: int) -> tuple[bytes, int] | None:
        """Likewise for rank ``rank``'s executed notebook; None while there is none."""
        ranks = job.nproc * (job.nnodes or 1)
        if rank >= ranks:
            raise NotFound(f"job {job.id} has ranks 0-{ranks - 1}", field="rank", reason="no_such_rank")
        try:
            answer = await self.backend.read_output(job.id, self._files_state(job), rank, offset, limit)
        except FileRefused as e:
            raise DanluError(
                f"job {job.id}'s output cannot be served: {e}",
                status=409,
                reason="unsafe_file",
                fix="the job replaced its output notebook with something that is not a plain file",
            ) from None
        if answer is None:  # a runner whose folder the service cannot read handed it over (a pod)
            answer = await asyncio.to_thread(outputs.read, self.settings.state_dir, job.id, rank, offset, limit)
        return answer

    def ended(self, job_id: str) -> asyncio.Event:
        return self.core.ended(job_id)

    async def counts(self) -> dict:
        """Jobs per state."""
        return await self.database.read(
            lambda s: dict(s.execute(select(Job.state, func.count()).group_by(Job.state)).all())
        )

    # changing ----------------------------------------------------------------------------------
    async def submit(self, principal, body) -> tuple[int, dict]:
        status, answer = await self.submission.submit(principal, body)
        return status, (await self.job_dict(answer["id"]) if status == 201 else answer)

    async def cancel(self, principal, job_id: str) -> dict:
        core = self.core
        job = await self.get(principal, job_id, write=True)
        if JobState(job.state) in FINAL:
            transition(job.state, JobState.cancelled)  # raises 409 with the reason
        who = principal.name
        if job.state == JobState.queued.value:
            async with core.lock:
                queue, handed = await self.database.write(_cancel_queued, job_id, who)
                core.pending.pop(job_id, None)
                self.metrics.finished.labels(queue, "cancelled").inc()
            core.mark_ended(job_id)
            if handed is not None:  # a queueing backend holds it: it goes from there too
                grace = self.settings.jobs.grace_period_seconds
                await self.backend.cancel(job_id, handed, grace, reason="cancelled")
                await self.backend.cleanup(job_id, handed)
        else:
            await self.audit.event(who, "cancel", job_id, before={"state": job.state}, after={"state": "cancelled"})
            await self.supervisor.cancel(job_id, dict(job.backend_state or {}), f"cancelled by {who}")
        await self.scheduler.schedule()
        return await self.job_dict(job_id)

    async def checkpoint(self, principal, job_id: str) -> dict:
        """Ask a running job the caller may control to save a checkpoint now (its code polls the count)."""
        job = await self.get(principal, job_id, write=True)
        save = await self.database.write(checkpoints.request_save, job.id, principal.name)
        return {"id": job.id, "save": save}

    async def reproduce(self, principal, job_id: str) -> dict:
        """Run a job the caller may see again, as the caller's new job (404 for a job they may not see)."""
        job = await self.get(principal, job_id)
        _status, answer = await self.reproduction.reproduce(principal, job)
        return await self.job_dict(answer["id"])

    async def compare(self, principal, job_id: str, other: str) -> dict:
        """What differs between two jobs the caller may see (404 for either one they may not)."""
        a = await self.get(principal, job_id)
        b = await self.get(principal, other)
        return await self.reproduction.compare(a, b)

    async def reprioritize(self, principal, job_id: str, priority: str) -> dict:
        require_admin(principal)
        job = await self.get(principal, job_id)
        await self.queues.reprioritize(principal, job, priority)
        return await self.job_dict(job_id)

    # the audit log, usage, allocations ------------------------------------------------------------
    async def usage(self, principal, *, user: str | None, by: str, start, end) -> dict:
        if not principal.admin:
            if user not in (None, principal.name) or by != "user":
                raise Forbidden(
                    "you may see only your own usage",
                    reason="not_admin",
                    field="user",
                    fix=f"ask for user={principal.name}, grouped by user",
                )
            user = principal.name
        body = await self.database.read(
            lambda s: usage.report(s, self.settings, start, end, by=by, owner=user, cache=self.usage_cache)
        )
        if principal.admin:
            body["idle_gpu_servers"] = await self.servers.idle()
        return body

    async def allocations(self, principal) -> dict:
        require_admin(principal)
        ledger = self.ledger

        def query(s):
            return [
                {
                    "device": a.device,
                    "holder_kind": a.holder_kind,
                    "holder_id": a.holder_id,
                    "owner": a.owner,
                    "flavor": a.flavor,
                    "since": a.since.isoformat() + "Z",
                }
                for a in ledger.allocations(s)
            ]

        return {"gpus": [g.to_dict() for g in ledger.inventory], "allocations": await self.database.read(query)}

    async def allocate_server(self, principal, body: dict) -> builtins.list[int]:
        require_admin(principal)
        return await self.servers.allocate(
            body["holder"], body["owner"], body["gpus"], profile=body.get("profile", ""), groups=body.get("groups", [])
        )

    async def release_server(self, principal, holder: str) -> None:
        require_admin(principal)
        await self.servers.release(holder)

    async def warm(self, principal, body: dict) -> dict:
        """Demand for a warm runner: a user's server started (the spawner) or a user about to submit.

        The profile is the one the user may use (their default when none is named); the runner
        starts in the background, within the pool's caps, and goes again after the pool's idle time.
        """
        user = body.get("user") or (principal.name if principal.is_user else None)
        if user is None:
            raise ValidationError("say whose runner to warm", field="user", fix="give user: NAME")
        if not principal.can_write(user):
            raise Forbidden(
                "you may warm runners only for yourself",
                reason="not_yours",
                field="user",
                fix=f"leave user out, or ask for user={principal.name}",
            )
        account = self.settings.account(user)  # refuses a user without a Unix account when they are on
        groups = await self.groups.groups_of(user, fallback=principal.groups if user == principal.name else ())
        profile = self.profiles.authorize(body.get("profile"), groups, admin=principal.admin and user == principal.name)
        warm = getattr(self.backend, "warm", None)  # only the local backend keeps warm runners
        if warm is not None:
            self.core.spawn(warm(profile.kernel_name, account))
        if self.mlflow is not None:  # their first job's start finds them an MLflow user already
            self.mlflow.prepare_user(user)
        return {"user": user, "profile": profile.slug, "warming": warm is not None}

    async def profiles_for(self, principal) -> dict:
        """The profiles the caller may use, and their default."""
        groups = await self.groups.groups_of(principal.name, fallback=principal.groups) if principal.is_user else ()
        default = self.profiles.default_for(groups, admin=principal.admin)
        return {
            "profiles": [p.to_dict() for p in self.profiles.for_user(groups, admin=principal.admin)],
            "default": default.slug if default else None,
        }

    async def queues_view(self) -> dict:
        """Every queue, whether the workbench drains, and the priority classes (everyone may read them)."""
        return {
            "queues": await self.queues.list(),
            "draining": self.core.draining,
            "priority_classes": self.settings.priority_classes,
            "default_priority_class": self.settings.default_priority_class,
        }

    async def lineage(self, principal, name: str, version: int) -> dict:
        """What made a model version, as far as the caller may read it (404 as the registry answers otherwise)."""
        return await model_lineage(self.models, self.database, self.settings.public_url, principal, name, version)

    def metrics_text(self, principal) -> bytes:
        if not principal.admin:
            raise Forbidden(
                "metrics are for admins (and Prometheus with an admin token)", reason="not_admin", fix=ADMIN_FIX
            )
        return self.metrics.exposition()

    # life ---------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Rebuild the model and re-attach to attempts that were running when the service stopped."""
        async with self.core.lock:
            await self.scheduler.rebuild_locked()
        await self.supervisor.recover()
        await self.scheduler.schedule()
        self.core.spawn(self.models.recover())  # evaluation gates: MLflow may be slower to start than we are
        self.core.spawn(self.runner_api.sweep())  # MLflow credentials of attempts that ended while we were away
        self.core.spawn(self.sweeps.run_forever())  # running sweeps are picked up where they were

    async def run_forever(self, interval: float = 2.0) -> None:
        await self.scheduler.run_forever(interval)

    async def stop(self) -> None:
        self.core.closing = True
        await self.supervisor.close()
        self.core.cancel_tasks()
        await self.backend.shutdown()
        self.submission.close()
        self.sweeps.close()
        self.database.close()


def _cancel_queued(s, job_id: str, who: str) -> tuple[str, dict | None]:
    row = s.get(Job, job_id)
    if row.state != JobState.queued.value:
        raise Conflict(f"job {job_id} started meanwhile; cancel it again", reason="raced")
    handed = dict(row.backend_state or {}) if handed_over(row) else None
    row.state = transition(row.state, JobState.cancelled).value
    row.reason = f"cancelled by {who} while queued"
    row.finished_at = utcnow()
    if handed is not None:
        attempt = row.attempts[-1]
        attempt.state, attempt.reason, attempt.finished_at, attempt.token_hash = "cancelled", row.reason, utcnow(), ""
    audit.append(s, who, "cancel", job_id, before={"state": "queued"}, after={"state": "cancelled"})
    return row.queue, handed
