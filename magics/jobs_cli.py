"""``danlu jobs`` and ``danlu reproduce``: submit, list, show, follow, cancel, checkpoint, reprioritize, compare and
re-run jobs.

Each command is one call of the jobs service's REST API (through
:func:`danlu.cliclient.client`), or, for ``submit``, one
:func:`danlu.submit.submit_notebook`; it prints a line or a table for people,
or with ``--json`` what the API answered. :func:`add_parser` hangs the
commands under ``danlu`` (called by :func:`danlu.cli.build_parser`).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

from danlu import cliclient
from danlu.cliclient import add_client_args
from danlu.errors import UsageError
from danlu.states import FINAL_STATES


def _row(job: dict) -> str:
    where = f"#{job['queue_position']}" if job.get("queue_position") else ""
    eta = f" (est. start {job['estimated_start'][:16]})" if job.get("estimated_start") else ""
    return (
        f"{job['id']}  {job['state']:<10} {where:<4} {job['name'][:24]:<24} {job['owner'][:10]:<10} "
        f"{job.get('queue', ''):<10} {job['resources']['nproc']}p {job['resources']['gpus']}g  "
        f"{job.get('reason') or ''}{eta}"
    ).rstrip()


def cmd_submit(args) -> int:
    from danlu import submit  # deferred: nbformat (and jsonschema) take ~1.4 s; only submit needs them

    options = submit.JobOptions(
        nproc=args.nproc,
        nodes=args.nnodes,
        gpus=args.gpus,
        gpu_type=args.gpu_type,
        cpu=args.cpu,
        memory=args.memory,
        profile=args.profile,
        queue=args.queue,
        priority=args.priority,
        name=args.name or None,
        experiment=args.experiment,
        params=dict(submit.parse_param(f"{k}={v}") for k, v in args.param),
        datasets=args.dataset,
        eval_datasets=args.eval_dataset,
        retries=args.retries,
        timeout=args.timeout,
        dry_run=args.dry_run,
        sweep=args.sweep,
        trials=args.trials,
        objective=args.objective,
        scheduler=args.scheduler,
        sampler=args.sampler,
        parallel=args.parallel,
        seed=args.seed,
    )
    if args.sweep and args.wait:
        raise UsageError("--wait is for one job; follow a sweep with: danlu sweeps show ID")
    client = cliclient.client(args)
    job = submit.submit_notebook(Path(args.notebook), options, client=client, cwd=args.cwd)
    if args.sweep:
        print(submit.sweep_line(job))
        return 0
    if args.dry_run:
        print("would start now" if job["admitted"] else f"would wait: {job['reason']}")
        return 0
    print(f"submitted {job['id']} ({job['state']})")
    if args.wait:
        job = submit.follow(client, job)
        print(f"{job['id']} {job['state']}" + (f": {job['reason']}" if job.get("reason") else ""))
        if job["state"] not in FINAL_STATES:  # Ctrl-C stopped following: exit as main() does for an interrupt
            return 130
        return 0 if job["state"] == "succeeded" else 1
    return 0


def cmd_list(args) -> int:
    """Jobs newest first, page by page: printed as they come (``--json``: one array of the API's jobs), so
    ``--all`` over any number of jobs holds one page at a time."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: give at least 1 (or --all)")
    cursors: list = []
    jobs = cliclient.client(args).iter_jobs(
        state=args.state,
        owner=args.owner,
        queue=args.queue,
        cursor=args.cursor,
        limit=None if args.all else (args.limit or 200),
        pages=cursors,
    )
    count = 0
    for job in jobs:
        if args.json:
            sys.stdout.write(("[\n" if count == 0 else ",\n") + textwrap.indent(json.dumps(job, indent=1), " "))
        else:
            print(_row(job))
        count += 1
    if args.json:
        print("\n]" if count else "[]")
    elif not count:
        print("no jobs")
    if cursors and cursors[-1]:
        print(f"more jobs: add --all, or --cursor {cursors[-1]} for the next ones", file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    job = cliclient.client(args).job(args.id)
    if args.json:
        print(json.dumps(job, indent=1))
        return 0
    for key in (
        "id",
        "name",
        "owner",
        "state",
        "reason",
        "failure",
        "profile",
        "queue",
        "priority",
        "queue_position",
        "estimated_start",
        "retry_at",
        "created_at",
        "started_at",
        "finished_at",
        "elapsed_seconds",
        "mlflow_run_url",
        "output_url",
        "reproduces",
    ):
        if job.get(key) not in (None, ""):
            print(f"{key:>15}: {job[key]}")
    print(f"{'resources':>15}: {job['resources']['nproc']} process(es), {job['resources']['gpus']} GPU(s)")
    if job.get("checkpoint"):
        print(f"{'checkpoint':>15}: {checkpoint_line(job)}")
    tracking = job.get("tracking") or {}
    if tracking:
        line = f"{tracking.get('state')}, {tracking.get('points_sent', 0)} metric points"
        if tracking.get("points_dropped"):
            line += f", {tracking['points_dropped']} dropped"
        print(f"{'tracking':>15}: {line}")
        for note in tracking.get("notes") or []:
            print(f"{'':>15}  {note}")
    for attempt in job["attempts"]:
        print(f"{'attempt ' + str(attempt['number']):>15}: {attempt['state']} {attempt.get('reason') or ''}")
    for i, used in enumerate(job.get("inputs") or []):
        print(f"{'inputs' if i == 0 else '':>15}: {used['ref']:<28} {used['context']:<10} digest {used['digest'][:16]}")
    return 0


def cmd_logs(args) -> int:
    for chunk in cliclient.client(args).logs(args.id, follow=args.follow, tail=args.tail):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def cmd_cancel(args) -> int:
    job = cliclient.client(args).cancel(args.id)
    print(f"{job['id']} {job['state']}")
    return 0


def age(seconds: float) -> str:
    """``40 s``, ``12 min``, ``3.5 h``: how long ago, as people say it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def checkpoint_line(job: dict) -> str:
    """``step 1500, 40 s ago (attempt 2)``: the job's last checkpoint (for an ended job, its age when it ended)."""
    saved = job["checkpoint"]
    when = "before it ended" if job.get("state") in FINAL_STATES else "ago"
    return f"step {saved['step']}, {age(saved['age_seconds'])} {when} (attempt {saved['attempt']})"


def cmd_checkpoint(args) -> int:
    answer = cliclient.client(args).checkpoint(args.id)
    if args.json:
        print(json.dumps(answer, indent=1))
        return 0
    print(
        f"{answer['id']}: asked to save a checkpoint now (request {answer['save']}); a job that uses "
        "danlu.resumable saves within about 10 s, and `danlu jobs show` then says its step"
    )
    return 0


def cmd_priority(args) -> int:
    job = cliclient.client(args).reprioritize(args.id, args.priority)
    print(f"{job['id']} priority {job['priority']} ({job['state']})")
    return 0


def _short(value, width: int = 30) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # a dataset: its ref and digest
        value = f"{value.get('ref')} {(value.get('digest') or 'no digest')[:12]}"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def print_comparison(data: dict) -> None:
    """A comparison of two jobs as a table of what differs, then a line that sums each part up."""
    rows = [
        (part, row["name"], _short(row["a"]), _short(row["b"]), "")
        for part in ("parameters", "environment", "datasets")
        for row in data[part]
    ]
    diffs = {}
    for row in data["source"]:
        rows.append(("source", row["what"], _short(row["a"], 14), _short(row["b"], 14), ""))
        diffs[len(rows) - 1] = (row.get("diff") or "").splitlines()[2:]  # past the ---/+++ header
    for row in data["metrics"] if isinstance(data["metrics"], list) else []:
        delta = f"{row['delta']:+.6g}" if isinstance(row.get("delta"), (int, float)) else ""
        rows.append(("metrics", row["name"], _short(row["a"]), _short(row["b"]), delta))
    print(f"{'':<12} {'':<24} {'a: ' + data['a']:<30} {'b: ' + data['b']:<30}".rstrip())
    for i, (part, name, a, b, delta) in enumerate(rows):
        print(f"{part:<12} {name[:24]:<24} {a:<30} {b:<30} {delta}".rstrip())
        for line in diffs.get(i, []):
            print(f"{'':<15}{line}".rstrip())
    verdicts = {True: "identical", False: "differ", None: "unknown"}
    print(
        "; ".join(
            f"{part} {verdicts[data['identical'][part]]}"
            for part in ("parameters", "environment", "source", "datasets", "metrics")
        )
    )


def cmd_reproduce(args) -> int:

    client = cliclient.client(args)
    job = client.reproduce(args.id)
    if not args.wait:
        if args.json:
            print(json.dumps(job, indent=1))
        else:
            print(f"submitted {job['id']} ({job['state']}), reproducing {args.id}")
        return 0
    if not args.json:
        print(f"submitted {job['id']} ({job['state']}), reproducing {args.id}; waiting for it to end")
    while job["state"] not in FINAL_STATES:
        time.sleep(2)
        job = client.job(job["id"])
    comparison = client.compare(args.id, job["id"])
    if args.json:
        print(json.dumps({"job": job, "compare": comparison}, indent=1))
    else:
        print(f"{job['id']} {job['state']}" + (f": {job['reason']}" if job.get("reason") else ""))
        print_comparison(comparison)
    return 0 if job["state"] == "succeeded" else 1


def cmd_diff(args) -> int:
    data = cliclient.client(args).compare(args.a, args.b)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print_comparison(data)
    return 0


def _sweep_row(sweep: dict) -> str:
    counts = sweep["counts"]
    best = sweep.get("best")
    shown = f"best #{best['number']} {best['value']:.6g}" if best else "no best yet"
    done = sum(n for state, n in counts.items() if state != "running")
    return (
        f"{sweep['id']}  {sweep['state']:<9} {sweep['name'][:24]:<24} {sweep['owner'][:10]:<10} "
        f"{sweep['objective']['text'][:20]:<20} {done}/{sweep['options']['trials']} ended, "
        f"{counts['running']} running, {counts['pruned']} pruned  {shown}"
    )


def cmd_sweeps(args) -> int:
    """``danlu sweeps list|show ID|stop ID``: one call each; ``--json`` prints what the API answered."""
    client = cliclient.client(args)
    if args.action in ("show", "stop") and not args.id:
        raise UsageError(f"danlu sweeps {args.action} needs a sweep id (see danlu sweeps list)")
    if args.action == "list" or args.action is None:
        sweeps = client.sweeps(owner=args.owner, state=args.state)
        if args.json:
            print(json.dumps(sweeps, indent=1))
        else:
            print("\n".join(_sweep_row(s) for s in sweeps) if sweeps else "no sweeps")
        return 0
    sweep = client.stop_sweep(args.id) if args.action == "stop" else client.sweep(args.id)
    if args.json:
        print(json.dumps(sweep, indent=1))
        return 0
    print(_sweep_row(sweep))
    if sweep.get("reason"):
        print(f"  {sweep['reason']}")
    for note in sweep.get("notes") or []:
        print(f"  note: {note}")
    if sweep.get("mlflow_run_url"):
        print(f"  MLflow: {sweep['mlflow_run_url']}")
    for t in sweep["trials"]:
        value = f"{t['value']:.6g}" if t["value"] is not None else "-"
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items())
        step = t["step"] if t["step"] is not None else "-"
        print(
            f"  #{t['number']:<4} {t['state']:<9} {t['job_id'] or '-':<12} step {step:<6}"
            f" {value:<12} {params}  {t['reason'][:60]}".rstrip()
        )
    return 0


