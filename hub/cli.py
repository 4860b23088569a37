"""The ``danlu`` script: the users' client commands plus the ones that run beside the hub.

``danlu up`` starts the workbench (:mod:`danlu.hub.app`), ``danlu config``
lists every option of danlu.yaml with its help and current value, ``danlu kueue
render`` writes danlu.yaml's teams as Kueue objects and ``danlu render k8s``
writes the whole cluster deployment (:mod:`danlu.hub.k8s.render`) and ``danlu doctor k8s`` checks a
live cluster against it (:mod:`danlu.hub.k8s.doctor`); every other command is
the client side's (:mod:`danlu.cli`), so a kernel that imports ``danlu``
never imports the hub.
"""

from __future__ import annotations

import argparse
import json
import sys

from danlu import cli
from danlu.lean import skip_unused_imports


def cmd_config(args) -> int:
    # deferred: the danlu script loads only what its command needs (danlu jobs list stays quick)
    from danlu.hub.config import describe, format_options, load_settings

    settings = load_settings(args.config)
    rows = describe(settings)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_options(rows, settings.source), end="")
    return 0


def cmd_kueue(args) -> int:
    # deferred: the danlu script loads only what its command needs (danlu jobs list stays quick)
    from danlu.hub import gpus, kueue
    from danlu.hub.config import load_settings  # deferred: as above

    settings = load_settings(args.config)
    print(kueue.to_yaml(kueue.render(settings, gpus.inventory(settings.gpus), namespace=args.namespace)), end="")
    return 0


def cmd_render(args) -> int:
    from danlu.hub.config import load_settings  # deferred: as above
    from danlu.hub.k8s import render  # deferred: as above
    from danlu.hub.profiles import builtin_profiles, load_profiles  # deferred: as above

    settings = load_settings(args.config)
    profiles = load_profiles(settings.profiles_file) if settings.profiles_file.exists() else builtin_profiles()
    for path in render.write(render.render(settings, profiles), args.out):
        print(path)
    return 0


def cmd_doctor(args) -> int:
    from danlu.hub.config import load_settings  # deferred: as above
    from danlu.hub.k8s import doctor, doctor_io  # deferred: as above
    from danlu.hub.profiles import builtin_profiles, load_profiles  # deferred: as above

    settings = load_settings(args.config)
    profiles = load_profiles(settings.profiles_file) if settings.profiles_file.exists() else builtin_profiles()
    exp = doctor.expected(settings, profiles)
    results = doctor_io.diagnose(exp, kubeconfig=args.kubeconfig, context=args.context, probe=not args.no_probe)
    print(doctor.as_json(results) if args.json else doctor.text(results), end="\n" if args.json else "")
    return doctor.exit_status(results)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = parser.commands
    sub.add_parser("up", help="start the workbench (JupyterHub, jobs service, MLflow)", add_help=False)
    cf = sub.add_parser(
        "config",
        help="every option of danlu.yaml: its help, default and current value",
        description="Every option of danlu.yaml, section by section: its type, default, current "
        "value and where that came from (the file, an environment variable, the "
        "default), and its help. Secrets show as (set) or (not set).",
    )
    cf.add_argument("--config", help="a danlu.yaml (default $DANLU_CONFIG)")
    cf.add_argument("--json", action="store_true", help="one JSON object per option instead of text")
    cf.set_defaults(func=cmd_config)
    kq = sub.add_parser("kueue", help="render danlu.yaml's teams as Kueue objects (YAML)")
    kq.add_argument("what", choices=["render"])
    kq.add_argument("--config", help="a danlu.yaml (default $DANLU_CONFIG)")
    kq.add_argument("--namespace", default="danlu")
    kq.set_defaults(func=cmd_kueue)
    rd = sub.add_parser("render", help="render danlu.yaml as a Kubernetes deployment (chart values, manifests)")
    rd.add_argument("what", choices=["k8s"])
    rd.add_argument("--config", help="a danlu.yaml (default $DANLU_CONFIG)")
    rd.add_argument("--out", required=True, help="the folder to write the files into (created if missing)")
    rd.set_defaults(func=cmd_render)
    dr = sub.add_parser(
        "doctor",
        help="check a live cluster against danlu.yaml's deployment, each failure with its fix",
        description="Checks, in order: the API server, the jobs service's RBAC, Kueue and its configuration, "
        "Kueue's visibility API, Trainer and JobSet, a ReadWriteMany class for homes, GPU nodes, MLflow, and "
        "the network policies (a probe pod). Exit status 1 when a check failed. docs/kubernetes.md, "
        "'First hour on a real cluster'.",
    )
    dr.add_argument("what", choices=["k8s"])
    dr.add_argument("--config", help="a danlu.yaml (default $DANLU_CONFIG)")
    dr.add_argument("--kubeconfig", help="a kubeconfig (default $KUBECONFIG, ~/.kube/config; in a pod its account)")
    dr.add_argument("--context", help="the kubeconfig context (default its current one)")
    dr.add_argument(
        "--no-probe",
        action="store_true",
        help="skip check 9, which creates a pod danlu-doctor-probe-* in the namespace (job pods' labels, "
        "restricted, deleted at the end) that tries the metadata address, the API server, MLflow and the hub",
    )
    dr.add_argument("--json", action="store_true", help="the results as one JSON object")
    dr.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    skip_unused_imports()
    if argv[:1] == ["up"]:
        from danlu.hub.app import main as up  # deferred: danlu up's whole workbench, loaded only for danlu up

        return up(argv[1:])
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
