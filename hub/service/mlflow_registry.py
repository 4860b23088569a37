"""The MLflow REST calls the model registry makes, as the workbench's MLflow admin.

:class:`MlflowRegistry` reads runs, their logged models, artifacts and metrics, and writes
registered models, model versions, their tags and aliases, and READ grants -- always as
:data:`~danlu.hub.mlflow_auth.SERVICE_ACCOUNT`, the admin that ``danlu up`` configures. Because
the service creates every registered model Danlu governs, users hold only the default permission
(READ) on it, so MLflow itself refuses them alias and tag writes, through the gateway or directly.
Every call is async (tornado's client, never the event loop blocked), has a timeout, and reads at
most :data:`MAX_ANSWER` bytes of answer; nothing here downloads or loads a model.
"""

from __future__ import annotations

from danlu.hub import mlflow_auth

#: the most bytes of one MLflow answer the service reads (a run with many metrics and tags fits)
MAX_ANSWER = mlflow_auth.MAX_ANSWER
#: the most logged models of one run the service looks at
MAX_LOGGED_MODELS = 100
MISSING = ("RESOURCE_DOES_NOT_EXIST",)


class MlflowRegistry:
    def __init__(self, url: str, secret: str | None, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json"}
        if secret:
            self.headers["Authorization"] = mlflow_auth.basic_authorization(mlflow_auth.SERVICE_ACCOUNT, secret)

    async def call(self, method: str, path: str, params: dict | None = None, body: dict | None = None):
        """``(status, JSON object)`` of one call; Unreachable when MLflow does not answer or fails (5xx)."""
        return await mlflow_auth.rest(self.url, self.headers, method, path, params=params, body=body,
                                      timeout=self.timeout, max_body=MAX_ANSWER)

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
        code, data = await self.call("POST", "/api/2.0/mlflow/logged-models/search", body={
            "experiment_ids": [experiment_id], "filter": f"source_run_id = '{run_id}'",
            "max_results": MAX_LOGGED_MODELS, "order_by": [{"field_name": "creation_time", "ascending": False}]})
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
        code, data = await self.call("POST", "/api/2.0/mlflow/registered-models/create",
                                     body={"name": name, "description": description})
        if code == 200:
            return True
        if data.get("error_code") == "RESOURCE_ALREADY_EXISTS":
            return False
        raise self.refused(f"create registered model {name}", code, data)

    async def create_version(self, name: str, source: str, run_id: str, model_id: str | None, tags: dict,
                             description: str) -> int:
        body = {"name": name, "source": source, "run_id": run_id, "description": description,
                "tags": [{"key": k, "value": v} for k, v in tags.items()]}
        if model_id:
            body["model_id"] = model_id
        data = await self._ok(f"create a version of {name}", "POST", "/api/2.0/mlflow/model-versions/create",
                              body=body)
        return int(data["model_version"]["version"])

    async def set_version_tags(self, name: str, version: int, tags: dict) -> None:
        for key, value in tags.items():
            await self._ok(f"tag {name} version {version}", "POST", "/api/2.0/mlflow/model-versions/set-tag",
                           body={"name": name, "version": str(version), "key": key, "value": value})

    async def set_alias(self, name: str, alias: str, version: int) -> None:
        await self._ok(f"set alias {alias} of {name}", "POST", "/api/2.0/mlflow/registered-models/alias",
                       body={"name": name, "alias": alias, "version": str(version)})

    async def delete_alias(self, name: str, alias: str) -> None:
        code, data = await self.call("DELETE", "/api/2.0/mlflow/registered-models/alias",
                                     body={"name": name, "alias": alias})
        if code != 200 and data.get("error_code") not in MISSING:
            raise self.refused(f"delete alias {alias} of {name}", code, data)

    async def grant_read(self, username: str, name: str) -> bool:
        """Give ``username`` READ on the registered model (what their evaluation job needs to load a version
        under ``default_permission: NO_PERMISSIONS``); False if this MLflow cannot."""
        code, data = await self.call("POST", "/api/3.0/mlflow/users/permissions/grant", body={
            "username": username, "resource_type": "registered_model", "resource_id": name, "permission": "READ"})
        return code == 200 or data.get("error_code") == "RESOURCE_ALREADY_EXISTS"  # their earlier version's
