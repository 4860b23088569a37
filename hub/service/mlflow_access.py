"""How the jobs service gives jobs MLflow: the tracking URI, and (with permissions) the owner's credentials.

:class:`MlflowAccess` is what the service needs of MLflow for a job: the
environment a job's runner and kernels get (:meth:`env_for`), making sure
the owner exists as an MLflow user before their job starts
(:meth:`ensure_user`), and refusing an experiment the owner could not write
(:meth:`check_experiment`). This plain version has no permissions to manage;
:mod:`danlu.hub.mlflow_auth` provides the one that drives MLflow's own
permission system.
"""

from __future__ import annotations


class MlflowAccess:
    def __init__(self, tracking_uri: str):
        self.tracking_uri = tracking_uri

    def env_for(self, owner: str) -> dict:
        return {"MLFLOW_TRACKING_URI": self.tracking_uri} if self.tracking_uri else {}

    async def ensure_user(self, owner: str, admin: bool = False) -> None:
        return None

    async def check_experiment(self, name: str, owner: str, admin: bool, user_exists) -> None:
        return None
