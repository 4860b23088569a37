"""Job pods fenced and hardened (danlu.hub.k8s.policies, the runtime's pod, the namespace's Pod Security).

The NetworkPolicies are tested by evaluating them: :func:`allowed` is the NetworkPolicy semantics of
``networking.k8s.io/v1`` in a few lines (a connection passes when the source's egress and the
destination's ingress both allow it; a pod no policy selects for a direction is open in it; rules
of all the policies that select it add up), run on the rendered policies for a job pod talking to
the cloud metadata address, the API server, another job, a notebook, DNS, the hub, MLflow and its
own peers. With helm (``helm`` on PATH or beside the interpreter) the chart's own policies join in,
and the Pod Security level the namespace enforces is checked against every pod the chart renders
and the notebook pods ``DanluKubeSpawner`` builds after the chart's own hub configuration.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

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


# --- the namespace enforces what the chart's pods pass ---------------------------------------


def helm() -> str | None:
    found = shutil.which("helm") or next(
        (str(p) for p in (ROOT / ".venv" / "bin" / "helm", Path(sys.executable).parent / "helm") if p.exists()), None
    )
    return found


needs_helm = pytest.mark.skipif(helm() is None or not CHART.exists(), reason="helm or the z2jh chart is not here")


@pytest.fixture(scope="module")
def chart(tmp_path_factory):
    """The chart rendered by helm with the rendered values; the values the hub pod reads; Danlu's config."""
    folder = tmp_path_factory.mktemp("render")
    settings, profiles = example()
    files = render.render(settings, profiles)
    render.write(files, folder)
    out = subprocess.run(
        [helm(), "template", "danlu", str(CHART), "-n", NS, "-f", str(folder / "values.yaml")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    objects = [o for o in yaml.safe_load_all(out) if o]
    (secret,) = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "hub"]
    secrets = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    values = yaml.safe_load(secrets["values.yaml"])
    (hub_names,) = [o["data"] for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "hub"]
    config_map = render.objects(settings, profiles)["mlflow.yaml"][0]
    (folder / "profiles.yaml").write_text(config_map["data"]["profiles.yaml"])
    danlu_yaml = yaml.safe_load(config_map["data"]["danlu.yaml"])
    danlu_yaml.pop("profiles_file")  # /etc/danlu/profiles.yaml on the cluster: beside danlu.yaml here
    (folder / "danlu.yaml").write_text(yaml.safe_dump(danlu_yaml))
    return SimpleNamespace(objects=objects, values=values, secrets=secrets, names=hub_names, folder=folder)


def notebook_pods(chart, monkeypatch, tmp_path) -> list[dict]:
    """User pods as the hub builds them: the chart's jupyterhub_config.py (its hub.extraConfig runs Danlu's
    configure(c)), then DanluKubeSpawner for each profile."""
    import kubernetes_asyncio.client  # deferred: only the chart tier needs the client
    from jupyterhub.objects import Hub  # deferred: as above
    from kubernetes_asyncio.config import kube_config  # deferred: as above
    from tornado.httpclient import AsyncHTTPClient  # deferred: as above
    from traitlets.config import Config  # deferred: as above

    from danlu.hub.k8s.spawner import DanluKubeSpawner  # deferred: imports kubespawner

    kubeconfig = tmp_path / "kubeconfig"
    cluster = {"name": "none", "cluster": {"server": "https://127.0.0.1:9"}}
    context = {"name": "none", "context": {"cluster": "none", "user": "none"}}
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "none",
                "clusters": [cluster],
                "users": [{"name": "none", "user": {"token": "unused"}}],
                "contexts": [context],
            }
        )
    )
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("DANLU_CONFIG", str(chart.folder / "danlu.yaml"))
    monkeypatch.setenv("POD_NAMESPACE", NS)
    for service in (o for o in chart.objects if o["kind"] == "Service"):  # what the kubelet sets in the hub pod
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        monkeypatch.setenv(f"{prefix}_SERVICE_HOST", "10.96.0.10")
        monkeypatch.setenv(f"{prefix}_SERVICE_PORT", str(service["spec"]["ports"][0]["port"]))
    monkeypatch.setattr(AsyncHTTPClient, "configure", classmethod(lambda cls, *a, **k: None))  # no pycurl here
    monkeypatch.syspath_prepend(str(CHART / "files" / "hub"))
    import z2jh  # deferred: the chart's own module, importable once its folder is on the path

    monkeypatch.setattr(z2jh, "_load_config", lambda: chart.values)  # the hub Secret's values.yaml
    monkeypatch.setattr(z2jh, "_get_config_value", chart.names.__getitem__)  # the hub ConfigMap's names
    monkeypatch.setattr(z2jh, "get_secret_value", lambda key, default=None: chart.secrets.get(key, default))
    c = Config()
    source = (CHART / "files" / "hub" / "jupyterhub_config.py").read_text()
    exec(compile(source, "jupyterhub_config.py", "exec"), {"get_config": lambda: c, "__file__": "x"})
    if c.KubeSpawner.get("profile_list") == []:  # the chart's empty list beats Danlu's (issue 16, fault 1)
        del c.KubeSpawner["profile_list"]

    async def build(profile):
        user = SimpleNamespace(name="ana", escaped_name="ana", id=1, admin=False, url="/user/ana/", server=None)
        user.groups = []
        s = DanluKubeSpawner(config=c, _mock=True, user=user, hub=Hub())
        s.user_options = {"profile": profile}
        await s._run_apply_user_options(s.user_options)
        await s.load_user_options()
        async with kubernetes_asyncio.client.ApiClient() as api:
            return api.sanitize_for_serialization(await s.get_pod_manifest())

    profiles = [p.slug for p in c.DanluKubeSpawner.profiles if p.environment.get("image")]
    assert profiles
    return {p: asyncio.run(build(p)) for p in profiles}


