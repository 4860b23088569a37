"""``danlu doctor k8s`` against the fake cluster (tests/k8sfake, real HTTP): a good set-up passes every check,
and each check, broken once, fails naming its fix.

The good set-up is what ``danlu render k8s`` writes for the danlu.yaml below (Kueue objects, the Kueue
configuration, the runtime, the RBAC), seeded into the fake's store as ``kubectl apply`` would leave it,
plus what the controllers and the cloud would have made: CRDs, an Available APIService and Deployments,
webhook configurations with ready EndpointSlices, an NFS StorageClass, a tainted GPU node, and an MLflow
stand-in on loopback that checks the Host header as MLflow's ``--allowed-hosts`` does. The probe pod runs
for real in the fake's kubelet; its targets are loopback ports (closed ones for the addresses that must be
blocked, a listening one for those that must answer), since the fake has no network to fence.
"""

from __future__ import annotations

import ast
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from danlu.hub.cli import main as danlu
from danlu.hub.config import load_settings
from danlu.hub.k8s import doctor, doctor_checks, doctor_io, jobs, kueueconfig, render
from danlu.hub.profiles import builtin_profiles

from .k8sfake import FakeCluster

NS = "danlu"
GPU_LABELS = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
CONFIG = {
    "gpus": {
        "declared": [
            {
                "count": 2,
                "flavor": "a100",
                "node_labels": GPU_LABELS,
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            }
        ]
    },
    "groups": {"vision": ["alice"]},
    "teams": {"vision": {"quota": {"gpus": {"a100": 2}}}},
    "kubernetes": {"hub_image": "registry.example/danlu/hub@sha256:" + "1" * 64, "trial": True},
}
#: Kueue's Configuration as its release manifests install it (the part the doctor reads)
KUEUE_AS_INSTALLED = {
    "apiVersion": kueueconfig.API_VERSION,
    "kind": "Configuration",
    "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset"]},
}


def obj(api_version, kind, name, namespace=None, **rest) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api_version, "kind": kind, "metadata": meta, **rest}


def available(kind="Available", status="True", reason="MinimumReplicasAvailable") -> dict:
    return {"conditions": [{"type": kind, "status": status, "reason": reason, "message": ""}]}


def endpoint_slice(namespace, service, ready=True) -> dict:
    out = obj("discovery.k8s.io/v1", "EndpointSlice", f"{service}-abcde", namespace)
    out["metadata"]["labels"] = {"kubernetes.io/service-name": service}
    out.update(addressType="IPv4", endpoints=[{"addresses": ["10.0.0.9"], "conditions": {"ready": ready}}])
    return out


def webhook_configuration(name, group, resource, namespace, service) -> dict:
    hook = {
        "name": f"validate.{resource}.{group}",
        "clientConfig": {"service": {"namespace": namespace, "name": service}},
        "rules": [{"apiGroups": [group], "apiVersions": ["*"], "operations": ["CREATE"], "resources": [resource]}],
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
    }
    return obj("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", name, webhooks=[hook])


