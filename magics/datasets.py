"""A dataset as code uses it: ``danlu.dataset`` and its record as an input of the MLflow run.

:func:`use` is ``danlu.dataset``: code in a cell asks for a catalog version
(through the runner API inside a job, with the user's hub token outside one),
gets its path, verifies it against the version's digest (:mod:`danlu.digests`)
and records it as an input of the run with its context (:func:`log_to_mlflow`,
which the job runner uses for the job's datasets too).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from danlu import autolog, env, tags
from danlu.client import DanluClient
from danlu.digests import CONTEXTS, EVALUATION, TRAINING, DatasetDigest, default_cache, verify
from danlu.errors import Unreachable, UsageError

#: what :func:`use` takes: ``NAME@VERSION``, ``NAME@latest`` or ``NAME`` (the latest)
REF = re.compile(r"^([a-z0-9](?:[-a-z0-9_.]{0,62}[a-z0-9])?)(?:@([1-9][0-9]{0,8}|latest))?$")


def log_to_mlflow(client, run_id: str, ds: DatasetDigest, context: str = TRAINING) -> None:
    """Record a dataset as an input of an MLflow run, with its context (``mlflow.data.context``)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag  # deferred: mlflow takes ~2 s to import

    dataset = Dataset(
        name=ds.name,
        digest=ds.digest[:36],
        source_type="local",
        source=json.dumps({"uri": Path(ds.path).as_uri()}),
        profile=json.dumps({"files": ds.files, "bytes": ds.bytes, "sha256": ds.digest}),
    )
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag(tags.DATA_CONTEXT, context)])])


# danlu.dataset ----------------------------------------------------------------------------------------------
def use(ref: str, context: str = TRAINING) -> Path:
    """``danlu.dataset``: the path of a catalog version, verified, and recorded as an input of the run.

    Inside a job the jobs service resolves ``ref`` as the job's owner (runner API, with the attempt's
    token) and records the use; outside one, the catalog is asked with the user's hub token. The files
    are verified against the version's digest here (:class:`~danlu.digests.DatasetChanged` names what
    changed), then logged on the job's MLflow run (rank 0) or, outside a job, on the active MLflow run if
    there is one.
    """
    match = REF.match(ref) if isinstance(ref, str) else None
    if match is None:
        raise UsageError(
            f"danlu.dataset({str(ref)[:80]!r}): not a catalog version; write NAME@VERSION (e.g. "
            "mnist@3), NAME@latest or NAME",
            reason="bad_ref",
            fix="see the datasets you may read with 'danlu datasets list'",
        )
    if context not in CONTEXTS:
        raise UsageError(
            f"danlu.dataset: context {str(context)[:40]!r} is not one of {', '.join(CONTEXTS)}",
            reason="bad_context",
            fix=f"use context={TRAINING!r} or context={EVALUATION!r}",
        )
    name, version = match.group(1), match.group(2) or "latest"
    answer = _resolve_in_job(f"{name}@{version}", context) if _in_job() else _resolve_outside(name, version)
    found = verify(
        answer["path"], answer["ref"], answer["digest"], answer.get("manifest") or [], cache_file=default_cache()
    )
    _log_input(found, context)
    return Path(answer["path"])


def _in_job() -> bool:
    return bool(env.JOB_ID.get())


def _resolve_in_job(ref: str, context: str) -> dict:
    api, token, attempt, job = env.RUNNER_API.get(), env.JOB_TOKEN.get(), env.ATTEMPT.get(), env.JOB_ID.get()
    if not (api and token and attempt):
        raise Unreachable(
            "danlu.dataset: this job's kernel was not told where the jobs service's runner API is",
            fix="name the version with --dataset NAME@VERSION when submitting instead",
        )
    client = DanluClient(api=api, token=token, scheme="Bearer", url=api)
    return client.request(
        "POST", f"/runner/jobs/{job}/attempts/{attempt}/datasets", json={"ref": ref, "context": context}
    ).json()


def _resolve_outside(name: str, version: str) -> dict:
    client = DanluClient()
    number = client.dataset(name)["latest"]["version"] if version == "latest" else int(version)
    return client.dataset_version(name, number)


def _log_input(found: DatasetDigest, context: str) -> None:
    """On the job's run (rank 0), or outside a job on the active MLflow run; a failure is a warning."""
    try:
        if _in_job():
            run = autolog.mlflow_run()
        else:  # no mlflow imported: no active run
            mlflow = sys.modules.get("mlflow")
            run = mlflow.active_run() if mlflow is not None and hasattr(mlflow, "active_run") else None
        if run is None:
            return
        from mlflow import MlflowClient  # deferred: mlflow takes ~2 s to import; only a run that logs needs it

        log_to_mlflow(MlflowClient(), run.info.run_id, found, context=context)
    except Exception as e:  # noqa: BLE001 - the data is verified; only its record in MLflow is missing
        print(f"danlu: dataset {found.name} not recorded in MLflow: {str(e)[:300]}", file=sys.stderr, flush=True)
