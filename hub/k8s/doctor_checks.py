"""The nine checks of ``danlu doctor k8s`` as pure functions: the facts the API returned in, problems out.

Each ``check_*`` takes the facts :mod:`danlu.hub.k8s.doctor_io` gathered for it and the
:class:`~danlu.hub.k8s.doctor.Expected` deployment, and returns ``(detail, problems)``: what it saw when
all is well, and each :class:`Problem` with its fix. Nothing here talks to a cluster, so each rule
(label selectors, taints and tolerations, ready endpoints, ReadWriteMany provisioners) is tested on
plain dicts; :mod:`danlu.hub.k8s.doctor` runs them in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from danlu.hub.k8s import kueueconfig, names, readme

if TYPE_CHECKING:
    from danlu.hub.k8s.doctor import Expected

KUEUE_NAMESPACE = "kueue-system"
KUEUE_CONFIG_MAP = "kueue-manager-config"
KUEUE_CONFIG_KEY = kueueconfig.CONFIG_KEY
KUEUE_FRAMEWORKS = kueueconfig.FRAMEWORKS
#: Kueue's default managedJobsNamespaceSelector (the Configuration leaves it out)
KUEUE_DEFAULT_SELECTOR = {
    "matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", KUEUE_NAMESPACE]}
    ]
}
KUEUE_CRDS = ("clusterqueues", "localqueues", "resourceflavors", "workloads", "workloadpriorityclasses")
VISIBILITY_APISERVICE = "v1beta1.visibility.kueue.x-k8s.io"
TRAINER_DEPLOYMENT = "kubeflow-trainer-controller-manager"
JOBSET_DEPLOYMENT = "jobset-controller-manager"
#: (group, resource) a webhook of each controller validates
WEBHOOKS = {"Trainer": ("trainer.kubeflow.org", "trainjobs"), "JobSet": ("jobset.x-k8s.io", "jobsets")}
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
#: provisioners known to give ReadWriteMany volumes / known to give ReadWriteOnce only (by suffix)
RWX_PROVISIONERS = (
    "nfs.csi.k8s.io",
    "nfs-subdir-external-provisioner",
    "cephfs.csi.ceph.com",
    "file.csi.azure.com",
    "kubernetes.io/azure-file",
    "filestore.csi.storage.gke.io",
    "efs.csi.aws.com",
    "fsx.csi.aws.com",
    "driver.longhorn.io",
    "pxd.portworx.com",
    "spectrumscale.csi.ibm.com",
)
RWO_PROVISIONERS = (
    "rancher.io/local-path",
    "kubernetes.io/no-provisioner",
    "ebs.csi.aws.com",
    "kubernetes.io/aws-ebs",
    "pd.csi.storage.gke.io",
    "kubernetes.io/gce-pd",
    "disk.csi.azure.com",
    "kubernetes.io/azure-disk",
    "rbd.csi.ceph.com",
    "hostpath.csi.k8s.io",
    "openebs.io/local",
)


@dataclass
class Problem:
    problem: str
    fix: str


# --- helpers over API objects ---------------------------------------------------------------


def condition(obj: Mapping | None, kind: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return {}


def is_true(obj: Mapping | None, kind: str) -> bool:
    return condition(obj, kind).get("status") == "True"


def why_not(obj: Mapping | None, kind: str) -> str:
    c = condition(obj, kind)
    if not c:
        return f"no {kind} condition yet"
    return f"{kind}={c.get('status')}: {c.get('reason', '')} {c.get('message', '')}".strip()


def selects(selector: Mapping | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; an empty selector selects all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        if (
            (op == "In" and labels.get(key) not in vals)
            or (op == "NotIn" and key in labels and labels[key] in vals)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def tolerates(tolerations: Iterable[Mapping], taint: Mapping) -> bool:
    """Whether a toleration lets a pod onto a node with ``taint`` (the scheduler's rule)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if not t.get("key") and t.get("operator") == "Exists":
            return True
        if t.get("key") != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def endpoints_ready(slices: Iterable[Mapping]) -> int:
    """Ready endpoints in a Service's EndpointSlices (an unset ``ready`` counts as ready)."""
    return sum(
        1 for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready") is not False
    )


# --- the checks (pure) ----------------------------------------------------------------------
# Each takes the facts doctor_io gathered and the Expected, and returns (detail, problems).


def check_api(facts: dict, exp: Expected):
    if facts.get("error"):
        return "", [Problem(facts["error"], facts["fix"])]
    detail = f"{facts['server']} answers (Kubernetes {facts['version']})"
    if facts.get("namespace") is None:
        return detail, [
            Problem(f"namespace {exp.namespace} does not exist", "kubectl apply -f namespace.yaml (danlu render k8s)")
        ]
    return f"{detail}; namespace {exp.namespace} exists", []


def check_rbac(facts: dict, exp: Expected):
    user = f"system:serviceaccount:{exp.namespace}:{exp.service_account}"
    problems = []
    if not facts["service_account"]:
        problems.append(
            Problem(
                f"ServiceAccount {exp.namespace}/{exp.service_account} does not exist",
                "install the chart (helm upgrade --install ... -f values.yaml): it creates the hub's account; "
                "if hub.serviceAccount.name renames it, bind that name in rbac.yaml",
            )
        )
    denied = [
        f"{verb} {resource}{'.' + group if group else ''}" for (verb, group, resource), ok in facts["answers"] if not ok
    ]
    if denied:
        problems.append(
            Problem(
                f"{user} may not: {', '.join(denied)}",
                f"kubectl apply -f rbac.yaml (Role danlu-jobs and its RoleBinding to {exp.service_account}); "
                f"then kubectl auth can-i --as={user} -n {exp.namespace} <verb> <resource> says yes",
            )
        )
    return f"{user} may do all {len(facts['answers'])} things the jobs service does", problems


def check_kueue(facts: dict, exp: Expected):
    install = readme.KUEUE_VERSION
    missing = [c for c in KUEUE_CRDS if c not in facts["crds"]]
    if missing:
        return "", [
            Problem(
                f"Kueue is not installed (no CRD {', '.join(f'{c}.kueue.x-k8s.io' for c in missing)})",
                f"kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/releases/download/{install}"
                "/manifests.yaml",
            )
        ]
    problems = []
    old = [c for c, versions in facts["crds"].items() if "v1beta2" not in versions]
    if old:
        problems.append(Problem(f"Kueue's CRDs do not serve v1beta2 ({', '.join(old)})", f"upgrade Kueue to {install}"))
    config = facts["config"]
    apply_config = (
        "merge kueue-config.yaml into it with python -m danlu.hub.k8s.kueueconfig (the rendered README's step 2: "
        f"it keeps other teams' settings), then kubectl -n {KUEUE_NAMESPACE} rollout restart "
        "deployment/kueue-controller-manager"
    )
    if config is None:
        problems.append(
            Problem(f"no ConfigMap {KUEUE_NAMESPACE}/{KUEUE_CONFIG_MAP} ({KUEUE_CONFIG_KEY})", apply_config)
        )
    else:
        frameworks = (config.get("integrations") or {}).get("frameworks") or []
        off = [f for f in KUEUE_FRAMEWORKS if f not in frameworks]
        if off:
            problems.append(Problem(f"Kueue's integrations.frameworks lacks {', '.join(off)}", apply_config))
        selector = config.get("managedJobsNamespaceSelector", KUEUE_DEFAULT_SELECTOR)
        if not selects(selector, facts["namespace_labels"]):
            problems.append(
                Problem(f"Kueue's managedJobsNamespaceSelector does not select namespace {exp.namespace}", apply_config)
            )
        if exp.pods_ready_timeout and not config.get("waitForPodsReady"):
            problems.append(
                Problem(
                    "Kueue's waitForPodsReady is off: a job whose pods never start (an image that cannot be "
                    "pulled, a missing claim) holds its team's quota until its deadline",
                    apply_config,
                )
            )
        if config.get("manageJobsWithoutQueueName"):
            problems.append(
                Problem(
                    "manageJobsWithoutQueueName is true: Kueue would hold the hub, proxy and MLflow pods too",
                    apply_config,
                )
            )
    for obj in exp.kueue_objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        live = facts["objects"].get((kind, name))
        if live is None:
            problems.append(Problem(f"{kind} {name} does not exist", "kubectl apply -f kueue.yaml (danlu render k8s)"))
        elif kind in ("ClusterQueue", "LocalQueue") and not is_true(live, "Active"):
            problems.append(
                Problem(
                    f"{kind} {name} is not active ({why_not(live, 'Active')})",
                    f"kubectl describe {kind.lower()} {name}; apply kueue.yaml again (its flavors and ClusterQueue)",
                )
            )
    return f"installed; frameworks and namespace selector right; {len(exp.kueue_objects)} objects present", problems


def check_visibility(facts: dict, exp: Expected):
    problems = []
    service = facts["apiservice"]
    fix = (
        f"kubectl get apiservice {VISIBILITY_APISERVICE} -o yaml shows why; Kueue's controller serves it "
        "(without it jobs show no queue position)"
    )
    if service is None:
        problems.append(
            Problem(f"APIService {VISIBILITY_APISERVICE} does not exist", f"install Kueue {readme.KUEUE_VERSION}")
        )
    elif not is_true(service, "Available"):
        problems.append(
            Problem(f"APIService {VISIBILITY_APISERVICE} is not Available ({why_not(service, 'Available')})", fix)
        )
    if facts["pending"] is not True:
        problems.append(Problem(f"the pendingworkloads call failed: {facts['pending']}", fix))
    return f"served; localqueues/{facts['queue']}/pendingworkloads answers", problems


def check_trainer(facts: dict, exp: Expected):
    problems = []
    install = (
        f'kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/manager'
        f'?ref={readme.TRAINER_VERSION}" (it brings JobSet)'
    )
    for name, found in facts["deployments"].items():
        if not found:
            problems.append(Problem(f"no Deployment {name} in any namespace", install))
        for d in found:
            where = f"{d['metadata']['namespace']}/{name}"
            if not is_true(d, "Available"):
                problems.append(
                    Problem(
                        f"Deployment {where} is not Available ({why_not(d, 'Available')})",
                        f"kubectl -n {d['metadata']['namespace']} describe deployment {name}",
                    )
                )
    for controller, hooks in facts["webhooks"].items():
        group, resource = WEBHOOKS[controller]
        if not hooks:
            problems.append(Problem(f"no ValidatingWebhookConfiguration validates {resource}.{group}", install))
        for hook, service, ready in hooks:
            if service and not ready:
                problems.append(
                    Problem(
                        f"{controller}'s webhook {hook} has no ready endpoint behind Service {service}",
                        f"wait for the controller's pods (kubectl get endpointslices -l kubernetes.io/service-name="
                        f"{service.split('/')[-1]} -n {service.split('/')[0]}); until then every TrainJob is refused",
                    )
                )
    if not facts["runtime"]:
        problems.append(
            Problem(
                f"ClusterTrainingRuntime {exp.runtime} does not exist",
                "kubectl apply -f trainer.yaml (danlu render k8s)",
            )
        )
    return f"controllers Available, webhooks served, ClusterTrainingRuntime {exp.runtime} present", problems


def rwx_capable(provisioner: str) -> bool | None:
    """True/False for provisioners known to give (or not) ReadWriteMany volumes; None when unknown."""
    if any(provisioner.endswith(p) for p in RWX_PROVISIONERS):
        return True
    if any(provisioner.endswith(p) for p in RWO_PROVISIONERS):
        return False
    return None


def check_storage(facts: dict, exp: Expected):
    classes = {c["metadata"]["name"]: c for c in facts["classes"]}
    fix = "create a ReadWriteMany StorageClass (NFS, CephFS, a cloud file store) and set kubernetes.home_storage_class"
    if exp.home_storage_class:
        name, how = exp.home_storage_class, "kubernetes.home_storage_class"
        if name not in classes:
            return "", [Problem(f"StorageClass {name} ({how}) does not exist", fix)]
    else:
        defaults = [
            n for n, c in classes.items() if (c["metadata"].get("annotations") or {}).get(DEFAULT_CLASS) == "true"
        ]
        if not defaults:
            return "", [
                Problem("kubernetes.home_storage_class is not set and the cluster has no default StorageClass", fix)
            ]
        name, how = defaults[0], "the cluster's default"
    provisioner = classes[name].get("provisioner", "")
    capable = rwx_capable(provisioner)
    detail = f"homes on StorageClass {name} ({how}, provisioner {provisioner})"
    if capable is False:
        return detail, [
            Problem(f"{provisioner} gives ReadWriteOnce volumes only: jobs on other nodes cannot mount homes", fix)
        ]
    if capable is None:
        bound = [
            c["metadata"]["name"]
            for c in facts["claims"]
            if (c.get("spec") or {}).get("storageClassName") == name
            and "ReadWriteMany" in ((c.get("status") or {}).get("accessModes") or [])
            and (c.get("status") or {}).get("phase") == "Bound"
        ]
        if not bound:
            return detail, [
                Problem(
                    f"cannot tell whether {provisioner} gives ReadWriteMany volumes (a provisioner the doctor "
                    "does not know)",
                    "start one notebook server (its home claim asks ReadWriteMany) and run the doctor again: a Bound "
                    "claim proves it; or use a class from a known file-system provisioner",
                )
            ]
        detail += f"; a Bound ReadWriteMany claim proves it ({bound[0]})"
    return detail, []


def check_gpu_nodes(facts: dict, exp: Expected):
    if not exp.flavors:
        return "no GPU flavors in danlu.yaml", []
    problems, seen = [], []
    nodes = [n for n in facts["nodes"] if not (n.get("spec") or {}).get("unschedulable") and is_true(n, "Ready")]
    render_fix = "edit gpus.declared in danlu.yaml, danlu render k8s, kubectl apply -f kueue.yaml"
    for flavor, spec in exp.flavors.items():
        labels = spec.get("node_labels") or {}
        resource = spec.get("resource", "nvidia.com/gpu")
        if not labels and len(exp.flavors) > 1:
            problems.append(Problem(f"flavor {flavor} has no node_labels: Kueue cannot steer its jobs", render_fix))
        matching = [n for n in nodes if selects({"matchLabels": labels}, n["metadata"].get("labels") or {})]
        with_gpus = [n for n in matching if _quantity((n.get("status") or {}).get("allocatable", {}).get(resource)) > 0]
        label_text = ",".join(f"{k}={v}" for k, v in labels.items()) or "(any node)"
        if not with_gpus:
            problems.append(
                Problem(
                    f"flavor {flavor}: no Ready node with labels {label_text} and {resource} allocatable",
                    f"label the GPU nodes (kubectl label node NODE {label_text}) and check the NVIDIA device plugin; "
                    f"or {render_fix}",
                )
            )
            continue
        total = sum(_quantity(n["status"]["allocatable"][resource]) for n in with_gpus)
        if spec.get("count") and total < spec["count"]:
            problems.append(
                Problem(
                    f"flavor {flavor}: danlu.yaml declares {spec['count']} GPUs, the nodes have {total:g} allocatable "
                    "(Kueue would admit jobs that never schedule)",
                    f"lower gpus.declared count for {flavor} or add nodes; then {render_fix}",
                )
            )
        tolerations = spec.get("tolerations") or []
        for node in with_gpus:
            for taint in (node.get("spec") or {}).get("taints") or []:
                if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
                    text = (
                        f"{taint.get('key')}{'=' + taint['value'] if taint.get('value') else ''}:{taint.get('effect')}"
                    )
                    problems.append(
                        Problem(
                            f"node {node['metadata']['name']} (flavor {flavor}) has taint {text} that the flavor's "
                            "tolerations do not tolerate",
                            f"add it to gpus.declared[flavor {flavor}].tolerations; then {render_fix}",
                        )
                    )
        seen.append(f"{flavor}: {len(with_gpus)} node(s), {total:g} GPUs")
    return "; ".join(seen), problems


def _quantity(value) -> float:
    try:
        return float(str(value or 0).rstrip("k"))
    except ValueError:
        return 0.0


def check_mlflow(facts: dict, exp: Expected):
    service = f"{exp.namespace}/{names.MLFLOW_SERVICE}"
    host = urlsplit(exp.mlflow_url).netloc
    if not facts["service"]:
        return "", [Problem(f"Service {service} does not exist", "kubectl apply -f mlflow.yaml (danlu render k8s)")]
    if not facts["ready"]:
        return "", [
            Problem(
                f"Service {service} has no ready endpoint",
                f"kubectl -n {exp.namespace} logs deployment/{names.MLFLOW_SERVICE} "
                "(the danlu-secrets Secret, PostgreSQL)",
            )
        ]
    status, body = facts["health"]
    if status == 200:
        return f"{exp.mlflow_url}/health answers with Host {host}", []
    if status == 403 and "host" in body.lower():
        fix = f"MLflow's --allowed-hosts must include {host} (render with this danlu and kubectl apply -f mlflow.yaml)"
    else:
        fix = f"kubectl -n {exp.namespace} logs deployment/{names.MLFLOW_SERVICE}"
    return "", [Problem(f"GET {exp.mlflow_url}/health with Host {host} answered {status}: {body[:200]}", fix)]


def parse_probe_log(text: str) -> dict[str, tuple[bool, str]]:
    """The probe's lines ``probe NAME ADDRESS reached|failed DETAIL`` as NAME -> (reached, detail)."""
    out = {}
    for line in text.splitlines():
        parts = line.split(" ", 4)
        if len(parts) >= 4 and parts[0] == "probe" and parts[3] in ("reached", "failed"):
            out[parts[1]] = (parts[3] == "reached", " ".join(parts[2:]))
    return out


def check_probe(facts: dict, exp: Expected):
    if facts.get("error"):
        return "", [Problem(facts["error"], facts["fix"])]
    seen = parse_probe_log(facts["log"])
    problems = []
    policy_fix = (
        "apply the job pods' NetworkPolicy (danlu render k8s) on a CNI that enforces NetworkPolicies "
        "(Calico, Cilium, GKE Dataplane V2); kubectl -n {ns} get networkpolicy"
    ).format(ns=exp.namespace)
    for target in facts["targets"]:
        reached, detail = seen.get(target.name, (None, "no answer in the probe's log"))
        if reached is None:
            problems.append(Problem(f"the probe did not report {target.name}: {facts['log'][-200:]!r}", policy_fix))
        elif target.blocked and reached:
            problems.append(Problem(f"a job pod reaches {target.name} ({detail})", policy_fix))
        elif not target.blocked and not reached:
            problems.append(
                Problem(
                    f"a job pod cannot reach {target.name} ({detail})",
                    "the job pods' NetworkPolicy must allow it, and the service must run (kubectl get endpointslices)",
                )
            )
    blocked = ", ".join(t.name for t in facts["targets"] if t.blocked)
    allowed = ", ".join(t.name for t in facts["targets"] if not t.blocked)
    return f"a job pod reaches {allowed} and not {blocked} (probe pod {facts['pod']}, deleted)", problems