class MlflowStandIn(BaseHTTPRequestHandler):
    """MLflow's health endpoint behind its Host check (``--allowed-hosts``)."""

    allowed: set[str] = set()

    def do_GET(self):
        if self.headers.get("Host") not in self.server.allowed:
            code, body = 403, b"Invalid Host header - possible DNS rebinding attack detected"
        elif self.path == "/services/mlflow/health":
            code, body = 200, b"OK"
        else:
            code, body = 404, b"not found"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow():
    server = ThreadingHTTPServer(("127.0.0.1", 0), MlflowStandIn)
    server.allowed = {f"danlu-mlflow.{NS}.svc:5000"}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def setup(tmp_path, mlflow):
    """A fake cluster with the good set-up, its kubeconfig and the Expected deployment."""
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    settings = load_settings(path, environ={})
    exp = doctor.expected(settings, builtin_profiles())
    port = mlflow.server_address[1]
    exp.probe_targets = [
        doctor.ProbeTarget("metadata", f"127.0.0.1:{closed_port()}", True),
        doctor.ProbeTarget("apiserver", f"127.0.0.1:{closed_port()}", True),
        doctor.ProbeTarget("mlflow", f"127.0.0.1:{port}", False),
        doctor.ProbeTarget("jobs", f"127.0.0.1:{port}", False),
    ]
    cluster = FakeCluster(namespaces=("default", NS, "kueue-system", "kubeflow-system")).start()
    cluster.services[(NS, "danlu-mlflow")] = f"http://127.0.0.1:{port}"
    store = cluster.store
    objects = render.objects(settings, builtin_profiles())
    for name in ("kueue.yaml", "trainer.yaml", "rbac.yaml"):
        for o in objects[name]:
            store.create(o)
    merged, _notes = kueueconfig.merge(KUEUE_AS_INSTALLED, objects["kueue-config.yaml"][0], NS)  # the README's step 2
    store.create(kueue_config_map(merged))
    store.create(obj("v1", "ServiceAccount", "hub", NS))
    for plural in doctor_checks.KUEUE_CRDS:
        versions = [{"name": "v1beta1", "served": True}, {"name": "v1beta2", "served": True, "storage": True}]
        store.create(
            obj(
                "apiextensions.k8s.io/v1",
                "CustomResourceDefinition",
                f"{plural}.kueue.x-k8s.io",
                spec={"versions": versions},
            )
        )
    store.create(
        obj("apiregistration.k8s.io/v1", "APIService", doctor_checks.VISIBILITY_APISERVICE, status=available())
    )
    for deployment in (doctor_checks.TRAINER_DEPLOYMENT, doctor_checks.JOBSET_DEPLOYMENT):
        store.create(obj("apps/v1", "Deployment", deployment, "kubeflow-system", status=available()))
    for name, (group, resource), service in (
        ("validator.trainer.kubeflow.org", doctor_checks.WEBHOOKS["Trainer"], "kubeflow-trainer-controller-manager"),
        ("jobset-validating-webhook-configuration", doctor_checks.WEBHOOKS["JobSet"], "jobset-webhook-service"),
    ):
        store.create(webhook_configuration(name, group, resource, "kubeflow-system", service))
        store.create(endpoint_slice("kubeflow-system", service))
    nfs = obj("storage.k8s.io/v1", "StorageClass", "nfs", provisioner="k8s-sigs.io/nfs-subdir-external-provisioner")
    nfs["metadata"]["annotations"] = {doctor_checks.DEFAULT_CLASS: "true"}
    store.create(nfs)
    node = obj("v1", "Node", "gpu-1", spec={"taints": [GPU_TAINT]})
    node["metadata"]["labels"] = dict(GPU_LABELS)
    node["status"] = {"allocatable": {"nvidia.com/gpu": "2", "cpu": "64"}, **available("Ready", reason="KubeletReady")}
    store.create(node)
    store.create(obj("v1", "Service", "danlu-mlflow", NS, spec={"ports": [{"name": "tcp", "port": 5000}]}))
    store.create(endpoint_slice(NS, "danlu-mlflow"))
    settle(cluster)
    kubeconfig = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    yield cluster, kubeconfig, exp, path
    cluster.stop()
    assert cluster.errors == []


