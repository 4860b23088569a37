"""The evaluation gate of model versions: thresholds, the evaluation notebook, and the verdict.

danlu.yaml's ``models.evaluations.NAME`` gives a registered model an evaluation notebook and metric
thresholds (``accuracy: ">= 0.9"``). Registering a version of it submits that notebook as a job of
the registrant's (:func:`job_body`: parameters ``model_uri``, ``model_name``, ``model_version``, ``model_digest``) whose
run the service creates in its own experiment (``danlu-evaluations/<model>``, where the registrant holds
only MLflow's default permission), writable only with that attempt's credentials, which end with it.
The version's gate follows the job: ``queued``, ``running``, then -- once the job has ended --
``passed`` or ``failed`` by the metrics of the run the service recorded for it (:func:`verdict`, frozen
into the version's record then), or ``error`` when the job did not succeed or has no run. These are pure
functions; the registry (:mod:`.versions`) calls them and records the outcome.
"""

from __future__ import annotations

import json
import math
import operator
import re
from pathlib import Path

from danlu.errors import ConfigError
from danlu.hub.service.mlflow_client import EVALUATIONS

#: the largest evaluation notebook the service reads
MAX_NOTEBOOK = 16 * 2**20
#: the most metrics of an evaluation run recorded on a version
THRESHOLD = re.compile(r"^\s*(>=|<=|==|>|<)\s*(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)\s*$")
OPERATORS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
#: the gate states while the evaluation job has not ended
WAITING = ("queued", "running")


def parse_threshold(text: str) -> tuple[str, float]:
    match = THRESHOLD.match(text)
    if match is None:  # the schema refuses it at start-up; this is the service's own guard
        raise ConfigError(f"models.evaluations: threshold {text[:40]!r} is not 'OP NUMBER'", fix="e.g. '>= 0.9'")
    return match.group(1), float(match.group(2))


def verdict(metrics: dict[str, float], thresholds: dict[str, str]) -> list[str]:
    """What the metrics miss: one line per threshold that is not met or whose metric was not logged."""
    failures = []
    for name, rule in sorted(thresholds.items()):
        op, limit = parse_threshold(rule)
        value = metrics.get(name)
        if value is None:
            failures.append(f"{name} was not logged by the evaluation run (needs {op} {limit:g})")
        elif not isinstance(value, (int, float)) or math.isnan(value) or not OPERATORS[op](value, limit):
            failures.append(f"{name} = {value}, needs {op} {limit:g}")
    return failures


def gate_of(job_state: str) -> str:
    """The gate while the evaluation job is in ``job_state``; ``ended`` once it is final."""
    if job_state in ("queued", "preempted"):
        return "queued"
    if job_state == "running":
        return "running"
    return "ended"


def read_notebook(path: str) -> dict:
    """The evaluation notebook (on a thread: it is a file on disk), bounded; ConfigError names what is wrong."""
    file = Path(path)
    try:
        with open(file, "rb") as f:
            raw = f.read(MAX_NOTEBOOK + 1)
    except OSError as e:
        raise ConfigError(
            f"models.evaluations: the evaluation notebook {path} cannot be read ({e.strerror or e})",
            fix="an admin fixes the path in danlu.yaml (models.evaluations.<name>.notebook)",
        ) from None
    if len(raw) > MAX_NOTEBOOK:
        raise ConfigError(
            f"models.evaluations: {path} is over {MAX_NOTEBOOK // 2**20} MiB",
            fix="keep the evaluation notebook small: load data inside it",
        )
    try:
        nb = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"models.evaluations: {path} is not a notebook ({e})", fix="save it as .ipynb") from None
    if not isinstance(nb, dict):
        raise ConfigError(f"models.evaluations: {path} is not a notebook", fix="save it as .ipynb")
    return nb


def job_body(name: str, version: int, notebook: dict, spec: dict, owner: str, digest: str | None = None) -> dict:
    """The submission of the evaluation job: the notebook, the version as parameters, the profile.

    ``model_digest`` names the copy the service made at registration: ``danlu.model(model_name, model_version)``
    loads that copy and checks it, where ``model_uri`` reads the registrant's run, which she can still rewrite.
    """
    parameters: dict = {"model_uri": f"models:/{name}/{version}", "model_name": name, "model_version": version}
    if digest:
        parameters["model_digest"] = digest
    body = {
        "notebook": notebook,
        "name": f"evaluate-{name}-v{version}"[:100],
        "parameters": parameters,
        "experiment": f"{EVALUATIONS}{name}",
    }
    if spec.get("profile"):
        body["profile"] = spec["profile"]
    return body
