"""How the jobs service gives jobs MLflow: the tracking URI and the owner's credentials, checked experiments.

:class:`MlflowAccess` is what the service needs of MLflow for a job: the
environment a job's runner and kernels get (:meth:`env_for`: the loopback
tracking URI and, with MLflow's permissions on, the owner's derived
credentials, so a job logs as its owner), making sure the owner exists as an
MLflow user before their job runs (:meth:`ensure_user`), and refusing at
submission an experiment the owner could not write (:meth:`check_experiment`).
The permission system itself is :mod:`danlu.hub.mlflow_auth`'s; without its
secret (a bare MLflow) there is nothing to provision or check.
"""

from __future__ import annotations

import logging

from danlu.errors import DanluError, Unreachable
from danlu.hub import mlflow_auth


class MlflowAccess:
    def __init__(self, tracking_uri: str, secret: str | None = None, log: logging.Logger | None = None):
        self.tracking_uri = tracking_uri
        self.secret = secret or None
        self.users = mlflow_auth.MlflowUsers(tracking_uri, self.secret) if self.secret and tracking_uri else None
        self.log = log or logging.getLogger("danlu.jobs")

    def env_for(self, owner: str) -> dict:
        if not self.tracking_uri:
            return {}
        return {"MLFLOW_TRACKING_URI": self.tracking_uri, **mlflow_auth.job_environment(owner, self.secret)}

    async def ensure_user(self, owner: str) -> None:
        """The owner exists in MLflow's user store (else MLflow refuses them); an absent MLflow is the job's news."""
        if self.users is None:
            return
        try:
            await self.users.ensure_user(owner)
        except (Unreachable, DanluError) as e:
            if isinstance(e, DanluError) and not isinstance(e, Unreachable) and e.status < 500:
                raise
            self.log.warning("could not make %s an MLflow user (%s): the job reports what MLflow says", owner, e)

    async def check_experiment(self, name: str, owner: str, admin: bool, user_exists) -> None:
        if self.users is None:
            return
        await self.ensure_user(owner)
        await self.users.check_experiment(name, owner, admin, user_exists)
