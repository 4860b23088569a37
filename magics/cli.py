"""The ``danlu`` command's client side: jobs, queues, audit, usage, profiles, datasets, reproduce.

Each command only translates arguments into one call of the jobs service's
REST API (through :class:`~danlu.client.DanluClient`, with ``$DANLU_URL`` and
``$JUPYTERHUB_API_TOKEN``); a mistake prints one clear line and exits with 2.
The commands that run beside the hub (``danlu up``, ``danlu kueue render``)
are added by :mod:`danlu.hub.cli`, which is what the ``danlu`` script runs, so
this side never imports the hub's.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from danlu.errors import DanluError, UsageError


def _client(args):
    from danlu.client import DanluClient

    return DanluClient(url=args.url, token=args.token)


def _row(job: dict) -> str:
    where = f"#{job['queue_position']}" if job.get("queue_position") else ""
    eta = f" (est. start {job['estimated_start'][:16]})" if job.get("estimated_start") else ""
    return (f"{job['id']}  {job['state']:<10} {where:<4} {job['name'][:24]:<24} {job['owner'][:10]:<10} "
            f"{job.get('queue', ''):<10} {job['resources']['nproc']}p {job['resources']['gpus']}g  "
            f"{job.get('reason') or ''}{eta}").rstrip()


def _pairs(values: list[str], option: str) -> dict:
    out = {}
    for value in values:
        key, sep, amount = value.partition("=")
        if not sep:
            raise UsageError(f"{option} {value!r}: write FLAVOR=COUNT, e.g. {option} a100=2")
        try:
            out[key] = int(amount)
        except ValueError:
            raise UsageError(f"{option} {value!r}: {amount!r} is not a whole number") from None
    return out


def cmd_submit(args) -> int:
    from danlu import submit

    options = submit.JobOptions(
        nproc=args.nproc, nodes=args.nnodes, gpus=args.gpus, gpu_type=args.gpu_type, cpu=args.cpu,
        memory=args.memory, profile=args.profile, queue=args.queue, priority=args.priority, name=args.name or None,
        experiment=args.experiment, params=dict(submit.parse_param(f"{k}={v}") for k, v in args.param),
        datasets=args.dataset, eval_datasets=args.eval_dataset, retries=args.retries, timeout=args.timeout,
        dry_run=args.dry_run)
    client = _client(args)
    job = submit.submit_notebook(Path(args.notebook), options, client=client, cwd=args.cwd)
    if args.dry_run:
        print("would start now" if job["admitted"] else f"would wait: {job['reason']}")
        return 0
    print(f"submitted {job['id']} ({job['state']})")
    if args.wait:
        job = submit.follow(client, job)
        print(f"{job['id']} {job['state']}" + (f": {job['reason']}" if job.get("reason") else ""))
        return 0 if job["state"] == "succeeded" else 1
    return 0


def cmd_list(args) -> int:
    """Jobs newest first, page by page: printed as they come (``--json``: one array of the API's jobs), so
    ``--all`` over any number of jobs holds one page at a time."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: give at least 1 (or --all)")
    cursors: list = []
    jobs = _client(args).iter_jobs(state=args.state, owner=args.owner, queue=args.queue, cursor=args.cursor,
                                   limit=None if args.all else (args.limit or 200), pages=cursors)
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
    job = _client(args).job(args.id)
    if args.json:
        print(json.dumps(job, indent=1))
        return 0
    for key in ("id", "name", "owner", "state", "reason", "failure", "profile", "queue", "priority", "queue_position",
                "estimated_start", "retry_at", "created_at", "started_at", "finished_at", "elapsed_seconds",
                "mlflow_run_url", "output_url", "reproduces"):
        if job.get(key) not in (None, ""):
            print(f"{key:>15}: {job[key]}")
    print(f"{'resources':>15}: {job['resources']['nproc']} process(es), {job['resources']['gpus']} GPU(s)")
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
    for chunk in _client(args).logs(args.id, follow=args.follow, tail=args.tail):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def cmd_cancel(args) -> int:
    job = _client(args).cancel(args.id)
    print(f"{job['id']} {job['state']}")
    return 0


