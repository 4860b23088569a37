"""The fence around job pods: the NetworkPolicies that bound what user code in a job reaches, and the
Pod Security labels of Danlu's namespace.

A job runs its user's code; nothing in it should reach what the user could not reach from the
notebook. Job pods (the ``danlu-torch`` runtime's labels :data:`~danlu.hub.k8s.manifests.JOB_POD`)
are selected by two kinds of NetworkPolicy, which add up (a connection passes if any policy that
selects the pod allows it):

* ``danlu-jobs`` (:func:`make_job_fence`, rendered into ``namespace.yaml``) selects every job pod for
  ingress and egress and allows egress only to DNS (``kube-dns`` in ``kube-system``, UDP and TCP 53),
  the jobs service's runner API in the hub pod (port 10101) and MLflow (its pods, port 5000), and no
  ingress at all. So the cloud metadata address, the API server, the internet, notebook pods and
  every other job are out of reach, and nothing reaches a job pod.
* ``<trainjob>-peers`` (:func:`make_peer_policy`) lets the pods of one multi-node attempt reach each
  other on every port (torchrun's rendezvous and the collectives pick their ports). A policy's
  selectors are fixed label values, and no selector says "the same job as me", so "same job" needs
  one policy per job: the jobs backend creates it with the TrainJob, owned by the TrainJob so the
  garbage collector deletes it with it. It selects ``jobset.sigs.k8s.io/jobset-name``, which JobSet
  puts on every pod it creates for the TrainJob (the JobSet is named as the TrainJob), so it does
  not depend on the runtime patch reaching the pod template. A one-node attempt gets none: torchrun
  ``--standalone`` meets on the pod's loopback, which no NetworkPolicy filters.

A cluster whose network plugin does not enforce NetworkPolicies (docs/kubernetes.md, Fencing) keeps
none of this; ``danlu doctor k8s`` probes it. Pod Security is enforced by the API server instead:
:data:`POD_SECURITY` is the strictest level every pod in the namespace passes (checked against the
chart's rendered pods, the spawner's notebook pods and Danlu's own in ``tests/test_k8s_fencing.py``),
with ``restricted`` warned and audited so the gap stays visible.
"""

from __future__ import annotations

from danlu.hub.k8s import manifests, names

NETWORKING_API = "networking.k8s.io/v1"
#: the label JobSet sets on each pod of a JobSet (a TrainJob's JobSet has the TrainJob's name)
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
#: the cluster DNS: CoreDNS/kube-dns keeps kube-dns's label on kubeadm, GKE, EKS, AKS and k3s
DNS_NAMESPACE = "kube-system"
DNS_POD = {"k8s-app": "kube-dns"}
JOB_FENCE = "danlu-jobs"
#: notebook pods of the chart pass ``baseline`` (KubeSpawner sets no seccomp profile and drops no
#: capabilities), every other pod ``restricted``; the namespace enforces what all of them pass
POD_SECURITY = {"enforce": "baseline", "warn": "restricted", "audit": "restricted"}


def pod_security_labels() -> dict:
    return {f"pod-security.kubernetes.io/{mode}": level for mode, level in POD_SECURITY.items()}


def make_namespace(namespace: str) -> dict:
    """Danlu's namespace, labelled for Pod Security admission."""
    ns = manifests.make_namespace(namespace)
    ns["metadata"]["labels"].update(pod_security_labels())
    return ns


def _pods(labels: dict) -> dict:
    return {"podSelector": {"matchLabels": dict(labels)}}


def make_job_fence(namespace: str) -> dict:
    """``danlu-jobs``: job pods reach DNS, the runner API and MLflow; nothing reaches them (see the module)."""
    dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": DNS_NAMESPACE}},
        "podSelector": {"matchLabels": dict(DNS_POD)},
    }
    return {
        "apiVersion": NETWORKING_API,
        "kind": "NetworkPolicy",
        "metadata": manifests.metadata(JOB_FENCE, namespace, names.JOB),
        "spec": {
            "podSelector": {"matchLabels": dict(manifests.JOB_POD)},
            "policyTypes": ["Ingress", "Egress"],
            "egress": [
                {"to": [dns], "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                {"to": [_pods(manifests.HUB_POD)], "ports": [{"protocol": "TCP", "port": names.JOBS_SERVICE_PORT}]},
                {"to": [_pods(manifests.MLFLOW_POD)], "ports": [{"protocol": "TCP", "port": names.MLFLOW_PORT}]},
            ],
        },
    }


def namespace_objects(namespace: str) -> list[dict]:
    """``namespace.yaml``: the namespace and the fence of its job pods, applied before anything runs there."""
    return [make_namespace(namespace), make_job_fence(namespace)]


def peer_policy_name(trainjob: str) -> str:
    return f"{trainjob}-peers"


def make_peer_policy(trainjob: str, namespace: str, labels: dict, owner_uid: str | None = None) -> dict:
    """``<trainjob>-peers``: the pods of one TrainJob reach each other, on any port (see the module)."""
    peers = _pods({JOBSET_NAME: trainjob})
    meta: dict = {"name": peer_policy_name(trainjob), "namespace": namespace, "labels": dict(labels)}
    if owner_uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": "trainer.kubeflow.org/v1alpha1",
                "kind": "TrainJob",
                "name": trainjob,
                "uid": owner_uid,
                "controller": False,
                "blockOwnerDeletion": False,
            }
        ]
    return {
        "apiVersion": NETWORKING_API,
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": {JOBSET_NAME: trainjob}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [peers]}],
            "egress": [{"to": [peers]}],
        },
    }
