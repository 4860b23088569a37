"""Who may read a model version: whoever may read the MLflow experiment of the run it came from.

A version's API model shows its run, its job and its evaluation's metrics. With MLflow's
``default_permission: READ`` everyone may read every experiment, so everyone reads every version. With
``NO_PERMISSIONS`` a version is shown only to admins, approvers (who decide on it), its registrant, the
owner of the job that made its run (from the service's records), and those MLflow gives a permission on
that run's experiment; to anyone else it does not exist (404), as the run does not in MLflow.
"""

from __future__ import annotations

from sqlalchemy import select

from danlu.errors import Unreachable
from danlu.hub.service.store.orm import Job

#: the MLflow permissions that let their holder read an experiment
READING = ("READ", "USE", "EDIT", "MANAGE")


class ReadAccess:
    def __init__(self, database, settings, registry, approver):
        """``registry``: the service's MLflow REST calls (None: no MLflow); ``approver``: an async check."""
        self.database = database
        self.settings = settings
        self.registry = registry
        self.approver = approver

    @property
    def open(self) -> bool:
        return self.settings.mlflow.default_permission != "NO_PERMISSIONS"

    async def readable(self, principal, views: list[dict]) -> list[dict]:
        """The versions of ``views`` (API models) the caller may read, in their order."""
        if not views or self.open or principal.admin or await self.approver(principal):
            return views
        ids = {v["job_id"] for v in views if v.get("job_id")}

        def jobs(s):
            found = s.scalars(select(Job).where(Job.id.in_(ids))) if ids else []
            return {j.id: (j.owner, (j.tracking or {}).get("experiment_id")) for j in found}

        made = await self.database.read(jobs)
        asked: dict[str, bool] = {}
        out = []
        for v in views:
            owner, experiment = made.get(v.get("job_id"), (None, None))
            if principal.name in (v.get("registered_by"), owner):
                out.append(v)
            elif experiment:
                if experiment not in asked:
                    asked[experiment] = await self._may_read(principal.name, str(experiment))
                if asked[experiment]:
                    out.append(v)
        return out

    async def _may_read(self, username: str, experiment_id: str) -> bool:
        if self.registry is None:
            return False
        try:
            code, data = await self.registry.call(
                "GET",
                "/api/3.0/mlflow/users/permissions/get",
                params={"username": username, "resource_type": "experiment", "resource_id": experiment_id},
            )
        except Unreachable:
            return False
        return code == 200 and data.get("permission") in READING
