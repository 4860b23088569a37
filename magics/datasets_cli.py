"""``danlu datasets``: register a file or folder as a dataset version, list the catalog, show datasets and versions.

Each command is one call of the jobs service's catalog API (through
:func:`danlu.cliclient.client`); it prints a table for people, or with
``--json`` exactly what the API answered. :func:`add_parser` hangs the
commands under ``danlu datasets`` (called by :func:`danlu.cli.build_parser`).
"""

from __future__ import annotations

import json

from danlu import cliclient
from danlu.cliclient import add_client_args
from danlu.errors import UsageError


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
        print(
            f"{'':>12}  {u['job_id']:<12} {u['owner'][:12]:<12} {u['state']:<10} {u['context']:<10} "
            f"{u.get('mlflow_run_id') or '-'}"
        )


def cmd_register(args) -> int:
    body = {"name": args.name, "path": args.path}
    if args.description is not None:
        body["description"] = args.description
    if args.read_group:
        body["read_groups"] = args.read_group
    if args.register_group:
        body["register_groups"] = args.register_group
    created, version = cliclient.client(args).register_dataset(body)
    if args.json:
        print(json.dumps(version, indent=1))
        return 0
    what = "registered" if created else "unchanged: already registered as"
    print(
        f"{what} {version['ref']}  {version['files']} files, {_size(version['bytes'])}, digest {version['digest'][:16]}"
    )
    return 0


def cmd_list(args) -> int:
    datasets = cliclient.client(args).datasets()
    if args.json:
        print(json.dumps(datasets, indent=1))
        return 0
    if not datasets:
        print("no datasets")
        return 0
    print(f"{'name':<24} {'latest':>6} {'files':>8} {'size':>10} {'digest':<16}  description")
    for ds in datasets:
        v = ds.get("latest") or {}
        print(
            f"{ds['name']:<24} {v.get('version', '-'):>6} {v.get('files', '-'):>8} "
            f"{_size(v['bytes']) if v else '-':>10} {v.get('digest', '-')[:16]:<16}  {ds['description'][:40]}"
        )
    return 0


def cmd_show(args) -> int:
    client = cliclient.client(args)
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
        print(
            f"{v['version']:>7} {v['files']:>8} {_size(v['bytes']):>10} {v['digest'][:16]:<16}  "
            f"{v['created_at'][:19]:<19} {v['created_by'][:12]:<12} {v['source']}"
        )
    return 0


def add_parser(sub) -> None:
    """``danlu datasets ...`` under the ``danlu`` command's subparsers."""
    ds = sub.add_parser("datasets", help="the dataset catalog: register, list, show versions")
    dsub = ds.add_subparsers(dest="action", metavar="ACTION")
    rg = dsub.add_parser("register", help="register a file or folder as a version of a dataset")
    rg.add_argument("name", help="the dataset's name (lowercase letters, digits, - _ .)")
    rg.add_argument("path", help="PATH relative to your home, or ROOT:PATH under a dataset root")
    rg.add_argument("--description")
    rg.add_argument(
        "--read-group",
        action="append",
        default=[],
        metavar="GROUP",
        help="who may read it (first registration; default everyone)",
    )
    rg.add_argument(
        "--register-group",
        action="append",
        default=[],
        metavar="GROUP",
        help="who may add versions (first registration; default everyone)",
    )
    rg.set_defaults(func=cmd_register)
    dl = dsub.add_parser("list", help="the datasets you may read")
    dl.set_defaults(func=cmd_list)
    dw = dsub.add_parser(
        "show", help="a dataset and its versions, or one version and the jobs that used it (NAME@VERSION)"
    )
    dw.add_argument("ref", metavar="NAME[@VERSION]")
    dw.set_defaults(func=cmd_show)
    for p in (rg, dl, dw):
        p.add_argument("--json", action="store_true")
        add_client_args(p)
