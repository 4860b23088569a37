"""The hub pod of a rendered deployment, as far as a test on one machine can have it.

:func:`deployment` renders an example with ``danlu render k8s`` and unpacks the ``danlu-config``
ConfigMap into a folder, as the chart mounts it at ``/etc/danlu``. :func:`hub_pod_environment`
is the hub container's environment as the kubelet makes it: the chart's own variables, the
rendered ``hub.extraEnv`` with each ``secretKeyRef`` read from a stand-in for the
``danlu-secrets`` Secret, and the API server's service variables every pod gets.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from danlu import env
from danlu.hub.config import load_settings
from danlu.hub.k8s import names, render
from danlu.hub.profiles import load_profiles

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "config"
#: the danlu-secrets Secret of the tests
SECRETS = {
    names.SECRET_POSTGRES_PASSWORD: "pg-password-from-the-secret",
    names.SECRET_MLFLOW_AUTH: "mlflow-secret-from-the-secret",
    names.SECRET_AUDIT_KEY: "audit-key-from-the-secret-0123456789abcdef",
    "oauth-client-secret": "oauth-secret-from-the-secret",
}
#: the API server's Service, as the kubelet announces it to every pod
API_HOST, API_PORT = "10.96.0.1", "443"


@dataclasses.dataclass
class Deployment:
    files: dict[str, str]
    values: dict
    config_dir: Path  # the ConfigMap's files, where the hub pod has /etc/danlu
    cluster_yaml: dict  # the cluster's danlu.yaml


def load_example(name: str, overrides: dict | None = None, folder: Path | None = None):
    """An example's settings and profiles; ``overrides`` (top-level keys) written to a copy first."""
    path = EXAMPLES / f"{name}.yaml"
    if overrides:
        data = {**yaml.safe_load(path.read_text()), **overrides}
        data = {k: v for k, v in data.items() if v is not None}
        path = folder / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
    settings = load_settings(path, environ={env.BASE_DIR: str(ROOT)})
    return settings, load_profiles(settings.profiles_file)


def deployment(tmp_path: Path, settings, profiles) -> Deployment:
    files = render.render(settings, profiles)
    config_map = next(
        o
        for o in yaml.safe_load_all(files["mlflow.yaml"])
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == names.CONFIG_MAP
    )
    config_dir = tmp_path / "etc-danlu"
    config_dir.mkdir()
    for name, text in config_map["data"].items():  # the folder stands for /etc/danlu
        (config_dir / name).write_text(text.replace(names.CONFIG_DIR, str(config_dir)))
    return Deployment(
        files, yaml.safe_load(files["values.yaml"]), config_dir, yaml.safe_load(config_map["data"]["danlu.yaml"])
    )


def hub_pod_environment(dep: Deployment) -> dict[str, str]:
    """The hub container's environment (see the module's docs); ``/etc/danlu`` is ``dep.config_dir``."""
    out = {
        # the kubelet's, for the default namespace's kubernetes Service
        "KUBERNETES_SERVICE_HOST": API_HOST,
        "KUBERNETES_SERVICE_PORT": API_PORT,
        "KUBERNETES_SERVICE_PORT_HTTPS": API_PORT,
        "HOSTNAME": "hub-7d9f8b6c5-x2x8q",
        "HOME": "/home/jovyan",
        "PATH": os.environ["PATH"],
        # the chart's (templates/hub/deployment.yaml)
        "PYTHONUNBUFFERED": "1",
        "HELM_RELEASE_NAME": "danlu",
        "POD_NAMESPACE": dep.cluster_yaml.get("kubernetes", {}).get("namespace", "danlu"),
        "CONFIGPROXY_AUTH_TOKEN": "the-proxy-token",
    }
    if "PYTHONPATH" in os.environ:  # the hub image has danlu installed; the tests may find it by PYTHONPATH
        out["PYTHONPATH"] = os.environ["PYTHONPATH"]
    for name, value in dep.values["hub"]["extraEnv"].items():
        if isinstance(value, dict):
            value = SECRETS[value["valueFrom"]["secretKeyRef"]["key"]]
        out[name] = value.replace(names.CONFIG_DIR, str(dep.config_dir))
    return out
