"""How users log in to a cluster deployment (issue 16, fault 5 and deliverable 4).

``danlu render k8s`` refuses a danlu.yaml that would leave the chart's DummyAuthenticator in place
(no ``auth``) or names one that cannot work in a pod, unless it says it is a throwaway trial
(``kubernetes.trial``); OAuth and OIDC render with the client's secret from the ``danlu-secrets``
Secret (``hub.extraEnv``), valid under the chart's values schema; and the hub, configured from the
rendered ConfigMap in the hub pod's environment, sets the authenticator class itself, whose real
OAuthenticator instance reads the secret.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import yaml
from traitlets.config import Config

from danlu.errors import ConfigError
from danlu.hub.k8s import render
from danlu.hub.k8s.hubconfig import configure
from danlu.hub.oidc import DanluOIDCAuthenticator

from .k8shub import SECRETS, deployment, hub_pod_environment, load_example
from .k8sschemas import values_errors, with_chart_defaults

OIDC = {
    "type": "oidc",
    "client_id": "danlu",
    "oauth_callback_url": "https://danlu.example.com/hub/oauth_callback",
    "authorize_url": "https://sso.example.com/auth",
    "token_url": "https://sso.example.com/token",
    "userdata_url": "https://sso.example.com/userinfo",
}


def refusal(tmp_path, **overrides) -> str:
    settings, profiles = load_example("two-flavors", overrides, tmp_path)
    with pytest.raises(ConfigError) as e:
        render.render(settings, profiles)
    return str(e.value)


def test_a_file_without_auth_is_refused_with_the_fix(tmp_path):
    message = refusal(tmp_path, auth=None)
    assert "no auth section" in message and "anyone" in message
    assert "oauth-client-secret" in message and "kubernetes.trial: true" in message


@pytest.mark.parametrize(
    "auth, why",
    [
        ({"type": "pam"}, "no Unix accounts"),
        ({"type": "dummy"}, "anyone log in as anyone"),
        ({"type": "github", "client_id": "x", "client_secret": "s", "oauth_callback_url": "https://h/cb"}, "ConfigMap"),
    ],
)
def test_authenticators_that_cannot_serve_a_cluster_are_refused(tmp_path, auth, why):
    assert why in refusal(tmp_path, auth=auth)


def test_a_trial_with_auth_is_refused(tmp_path):
    settings, _ = load_example("two-flavors")
    kube = {**settings.explicit()["kubernetes"], "trial": True}
    assert "remove kubernetes.trial" in refusal(tmp_path, kubernetes=kube)


def test_oidc_renders_with_its_secret_from_the_secret(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors", {"auth": OIDC}, tmp_path))
    assert dep.values["hub"]["extraEnv"]["OAUTH_CLIENT_SECRET"] == {
        "valueFrom": {"secretKeyRef": {"name": "danlu-secrets", "key": "oauth-client-secret"}}
    }
    assert dep.cluster_yaml["auth"] == OIDC  # no client_secret anywhere
    assert values_errors(with_chart_defaults(dep.values)) == []


def hub(dep, **environ) -> Config:
    c = Config()
    configure(c, dep.config_dir, environ={**hub_pod_environment(dep), **environ})
    return c


def test_the_hub_sets_the_oauthenticator_which_reads_the_secret(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors"))  # the example logs in with OIDC
    hub_env = hub_pod_environment(dep)
    c = hub(dep)
    assert c.JupyterHub.authenticator_class == "danlu.hub.oidc.DanluOIDCAuthenticator"
    with mock.patch.dict(os.environ, hub_env, clear=True):  # the hub process's environment
        authenticator = DanluOIDCAuthenticator(config=c)
        assert authenticator.client_secret == SECRETS["oauth-client-secret"]
    assert authenticator.client_id == dep.cluster_yaml["auth"]["client_id"]
    assert authenticator.token_url == dep.cluster_yaml["auth"]["token_url"]
    assert not authenticator.allow_all


def test_the_hub_does_not_start_without_the_client_secret(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors"))
    with pytest.raises(ConfigError, match="oauth-client-secret key of the danlu-secrets Secret"):
        hub(dep, OAUTH_CLIENT_SECRET="")


def test_the_hub_refuses_a_config_map_without_auth(tmp_path):
    dep = deployment(tmp_path, *load_example("two-flavors"))
    path = dep.config_dir / "danlu.yaml"
    data = yaml.safe_load(path.read_text())
    del data["auth"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="no auth section"):
        hub(dep)


def test_a_trial_says_so_and_sets_the_dummy_authenticator_itself(tmp_path):
    dep = deployment(tmp_path, *load_example("shared-workstation"))  # kubernetes: {trial: true}
    assert dep.cluster_yaml["auth"] == {"type": "dummy"}
    for name, text in dep.files.items():
        assert "THROWAWAY TRIAL" in text, name
    c = hub(dep)
    assert c.JupyterHub.authenticator_class == "jupyterhub.auth.DummyAuthenticator"
