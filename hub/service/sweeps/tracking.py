"""A sweep in MLflow: its parent run, its trials' runs as children, the objective's history, the best trial.

The parent run is made by the service as the sweep's owner in the sweep's experiment (the trials' own), so
it is the owner's like their jobs' runs; everything after is written as the workbench's MLflow admin
(:class:`~danlu.hub.service.mlflow_client.MlflowRegistry`): the tag ``mlflow.parentRunId`` on each trial's run
(MLflow's UI nests it under the parent), the best trial's number, job, parameters and objective on the
parent as it changes (tags ``danlu.sweep.best.*`` and metrics ``best_trial``, ``best_<metric>``), and the
parent's end. The objective's history of a trial's run (step -> value) is read the same way: it is what
the job's auto-logging recorded. MLflow away: the calls raise :class:`~danlu.errors.DanluError` and the
sweep's loop tries again on its next tick.
"""

from __future__ import annotations

import time

from danlu import tags
from danlu.hub import mlflow_auth

#: the most points of one metric's history read per trial and tick
MAX_HISTORY = 25_000
PARENT_TAG = "mlflow.parentRunId"
SWEEP_TAG = "danlu.sweep_id"


async def create_parent(mlflow, sweep: dict) -> tuple[str, str]:
    """The sweep's parent run, made as its owner in its experiment: ``(run_id, experiment_id)``."""
    api = mlflow.registry
    owner, experiment = sweep["owner"], sweep["experiment"]
    headers = dict(api.headers)
    if mlflow.secret:
        await mlflow.ensure_user(owner)
        headers["Authorization"] = mlflow_auth.basic_authorization(owner, mlflow.secret)
    experiment_id = None
    for _ in range(2):
        code, data = await mlflow_auth.rest(
            api.url, headers, "GET", "/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": experiment}
        )
        if code == 200:
            experiment_id = str(data["experiment"]["experiment_id"])
            break
        code, data = await mlflow_auth.rest(
            api.url, headers, "POST", "/api/2.0/mlflow/experiments/create", body={"name": experiment}
        )
        if code == 200:
            experiment_id = str(data["experiment_id"])
            break
        if data.get("error_code") != "RESOURCE_ALREADY_EXISTS":
            raise api.refused(f"create experiment {experiment} for {owner}", code, data)
    if experiment_id is None:
        raise api.refused(f"find experiment {experiment}", code, data)
    run_tags = {
        tags.RUN_NAME: f"sweep {sweep['name'] or sweep['id']}",
        tags.MLFLOW_USER: owner,
        tags.USER: owner,
        SWEEP_TAG: sweep["id"],
    }
    code, data = await mlflow_auth.rest(
        api.url,
        headers,
        "POST",
        "/api/2.0/mlflow/runs/create",
        body={
            "experiment_id": experiment_id,
            "run_name": run_tags[tags.RUN_NAME],
            "start_time": int(time.time() * 1000),
            "tags": [{"key": k, "value": v} for k, v in run_tags.items()],
        },
    )
    if code != 200:
        raise api.refused(f"create the parent run of sweep {sweep['id']}", code, data)
    run_id = data["run"]["info"]["run_id"]
    spec = sweep["spec"]
    params = {
        "sweep.objective": spec["objective"],
        "sweep.scheduler": spec["scheduler"],
        "sweep.sampler": spec["sampler"],
        "sweep.trials": str(spec["trials"]),
        "sweep.parallel": str(spec["parallel"]),
        **{f"sweep.space.{d['name']}": d["text"][:6000] for d in spec["space"]},
    }
    await _batch(api, run_id, params=params)
    return run_id, experiment_id


async def _batch(api, run_id: str, *, params: dict | None = None, run_tags: dict | None = None, metrics=()) -> None:
    body = {
        "run_id": run_id,
        "params": [{"key": k, "value": str(v)} for k, v in (params or {}).items()],
        "tags": [{"key": k, "value": str(v)[:5000]} for k, v in (run_tags or {}).items()],
        "metrics": [
            {"key": k, "value": v, "timestamp": int(time.time() * 1000), "step": step} for k, v, step in metrics
        ],
    }
    code, data = await api.call("POST", "/api/2.0/mlflow/runs/log-batch", body=body)
    if code != 200:
        raise api.refused(f"write to run {run_id}", code, data)


async def adopt(mlflow, run_id: str, parent_run_id: str, sweep_id: str, number: int) -> None:
    """A trial's run becomes a child of the sweep's parent run."""
    await _batch(
        mlflow.registry,
        run_id,
        run_tags={PARENT_TAG: parent_run_id, SWEEP_TAG: sweep_id, "danlu.sweep_trial": str(number)},
    )


async def history(mlflow, run_id: str, metric: str) -> list[tuple[int, float]]:
    """The metric's points in the run, by step (the latest value of a step logged twice), oldest step first."""
    code, data = await mlflow.registry.call(
        "GET",
        "/api/2.0/mlflow/metrics/get-history",
        params={"run_id": run_id, "metric_key": metric, "max_results": str(MAX_HISTORY)},
    )
    if code != 200:
        raise mlflow.registry.refused(f"read {metric} of run {run_id}", code, data)
    points: dict[int, tuple[int, float]] = {}
    for m in data.get("metrics") or []:
        try:
            step, value, at = int(m.get("step") or 0), float(m["value"]), int(m.get("timestamp") or 0)
        except (KeyError, TypeError, ValueError):
            continue
        if step not in points or at >= points[step][0]:
            points[step] = (at, value)
    return [(step, points[step][1]) for step in sorted(points)]


async def log_best(mlflow, run_id: str, metric: str, best: dict, finished: int) -> None:
    """The best trial so far on the parent run: tags (number, job, parameters) and metrics (step: trials ended)."""
    run_tags = {
        "danlu.sweep.best.trial": best["number"],
        "danlu.sweep.best.job_id": best.get("job_id") or "",
        f"danlu.sweep.best.{metric}": best["value"],
        **{f"danlu.sweep.best.param.{k}": v for k, v in best["params"].items()},
    }
    metrics = [("best_trial", float(best["number"]), finished), (f"best_{metric}", float(best["value"]), finished)]
    await _batch(mlflow.registry, run_id, run_tags=run_tags, metrics=metrics)


async def finish(mlflow, run_id: str, state: str) -> None:
    status = {"succeeded": "FINISHED", "stopped": "KILLED"}.get(state, "FAILED")
    code, data = await mlflow.registry.call(
        "POST",
        "/api/2.0/mlflow/runs/update",
        body={"run_id": run_id, "status": status, "end_time": int(time.time() * 1000)},
    )
    if code != 200:
        raise mlflow.registry.refused(f"end run {run_id}", code, data)


class MlflowObjective:
    """Where the loop reads a trial's objective: the history of its job's MLflow run (none yet: no points)."""

    def __init__(self, mlflow):
        self.mlflow = mlflow

    async def history(self, trial: dict, metric: str) -> list[tuple[int, float]]:
        return await history(self.mlflow, trial["run_id"], metric) if trial.get("run_id") else []