def add_parser(sub) -> None:
    """``danlu jobs ...`` and ``danlu reproduce`` under the ``danlu`` command's subparsers."""
    jobs = sub.add_parser("jobs", help="submit and follow jobs")
    jsub = jobs.add_subparsers(dest="action", metavar="ACTION")
    s = jsub.add_parser("submit", help="run a notebook as a job")
    s.add_argument("notebook")
    s.add_argument("--nproc", type=int, default=1, help="processes (torchrun ranks) per node")
    s.add_argument("--nnodes", type=int, default=1, help="nodes (Kubernetes only)")
    s.add_argument("--gpus", type=int, default=0)
    s.add_argument("--profile")
    s.add_argument("--queue", help="a team's queue (default your first team's)")
    s.add_argument("--priority", help="a priority class")
    s.add_argument("--retries", type=int, help="retries after infrastructure failures")
    s.add_argument("--timeout", type=int, help="seconds before the job is stopped (timed_out)")
    s.add_argument("--gpu-type", help="GPU flavor")
    s.add_argument("--cpu", type=float, help="CPU cores (default one per process)")
    s.add_argument("--memory", help="memory, e.g. 16G")
    s.add_argument("--name")
    s.add_argument("--experiment")
    s.add_argument(
        "--dataset",
        action="append",
        default=[],
        help="PATH (relative to --cwd), ROOT:PATH, or a catalog version NAME@VERSION, NAME@latest or NAME",
    )
    s.add_argument(
        "--eval-dataset",
        action="append",
        default=[],
        metavar="DATASET",
        help="like --dataset, recorded in MLflow with context evaluation",
    )
    s.add_argument("--cwd", help="working directory relative to your home")
    s.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    s.add_argument("--wait", action="store_true", help="stream the log until the job ends")
    s.add_argument("--dry-run", action="store_true")
    s.add_argument("--sweep", action="append", default=[], metavar="NAME=DIST(ARGS)", help="search a parameter")
    s.add_argument("--trials", type=int, help="sweep: trials in all (default 16)")
    s.add_argument("--objective", metavar="METRIC:min|max", help="sweep: the logged metric to optimize")
    s.add_argument("--scheduler", help="sweep: asha (default), hyperband or none")
    s.add_argument("--sampler", help="sweep: tpe (default) or random")
    s.add_argument("--parallel", type=int, help="sweep: trials under way at once")
    s.add_argument("--seed", type=int, help="sweep: the sampler's seed")
    s.set_defaults(func=cmd_submit)
    ls = jsub.add_parser("list", help="your jobs (admins: everyone's), newest first")
    ls.add_argument("--state", help="only these states (comma-separated)")
    ls.add_argument("--owner", help="admins: only this user's jobs")
    ls.add_argument("--limit", type=int, help="at most this many jobs (default 200)")
    ls.add_argument("--all", action="store_true", help="every job, reading page after page")
    ls.add_argument("--cursor", help="start where an earlier listing stopped (the cursor it printed)")
    ls.add_argument("--json", action="store_true", help="the API's jobs, as one JSON array")
    ls.set_defaults(func=cmd_list)
    sh = jsub.add_parser("show", help="one job")
    sh.add_argument("id")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_show)
    lg = jsub.add_parser("logs", help="a job's log")
    lg.add_argument("id")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int)
    lg.set_defaults(func=cmd_logs)
    cc = jsub.add_parser("cancel", help="cancel a job")
    cc.add_argument("id")
    cc.set_defaults(func=cmd_cancel)
    ck = jsub.add_parser("checkpoint", help="ask a running job to save a checkpoint now")
    ck.add_argument("id", metavar="JOB")
    ck.add_argument("--json", action="store_true", help="what the API answered")
    ck.set_defaults(func=cmd_checkpoint)
    pp = jsub.add_parser("priority", help="reprioritize a job (admins)")
    pp.add_argument("id")
    pp.add_argument("priority", help="a priority class")
    pp.set_defaults(func=cmd_priority)
    df = jsub.add_parser("diff", help="what differs between two jobs (parameters, environment, source, data, metrics)")
    df.add_argument("a", metavar="A", help="a job id")
    df.add_argument("b", metavar="B", help="another job id")
    df.add_argument("--json", action="store_true")
    df.set_defaults(func=cmd_diff)
    for p in (s, ls, sh, lg, cc, pp, df, ck):
        add_client_args(p)
    ls.add_argument("--queue", help="only this queue")
    sw = sub.add_parser("sweeps", help="hyperparameter sweeps: list, show, stop")
    sw.add_argument("action", nargs="?", choices=("list", "show", "stop"), default="list")
    sw.add_argument("id", nargs="?", help="a sweep id (show, stop)")
    sw.add_argument("--owner", help="admins: only this user's sweeps")
    sw.add_argument("--state", help="only sweeps in this state (running, succeeded, stopped, failed)")
    sw.add_argument("--json", action="store_true", help="what the API answered")
    sw.set_defaults(func=cmd_sweeps)
    add_client_args(sw)
    rp = sub.add_parser(
        "reproduce", help="run a job again exactly (same notebook, parameters, profile, data) and compare"
    )
    rp.add_argument("id", metavar="JOB", help="the job to run again")
    rp.add_argument("--wait", action="store_true", help="wait for the new job, then print what differs")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_reproduce)
    add_client_args(rp)
