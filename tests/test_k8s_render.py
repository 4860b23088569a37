"""Pure tests of ``danlu render k8s`` (:mod:`danlu.hub.k8s.render` and its builders).

Whole-dict comparisons for small builders; every object of both examples validated against the
official schemas (tests/k8sschemas.py), the chart values against the chart's values schema after
Helm's merge over its defaults; the committed helm-values/ compared with a fresh rendering; the CLI.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from danlu import env
from danlu.errors import ConfigError
from danlu.hub import cli
from danlu.hub.config import load_settings
from danlu.hub.k8s import kueueconfig, manifests, mlflowserver, names, render, values
from danlu.hub.profiles import load_profiles

from .k8sschemas import errors, values_errors, with_chart_defaults

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "shared-workstation": ROOT / "examples" / "config" / "shared-workstation.yaml",
    "two-flavors": ROOT / "examples" / "config" / "two-flavors.yaml",
}
MANAGED = {names.MANAGED_BY: names.MANAGER}
DIGEST = "sha256:" + "a" * 64


def _load(path):
    settings = load_settings(path, environ={env.BASE_DIR: str(ROOT)})
    return settings, load_profiles(settings.profiles_file)


def _objects(files: dict[str, str]) -> list[dict]:
    return [
        obj
        for name, text in files.items()
        if name.endswith(".yaml") and name not in ("values.yaml", "kueue-config.yaml")
        for obj in yaml.safe_load_all(text)
    ]


# --- small builders, whole dicts ----------------------------------------------------------------


def test_training_runtime():
    runtime = manifests.make_training_runtime("registry.example.com/danlu/pytorch@" + DIGEST, "8Gi")
    pod_labels = {**MANAGED, names.COMPONENT: names.JOB}
    assert runtime == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": "danlu-torch", "labels": pod_labels},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                "spec": {
                                    "backoffLimit": 0,
                                    "template": {
                                        "metadata": {"labels": pod_labels},
                                        "spec": {
                                            "restartPolicy": "Never",
                                            "automountServiceAccountToken": False,
                                            "securityContext": {
                                                "runAsNonRoot": True,
                                                "runAsUser": 1000,
                                                "runAsGroup": 100,
                                                "fsGroup": 100,
                                                "seccompProfile": {"type": "RuntimeDefault"},
                                            },
                                            "containers": [
                                                {
                                                    "name": "node",
                                                    "image": "registry.example.com/danlu/pytorch@" + DIGEST,
                                                    "command": ["python", "-m", "danlu.runner", "--kubernetes"],
                                                    "securityContext": {
                                                        "allowPrivilegeEscalation": False,
                                                        "capabilities": {"drop": ["ALL"]},
                                                    },
                                                    "volumeMounts": [
                                                        {"name": "shm", "mountPath": "/dev/shm"},
                                                        {"name": "job", "mountPath": "/danlu/job"},
                                                    ],
                                                }
                                            ],
                                            "volumes": [
                                                {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                                                {"name": "job", "emptyDir": {}},
                                            ],
                                        },
                                    },
                                },
                            },
                        }
                    ]
                }
            },
        },
    }
    assert errors(runtime) == []


def test_a_private_registry_gives_the_runtime_its_image_pull_secrets(tmp_path):
    """Without them a private image is never pulled: the pods wait and (issue 16) held the team's quota."""
    config = tmp_path / "danlu.yaml"
    config.write_text("kubernetes: {image_pull_secrets: [regcred], trial: true}\n")
    settings = load_settings(config, environ={env.BASE_DIR: str(ROOT)})
    files = render.render(settings, load_profiles(settings.profiles_file))
    (runtime,) = yaml.safe_load_all(files["trainer.yaml"])
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and errors(runtime) == []
    plain = manifests.make_training_runtime("i@" + DIGEST, "1Gi")
    assert (
        "imagePullSecrets"
        not in plain["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    )


def test_network_policy():
    policy = manifests.make_ingress_policy(
        "danlu-mlflow", "danlu", "mlflow", manifests.MLFLOW_POD, 5000, [manifests.HUB_POD, manifests.JOB_POD]
    )
    assert policy == {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "danlu-mlflow", "namespace": "danlu", "labels": {**MANAGED, names.COMPONENT: "mlflow"}},
        "spec": {
            "podSelector": {"matchLabels": {**MANAGED, names.COMPONENT: "mlflow"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {"app": "jupyterhub", "component": "hub"}}},
                        {"podSelector": {"matchLabels": {**MANAGED, names.COMPONENT: "job"}}},
                    ],
                    "ports": [{"protocol": "TCP", "port": 5000}],
                }
            ],
        },
    }
    assert errors(policy) == []


