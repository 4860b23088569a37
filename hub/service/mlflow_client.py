"""MLflow as the jobs service sees it: a job's run and its attempt's credentials, checked experiments,
and the REST calls of the model registry.

:class:`MlflowAccess` is what the service needs of MLflow for a job: the
job's run, created by the service, and the environment a job's runner and kernels get
(:meth:`~MlflowAccess.open_run`: the loopback tracking URI and, with MLflow's permissions on,
credentials of the attempt's own MLflow user, confined to that run and deleted with the attempt
by :meth:`~MlflowAccess.expire`), making sure the owner exists as an
MLflow user before their job runs (:meth:`~MlflowAccess.ensure_user`; begun in the background
by :meth:`~MlflowAccess.prepare_user` when their server starts or their job is accepted, so
that neither a submission nor a start waits for MLflow to create a user), and
refusing at submission an experiment the owner could not write
(:meth:`~MlflowAccess.check_experiment`), and reading a run's final metrics as the
workbench's MLflow admin (:meth:`~MlflowAccess.final_metrics`, for comparing two jobs).
The permission system itself is :mod:`danlu.hub.mlflow_auth`'s; without its
secret (a bare MLflow) there is nothing to provision or check.

:class:`MlflowRegistry` (``MlflowAccess.registry``) reads runs, their logged models, artifacts and metrics,
and writes registered models, model versions, their tags and aliases, and READ grants -- always as
:data:`~danlu.hub.mlflow_auth.SERVICE_ACCOUNT`, the admin that ``danlu up`` configures. Because the service
creates every registered model Danlu governs, users hold only the default permission (READ) on it, so MLflow
itself refuses them alias and tag writes, through the gateway or directly. Every call is async (tornado's
client, never the event loop blocked), has a timeout, and reads at most :data:`MAX_ANSWER` bytes of answer;
nothing here downloads or loads a model.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from danlu import tags
from danlu.errors import DanluError, PolicyError, Unreachable
from danlu.hub import mlflow_auth
from danlu.hub.service.formats import RUN_ID

#: how long an experiment found writable by its owner is taken as writable, and how many are remembered
CHECKED_FOR = 60.0
MAX_CHECKED = 10_000
#: the most bytes of one MLflow answer the service reads (a run with many metrics and tags fits)
MAX_ANSWER = mlflow_auth.MAX_ANSWER
#: the most logged models of one run the service looks at
MAX_LOGGED_MODELS = 100
#: the most metrics of one run the service reads
MAX_METRICS = 200
MISSING = ("RESOURCE_DOES_NOT_EXIST",)
#: the name space of the experiments the service creates (as its MLflow admin) for model evaluations
EVALUATIONS = "danlu-evaluations/"


class MlflowAccess:
    def __init__(self, tracking_uri: str, secret: str | None = None, log: logging.Logger | None = None):
        self.tracking_uri = tracking_uri
        self.secret = secret or None
        self.users = mlflow_auth.MlflowUsers(tracking_uri, self.secret) if self.secret and tracking_uri else None
        #: the model registry's calls, as the workbench's MLflow admin (None: no MLflow)
        self.registry = MlflowRegistry(tracking_uri, self.secret) if tracking_uri else None
        self.log = log or logging.getLogger("danlu.jobs")
        self._writable: dict[tuple[str, str], float] = {}  # (owner, experiment) -> checked until
        self._users: set[str] = set()  # owners made MLflow users by this process
        self._making: dict[str, asyncio.Future] = {}  # owner -> the making of their MLflow user, under way

    async def open_run(
        self,
        job_id: str,
        attempt: int,
        owner: str,
        experiment: str,
        run_id: str | None,
        run_tags: dict,
        models=(),
    ) -> dict:
        """The job's MLflow run, made by the service, and this attempt's credentials for it alone.

        The first attempt's run is created as the job's owner in the job's experiment (created as the owner
        when it is new, so the owner holds MANAGE on it); an evaluation's experiment (:data:`EVALUATIONS`)
        is the service's own, where the registrant holds only the default permission. Every attempt gets an
        MLflow user of its own (:func:`~danlu.hub.mlflow_auth.job_username`, never an admin, whoever the
        owner is) with EDIT on that experiment and READ on ``models``; :meth:`expire` deletes it when the
        attempt ends. Answers ``{"run_id", "experiment_id", "env"}``; Unreachable or a 502 if MLflow fails.
        """
        api = self.registry
        as_service = experiment.startswith(EVALUATIONS)
        if self.secret:
            await self.ensure_user(owner)
        headers = dict(api.headers)
        if self.secret and not as_service:
            headers["Authorization"] = mlflow_auth.basic_authorization(owner, self.secret)
        if run_id:
            run = await api.run(run_id)
            if run is None:
                raise DanluError(f"the job's MLflow run {run_id} is gone from MLflow", reason="run_gone", status=409)
            experiment_id = str((run.get("info") or {}).get("experiment_id"))
        else:
            experiment_id = await self._experiment(headers, experiment, owner)
            code, data = await mlflow_auth.rest(
                api.url,
                headers,
                "POST",
                "/api/2.0/mlflow/runs/create",
                body={
                    "experiment_id": experiment_id,
                    "run_name": run_tags.get(tags.RUN_NAME, ""),
                    "start_time": int(time.time() * 1000),
                    "tags": [{"key": k, "value": str(v)[:5000]} for k, v in run_tags.items() if v],
                },
            )
            if code != 200:
                raise api.refused(f"create the run of job {job_id} in {experiment}", code, data)
            run_id = data["run"]["info"]["run_id"]
        env = {"MLFLOW_TRACKING_URI": self.tracking_uri}
        if self.secret:
            username = mlflow_auth.job_username(job_id, attempt, run_id)
            await self.users.ensure_user(username, admin=False)
            await self._grant(username, "experiment", experiment_id, "EDIT")
            for name in models:
                await self._grant(username, "registered_model", name, "READ")
            env.update(mlflow_auth.job_environment(username, self.secret))
        return {"run_id": run_id, "experiment_id": experiment_id, "env": env}

    async def expire(self, job_id: str, attempt: int, run_id: str | None) -> None:
        """The attempt's MLflow user is deleted: its credentials stop working (an absent MLflow: logged)."""
        if self.users is None or not run_id:
            return
        username = mlflow_auth.job_username(job_id, attempt, run_id)
        try:
            code, data = await self.registry.call("DELETE", "/api/2.0/mlflow/users/delete", body={"username": username})
        except Unreachable as e:
            self.log.warning("the MLflow user %s was not deleted (%s): it is deleted at the next start", username, e)
            return
        self.users._known.pop(username, None)
        if code != 200 and data.get("error_code") not in MISSING:
            self.log.warning("the MLflow user %s was not deleted: %s", username, data.get("message"))

    async def sweep(self, running: set[tuple[str, int]]) -> int:
        """Delete every attempt's MLflow user but those of ``running`` attempts ``(job id, number)``: the
        attempts that ended while this service was not there to expire them. Answers how many went."""
        if self.users is None:
            return 0
        code, data = await self.registry.call("GET", "/api/2.0/mlflow/users/list")
        if code != 200:
            raise self.registry.refused("list MLflow's users", code, data)
        gone = 0
        for user in data.get("users") or []:
            name = user.get("username") if isinstance(user, dict) else None
            parts = name.split("/") if isinstance(name, str) and name.startswith(mlflow_auth.JOB_PREFIX) else []
            if len(parts) == 4 and parts[2].isdigit() and (parts[1], int(parts[2])) not in running:
                await self.expire(parts[1], int(parts[2]), parts[3])
                gone += 1
        return gone

    async def _experiment(self, headers: dict, name: str, owner: str) -> str:
        api = self.registry
        for _ in range(2):
            code, data = await mlflow_auth.rest(
                api.url, headers, "GET", "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name}
            )
            if code == 200:
                return str(data["experiment"]["experiment_id"])
            code, data = await mlflow_auth.rest(
                api.url, headers, "POST", "/api/2.0/mlflow/experiments/create", body={"name": name}
            )
            if code == 200:
                return str(data["experiment_id"])
            if data.get("error_code") != "RESOURCE_ALREADY_EXISTS":  # else: made meanwhile by another job
                raise api.refused(f"create experiment {name} for {owner}", code, data)
        raise api.refused(f"find experiment {name}", code, data)

    async def _grant(self, username: str, kind: str, resource: str, permission: str) -> None:
        code, data = await self.registry.call(
            "POST",
            "/api/3.0/mlflow/users/permissions/grant",
            body={"username": username, "resource_type": kind, "resource_id": resource, "permission": permission},
        )
        if code != 200 and data.get("error_code") != "RESOURCE_ALREADY_EXISTS":
            raise self.registry.refused(f"give {username} {permission} on {kind} {resource}", code, data)

    async def ensure_user(self, owner: str) -> None:
        """The owner exists in MLflow's user store (else MLflow refuses them); an absent MLflow is the job's news.

        Joins the making of that user already under way (:meth:`prepare_user`) rather than asking twice.
        """
        if self.users is None or owner in self._users:
            return
        await asyncio.shield(self._making_of(owner))

    def prepare_user(self, owner: str) -> None:
        """Begin :meth:`ensure_user` in the background: the owner's server started, or their job was accepted.

        MLflow takes a fifth of a second to create a user (it hashes the password); begun here, that is
        done before the job's start needs it, and no request waits for it. A failure is logged, and the
        start asks again.
        """
        if self.users is not None and owner not in self._users:
            self._making_of(owner)

    def _making_of(self, owner: str) -> asyncio.Future:
        task = self._making.get(owner)
        if task is None:
            task = self._making[owner] = asyncio.ensure_future(self._make_user(owner))
            task.add_done_callback(lambda done: self._made(owner, done))
        return task

    def _made(self, owner: str, task: asyncio.Future) -> None:
        self._making.pop(owner, None)
        if task.cancelled():
            return
        if task.exception() is not None:  # retrieved here for prepare_user's tasks, which nobody awaits
            self.log.warning("could not make %s an MLflow user: %s", owner, task.exception())
        elif task.result():
            self._users.add(owner)

    async def _make_user(self, owner: str) -> bool:
        """Whether the owner is now an MLflow user (False: MLflow did not answer; the next start asks again)."""
        try:
            await self.users.ensure_user(owner)
        except (Unreachable, DanluError) as e:
            if isinstance(e, DanluError) and not isinstance(e, Unreachable) and e.status < 500:
                raise
            self.log.warning("could not make %s an MLflow user (%s): the job reports what MLflow says", owner, e)
            return False
        return True

    async def check_experiment(self, name: str, owner: str, admin: bool, user_exists) -> None:
        """Refuse an experiment the owner could not write (see MlflowUsers.check_experiment).

        An experiment found writable is not asked about again for :data:`CHECKED_FOR` seconds: a user
        submitting a sweep costs MLflow two lookups a minute, not two per job. MLflow itself decides
        at run creation, so a permission taken away meanwhile fails that job, with MLflow's reason.
        A new experiment (the usual first job: ``OWNER/...``) needs no MLflow user of the owner, so a
        first submission does not wait for one to be made; an existing one is asked about for the
        owner as an MLflow user (their permission there may be MLflow's default), made first if need be.
        """
        if self.users is None:
            return
        key = (owner, name)
        if self._writable.get(key, 0.0) > time.monotonic():
            return
        try:
            await self.users.check_experiment(name, owner, admin, user_exists)
        except PolicyError:
            if owner in self._users:
                raise
            await self.ensure_user(owner)  # MLflow answers no permission for someone not yet its user
            await self.users.check_experiment(name, owner, admin, user_exists)
        if len(self._writable) > MAX_CHECKED:
            self._writable.clear()
        self._writable[key] = time.monotonic() + CHECKED_FOR

    async def final_metrics(self, run_id: str) -> dict | None:
        """``{metric: its last value}`` of an MLflow run (at most :data:`MAX_METRICS`); None if MLflow has no such
        run or does not answer. Read as the workbench's MLflow admin, asynchronously."""
        if self.registry is None or not RUN_ID.match(run_id or ""):
            return None
        try:
            run = await self.registry.run(run_id)
        except DanluError as e:
            self.log.warning("could not read the metrics of MLflow run %s: %s", run_id, e)
            return None
        return latest_metrics(run) if run is not None else None


