"""The unix-accounts tier: ``users.unix_accounts: on`` with real accounts, as an attacker would meet it.

Needs root, ``useradd``, and a Danlu installation that every account can run,
whose Python :data:`danlu.env.TEST_UNIX_PYTHON` names (``make unix-env`` builds
one in ``/opt/danlu-unix``) and which holds this checkout's code. Without them
the tier skips, saying why; with :data:`danlu.env.TEST_REQUIRE` naming ``unix`` (CI
sets both) it fails instead, so the mode meant to keep users apart is never
silently left untested.

One workbench per module: the fixtures create the accounts ``danlu-alice`` and
``danlu-bob`` (removed again afterwards), start ``danlu up`` as root on the
installation's Python with its state dir under ``/tmp`` (mode 0711, so the
accounts can reach it), and give alice a job that has written a secret into
her home, her job log and her output notebook and is still running.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from danlu import env
from danlu.hub import accounts
from danlu.hub.testing import RemoteKernel, Workbench, run_as

from ..conftest import CONFIG, PROFILES, cannot_run

ROOT = Path(__file__).resolve().parents[2]  # the checkout the tests run from

ALICE, BOB = "danlu-alice", "danlu-bob"

#: where each part of the package comes from in the checkout (pyproject.toml's package-dir)
PACKAGE_DIRS = {"": "magics", "hub": "hub", "lab": "extensions/server"}


def _stale_files(python: str) -> list[str]:
    """Source files whose copy in ``python``'s Danlu differs from this checkout (make unix-env reinstalls)."""
    found = subprocess.run(
        [python, "-c", "import danlu, os; print(os.path.dirname(danlu.__file__))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if found.returncode != 0:
        return [f"(no danlu importable: {found.stderr.strip()[-300:]})"]
    installed = Path(found.stdout.strip())
    stale = []
    for sub, src in PACKAGE_DIRS.items():
        for path in sorted((ROOT / src).rglob("*")):
            if path.suffix not in (".py", ".yaml") or "__pycache__" in path.parts or "labextension" in path.parts:
                continue
            copy = installed / sub / path.relative_to(ROOT / src)
            if not copy.is_file() or copy.read_bytes() != path.read_bytes():
                stale.append(str(path.relative_to(ROOT)))
    return stale


def unusable() -> str | None:
    """Why this tier cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (it creates accounts and runs danlu up as root)"
    if not (shutil.which("useradd") and shutil.which("userdel")):
        return "needs useradd and userdel"
    python = env.TEST_UNIX_PYTHON.get()
    if not python:
        return f"{env.TEST_UNIX_PYTHON} is not set (make unix-env builds /opt/danlu-unix; .ci/run sets it)"
    if not (os.access(python, os.X_OK) and accounts.runnable_by_others(python)):
        return f"{env.TEST_UNIX_PYTHON}={python}: other accounts cannot run it"
    stale = _stale_files(python)
    if stale:
        return (
            f"{env.TEST_UNIX_PYTHON}={python} holds another version of Danlu than this checkout "
            f"({', '.join(stale[:5])}{' …' if len(stale) > 5 else ''}): run make unix-env"
        )
    return None


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    home: Path


def _remove_account(name: str) -> None:
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for proc in psutil.process_iter():  # userdel refuses while the account has processes
        try:
            if proc.uids().real == uid:
                proc.kill()
        except psutil.Error:
            continue
    subprocess.run(["userdel", "-r", name], capture_output=True)


@pytest.fixture(scope="module")
def unix_python() -> str:
    why = unusable()
    if why:
        cannot_run("unix", why)
    return env.TEST_UNIX_PYTHON.get()


@pytest.fixture(scope="module")
def users(unix_python) -> dict[str, Account]:
    made = {}
    try:
        for name in (ALICE, BOB):
            _remove_account(name)  # left by an interrupted run
            # as the admin guide says: a home only its owner can enter
            subprocess.run(["useradd", "-m", "-K", "HOME_MODE=0700", name], check=True, capture_output=True)
            entry = pwd.getpwnam(name)
            made[name] = Account(name, entry.pw_uid, Path(entry.pw_dir))
        check = run_as(BOB, [unix_python, "-c", "import danlu.hub.app"])
        assert check.returncode == 0, f"{BOB} cannot run {unix_python}: {check.stderr[-1000:]}"
        yield made
    finally:
        for name in (ALICE, BOB):
            _remove_account(name)


def notebook(*sources: str) -> dict:
    return {
        "cells": [
            {
                "cell_type": "code",
                "id": f"c{i}",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "source": source,
            }
            for i, source in enumerate(sources)
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


@pytest.fixture(scope="module")
def wb(unix_python, users):
    # pytest's temp folders are root's alone; the accounts' processes must reach the state dir
    tmp = Path(tempfile.mkdtemp(prefix="danlu-unix-", dir="/tmp"))
    os.chmod(tmp, 0o711)
    config = {
        **CONFIG,
        "users": {"unix_accounts": "on"},
        "auth": {"type": "pam"},  # the login that proves the account (danlu up refuses dummy with Unix accounts)
        "admin_users": [],
        "groups": {},
        "jobs": {**CONFIG["jobs"], "retry_backoff_seconds": 1},
    }
    wb = Workbench(tmp, config=config, profiles=PROFILES, python=unix_python)
    try:
        wb.start()
        wb.users = users
        wb.tokens = {name: wb.create_user(name) for name in users}
        yield wb
    finally:
        code = wb.stop()
        leftovers = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in wb.processes()] if hasattr(wb, "info") else []
        shutil.rmtree(tmp, ignore_errors=True)
    assert not leftovers, f"processes left after danlu up stopped: {leftovers}"
    assert code == 0, wb.log_tail()


SECRET = f"alice-secret-{uuid.uuid4().hex}"


@dataclass
class AliceJob:
    id: str
    dir: Path
    run_id: str | None
    secret: str


@pytest.fixture(scope="module")
def alice_job(wb) -> AliceJob:
    """A job of alice's that has put SECRET in her home, its log and its output, and runs on (sleeping)."""
    token = wb.tokens[ALICE]
    first = (
        f"import os, pathlib\nsecret = {SECRET!r}\n"
        "pathlib.Path(os.path.expanduser('~/secret.txt')).write_text(secret)\n"
        "print('uid', os.getuid(), secret)\n"
    )
    r = wb.api(
        "POST",
        "/jobs",
        token=token,
        json={"notebook": notebook(first, "import time\ntime.sleep(3600)"), "name": "alices-secret", "retries": 0},
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    jobdir = wb.state / "jobs" / job_id
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        job = wb.api("GET", f"/jobs/{job_id}", token=token).json()
        assert job["state"] in ("queued", "running"), job
        output = jobdir / "output.ipynb"
        if (
            output.exists()
            and SECRET in output.read_text(errors="replace")
            and f"uid {wb.users[ALICE].uid} {SECRET}" in (jobdir / "job.log").read_text(errors="replace")
        ):
            return AliceJob(job_id, jobdir, job.get("mlflow_run_id"), SECRET)
        time.sleep(0.5)
    raise AssertionError(
        f"alice's job did not write her secret:\n{wb.api('GET', f'/jobs/{job_id}/logs', token=token).text[-3000:]}"
    )


@pytest.fixture(scope="module")
def bob_kernel(wb) -> RemoteKernel:
    """A kernel in bob's own server."""
    r = wb.start_server(BOB, {"profile": "python"})
    assert r.status_code in (201, 202), r.text
    return RemoteKernel(wb, BOB, wb.tokens[BOB])


#: what every job of bob's starts with: ``jd`` is its own job folder
JOB_PRELUDE = f"import os\njd = os.environ[{str(env.JOB_DIR)!r}]\n"


def bob_job(wb, source: str, *, wait: bool = True, **body) -> dict:
    """Submit a one-cell job as bob (``jd``: its folder); with ``wait``, return it once ended, its log as ``log``.

    No retries unless asked: a retry starts with the service touching the job's folder, where bob's links are.
    """
    token = wb.tokens[BOB]
    r = wb.api("POST", "/jobs", token=token, json={"notebook": notebook(JOB_PRELUDE + source), "retries": 0, **body})
    assert r.status_code == 201, r.text
    job = r.json()
    if wait:
        job = wb.wait_job(job["id"], token, timeout=240)
        job["log"] = wb.api("GET", f"/jobs/{job['id']}/logs", token=token).text
    return job


def result_of(log: str) -> dict:
    """What a probing job printed as ``RESULT {json}``."""
    lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the job printed no RESULT line:\n{log[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


#: prepended to probing jobs: attempt(name, fn) records how each try ended, report() prints them
PROBE = """
import json, os
results = {}
def attempt(name, fn):
    try:
        fn()
        results[name] = "allowed"
    except PermissionError:
        results[name] = "PermissionError"
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
def report():
    print("RESULT " + json.dumps(results), flush=True)
"""


def refused(results: dict) -> dict:
    """The tries that were not refused with PermissionError (expected: none)."""
    return {k: v for k, v in results.items() if v != "PermissionError"}


def mode_of(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, stat.S_IMODE(st.st_mode)


def canary(wb, name: str) -> Path:
    """A root-owned file (mode 0600) that bob's links point at: the service must never write, chown or chmod it."""
    path = wb.tmp / f"canary-{name}"
    path.write_text(f"canary {name}\n")
    os.chmod(path, 0o600)
    return path


def canary_changes(paths: list[Path]) -> dict[str, str]:
    """How each canary differs from a fresh one (owner, mode, links, content); empty when none changed."""
    changes = {}
    for path in paths:
        st = path.stat()
        seen = {
            "uid": st.st_uid,
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "links": st.st_nlink,
            "content": path.read_text(errors="replace"),
        }
        fresh = {"uid": 0, "mode": oct(0o600), "links": 1, "content": f"{path.name.replace('-', ' ', 1)}\n"}
        if seen != fresh:
            changes[path.name] = ", ".join(f"{k} {v!r:.70}" for k, v in seen.items() if v != fresh[k])
    return changes


#: code for a job's kernel: SIGKILL the job runner it runs under, so the attempt ends as an infrastructure failure
KILL_MY_RUNNER = """
import os, signal, psutil
runner = next(p for p in psutil.Process().parents() if "danlu.runner" in " ".join(p.cmdline()))
os.kill(runner.pid, signal.SIGKILL)
os._exit(0)
"""


def wait_for(wb, job_id: str, path: Path, timeout: float = 180, ask: bool = True) -> None:
    """Wait until bob's running job has made ``path`` (its signal that it is ready).

    ``ask=False``: watch only the file system, for a job whose folder the API may block on.
    """
    token = wb.tokens[BOB]
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not ask:
            ended = (path.parent / "status.json").exists()
            assert not ended and time.monotonic() < deadline, f"job {job_id} made no {path.name}"
            time.sleep(0.3)
            continue
        job = wb.api("GET", f"/jobs/{job_id}", token=token).json()
        if job["state"] not in ("queued", "running") or time.monotonic() > deadline:
            try:
                log = wb.api("GET", f"/jobs/{job_id}/logs", token=token, timeout=10).text[-3000:]
            except OSError as e:
                log = f"(no log: {e})"
            raise AssertionError(f"job {job_id} is {job['state']} ({job['reason']}) and made no {path.name}:\n{log}")
        time.sleep(0.3)
