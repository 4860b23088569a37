"""``python -m danlu.hub.k8s.mlflowserver``: the MLflow tracking server of a cluster deployment.

The MLflow Deployment that ``danlu render k8s`` writes runs this. It does on a cluster what
:meth:`danlu.hub.app.Workbench.start_mlflow` does on one machine: write the basic-auth app's
ini (:func:`danlu.hub.mlflow_auth.write_auth_config`, its admin password derived from the
workbench secret, which comes from the ``danlu-secrets`` Secret) into a private temporary
folder, then replace itself with ``mlflow server --app-name basic-auth`` on ``0.0.0.0``. Its
stores come from the danlu.yaml in the ``danlu-config`` ConfigMap (the renderer points them at
Danlu's PostgreSQL and the artifact volume or object store). PostgreSQL's password is
``$PGPASSWORD``, which libpq reads, so no URL carries it.

MLflow refuses a request whose ``Host`` header is not in ``--allowed-hosts`` (403 "Invalid Host
header", its guard against DNS rebinding), so :func:`allowed_hosts` lists every name of the
Service a client may use: the hub's services and every job call it by :func:`url`
(``danlu-mlflow.<namespace>.svc:5000``); the short and ``.svc.cluster.local`` forms and the
kubelet's probe (``localhost``) are allowed too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from danlu import env
from danlu.errors import ConfigError
from danlu.hub import mlflow_auth, mlflowserver
from danlu.hub.config import Settings, load_settings
from danlu.hub.k8s import names


def url(namespace: str) -> str:
    """The tracking URI the hub's services and jobs use: the Service's name in the namespace, with
    the ``/services/mlflow`` prefix the server runs under (the gateway's path on the hub)."""
    return f"http://{names.MLFLOW_SERVICE}.{namespace}.svc:{names.MLFLOW_PORT}/services/mlflow"


def allowed_hosts(namespace: str, port: int = names.MLFLOW_PORT) -> list[str]:
    """Every ``Host`` header a client in the cluster may send to the Service, with and without the
    port: short, namespaced, ``.svc`` and ``.svc.cluster.local`` names, and ``localhost`` (probes)."""
    service = names.MLFLOW_SERVICE
    hosts = [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]
    return [name for host in [*hosts, "localhost"] for name in (f"{host}:{port}", host)]


def server_command(settings: Settings, port: int = names.MLFLOW_PORT) -> list[str]:
    """``mlflow server`` with the stores danlu.yaml names (the renderer always sets both)."""
    mlflow = settings.mlflow
    for key in ("backend_store_uri", "artifacts_destination"):
        if not getattr(mlflow, key):
            raise ConfigError(
                f"{settings.where('mlflow')}: mlflow.{key} is not set",
                fix="render the ConfigMap with danlu render k8s, which sets it",
            )
    return [
        sys.executable,
        "-m",
        "danlu.hub.mlflowserver",
        "--app-name",
        "basic-auth",
        "--backend-store-uri",
        mlflow.backend_store_uri,
        "--artifacts-destination",
        mlflow.artifacts_destination,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--static-prefix",
        "/services/mlflow",
        "--workers",
        str(mlflow.workers),
        "--allowed-hosts",
        ",".join(allowed_hosts(settings.kubernetes.namespace, port)),
    ]


def main() -> None:
    settings = load_settings()
    secret = env.MLFLOW_AUTH_SECRET.get()
    if not secret:
        raise SystemExit(
            f"{env.MLFLOW_AUTH_SECRET} is not set: create the {names.SECRET} Secret "
            f"(key {names.SECRET_MLFLOW_AUTH}); see docs/kubernetes.md"
        )
    folder = Path(tempfile.mkdtemp(prefix="mlflow-auth-"))
    config = mlflow_auth.write_auth_config(folder, settings, secret)
    command = server_command(settings)
    environ = mlflowserver.server_environ({**os.environ, **mlflow_auth.server_environment(config, secret)})
    os.execve(command[0], command, environ)  # no hub or proxy token, as on one machine


if __name__ == "__main__":
    main()