def cmd_priority(args) -> int:
    job = _client(args).reprioritize(args.id, args.priority)
    print(f"{job['id']} priority {job['priority']} ({job['state']})")
    return 0


def _amount(quota: dict) -> str:
    parts = [f"{n:g} {flavor}" for flavor, n in (quota.get("gpus") or {}).items()]
    if "cpu" in quota:
        parts.append(f"{quota['cpu']:g} cpu")
    if "memory" in quota:
        parts.append(f"{quota['memory']} memory")
    return ", ".join(parts) or "-"


def cmd_queues(args) -> int:
    client = _client(args)
    if args.action and not args.name:
        raise UsageError(f"danlu queues {args.action} needs a queue name")
    if args.action == "reset":
        queue = client.reset_queue(args.name)
        print(f"queue {queue['name']}: back to danlu.yaml, quota {_amount(queue['quota'])}")
        return 0
    if args.action in ("hold", "release"):
        queue = client.hold(args.name, args.action == "hold")
        print(f"queue {queue['name']} {'held' if queue['held'] else 'released'}")
        return 0
    if args.action == "set":
        changes = {}
        quota = {}
        if args.gpus:
            quota["gpus"] = _pairs(args.gpus, "--gpus")
        if args.cpu is not None:
            quota["cpu"] = args.cpu
        if args.memory is not None:
            quota["memory"] = args.memory
        if quota:
            changes["quota"] = quota
        if args.borrow_gpus:
            changes["borrowing_limit"] = {"gpus": _pairs(args.borrow_gpus, "--borrow-gpus")}
        if args.lend_gpus:
            changes["lending_limit"] = {"gpus": _pairs(args.lend_gpus, "--lend-gpus")}
        if not changes:
            raise UsageError("nothing to change: give --gpus, --cpu, --memory, --borrow-gpus or --lend-gpus")
        queue = client.change_queue(args.name, changes)
        print(f"queue {queue['name']}: quota {_amount(queue['quota'])}")
        return 0
    data = client.queues()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    if data["draining"]:
        print("the workbench is draining: no job starts")
    print(f"{'queue':<12} {'cohort':<10} {'quota':<22} {'in use':<18} {'running':>7} {'waiting':>7}")
    for q in data["queues"]:
        held = " (held)" if q["held"] else ""
        borrowed = "".join(f" +{n:g} {f} borrowed" for f, n in q.get("borrowing", {}).items())
        print(f"{q['name'] + held:<12} {q.get('cohort') or '-':<10} {_amount(q['quota']):<22} "
              f"{_amount(q['usage']) + borrowed:<18} {q['running']:>7} {q['pending']:>7}")
    return 0


def cmd_drain(args) -> int:
    state = _client(args).drain(args.state == "on")
    print("draining: no job starts until 'danlu drain off'" if state["draining"] else "no longer draining")
    return 0


def cmd_audit(args) -> int:
    client = _client(args)
    if args.action == "verify":
        result = client.audit_verify()
        if result["ok"]:
            print(f"audit log intact: {result['records']} records")
            return 0
        print(f"audit log broken: {result['problem']}", file=sys.stderr)
        return 1
    records = client.audit(limit=args.limit, action=args.filter_action, target=args.target)
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    for r in records:
        change = f"{json.dumps(r['before'])} -> {json.dumps(r['after'])}" if r["before"] else json.dumps(r["after"])
        print(f"{r['seq']:>6} {r['at'][:19]} {r['actor']:<12} {r['action']:<14} {r['target']:<14} {change}")
    return 0


def cmd_usage(args) -> int:
    data = _client(args).usage(start=args.start, end=args.end, by=args.by, user=args.user)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    currency = data.get("currency") or ""
    print(f"GPU usage {data['from'][:16]} .. {data['to'][:16]}, by {data['by']}")
    cost = f"cost {currency}".strip()
    print(f"{data['by']:<16} {'GPU-hours':>10} {cost:>12} {'jobs':>6} {'servers':>8} {'measured util':>14}")
    for row in data["rows"]:
        util = f"{row['measured_utilization']:.0f}%" if row["measured_utilization"] is not None else "n/a"
        print(f"{row[data['by']]:<16} {row['gpu_hours']:>10.2f} {row['cost']:>12.2f} {row['jobs']:>6} "
              f"{row['servers']:>8} {util:>14}")
    print(f"{'total':<16} {data['total']['gpu_hours']:>10.2f} {data['total']['cost']:>12.2f}")
    for server in data.get("idle_gpu_servers", []):
        print(f"idle: server {server['server']} holds {server['gpus']} GPU(s), no activity for "
              f"{server['idle_minutes']:.0f} min")
    return 0


