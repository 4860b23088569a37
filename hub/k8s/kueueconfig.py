"""What Danlu needs in Kueue's manager Configuration, and how it is merged into the one a cluster runs.

Kueue has one Configuration per cluster (``kueue-system/kueue-manager-config``), shared with every other
team that queues work there; replacing it would switch off their integrations and namespace rules. So
``danlu render k8s`` writes only what Danlu needs (:func:`requirements`, the file ``kueue-config.yaml``):

* the integrations ``trainer.kubeflow.org/trainjob`` (jobs) and ``pod`` (GPU notebooks);
* ``waitForPodsReady``: an admitted workload whose pods are not all ready within the timeout (an image
  that cannot be pulled, a claim that does not exist, nodes that never fit) is evicted and gives back its
  quota, instead of holding the team's GPUs until its deadline. The jobs backend then ends the attempt
  and names the cause. ``blockAdmission: false``: one stuck job never stops the admission of others.

:func:`merge` adds them to the running configuration and keeps everything else (``python -m
danlu.hub.k8s.kueueconfig CURRENT REQUIRED``; docs/kubernetes.md has the commands). It refuses, with the
fix, what would change other teams' work or leave Danlu's namespace unmanaged: a namespace selector that
excludes Danlu's namespace, or adding the ``pod`` integration while ``manageJobsWithoutQueueName`` is on
(every pod in every managed namespace would then wait for Kueue). A ``waitForPodsReady`` already there is
kept as it is, since it applies to every team.
"""

from __future__ import annotations

import copy
import json
import sys

import yaml

from danlu.errors import ConfigError

API_VERSION = "config.kueue.x-k8s.io/v1beta2"
FRAMEWORKS = ("trainer.kubeflow.org/trainjob", "pod")
NAME_LABEL = "kubernetes.io/metadata.name"
CONFIG_KEY = "controller_manager_config.yaml"  # the key of kueue-manager-config that Kueue reads


def requirements(pods_ready_timeout: int) -> dict:
    """The part of Kueue v0.19's Configuration that Danlu needs (``kueue-config.yaml``)."""
    out: dict = {"apiVersion": API_VERSION, "kind": "Configuration", "integrations": {"frameworks": list(FRAMEWORKS)}}
    if pods_ready_timeout:
        out["waitForPodsReady"] = {
            "timeout": f"{int(pods_ready_timeout)}s",
            "blockAdmission": False,
            "requeuingStrategy": {"timestamp": "Eviction", "backoffBaseSeconds": 60, "backoffMaxSeconds": 3600},
        }
    return out


def selects(selector: dict | None, namespace: str, kueue_namespace: str = "kueue-system") -> bool:
    """Whether ``managedJobsNamespaceSelector`` selects ``namespace`` (by its name label; Kueue's default,
    when there is none, is every namespace but kube-system and Kueue's own)."""
    if selector is None:
        return namespace not in ("kube-system", kueue_namespace)
    labels = {NAME_LABEL: namespace}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for term in selector.get("matchExpressions") or []:
        key, op, values = term.get("key"), term.get("operator"), term.get("values") or []
        present = key in labels
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and present and labels[key] in values)
            or (op == "Exists" and not present)
            or (op == "DoesNotExist" and present)
        ):
            return False
    return True


def merge(current: dict, required: dict, namespace: str) -> tuple[dict, list[str]]:
    """``current`` with what ``required`` adds; the notes say what was kept as it was."""
    if current.get("apiVersion") != API_VERSION or current.get("kind") != "Configuration":
        raise ConfigError(
            f"the running Kueue configuration is {current.get('apiVersion')}/{current.get('kind')}, not "
            f"{API_VERSION}/Configuration: install Kueue v0.19 (its release manifests ship that) and try again"
        )
    out = copy.deepcopy(current)
    notes = []
    kueue_ns = out.get("namespace") or "kueue-system"
    if not selects(out.get("managedJobsNamespaceSelector"), namespace, kueue_ns):
        raise ConfigError(
            f"Kueue's managedJobsNamespaceSelector does not select the namespace {namespace!r}, so Kueue would "
            f"not queue Danlu's jobs: add {namespace!r} to it (label {NAME_LABEL}) and try again"
        )
    integrations = out.setdefault("integrations", {})
    frameworks = list(integrations.get("frameworks") or [])
    added = [f for f in required["integrations"]["frameworks"] if f not in frameworks]
    if "pod" in added and out.get("manageJobsWithoutQueueName"):
        raise ConfigError(
            "Kueue's manageJobsWithoutQueueName is true, so enabling its pod integration would make every pod "
            "of every managed namespace wait for Kueue: limit managedJobsNamespaceSelector to the namespaces "
            f"that want that (and {namespace!r}), or set manageJobsWithoutQueueName: false, and try again"
        )
    integrations["frameworks"] = frameworks + added
    if "waitForPodsReady" in required:
        if "waitForPodsReady" in out:
            notes.append(
                f"kept the cluster's waitForPodsReady {out['waitForPodsReady']} (it applies to every team); "
                f"Danlu asks for {required['waitForPodsReady']['timeout']}"
            )
        else:
            out["waitForPodsReady"] = copy.deepcopy(required["waitForPodsReady"])
    return out, notes


def main(argv: list[str] | None = None) -> int:
    """``python -m danlu.hub.k8s.kueueconfig CURRENT REQUIRED --namespace NS [--patch]``: the merged
    configuration on stdout (with ``--patch``: as a merge patch of the ``kueue-manager-config`` ConfigMap,
    for ``kubectl patch --type merge --patch-file``, which keeps the ConfigMap's labels), notes on stderr;
    exit code 2 with one line when it refuses."""
    args = list(sys.argv[1:] if argv is None else argv)
    as_patch = "--patch" in args
    args = [a for a in args if a != "--patch"]
    namespace = "danlu"
    if "--namespace" in args:
        i = args.index("--namespace")
        namespace = args[i + 1] if i + 1 < len(args) else ""
        del args[i : i + 2]
    if len(args) != 2 or not namespace:
        print(
            "usage: python -m danlu.hub.k8s.kueueconfig CURRENT.yaml kueue-config.yaml --namespace NS", file=sys.stderr
        )
        return 2
    try:
        docs: list[dict] = []
        for path in args:
            with open(path, encoding="utf-8") as f:
                docs.append(next((d for d in yaml.safe_load_all(f) if d), {}))
        merged, notes = merge(docs[0], docs[1], namespace)
    except (OSError, yaml.YAMLError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    text = yaml.safe_dump(merged, sort_keys=False, default_flow_style=False)
    sys.stdout.write(json.dumps({"data": {CONFIG_KEY: text}}) + "\n" if as_patch else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
