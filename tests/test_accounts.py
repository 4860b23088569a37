"""Unix accounts: looking them up and dropping privileges (the workbench as real accounts is tests/unix/)."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess

import pytest

from danlu.errors import PolicyError
from danlu.hub import accounts

ROOT = os.geteuid() == 0


def test_lookup_refuses_missing_and_root_accounts():
    with pytest.raises(PolicyError) as missing:
        accounts.lookup("no-such-user-danlu")
    assert missing.value.reason == "no_unix_account"
    assert "useradd -m -K HOME_MODE=0700 no-such-user-danlu" in str(missing.value)
    with pytest.raises(PolicyError) as root:
        accounts.lookup("root")
    assert root.value.reason == "root_account"


def test_modes():
    assert accounts.enabled("on") is True
    assert accounts.enabled("off") is False
    assert accounts.enabled("auto") == (ROOT and accounts.runnable_by_others())


@pytest.mark.skipif(not ROOT, reason="dropping privileges needs root")
def test_demote_runs_a_child_as_the_account(tmp_path):
    nobody = pwd.getpwnam("nobody")
    account = accounts.Account("nobody", nobody.pw_uid, nobody.pw_gid, "/nonexistent")
    out = subprocess.run(
        ["id", "-u"], preexec_fn=accounts.demote(account), capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == str(nobody.pw_uid)
    path = tmp_path / "handed"
    path.write_text("x")
    accounts.give(path, account, 0o600)
    st = path.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, 0o600)


@pytest.mark.parametrize(
    "auth, euid, warns",
    [
        ({"type": "pam"}, 1000, None),  # PAM without root: only the account running danlu up can log in
        ({"type": "dummy"}, 1000, "any user can read and change every other user's files"),
        ({"type": "shared-password", "user_password": "x" * 8}, 1000, "any user can read and change"),
        ({"type": "pam"}, 0, "every user's code runs as root"),
    ],
)
def test_the_banner_says_who_can_do_what(monkeypatch, tmp_path, auth, euid, warns):
    from danlu.hub.app import DanluUp
    from danlu.hub.config import Settings

    monkeypatch.setattr(os, "geteuid", lambda: euid)
    settings = Settings.from_data({"auth": auth, "users": {"unix_accounts": "off"}, "state_dir": str(tmp_path)})
    lines = DanluUp.isolation(settings)
    assert lines[0].startswith("servers and jobs run as ")
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert (warnings and warns in warnings[0]) if warns else not warnings
    on = Settings.from_data({"users": {"unix_accounts": "on"}})
    assert DanluUp.isolation(on) == [
        "servers and jobs run as each user's Unix account: the file system keeps users apart (docs/security.md)"
    ]
