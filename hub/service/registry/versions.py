"""Registered models: versions from runs, the evaluation gate, approvals, and aliases that follow them.

:class:`ModelRegistry` registers an MLflow model version from the run of a job the caller owns (which job
made which run is the service's record, set when it created the run; a run's tags are never evidence; admins
any job's run; any other run is a 404), from the run's MLflow 3 logged model or from
``runs:/RUN/ARTIFACT_PATH``. MLflow's version points there, but the registrant can still overwrite or delete
those files, so the service copies them first (:mod:`.copies`: never loaded or unpickled) into storage only it
writes, and the version's ``digest`` names that copy: approving re-verifies it and records the digest approved,
and loading (``GET .../files``, ``danlu.model``) serves and checks it. The
registered model is created by the service's MLflow admin, so users hold only the default permission on it
and MLflow refuses their alias and tag writes; a same-named MLflow model that Danlu did not create (no
``models`` row) is never written to (409). Danlu's database is the record (``models``, ``model_versions``,
``model_decisions``); the version's MLflow tags mirror it and are re-written until they do.

A model with an evaluation in danlu.yaml (:mod:`.evaluations`) gets an evaluation job per version, submitted
as the registrant's, whose run is in the service's own experiment; its gate is brought up to date whenever
the version is read or decided on, and at start-up (:meth:`ModelRegistry.recover`). Approval is pending ->
approved or rejected, once, by a member of ``models.approvers`` or an admin, with a comment; the registrant
may not decide unless ``models.self_approval``; approving needs a passed (or no) evaluation. Aliases move
only to approved versions, by approvers, through here. Reads show a version only to those who may read its
run's experiment (:mod:`.access`). Every decision, alias change, gate verdict and registration is an audit
record in the transaction of the change.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import shutil

from sqlalchemy import select

from danlu.errors import Conflict, DanluError, Forbidden, NotFound, Unreachable, ValidationError
from danlu.hub.service import validation
from danlu.hub.service.formats import MODEL, RESERVED_ALIAS, RUN_ID
from danlu.hub.service.jobs.submission import Submission
from danlu.hub.service.mlflow_client import MlflowAccess, MlflowRegistry, latest_metrics
from danlu.hub.service.registry import copies, evaluations, records
from danlu.hub.service.registry.access import ReadAccess
from danlu.hub.service.registry.records import mlflow_tags, model_to_dict, views_of
from danlu.hub.service.store.database import Database
from danlu.hub.service.store.orm import Job, ModelRecord, ModelVersionRecord, utcnow

FIND_FIX = "see the registered models with 'danlu models list' or GET /models"
RUN_FIX = (
    "register the run of one of your jobs: its id is the job's mlflow_run_id ('danlu jobs show'); runs made "
    "outside Danlu's jobs cannot be registered"
)


class ModelRegistry:
    def __init__(
        self,
        submission: Submission,
        *,
        database: Database,
        settings,
        groups,
        mlflow: MlflowAccess | None,
        log: logging.Logger,
    ):
        self.submission = submission
        self.database = database
        self.settings = settings
        self.groups = groups
        self.mlflow = mlflow.registry if mlflow is not None else None
        self.log = log
        self._registering = asyncio.Lock()  # one registration at a time: MLflow numbers versions, we record them
        self._settling = asyncio.Lock()
        self._aliasing = asyncio.Lock()  # an alias in MLflow and its audit record change together, one at a time
        self.access = ReadAccess(database, settings, self.mlflow, self._is_approver)
        self.max_bytes = copies.MAX_BYTES_DEFAULT  # of one version's files (c.JobsServiceApp.model_max_bytes)

    # who may do what ----------------------------------------------------------------------------
    def _api(self) -> MlflowRegistry:
        if self.mlflow is None:
            raise DanluError(
                "this workbench has no MLflow server, and models live in MLflow's registry",
                status=503,
                reason="no_mlflow",
                fix="an admin starts Danlu with MLflow (danlu up does by default)",
            )
        return self.mlflow

    async def _groups(self, principal) -> set[str]:
        if not principal.is_user:
            return set(principal.groups)
        return set(await self.groups.groups_of(principal.name, fallback=principal.groups))

    async def _is_approver(self, principal) -> bool:
        return principal.admin or bool((await self._groups(principal)) & set(self.settings.models.approvers))

    async def _require_approver(self, principal) -> None:
        approvers = self.settings.models.approvers
        if await self._is_approver(principal):
            return
        who = f"members of {', '.join(approvers)} and admins" if approvers else "admins"
        raise Forbidden(
            f"only {who} may approve or reject model versions and move their aliases",
            reason="not_an_approver",
            fix=f"ask one of the {who} (danlu.yaml models.approvers)",
        )

    async def _owner_of(self, run_id: str) -> tuple[str | None, str | None]:
        """``(owner, job id)`` of a run from the service's own record of which job made it (the service
        creates every job's run), else ``(None, None)``: a run's tags are the job's to write, never evidence."""
        job = await self.database.read(
            lambda s: s.scalars(select(Job).where(Job.mlflow_run_id == run_id).limit(1)).first()
        )
        return (job.owner, job.id) if job is not None else (None, None)

    # registering --------------------------------------------------------------------------------
    async def register(self, principal, body) -> tuple[int, dict]:
        validation.check_schema("ModelRegistration", body)
        if not principal.is_user:
            raise Forbidden(
                "only users register models; this token belongs to a service",
                reason="not_a_user",
                fix="register with a user's token (JUPYTERHUB_API_TOKEN in their server)",
            )
        name, run_id = body["name"], body["run_id"]
        check_registration(body)
        api = self._api()
        owner, job_id = await self._owner_of(run_id)
        run = await api.run(run_id) if owner is not None else None
        if run is None or not (principal.admin or owner == principal.name):
            raise NotFound(
                f"run {run_id} not found among the runs of your Danlu jobs",
                reason="no_such_run",
                field="run_id",
                fix=RUN_FIX,
            )
        source, model_id, files_uri = await self._source(api, run, body.get("artifact_path"))
        spec = self.settings.models.evaluations.get(name)
        notebook = await self._evaluation_notebook(spec) if spec else None
        copier = copies.Copier(api, self.settings.state_dir, self.max_bytes)
        staging, files = await copier.copy(files_uri)
        try:
            where = (source, model_id, job_id)
            row = await self._record(principal, api, body, copier, (staging, files), where, spec)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)  # gone already once it is in place
        if not await api.grant_read(principal.name, name):
            self.log.warning(
                "could not grant %s READ on model %s in MLflow: under NO_PERMISSIONS their evaluation "
                "job cannot load it",
                principal.name,
                name,
            )
        self.log.info("model %s version %s registered by %s from %s", name, row.version, principal.name, source)
        if spec:
            await self._evaluate(principal, row, spec, notebook)
        return 201, await self.version_view(principal, row.name, row.version)

    async def _record(self, principal, api, body, copier, copy, where, spec) -> ModelVersionRecord:
        """The version in MLflow, its copy moved into place, its row: one registration at a time."""
        (name, run_id), (staging, files), (source, model_id, job_id) = (body["name"], body["run_id"]), copy, where
        async with self._registering:
            if await self.database.read(lambda s: s.get(ModelRecord, name)) is None:
                if not await api.create_registered_model(name, body.get("description", "")):
                    raise Conflict(
                        f"MLflow has a registered model named {name} that Danlu did not create",
                        reason="name_taken",
                        field="name",
                        fix="choose another name; versions go only into models Danlu created, whose "
                        "aliases and tags no user can write around the approvals (an admin may "
                        "rename or delete the MLflow model)",
                    )
                await self.database.write(records.insert_model, name, body.get("description", ""), principal.name)
            row = ModelVersionRecord(
                name=name,
                run_id=run_id,
                job_id=job_id,
                source=source,
                model_id=model_id,
                registered_by=principal.name,
                registered_at=utcnow(),
                approval="pending",
                evaluation="queued" if spec else "not_required",
                thresholds=dict(spec["thresholds"]) if spec else {},
                metrics={},
                failures=[],
                synced=True,
                digest=copies.manifest_digest(files),
            )
            row.version = await api.create_version(
                name, source, run_id, model_id, mlflow_tags(row, None), body.get("description", "")
            )
            await asyncio.to_thread(copier.place, staging, name, row.version)
            await self.database.write(records.insert_version, row)
        return row

    async def _source(self, api: MlflowRegistry, run: dict, artifact_path: str | None) -> tuple[str, str | None, str]:
        """``(source, logged model id, URI of its files)``: the run's logged model (by name with
        ``artifact_path``), else its artifacts at ``runs:/RUN/ARTIFACT_PATH``; 400 with the fix when the run has
        neither."""
        info = run.get("info") or {}
        run_id, experiment_id = info.get("run_id", ""), str(info.get("experiment_id", ""))
        logged = await api.logged_models(experiment_id, run_id) if experiment_id else []
        if artifact_path is None:
            if len(logged) == 1:
                return f"models:/{logged[0]['model_id']}", logged[0]["model_id"], logged[0].get("artifact_uri", "")
            if logged:
                names = ", ".join(sorted(str(m.get("name")) for m in logged)[:10])
                raise ValidationError(
                    f"run {run_id} logged {len(logged)} models ({names})",
                    field="artifact_path",
                    reason="which_model",
                    fix="give artifact_path: the name of the one to register",
                )
            raise ValidationError(
                f"run {run_id} logged no model",
                field="artifact_path",
                reason="no_model",
                fix="log one in the job (mlflow.<flavor>.log_model(model, name='model')), or give "
                "artifact_path: the folder of its artifacts that holds the model",
            )
        named = [m for m in logged if m.get("name") == artifact_path]
        if named:
            return f"models:/{named[0]['model_id']}", named[0]["model_id"], named[0].get("artifact_uri", "")
        if await api.has_artifact(run_id, artifact_path):
            return f"runs:/{run_id}/{artifact_path}", None, f"{info.get('artifact_uri', '')}/{artifact_path}"
        raise ValidationError(
            f"run {run_id} has no logged model or artifact named {artifact_path}",
            field="artifact_path",
            reason="no_model",
            fix="give the name of a logged model or an artifact folder of the run (see its Artifacts tab in MLflow)",
        )

    async def _evaluation_notebook(self, spec: dict) -> dict:
        try:
            return await asyncio.to_thread(evaluations.read_notebook, spec["notebook"])
        except DanluError as e:
            self.log.error("model evaluation notebook: %s", e)
            raise DanluError(
                f"this model's evaluation cannot run: {e}",
                status=503,
                reason="evaluation_unavailable",
                fix=e.fix or "ask an admin",
            ) from None

    async def _evaluate(self, principal, row: ModelVersionRecord, spec: dict, notebook: dict) -> None:
        """Submit the evaluation job as the registrant; a refusal ends the gate in ``error``, naming it."""
        body = evaluations.job_body(row.name, row.version, notebook, spec, principal.name, row.digest)
        try:
            _, job = await self.submission.submit(principal, body, evaluation=True)
        except DanluError as e:
            await self.database.write(
                records.settle, row.id, "error", {}, [f"the evaluation job was refused: {e}"], None
            )
        else:
            await self.database.write(records.set_evaluation_job, row.id, job["id"])
        await self._sync()

    # reading ------------------------------------------------------------------------------------
    async def list(self, principal) -> builtins.list[dict]:
        """Every model, with the newest version the caller may read (:class:`~.access.ReadAccess`)."""
        await self.settle()

        def query(s):
            models = list(s.scalars(select(ModelRecord).order_by(ModelRecord.name)))
            rows = list(s.scalars(select(ModelVersionRecord).order_by(ModelVersionRecord.version)))
            if self.access.open:  # only the newest of each is shown: no need to read the others' decisions
                rows = list({r.name: r for r in rows}.values())
            return models, views_of(s, rows)

        models, views = await self.database.read(query)
        latest = {v["name"]: v for v in await self.access.readable(principal, views)}
        return [model_to_dict(m, [latest[m.name]] if m.name in latest else []) for m in models]

    async def show(self, principal, name: str) -> dict:
        await self.settle(name)

        def query(s):
            m = s.get(ModelRecord, name)
            if m is None:
                return None, []
            rows = list(
                s.scalars(
                    select(ModelVersionRecord)
                    .where(ModelVersionRecord.name == name)
                    .order_by(ModelVersionRecord.version)
                )
            )
            return m, views_of(s, rows)

        model, views = await self.database.read(query)
        if model is None:
            raise NotFound(f"model {name} not found", reason="no_such_model", field="name", fix=FIND_FIX)
        return model_to_dict(model, await self.access.readable(principal, views), every=True)

    async def version_view(self, principal, name: str, version: int) -> dict:
        """One version's API model, if the caller may read it (the lineage view calls this too); NotFound
        as the API answers, for a version they may not read too."""
        await self.settle(name, version)

        def query(s):
            row = records.version_row(s, name, version)
            return views_of(s, [row]) if row is not None else []

        views = await self.access.readable(principal, await self.database.read(query))
        if not views:
            raise await self._missing(name, version)
        return views[0]

    async def stored(self, principal, name: str, version: int, path: str | None = None) -> dict | int:
        """The manifest of the version's stored copy (if the caller may read the version), checked against the
        version's digest (409 if it changed; 404 ``not_copied`` for a version registered before copies); with
        ``path``, an open fd of that file of it (one the manifest lists)."""
        digest = (await self.version_view(principal, name, version))["digest"]
        if digest is None:
            raise copies.not_copied(name, version)
        state = self.settings.state_dir
        if path is not None:
            return await asyncio.to_thread(copies.open_file, state, name, version, digest, path)
        files = await asyncio.to_thread(copies.manifest, state, name, version, digest)
        return {"name": name, "version": version, "digest": digest, "files": files}

    async def _missing(self, name: str, version: int) -> NotFound:
        if await self.database.read(lambda s: s.get(ModelRecord, name)) is None:
            return NotFound(f"model {name} not found", reason="no_such_model", field="name", fix=FIND_FIX)
        return NotFound(
            f"model {name} has no version {version}",
            reason="no_such_version",
            field="version",
            fix=f"see its versions with 'danlu models show {name}'",
        )

    # deciding -----------------------------------------------------------------------------------
    async def decide(self, principal, name: str, version: int, body) -> dict:
        validation.check_schema("ModelDecisionRequest", body)
        await self.settle(name, version)
        row = await self.database.read(records.version_row, name, version)
        if row is None:
            raise await self._missing(name, version)
        await self._require_approver(principal)
        if row.registered_by == principal.name and not self.settings.models.self_approval:
            raise Forbidden(
                f"you registered {name} version {version}: someone else must decide on it",
                reason="self_approval",
                fix="ask another approver (danlu.yaml models.self_approval is false)",
            )
        if body["decision"] == "approve":
            if row.digest is None:
                raise Conflict(
                    f"{name} version {version} was registered before Danlu copied models: an approval names the "
                    "digest of a stored copy, and it has none",
                    reason="not_copied",
                    fix="reject it, and register its run again (the new version has a copy)",
                )
            await asyncio.to_thread(copies.verify, self.settings.state_dir, name, version, row.digest)
        decide = (name, version, principal.name, body["decision"], body["comment"], row.digest)
        await self.database.write(records.decide, *decide)
        self.log.info("model %s version %s: %s by %s", name, version, body["decision"], principal.name)
        await self._sync()
        return await self.version_view(principal, name, version)

    async def set_alias(self, principal, name: str, alias: str, body) -> dict:
        validation.check_schema("ModelAliasRequest", body)
        check_alias(alias)
        version = body["version"]
        row = await self.database.read(records.version_row, name, version)
        if row is None:
            raise await self._missing(name, version)
        await self._require_approver(principal)
        if row.approval != "approved":
            raise Conflict(
                f"{name} version {version} is {row.approval}: aliases move only to approved versions",
                reason="not_approved",
                field="version",
                fix=f"approve it first ('danlu models approve {name} {version} --comment ...')",
            )
        api = self._api()
        async with self._aliasing:
            await api.set_alias(name, alias, version)
            before = await self.database.write(records.alias, name, alias, version, principal.name)
        return {"name": name, "alias": alias, "version": version, "previous": before}

    async def delete_alias(self, principal, name: str, alias: str) -> dict:
        model = await self.database.read(lambda s: s.get(ModelRecord, name))
        if model is None:
            raise NotFound(f"model {name} not found", reason="no_such_model", field="name", fix=FIND_FIX)
        if alias not in (model.aliases or {}):
            raise NotFound(
                f"model {name} has no alias {alias}",
                reason="no_such_alias",
                field="alias",
                fix=f"see its aliases with 'danlu models show {name}'",
            )
        await self._require_approver(principal)
        api = self._api()
        async with self._aliasing:
            await api.delete_alias(name, alias)
            before = await self.database.write(records.alias, name, alias, None, principal.name)
        return {"name": name, "alias": alias, "version": None, "previous": before}

    # the evaluation gate and MLflow's copy --------------------------------------------------------
    async def settle(self, name: str | None = None, version: int | None = None) -> None:
        """Bring waiting evaluation gates up to date with their jobs (idempotent; MLflow away: next time)."""

        def waiting(s):
            q = select(
                ModelVersionRecord.id,
                ModelVersionRecord.evaluation_job,
                ModelVersionRecord.thresholds,
                ModelVersionRecord.evaluation,
            ).where(
                ModelVersionRecord.evaluation.in_(evaluations.WAITING), ModelVersionRecord.evaluation_job.is_not(None)
            )
            if name is not None:
                q = q.where(ModelVersionRecord.name == name)
            if version is not None:
                q = q.where(ModelVersionRecord.version == version)
            return [
                (row_id, s.get(Job, job_id), thresholds, state) for row_id, job_id, thresholds, state in s.execute(q)
            ]

        async with self._settling:
            changed = False
            for row_id, job, thresholds, state in await self.database.read(waiting):
                verdict = await self._verdict(job, thresholds)
                if verdict is None or verdict[0] == state:
                    continue
                await self.database.write(records.settle, row_id, *verdict, job.id if job is not None else None)
                changed = True
            if changed:
                await self._sync()

    async def _verdict(self, job: Job | None, thresholds: dict) -> tuple[str, dict, builtins.list] | None:
        if job is None:
            return "error", {}, ["the evaluation job is gone from the jobs database"]
        gate = evaluations.gate_of(job.state)
        if gate != "ended":
            return gate, {}, []
        if job.state != "succeeded":
            return "error", {}, [f"the evaluation job {job.id} {job.state}: {job.reason}"[:1000]]
        if not job.mlflow_run_id:
            return "error", {}, [f"the evaluation job {job.id} logged no MLflow run"]
        try:
            run = await self._api().run(job.mlflow_run_id)
        except (Unreachable, DanluError) as e:
            self.log.warning("evaluation of job %s not read yet: %s", job.id, e)
            return None
        if run is None:
            return "error", {}, [f"the evaluation run {job.mlflow_run_id} is not in MLflow"]
        metrics = latest_metrics(run)
        failures = evaluations.verdict(metrics, thresholds)
        return ("failed" if failures else "passed"), metrics, failures

    async def _sync(self) -> None:
        """Write the MLflow tags of versions whose row changed since (MLflow away: at the next change or start)."""
        if self.mlflow is None:
            return
        for row, decided_by in await self.database.read(records.unsynced):
            try:
                await self.mlflow.set_version_tags(row.name, row.version, mlflow_tags(row, decided_by))
            except DanluError as e:
                self.log.warning("MLflow tags of model %s version %s not written yet: %s", row.name, row.version, e)
                return
            await self.database.write(records.mark_synced, row.id, row.approval, row.evaluation)

    async def recover(self) -> None:
        """At start-up: gates whose evaluation was never submitted end in ``error``; the rest are settled."""
        try:
            await self.database.write(records.orphaned)
            await self.settle()
            await self._sync()
        except DanluError as e:
            self.log.warning("model evaluations not settled at start-up: %s", e)


def check_registration(body: dict) -> None:
    """What the document's patterns cannot say: no trailing newline, no ``.``/``..`` or empty path segment."""
    for key, pattern in (("name", MODEL), ("run_id", RUN_ID)):
        if not pattern.match(body[key]):
            raise ValidationError(
                f"{key}: {body[key][:40]!r} is not valid",
                field=key,
                reason="invalid_field",
                fix=f"it must match {pattern.pattern}",
            )
    path = body.get("artifact_path")
    if path is not None and (path.endswith("\n") or any(part in ("", ".", "..") for part in path.split("/"))):
        raise ValidationError(
            f"artifact_path: {path[:80]!r} is not a path inside the run's artifacts",
            field="artifact_path",
            reason="escapes_root",
            fix="give a relative path like 'model' or 'checkpoints/best', without '.' or '..'",
        )


def check_alias(alias: str) -> None:
    if RESERVED_ALIAS.match(alias):
        raise ValidationError(
            f"alias: {alias[:40]} is MLflow's own (latest and v<N> name versions)",
            field="alias",
            reason="reserved_alias",
            fix="choose another alias, e.g. champion or staging",
        )
