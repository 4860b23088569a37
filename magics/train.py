"""``%%train``: promote a notebook cell into a job.

The job's notebook is built by :func:`build_job_notebook`, with one rule for
what it contains, in this order:

1. a ``parameters`` cell (papermill's tag) assigning every ``--param``;
2. the *setup cells*: every cell run in this kernel with ``%%train_setup``
   (imports, data loading, model definitions), the latest run of each cell, in
   the order they were first run -- so what the job runs is exactly what you
   ran here, saved or not;
3. the ``%%train`` cell's own code.

The job records which setup cells it included (``source.included_cells``). The
magic parses its arguments (``magic_arguments``), then calls one plain
function, :func:`submit_cell`, which makes one API call; nothing in it evaluates
user text (``--param`` values are read as JSON or Python literals, else kept
as strings). :func:`last_job_id` tells a caller -- the lab extension's "Run
cell as training job", which submits with ``--quiet`` -- which job the last
``%%train`` of this kernel submitted.
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
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from danlu import env
from danlu.client import DanluClient
from danlu.errors import DanluError, UsageError

_last_job_id: str | None = None


def last_job_id() -> str | None:
    """The id of the last job ``%%train`` submitted in this kernel (None if none yet)."""
    return _last_job_id


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


def build_job_notebook(cell: str, params: dict, setup: dict[str, str], *, kernel_name: str,
                       display_name: str = "Python 3", cell_id: str | None = None) -> nbformat.NotebookNode:
    """The notebook a ``%%train`` cell runs as (see the module docstring for the rule)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": display_name, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    lines = [f"{key} = {python_literal(value)}" for key, value in params.items()]
    parameters = nbformat.v4.new_code_cell("\n".join(lines) or "# no parameters",
                                           metadata={"tags": ["parameters"]})
    nb.cells.append(parameters)
    for setup_id, source in setup.items():
        nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": ["danlu-setup"],
                                                                    "danlu": {"cell_id": setup_id}}))
    job_cell = nbformat.v4.new_code_cell(cell, metadata={"tags": ["danlu-cell"]})
    if cell_id and re.match(r"^[a-zA-Z0-9-_]{1,64}$", cell_id):
        job_cell["id"] = cell_id
    nb.cells.append(job_cell)
    return nb