@needs_helm
def test_the_namespace_enforces_the_strictest_level_every_pod_in_it_passes(chart, monkeypatch, tmp_path):
    """Every pod the chart renders, the notebook pods of every profile, and Danlu's own (MLflow, PostgreSQL,
    jobs) pass the enforced level; ``restricted`` is the level only warned about because a pod fails it."""
    settings, profiles = example()
    ours = [o for objs in render.objects(settings, profiles).values() for o in objs]
    pods = [(n, s, a) for n, s, a in pod_specs(chart.objects)]
    notebooks = notebook_pods(chart, monkeypatch, tmp_path)
    for pod in notebooks.values():  # the labels the policy tests give a notebook are a real one's
        assert NOTEBOOK["labels"].items() <= pod["metadata"]["labels"].items()
    pods += [(f"notebook/{slug}", p["spec"], p["metadata"].get("annotations")) for slug, p in notebooks.items()]
    pods += [(n, s, a) for n, s, a in pod_specs(ours)]
    pods += [(p["metadata"]["name"], p["spec"], None) for p in job_pods(nnodes=2)]
    enforced = policies.POD_SECURITY["enforce"]
    assert {name: violations(spec, enforced, ann) for name, spec, ann in pods} == {n: [] for n, _, _ in pods}
    stricter = {"baseline": "restricted", "restricted": None}[enforced]
    if stricter:
        assert any(violations(spec, stricter, ann) for _, spec, ann in pods), f"every pod passes {stricter}"
    assert policies.POD_SECURITY["warn"] == policies.POD_SECURITY["audit"] == "restricted"


@needs_helm
def test_with_the_charts_policies_the_runner_api_and_mlflow_let_job_pods_in(chart):
    """The other end: the hub's (chart-rendered) ingress admits job pods on the runner API only."""
    netpols = [o for o in chart.objects if o["kind"] == "NetworkPolicy"] + danlu_policies()
    for p in netpols:
        p["metadata"].setdefault("namespace", NS)
    a = job_pod("danlu-j1-1")
    assert allowed(netpols, a, HUB, names.JOBS_SERVICE_PORT)
    assert allowed(netpols, a, MLFLOW, names.MLFLOW_PORT)
    assert not allowed(netpols, a, HUB, 8081)
    assert not allowed(netpols, a, PROXY, 8000)
    assert not allowed(netpols, a, {"ip": METADATA_IP}, 80)
    assert not allowed(netpols, NOTEBOOK, a, 29400)  # the chart's notebook egress meets the job fence
    # notebooks: the chart's policy, not its privileged iptables init container, keeps the metadata address out
    assert not allowed(netpols, NOTEBOOK, {"ip": METADATA_IP}, 80)
    assert allowed(netpols, NOTEBOOK, {"ip": "8.8.8.8"}, 443)