def settle(cluster) -> None:
    """Wait until the fake's API server and Kueue have labelled the namespace and set the queues' state."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ns = cluster.get("Namespace", None, NS)
        queues = cluster.objects("ClusterQueue") + cluster.objects("LocalQueue")
        if "kubernetes.io/metadata.name" in ns["metadata"].get("labels", {}) and all(
            doctor_checks.condition(q, "Active") for q in queues
        ):
            return
        time.sleep(0.05)
    raise AssertionError("the fake never labelled the namespace or activated the queues")


def diagnose(setup, **kwargs):
    _cluster, kubeconfig, exp, _path = setup
    results = doctor_io.diagnose(exp, kubeconfig=kubeconfig, **kwargs)
    return {r.number: r for r in results}


def test_a_good_setup_passes_every_check(setup):
    results = diagnose(setup)
    assert {n: r.status for n, r in results.items()} == dict.fromkeys(range(1, 10), "ok"), doctor.text(
        list(results.values())
    )
    assert "a100: 1 node(s), 2 GPUs" in results[7].detail
    assert setup[0].objects("Pod", NS) == []  # the probe pod is gone


def break_api(cluster, exp):
    cluster.stop()


def break_rbac(cluster, exp):
    cluster.store.remove("RoleBinding", NS, "danlu-jobs")


def kueue_config_map(config: dict) -> dict:
    data = {doctor_checks.KUEUE_CONFIG_KEY: yaml.safe_dump(config)}
    return obj("v1", "ConfigMap", doctor_checks.KUEUE_CONFIG_MAP, "kueue-system", data=data)


def break_kueue_config(cluster, exp):
    config = kueue_config_map(KUEUE_AS_INSTALLED)  # as installed: Danlu's needs never merged
    cluster.store.mutate("ConfigMap", "kueue-system", "kueue-manager-config", lambda o: o.update(data=config["data"]))


def break_pods_ready(cluster, exp):
    required = {**kueueconfig.requirements(0)}  # the frameworks merged, waitForPodsReady not
    config = kueue_config_map(kueueconfig.merge(KUEUE_AS_INSTALLED, required, NS)[0])
    cluster.store.mutate("ConfigMap", "kueue-system", "kueue-manager-config", lambda o: o.update(data=config["data"]))


def break_cluster_queue(cluster, exp):
    cluster.store.remove("ResourceFlavor", None, "a100")


def break_visibility(cluster, exp):
    cluster.store.mutate(
        "APIService",
        None,
        doctor_checks.VISIBILITY_APISERVICE,
        lambda o: o.update(status=available(status="False", reason="FailedDiscoveryCheck")),
    )


def break_webhook(cluster, exp):
    cluster.store.remove("EndpointSlice", "kubeflow-system", "jobset-webhook-service-abcde")


def break_runtime(cluster, exp):
    cluster.store.remove("ClusterTrainingRuntime", None, "danlu-torch")


def break_storage(cluster, exp):
    cluster.store.mutate("StorageClass", None, "nfs", lambda o: o.update(provisioner="rancher.io/local-path"))


def break_taint(cluster, exp):
    taints = [GPU_TAINT, {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}]
    cluster.store.mutate("Node", None, "gpu-1", lambda o: o["spec"].update(taints=taints))


def break_node_labels(cluster, exp):
    cluster.store.mutate("Node", None, "gpu-1", lambda o: o["metadata"].update(labels={}))


def break_mlflow_host(cluster, exp):
    exp.mlflow_url = exp.mlflow_url.replace(f".{NS}.svc", f".{NS}.svc.cluster.local")


def break_mlflow_endpoints(cluster, exp):
    cluster.store.remove("EndpointSlice", NS, "danlu-mlflow-abcde")


def break_policy(cluster, exp):
    exp.probe_targets[0].address = exp.probe_targets[2].address  # the "metadata address" answers


@pytest.mark.parametrize(
    ("breaks", "number", "problem", "fix"),
    [
        (break_api, 1, "unreachable", "kubeconfig"),
        (break_rbac, 2, "may not: create trainjobs.trainer.kubeflow.org", "kubectl apply -f rbac.yaml"),
        (break_kueue_config, 3, "lacks trainer.kubeflow.org/trainjob, pod", "python -m danlu.hub.k8s.kueueconfig"),
        (break_pods_ready, 3, "waitForPodsReady is off", "python -m danlu.hub.k8s.kueueconfig"),
        (break_cluster_queue, 3, "ClusterQueue vision is not active (Active=False: FlavorNotFound", "kueue.yaml"),
        (break_visibility, 4, "is not Available (Available=False: FailedDiscoveryCheck", "apiservice"),
        (break_webhook, 5, "no ready endpoint behind Service kubeflow-system/jobset-webhook-service", "every TrainJob"),
        (break_runtime, 5, "ClusterTrainingRuntime danlu-torch does not exist", "kubectl apply -f trainer.yaml"),
        (break_storage, 6, "ReadWriteOnce volumes only", "kubernetes.home_storage_class"),
        (break_taint, 7, "taint dedicated=ml:NoSchedule", "tolerations"),
        (break_node_labels, 7, "no Ready node with labels nvidia.com/gpu.product=NVIDIA-A100", "kubectl label node"),
        (break_mlflow_host, 8, "answered 403", "--allowed-hosts must include danlu-mlflow.danlu.svc.cluster.local"),
        (break_mlflow_endpoints, 8, "no ready endpoint", "logs deployment/danlu-mlflow"),
        (break_policy, 9, "a job pod reaches metadata", "NetworkPolicy"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_each_check_failing_names_its_fix(setup, breaks, number, problem, fix):
    cluster, _kubeconfig, exp, _path = setup
    breaks(cluster, exp)
    if breaks is break_cluster_queue:
        wait_until(lambda: not doctor_checks.is_true(cluster.get("ClusterQueue", None, "vision"), "Active"))
    results = diagnose(setup)
    failed = {n for n, r in results.items() if r.status == "failed"}
    assert failed == {number}, doctor.text(list(results.values()))
    found = results[number].problems
    assert any(problem in p.problem and fix in p.fix for p in found), found
    if number == 1:
        assert {r.status for n, r in results.items() if n > 1} == {"skipped"}
        assert results[2].detail == "skipped: needs 1"
    if breaks is break_rbac:  # the same question kubectl auth can-i --as asks, for every rule
        assert len(found[0].problem.split(", ")) == len(exp.rules)


def wait_until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_check_that_needs_a_failed_one_is_skipped(setup):
    cluster, _kubeconfig, _exp, _path = setup
    for plural in doctor_checks.KUEUE_CRDS:
        cluster.store.remove("CustomResourceDefinition", None, f"{plural}.kueue.x-k8s.io")
    results = diagnose(setup, probe=False)
    assert results[3].status == "failed" and "Kueue is not installed" in results[3].problems[0].problem
    assert results[4].status == "skipped" and results[4].detail == "skipped: needs 3"
    assert results[9].status == "skipped" and "--no-probe" in results[9].detail
    assert [r.status for n, r in results.items() if n not in (3, 4, 9)] == ["ok"] * 6


def test_the_cli_prints_each_check_and_exits_non_zero_on_a_failure(setup, capsys):
    cluster, kubeconfig, _exp, path = setup
    argv = ["doctor", "k8s", "--config", str(path), "--kubeconfig", kubeconfig, "--no-probe"]
    assert danlu(argv) == 0
    out = capsys.readouterr().out
    assert "[ok] 1. API server" in out and "[skipped] 9. network policies" in out
    cluster.store.mutate("StorageClass", None, "nfs", lambda o: o.update(provisioner="rancher.io/local-path"))
    assert danlu([*argv, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    storage = report["checks"][5]
    assert storage["status"] == "failed" and "home_storage_class" in storage["problems"][0]["fix"]


def test_no_cluster_configuration_is_a_failed_first_check(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    (tmp_path / "danlu.yaml").write_text(yaml.safe_dump({"kubernetes": {"trial": True}}))
    settings = load_settings(tmp_path / "danlu.yaml", environ={})
    exp = doctor.expected(settings, builtin_profiles())
    results = doctor_io.diagnose(exp, kubeconfig=str(tmp_path / "missing"))
    assert results[0].status == "failed" and "--kubeconfig" in results[0].problems[0].fix
    assert doctor.exit_status(results) == 1


# --- pure rules -------------------------------------------------------------------------------


def test_tolerations_follow_the_schedulers_rule():
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    assert doctor_checks.tolerates([{"key": "nvidia.com/gpu", "operator": "Exists"}], taint)
    assert doctor_checks.tolerates([{"operator": "Exists"}], taint)
    assert doctor_checks.tolerates([{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}], taint)
    assert not doctor_checks.tolerates([{"key": "nvidia.com/gpu", "value": "other"}], taint)
    assert not doctor_checks.tolerates([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}], taint)


def test_kueue_default_namespace_selector_excludes_only_system_namespaces():
    assert doctor_checks.selects(doctor_checks.KUEUE_DEFAULT_SELECTOR, {"kubernetes.io/metadata.name": NS})
    assert not doctor_checks.selects(
        doctor_checks.KUEUE_DEFAULT_SELECTOR, {"kubernetes.io/metadata.name": "kube-system"}
    )


def test_probe_log_is_parsed_line_by_line():
    log = "probe metadata 169.254.169.254:80 failed TimeoutError()\nnoise\nprobe mlflow h:5000 reached\n"
    assert doctor_checks.parse_probe_log(log) == {
        "metadata": (False, "169.254.169.254:80 failed TimeoutError()"),
        "mlflow": (True, "h:5000 reached"),
    }


# --- the RBAC list the doctor checks is what the backend does ----------------------------------


def backend_calls() -> set[tuple[str, str, str]]:
    """(verb, group, resource) of every API call in hub/backends/kubernetes.py, read from its source."""
    verbs = {"create": "create", "read": "get", "get": "get", "list": "list", "delete": "delete", "replace": "update"}
    core = {"pod": "pods", "secret": "secrets", "pod_log": "pods/log"}
    source = Path(__file__).parent.parent / "hub" / "backends" / "kubernetes.py"
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_call" and len(node.args) >= 2):
            continue
        method = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
        if method == "GET":  # Kueue's visibility API, by path
            found.add(("get", "visibility.kueue.x-k8s.io", "localqueues/pendingworkloads"))
            continue
        api, _, name = method.partition(".")
        verb = verbs[name.split("_")[0]]
        if api == "CoreV1Api":
            found.add((verb, "", core[name.split("namespaced_", 1)[1]]))
        elif api == "NetworkingV1Api":
            found.add(
                (verb, "networking.k8s.io", {"network_policy": "networkpolicies"}[name.split("namespaced_", 1)[1]])
            )
        else:  # CustomObjectsApi: group, version, namespace, plural
            group, plural = node.args[2], node.args[5]
            group = jobs.GROUP if isinstance(group, ast.Attribute) else group.value
            plural = jobs.PLURAL if isinstance(plural, ast.Attribute) else plural.value
            found.add((verb, group, plural))
    return found


def test_the_rbac_the_doctor_checks_covers_every_call_of_the_backend(tmp_path):
    (tmp_path / "danlu.yaml").write_text(yaml.safe_dump({"kubernetes": {"trial": True}}))
    exp = doctor.expected(load_settings(tmp_path / "danlu.yaml", environ={}), builtin_profiles())
    calls = backend_calls()
    assert ("create", "trainer.kubeflow.org", "trainjobs") in calls and ("get", "", "pods/log") in calls
    assert calls <= set(exp.rules), calls - set(exp.rules)
