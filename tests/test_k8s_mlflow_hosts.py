"""MLflow answers every name the rendered deployment calls it by (issue 16, fault 4).

MLflow refuses a ``Host`` header missing from ``--allowed-hosts`` with 403 "Invalid Host header".
The names come from the rendered configuration: the hub's ``DANLU_MLFLOW_URL`` (values.yaml),
what ``configure(c)`` gives the jobs service and the gateway (and the service, in turn, every
job as ``MLFLOW_TRACKING_URI``). The real MLflow server is started with the arguments its
Deployment's command computes from the rendered danlu.yaml (on loopback, SQLite stores) and
called with each of those names, as its Service's clients would.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import pytest
import requests
import yaml
from traitlets.config import Config

from danlu import env
from danlu.hub import mlflow_auth
from danlu.hub.config import load_settings
from danlu.hub.k8s import mlflowserver
from danlu.hub.k8s.hubconfig import configure
from danlu.hub.testing import free_port

from .k8shub import deployment, hub_pod_environment, load_example
from .mlflowkit import running_mlflow

PATIENCE = 180.0  # bounds a hang on a busy machine; nothing here measures time
SECRET = "mlflow-secret-of-the-test"


def used_hosts(dep) -> set[str]:
    """Every host[:port] the rendered configuration calls MLflow by."""
    hub_env = hub_pod_environment(dep)
    urls = {hub_env[str(env.MLFLOW_URL)]}
    for environ in (hub_env, {k: v for k, v in hub_env.items() if k != str(env.MLFLOW_URL)}):
        c = Config()
        configure(c, dep.config_dir, environ=environ)
        urls |= {
            s["environment"][str(env.MLFLOW_URL)] for s in c.JupyterHub.services if s["name"] in ("danlu", "mlflow")
        }
    return {urlsplit(url).netloc for url in urls}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    dep = deployment(tmp_path_factory.mktemp("mlflow-hosts"), *load_example("two-flavors"))
    return dep, used_hosts(dep)


def test_every_name_the_deployment_uses_is_allowed(rendered):
    dep, hosts = rendered
    namespace = dep.cluster_yaml["kubernetes"]["namespace"]
    assert f"danlu-mlflow.{namespace}.svc:5000" in hosts
    allowed = set(mlflowserver.allowed_hosts(namespace))
    assert hosts <= allowed
    for host in hosts:  # with and without the port, and the cluster domain's full name
        assert host.rsplit(":", 1)[0] in allowed
    assert f"danlu-mlflow.{namespace}.svc.cluster.local:5000" in allowed


@pytest.fixture(scope="module")
def mlflow_server(rendered, tmp_path_factory):
    """The real MLflow server, with the arguments of the rendered Deployment but SQLite and a loopback port."""
    dep, _ = rendered
    folder = tmp_path_factory.mktemp("mlflow")
    data = yaml.safe_load((dep.config_dir / "danlu.yaml").read_text())
    data["mlflow"].update(
        backend_store_uri=f"sqlite:///{folder / 'mlflow.db'}",
        auth_database_uri=f"sqlite:///{folder / 'mlflow-auth.db'}",
        artifacts_destination=str(folder / "artifacts"),
    )
    local = folder / "danlu.yaml"
    local.write_text(yaml.safe_dump(data))
    settings = load_settings(local, environ={env.BASE_DIR: str(folder)})
    command = mlflowserver.server_command(settings)
    port = free_port()
    command[command.index("--host") + 1] = "127.0.0.1"  # on loopback, not 0.0.0.0
    command[command.index("--port") + 1] = str(port)
    config = mlflow_auth.write_auth_config(folder, settings, SECRET)
    environ = {**os.environ, **mlflow_auth.server_environment(config, SECRET)}
    with running_mlflow(folder, PATIENCE, command, port, environ, health="/services/mlflow/health") as url:
        yield url


def test_mlflow_answers_each_name_the_deployment_uses(rendered, mlflow_server):
    _, hosts = rendered
    auth = mlflow_auth.basic_authorization(mlflow_auth.SERVICE_ACCOUNT, SECRET)
    for host in sorted(hosts):
        answer = requests.get(
            f"{mlflow_server}/services/mlflow/api/2.0/mlflow/experiments/search",
            params={"max_results": 1},
            headers={"Host": host, "Authorization": auth},
            timeout=30,
        )
        assert answer.status_code == 200, f"Host: {host}: {answer.status_code} {answer.text[:200]}"
    stranger = requests.get(
        f"{mlflow_server}/services/mlflow/api/2.0/mlflow/experiments/search",
        headers={"Host": "evil.example.com", "Authorization": auth},
        timeout=30,
    )
    assert stranger.status_code == 403  # the guard is still on
