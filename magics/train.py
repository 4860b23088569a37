"""``%%train`` and ``%%train_setup``: promote a notebook cell into a job.

The magic parses its arguments (``magic_arguments``) into
:class:`~danlu.submit.JobOptions`, then calls one plain function,
:func:`~danlu.submit.submit_cell`, which makes one API call (what the job's
notebook holds is the rule in :mod:`danlu.submit`). ``%%train_setup`` runs
its cell here and records it for every later job of this kernel. After a
submission the magic shows a live job card (:mod:`danlu.card`), follows the
log (``--wait``), or prints only the job's id (``--quiet``, for the lab
extension's "Run cell as training job", which then asks
:func:`danlu.last_job_id`).
"""

from __future__ import annotations

from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

import danlu
from danlu.card import JobCard
from danlu.client import DanluClient
from danlu.errors import DanluError, UsageError
from danlu.submit import JobOptions, SetupCells, follow, parse_param, submit_cell, sweep_line, unquote


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
    print(
        f"# profile {result['profile']}, queue {result.get('queue', 'default')}, "
        f"{result['resources']['nproc']} process(es), {result['resources']['gpus']} GPU(s): {verdict}"
    )


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
    @argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A parameter, injected by papermill (repeatable).",
    )
    @argument(
        "--dataset",
        action="append",
        default=[],
        metavar="PATH",
        help="A training dataset (path relative to the notebook's folder, <root>:<path>, or a catalog "
        "version NAME@VERSION, NAME@latest or NAME, re-verified at start) recorded with its content "
        "digest (repeatable).",
    )
    @argument(
        "--eval-dataset",
        action="append",
        default=[],
        metavar="PATH",
        help="Like --dataset, recorded in MLflow with context evaluation (repeatable).",
    )
    @argument(
        "--wait",
        dest="wait",
        action="store_true",
        default=False,
        help="Stream the job's log here until it ends (Ctrl-C stops following, not the job).",
    )
    @argument("--no-wait", dest="wait", action="store_false", help="Return at once with a live job card (default).")
    @argument(
        "--quiet",
        action="store_true",
        help="Print only the job's id, with no job card, and return at once (for tools: see danlu.last_job_id()).",
    )
    @argument("--dry-run", action="store_true", help="Show the notebook that would run and whether it would start now.")
    @argument(
        "--sweep",
        action="append",
        default=[],
        metavar="NAME=DIST(ARGS)",
        help="Search a parameter (repeatable): uniform(a,b), loguniform(a,b), int(a,b) or choice(v1,...). "
        "The cell becomes a sweep: a set of ordinary jobs, one per trial.",
    )
    @argument("--trials", type=int, help="Sweep: trials in all (default 16).")
    @argument("--objective", metavar="METRIC:min|max", help="Sweep: the logged metric to minimize or maximize.")
    @argument("--scheduler", help="Sweep: asha (default), hyperband or none (no early stopping).")
    @argument("--sampler", help="Sweep: tpe (default) or random.")
    @argument("--parallel", type=int, help="Sweep: trials under way at once (default min(4, trials)).")
    @argument("--seed", type=int, help="Sweep: the sampler's seed.")
    @cell_magic
    def train(self, line, cell):
        """Run this cell as a Danlu job (papermill, torchrun for --nproc > 1), tracked in MLflow.

        The job's notebook is: a parameters cell with every --param, the cells you ran
        with %%train_setup in this kernel (latest version of each), then this cell.
        Metrics written with torch.utils.tensorboard.SummaryWriter, the parameters,
        the cell's sha256, the notebook and the log go to one MLflow run, with no
        MLflow code in the cell.

        With --quiet it prints only the job's id; ``danlu.last_job_id()`` returns
        the id of the last job submitted in this kernel either way.

        Examples::

            %%train --nproc 2 --param lr=0.01 --wait
            %%train --gpus 1 --profile pytorch --dataset data/mnist
            %%train --dataset mnist@3 --eval-dataset mnist-test@1
            %%train --quiet --param lr=0.1
            %%train --sweep "lr=loguniform(1e-4,1e-1)" --trials 64 --objective val_loss:min
        """
        try:
            args = parse_argstring(self.train, line)
            if args.quiet and args.wait:
                raise UsageError("--quiet returns at once with the job's id; it does not go with --wait")
            options = JobOptions(
                nproc=args.nproc,
                nodes=args.nnodes,
                gpus=args.gpus,
                gpu_type=args.gpu_type,
                cpu=args.cpu,
                memory=args.memory,
                params=dict(parse_param(p) for p in args.param),
                datasets=args.dataset,
                eval_datasets=args.eval_dataset,
                retries=args.retries,
                timeout=args.timeout,
                dry_run=args.dry_run,
                # an empty one of these is its default, as %%train has always read them
                profile=args.profile or None,
                queue=args.queue or None,
                priority=args.priority or None,
                name=args.name or None,
                experiment=args.experiment or None,
                sweep=[unquote(s) for s in args.sweep],
                trials=args.trials,
                objective=unquote(args.objective) if args.objective else None,
                scheduler=args.scheduler or None,
                sampler=args.sampler or None,
                parallel=args.parallel,
                seed=args.seed,
            )
            if options.sweep and (args.wait or args.quiet):
                raise UsageError("--wait and --quiet are for one job; follow a sweep with: danlu sweeps show ID")
            client = self.client_factory()
            self.setup.forget(_deleted_cells(self.shell))
            result = submit_cell(cell, options, client=client, setup=self.setup, cell_id=_cell_id(self.shell))
            if args.dry_run:
                show_dry_run(result)
                return None
            if options.sweep:
                print(sweep_line(result))
                return None
            danlu._last_job_id = result["id"]
            if args.quiet:
                print(result["id"])
                return None
            if args.wait:
                print(
                    f"Job {result['id']} submitted ({result['state']}); following its log. "
                    "Ctrl-C stops following, not the job."
                )
                job = follow(client, result)
                print(
                    f"Job {job['id']} {job['state']}"
                    + (f": {job['reason']}" if job.get("reason") else "")
                    + (f"\nMLflow run: {job['mlflow_run_url']}" if job.get("mlflow_run_url") else "")
                )
                if job["state"] in ("failed", "cancelled", "timed_out"):
                    raise UsageError(f"job {job['id']} {job['state']}: {job.get('reason') or 'see its log'}")
                return None
            JobCard(client, result).show()
            return None
        except DanluError as e:
            raise IPythonUsageError(str(e)) from None
