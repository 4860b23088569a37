"""Danlu: a JupyterHub-centric research workbench.

In a notebook of a Danlu server::

    %load_ext danlu

    %%train_setup
    import torch

    %%train --nproc 2 --param lr=0.01 --wait
    ...  # runs as a job, tracked in MLflow

:func:`dataset` hands code a catalog version's path, verified and recorded as
an input of the run. Inside a job, :func:`log_dataset` records a dataset as an input of the job's
MLflow run, :func:`checkpoint_dir` is where to save checkpoints and ``danlu.resumable(model=..., optimizer=...)``
makes a training loop resume after a preemption (:mod:`danlu.resumable`). :func:`last_job_id` is the job
the last ``%%train`` of this kernel submitted. :func:`model` hands code a registered model version's
files, checked against the digest it was registered and approved with. This
package (folder ``magics/``) is what runs in kernels and jobs; ``danlu.hub``
(folder ``hub/``) runs beside JupyterHub.
"""

from __future__ import annotations

from pathlib import Path

from danlu import env

__version__ = "0.1.0"

_last_job_id: str | None = None  # set by %%train (danlu.train)


def load_ipython_extension(ipython) -> None:
    """``%load_ext danlu``: register ``%%train`` and ``%%train_setup``."""
    from danlu.train import TrainMagics  # deferred: IPython's magics and nbformat take ~1.5 s; jobs import danlu too

    ipython.register_magics(TrainMagics)


def last_job_id() -> str | None:
    """The id of the last job ``%%train`` submitted in this kernel (None if none yet).

    The lab extension's "Run cell as training job" submits with ``%%train --quiet`` and then asks this.
    """
    return _last_job_id


def __getattr__(name: str):
    """``danlu.resumable``, imported on first use so ``import danlu`` stays light (see :mod:`danlu.resumable`)."""
    if name == "resumable":
        import importlib  # deferred: only the first use of danlu.resumable imports it

        return importlib.import_module("danlu.resumable")
    raise AttributeError(f"module 'danlu' has no attribute {name!r}")


def checkpoint_dir() -> Path:
    """Where a job saves checkpoints (``$DANLU_CHECKPOINT_DIR``); kept across its attempts."""
    path = Path(env.CHECKPOINT_DIR.get("checkpoints"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def log_dataset(path, name: str | None = None, context: str = "training"):
    """Record a dataset (file or folder) as an input of this job's MLflow run, with its content digest.

    Outside a job (or on a rank other than 0) the digest is computed and returned but nothing is logged.
    """
    # deferred: hashlib and the API client (requests) come with them, and import danlu stays light
    from danlu import autolog, datasets, digests

    digest = digests.digest(path, name=name, cache_file=digests.default_cache())
    run = autolog.mlflow_run()
    if run is not None:
        from mlflow import MlflowClient  # deferred: mlflow takes ~2 s to import; only a run that logs needs it

        datasets.log_to_mlflow(MlflowClient(), run.info.run_id, digest, context=context)
    return digest


def dataset(ref: str, context: str = "training") -> Path:
    """The path of a catalog dataset version (``NAME@VERSION``, ``NAME@latest`` or ``NAME``), for reading.

    Inside a job it is resolved by the jobs service as the job's owner, who must be in the dataset's read
    groups (else :class:`~danlu.errors.NotFound`), and the use is recorded (``GET /jobs/{id}``'s ``inputs``);
    outside one, with your hub token. Either way the files are verified against the version's digest
    (:class:`~danlu.digests.DatasetChanged` names the files that changed) and the version is logged as an
    input of the MLflow run (the job's; outside a job, the active run if any) with ``context``
    (``"training"`` or ``"evaluation"``).
    """
    from danlu import datasets  # deferred: hashlib and the API client (requests) come with it; import danlu stays light

    return datasets.use(ref, context)


def model(name: str, version: int | str | None = None, dest=None) -> Path:
    """The local folder of a registered model version's files (``version``: a number, an alias, or None for the
    newest you may read), downloaded from the copy the jobs service made at registration and checked: the
    manifest against the version's digest, each file against the manifest (:class:`~danlu.models.ModelChanged`
    names a mismatch). Load it with its flavor, e.g. ``mlflow.pyfunc.load_model(danlu.model("digits", "champion"))``.
    """
    from danlu import models  # deferred: the API client (requests) comes with it; import danlu stays light

    return models.load(name, version, dest)
