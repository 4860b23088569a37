"""Submitting a job, from ``%%train`` or ``danlu jobs submit``: its options, one request body, following it.

:class:`JobOptions` are a job's options as both take them, and :func:`job_body`
is the one ``POST /jobs`` body made of them. :func:`submit_cell` submits a
``%%train`` cell, :func:`submit_notebook` a notebook file; :func:`follow`
streams a job's log until it ends, for ``--wait`` in either. A cell's job
notebook is built by :func:`build_job_notebook`, with one rule for what it
contains, in this order:

1. a ``parameters`` cell (papermill's tag) assigning every ``--param``;
2. the *setup cells*: every cell run in the kernel with ``%%train_setup``
   (imports, data loading, model definitions), the latest run of each cell, in
   the order they were first run -- so what the job runs is exactly what was
   run there, saved or not;
3. the ``%%train`` cell's own code.

The job records which setup cells it included (``source.included_cells``).
Nothing here evaluates user text: ``--param`` values are read as JSON or
Python literals, else kept as strings (:func:`parse_param`).
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat

from danlu import env
from danlu.digests import EVALUATION
from danlu.errors import UsageError

if TYPE_CHECKING:
    from danlu.client import DanluClient


@dataclass
class JobOptions:
    """A job's options, as ``%%train`` and ``danlu jobs submit`` take them; None leaves an option to the service."""

    nproc: int = 1  # processes (torchrun ranks) per node
    nodes: int = 1
    gpus: int = 0  # for the whole job
    gpu_type: str | None = None
    cpu: float | None = None
    memory: str | None = None
    profile: str | None = None
    queue: str | None = None
    priority: str | None = None
    name: str | None = None
    experiment: str | None = None
    params: dict = field(default_factory=dict)  # injected by papermill
    datasets: list[str] = field(default_factory=list)  # training datasets: paths or catalog versions
    eval_datasets: list[str] = field(default_factory=list)  # recorded with context evaluation
    retries: int | None = None
    timeout: int | None = None  # seconds
    dry_run: bool = False
    #: a sweep (``--sweep NAME=DIST(ARGS)``, repeatable): the service parses and checks it, so the magic and
    #: the CLI print its words; the other sweep options go as given (None: the service's default)
    sweep: list[str] = field(default_factory=list)
    trials: int | None = None
    objective: str | None = None
    scheduler: str | None = None
    sampler: str | None = None
    parallel: int | None = None
    seed: int | None = None

    def sweep_options(self) -> dict:
        return {
            k: v
            for k, v in (
                ("trials", self.trials),
                ("objective", self.objective),
                ("scheduler", self.scheduler),
                ("sampler", self.sampler),
                ("parallel", self.parallel),
                ("seed", self.seed),
            )
            if v is not None
        }

    def resources(self) -> dict:
        """The body's ``resources``: nodes only when more than one, the others only when given."""
        resources = {"nproc": self.nproc, "gpus": self.gpus}
        if self.nodes != 1:
            resources["nodes"] = self.nodes
        resources.update(
            {
                k: v
                for k, v in (("gpu_type", self.gpu_type), ("cpu", self.cpu), ("memory", self.memory))
                if v is not None
            }
        )
        return resources


def job_body(notebook: dict, options: JobOptions, *, cwd: str | None, source: dict) -> dict:
    """The ``POST /jobs`` body: the notebook, the options (those given), the working folder and the source."""
    body = {"notebook": notebook, "parameters": options.params, "resources": options.resources()}
    if cwd is not None:
        body["cwd"] = cwd
    body["source"] = source
    for key, value in (
        ("profile", options.profile),
        ("queue", options.queue),
        ("name", options.name),
        ("experiment", options.experiment),
        ("priority", options.priority),
        ("retries", options.retries),
        ("timeout_seconds", options.timeout),
    ):
        if value is not None:
            body[key] = value
    if options.datasets or options.eval_datasets:
        body["datasets"] = list(options.datasets) + [
            {"ref": ref, "context": EVALUATION} for ref in options.eval_datasets
        ]
    if options.dry_run:
        body["dry_run"] = True
    return body


def send(client: DanluClient, body: dict, options: JobOptions) -> dict:
    """``POST /jobs`` with the body, or, with ``--sweep``, ``POST /sweeps`` with it as the trials' job."""
    if not options.sweep:
        if options.sweep_options():
            raise UsageError(f"--{next(iter(options.sweep_options()))} is a sweep's option: add --sweep NAME=DIST(...)")
        return client.submit(body)
    if options.dry_run:
        raise UsageError("--dry-run does not go with --sweep: the sweep is checked in full before anything is queued")
    if options.objective is None:
        raise UsageError("a sweep needs --objective METRIC:min or METRIC:max, e.g. --objective val_loss:min")
    return client.start_sweep({"job": body, "sweep": list(options.sweep), **options.sweep_options()})


def sweep_line(sweep: dict) -> str:
    """One line on a sweep just started (the magic's and the CLI's)."""
    options = sweep["options"]
    return (
        f"Sweep {sweep['id']} ({sweep['name']}) started: {options['trials']} trials of "
        f"{sweep['objective']['text']}, {options['parallel']} at once, {options['scheduler']}/{options['sampler']}; "
        f"follow it with: danlu sweeps show {sweep['id']}"
    )


