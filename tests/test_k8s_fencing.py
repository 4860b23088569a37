"""Job pods fenced and hardened (danlu.hub.k8s.policies, the runtime's pod, the namespace's Pod Security).

The NetworkPolicies are tested by evaluating them: :func:`allowed` is the NetworkPolicy semantics of
``networking.k8s.io/v1`` in a few lines (a connection passes when the source's egress and the
destination's ingress both allow it; a pod no policy selects for a direction is open in it; rules
of all the policies that select it add up), run on the rendered policies for a job pod talking to
the cloud metadata address, the API server, another job, a notebook, DNS, the hub, MLflow and its
own peers. The chart tier (tests/chart/test_pod_security.py) adds the chart's own policies and checks
the Pod Security level the namespace enforces against every pod the chart renders and the notebook
pods ``DanluKubeSpawner`` builds after the chart's own hub configuration.
"""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path
from types import SimpleNamespace

import pytest

from danlu import env
from danlu.hub.backends.base import Launch
from danlu.hub.backends.kubernetes import KubernetesBackend
from danlu.hub.config import load_settings
from danlu.hub.k8s import jobs, manifests, names, policies, render
from danlu.hub.profiles import load_profiles
from tests.k8sfake.trainer import build_pods
from tests.k8sschemas import errors
from tests.podsecurity import level, pod_specs, violations

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "tests" / "charts" / "jupyterhub-4.4.0"
NS = "danlu"
IMAGE = "registry.example.org/danlu/pytorch@sha256:" + "a" * 64
METADATA_IP, API_SERVER_IP = "169.254.169.254", "10.96.0.1"


def example():
    """The two-flavors example's settings and profiles (GPU flavors, teams, its namespace ``danlu``)."""
    settings = load_settings(ROOT / "examples" / "config" / "two-flavors.yaml", environ={env.BASE_DIR: str(ROOT)})
    return settings, load_profiles(settings.profiles_file)


# --- the evaluator --------------------------------------------------------------------------


def _selects(selector: dict | None, labels: dict) -> bool:
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _ns_labels(namespace: str) -> dict:
    return {"kubernetes.io/metadata.name": namespace}


def _peer_matches(peer: dict, policy_ns: str, dest) -> bool:
    if "ipBlock" in peer:
        if "ip" not in dest:
            return False  # a pod is matched by its selectors here; pod IPs are not modelled
        ip = ipaddress.ip_address(dest["ip"])
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or []
        )
    if "ip" in dest:
        return False  # a selector matches pods, never an address outside the pod network
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], _ns_labels(dest["namespace"])):
            return False
    elif dest["namespace"] != policy_ns:
        return False
    return _selects(peer.get("podSelector"), dest["labels"])


def _port_matches(rule_ports, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    return any(p.get("protocol", "TCP") == protocol and ("port" not in p or p["port"] == port) for p in rule_ports)


def _types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def _direction_allows(netpols, pod, other, port, protocol, direction: str) -> bool:
    key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    selecting = [
        p
        for p in netpols
        if p["metadata"]["namespace"] == pod["namespace"]
        and direction in _types(p)
        and _selects(p["spec"].get("podSelector"), pod["labels"])
    ]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(x, p["metadata"]["namespace"], other) for x in peers)) and (
                _port_matches(rule.get("ports"), port, protocol)
            ):
                return True
    return False


def allowed(netpols: list[dict], src: dict, dst: dict, port: int, protocol: str = "TCP") -> bool:
    """Whether pod ``src`` may open ``port`` on ``dst`` (a pod, or ``{"ip": ...}`` outside the pod network)."""
    if not _direction_allows(netpols, src, dst, port, protocol, "Egress"):
        return False
    return "ip" in dst or _direction_allows(netpols, dst, src, port, protocol, "Ingress")


# --- the pods ------------------------------------------------------------------------------


def job_pod(trainjob: str, namespace: str = NS) -> dict:
    """A job pod's labels as JobSet creates it from the runtime and the TrainJob's patch."""
    labels = {**manifests.JOB_POD, **jobs.labels("j1", 1, "ana", "vision"), policies.JOBSET_NAME: trainjob}
    return {"namespace": namespace, "labels": labels}


