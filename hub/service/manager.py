"""The jobs service's facade: everything the HTTP handlers call, with no HTTP in it.

:class:`JobManager` builds the parts -- :class:`~danlu.hub.service.jobs.submission.Submission`,
:class:`~danlu.hub.service.jobs.scheduler.Scheduler`, :class:`~danlu.hub.service.jobs.supervisor.Supervisor` (the
execution manager), :class:`~danlu.hub.service.jobs.runner_api.Reports` (the runner API),
:class:`~danlu.hub.service.jobs.queues.Queues`, :class:`~danlu.hub.service.jobs.servers.Servers`,
:class:`~danlu.hub.service.datasets.catalog.Catalog` (datasets),
:class:`~danlu.hub.service.jobs.reproduction.Reproduction` (re-running a job, comparing two),
:class:`~danlu.hub.service.registry.versions.ModelRegistry` (models, evaluations, approvals) -- around one
:class:`~danlu.hub.service.jobs.core.Core`, and answers for a caller: who may see or control which
job (404, never 403, for someone else's), reading a job's log and notebooks
through the backend, the audit log, usage, allocations. Authorization lives
here, not in the handlers.
"""

from __future__ import annotations

import asyncio
import os

from sqlalchemy import func, select

from danlu.errors import Conflict, DanluError, Forbidden, NotFound, ValidationError
from danlu.hub.service.datasets.catalog import Catalog, uses_of_jobs
from danlu.hub.service.jobs import outputs, views
from danlu.hub.service.jobs.core import Core
from danlu.hub.service.jobs.experiments import experiments_of
from danlu.hub.service.jobs.queues import ADMIN_FIX, Queues, require_admin
from danlu.hub.service.jobs.reproduction import Reproduction
from danlu.hub.service.jobs.runner_api import Reports
from danlu.hub.service.jobs.scheduler import Scheduler
from danlu.hub.service.jobs.servers import Servers
from danlu.hub.service.jobs.submission import Submission
from danlu.hub.service.jobs.supervisor import Supervisor, handed_over
from danlu.hub.service.jobs.views import JOB_ID, job_to_dict
from danlu.hub.service.registry.versions import ModelRegistry
from danlu.hub.service.states import FINAL, JobState, transition
from danlu.hub.service.store import audit, listing
from danlu.hub.service.store.orm import AuditRecord, Flag, Job, JobInput, utcnow
from danlu.hub.service.usage import reports as usage


