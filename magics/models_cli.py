"""``danlu models`` and ``danlu lineage``: register a run's model, list and show versions, approve or reject,
move aliases, and show what made a version.

Each command is one call of the jobs service's models API (through :func:`danlu.cliclient.client`); it
prints a table for people, or with ``--json`` exactly what the API answered. :func:`add_parser`
hangs the commands under ``danlu models`` and ``danlu lineage`` (called by :func:`danlu.cli.build_parser`).
"""

from __future__ import annotations

import json

from danlu import cliclient
from danlu.cliclient import add_client_args
from danlu.errors import UsageError


def _print_json(data) -> int:
    print(json.dumps(data, indent=1))
    return 0


def _gate(v: dict) -> str:
    evaluation = v["evaluation"]
    job = f" (job {evaluation['job_id']})" if evaluation.get("job_id") else ""
    return f"{evaluation['state']}{job}"


def _version_row(v: dict) -> str:
    return (
        f"{v['version']:>7} {v['approval']:<9} {v['evaluation']['state']:<12} {v['registered_by'][:12]:<12} "
        f"{v['registered_at'][:19]:<19} {','.join(v['aliases']) or '-':<16} {v['source']}"
    )


VERSION_HEADER = (
    f"{'version':>7} {'approval':<9} {'evaluation':<12} {'by':<12} {'registered':<19} {'aliases':<16} source"
)


def _show_version(v: dict) -> None:
    for key in ("name", "version", "approval", "source", "run_id", "job_id", "registered_by", "registered_at"):
        print(f"{key:>14}: {v[key] if v[key] is not None else '-'}")
    print(f"{'files':>14}: {v.get('digest') or 'not copied (registered before Danlu copied models)'}")
    print(f"{'aliases':>14}: {', '.join(v['aliases']) or '-'}")
    print(f"{'evaluation':>14}: {_gate(v)}")
    evaluation = v["evaluation"]
    for name, rule in sorted(evaluation["thresholds"].items()):
        value = evaluation["metrics"].get(name, "not logged")
        print(f"{'':>14}  {name} = {value}  (needs {rule})")
    for failure in evaluation["failures"]:
        print(f"{'':>14}  ! {failure}")
    for d in v["decisions"]:
        print(
            f"{'decision':>14}: {d['decision']} by {d['actor']} at {d['at'][:19]} (audit #{d['audit_seq']}"
            f"{', files ' + d['digest'][:19] if d.get('digest') else ''}): {d['comment']}"
        )


def cmd_register(args) -> int:
    body = {"run_id": args.run, "name": args.name}
    if args.artifact_path is not None:
        body["artifact_path"] = args.artifact_path
    if args.description is not None:
        body["description"] = args.description
    v = cliclient.client(args).register_model(body)
    if args.json:
        return _print_json(v)
    print(
        f"registered {v['name']} version {v['version']} from {v['source']}; approval {v['approval']}, "
        f"evaluation {_gate(v)}"
    )
    return 0


def cmd_list(args) -> int:
    models = cliclient.client(args).models()
    if args.json:
        return _print_json(models)
    if not models:
        print("no models")
        return 0
    print(f"{'name':<28} {'latest':>6} {'approval':<9} {'evaluation':<12} {'aliases':<24} description")
    for m in models:
        v = m.get("latest") or {}
        aliases = ", ".join(f"{a}={n}" for a, n in sorted(m["aliases"].items())) or "-"
        print(
            f"{m['name'][:28]:<28} {v.get('version', '-'):>6} {v.get('approval', '-'):<9} "
            f"{v['evaluation']['state'] if v else '-':<12} {aliases[:24]:<24} {m['description'][:40]}"
        )
    return 0


def cmd_show(args) -> int:
    client = cliclient.client(args)
    data = client.model_version(args.name, args.version) if args.version else client.model(args.name)
    if args.json:
        return _print_json(data)
    if args.version:
        _show_version(data)
        return 0
    for key in ("name", "description", "created_by", "created_at"):
        print(f"{key:>11}: {data[key]}")
    print(f"{'aliases':>11}: {', '.join(f'{a} -> {n}' for a, n in sorted(data['aliases'].items())) or '-'}")
    print(VERSION_HEADER)
    for v in data.get("versions") or []:
        print(_version_row(v))
    return 0