def cmd_profiles(args) -> int:
    data = _client(args).profiles()
    for p in data["profiles"]:
        mark = "*" if p["slug"] == data.get("default") else " "
        print(f"{mark} {p['slug']:<20} {p['display_name']}  GPUs {p['resources']['gpus']}")
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _tables(version: dict) -> None:
    for t in version.get("tables") or []:
        columns = ", ".join(t["columns"]) if t.get("columns") is not None else "-"
        rows = f"{t['rows']} rows" if t.get("rows") is not None else ""
        note = f" ({t['note']})" if t.get("note") else ""
        print(f"{'':>12}  {t['path']} [{t['format']}] {rows} columns: {columns}{note}")


def _users(used_by: list[dict]) -> None:
    """The jobs that used a version (the ones the caller may see, newest first)."""
    if not used_by:
        print(f"{'used by':>12}: no job you can see")
        return
    print(f"{'used by':>12}: {'job':<12} {'owner':<12} {'state':<10} {'context':<10} mlflow run")
    for u in used_by:
        print(f"{'':>12}  {u['job_id']:<12} {u['owner'][:12]:<12} {u['state']:<10} {u['context']:<10} "
              f"{u.get('mlflow_run_id') or '-'}")


def cmd_datasets_register(args) -> int:
    body = {"name": args.name, "path": args.path}
    if args.description is not None:
        body["description"] = args.description
    if args.read_group:
        body["read_groups"] = args.read_group
    if args.register_group:
        body["register_groups"] = args.register_group
    created, version = _client(args).register_dataset(body)
    if args.json:
        print(json.dumps(version, indent=1))
        return 0
    what = "registered" if created else "unchanged: already registered as"
    print(f"{what} {version['ref']}  {version['files']} files, {_size(version['bytes'])}, "
          f"digest {version['digest'][:16]}")
    return 0


def cmd_datasets_list(args) -> int:
    datasets = _client(args).datasets()
    if args.json:
        print(json.dumps(datasets, indent=1))
        return 0
    if not datasets:
        print("no datasets")
        return 0
    print(f"{'name':<24} {'latest':>6} {'files':>8} {'size':>10} {'digest':<16}  description")
    for ds in datasets:
        v = ds.get("latest") or {}
        print(f"{ds['name']:<24} {v.get('version', '-'):>6} {v.get('files', '-'):>8} "
              f"{_size(v['bytes']) if v else '-':>10} {v.get('digest', '-')[:16]:<16}  {ds['description'][:40]}")
    return 0


def cmd_datasets_show(args) -> int:
    client = _client(args)
    name, sep, number = args.ref.partition("@")
    if sep and not number.isdigit():
        raise UsageError(f"{args.ref!r}: write NAME or NAME@VERSION, e.g. {name}@1")
    data = client.dataset_version(name, int(number)) if sep else client.dataset(name)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    if sep:
        for key in ("ref", "digest", "files", "bytes", "source", "path", "created_by", "created_at"):
            print(f"{key:>12}: {_size(data[key]) if key == 'bytes' else data[key]}")
        _tables(data)
        manifest = data.get("manifest") or []
        for rel, size, sha in manifest[:20]:
            print(f"{'':>12}  {sha[:12]} {_size(size):>10}  {rel}")
        if len(manifest) > 20:
            print(f"{'':>12}  ... {len(manifest) - 20} more files (--json lists them all)")
        _users(data.get("used_by") or [])
        return 0
    for key in ("name", "description", "created_by", "created_at"):
        print(f"{key:>15}: {data[key]}")
    print(f"{'read groups':>15}: {', '.join(data['read_groups']) or 'everyone'}")
    print(f"{'register groups':>15}: {', '.join(data['register_groups']) or 'everyone'}")
    print(f"{'version':>7} {'files':>8} {'size':>10} {'digest':<16}  {'created':<19} {'by':<12} source")
    for v in data.get("versions") or []:
        print(f"{v['version']:>7} {v['files']:>8} {_size(v['bytes']):>10} {v['digest'][:16]:<16}  "
              f"{v['created_at'][:19]:<19} {v['created_by'][:12]:<12} {v['source']}")
    return 0


