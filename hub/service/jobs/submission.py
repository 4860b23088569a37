"""Accepting a job: validate, resolve, and record its whole spec in the database.

:meth:`Submission.submit` checks everything a schema cannot say -- the
notebook, the parameters, the profile policy of the owner's groups, the
queue, the priority class, limits, whether the job could ever start here, the
working folder and the datasets (confined to their roots on their real
paths, or catalog versions ``NAME@VERSION`` the owner may read; a bare
``NAME`` is the latest version of a catalog dataset the owner may read, and
is refused when a file or folder of that name is in the job's folder too),
the MLflow experiment -- before anything is written. Then the job's row (identity,
profile, resources, parameters, datasets with their resolved paths and, for
catalog versions, digests; each with its context, training or evaluation, the cell's sha256) and its
notebook (a row of its own) are committed in state ``queued`` with a ``submit`` audit record, a
``dataset_uses`` row per catalog version, and its provenance (:mod:`.provenance`: what reproducing it
needs). That row is the job's
spec: what runs, and as whom, comes from here at every start, never from a
file the job could write. A dry run answers with the same checks and one
admission pass on a copy of the model.

What a submission waits for besides its own checks -- the notebook's validation
(on a thread of its own: a 64 MiB notebook takes seconds, which the event loop
must spend answering others), the owner's groups (the hub) and whether they may
write the experiment (MLflow) -- is begun at once and awaited where each is
needed, so a first submission waits for the slowest, not the sum; errors are
still reported in the same order. Making the owner an MLflow user, which a new
experiment does not need, is begun once the job is accepted, in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from danlu.digests import TRAINING
from danlu.errors import Forbidden, PolicyError, UsageError, ValidationError
from danlu.hub.backends.base import Backend
from danlu.hub.service import paths, validation
from danlu.hub.service.admission import quotas
from danlu.hub.service.admission.workloads import Workload
from danlu.hub.service.datasets.catalog import Catalog, record_uses
from danlu.hub.service.formats import DATASET, DATASET_REF
from danlu.hub.service.jobs import provenance
from danlu.hub.service.jobs.core import Core, workload_of
from danlu.hub.service.jobs.scheduler import DRAINING, Scheduler
from danlu.hub.service.mlflow_client import EVALUATIONS
from danlu.hub.service.states import JobState
from danlu.hub.service.store import audit
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.ledger import Ledger
from danlu.hub.service.store.orm import Job, JobInput, utcnow
from danlu.hub.service.store.rows import cell_sha256

#: notebooks validated at once, each on a thread (more wait their turn): they are bounded in size by the request
#: body, and more threads would only share one GIL
NOTEBOOK_CHECKS = 2


class Submission:
    def __init__(
        self,
        core: Core,
        scheduler: Scheduler,
        datasets: Catalog,
        *,
        database: Database,
        settings,
        profiles,
        groups,
        ledger: Ledger,
        backend: Backend,
        mlflow,
        log: logging.Logger,
    ):
        self.core = core
        self.backend = backend
        self.scheduler = scheduler
        self.datasets = datasets
        self.database = database
        self.settings = settings
        self.profiles = profiles
        self.groups = groups
        self.ledger = ledger
        self.mlflow = mlflow
        self.log = log
        self._notebooks = ThreadPoolExecutor(max_workers=NOTEBOOK_CHECKS, thread_name_prefix="danlu-notebook")

    def close(self) -> None:
        self._notebooks.shutdown(wait=False, cancel_futures=True)

    def _workdir(self, home: Path, cwd: str) -> Path:
        workdir = home / cwd
        real_home = os.path.realpath(home)
        real = os.path.realpath(workdir)
        if not (real == real_home or real.startswith(real_home.rstrip("/") + "/")):
            raise ValidationError(
                f"cwd: folder '{cwd}' leads outside your home (through a symbolic link)",
                field="cwd",
                reason="escapes_root",
                fix="use a folder inside your home",
            )
        if not os.path.isdir(real):
            raise ValidationError(
                f"cwd: folder '{cwd}' does not exist in your home",
                field="cwd",
                reason="no_folder",
                fix="create it, or give a folder relative to your home",
            )
        return workdir

    async def submit(
        self,
        principal,
        body,
        *,
        reproduces: str | None = None,
        pins: dict[int, dict] | None = None,
        evaluation: bool = False,
    ) -> tuple[int, dict]:
        """Accept a job; ``reproduces`` and ``pins`` (dataset index -> the digest a plain path must still have)
        come from :meth:`.reproduction.Reproduction.reproduce`, never from a request body; ``evaluation``
        from the model registry, whose evaluation jobs alone log into the service's evaluation experiments."""
        if not isinstance(body, dict):
            raise ValidationError(
                "the request body must be a JSON object",
                field="body",
                fix='send {"notebook": {...}} with Content-Type: application/json',
            )
        validation.check_schema("JobSubmission", body)
        if not principal.is_user:
            raise Forbidden(
                "only users submit jobs; this token belongs to a service",
                reason="not_a_user",
                fix="submit with a user's token (JUPYTERHUB_API_TOKEN in their server, or /hub/token)",
            )
        async with _background() as begin:
            return await self._submit(principal, body, begin, reproduces, pins, evaluation)

    async def _submit(
        self, principal, body: dict, begin, reproduces: str | None, pins: dict[int, dict] | None, evaluation: bool
    ) -> tuple[int, dict]:
        core = self.core
        settings, jobs = self.settings, self.settings.jobs
        owner = principal.name
        nb = body["notebook"]
        checked = begin(asyncio.get_running_loop().run_in_executor(self._notebooks, validation.check_notebook, nb))
        groups_of = begin(self.groups.groups_of(owner, fallback=principal.groups))
        node = await checked
        params = body.get("parameters", {})
        validation.check_parameters(params)
        resources = {"nproc": 1, "gpus": 0, "nodes": 1, **body.get("resources", {})}
        validation.check_nodes(resources, multi_node=self.scheduler.multi_node)
        if resources["nproc"] > jobs.max_nproc:
            raise ValidationError(
                f"resources.nproc must be at most {jobs.max_nproc}, got {resources['nproc']}",
                field="resources.nproc",
                reason="too_many_processes",
                fix=f"ask for at most {jobs.max_nproc} processes (jobs.max_nproc)",
            )
        if resources["gpus"] > self.ledger.total:
            raise PolicyError(
                f"resources.gpus: {resources['gpus']} GPUs asked, the workbench has {self.ledger.total}",
                field="resources.gpus",
                reason="not_enough_gpus",
            )
        if resources.get("gpu_type") and resources["gpu_type"] not in core.model.devices:
            raise ValidationError(
                f"resources.gpu_type: no GPUs of flavor '{resources['gpu_type']}' here",
                field="resources.gpu_type",
                fix=f"flavors: {', '.join(core.model.devices) or 'none'}",
            )
        if "memory" in resources:
            resources["memory"] = validation.check_size(resources["memory"], "resources.memory")
        retries = body.get("retries", jobs.default_retries)
        if retries > jobs.max_retries:
            raise ValidationError(
                f"retries must be at most {jobs.max_retries}",
                field="retries",
                fix=f"ask for at most {jobs.max_retries} retries (jobs.max_retries)",
            )
        timeout = body.get("timeout_seconds")
        if timeout is not None and timeout > jobs.max_runtime_seconds:
            raise ValidationError(
                f"timeout_seconds must be at most {jobs.max_runtime_seconds} (the workbench's max runtime)",
                field="timeout_seconds",
                fix="ask for less, or leave it out for the workbench's maximum",
            )
        cwd = paths.safe_relative_path(body.get("cwd", "."), "cwd")
        wanted = [_dataset_item(i, item) for i, item in enumerate(body.get("datasets", []))]
        refs = {i for i, (value, _, _) in enumerate(wanted) if DATASET_REF.match(value)}
        for i, (value, _, field) in enumerate(wanted):
            if i not in refs:
                paths.check_dataset(value, field, settings.dataset_roots)
        source = dict(body.get("source", {}))
        if source.get("notebook_path"):
            source["notebook_path"] = paths.safe_relative_path(source["notebook_path"], "source.notebook_path")
        stem = PurePosixPath(source.get("notebook_path") or "").stem
        experiment = body.get("experiment") or f"{owner}/{stem or 'jobs'}"
        if experiment.startswith(EVALUATIONS) != evaluation:
            raise PolicyError(
                f"experiment '{experiment}': {EVALUATIONS}... holds the service's model evaluations only",
                reason="experiment_not_yours",
                field="experiment",
                fix=f"name it '{owner}/...' or leave it out",
            )
        writable = (
            begin(self.mlflow.check_experiment(experiment, owner, principal.admin, self.groups.exists))
            if self.mlflow is not None and not evaluation
            else None
        )
        account = settings.account(owner)  # refuses a user without a Unix account when they are on
        groups = await groups_of
        profile = self.profiles.authorize(
            body.get("profile"), groups, admin=principal.admin, gpus=resources["gpus"], gpu_field="resources.gpus"
        )
        queue = quotas.queue_for(settings, body.get("queue"), groups, admin=principal.admin)
        priority_class, priority = quotas.priority_of(settings, body.get("priority"))
        request = quotas.request_for(resources, resources["nproc"] * resources["nodes"], profile)
        probe = Workload("(new)", queue, priority, time.time(), request, owner)
        never = core.model.impossible(probe)
        if never:
            raise PolicyError(f"this job could never start: {never}", reason="never_fits", field="resources")
        home = settings.user_home(owner)
        if account is None:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)  # users may submit before ever starting a server
        workdir = self._workdir(home, cwd)
        datasets = []
        for i, (value, context, field) in enumerate(wanted):
            # a catalog version: its files are re-verified against its digest when the job starts
            entry = await self._catalog_entry(principal, value, field, workdir, i in refs)
            if entry is None:
                name, path = paths.resolve_dataset(
                    value, workdir=workdir, home=home, roots=settings.dataset_roots, field=field
                )
                entry = {"name": name, "path": str(path), **(pins or {}).get(i, {})}
            datasets.append({**entry, "context": context})
        name = body.get("name") or (re.sub(r"[^A-Za-z0-9._-]", "-", stem).strip("-.")[:60] or "job")
        if writable is not None:
            await writable
        cell_id, sha = cell_sha256(nb)
        source.setdefault("cell_id", cell_id)
        # the job runs on its profile's kernel, whatever the notebook was saved with
        node.metadata["kernelspec"] = {
            "name": profile.kernel_name,
            "display_name": profile.display_name,
            "language": "python",
        }
        node.metadata.setdefault("language_info", {"name": "python"})
        if body.get("dry_run"):
            return 200, await self._dry_run(node, params, profile, resources, probe)

        environment = await provenance.environment_of(profile, in_image=self.backend.runs_in_images)
        record = provenance.build(
            profile=profile.slug,
            environment=environment,
            parameters=params,
            nb=node,
            source=source,
            datasets=datasets,
            cell_sha256=sha,
            reproduces=reproduces,
        )
        job = Job(
            id=uuid.uuid4().hex[:12],
            owner=owner,
            name=name,
            state=JobState.queued.value,
            reason="",
            profile=profile.slug,
            queue=queue,
            priority=priority,
            priority_class=priority_class,
            nproc=resources["nproc"],
            nnodes=resources["nodes"],
            gpus=request.gpus,
            gpu_type=request.gpu_flavor,
            cpu=request.cpu,
            memory=request.memory,
            retries=retries,
            timeout_seconds=timeout,
            parameters=params,
            experiment=experiment,
            datasets=datasets,
            source=source,
            cwd=cwd,
            groups=list(groups),
            cell_sha256=sha,
            created_at=utcnow(),
            provenance=record,
            reproduces=reproduces,
        )
        job.queued_at = job.created_at
        notebook = json.dumps(node)
        after = {
            "queue": queue,
            "priority": priority_class,
            "profile": profile.slug,
            "resources": resources,
            "name": name,
        }
        if reproduces:
            after["reproduces"] = reproduces
        async with core.lock:
            await self.database.write(_insert, job, notebook, after)
            core.pending[job.id] = workload_of(job)
        if self.mlflow is not None:
            self.mlflow.prepare_user(owner)  # done before the job's start needs it, usually
        self.log.info("job %s submitted by %s (%s, queue %s, %s)", job.id, owner, profile.slug, queue, resources)
        await self.scheduler.schedule()
        return 201, {"id": job.id}

    async def _catalog_entry(self, principal, value: str, field: str, workdir: Path, ref: bool) -> dict | None:
        """The catalog version ``value`` names (``NAME@VERSION``, or a bare ``NAME`` the caller may read: the
        latest), or None for a path; a bare name that is also a file or folder in the job's folder is refused."""
        if ref:
            return await self.datasets.resolve(principal, value, field)
        if not DATASET.match(value):
            return None
        entry = await self.datasets.readable_latest(principal, value, field)
        if entry is not None and os.path.lexists(workdir / value):
            raise UsageError(
                f"{field}: '{value}' is both a dataset of the catalog and a file or folder in the job's folder",
                field=field,
                reason="ambiguous_dataset",
                fix=f"write ./{value} for the file or folder, or {value}@latest for the catalog's "
                f"latest version ({entry['name']})",
            )
        return entry

    async def _dry_run(self, node, params: dict, profile, resources: dict, probe: Workload) -> dict:
        # deferred: papermill takes ~0.4 s to import; only a dry run renders parameters here
        from papermill.parameterize import parameterize_notebook

        core = self.core
        # what papermill's load_notebook_node does before parameterizing
        node.metadata.setdefault("papermill", {})
        for cell in node.cells:
            cell.metadata.setdefault("tags", [])
        rendered = (
            parameterize_notebook(node, params, report_mode=False, kernel_name=profile.kernel_name, language="python")
            if params
            else node
        )
        async with core.lock:
            sim = copy.deepcopy(core.model)
            decision = sim.cycle([copy.copy(w) for w in core.pending.values()] + [probe], time.time(), preempt=True)
        admitted = any(w.id == probe.id for w in decision.admitted)
        if core.draining:
            admitted, reason = False, DRAINING
        else:
            reason = "would start now" if admitted else decision.waiting.get(probe.id, "would wait")
        return {
            "dry_run": True,
            "admitted": admitted,
            "reason": reason,
            "queue": probe.team,
            "queue_position": decision.positions.get(probe.id),
            "profile": profile.slug,
            "resources": resources,
            "notebook": dict(rendered),
        }


@contextlib.asynccontextmanager
async def _background():
    """``begin(awaitable)``: run it from now on and await it later; whatever has not been awaited when the
    block ends (a check before it refused the job) is cancelled, and its outcome dropped."""
    begun: list[asyncio.Future] = []

    def begin(awaitable) -> asyncio.Future:
        future = asyncio.ensure_future(awaitable)
        begun.append(future)
        return future

    try:
        yield begin
    finally:
        for future in begun:
            if not future.done():
                future.cancel()
            future.add_done_callback(_drop)


def _drop(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a refused job's other checks need not be reported


def _dataset_item(i: int, item) -> tuple[str, str, str]:
    """``(value, context, field)`` of ``datasets[i]``: a string (training) or ``{"ref", "context"}``."""
    if isinstance(item, str):
        return item, TRAINING, f"datasets[{i}]"
    return item["ref"], item.get("context", TRAINING), f"datasets[{i}].ref"


def _insert(s, job: Job, notebook: str, after: dict) -> None:
    s.add(job)
    s.add(JobInput(job_id=job.id, notebook=notebook))
    s.flush()
    record_uses(s, job.id, None, job.datasets)
    audit.append(s, job.owner, "submit", job.id, after=after)