def test_kueue_config_yaml_is_only_what_danlu_needs(example):
    """Not a ConfigMap that would replace the cluster's whole Kueue configuration (tests/test_kueue.py merges it)."""
    _, settings, _, files = example
    assert list(yaml.safe_load_all(files["kueue-config.yaml"])) == [
        kueueconfig.requirements(settings.kubernetes.pods_ready_timeout)
    ]


@pytest.mark.parametrize(
    "reference, image",
    [
        (
            "quay.io/jupyterhub/k8s-hub:4.4.0@" + DIGEST,
            {"name": "quay.io/jupyterhub/k8s-hub", "tag": "4.4.0@" + DIGEST},
        ),
        ("localhost:5000/danlu/hub@" + DIGEST, {"name": "localhost:5000/danlu/hub", "tag": "latest@" + DIGEST}),
        ("localhost:5000/danlu/hub:1.0", {"name": "localhost:5000/danlu/hub", "tag": "1.0"}),
    ],
)
def test_split_image(reference, image):
    assert values.split_image(reference) == image


def test_values_of_a_tiny_config(tmp_path):
    config = tmp_path / "danlu.yaml"
    config.write_text(
        f"hub: {{idle_timeout_seconds: 0}}\nkubernetes: {{namespace: lab, hub_image: h/hub@{DIGEST}, "
        "home_storage_class: nfs, home_size: 5G, shm_size: 1G}\n"
    )
    settings = load_settings(config, environ={env.BASE_DIR: str(ROOT)})
    data = render.chart_values(settings, load_profiles(settings.profiles_file))
    placeholder = {"name": "registry.example.com/danlu/python", "tag": "latest@sha256:" + "0" * 64}
    assert data["singleuser"]["image"] == placeholder
    assert data["singleuser"]["storage"] == {
        "type": "dynamic",
        "capacity": "5Gi",
        "homeMountPath": "/home/jovyan",
        "dynamic": {"storageAccessModes": ["ReadWriteMany"], "storageClass": "nfs"},
    }  # /dev/shm is the spawner's (one volume there: two mounts at one path are refused)
    assert data["cull"] == {"enabled": False}
    assert data["hub"]["image"] == {"name": "h/hub", "tag": "latest@" + DIGEST}
    assert data["hub"]["extraConfig"] == {"danlu": "from danlu.hub.k8s.hubconfig import configure\nconfigure(c)\n"}
    assert data["hub"]["extraEnv"][env.MLFLOW_URL] == "http://danlu-mlflow.lab.svc:5000/services/mlflow"
    assert data["hub"]["extraVolumeMounts"] == [{"name": "danlu-config", "mountPath": "/etc/danlu", "readOnly": True}]
    assert data["hub"]["services"]["danlu"]["url"] == "http://hub:10101"
    assert values_errors(with_chart_defaults(data)) == []


# --- both examples: valid, committed, deterministic -----------------------------------------------


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def example(request):
    settings, profiles = _load(EXAMPLES[request.param])
    return request.param, settings, profiles, render.render(settings, profiles)


def test_every_rendered_object_is_valid(example):
    _, settings, _, files = example
    objects = _objects(files)
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "ResourceFlavor",
        "ClusterQueue",
        "LocalQueue",
        "WorkloadPriorityClass",
        "ConfigMap",
        "ClusterTrainingRuntime",
        "StatefulSet",
        "Service",
        "Deployment",
        "NetworkPolicy",
    } <= kinds
    namespace = settings.kubernetes.namespace
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert errors(obj) == [], where
        assert obj["metadata"]["labels"][names.MANAGED_BY] == names.MANAGER, where
        if obj["kind"] in (
            "ConfigMap",
            "Service",
            "Deployment",
            "StatefulSet",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "LocalQueue",
        ):
            assert obj["metadata"]["namespace"] in (namespace, "kueue-system"), where
    chart = yaml.safe_load(files["values.yaml"])
    assert values_errors(with_chart_defaults(chart)) == []