def _short(value, width: int = 30) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # a dataset: its ref and digest
        value = f"{value.get('ref')} {(value.get('digest') or 'no digest')[:12]}"
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[:width - 1] + "…"


def print_comparison(data: dict) -> None:
    """A comparison of two jobs as a table of what differs, then a line that sums each part up."""
    rows = [(part, row["name"], _short(row["a"]), _short(row["b"]), "")
            for part in ("parameters", "environment", "datasets") for row in data[part]]
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
    print("; ".join(f"{part} {verdicts[data['identical'][part]]}"
                    for part in ("parameters", "environment", "source", "datasets", "metrics")))


def cmd_reproduce(args) -> int:
    import time

    from danlu.client import FINAL_STATES

    client = _client(args)
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
    data = _client(args).compare(args.a, args.b)
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print_comparison(data)
    return 0


LINEAGE_ORDER = ("model_version", "approval", "evaluation", "run", "job", "notebook", "cell", "dataset_version",
                 "environment")


def cmd_lineage(args) -> int:
    name, sep, number = args.ref.partition("@")
    version = args.version if args.version is not None else (number if sep else None)
    if not version or not str(version).isdigit():
        raise UsageError(f"{args.ref!r}: name a model version, e.g. 'danlu lineage {name} 1' or {name}@1")
    data = _client(args).lineage(name, int(version))
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    by_kind: dict[str, list[dict]] = {}
    for node in data["nodes"]:
        by_kind.setdefault(node["kind"], []).append(node)
    for kind in LINEAGE_ORDER + tuple(k for k in by_kind if k not in LINEAGE_ORDER):
        for node in by_kind.get(kind, []):
            print(f"{kind.replace('_', ' '):>15}: {node['label']}")
            for key, value in node["detail"].items():
                print(f"{'':>15}  {key}: {value}")
            if node.get("url"):
                print(f"{'':>15}  {node['url']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="danlu", description="Danlu research workbench.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = sub  # danlu.hub.cli adds the hub-side commands here

    def client_args(p):
        p.add_argument("--url", help="workbench URL (default $DANLU_URL or http://127.0.0.1:8000)")
        p.add_argument("--token", help="JupyterHub API token (default $DANLU_TOKEN or $JUPYTERHUB_API_TOKEN)")

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
    s.add_argument("--dataset", action="append", default=[],
                   help="PATH (relative to --cwd), ROOT:PATH, or a catalog version NAME@VERSION, NAME@latest or NAME")
    s.add_argument("--eval-dataset", action="append", default=[], metavar="DATASET",
                   help="like --dataset, recorded in MLflow with context evaluation")
    s.add_argument("--cwd", help="working directory relative to your home")
    s.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    s.add_argument("--wait", action="store_true", help="stream the log until the job ends")
    s.add_argument("--dry-run", action="store_true")
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
    pp = jsub.add_parser("priority", help="reprioritize a job (admins)")
    pp.add_argument("id")
    pp.add_argument("priority", help="a priority class")
    pp.set_defaults(func=cmd_priority)
    df = jsub.add_parser("diff", help="what differs between two jobs (parameters, environment, source, data, "
                                      "metrics)")
    df.add_argument("a", metavar="A", help="a job id")
    df.add_argument("b", metavar="B", help="another job id")
    df.add_argument("--json", action="store_true")
    df.set_defaults(func=cmd_diff)
    for p in (s, ls, sh, lg, cc, pp, df):
        client_args(p)
    ls.add_argument("--queue", help="only this queue")

    qs = sub.add_parser("queues", help="queues, quotas and use; admins: hold, release, set")
    qs.add_argument("action", nargs="?", choices=["hold", "release", "set", "reset"])
    qs.add_argument("name", nargs="?")
    qs.add_argument("--gpus", action="append", default=[], metavar="FLAVOR=N", help="set: nominal GPU quota")
    qs.add_argument("--cpu", type=float, help="set: nominal CPU quota")
    qs.add_argument("--memory", help="set: nominal memory quota")
    qs.add_argument("--borrow-gpus", action="append", default=[], metavar="FLAVOR=N", help="set: borrowing limit")
    qs.add_argument("--lend-gpus", action="append", default=[], metavar="FLAVOR=N", help="set: lending limit")
    qs.add_argument("--json", action="store_true")
    qs.set_defaults(func=cmd_queues)
    dr = sub.add_parser("drain", help="admins: stop admitting jobs (on) or resume (off)")
    dr.add_argument("state", choices=["on", "off"])
    dr.set_defaults(func=cmd_drain)
    au = sub.add_parser("audit", help="admins: the audit log, or 'verify' its hash chain")
    au.add_argument("action", nargs="?", choices=["verify"])
    au.add_argument("--limit", type=int, default=50)
    au.add_argument("--action", dest="filter_action", help="only this action")
    au.add_argument("--target", help="only this job or queue")
    au.add_argument("--json", action="store_true")
    au.set_defaults(func=cmd_audit)
    us = sub.add_parser("usage", help="GPU-hours and cost (yours; admins: everyone's)")
    us.add_argument("--from", dest="start", help="ISO date/time (default 30 days ago)")
    us.add_argument("--to", dest="end", help="ISO date/time (default now)")
    us.add_argument("--by", choices=["user", "team", "queue", "profile"], default="user")
    us.add_argument("--user")
    us.add_argument("--json", action="store_true")
    us.set_defaults(func=cmd_usage)
    for p in (qs, dr, au, us):
        client_args(p)
    ds = sub.add_parser("datasets", help="the dataset catalog: register, list, show versions")
    dsub = ds.add_subparsers(dest="action", metavar="ACTION")
    rg = dsub.add_parser("register", help="register a file or folder as a version of a dataset")
    rg.add_argument("name", help="the dataset's name (lowercase letters, digits, - _ .)")
    rg.add_argument("path", help="PATH relative to your home, or ROOT:PATH under a dataset root")
    rg.add_argument("--description")
    rg.add_argument("--read-group", action="append", default=[], metavar="GROUP",
                    help="who may read it (first registration; default everyone)")
    rg.add_argument("--register-group", action="append", default=[], metavar="GROUP",
                    help="who may add versions (first registration; default everyone)")
    rg.set_defaults(func=cmd_datasets_register)
    dl = dsub.add_parser("list", help="the datasets you may read")
    dl.set_defaults(func=cmd_datasets_list)
    dw = dsub.add_parser("show", help="a dataset and its versions, or one version and the jobs that used it "
                                      "(NAME@VERSION)")
    dw.add_argument("ref", metavar="NAME[@VERSION]")
    dw.set_defaults(func=cmd_datasets_show)
    for p in (rg, dl, dw):
        p.add_argument("--json", action="store_true")
        client_args(p)
    rp = sub.add_parser("reproduce", help="run a job again exactly (same notebook, parameters, profile, data) "
                                          "and compare")
    rp.add_argument("id", metavar="JOB", help="the job to run again")
    rp.add_argument("--wait", action="store_true", help="wait for the new job, then print what differs")
    rp.add_argument("--json", action="store_true")
    rp.set_defaults(func=cmd_reproduce)
    client_args(rp)
    from danlu import models_cli

    models_cli.add_parser(sub, client_args)
    li = sub.add_parser("lineage", help="what made a model version: run, job, notebook and cell, datasets, "
                                        "environment, evaluation, approvals")
    li.add_argument("ref", metavar="NAME", help="the model (or NAME@VERSION)")
    li.add_argument("version", nargs="?", help="the version number")
    li.add_argument("--json", action="store_true", help="the API's answer: {model, nodes, edges}")
    li.set_defaults(func=cmd_lineage)
    client_args(li)
    pr = sub.add_parser("profiles", help="profiles you may use")
    client_args(pr)
    pr.set_defaults(func=cmd_profiles)
    return parser


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = parser or build_parser()
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
