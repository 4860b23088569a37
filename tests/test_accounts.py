"""Unix accounts: dropping privileges, and the workbench with servers and jobs as real accounts."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from danlu.errors import PolicyError
from danlu.hub import accounts

ROOT = os.geteuid() == 0


def test_lookup_refuses_missing_and_root_accounts():
    with pytest.raises(PolicyError) as missing:
        accounts.lookup("no-such-user-danlu")
    assert missing.value.reason == "no_unix_account" and "useradd -m no-such-user-danlu" in str(missing.value)
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
    out = subprocess.run(["id", "-u"], preexec_fn=accounts.demote(account), capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(nobody.pw_uid)
    path = tmp_path / "handed"
    path.write_text("x")
    accounts.give(path, account, 0o600)
    st = path.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (nobody.pw_uid, 0o600)


def _can_run_as_others() -> bool:
    return ROOT and shutil.which("useradd") is not None and accounts.runnable_by_others()


@pytest.mark.service
@pytest.mark.skipif(not _can_run_as_others(),
                    reason="needs root, useradd, and a Danlu installation other accounts can run "
                           f"({sys.executable} is not reachable by them here)")
def test_servers_and_jobs_run_as_each_users_account():
    from danlu.hub.testing import Workbench

    from .conftest import PROFILES
    from .test_resilience import notebook

    users = ["danlutest-a", "danlutest-b"]
    for user in users:
        subprocess.run(["useradd", "-m", user], check=False, capture_output=True)
    # pytest's own temp folders are private to root; the users' processes must reach the state dir
    tmp = tempfile.mkdtemp(prefix="danlu-accounts-", dir="/tmp")
    os.chmod(tmp, 0o711)
    wb = Workbench(tmp, config={"users": {"unix_accounts": "on"}}, profiles=PROFILES).start()
    try:
        a, b = (wb.create_user(u) for u in users)
        assert wb.start_server(users[0], {"profile": "python"}).status_code in (201, 202)
        job = wb.api("POST", "/jobs", token=a, json={"notebook": notebook(
            "import os, time; print('uid', os.getuid()); time.sleep(3)")}).json()
        time.sleep(1)
        done = wb.wait_job(job["id"], a)
        assert done["state"] == "succeeded", wb.api("GET", f"/jobs/{job['id']}/logs", token=a).text
        uid = pwd.getpwnam(users[0]).pw_uid
        assert f"uid {uid}" in wb.api("GET", f"/jobs/{job['id']}/logs", token=a).text
        jobdir = wb.state / "jobs" / job["id"]
        st = jobdir.stat()
        assert st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700
        peek = subprocess.run(["su", users[1], "-s", "/bin/sh", "-c", f"cat {jobdir}/job.log"],
                              capture_output=True, text=True)
        assert peek.returncode != 0
        refused = wb.api("POST", "/jobs", token=wb.create_user("nobody-here"), json={"notebook": notebook("1")})
        assert refused.status_code == 403 and refused.json()["reason"] == "no_unix_account"
        assert b
    finally:
        wb.stop()
        for user in users:
            subprocess.run(["userdel", "-r", user], check=False, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("auth, euid, warns", [
    ({"type": "pam"}, 1000, None),  # PAM without root: only the account running danlu up can log in
    ({"type": "dummy"}, 1000, "any user can read and change every other user's files"),
    ({"type": "shared-password", "user_password": "x" * 8}, 1000, "any user can read and change"),
    ({"type": "pam"}, 0, "every user's code runs as root"),
])
def test_the_banner_says_who_can_do_what(monkeypatch, tmp_path, auth, euid, warns):
    from danlu.hub.app import DanluUp
    from danlu.hub.config import Settings

    monkeypatch.setattr(os, "geteuid", lambda: euid)
    settings = Settings(data={"auth": auth, "users": {"unix_accounts": "off"}, "state_dir": str(tmp_path)})
    lines = DanluUp.isolation(settings)
    assert lines[0].startswith("servers and jobs run as ")
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert (warnings and warns in warnings[0]) if warns else not warnings
    on = Settings(data={"users": {"unix_accounts": "on"}})
    assert DanluUp.isolation(on) == ["servers and jobs run as each user's Unix account: the file system keeps "
                                     "users apart (docs/security.md)"]
