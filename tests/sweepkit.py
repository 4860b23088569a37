"""A fake backend whose jobs are synthetic training runs, for sweeps' tests and benchmark.

:class:`CurveBackend`'s runner does what a trial's cell does with no Optuna code in it: it reads its
parameters (``lr``, ``batch``, ``steps``), logs ``val_loss`` at steps 1..``steps`` -- a deterministic
learning curve of its parameters (:func:`curve`) -- and succeeds. Points go to the job's MLflow run with
the attempt's own credentials from its spec (``mlflow``: a real MLflow), or, without one, to
:attr:`CurveBackend.points` by job id, which :class:`PointsObjective` serves to the sweeps' loop in place of
MLflow. On SIGTERM (a cancel, a pruning, a preemption) it asks the service why and reports that; a job
named in :attr:`CurveBackend.fail_names` fails in its user code at step 2. :attr:`events` records
``(time, "start"|"end", job id, gpus)`` for the quota audit.
"""

from __future__ import annotations

import asyncio
import math
import time

import requests

from .fakes import FakeBackend, FakeRun


def curve(params: dict, step: int) -> float:
    """The validation loss of a configuration after ``step`` steps: its floor plus a decaying excess. Larger
    batches learn faster and end worse, so curves cross: early leaders are not always the best at the end."""
    lr = float(params.get("lr", 1e-2))
    big = float(params.get("batch", 32)) > 32
    floor = 0.1 + 0.15 * (math.log10(lr) + 2.2) ** 2 + (0.06 if big else 0.0)
    return floor + 1.5 / (1.0 + (0.6 if big else 0.35) * step)


class PointsObjective:
    """The loop's objective source reading :attr:`CurveBackend.points` (no MLflow)."""

    def __init__(self, backend: CurveBackend):
        self.backend = backend

    async def history(self, trial: dict, metric: str) -> list[tuple[int, float]]:
        points = self.backend.points.get(trial["job_id"] or "", {}) if metric == "val_loss" else {}
        return sorted(points.items())


class CurveBackend(FakeBackend):
    def __init__(self, *, pace: float = 0.02, mlflow: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.pace = pace
        self.mlflow = mlflow
        self.points: dict[str, dict[int, float]] = {}
        self.fail_names: set[str] = set()
        self.steps_run = 0  # trial-steps executed, all jobs together
        self.events: list[tuple[float, str, str, int]] = []

    async def runner(self, run: FakeRun) -> int:
        spec = await run.fetch_spec()
        if spec is None:
            return 3
        self.events.append((time.monotonic(), "start", run.job_id, spec["gpus"]))
        try:
            return await self._train(run, spec)
        finally:
            self.events.append((time.monotonic(), "end", run.job_id, spec["gpus"]))

    async def _train(self, run: FakeRun, spec: dict) -> int:
        params = spec["parameters"]
        for step in range(1, int(params.get("steps", 9)) + 1):
            if run.signalled.is_set():
                stop = await run.ask_stop()
                reason = (stop or {}).get("reason") or "failed"
                await run.report(reason, reason, exit_code=None)
                return 0
            if spec["name"] in self.fail_names and step == 2:
                run.write("job.log", "ValueError: loss is nan\n")
                await run.report("failed", "cell 1 raised ValueError: loss is nan", exit_code=1)
                return 0
            value = curve(params, step)
            self.steps_run += 1
            if self.mlflow is None:
                self.points.setdefault(run.job_id, {})[step] = value
            else:
                await asyncio.to_thread(self._log, spec, step, value)
            await asyncio.sleep(self.pace)
        await run.report("succeeded")
        return 0

    def _log(self, spec: dict, step: int, value: float) -> None:
        env = spec["mlflow_env"]
        user = env.get("MLFLOW_TRACKING_USERNAME")
        auth = (user, env["MLFLOW_TRACKING_PASSWORD"]) if user else None
        r = requests.post(
            f"{env['MLFLOW_TRACKING_URI']}/api/2.0/mlflow/runs/log-metric",
            json={
                "run_id": spec["tracking"]["run_id"],
                "key": "val_loss",
                "value": value,
                "timestamp": int(time.time() * 1000),
                "step": step,
            },
            auth=auth,
            timeout=30,
        )
        r.raise_for_status()


def most_at_once(log: list[tuple[float, str, str, int]]) -> int:
    """The most GPUs the logged jobs held at one time (ends before starts at the same instant)."""
    held = most = 0
    for _at, what, _job, gpus in sorted(log, key=lambda e: (e[0], e[1] == "start")):
        held += gpus if what == "start" else -gpus
        most = max(most, held)
    return most
