"""The ``danlu`` command's client side: its parser and main, and the workbench's queues, audit, usage and profiles.

Each command only translates arguments into one call of the jobs service's
REST API (through :func:`danlu.cliclient.client`, with ``$DANLU_URL`` and
``$JUPYTERHUB_API_TOKEN``); a mistake prints one clear line and exits with 2.
The commands on jobs, datasets and models live in :mod:`danlu.jobs_cli`,
:mod:`danlu.datasets_cli` and :mod:`danlu.models_cli`. The commands that run
beside the hub (``danlu up``, ``danlu kueue render``) are added by
:mod:`danlu.hub.cli`, which is what the ``danlu`` script runs, so this side
never imports the hub's.
"""

from __future__ import annotations

import argparse
import json
import sys

from danlu import cliclient, datasets_cli, jobs_cli, models_cli
from danlu.cliclient import add_client_args
from danlu.errors import DanluError, UsageError


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


def _amount(quota: dict) -> str:
    parts = [f"{n:g} {flavor}" for flavor, n in (quota.get("gpus") or {}).items()]
    if "cpu" in quota:
        parts.append(f"{quota['cpu']:g} cpu")
    if "memory" in quota:
        parts.append(f"{quota['memory']} memory")
    return ", ".join(parts) or "-"


def cmd_queues(args) -> int:
    client = cliclient.client(args)
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
        print(
            f"{q['name'] + held:<12} {q.get('cohort') or '-':<10} {_amount(q['quota']):<22} "
            f"{_amount(q['usage']) + borrowed:<18} {q['running']:>7} {q['pending']:>7}"
        )
    return 0


def cmd_drain(args) -> int:
    state = cliclient.client(args).drain(args.state == "on")
    print("draining: no job starts until 'danlu drain off'" if state["draining"] else "no longer draining")
    return 0


def cmd_audit(args) -> int:
    client = cliclient.client(args)
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


def _hours(value) -> str:
    """GPU-hours busy, or n/a where nothing was sampled (declared devices, no NVML)."""
    return "n/a" if value is None else f"{value:.2f}"


def cmd_usage(args) -> int:
    data = cliclient.client(args).usage(start=args.start, end=args.end, by=args.by, user=args.user)
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    currency = data.get("currency") or ""
    print(f"GPU usage {data['from'][:16]} .. {data['to'][:16]}, by {data['by']}")
    cost = f"cost {currency}".strip()
    print(f"{data['by']:<16} {'GPU-hours':>10} {'busy':>8} {cost:>12} {'jobs':>6} {'servers':>8} {'measured util':>14}")
    for row in data["rows"]:
        util = f"{row['measured_utilization']:.0f}%" if row["measured_utilization"] is not None else "n/a"
        print(
            f"{row[data['by']]:<16} {row['gpu_hours']:>10.2f} {_hours(row.get('gpu_hours_busy')):>8} "
            f"{row['cost']:>12.2f} {row['jobs']:>6} {row['servers']:>8} {util:>14}"
        )
    total = data["total"]
    print(f"{'total':<16} {total['gpu_hours']:>10.2f} {_hours(total.get('gpu_hours_busy')):>8} {total['cost']:>12.2f}")
    for server in data.get("idle_gpu_servers", []):
        print(
            f"idle: server {server['server']} holds {server['gpus']} GPU(s), no activity for "
            f"{server['idle_minutes']:.0f} min"
        )
    return 0


def cmd_profiles(args) -> int:
    data = cliclient.client(args).profiles()
    for p in data["profiles"]:
        mark = "*" if p["slug"] == data.get("default") else " "
        print(f"{mark} {p['slug']:<20} {p['display_name']}  GPUs {p['resources']['gpus']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="danlu", description="Danlu research workbench.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = sub  # danlu.hub.cli adds the hub-side commands here
    jobs_cli.add_parser(sub)
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
        add_client_args(p)
    datasets_cli.add_parser(sub)
    models_cli.add_parser(sub)
    pr = sub.add_parser("profiles", help="profiles you may use")
    add_client_args(pr)
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
