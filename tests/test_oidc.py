"""Login through a real OpenID provider (issue 17, deliverable 6).

The provider is ``oidc-provider`` (an OpenID Certified implementation, ``tests/oidc/provider.mjs``) on
loopback, installed by ``make test`` (``tests/oidc/package-lock.json``). A real ``danlu up`` is configured
with its issuer URL alone (discovery), and logins go through the provider's own authorize endpoint,
login form and consent form, followed with an HTTP client as a browser would, and once in Chromium to a
running JupyterLab (the ui tier). The provider's admin hook changes a user's groups the way an admin of
Keycloak or Azure AD would; the hub must follow within its ``refresh_seconds`` (2 s here) plus the jobs
service's group cache (15 s), and access tokens live 4 s, so their renewal by refresh token is exercised.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
import uuid
from html import unescape
from pathlib import Path
from urllib.parse import urljoin

import pytest
import requests
import yaml

from danlu.errors import ConfigError
from danlu.hub.oidc import discover
from danlu.hub.testing import Workbench, free_port

from .conftest import cannot_run
from .test_hubconfig import authenticator, hub_config

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[1]
OIDC = ROOT / "tests" / "oidc"
CHROMIUM = os.environ.get("DANLU_UI_CHROMIUM", "/usr/bin/chromium")
SECRET = "oidc-client-secret-" + uuid.uuid4().hex
ACCESS_TTL = 4  # seconds: the tests see access tokens expire and be renewed
REFRESH = 2  # auth.refresh_seconds
GROUP_CACHE = 15  # the jobs service's cache of a user's groups (danlu.hub.service.auth.GroupDirectory)

USERS = {
    "carol": {"password": "carol-pw", "groups": ["danlu-users", "vision"]},
    "dora": {"password": "dora-pw", "groups": ["ml-admins"]},
    "erin": {"password": "erin-pw", "groups": ["danlu-users"]},
    "frank": {"password": "frank-pw", "groups": ["danlu-users", "vision"]},
    "mallory": {"password": "mallory-pw", "groups": ["guests"]},
}
PROFILES = {
    "profiles": [
        {"slug": "python", "display_name": "Python", "default": True, "environment": {"current": True}},
        {
            "slug": "gpu-vision",
            "display_name": "Vision GPUs",
            "environment": {"current": True},
            "resources": {"gpus": [0, 1]},
            "groups": ["vision"],
        },
    ]
}


def node_missing() -> str | None:
    if shutil.which("node") is None:
        return "node (Node.js) is not on PATH"
    if not (OIDC / "node_modules" / "oidc-provider").exists():
        return f"{OIDC / 'node_modules'} is missing (make test installs it: npm ci --prefix tests/oidc)"
    return None


class Provider:
    """``tests/oidc/provider.mjs`` as a process, and its admin hook."""

    def __init__(self, tmp: Path, redirect_uri: str):
        self.port = free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.admin_token = uuid.uuid4().hex
        self.log = tmp / "oidc-provider.log"
        env = {
            **os.environ,
            "OIDC_PORT": str(self.port),
            "OIDC_CLIENTS": json.dumps(
                [{"client_id": "danlu", "client_secret": SECRET, "redirect_uris": [redirect_uri]}]
            ),
            "OIDC_USERS": json.dumps(USERS),
            "OIDC_ACCESS_TTL": str(ACCESS_TTL),
            "OIDC_ADMIN_TOKEN": self.admin_token,
        }
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["node", str(OIDC / "provider.mjs")], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 30
        while "listening" not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def set_groups(self, user: str, groups: list[str]) -> None:
        r = requests.put(
            f"{self.issuer}/admin/users/{user}",
            json={"groups": groups},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text

    def grants(self) -> dict:
        r = requests.get(
            f"{self.issuer}/admin/grants", headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=10
        )
        return r.json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    reason = node_missing()
    if reason:
        cannot_run("oidc", reason)
    tmp = tmp_path_factory.mktemp("oidc")
    wb = Workbench(tmp / "wb", profiles=PROFILES)  # its port, for the client's redirect URI
    p = Provider(tmp, f"{wb.url}/hub/oauth_callback")
    p.workbench = wb
    yield p
    p.stop()


@pytest.fixture(scope="module")
def hub(provider):
    wb = provider.workbench
    config = yaml.safe_load(wb.config_file.read_text())
    config.update(
        {
            "auth": {
                "type": "oidc",
                "issuer": provider.issuer,
                "client_id": "danlu",
                "client_secret": SECRET,
                "oauth_callback_url": f"{wb.url}/hub/oauth_callback",
                "allowed_groups": ["danlu-users"],
                "admin_groups": ["ml-admins"],
                "refresh_seconds": REFRESH,
            },
            "gpus": {"declared": [{"count": 2, "flavor": "sim"}]},
            "resources": {"cpu": 16},
            "teams": {"vision": {"quota": {"gpus": {"sim": 2}}}},
        }
    )
    wb.config_file.write_text(yaml.safe_dump(config))
    wb.start()
    yield wb
    wb.stop()


FORM = re.compile(r'<form[^>]*action="([^"]+)"[^>]*>(.*?)</form>', re.S)


def login(wb: Workbench, user: str, password: str) -> tuple[requests.Session, requests.Response]:
    """Log in as a browser would: the hub's OAuth login, the provider's login form, its consent form."""
    s = requests.Session()
    r = s.get(f"{wb.url}/hub/oauth_login", params={"next": "/hub/home"}, timeout=30)
    for fields in ({"login": user, "password": password}, {}):  # the login page, then the consent page
        assert r.status_code == 200 and "<form" in r.text, (r.status_code, r.url, r.text[:500])
        action, _ = FORM.search(r.text).groups()
        r = s.post(urljoin(r.url, unescape(action)), data=fields, timeout=60)
    return s, r


def hub_user(wb: Workbench, name: str) -> dict:
    return wb.hub("GET", f"/users/{name}").json()


def within(seconds: float, check, what: str):
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:.0f}s"
        time.sleep(0.5)


def user_token(wb: Workbench, name: str) -> str:
    r = wb.hub("POST", f"/users/{name}/tokens", json={"note": "tests"})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def team_of(wb: Workbench, token: str) -> str | None:
    """The queue a job of this user would go to (a dry run), or None when they are in no team."""
    notebook = {
        "cells": [
            {"cell_type": "code", "id": "c", "metadata": {}, "outputs": [], "execution_count": None, "source": "1"}
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    r = wb.api("POST", "/jobs", token=token, json={"notebook": notebook, "dry_run": True})
    return r.json().get("queue") if r.status_code == 200 else None


def profiles_of(wb: Workbench, token: str) -> set[str]:
    return {p["slug"] for p in wb.api("GET", "/profiles", token=token).json()["profiles"]}


# discovery and configuration --------------------------------------------------------------------------------


def test_discovery_gives_the_endpoints_from_the_issuer_alone(provider, tmp_path):
    found = discover(provider.issuer)
    assert found == {
        "authorize_url": f"{provider.issuer}/auth",
        "token_url": f"{provider.issuer}/token",
        "userdata_url": f"{provider.issuer}/me",
        "basic_auth": False,  # the provider takes the secret in the form body (client_secret_post)
    }
    auth = authenticator(
        hub_config(
            tmp_path,
            {
                "auth": {
                    "type": "oidc",
                    "issuer": provider.issuer,
                    "client_id": "danlu",
                    "client_secret": SECRET,
                    "oauth_callback_url": "https://gpu.example.org/hub/oauth_callback",
                    "admin_groups": ["ml-admins"],
                }
            },
        )
    )
    assert (auth.authorize_url, auth.token_url, auth.userdata_url) == (
        found["authorize_url"],
        found["token_url"],
        found["userdata_url"],
    )
    assert auth.manage_groups and auth.enable_auth_state and auth.admin_groups == {"ml-admins"}


def test_a_wrong_issuer_stops_the_hub_with_the_fix(provider):
    with pytest.raises(ConfigError, match="names the issuer"):  # another name for the same server is not it
        discover(provider.issuer.replace("127.0.0.1", "localhost"))
    with pytest.raises(ConfigError, match="cannot read the provider's OpenID configuration") as e:
        discover(f"http://127.0.0.1:{free_port()}/realms/lab")
    assert "auth.issuer" in e.value.fix


def test_groups_from_the_provider_need_no_danlu_groups_and_keep_a_crypt_key(tmp_path):
    auth = {
        "type": "oidc",
        "client_id": "danlu",
        "client_secret": "s",
        "oauth_callback_url": "https://gpu.example.org/hub/oauth_callback",
        "authorize_url": "https://sso.example.org/auth",
        "token_url": "https://sso.example.org/token",
        "userdata_url": "https://sso.example.org/userinfo",
        "groups_claim": "realm_access.roles",
        "admin_groups": ["ml-admins"],
        "refresh_seconds": 45,
    }
    c = hub_config(tmp_path, {"auth": auth})
    a = authenticator(c)
    assert a.auth_state_groups_key == "oauth_user.realm_access.roles"
    assert a.refresh_seconds == 45 and a.auth_refresh_age == 45 and a.refresh_pre_spawn
    assert not a.allow_existing_users  # a user once admitted by a group is not admitted for ever
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert roles["danlu-admin"]["groups"] == ["ml-admins"]  # Danlu's admin scope follows the group
    key = tmp_path / "state" / "jupyterhub_crypt_key"
    assert c.CryptKeeper["keys"] == [key.read_text()] and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert hub_config(tmp_path, {"auth": auth}).CryptKeeper["keys"] == c.CryptKeeper["keys"]  # kept, not remade


# logins through the provider ---------------------------------------------------------------------------------


def test_login_maps_the_groups_to_hub_groups_a_team_and_profiles(hub, provider):
    _, r = login(hub, "carol", "carol-pw")
    assert r.status_code == 200 and r.url == f"{hub.url}/hub/home", (r.url, r.text[:300])
    model = hub_user(hub, "carol")
    assert sorted(model["groups"]) == ["danlu-users", "vision"] and not model["admin"]
    token = user_token(hub, "carol")
    assert team_of(hub, token) == "vision"
    assert profiles_of(hub, token) == {"python", "gpu-vision"}


def test_the_admin_group_makes_an_admin_of_hub_and_danlu(hub, provider):
    login(hub, "dora", "dora-pw")  # not in the allowed group: admins may always log in
    assert hub_user(hub, "dora")["admin"] is True
    token = user_token(hub, "dora")
    assert hub.api("GET", "/audit", token=token).status_code == 200  # custom:danlu:admin, from the group's role


def test_a_user_outside_the_allowed_groups_is_refused(hub, provider):
    _, r = login(hub, "mallory", "mallory-pw")
    assert r.status_code == 403, (r.status_code, r.url)
    assert hub.hub("GET", "/users/mallory").status_code == 404


def test_removal_at_the_provider_takes_rights_away(hub, provider):
    login(hub, "frank", "frank-pw")
    token = user_token(hub, "frank")
    assert team_of(hub, token) == "vision"
    provider.set_groups("frank", ["danlu-users"])  # an admin of the provider takes frank out of vision
    within(REFRESH + 5, lambda: hub_user(hub, "frank")["groups"] == ["danlu-users"], "the hub group's removal")
    within(GROUP_CACHE + 5, lambda: team_of(hub, token) is None, "the team's removal")
    assert profiles_of(hub, token) == {"python"}

    provider.set_groups("dora", [])  # and dora out of the admins
    within(REFRESH + 5, lambda: hub_user(hub, "dora")["admin"] is False, "the admin's removal")
    roles = hub.hub("GET", "/users/dora").json()["roles"]
    assert "admin" not in roles


def test_an_expired_access_token_is_renewed_by_the_refresh_token(hub, provider):
    session, _ = login(hub, "erin", "erin-pw")
    first = hub.hub("GET", "/users/erin").json()["auth_state"]["access_token"]
    before = provider.grants().get("refresh_token", 0)
    time.sleep(ACCESS_TTL + REFRESH + 1)
    state = within(10, lambda: (s := hub_user(hub, "erin")["auth_state"])["access_token"] != first and s, "renewal")
    assert state["refresh_token"] and provider.grants().get("refresh_token", 0) > before
    # her browser session goes on without a new login
    r = session.get(f"{hub.url}/hub/home", timeout=30)
    assert r.status_code == 200 and r.url == f"{hub.url}/hub/home"


# in a browser ------------------------------------------------------------------------------------------------


def test_login_in_a_browser_through_the_provider_to_jupyterlab(hub, provider, tmp_path):
    if not Path(CHROMIUM).exists():
        cannot_run("ui", f"{CHROMIUM} is missing (apt-get install chromium; .ci/run installs it)")
    provider.set_groups("frank", ["danlu-users", "vision"])
    done = subprocess.run(
        ["node", str(OIDC / "browser-login.mjs")],
        env={
            **os.environ,
            "HUB_URL": hub.url,
            "USER_NAME": "frank",
            "PASSWORD": "frank-pw",
            "CHROMIUM": CHROMIUM,
            "SCREENSHOT": str(tmp_path / "lab.png"),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n--- workbench log:\n{hub.log_tail(60)}"
    assert "/user/frank/lab" in done.stdout