def unquote(text: str) -> str:
    """``text`` without the quotes IPython keeps around an argument (``--sweep "lr=uniform(0,1)"``)."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def parse_param(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value); the value is a JSON/Python literal when it parses as one."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # IPython keeps the quotes of --param 'name=a b'
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UsageError(f"--param {text!r}: write KEY=VALUE, e.g. --param lr=0.01")
    if not key.isidentifier() or keyword.iskeyword(key):
        raise UsageError(f"--param {text!r}: {key!r} is not a usable Python name (letters, digits, _; not a keyword)")
    raw = raw.strip()
    for parse in (json.loads, ast.literal_eval):
        try:
            return key, parse(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return key, raw


def python_literal(value) -> str:
    """Python source for a JSON-like value (``repr`` writes ``inf``/``nan``, which are not literals)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(python_literal(v) + ", " for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k)}: {python_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


@dataclass
class SetupCells:
    """Cells run with ``%%train_setup`` in this kernel: latest source per cell, first-run order."""

    cells: dict[str, str] = field(default_factory=dict)

    def record(self, cell_id: str, source: str) -> None:
        self.cells[cell_id] = source  # dicts keep first-insertion order; a re-run updates in place

    def forget(self, cell_ids) -> None:
        for cell_id in cell_ids or ():
            self.cells.pop(cell_id, None)


def build_job_notebook(
    cell: str,
    params: dict,
    setup: dict[str, str],
    *,
    kernel_name: str,
    display_name: str = "Python 3",
    cell_id: str | None = None,
) -> nbformat.NotebookNode:
    """The notebook a ``%%train`` cell runs as (see the module docstring for the rule)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": display_name, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    lines = [f"{key} = {python_literal(value)}" for key, value in params.items()]
    parameters = nbformat.v4.new_code_cell("\n".join(lines) or "# no parameters", metadata={"tags": ["parameters"]})
    nb.cells.append(parameters)
    for setup_id, source in setup.items():
        nb.cells.append(
            nbformat.v4.new_code_cell(source, metadata={"tags": ["danlu-setup"], "danlu": {"cell_id": setup_id}})
        )
    job_cell = nbformat.v4.new_code_cell(cell, metadata={"tags": ["danlu-cell"]})
    if cell_id and re.match(r"^[a-zA-Z0-9-_]{1,64}$", cell_id):
        job_cell["id"] = cell_id
    nb.cells.append(job_cell)
    return nb


def _git_commit(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.match(r"^[0-9a-f]{7,64}$", commit) else None


def _git_dirty(folder: Path) -> bool | None:
    """Whether tracked files have uncommitted changes (None: not a git tree, or git did not answer)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def where_am_i() -> dict:
    """Notebook path and working directory relative to $HOME, and the git commit and state, as far as known."""
    home = Path(os.environ.get("HOME", os.getcwd())).resolve()
    cwd = Path.cwd().resolve()
    rel_cwd = os.path.relpath(cwd, home) if cwd.is_relative_to(home) else "."
    session = os.environ.get("JPY_SESSION_NAME") or ""
    notebook = None
    if session:
        path = Path(session)
        path = path if path.is_absolute() else home / path
        notebook = os.path.relpath(path.resolve(), home) if path.resolve().is_relative_to(home) else None
    folder = Path(session).parent if session and Path(session).is_absolute() else cwd
    commit = _git_commit(folder)
    return {
        "cwd": rel_cwd,
        "notebook_path": notebook,
        "git_commit": commit,
        "git_dirty": _git_dirty(folder) if commit else None,
    }


def submit_cell(cell: str, options: JobOptions, *, client: DanluClient, setup: SetupCells, cell_id: str | None) -> dict:
    """Build the job notebook for a ``%%train`` cell and submit it (or dry-run it); returns the API's answer.

    The profile defaults to the server's (``$DANLU_PROFILE``); the working folder and the source (notebook,
    cell, git commit and state, setup cells) are where the kernel is.
    """
    if options.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {options.nproc}")
    if options.nodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {options.nodes}")
    if options.gpus < 0:
        raise UsageError(f"--gpus must be 0 or more, got {options.gpus}")
    options = replace(options, profile=options.profile or env.PROFILE.get())
    place = where_am_i()
    kernel = f"danlu-{options.profile or 'python'}"  # the service sets the real one
    nb = build_job_notebook(cell, options.params, dict(setup.cells), kernel_name=kernel, cell_id=cell_id)
    source = {
        k: v
        for k, v in {
            "notebook_path": place["notebook_path"],
            "cell_id": cell_id,
            "git_commit": place["git_commit"],
            "git_dirty": place.get("git_dirty"),
            "included_cells": list(setup.cells),
        }.items()
        if v is not None
    }
    return send(client, job_body(json.loads(nbformat.writes(nb)), options, cwd=place["cwd"], source=source), options)


def submit_notebook(path: Path, options: JobOptions, *, client: DanluClient, cwd: str | None = None) -> dict:
    """Submit a notebook file as a job (or dry-run it); returns the API's answer.

    ``cwd`` is the job's working folder relative to the user's home (None: the service's default).
    """
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such notebook") from None
    except Exception as e:
        raise UsageError(f"{path}: not a notebook ({e})") from None
    source = {"notebook_path": str(path) if not path.is_absolute() else path.name}
    return send(client, job_body(json.loads(nbformat.writes(nb)), options, cwd=cwd, source=source), options)


def follow(client: DanluClient, job: dict) -> dict:
    """Stream a job's log to stdout until the job ends, and return the job then.

    Ctrl-C stops following, not the job: it says how to cancel it and returns the job as it is.
    """
    try:
        for chunk in client.logs(job["id"], follow=True):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print(f"\nStopped following. Job {job['id']} keeps running; cancel it with: danlu jobs cancel {job['id']}")
    return client.job(job["id"])
