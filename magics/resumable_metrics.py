"""One point per step in a resumed job's MLflow curves: the steps done again after a resume are not logged twice.

A resumed attempt continues the job's MLflow run, and it does again the steps between its checkpoint
and the moment the previous attempt was killed: those steps' metrics are already in the run (or in the
job's TensorBoard event files, which the runner forwards to it). :func:`install` learns, once, the
highest step each metric already has (:func:`high_steps`: the run's latest metrics, read with the
job's own MLflow credentials, and the event files in the job's folder) and from then on, in this
kernel, drops a point whose step is at or below that:

* ``SummaryWriter.add_scalar(tag, value, global_step)`` (auto-logging forwards these to MLflow);
* ``mlflow.log_metric(key, value, step=...)`` and ``mlflow.log_metrics(metrics, step=...)``.

A point logged without a step cannot be placed and is always logged (a resumed curve then has those
steps twice). Once a run passes its highest step, the check is one comparison a call.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from danlu import env
from danlu.importhooks import when_imported

_floors: dict[str, int] = {}  # metric key -> the highest step the run has
_top = [-1]  # the highest of them (a list: the wrappers read it as a closure cell)
# marks this module's wrappers; not ``__wrapped__``, which auto-logging's fast ``add_scalar`` carries too
MARK = "_danlu_logged_once"


def high_steps(run_id: str | None, jobdir: Path | None) -> dict[str, int]:
    """The highest step of each metric the job has logged: in its MLflow run and in its event files."""
    out: dict[str, int] = {}
    for found in (_from_events(jobdir), _from_mlflow(run_id)):
        for key, step in found.items():
            out[key] = max(step, out.get(key, step))
    return out


def _from_mlflow(run_id: str | None) -> dict[str, int]:
    if not run_id:
        return {}
    try:
        from mlflow import MlflowClient  # deferred: mlflow takes ~2 s to import; only a resumed run with MLflow asks

        run = MlflowClient().get_run(run_id)
        # the run's latest metrics carry their step: the highest of each key (MLflow's latest_metrics)
        return {m.key: int(m.step) for m in getattr(run.data, "_metric_objs", [])}
    except Exception as e:  # noqa: BLE001 - MLflow away: the event files still say what was logged
        print(f"danlu: the MLflow run's steps could not be read ({str(e)[:200]})", file=sys.stderr, flush=True)
        return {}


def _from_events(jobdir: Path | None) -> dict[str, int]:
    if jobdir is None:
        return {}
    # deferred: the event-file reader is only needed when an attempt resumes
    from danlu.tensorboard.names import metric_key
    from danlu.tensorboard.reader import READ_CHUNK, EventFile, LogDirs

    tensorboard = Path(jobdir) / "tensorboard"
    out: dict[str, int] = {}
    keys: dict[str, str] = {}
    for path in LogDirs(tensorboard / "logdirs", [tensorboard / "rank-0"]).event_files():
        file, more = EventFile(path), True
        while more:
            events, more = file.read(READ_CHUNK)
            for _wall, step, values in events:
                for tag, _value in values:
                    key = keys.get(tag) or keys.setdefault(tag, metric_key(tag))
                    if step > out.get(key, -(2**63)):
                        out[key] = step
    return out


def install(floors: dict[str, int]) -> None:
    """Drop, in this kernel, metric points at or below ``floors`` (metric key -> highest step logged)."""
    _floors.update(floors)
    _top[0] = max(_floors.values(), default=-1)
    if _top[0] < 0:
        return
    when_imported(["torch.utils.tensorboard.writer"], _wrap_summary_writer)
    when_imported(["mlflow"], _wrap_mlflow)


def clear() -> None:
    """Log every point again (tests; a new state that did not resume)."""
    _floors.clear()
    _top[0] = -1


def logged(key: str, step) -> bool:
    """Whether ``key`` at ``step`` is already in the run (so the point is dropped)."""
    if step is None:
        return False
    try:
        step = int(step)
    except (TypeError, ValueError):
        return False
    if step > _top[0]:
        return False
    floor = _floors.get(key)
    return floor is not None and step <= floor


def _wrap_summary_writer(module) -> None:
    cls = getattr(module, "SummaryWriter", None)
    if cls is None or getattr(cls.add_scalar, MARK, False):  # wrapped once per class, whichever module
        return
    from danlu.tensorboard.names import metric_key  # deferred: only a kernel whose code uses TensorBoard needs it

    inner, top = cls.add_scalar, _top
    keys: dict = {}

    def add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
        if global_step is not None and top[0] >= 0:
            key = keys.get(tag)
            if key is None:
                key = keys[tag] = metric_key(str(tag))
            if logged(key, global_step):
                return None
        return inner(self, tag, scalar_value, global_step, *args, **kwargs)

    add_scalar.__wrapped__ = inner  # type: ignore[attr-defined]
    setattr(add_scalar, MARK, True)
    add_scalar.__doc__ = inner.__doc__
    cls.add_scalar = add_scalar


def _wrap_mlflow(module) -> None:
    if not hasattr(module, "log_metric") or getattr(module.log_metric, MARK, False):  # once per module
        return
    log_metric, log_metrics = module.log_metric, module.log_metrics

    def log_metric_once(key, value, step=None, *args, **kwargs):
        if step is not None and logged(key, step):
            return None
        return log_metric(key, value, step, *args, **kwargs)

    def log_metrics_once(metrics, step=None, *args, **kwargs):
        if step is not None and _top[0] >= 0:
            metrics = {k: v for k, v in metrics.items() if not logged(k, step)}
            if not metrics:
                return None
        return log_metrics(metrics, step, *args, **kwargs)

    log_metric_once.__wrapped__ = log_metric  # type: ignore[attr-defined]
    log_metrics_once.__wrapped__ = log_metrics  # type: ignore[attr-defined]
    setattr(log_metric_once, MARK, True)
    setattr(log_metrics_once, MARK, True)
    log_metric_once.__doc__, log_metrics_once.__doc__ = log_metric.__doc__, log_metrics.__doc__
    module.log_metric, module.log_metrics = log_metric_once, log_metrics_once


def jobdir() -> Path | None:
    value = env.JOB_DIR.get()
    return Path(value) if value else None


def run_id() -> str | None:
    return os.environ.get("MLFLOW_RUN_ID") or None