def _git_commit(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.match(r"^[0-9a-f]{7,64}$", commit) else None


def _git_dirty(folder: Path) -> bool | None:
    """Whether tracked files have uncommitted changes (None: not a git tree, or git did not answer)."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=5)
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
    return {"cwd": rel_cwd, "notebook_path": notebook, "git_commit": commit,
            "git_dirty": _git_dirty(folder) if commit else None}


def submit_cell(cell: str, *, client: DanluClient, setup: SetupCells, cell_id: str | None, nproc: int = 1,
                gpus: int = 0, profile: str | None = None, queue: str | None = None, name: str | None = None,
                experiment: str | None = None, params: dict | None = None, datasets: list[str] | None = None,
                eval_datasets: list[str] | None = None,
                priority: str | None = None, retries: int | None = None, timeout: int | None = None,
                gpu_type: str | None = None, cpu: float | None = None, memory: str | None = None,
                dry_run: bool = False, nodes: int = 1) -> dict:
    """Build the job notebook for a cell and submit it (or dry-run it); returns the API's answer."""
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if nodes < 1:
        raise UsageError(f"--nnodes must be at least 1, got {nodes}")
    if gpus < 0:
        raise UsageError(f"--gpus must be 0 or more, got {gpus}")
    params = params or {}
    place = where_am_i()
    kernel = f"danlu-{profile or env.PROFILE.get('python')}"  # the service sets the real one
    nb = build_job_notebook(cell, params, dict(setup.cells), kernel_name=kernel, cell_id=cell_id)
    resources = {"nproc": nproc, "gpus": gpus}
    if nodes != 1:
        resources["nodes"] = nodes
    resources.update({k: v for k, v in (("gpu_type", gpu_type), ("cpu", cpu), ("memory", memory)) if v is not None})
    body = {
        "notebook": json.loads(nbformat.writes(nb)),
        "parameters": params,
        "resources": resources,
        "cwd": place["cwd"],
        "source": {k: v for k, v in {
            "notebook_path": place["notebook_path"], "cell_id": cell_id, "git_commit": place["git_commit"],
            "git_dirty": place.get("git_dirty"), "included_cells": list(setup.cells)}.items() if v is not None},
    }
    for key, value in (("profile", profile or env.PROFILE.get()), ("queue", queue), ("name", name),
                       ("experiment", experiment), ("priority", priority), ("retries", retries),
                       ("timeout_seconds", timeout)):
        if value is not None and value != "":
            body[key] = value
    if datasets or eval_datasets:
        body["datasets"] = list(datasets or []) + [{"ref": ref, "context": "evaluation"} for ref in eval_datasets or []]
    if dry_run:
        body["dry_run"] = True
    return client.submit(body)


def _cell_id(shell) -> str | None:
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None
    try:
        parent = kernel.get_parent("shell")
    except TypeError:
        parent = kernel.get_parent()
    except Exception:
        return None
    meta = (parent or {}).get("metadata") or {}
    return meta.get("cellId")


def _deleted_cells(shell) -> list[str]:
    kernel = getattr(shell, "kernel", None)
    try:
        parent = kernel.get_parent("shell") if kernel is not None else {}
    except Exception:
        return []
    return list(((parent or {}).get("metadata") or {}).get("deletedCells") or [])


def show_dry_run(result: dict) -> None:
    print("Dry run: nothing was submitted.")
    for i, cell in enumerate(result["notebook"].get("cells", []), 1):
        tags = ",".join(cell.get("metadata", {}).get("tags", []))
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) else source
        print(f"# --- cell {i}" + (f" [{tags}]" if tags else "") + " ---")
        print(source)
    verdict = "would start now" if result["admitted"] else f"would wait: {result['reason']}"
    print(f"# profile {result['profile']}, queue {result.get('queue', 'default')}, "
          f"{result['resources']['nproc']} process(es), {result['resources']['gpus']} GPU(s): {verdict}")


def follow(client: DanluClient, job: dict) -> dict:
    """Stream a job's log until it ends; Ctrl-C stops following, not the job."""
    try:
        for chunk in client.logs(job["id"], follow=True):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    except KeyboardInterrupt:
        print(f"\nStopped following. Job {job['id']} keeps running; cancel it with: danlu jobs cancel {job['id']}")
        return client.job(job["id"])
    return client.job(job["id"])


