"""The ``danlu`` command.

``danlu up`` starts the workbench (:mod:`danlu.hub.app`). The other commands
only translate arguments into one call of the jobs service's REST API (through
:class:`~danlu.client.DanluClient`, with ``$DANLU_URL`` and
``$JUPYTERHUB_API_TOKEN``); a mistake prints one clear line and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from danlu.errors import DanluError, UsageError

FINAL = {"succeeded", "failed", "cancelled"}


def _client(args):
    from danlu.client import DanluClient

    return DanluClient(url=args.url, token=args.token)


def _row(job: dict) -> str:
    where = f"#{job['queue_position']}" if job.get("queue_position") else ""
    return (f"{job['id']}  {job['state']:<10} {where:<4} {job['name'][:28]:<28} {job['owner'][:12]:<12} "
            f"{job['resources']['nproc']}p {job['resources']['gpus']}g  {job.get('reason') or ''}").rstrip()


def cmd_submit(args) -> int:
    import nbformat

    from danlu.train import parse_param

    path = Path(args.notebook)
    try:
        nb = nbformat.read(path, as_version=4)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such notebook") from None
    except Exception as e:
        raise UsageError(f"{path}: not a notebook ({e})") from None
    params = dict(parse_param(f"{k}={v}") for k, v in args.param)
    body = {"notebook": json.loads(nbformat.writes(nb)), "parameters": params,
            "resources": {"nproc": args.nproc, "gpus": args.gpus}, "name": args.name or None,
            "profile": args.profile, "queue": args.queue, "experiment": args.experiment,
            "datasets": args.dataset or None, "cwd": args.cwd,
            "source": {"notebook_path": str(path) if not path.is_absolute() else path.name}}
    body = {k: v for k, v in body.items() if v is not None}
    if args.dry_run:
        body["dry_run"] = True
    client = _client(args)
    job = client.submit(body)
    if args.dry_run:
        print("would start now" if job["admitted"] else f"would wait: {job['reason']}")
        return 0
    print(f"submitted {job['id']} ({job['state']})")
    if args.wait:
        for chunk in client.logs(job["id"], follow=True):
            sys.stdout.write(chunk)
            sys.stdout.flush()
        job = client.job(job["id"])
        print(f"{job['id']} {job['state']}" + (f": {job['reason']}" if job.get("reason") else ""))
        return 0 if job["state"] == "succeeded" else 1
    return 0


def cmd_list(args) -> int:
    jobs = _client(args).jobs(state=args.state, owner=args.owner)
    if args.json:
        print(json.dumps(jobs, indent=1))
    elif not jobs:
        print("no jobs")
    else:
        for job in jobs:
            print(_row(job))
    return 0


def cmd_show(args) -> int:
    job = _client(args).job(args.id)
    if args.json:
        print(json.dumps(job, indent=1))
        return 0
    for key in ("id", "name", "owner", "state", "reason", "profile", "queue", "queue_position", "created_at",
                "started_at", "finished_at", "elapsed_seconds", "mlflow_run_url", "output_url"):
        if job.get(key) not in (None, ""):
            print(f"{key:>15}: {job[key]}")
    print(f"{'resources':>15}: {job['resources']['nproc']} process(es), {job['resources']['gpus']} GPU(s)")
    for attempt in job["attempts"]:
        print(f"{'attempt ' + str(attempt['number']):>15}: {attempt['state']} {attempt.get('reason') or ''}")
    return 0


def cmd_logs(args) -> int:
    for chunk in _client(args).logs(args.id, follow=args.follow, tail=args.tail):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def cmd_cancel(args) -> int:
    job = _client(args).cancel(args.id)
    print(f"{job['id']} {job['state']}")
    return 0


def cmd_profiles(args) -> int:
    data = _client(args).profiles()
    for p in data["profiles"]:
        mark = "*" if p["slug"] == data.get("default") else " "
        print(f"{mark} {p['slug']:<20} {p['display_name']}  GPUs {p['resources']['gpus']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="danlu", description="Danlu research workbench.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    up = sub.add_parser("up", help="start the workbench (JupyterHub, jobs service, MLflow)", add_help=False)
    up.add_argument("rest", nargs=argparse.REMAINDER)

    def client_args(p):
        p.add_argument("--url", help="workbench URL (default $DANLU_URL or http://127.0.0.1:8000)")
        p.add_argument("--token", help="JupyterHub API token (default $DANLU_TOKEN or $JUPYTERHUB_API_TOKEN)")

    jobs = sub.add_parser("jobs", help="submit and follow jobs")
    jsub = jobs.add_subparsers(dest="action", metavar="ACTION")
    s = jsub.add_parser("submit", help="run a notebook as a job")
    s.add_argument("notebook")
    s.add_argument("--nproc", type=int, default=1)
    s.add_argument("--gpus", type=int, default=0)
    s.add_argument("--profile")
    s.add_argument("--queue")
    s.add_argument("--name")
    s.add_argument("--experiment")
    s.add_argument("--dataset", action="append", default=[])
    s.add_argument("--cwd", help="working directory relative to your home")
    s.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    s.add_argument("--wait", action="store_true", help="stream the log until the job ends")
    s.add_argument("--dry-run", action="store_true")
    s.set_defaults(func=cmd_submit)
    ls = jsub.add_parser("list", help="your jobs (admins: everyone's)")
    ls.add_argument("--state")
    ls.add_argument("--owner")
    ls.add_argument("--json", action="store_true")
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
    for p in (s, ls, sh, lg, cc):
        client_args(p)
    pr = sub.add_parser("profiles", help="profiles you may use")
    client_args(pr)
    pr.set_defaults(func=cmd_profiles)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from danlu.hub.app import main as up

        return up(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except DanluError as e:
        print(f"danlu: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
