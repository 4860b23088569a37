"""Pure tests of the generated JupyterHub configuration (danlu.hub.hubconfig)."""

from __future__ import annotations

import asyncio
import importlib

import pytest
import yaml
from traitlets.config import Config

from danlu.errors import ConfigError
from danlu.hub.config import load_settings
from danlu.hub.hubconfig import AUTHENTICATORS, SERVER_TOKEN_SCOPES, configure
from danlu.hub.scopes import CULLER_SCOPES

OIDC = {
    "type": "oidc",
    "client_id": "danlu",
    "client_secret": "s3cret",
    "oauth_callback_url": "https://gpu.example.org/hub/oauth_callback",
    "authorize_url": "https://sso.example.org/auth",
    "token_url": "https://sso.example.org/token",
    "userdata_url": "https://sso.example.org/userinfo",
}


def hub_config(tmp_path, data: dict) -> Config:
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump(data))
    env = {
        "DANLU_CONFIG": str(path),
        "DANLU_STATE_DIR": str(tmp_path / "state"),
        "DANLU_HUB_PORT": "8081",
        "DANLU_PROXY_API_PORT": "8001",
        "DANLU_ADMIN_TOKEN": "a" * 64,
        "DANLU_MLFLOW_URL": "http://127.0.0.1:5000",
        "DANLU_SERVICE_PORT": "10101",
        "DANLU_GATEWAY_PORT": "10102",
        "DANLU_INSTANCE": "test",
        "PATH": "/usr/bin",
    }
    c = Config()
    configure(c, environ=env)
    return c


def authenticator(c: Config):
    module, _, name = c.JupyterHub.authenticator_class.rpartition(".")
    return getattr(importlib.import_module(module), name)(config=c)


def allowed(auth, name, groups=()):
    model = {"name": name, "groups": list(groups), "admin": name in auth.admin_users, "auth_state": {}}
    return asyncio.run(auth.check_allowed(name, model))


def test_defaults_pam_services_scopes_and_roles(tmp_path):
    c = hub_config(tmp_path, {"admin_users": ["alice"], "groups": {"vision": ["bob"]}})
    assert c.JupyterHub.authenticator_class == AUTHENTICATORS["pam"]
    assert c.Authenticator.admin_users == {"alice"}
    assert c.JupyterHub.load_groups == {"vision": {"users": ["bob"]}}
    services = {s["name"]: s for s in c.JupyterHub.services}
    assert set(services) == {"danlu", "mlflow", "danlu-admin"}  # the jobs service runs the idle culler
    assert services["danlu"]["url"] == "http://127.0.0.1:10101"
    assert services["danlu-admin"]["api_token"] == "a" * 64
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert set(CULLER_SCOPES) <= set(roles["danlu-service"]["scopes"])
    assert "custom:danlu:jobs!user" in roles["user"]["scopes"]
    assert roles["danlu-admin"]["users"] == ["alice"]
    assert "custom:danlu:jobs!user" in SERVER_TOKEN_SCOPES
    assert c.Spawner.server_token_scopes == SERVER_TOKEN_SCOPES
    assert c.DanluLocalSpawner.jobs_api_url == "http://127.0.0.1:10101/services/danlu/api/v1"


def test_idle_culler_can_be_turned_off(tmp_path):
    c = hub_config(tmp_path, {"hub": {"idle_timeout_seconds": 0, "gpu_idle_timeout_seconds": 0}})
    assert "idle-culler" not in {s["name"] for s in c.JupyterHub.services}
    service = next(r for r in c.JupyterHub.load_roles if r["name"] == "danlu-service")
    assert "delete:servers" not in service["scopes"]  # a service that culls nothing may stop nothing
    # GPU-aware culling alone (danlu.hub.service.jobs.gpuculling) needs the culler's scopes
    c = hub_config(tmp_path, {"hub": {"idle_timeout_seconds": 0}})
    service = next(r for r in c.JupyterHub.load_roles if r["name"] == "danlu-service")
    assert set(CULLER_SCOPES) <= set(service["scopes"])


def test_github_admits_members_of_allowed_orgs_and_admins(tmp_path):
    c = hub_config(
        tmp_path,
        {
            "admin_users": ["alice"],
            "auth": {
                "type": "github",
                "client_id": "x",
                "client_secret": "y",
                "oauth_callback_url": "https://gpu.example.org/hub/oauth_callback",
                "allowed_organizations": ["lab"],
            },
        },
    )
    auth = authenticator(c)
    assert auth.allowed_organizations == {"lab"} and auth.client_id == "x"


def test_oauth_without_allow_list_admits_only_admins(tmp_path):
    auth = authenticator(hub_config(tmp_path, {"admin_users": ["alice"], "auth": OIDC}))
    assert allowed(auth, "alice") and not allowed(auth, "mallory")


def test_oidc_allowed_groups_manage_groups(tmp_path):
    auth = authenticator(hub_config(tmp_path, {"admin_users": ["alice"], "auth": {**OIDC, "allowed_groups": ["ml"]}}))
    assert auth.manage_groups is True
    assert allowed(auth, "zed", ["ml"]) and not allowed(auth, "yo", ["other"]) and allowed(auth, "alice")


def test_gitlab_and_shared_password(tmp_path):
    gitlab = authenticator(
        hub_config(
            tmp_path,
            {
                "auth": {
                    "type": "gitlab",
                    "client_id": "x",
                    "client_secret": "y",
                    "gitlab_url": "https://gitlab.example.org",
                    "oauth_callback_url": "https://gpu.example.org/hub/oauth_callback",
                    "allowed_gitlab_groups": ["ml"],
                }
            },
        )
    )
    assert gitlab.allowed_gitlab_groups == {"ml"}
    shared = authenticator(
        hub_config(tmp_path, {"auth": {"type": "shared-password", "user_password": "p" * 12, "allowed_users": ["ana"]}})
    )
    assert shared.user_password == "p" * 12 and shared.allowed_users == {"ana"}


def test_groups_and_provider_managed_groups_conflict(tmp_path):
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump({"groups": {"vision": ["bob"]}, "auth": {**OIDC, "manage_groups": True}}))
    with pytest.raises(ConfigError, match="groups cannot be listed"):
        load_settings(path, environ={})


def test_missing_extra_config_file_is_named(tmp_path):
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump({"hub": {"extra_config_file": "nope.py"}}))
    with pytest.raises(ConfigError, match="nope.py does not exist"):
        load_settings(path, environ={"DANLU_BASE_DIR": str(tmp_path)})
