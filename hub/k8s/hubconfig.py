"""JupyterHub's configuration on Kubernetes, added to the Zero to JupyterHub chart's own.

The chart's ``hub.extraConfig`` calls :func:`configure`::

    from danlu.hub.k8s.hubconfig import configure; configure(c)

It reads ``danlu.yaml`` and ``profiles.yaml`` from one folder (the Danlu ConfigMap, mounted at
``/etc/danlu``; ``$DANLU_CONFIG`` may name another danlu.yaml), and adds what the local
configuration (:mod:`danlu.hub.hubconfig`) adds, built by the same functions: the spawner
(:class:`~danlu.hub.k8s.spawner.DanluKubeSpawner`), admins and groups, the custom scopes and
roles, and the jobs service ``danlu`` as a hub-managed service running jobs as TrainJobs
(``jobs.backend: kubernetes``). The chart's own services, roles, admins and groups are kept:
extraConfig runs last, so this adds to them instead of replacing them. The authenticator is
danlu.yaml's ``auth`` (:mod:`danlu.hub.k8s.auth`): never the chart's default DummyAuthenticator,
unless danlu.yaml says the deployment is a throwaway trial.

JupyterHub starts a managed service with a stripped environment: its ``environment`` plus the
few variables ``LocalProcessSpawner.env_keep`` names (``PATH``, ``LANG``, ...), never the rest of
the hub's (``jupyterhub/services/service.py``). What the services need from the hub pod's own
environment (:data:`JOBS_SERVICE_ENV`, :data:`SERVICES_ENV`) is copied into their ``environment``
here, when the hub reads its configuration: the in-cluster API address the kubelet sets and
the database password the chart's ``hub.extraEnv`` takes from the ``danlu-secrets`` Secret.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from traitlets.config import LazyConfigValue

from danlu import env as names
from danlu.errors import ConfigError
from danlu.hub.backends import backends
from danlu.hub.backends.kubernetes import KubernetesBackend
from danlu.hub.config import Settings, load_settings
from danlu.hub.hubconfig import SERVER_TOKEN_SCOPES, admins_and_groups, authenticator, jobs_service, lab_args, roles
from danlu.hub.k8s import auth as k8s_auth
from danlu.hub.k8s import mlflowserver
from danlu.hub.k8s import names as k8s_names
from danlu.hub.profiles import load_profiles
from danlu.hub.scopes import CUSTOM_SCOPES

#: the hub's volume in the chart (hub.db lives there): the jobs service's state, unless danlu.yaml says
HUB_STATE_DIR = "/srv/jupyterhub/danlu"
#: the chart's Services of the hub and of the public proxy
HUB_SERVICE = "hub"
PROXY_SERVICE = "proxy-public"

#: what both services take from the hub pod's environment: the way out of the cluster, if any
SERVICES_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy", "SSL_CERT_FILE", "TZ")
#: and what the jobs service alone takes: the in-cluster API address (kubernetes_asyncio's
#: load_incluster_config reads it; the service account's token is a file), and every variable of
#: libpq (PGPASSWORD from danlu-secrets; PGSSLMODE and the like if the admin sets them), and the audit
#: chain's key (DANLU_AUDIT_KEY from danlu-secrets)
JOBS_SERVICE_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "PG*", str(names.AUDIT_KEY))


def passed_on(environ, keys) -> dict:
    """The variables of ``environ`` that ``keys`` names (``PG*``: every name with that prefix)."""
    return {
        name: value
        for name, value in environ.items()
        if any(name.startswith(key[:-1]) if key.endswith("*") else name == key for key in keys)
    }


def _current(section, name: str, empty):
    """What the chart already set for ``section.name`` (``empty`` when nothing)."""
    if name not in section:
        return empty
    value = section[name]
    return value.get_value(empty) if isinstance(value, LazyConfigValue) else value


def _by_name(existing, added: list[dict]) -> list[dict]:
    names_added = {item["name"] for item in added}
    return [item for item in existing if item.get("name") not in names_added] + added


def configure(c, config_dir: str | os.PathLike = "/etc/danlu", environ=os.environ) -> Settings:
    folder = Path(config_dir)
    config_file = Path(names.CONFIG.get(environ=environ) or folder / "danlu.yaml")
    if not config_file.exists():
        raise ConfigError(
            f"{config_file} does not exist",
            fix=f"mount Danlu's ConfigMap (danlu.yaml, profiles.yaml) at {folder}, or set {names.CONFIG}",
        )
    # relative paths in danlu.yaml start beside it (the hub's working folder is the chart's, not Danlu's)
    environ = {**environ, names.BASE_DIR: names.BASE_DIR.get(environ=environ) or str(config_file.parent)}
    settings = load_settings(config_file, environ=environ)
    if settings.is_set("jobs", "backend") and backends.get(settings.jobs.backend) is not KubernetesBackend:
        raise ConfigError(
            f"{settings.jobs.where('backend')}: jobs.backend is {settings.jobs.backend}, which "
            "would run jobs inside the hub pod",
            fix="set jobs.backend: kubernetes (or remove it)",
        )
    profiles_file = settings.profiles_file if settings.is_set("profiles_file") else config_file.parent / "profiles.yaml"
    if not profiles_file.exists():
        raise ConfigError(
            f"{profiles_file} does not exist", fix="add profiles.yaml to Danlu's ConfigMap, beside danlu.yaml"
        )
    state = settings.state_dir if settings.is_set("state_dir") else Path(HUB_STATE_DIR)
    namespace = settings.kubernetes.namespace

    k8s_auth.check(settings, rendered=True)
    authenticator(c, settings, environ)
    chart_admins = set(_current(c.Authenticator, "admin_users", set()))
    chart_groups = dict(_current(c.JupyterHub, "load_groups", {}))
    admins_and_groups(c, settings)
    c.Authenticator.admin_users = chart_admins | set(c.Authenticator.admin_users)
    c.JupyterHub.load_groups = {**chart_groups, **_current(c.JupyterHub, "load_groups", {})}

    # telemetry off unless privacy.allow_outbound (the way out, if any, is SERVICES_ENV's)
    private = names.private_environment(settings.privacy.allow_outbound, {})
    service_env = {
        **private,
        names.CONFIG: str(config_file),
        names.PROFILES_FILE: str(profiles_file),
        names.BASE_DIR: environ[names.BASE_DIR],
        names.STATE_DIR: str(state),
    }
    # MLflow in the namespace (mlflow.yaml); jobs reach it there, users through the gateway
    mlflow_env = {
        **private,
        **passed_on(environ, SERVICES_ENV),
        names.MLFLOW_URL: names.MLFLOW_URL.get(environ=environ) or mlflowserver.url(namespace),
    }
    if names.MLFLOW_AUTH_SECRET.get(environ=environ):  # from the danlu-secrets Secret, in the hub's environment
        mlflow_env[names.MLFLOW_AUTH_SECRET] = names.MLFLOW_AUTH_SECRET.get(environ=environ)
    # on the cluster: jobs are TrainJobs, no danlu up upgrades the database first, and the chart culls idle servers
    service = jobs_service(
        f"http://{HUB_SERVICE}:{k8s_names.JOBS_SERVICE_PORT}",
        [
            sys.executable,
            "-m",
            "danlu.hub.service",
            "--JobsServiceApp.backend_class=kubernetes",
            "--JobsServiceApp.upgrade_database=True",
            "--JobsServiceApp.cull_idle_servers=False",
            "--JobsServiceApp.ip=0.0.0.0",
        ],
        {**passed_on(environ, JOBS_SERVICE_ENV), **service_env, **mlflow_env},
    )
    gateway = {
        "name": "mlflow",
        "url": f"http://{HUB_SERVICE}:{k8s_names.GATEWAY_SERVICE_PORT}",
        "command": [sys.executable, "-m", "danlu.hub.mlflow_gateway", "--ip=0.0.0.0"],
        "environment": mlflow_env,
        "oauth_no_confirm": True,
    }
    c.JupyterHub.services = _by_name(_current(c.JupyterHub, "services", []), [service, gateway])
    c.JupyterHub.custom_scopes = {**_current(c.JupyterHub, "custom_scopes", {}), **CUSTOM_SCOPES}
    services = [s["name"] for s in c.JupyterHub.services]
    c.JupyterHub.load_roles = _by_name(
        _current(c.JupyterHub, "load_roles", []), roles(settings, services, service_culls=False)
    )

    base_url = "/" + str(_current(c.JupyterHub, "base_url", "/")).strip("/")
    c.JupyterHub.spawner_class = "danlu.hub.k8s.spawner.DanluKubeSpawner"
    c.DanluKubeSpawner.settings = settings
    c.DanluKubeSpawner.profiles = load_profiles(profiles_file)
    c.DanluKubeSpawner.namespace = namespace
    c.DanluKubeSpawner.server_token_scopes = SERVER_TOKEN_SCOPES
    c.DanluKubeSpawner.args = lab_args(settings)
    c.DanluKubeSpawner.extra_env = {
        **private,
        names.URL: f"http://{PROXY_SERVICE}.{namespace}.svc{base_url.rstrip('/')}",
        **({names.PUBLIC_URL: settings.public_url} if settings.is_set("public_url") else {}),
    }
    return settings