def test_the_cluster_config_and_profiles_load(example, tmp_path):
    _, _, _, files = example
    cm = next(o for o in _objects(files) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == names.CONFIG_MAP)
    (tmp_path / "danlu.yaml").write_text(cm["data"]["danlu.yaml"])
    (tmp_path / "profiles.yaml").write_text(cm["data"]["profiles.yaml"])
    settings = load_settings(tmp_path / "danlu.yaml", environ={})
    assert settings.jobs.backend == "kubernetes"
    assert str(settings.profiles_file) == "/etc/danlu/profiles.yaml"
    profiles = load_profiles(tmp_path / "profiles.yaml")
    assert all(p.environment["image"].partition("@sha256:")[2] for p in profiles)
    assert mlflowserver.server_command(settings)[1:7] == [
        "-m",
        "danlu.hub.mlflowserver",
        "--app-name",
        "basic-auth",
        "--backend-store-uri",
        "postgresql+psycopg://danlu@danlu-postgres:5432/mlflow",
    ]


def test_committed_helm_values_are_fresh(example):
    name, _, _, files = example
    folder = ROOT / "helm-values" / name
    regenerate = f"danlu render k8s --config examples/config/{name}.yaml --out helm-values/{name} (or make render-k8s)"
    assert sorted(p.name for p in folder.iterdir()) == sorted(files), f"helm-values/{name} is stale: {regenerate}"
    for file, text in files.items():
        assert (folder / file).read_text() == text, f"helm-values/{name}/{file} is stale: {regenerate}"


def test_rendering_is_deterministic(example):
    _, settings, profiles, files = example
    assert render.render(copy.deepcopy(settings), profiles) == files


def test_the_validators_catch_a_misspelled_field(example):
    _, _, _, files = example
    runtime = next(o for o in _objects(files) if o["kind"] == "ClusterTrainingRuntime")
    runtime["spec"]["mlPolicy"]["numNode"] = runtime["spec"]["mlPolicy"].pop("numNodes")
    assert any("numNode" in e for e in errors(runtime))
    deployment = next(o for o in _objects(files) if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert errors(deployment) != []
    chart = yaml.safe_load(files["values.yaml"])
    chart["singleuser"]["storage"]["capactiy"] = chart["singleuser"]["storage"].pop("capacity")
    assert any("capactiy" in e for e in values_errors(with_chart_defaults(chart)))


def test_no_secret_values_in_the_output(example):
    _, _, _, files = example
    for obj in _objects(files):
        assert obj["kind"] != "Secret"
    env = []  # (name, definition) of every environment variable, in containers and in the chart values

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("env"), list):
                env.extend((e["name"], e) for e in node["env"])
            if isinstance(node.get("extraEnv"), dict):
                env.extend(node["extraEnv"].items())
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(_objects(files))
    walk(yaml.safe_load(files["values.yaml"]))
    secret = [(n, d) for n, d in env if "PASSWORD" in n or "SECRET" in n]
    assert len(secret) >= 5
    for name, definition in secret:
        assert definition["valueFrom"]["secretKeyRef"]["name"] == names.SECRET, name


def test_a_secret_in_danlu_yaml_is_refused(tmp_path):
    config = tmp_path / "danlu.yaml"
    config.write_text("jobs: {database_url: 'postgresql://danlu:hunter2@db/danlu'}\n")
    settings = load_settings(config, environ={env.BASE_DIR: str(ROOT)})
    with pytest.raises(ConfigError, match="holds a password"):
        render.render(settings, load_profiles(settings.profiles_file))


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_writes_the_files(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "out"
    assert cli.main(["render", "k8s", "--config", str(EXAMPLES["two-flavors"]), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(render.FILES)
    assert (out / "values.yaml").read_text() == (ROOT / "helm-values" / "two-flavors" / "values.yaml").read_text()
    assert str(out / "values.yaml") in capsys.readouterr().out


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    config = tmp_path / "danlu.yaml"
    config.write_text("kubernetes: {namespace: Not_A_Name}\n")
    assert cli.main(["render", "k8s", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("danlu: ") and "namespace" in err and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "out").exists()


def test_kueue_render_still_works(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli.main(["kueue", "render", "--config", str(EXAMPLES["shared-workstation"])]) == 0
    assert "kind: ClusterQueue" in capsys.readouterr().out


def test_the_jobs_service_may_do_exactly_what_the_kubernetes_backend_does_and_no_more():
    role, binding = manifests.make_jobs_rbac("danlu")
    assert role["rules"] == [
        {
            "apiGroups": ["trainer.kubeflow.org"],
            "resources": ["trainjobs"],
            "verbs": ["create", "get", "list", "watch", "delete"],
        },
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["visibility.kueue.x-k8s.io"], "resources": ["localqueues/pendingworkloads"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "delete"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "get", "update", "delete"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]},
    ]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "danlu"}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "danlu-jobs"}
    assert errors(role) == [] and errors(binding) == []
