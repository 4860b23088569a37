"""How the jobs service gives jobs MLflow: the tracking URI and the owner's credentials, checked experiments.

:class:`MlflowAccess` is what the service needs of MLflow for a job: the
environment a job's runner and kernels get (:meth:`env_for`: the loopback
tracking URI and, with MLflow's permissions on, the owner's derived
credentials, so a job logs as its owner), making sure the owner exists as an
MLflow user before their job runs (:meth:`ensure_user`; begun in the background
by :meth:`prepare_user` when their server starts or their job is accepted, so
that neither a submission nor a start waits for MLflow to create a user), and
refusing at submission an experiment the owner could not write
(:meth:`check_experiment`), and reading a run's final metrics as the
workbench's MLflow admin (:meth:`final_metrics`, for comparing two jobs).
The permission system itself is :mod:`danlu.hub.mlflow_auth`'s; without its
secret (a bare MLflow) there is nothing to provision or check.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

from danlu.errors import DanluError, PolicyError, Unreachable
from danlu.hub import mlflow_auth

RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: how long an experiment found writable by its owner is taken as writable, and how many are remembered
CHECKED_FOR = 60.0
MAX_CHECKED = 10_000


class MlflowAccess:
    def __init__(self, tracking_uri: str, secret: str | None = None, log: logging.Logger | None = None):
        self.tracking_uri = tracking_uri
        self.secret = secret or None
        self.users = mlflow_auth.MlflowUsers(tracking_uri, self.secret) if self.secret and tracking_uri else None
        self.log = log or logging.getLogger("danlu.jobs")
        self._writable: dict[tuple[str, str], float] = {}  # (owner, experiment) -> checked until
        self._users: set[str] = set()  # owners made MLflow users by this process
        self._making: dict[str, asyncio.Future] = {}  # owner -> the making of their MLflow user, under way

    def env_for(self, owner: str) -> dict:
        if not self.tracking_uri:
            return {}
        return {"MLFLOW_TRACKING_URI": self.tracking_uri, **mlflow_auth.job_environment(owner, self.secret)}

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
        """``{metric: its last value}`` of an MLflow run (at most
        :data:`~danlu.hub.service.registry.evaluations.MAX_METRICS`); None if MLflow has no such run or does not
        answer. Read as the workbench's MLflow admin, asynchronously."""
        from danlu.hub.service.mlflow_registry import MlflowRegistry
        from danlu.hub.service.registry.evaluations import latest_metrics

        if not self.tracking_uri or not RUN_ID.match(run_id or ""):
            return None
        try:
            run = await MlflowRegistry(self.tracking_uri, self.secret).run(run_id)
        except DanluError as e:
            self.log.warning("could not read the metrics of MLflow run %s: %s", run_id, e)
            return None
        return latest_metrics(run) if run is not None else None
