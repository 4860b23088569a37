"""Unix accounts map only hub users who proved the account, and only to users' accounts.

As a hostile user would try it: log in (or be created) under the name of a system account
(``daemon``, one made with ``useradd -r``) to run as it; or start a workbench with Unix accounts
and a login that proves nothing (the dummy login, a shared password, OAuth with no claim naming
the account), so that anyone may name any account. The first is refused where the account is
looked up (the spawner and the jobs service alike); the second when ``danlu up`` starts.

Needs root and ``useradd`` (not the tier's installed Danlu: nothing here runs as the accounts).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from danlu.errors import PolicyError
from danlu.hub import accounts
from danlu.hub.config import load_settings
from danlu.hub.spawner import DanluLocalSpawner

from ..conftest import cannot_run

SYSTEM, ORDINARY = "danlu-sysacct", "danlu-carol"


def _userdel(name: str) -> None:
    subprocess.run(["userdel", "-r", name], capture_output=True)


@pytest.fixture(scope="module")
def made():
    if os.geteuid() != 0:
        cannot_run("unix", "needs root (it creates accounts)")
    if not (shutil.which("useradd") and shutil.which("userdel")):
        cannot_run("unix", "needs useradd and userdel")
    for name in (SYSTEM, ORDINARY):
        _userdel(name)
    subprocess.run(["useradd", "-r", "-M", SYSTEM], check=True, capture_output=True)
    subprocess.run(["useradd", "-M", ORDINARY], check=True, capture_output=True)
    try:
        yield {name: pwd.getpwnam(name) for name in (SYSTEM, ORDINARY)}
    finally:
        for name in (SYSTEM, ORDINARY):
            _userdel(name)


def settings_for(tmp_path: Path, **config):
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump({"users": {"unix_accounts": "on"}, **config}))
    return load_settings(str(path), {"state_dir": str(tmp_path / "state")})


def test_a_hub_user_named_after_a_system_account_never_runs_as_it(made, tmp_path):
    settings = settings_for(tmp_path)
    low, _ = settings.uid_range
    assert made[SYSTEM].pw_uid < low <= made[ORDINARY].pw_uid

    for name in [SYSTEM] + [n for n in ("daemon", "bin", "nobody") if _exists(n)]:
        with pytest.raises(PolicyError) as e:  # the jobs service: a job of the hub user 'daemon'
            settings.account(name)
        assert e.value.reason == "system_account" and "users.uid_min" in e.value.fix
        spawner = DanluLocalSpawner(unix_accounts=True, uid_range=settings.uid_range)
        spawner.user = SimpleNamespace(name=name)
        with pytest.raises(PolicyError):  # the hub: a server of the hub user 'daemon'
            spawner.account  # noqa: B018
    assert settings.account(ORDINARY).uid == made[ORDINARY].pw_uid


def test_the_uid_range_is_the_admins_to_set(made, tmp_path):
    uid = made[SYSTEM].pw_uid
    settings = settings_for(tmp_path, users={"unix_accounts": "on", "uid_min": uid, "uid_max": uid})

    assert settings.account(SYSTEM).uid == uid
    with pytest.raises(PolicyError, match=r"outside the UIDs of users' accounts"):
        settings.account(ORDINARY)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


OAUTH = {"client_id": "danlu", "client_secret": "s", "oauth_callback_url": "http://127.0.0.1/hub/oauth_callback"}
OIDC = {
    "type": "oidc",
    **OAUTH,
    "authorize_url": "http://127.0.0.1:1/auth",
    "token_url": "http://127.0.0.1:1/token",
    "userdata_url": "http://127.0.0.1:1/me",
}


@pytest.mark.parametrize(
    "auth, what",
    [
        ({"type": "dummy"}, "the dummy login, which proves no account"),
        ({"type": "shared-password", "user_password": "workshop-password"}, "the shared-password login"),
        (OIDC, "the oidc login, but nothing says which of its claims is the Unix account"),
        ({"type": "github", **OAUTH}, "the github login, but nothing says which"),
    ],
)
def test_danlu_up_refuses_unix_accounts_with_a_login_that_proves_no_account(made, tmp_path, auth, what):
    config = tmp_path / "danlu.yaml"
    config.write_text(yaml.safe_dump({"users": {"unix_accounts": "on"}, "auth": auth}))

    up = subprocess.run(
        [sys.executable, "-m", "danlu.hub", "up", "--config", str(config), "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert up.returncode == 2, up.stdout + up.stderr
    assert f"users.unix_accounts is on with {what}" in up.stderr
    assert "Traceback" not in up.stderr
    assert "users.unix_accounts: off" in up.stderr  # the fix is named
    assert not (tmp_path / "state" / "danlu.sqlite").exists()  # refused before anything started


def test_pam_and_oidc_with_an_account_claim_prove_the_account(made, tmp_path):
    settings_for(tmp_path).check_unix_login()  # pam, the default
    settings = settings_for(tmp_path, auth=OIDC, users={"unix_accounts": "on", "account_claim": "uid"})
    settings.check_unix_login()
    accounts.check_login("oidc", "uid", "danlu.yaml")