class JobManager:
    def __init__(self, **kwargs):
        self.core = core = Core(**kwargs)
        self.supervisor = Supervisor(core)
        self.scheduler = Scheduler(core, self.supervisor)
        self.catalog = Catalog(core)
        self.submission = Submission(core, self.scheduler, self.catalog)
        self.reports = Reports(core, self.supervisor, self.catalog)
        self.queues = Queues(core, self.scheduler)
        self.servers = Servers(core, self.scheduler)
        self.reproduction = Reproduction(core, self.submission, self.catalog)
        self.models = ModelRegistry(core, self.submission)
        self.usage_cache = usage.Cache()
        self.view_cache = views.ViewCache()

    # shortcuts the app and the handlers use ------------------------------------------------------
    @property
    def settings(self):
        return self.core.settings

    @property
    def profiles(self):
        return self.core.profiles

    @property
    def groups(self):
        return self.core.groups

    @property
    def backend(self):
        return self.core.backend

    @property
    def metrics(self):
        return self.core.metrics

    @property
    def draining(self) -> bool:
        return self.core.draining

    # reading ----------------------------------------------------------------------------------
    async def get(self, principal, job_id: str, *, write: bool = False) -> Job:
        """A job the caller may see (and, with ``write``, control); 404 otherwise, never 403."""
        if not isinstance(job_id, str) or not JOB_ID.match(job_id):
            raise ValidationError(f"'{str(job_id)[:40]}' is not a job id (12 hex digits)", field="id",
                                  reason="bad_id")
        job = await self.core.read(lambda s: s.get(Job, job_id))
        allowed = job is not None and (principal.can_write(job.owner) if write else principal.can_read(job.owner))
        if not allowed:
            raise NotFound(f"job {job_id} not found", reason="no_such_job", field="id",
                           fix="see the jobs you may read with 'danlu jobs list' or GET /jobs")
        return job

    def _listing(self, principal, states: list[str] | None, owner: str | None,
                 cursor: str | None) -> tuple[str | None, listing.Key | None]:
        """Whose jobs a listing may read (None: everyone's, for admins) and the key it starts below; 403 for a
        user asking for another's, 400 for an unknown state or a bad cursor, before anything is read."""
        if owner and owner != principal.name and not principal.admin:
            raise Forbidden("only admins can list other users' jobs", reason="not_admin", field="owner",
                            fix=f"leave owner out, or ask for owner={principal.name}")
        for state in states or []:
            if state not in JobState.__members__:
                raise ValidationError(f"unknown state '{state[:40]}'", field="state",
                                      fix=f"use {', '.join(JobState.__members__)}")
        after = listing.decode_cursor(cursor) if cursor is not None else None
        return ((owner or None) if principal.admin else principal.name), after

    async def page(self, principal, *, states: list[str] | None = None, owner: str | None = None,
                   queue: str | None = None, limit: int = 200,
                   cursor: str | None = None) -> tuple[list[Job], str | None]:
        """A page of the jobs the caller may see, newest first, and the cursor of the next page (None: the last)."""
        who, after = self._listing(principal, states, owner, cursor)
        jobs, last = await self.core.read(lambda s: listing.page(s, owner=who, states=list(states or []), queue=queue,
                                                                 limit=limit, after=after))
        return jobs, (listing.encode_cursor(last) if last is not None else None)

    async def page_json(self, principal, *, states: list[str] | None = None, owner: str | None = None,
                        queue: str | None = None, limit: int = 200, cursor: str | None = None) -> str:
        """:meth:`page` with :meth:`views` of its jobs, as the body of ``GET /jobs`` (JSON text, the same bytes).

        Read, built and encoded in one go on a reader thread: what its jobs' views show, read with the
        page itself, then their attempts and dataset uses (a select each, no ORM objects), and each view
        encoded, or taken from :attr:`view_cache` when the job has ended and its stored values are those
        the cached view was built from. Which jobs are on the page is decided by the caller's filter
        alone; the cache only ever answers for those.
        """
        who, after = self._listing(principal, states, owner, cursor)

        def body(s) -> str:
            found, last = listing.rows(s, views.STORED_COLUMNS, owner=who, states=list(states or []),
                                       queue=queue, limit=limit, after=after)
            jobs = views.stored(s, [row for _key, row in found])
            return listing.encode_page(self.view_cache.encoded(self.core, jobs),
                                       listing.encode_cursor(last) if last is not None else None)

        return await self.core.read(body)

    async def list(self, principal, **kwargs) -> list[Job]:
        """The first page (or the page at ``cursor``) of :meth:`page`, without the next cursor."""
        return (await self.page(principal, **kwargs))[0]

    async def experiments(self, principal, owner: str | None = None) -> list[dict]:
        """The MLflow experiments holding a user's job runs (the caller's, or for admins anyone's)."""
        owner = owner or principal.name
        if owner != principal.name and not principal.admin:
            raise Forbidden("only admins can list other users' experiments", reason="not_admin", field="owner",
                            fix=f"leave owner out, or ask for owner={principal.name}")
        return await self.core.read(experiments_of, owner)

    def to_dict(self, job: Job, inputs: list[dict] | None = None) -> dict:
        return job_to_dict(self.core, job, inputs)

    async def views(self, jobs: list[Job]) -> list[dict]:
        """The API models of ``jobs``, with the dataset versions each used (one query for all), built on a
        reader thread: a page of 1000 jobs costs the event loop nothing but the wait."""
        def build(s):
            uses = uses_of_jobs(s, [j.id for j in jobs])
            return [self.to_dict(j, uses.get(j.id, [])) for j in jobs]

        return await self.core.read(build)

    async def job_dict(self, job_id: str) -> dict:
        return (await self.views([await self.core.read(lambda s: s.get(Job, job_id))]))[0]

    async def input_notebook(self, principal, job_id: str) -> tuple[Job, bytes]:
        job = await self.get(principal, job_id)
        row = await self.core.read(lambda s: s.get(JobInput, job.id))
        if row is None:
            raise NotFound(f"job {job.id} has no notebook on record", reason="no_output")
        return job, row.notebook.encode()

    def _files_state(self, job: Job) -> dict:
        """The backend state to read a job's files with: whose files they must be, even before it started."""
        state = dict(job.backend_state or {}) if isinstance(job.backend_state, dict) else {}
        if not isinstance(state.get("uid"), int):
            try:
                account = self.core.settings.account(job.owner) if self.core.settings.unix_accounts else None
            except DanluError:  # the account is gone: nothing in that folder is anyone's we would serve
                return {**state, "uid": -1}
            state["uid"] = account.uid if account is not None else os.geteuid()
        return state

    async def read_log(self, job: Job, offset: int, limit: int) -> tuple[bytes, int]:
        return await self.core.backend.read_log(job.id, self._files_state(job), offset, limit)

    async def read_output(self, job: Job, rank: int, offset: int, limit: int) -> tuple[bytes, int] | None:
        ranks = job.nproc * (job.nnodes or 1)
        if rank >= ranks:
            raise NotFound(f"job {job.id} has ranks 0-{ranks - 1}", field="rank", reason="no_such_rank")
        answer = await self.core.backend.read_output(job.id, self._files_state(job), rank, offset, limit)
        if answer is None:  # a runner whose folder the service cannot read handed it over (a pod)
            answer = await asyncio.to_thread(outputs.read, self.core.settings.state_dir, job.id, rank, offset, limit)
        return answer

    def ended(self, job_id: str) -> asyncio.Event:
        return self.core.ended(job_id)

    async def counts(self) -> dict:
        """Jobs per state."""
        return await self.core.read(lambda s: dict(s.execute(select(Job.state, func.count())
                                                             .group_by(Job.state)).all()))

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
                queue, handed = await core.db(_cancel_queued, job_id, who)
                core.pending.pop(job_id, None)
                core.metrics.finished.labels(queue, "cancelled").inc()
            core.mark_ended(job_id)
            if handed is not None:  # a queueing backend holds it: it goes from there too
                grace = core.settings.jobs["grace_period_seconds"]
                await core.backend.cancel(job_id, handed, grace, reason="cancelled")
                await core.backend.cleanup(job_id, handed)
        else:
            await self.audit_event(who, "cancel", job_id, before={"state": job.state}, after={"state": "cancelled"})
            await self.supervisor.cancel(job_id, dict(job.backend_state or {}), f"cancelled by {who}")
        await self.scheduler.schedule()
        return await self.job_dict(job_id)

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
    async def audit_event(self, actor: str, action: str, target: str, before=None, after=None) -> dict:
        """Append to the audit log outside an admission pass (one writer at a time keeps the chain whole)."""
        async with self.core.lock:
            return await self.core.db(lambda s: audit.to_dict(audit.append(s, actor, action, target, before=before,
                                                                           after=after)))

    async def record_login(self, principal, body: dict) -> dict:
        if not (principal.kind == "service" and principal.name == "danlu-admin"):
            raise Forbidden("only the hub records logins", reason="not_the_hub",
                            fix="logins are recorded by the hub itself; read them with GET /audit?action=login")
        return await self.audit_event(body["actor"], body["action"], "workbench", after=body.get("details", {}))

    async def audit_records(self, principal, *, limit: int, action: str | None, target: str | None) -> list[dict]:
        if not principal.admin:
            raise Forbidden("the audit log is for admins", reason="not_admin", fix=ADMIN_FIX)

        def query(s):
            q = select(AuditRecord).order_by(AuditRecord.seq.desc()).limit(limit)
            if action:
                q = q.where(AuditRecord.action == action)
            if target:
                q = q.where(AuditRecord.target == target)
            return [audit.to_dict(r) for r in s.scalars(q)]

        return await self.core.read(query)

    async def audit_verify(self, principal) -> dict:
        if not principal.admin:
            raise Forbidden("the audit log is for admins", reason="not_admin", fix=ADMIN_FIX)
        return await self.core.read(lambda s: audit.verify(s).to_dict())

    def record_profiles(self, profiles) -> None:
        """Audit a change of the governed profiles since the service last started (at start-up)."""
        now = {p.slug: {"display_name": p.display_name, "environment": p.environment, "groups": list(p.groups),
                        "gpus": list(p.gpu_choices), "requirements": p.requirements_digest()} for p in profiles}
        with self.core.sessions() as s, s.begin():
            flag = s.get(Flag, "profiles")
            before = flag.value.get("profiles", {}) if flag and isinstance(flag.value, dict) else None
            if before == now:
                return
            changed = {slug for slug in set(now) | set(before or {}) if (before or {}).get(slug) != now.get(slug)}
            audit.append(s, "danlu", "change_profiles", profiles.source,
                         before={slug: (before or {}).get(slug) for slug in sorted(changed)},
                         after={slug: now.get(slug) for slug in sorted(changed)})
            s.merge(Flag(key="profiles", value={"profiles": now}))

    async def usage(self, principal, *, user: str | None, by: str, start, end) -> dict:
        if not principal.admin:
            if user not in (None, principal.name) or by != "user":
                raise Forbidden("you may see only your own usage", reason="not_admin", field="user",
                                fix=f"ask for user={principal.name}, grouped by user")
            user = principal.name
        body = await self.core.read(lambda s: usage.report(s, self.core.settings, start, end, by=by, owner=user,
                                                           cache=self.usage_cache))
        if principal.admin:
            body["idle_gpu_servers"] = await self.servers.idle()
        return body

    async def allocations(self, principal) -> dict:
        require_admin(principal)
        ledger = self.core.ledger

        def query(s):
            return [{"device": a.device, "holder_kind": a.holder_kind, "holder_id": a.holder_id, "owner": a.owner,
                     "flavor": a.flavor, "since": a.since.isoformat() + "Z"} for a in ledger.allocations(s)]

        return {"gpus": [g.to_dict() for g in ledger.inventory], "allocations": await self.core.read(query)}

    async def allocate_server(self, principal, body: dict) -> list[int]:
        require_admin(principal)
        return await self.servers.allocate(body["holder"], body["owner"], body["gpus"],
                                           profile=body.get("profile", ""), groups=body.get("groups", []))

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
            raise Forbidden("you may warm runners only for yourself", reason="not_yours", field="user",
                            fix=f"leave user out, or ask for user={principal.name}")
        account = self.core.settings.account(user)  # refuses a user without a Unix account when they are on
        groups = await self.core.groups.groups_of(user, fallback=principal.groups if user == principal.name else ())
        profile = self.core.profiles.authorize(body.get("profile"), groups,
                                               admin=principal.admin and user == principal.name)
        warm = getattr(self.core.backend, "warm", None)  # only the local backend keeps warm runners
        if warm is not None:
            self.core.spawn(warm(profile.kernel_name, account))
        if self.core.mlflow is not None:  # their first job's start finds them an MLflow user already
            self.core.mlflow.prepare_user(user)
        return {"user": user, "profile": profile.slug, "warming": warm is not None}

    def metrics_text(self, principal) -> bytes:
        if not principal.admin:
            raise Forbidden("metrics are for admins (and Prometheus with an admin token)", reason="not_admin",
                            fix=ADMIN_FIX)
        return self.core.metrics.exposition()

    # life ---------------------------------------------------------------------------------------
    async def recover(self) -> None:
        """Rebuild the model and re-attach to attempts that were running when the service stopped."""
        async with self.core.lock:
            await self.scheduler.rebuild_locked()
        await self.supervisor.recover()
        await self.scheduler.schedule()
        self.core.spawn(self.models.recover())  # evaluation gates: MLflow may be slower to start than we are

    async def run_forever(self, interval: float = 2.0) -> None:
        await self.scheduler.run_forever(interval)

    async def stop(self) -> None:
        self.core.closing = True
        await self.supervisor.close()
        self.core.cancel_tasks()
        await self.core.backend.shutdown()
        self.submission.close()
        self.core.close()


def _cancel_queued(s, job_id: str, who: str) -> str:
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