def cmd_decide(args) -> int:
    if not args.comment.strip():
        raise UsageError("--comment must say something: it goes into the audit log")
    v = cliclient.client(args).decide_model(args.name, args.version, args.decision, args.comment)
    if args.json:
        return _print_json(v)
    print(f"{v['name']} version {v['version']}: {v['approval']}")
    return 0


def cmd_alias(args) -> int:
    client = cliclient.client(args)
    if args.delete:
        if args.version is not None:
            raise UsageError("--delete takes no VERSION: danlu models alias NAME ALIAS --delete")
        change = client.delete_model_alias(args.name, args.alias)
    else:
        if args.version is None:
            raise UsageError("give the VERSION the alias should name, or --delete")
        change = client.set_model_alias(args.name, args.alias, args.version)
    if args.json:
        return _print_json(change)
    before = f" (was {change['previous']})" if change.get("previous") else ""
    now = f"-> version {change['version']}" if change["version"] is not None else "removed"
    print(f"{change['name']}@{change['alias']} {now}{before}")
    return 0


LINEAGE_ORDER = (
    "model_version",
    "approval",
    "evaluation",
    "run",
    "job",
    "notebook",
    "cell",
    "dataset_version",
    "environment",
)


def cmd_lineage(args) -> int:
    name, sep, number = args.ref.partition("@")
    version = args.version if args.version is not None else (number if sep else None)
    if not version or not str(version).isdigit():
        raise UsageError(f"{args.ref!r}: name a model version, e.g. 'danlu lineage {name} 1' or {name}@1")
    data = cliclient.client(args).lineage(name, int(version))
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


def add_parser(sub) -> None:
    """``danlu models ...`` and ``danlu lineage`` under the ``danlu`` command's subparsers."""
    models = sub.add_parser("models", help="registered models: register, list, show, approve, reject, alias")
    msub = models.add_subparsers(dest="action", metavar="ACTION")
    rg = msub.add_parser("register", help="register a model version from an MLflow run of yours")
    rg.add_argument("run", metavar="RUN", help="the MLflow run id (a job's mlflow_run_id)")
    rg.add_argument("name", metavar="NAME", help="the registered model's name")
    rg.add_argument(
        "--artifact-path", help="the logged model's name, or the artifact folder (default: its only logged model)"
    )
    rg.add_argument("--description")
    rg.set_defaults(func=cmd_register)
    ls = msub.add_parser("list", help="the registered models, their aliases and latest versions")
    ls.set_defaults(func=cmd_list)
    sh = msub.add_parser("show", help="a model and its versions, or one version")
    sh.add_argument("name", metavar="NAME")
    sh.add_argument("version", metavar="VERSION", type=int, nargs="?")
    sh.set_defaults(func=cmd_show)
    parsers = [rg, ls, sh]
    for decision, verb in (("approve", "approve"), ("reject", "reject")):
        p = msub.add_parser(verb, help=f"approvers: {verb} a pending version (audited)")
        p.add_argument("name", metavar="NAME")
        p.add_argument("version", metavar="VERSION", type=int)
        p.add_argument("--comment", required=True, help="why (recorded in the audit log)")
        p.set_defaults(func=cmd_decide, decision=decision)
        parsers.append(p)
    al = msub.add_parser("alias", help="approvers: point ALIAS at an approved VERSION, or --delete it")
    al.add_argument("name", metavar="NAME")
    al.add_argument("alias", metavar="ALIAS")
    al.add_argument("version", metavar="VERSION", type=int, nargs="?")
    al.add_argument("--delete", action="store_true", help="remove the alias")
    al.set_defaults(func=cmd_alias)
    parsers.append(al)
    for p in parsers:
        p.add_argument("--json", action="store_true")
        add_client_args(p)
    li = sub.add_parser(
        "lineage",
        help="what made a model version: run, job, notebook and cell, datasets, environment, evaluation, approvals",
    )
    li.add_argument("ref", metavar="NAME", help="the model (or NAME@VERSION)")
    li.add_argument("version", nargs="?", help="the version number")
    li.add_argument("--json", action="store_true", help="the API's answer: {model, nodes, edges}")
    li.set_defaults(func=cmd_lineage)
    add_client_args(li)