@magics_class
class TrainMagics(Magics):
    def __init__(self, shell):
        super().__init__(shell)
        self.setup = SetupCells()
        self.client_factory = DanluClient

    @cell_magic
    def train_setup(self, line, cell):
        """Run this cell here and include it in every later %%train job of this kernel.

        Use it for imports, data loading and definitions the training cell needs.
        Re-running the cell replaces what is recorded for it; the job lists the
        setup cells it included.
        """
        cell_id = _cell_id(self.shell) or f"setup-{len(self.setup.cells) + 1}"
        self.setup.forget(_deleted_cells(self.shell))
        result = self.shell.run_cell(cell, store_history=False)
        if result.success:
            self.setup.record(cell_id, cell)
        return None

    @magic_arguments()
    @argument("--nproc", type=int, default=1, help="Processes (torchrun ranks) per node; default 1.")
    @argument("--nnodes", type=int, default=1, help="Nodes (Kubernetes only): --nnodes x --nproc ranks; default 1.")
    @argument("--gpus", type=int, default=0, help="GPUs for the whole job (exclusive devices); default 0.")
    @argument("--profile", help="Governed profile (environment) to run on; default: this server's profile.")
    @argument("--queue", help="A team's queue; default: your first team's.")
    @argument("--priority", help="A priority class (see danlu queues); default: the workbench's default class.")
    @argument("--retries", type=int, help="Retries after infrastructure failures (killed, lost), with backoff.")
    @argument("--timeout", type=int, metavar="SECONDS", help="Stop the job after this long (it ends timed_out).")
    @argument("--gpu-type", help="A GPU flavor; default the first of your team's that fits.")
    @argument("--cpu", type=float, help="CPU cores for the job; default one per process.")
    @argument("--memory", help="Memory for the job, e.g. 16G; default the profile's.")
    @argument("--name", help="Job name (letters, digits, . _ -); default: the notebook's name.")
    @argument("--experiment", help="MLflow experiment; default <user>/<notebook name>.")
    @argument("--param", "-p", action="append", default=[], metavar="KEY=VALUE",
              help="A parameter, injected by papermill (repeatable).")
    @argument("--dataset", action="append", default=[], metavar="PATH",
              help="A training dataset (path relative to the notebook's folder, <root>:<path>, or a catalog "
                   "version NAME@VERSION, NAME@latest or NAME, re-verified at start) recorded with its content "
                   "digest (repeatable).")
    @argument("--eval-dataset", action="append", default=[], metavar="PATH",
              help="Like --dataset, recorded in MLflow with context evaluation (repeatable).")
    @argument("--wait", dest="wait", action="store_true", default=False,
              help="Stream the job's log here until it ends (Ctrl-C stops following, not the job).")
    @argument("--no-wait", dest="wait", action="store_false", help="Return at once with a live job card (default).")
    @argument("--quiet", action="store_true",
              help="Print only the job's id, with no job card, and return at once (for tools; see last_job_id()).")
    @argument("--dry-run", action="store_true", help="Show the notebook that would run and whether it would start now.")
    @cell_magic
    def train(self, line, cell):
        """Run this cell as a Danlu job (papermill, torchrun for --nproc > 1), tracked in MLflow.

        The job's notebook is: a parameters cell with every --param, the cells you ran
        with %%train_setup in this kernel (latest version of each), then this cell.
        Metrics written with torch.utils.tensorboard.SummaryWriter, the parameters,
        the cell's sha256, the notebook and the log go to one MLflow run, with no
        MLflow code in the cell.

        With --quiet it prints only the job's id; ``danlu.train.last_job_id()`` returns
        the id of the last job submitted in this kernel either way.

        Examples::

            %%train --nproc 2 --param lr=0.01 --wait
            %%train --gpus 1 --profile pytorch --dataset data/mnist
            %%train --dataset mnist@3 --eval-dataset mnist-test@1
            %%train --quiet --param lr=0.1
        """
        global _last_job_id
        try:
            args = parse_argstring(self.train, line)
            if args.quiet and args.wait:
                raise UsageError("--quiet returns at once with the job's id; it does not go with --wait")
            params = dict(parse_param(p) for p in args.param)
            client = self.client_factory()
            self.setup.forget(_deleted_cells(self.shell))
            result = submit_cell(cell, client=client, setup=self.setup, cell_id=_cell_id(self.shell),
                                 nproc=args.nproc, gpus=args.gpus, profile=args.profile, queue=args.queue,
                                 name=args.name, experiment=args.experiment, params=params, datasets=args.dataset,
                                 eval_datasets=args.eval_dataset,
                                 priority=args.priority, retries=args.retries, timeout=args.timeout,
                                 gpu_type=args.gpu_type, cpu=args.cpu, memory=args.memory, dry_run=args.dry_run,
                                 nodes=args.nnodes)
            if args.dry_run:
                show_dry_run(result)
                return None
            _last_job_id = result["id"]
            if args.quiet:
                print(result["id"])
                return None
            if args.wait:
                print(f"Job {result['id']} submitted ({result['state']}); following its log. "
                      "Ctrl-C stops following, not the job.")
                job = follow(client, result)
                print(f"Job {job['id']} {job['state']}" + (f": {job['reason']}" if job.get("reason") else "")
                      + (f"\nMLflow run: {job['mlflow_run_url']}" if job.get("mlflow_run_url") else ""))
                if job["state"] in ("failed", "cancelled", "timed_out"):
                    raise UsageError(f"job {job['id']} {job['state']}: {job.get('reason') or 'see its log'}")
                return None
            from danlu.card import JobCard

            JobCard(client, result).show()
            return None
        except DanluError as e:
            raise IPythonUsageError(str(e)) from None
