"""Auto-logging inside a job's kernel: no MLflow code in the user's cell.

:func:`activate` runs (silently) in every rank's kernel before the notebook.
It costs nothing in the training loop:

* ``torch.utils.tensorboard.SummaryWriter`` gets a default ``log_dir`` in the
  job's folder (``tensorboard/rank-N``) and a short flush interval; rank 0
  records each writer's log dir, and the job runner (a separate process) tails
  those event files into the job's MLflow run in batches.
* Its event files are written by :mod:`danlu.tensorboard.writer`: the same files,
  record for record, for about a microsecond of the training thread per
  ``add_scalar`` where TensorBoard's own writer takes tens (at 100 scalars a
  step, 8 ms a step on two cores).
* Writers are flushed after every cell and at exit, so nothing is lost when a
  cell fails.
* On rank 0, importing a framework that ``mlflow.autolog()`` covers (sklearn,
  Lightning, XGBoost, Keras, transformers, ...) turns on ``mlflow.autolog``
  against the job's run; MLflow is imported only then, so a job that uses none
  of them does not pay for importing it.
* The seed the code sets (``random.seed``, ``torch.manual_seed``, ...) is noticed
  for the job's provenance (:mod:`danlu.seeds`).

Metrics come from rank 0 only, as Lightning's ``rank_zero_only`` does, so a
series has one point per step.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from pathlib import Path

from danlu import env, seeds
from danlu.importhooks import when_imported

#: top-level modules whose import turns on mlflow.autolog (mlflow's LIBRARY_TO_AUTOLOG_MODULE)
AUTOLOG_FRAMEWORKS = frozenset(
    {
        "tensorflow",
        "keras",
        "xgboost",
        "lightgbm",
        "statsmodels",
        "sklearn",
        "pyspark",
        "pytorch_lightning",
        "lightning",
        "setfit",
        "transformers",
    }
)

_writers: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_state: dict = {"active": False, "mlflow": False}


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def _jobdir() -> Path | None:
    value = env.JOB_DIR.get()
    return Path(value) if value else None


# TensorBoard -------------------------------------------------------------------
def default_logdir() -> str:
    jd = _jobdir()
    base = jd / "tensorboard" if jd else Path("runs")
    return str(base / f"rank-{rank()}")


def _register_logdir(log_dir: str) -> None:
    jd = _jobdir()
    if jd is None or rank() != 0:
        return
    path = str(Path(log_dir).resolve())
    listing = jd / "tensorboard" / "logdirs"
    with _lock:
        listing.parent.mkdir(parents=True, exist_ok=True)
        known = listing.read_text().splitlines() if listing.exists() else []
        if path not in known:
            with open(listing, "a", encoding="utf-8") as f:
                f.write(path + "\n")


def _patch_summary_writer(module) -> None:
    cls = getattr(module, "SummaryWriter", None)
    if cls is None or getattr(cls, "_danlu_patched", False):
        return
    original = cls.__init__

    def __init__(self, log_dir=None, *args, **kwargs):
        if log_dir is None and not args and not kwargs.get("comment"):
            log_dir = default_logdir()
        if len(args) < 3:  # flush_secs is the 4th positional argument after log_dir
            kwargs.setdefault("flush_secs", 2)
        original(self, log_dir, *args, **kwargs)
        _writers.add(self)
        try:
            _register_logdir(self.log_dir if hasattr(self, "log_dir") else self.get_logdir())
        except OSError:
            pass

    __init__.__wrapped__ = original
    cls.__init__ = __init__
    cls._danlu_patched = True
    # deferred: it imports numpy and TensorBoard's protos, which only a kernel whose code uses TensorBoard needs
    from danlu.tensorboard import writer

    writer.activate(module)


def flush_writers(*_args) -> None:
    for writer in list(_writers):
        try:
            writer.flush()
        except Exception:  # a closed writer
            pass


# MLflow --------------------------------------------------------------------------
def mlflow_run():
    """The job's MLflow run, resumed in this process (rank 0 only); None elsewhere."""
    if rank() != 0 or not os.environ.get("MLFLOW_RUN_ID"):
        return None
    import mlflow  # deferred: mlflow takes ~2 s to import; only a job's rank 0 with a run needs it

    with _lock:
        active = mlflow.active_run()
        if active is None or active.info.run_id != os.environ["MLFLOW_RUN_ID"]:
            active = mlflow.start_run(run_id=os.environ["MLFLOW_RUN_ID"])
        _state["mlflow"] = True
    return active


def _enable_mlflow_autolog(_module) -> None:
    if _state.get("autolog"):
        return
    _state["autolog"] = True
    try:
        import mlflow  # deferred: mlflow takes ~2 s to import; needed once the code imports a framework it covers

        if mlflow_run() is not None:
            mlflow.autolog(silent=True)
    except Exception as e:  # never break the user's import
        print(f"danlu: mlflow.autolog could not be enabled: {e}", file=sys.stderr)


def _resume_run(_module) -> None:
    """Once the code imports mlflow, the job's run is its active run: a model or an artifact logged without
    naming a run (``mlflow.<flavor>.log_model``, ``create_external_model``) belongs to the job's run and
    experiment, where registering it as a model finds it, not to a new run in MLflow's default experiment."""
    try:
        mlflow_run()
    except Exception as e:  # never break the user's import; MLflow says why on their first call
        print(f"danlu: the job's MLflow run could not be resumed: {e}", file=sys.stderr)


def activate() -> None:
    """Turn on auto-logging in this kernel (idempotent)."""
    if _state["active"]:
        return
    _state["active"] = True
    when_imported(["torch.utils.tensorboard.writer"], _patch_summary_writer)
    if rank() == 0 and os.environ.get("MLFLOW_RUN_ID"):
        when_imported(["mlflow"], _resume_run)
        when_imported(sorted(AUTOLOG_FRAMEWORKS), _enable_mlflow_autolog)
    atexit.register(flush_writers)
    if _jobdir() is not None:
        seeds.activate()
    try:
        from IPython import get_ipython  # deferred: optional (only a kernel has IPython); ~0.3 s elsewhere

        shell = get_ipython()
        if shell is not None:
            shell.events.register("post_run_cell", flush_writers)
    except ImportError:
        pass