def run_tags(spec: dict) -> dict:
    """The tags the service gives a job's run when it creates it: what the job's row says, for MLflow's UI
    (Danlu itself never reads them back: which job made which run is in its own records)."""
    source = spec.get("source") if isinstance(spec.get("source"), dict) else {}
    environment = spec.get("environment") if isinstance(spec.get("environment"), dict) else {}
    included = source.get("included_cells") if isinstance(source.get("included_cells"), list) else []
    return {
        tags.INCLUDED_CELLS: ",".join(str(c) for c in included),
        tags.SOURCE_GIT_COMMIT: source.get("git_commit") or "",
        tags.GIT_COMMIT: source.get("git_commit") or "",
        tags.ENV_DIGEST: str(environment.get("digest") or ""),
        tags.RUN_NAME: spec.get("name") or spec["job_id"],
        tags.MLFLOW_USER: spec["owner"],
        tags.SOURCE_TYPE: "NOTEBOOK",
        tags.SOURCE_NAME: source.get("notebook_path") or "",
        tags.JOB_ID: spec["job_id"],
        tags.USER: spec["owner"],
        tags.PROFILE: spec.get("profile") or "",
        tags.QUEUE: spec.get("queue") or "default",
        tags.NOTEBOOK_PATH: source.get("notebook_path") or "",
        tags.CELL_ID: source.get("cell_id") or "",
        tags.CELL_SHA256: spec.get("cell_sha256") or "",
    }


