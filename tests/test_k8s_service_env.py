"""The jobs service in the hub pod reaches the Kubernetes API and PostgreSQL (issue 16, fault 2).

JupyterHub starts a managed service with a stripped environment (``_ServiceSpawner``, a
LocalProcessSpawner: the service's ``environment`` plus ``env_keep``). The test configures the
hub from a rendered deployment in the hub pod's environment (tests/k8shub.py), then starts the
jobs service's process with JupyterHub's own ``Service.start`` (its ``_ServiceSpawner`` builds the
environment), and the process makes the backend's
API client (the in-cluster branch: the service account's token and CA are stand-in files) and
asks libpq for the password it would send. Also: the backend's client loading names its fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from types import SimpleNamespace
from unittest import mock

import certifi
import pytest
from jupyterhub import orm
from jupyterhub.objects import Hub
from jupyterhub.services.service import Service
from traitlets.config import Config

from danlu.errors import ConfigError
from danlu.hub.k8s import apiclient
from danlu.hub.k8s.hubconfig import configure

from .k8shub import API_HOST, API_PORT, SECRETS, deployment, hub_pod_environment, load_example

PROBE = """
import asyncio, json, os, sys
from kubernetes_asyncio.config import incluster_config
from psycopg import pq
# the files the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount
incluster_config.SERVICE_TOKEN_FILENAME, incluster_config.SERVICE_CERT_FILENAME = sys.argv[2:4]
from danlu.hub.backends.kubernetes import KubernetesBackend

async def client():
    api = await KubernetesBackend()._api()
    try:
        cfg = api.configuration
        return cfg.host, cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
    finally:
        await api.close()

try:
    host, token = asyncio.run(client())
    error = None
except Exception as e:
    host = token = None
    error = f"{type(e).__name__}: {e}"
libpq = {o.keyword.decode(): (o.val or b"").decode() for o in pq.Conninfo.get_defaults()}
with open(sys.argv[1], "w") as f:
    json.dump({"host": host, "token": token, "error": error, "password": libpq["password"],
               "secret": os.environ.get("DANLU_MLFLOW_AUTH_SECRET"),
               "audit_key": os.environ.get("DANLU_AUDIT_KEY"),
               "proxy_token": os.environ.get("CONFIGPROXY_AUTH_TOKEN")}, f)
"""


def start_as_jupyterhub_does(spec: dict, command: list[str], hub_env: dict) -> int:
    """Start ``spec`` (a c.JupyterHub.services entry) with JupyterHub's own ``Service.start``, in a
    hub whose own environment is ``hub_env``; ``command`` replaces the service's (a probe). Its exit code."""
    service = Service(
        name=spec["name"],
        command=command,
        environment=spec["environment"],
        url=spec["url"],
        api_token="service-token",
        app=SimpleNamespace(public_url="", internal_ssl=False, internal_certs_location="", internal_trust_bundles={}),
        hub=Hub(ip="0.0.0.0"),
        orm=SimpleNamespace(
            server=orm.Server(
                proto="http",
                ip="0.0.0.0",
                port=10101,
                cookie_name="jupyterhub-services",
                base_url=f"/services/{spec['name']}/",
            )
        ),
    )

    async def run():
        with mock.patch.dict(os.environ, hub_env, clear=True):
            await service.start()
        service.spawner.stop_polling()  # JupyterHub would restart it when it exits
        return await asyncio.to_thread(service.proc.wait, 60)

    return asyncio.run(run())


def test_the_jobs_service_finds_the_in_cluster_api_and_the_database_password(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors"))
    hub_env = hub_pod_environment(dep)
    c = Config()
    configure(c, dep.config_dir, environ=hub_env)
    spec = next(s for s in c.JupyterHub.services if s["name"] == "danlu")
    assert spec["command"][1:3] == ["-m", "danlu.hub.service"]

    probe, out = tmp_path / "probe.py", tmp_path / "found.json"
    probe.write_text(PROBE)
    token = tmp_path / "token"
    token.write_text("the-service-account-token")
    command = [sys.executable, str(probe), str(out), str(token), certifi.where()]
    assert start_as_jupyterhub_does(spec, command, hub_env) == 0
    found = json.loads(out.read_text())
    assert found["error"] is None
    assert found["host"] == f"https://{API_HOST}:{API_PORT}"
    assert found["token"] == "Bearer the-service-account-token"
    assert found["password"] == SECRETS["postgres-password"]
    assert found["secret"] == SECRETS["mlflow-auth-secret"]
    assert found["audit_key"] == SECRETS["audit-key"]  # the audit chain's key: from the Secret, not the volume
    assert found["proxy_token"] is None  # and nothing the service must not have


def test_the_gateway_gets_no_database_password_nor_the_api(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors"))
    hub_env = {**hub_pod_environment(dep), "HTTPS_PROXY": "http://proxy.example.com:3128"}
    c = Config()
    configure(c, dep.config_dir, environ=hub_env)
    gateway = next(s for s in c.JupyterHub.services if s["name"] == "mlflow")["environment"]
    assert "PGPASSWORD" not in gateway and "KUBERNETES_SERVICE_HOST" not in gateway
    assert "DANLU_AUDIT_KEY" not in gateway
    assert gateway["HTTPS_PROXY"] == "http://proxy.example.com:3128"


def load(kubeconfig="", environ=None):
    return asyncio.run(apiclient.load(kubeconfig, environ=environ or {}))


def test_no_way_to_the_api_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(ConfigError) as e:
        load()
    assert "KUBERNETES_SERVICE_HOST is not in its environment" in str(e.value)
    assert "danlu.hub.k8s.hubconfig.configure(c)" in str(e.value)


def test_a_missing_service_account_token_names_the_fix():
    with pytest.raises(ConfigError) as e:
        load(environ={"KUBERNETES_SERVICE_HOST": API_HOST, "KUBERNETES_SERVICE_PORT": API_PORT})
    assert "service account" in str(e.value) and "hub.serviceAccount" in str(e.value)


def test_an_unreadable_kubeconfig_names_the_option(tmp_path):
    with pytest.raises(ConfigError, match="KubernetesBackend.kubeconfig"):
        load(str(tmp_path / "absent"))
