"""Optuna as the sweeps' engine: its studies in an RDB storage beside the jobs database, asked and told.

Optuna keeps its own tables and its own Alembic revision in a table named ``alembic_version`` -- the name
the jobs database's own revision uses -- so its tables cannot share that schema: on SQLite they are in a
file next to the jobs database (``danlu.sqlite`` -> ``danlu-optuna.sqlite``), on PostgreSQL in the same
database under a schema of their own (``danlu_optuna``, made if missing). Optuna creates and upgrades
them itself. ``JobsServiceApp.sweeps_storage_url`` names another storage.

Every call runs on one thread of its own (:class:`Engine` serialises them): Optuna's storage calls block,
and a study object is not shared across threads. A study is loaded once per service process with the
sampler and pruner the sweep names (:func:`sampler_for`, :func:`pruner_for`); a trial is found again by its
number after a restart, so the service's loop picks a sweep up where it was.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState
from sqlalchemy.engine import make_url

from danlu.hub.service.sweeps.space import Dimension, SweepSpec

#: the PostgreSQL schema of Optuna's tables when they share the jobs database
PG_SCHEMA = "danlu_optuna"

optuna.logging.set_verbosity(optuna.logging.WARNING)


def storage_url_for(jobs_url: str) -> str:
    """Where Optuna's tables go by default, given the jobs database's URL (see the module docstring)."""
    url = make_url(jobs_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:":
        path = Path(url.database)
        return str(url.set(database=str(path.with_name(f"{path.stem}-optuna{path.suffix or '.sqlite'}"))))
    return jobs_url


def make_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage at ``url`` (PostgreSQL: in :data:`PG_SCHEMA`, made if missing)."""
    parsed = make_url(url)
    kwargs: dict = {}
    if parsed.get_backend_name() == "postgresql":
        from sqlalchemy import create_engine, text  # deferred: only PostgreSQL needs its own schema made

        engine = create_engine(url)
        with engine.begin() as connection:
            connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {PG_SCHEMA}"))
        engine.dispose()
        kwargs = {"connect_args": {"options": f"-csearch_path={PG_SCHEMA}"}}
    elif parsed.get_backend_name() == "sqlite":
        kwargs = {"connect_args": {"timeout": 30}}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def distribution(d: Dimension):
    if d.distribution == "choice":
        return CategoricalDistribution(list(d.choices))
    assert d.low is not None and d.high is not None  # the ranges have both bounds (space.parse_dimension)
    if d.distribution == "int":
        return IntDistribution(int(d.low), int(d.high))
    return FloatDistribution(float(d.low), float(d.high), log=d.distribution == "loguniform")


def sampler_for(spec: SweepSpec):
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=spec.seed)
    return optuna.samplers.TPESampler(seed=spec.seed, n_startup_trials=min(10, max(1, spec.trials // 4)))


def pruner_for(spec: SweepSpec):
    if spec.scheduler == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.scheduler == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=spec.min_resource, reduction_factor=spec.reduction_factor)
    return optuna.pruners.NopPruner()


class Engine:
    """The sweeps' studies, on one thread: ask, report, tell, by study name and trial number."""

    def __init__(self, url: str, log: logging.Logger | None = None):
        self.url = url
        self.log = log or logging.getLogger("danlu.jobs")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="danlu-optuna")
        self._storage: optuna.storages.RDBStorage | None = None
        self._studies: dict[str, optuna.Study] = {}

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # on the engine's thread -------------------------------------------------------------------------------
    def storage(self) -> optuna.storages.RDBStorage:
        if self._storage is None:
            self._storage = make_storage(self.url)
        return self._storage

    def study(self, name: str, spec: SweepSpec) -> optuna.Study:
        study = self._studies.get(name)
        if study is None:
            study = optuna.create_study(
                study_name=name,
                storage=self.storage(),
                direction="maximize" if spec.direction == "maximize" else "minimize",
                sampler=sampler_for(spec),
                pruner=pruner_for(spec),
                load_if_exists=True,
            )
            self._studies[name] = study
        return study

    def ask(self, name: str, spec: SweepSpec) -> tuple[int, dict]:
        """A new trial: its number and its parameters."""
        study = self.study(name, spec)
        trial = study.ask({d.name: distribution(d) for d in spec.space})
        return trial.number, dict(trial.params)

    def _trial(self, study: optuna.Study, number: int) -> optuna.trial.Trial:
        storage = study._storage
        return optuna.trial.Trial(study, storage.get_trial_id_from_study_id_trial_number(study._study_id, number))

    def report(self, name: str, spec: SweepSpec, number: int, points: list[tuple[int, float]]) -> tuple[bool, int]:
        """Report ``points`` (step, value) of a running trial, in order; (whether the pruner stops it, the rungs
        it completed). The pruner is asked at each rung's step and after the last point, so a batch of points
        read at once is judged at each rung as it would have been point by point."""
        study = self.study(name, spec)
        trial = self._trial(study, number)
        rungs = rung_steps(spec, max(step for step, _ in points)) if points and spec.scheduler != "none" else set()
        # a restarted service reads a trial's points again: those Optuna has are not reported twice
        known = study._storage.get_trial(trial._trial_id).intermediate_values
        for i, (step, value) in enumerate(points):
            if not math.isfinite(value):
                continue
            if step not in known:
                trial.report(value, step)
            if (step in rungs or i == len(points) - 1) and spec.scheduler != "none":
                if trial.should_prune():
                    return True, rungs_of(study, number)
        return False, rungs_of(study, number)

    def tell(self, name: str, spec: SweepSpec, number: int, state: str, value: float | None = None) -> int:
        """End a trial: ``complete`` with its objective, ``pruned`` or ``failed``; answers its rungs."""
        study = self.study(name, spec)
        states = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED, "failed": TrialState.FAIL}
        values = value if state == "complete" else None
        study.tell(number, values, state=states[state], skip_if_finished=True)
        return rungs_of(study, number)

    def fail_running(self, name: str, spec: SweepSpec) -> None:
        """Every trial still running in Optuna fails (the sweep was stopped)."""
        study = self.study(name, spec)
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)


def rung_steps(spec: SweepSpec, up_to: int) -> set[int]:
    """The steps at which a rung is judged: ``min_resource * reduction_factor ** k`` up to ``up_to``."""
    steps, step = set(), spec.min_resource
    while step <= up_to:
        steps.add(step)
        step *= spec.reduction_factor
    return steps


def rungs_of(study: optuna.Study, number: int) -> int:
    """How many ASHA rungs the trial completed (Optuna's ``completed_rung_N`` system attributes)."""
    storage = study._storage
    frozen = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, number))
    return sum(1 for key in frozen.system_attrs if key.startswith("completed_rung_"))