def latest_metrics(run: dict) -> dict[str, float]:
    """``{name: latest value}`` of an MLflow run (its ``data.metrics``), at most :data:`MAX_METRICS` names."""
    out: dict[str, float] = {}
    for m in (run.get("data") or {}).get("metrics") or []:
        if len(out) >= MAX_METRICS:
            break
        if isinstance(m, dict) and isinstance(m.get("key"), str) and len(m["key"]) <= 250:
            try:
                value = float(m.get("value"))
            except (TypeError, ValueError):
                continue
            out[m["key"]] = value if math.isfinite(value) else str(value)
    return out


class MlflowRegistry:
    def __init__(self, url: str, secret: str | None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if secret:
            self.headers["Authorization"] = mlflow_auth.basic_authorization(mlflow_auth.SERVICE_ACCOUNT, secret)

    async def call(self, method: str, path: str, params: dict | None = None, body: dict | None = None):
        """``(status, JSON object)`` of one call; Unreachable when MLflow does not answer or fails (5xx)."""
        return await mlflow_auth.rest(
            self.url, self.headers, method, path, params=params, body=body, timeout=self.timeout, max_body=MAX_ANSWER
        )

    refused = staticmethod(mlflow_auth.refused)

    async def _ok(self, what: str, method: str, path: str, **kwargs) -> dict:
        code, data = await self.call(method, path, **kwargs)
        if code != 200:
            raise self.refused(what, code, data)
        return data

    # runs -------------------------------------------------------------------------------------------
    async def run(self, run_id: str) -> dict | None:
        """The run (``info`` and ``data``), or None if MLflow has no such run."""
        code, data = await self.call("GET", "/api/2.0/mlflow/runs/get", params={"run_id": run_id})
        if code == 200 and isinstance(data.get("run"), dict):
            return data["run"]
        if data.get("error_code") in MISSING or code in (400, 404):
            return None
        raise self.refused(f"read run {run_id}", code, data)

    async def logged_models(self, experiment_id: str, run_id: str) -> list[dict]:
        """The MLflow 3 logged models whose source run is ``run_id`` (their ``info``), newest first."""
        code, data = await self.call(
            "POST",
            "/api/2.0/mlflow/logged-models/search",
            body={
                "experiment_ids": [experiment_id],
                "filter": f"source_run_id = '{run_id}'",
                "max_results": MAX_LOGGED_MODELS,
                "order_by": [{"field_name": "creation_time", "ascending": False}],
            },
        )
        if code != 200:
            return []  # an MLflow without logged models: the run's artifacts are the source
        return [m["info"] for m in data.get("models") or [] if isinstance(m, dict) and isinstance(m.get("info"), dict)]

    async def has_artifact(self, run_id: str, path: str) -> bool:
        """Whether the run has a file or folder at ``path`` (one listing of its parent folder)."""
        parent, _, leaf = path.rpartition("/")
        params = {"run_id": run_id, **({"path": parent} if parent else {})}
        code, data = await self.call("GET", "/api/2.0/mlflow/artifacts/list", params=params)
        return code == 200 and any(isinstance(f, dict) and f.get("path") == path for f in data.get("files") or [])

    # registered models and versions -------------------------------------------------------------------
    async def registered_model(self, name: str) -> dict | None:
        code, data = await self.call("GET", "/api/2.0/mlflow/registered-models/get", params={"name": name})
        if code == 200:
            return data.get("registered_model") or {}
        if data.get("error_code") in MISSING or code == 404:
            return None
        raise self.refused(f"read registered model {name}", code, data)

    async def create_registered_model(self, name: str, description: str) -> bool:
        """Create it (the service gets MANAGE, users keep the default); False if the name exists."""
        code, data = await self.call(
            "POST", "/api/2.0/mlflow/registered-models/create", body={"name": name, "description": description}
        )
        if code == 200:
            return True
        if data.get("error_code") == "RESOURCE_ALREADY_EXISTS":
            return False
        raise self.refused(f"create registered model {name}", code, data)

    async def create_version(
        self, name: str, source: str, run_id: str, model_id: str | None, tags: dict, description: str
    ) -> int:
        body = {
            "name": name,
            "source": source,
            "run_id": run_id,
            "description": description,
            "tags": [{"key": k, "value": v} for k, v in tags.items()],
        }
        if model_id:
            body["model_id"] = model_id
        data = await self._ok(f"create a version of {name}", "POST", "/api/2.0/mlflow/model-versions/create", body=body)
        return int(data["model_version"]["version"])

    async def set_version_tags(self, name: str, version: int, tags: dict) -> None:
        for key, value in tags.items():
            await self._ok(
                f"tag {name} version {version}",
                "POST",
                "/api/2.0/mlflow/model-versions/set-tag",
                body={"name": name, "version": str(version), "key": key, "value": value},
            )

    async def set_alias(self, name: str, alias: str, version: int) -> None:
        await self._ok(
            f"set alias {alias} of {name}",
            "POST",
            "/api/2.0/mlflow/registered-models/alias",
            body={"name": name, "alias": alias, "version": str(version)},
        )

    async def delete_alias(self, name: str, alias: str) -> None:
        code, data = await self.call(
            "DELETE", "/api/2.0/mlflow/registered-models/alias", body={"name": name, "alias": alias}
        )
        if code != 200 and data.get("error_code") not in MISSING:
            raise self.refused(f"delete alias {alias} of {name}", code, data)

    async def grant_read(self, username: str, name: str) -> bool:
        """Give ``username`` READ on the registered model (what their evaluation job needs to load a version
        under ``default_permission: NO_PERMISSIONS``); False if this MLflow cannot."""
        code, data = await self.call(
            "POST",
            "/api/3.0/mlflow/users/permissions/grant",
            body={"username": username, "resource_type": "registered_model", "resource_id": name, "permission": "READ"},
        )
        return code == 200 or data.get("error_code") == "RESOURCE_ALREADY_EXISTS"  # their earlier version's