RELEASE = {"release": "danlu"}  # the chart's pods (and KubeSpawner's, by the chart's common_labels) carry it
NOTEBOOK = {"namespace": NS, "labels": {**manifests.NOTEBOOK_POD, **manifests.labels(names.NOTEBOOK), **RELEASE}}
HUB = {"namespace": NS, "labels": {**manifests.HUB_POD, **RELEASE}}
PROXY = {"namespace": NS, "labels": {**manifests.PROXY_POD, **RELEASE}}
MLFLOW = {"namespace": NS, "labels": dict(manifests.MLFLOW_POD)}
POSTGRES = {"namespace": NS, "labels": dict(manifests.POSTGRES_POD)}
DNS = {"namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
OTHER_NS_POD = {"namespace": "other-team", "labels": dict(manifests.JOB_POD)}


def danlu_policies(nnodes: int = 2) -> list[dict]:
    files = render.objects(*example())
    out = [o for objs in files.values() for o in objs if o["kind"] == "NetworkPolicy"]
    if nnodes > 1:
        out.append(policies.make_peer_policy("danlu-j1-1", NS, jobs.labels("j1", 1, "ana", "vision"), "uid-1"))
    return out


def test_a_job_pod_reaches_only_dns_the_runner_api_mlflow_and_its_peers():
    netpols = danlu_policies()
    a, peer, other = job_pod("danlu-j1-1"), job_pod("danlu-j1-1"), job_pod("danlu-j2-1")

    assert not allowed(netpols, a, {"ip": METADATA_IP}, 80)
    assert not allowed(netpols, a, {"ip": API_SERVER_IP}, 443)
    assert not allowed(netpols, a, {"ip": "8.8.8.8"}, 443)
    assert not allowed(netpols, a, other, 29400)
    assert not allowed(netpols, other, a, 29400)  # nor does the other job reach this one
    assert not allowed(netpols, a, NOTEBOOK, 8888)
    assert not allowed(netpols, NOTEBOOK, a, 29400)
    assert not allowed(netpols, a, POSTGRES, names.POSTGRES_PORT)
    assert not allowed(netpols, a, HUB, 8081)  # the hub's API: not the runner's business
    assert not allowed(netpols, a, HUB, names.GATEWAY_SERVICE_PORT)
    assert not allowed(netpols, a, PROXY, 8000)
    assert not allowed(netpols, a, {**DNS, "namespace": NS}, 53, "UDP")  # kube-dns's label, but not kube-system

    assert allowed(netpols, a, DNS, 53, "UDP") and allowed(netpols, a, DNS, 53, "TCP")
    assert allowed(netpols, a, HUB, names.JOBS_SERVICE_PORT)
    assert allowed(netpols, a, MLFLOW, names.MLFLOW_PORT)  # MLflow's own ingress policy lets job pods in
    assert allowed(netpols, a, peer, 29400) and allowed(netpols, peer, a, 41234)  # rendezvous and NCCL


def test_a_one_node_job_has_no_peers_and_other_namespaces_are_untouched():
    netpols = danlu_policies(nnodes=1)
    a = job_pod("danlu-j1-1")
    assert not allowed(netpols, a, job_pod("danlu-j1-1"), 29400)
    assert allowed(netpols, a, HUB, names.JOBS_SERVICE_PORT)
    # the fence is namespaced: it selects nothing in another team's namespace
    assert allowed(netpols, OTHER_NS_POD, {"ip": METADATA_IP}, 80)


def test_the_policies_and_the_namespace_are_valid_and_rendered():
    peers = policies.make_peer_policy("danlu-j1-1", NS, jobs.labels("j1", 1, "ana", "vision"), "uid-1")
    files = render.objects(*example())
    namespace, fence = files["namespace.yaml"]
    for obj in (namespace, fence, peers):
        assert errors(obj) == []
    assert namespace["metadata"]["labels"] == {
        names.MANAGED_BY: names.MANAGER,
        "pod-security.kubernetes.io/enforce": "baseline",
        "pod-security.kubernetes.io/warn": "restricted",
        "pod-security.kubernetes.io/audit": "restricted",
    }
    assert fence["metadata"]["name"] == policies.JOB_FENCE
    assert peers["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # deleted with its TrainJob
    rbac = {
        (g, r): rule["verbs"]
        for rule in files["rbac.yaml"][0]["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert "create" in rbac[("networking.k8s.io", "networkpolicies")]


# --- the job pod's hardening -------------------------------------------------------------


def job_pods(**kw) -> list[dict]:
    """The pods JobSet creates for a TrainJob on the rendered runtime (the fake Trainer's merge)."""
    runtime = manifests.make_training_runtime(IMAGE, "1Gi")
    tj = jobs.trainjob(
        job_id="j1",
        attempt=1,
        owner="ana",
        queue="vision",
        priority_class="",
        namespace=NS,
        image=IMAGE,
        nproc=2,
        api_url="http://hub:10101/services/danlu/api/v1",
        **kw,
    )
    tj["metadata"]["uid"] = "uid-1"
    return build_pods(tj, runtime, {}, [], 29400)


@pytest.mark.parametrize(
    "kw",
    [{}, {"gpus": 4, "cpu": 8, "memory": 2**34, "home_claim": "claim-ana", "nnodes": 2, "tolerations": [{"key": "g"}]}],
)
def test_a_job_pod_passes_the_restricted_pod_security_standard(kw):
    for pod in job_pods(**kw):
        assert errors(pod) == []
        assert violations(pod["spec"], "restricted") == []
        assert pod["spec"]["automountServiceAccountToken"] is False
        (container,) = pod["spec"]["containers"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert {k: pod["spec"]["securityContext"][k] for k in ("runAsNonRoot", "seccompProfile")} == {
            "runAsNonRoot": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }


def test_the_checker_refuses_what_the_standard_refuses():
    """The checker itself: each control fails the pod it should."""
    good = job_pods()[0]["spec"]
    assert level(good) == "restricted"
    container = dict(good["containers"][0])
    cases = {
        "baseline": [
            {"securityContext": {**container["securityContext"], "allowPrivilegeEscalation": True}},
            {"securityContext": {"allowPrivilegeEscalation": False}},  # capabilities kept
        ],
        "privileged": [
            {"securityContext": {**container["securityContext"], "privileged": True}},
            {"securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}},
        ],
    }
    for expected, changes in cases.items():
        for change in changes:
            assert level({**good, "containers": [{**container, **change}]}) == expected, change
    assert level({**good, "hostNetwork": True}) == "privileged"
    assert level({**good, "securityContext": {}}) == "baseline"  # no runAsNonRoot, no seccomp
    assert level({**good, "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}) == "privileged"
    assert level({**good, "volumes": [{"name": "n", "nfs": {"server": "s", "path": "/"}}]}) == "baseline"


def test_danlus_own_pods_pass_restricted():
    files = render.objects(*example())
    for name, spec, ann in pod_specs(files["mlflow.yaml"]):
        assert violations(spec, "restricted", ann) == [], name


# --- the backend creates the peers' policy with the TrainJob -------------------------------


def started(nnodes: int) -> list[tuple]:
    calls = []

    async def call(self, what, method, *args, **kwargs):
        calls.append((method, args))
        if method.endswith("create_namespaced_custom_object"):
            return {**args[-1], "metadata": {**args[-1]["metadata"], "uid": "uid-1"}}
        return {}

    backend = KubernetesBackend(namespace=NS, home_claim="")
    backend.profiles = SimpleNamespace(get=lambda slug: SimpleNamespace(environment={"image": IMAGE}))
    launch = Launch(
        job_id="j1", attempt=1, owner="ana", kernel_name="python3", nproc=1, nnodes=nnodes, queue="vision", token="t"
    )

    async def run():
        async def record(state):
            pass

        return await backend.start(launch, record)

    original = KubernetesBackend._call
    KubernetesBackend._call = call
    try:
        asyncio.run(run())
    finally:
        KubernetesBackend._call = original
    return calls


def test_a_multi_node_attempt_gets_its_peers_policy_owned_by_its_trainjob():
    calls = started(nnodes=2)
    created = [args for method, args in calls if method == "NetworkingV1Api.create_namespaced_network_policy"]
    assert len(created) == 1
    namespace, policy = created[0]
    assert namespace == NS
    assert policy == policies.make_peer_policy("danlu-j1-1", NS, jobs.labels("j1", 1, "ana", "vision"), "uid-1")
    assert errors(policy) == []
    assert not any(m.endswith("network_policy") for m, _ in started(nnodes=1))
