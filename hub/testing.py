"""Drive a real ``danlu up`` through its public interfaces (tests, benchmarks, the demo).

:class:`Workbench` starts ``danlu up`` on a free port with its own state dir and
talks to it the way users and admins do: the hub REST API (with the admin
token), the jobs service API and MLflow through the proxy. The workbench may run
on another Python than the tests (``python=``: a Danlu installation every account
can run, for ``users.unix_accounts: on``); :func:`run_as` runs a command as one
of those accounts. :class:`RemoteKernel`
executes code on a kernel of a user's server over the Jupyter websocket
protocol, as JupyterLab does. Shipped in the package, like
``jupyterhub.tests.mocking``, so the tests, ``benchmarks/`` and ``make demo``
share one harness.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import requests
import yaml
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from danlu import env as names

#: One profile running on the workbench's own Python: what a benchmark's workbench needs, and nothing to build
CURRENT_PYTHON_PROFILES = {
    "profiles": [
        {
            "slug": "python",
            "display_name": "Python (workbench environment)",
            "default": True,
            "environment": {"current": True},
        }
    ]
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as(user: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command as a Unix account (needs root), in its home, with its groups; output captured as text."""
    entry = pwd.getpwnam(user)
    env = {
        "HOME": entry.pw_dir,
        "USER": user,
        "LOGNAME": user,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        **kwargs.pop("env", {}),
    }
    return subprocess.run(
        argv,
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=os.getgrouplist(user, entry.pw_gid),
        env=env,
        cwd=kwargs.pop("cwd", entry.pw_dir),
        capture_output=True,
        text=True,
        timeout=kwargs.pop("timeout", 120),
        **kwargs,
    )


class Workbench:
    def __init__(
        self,
        tmp: Path,
        config: dict | None = None,
        profiles: dict | None = None,
        extra_env: dict | None = None,
        python: str | None = None,
    ):
        """``python``: the interpreter that runs ``danlu up`` (default: this one); the tests stay here.
        ``profiles``: the profiles file's content (default :data:`CURRENT_PYTHON_PROFILES`), unless ``config``
        names a ``profiles_file``. Nothing is read from a source checkout: the harness works from an installed
        Danlu as well."""
        self.tmp = Path(tmp)
        self.python = python or sys.executable
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.state = self.tmp / "state"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = uuid.uuid4().hex + uuid.uuid4().hex
        config = dict(config or {})
        config.setdefault("auth", {"type": "dummy"})
        config.setdefault("users", {"unix_accounts": "off"})  # test users have no Unix accounts
        config.setdefault("hub", {"idle_timeout_seconds": 0})
        if profiles is not None or "profiles_file" not in config:
            (self.tmp / "profiles.yaml").write_text(
                yaml.safe_dump(CURRENT_PYTHON_PROFILES if profiles is None else profiles)
            )
            config["profiles_file"] = str(self.tmp / "profiles.yaml")
        self.config_file = self.tmp / "danlu.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = self.tmp / "danlu-up.log"

    # life -----------------------------------------------------------------------
    def start(self, timeout: float = 240) -> "Workbench":
        env = {**os.environ, names.ADMIN_TOKEN: self.admin_token, "PYTHONUNBUFFERED": "1", **self.extra_env}
        env = {name: value for name, value in env.items() if value is not None}  # extra_env's None: removed
        env.pop("JUPYTERHUB_API_TOKEN", None)
        if self.python != sys.executable:  # its own installation, not this one's import paths
            for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
                env.pop(name, None)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                self.python,
                "-m",
                "danlu.hub",
                "up",
                "--config",
                str(self.config_file),
                "--state-dir",
                str(self.state),
                "--port",
                str(self.port),
                "--quiet-hub",
            ],
            cwd=str(self.tmp),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"danlu up exited ({self.proc.returncode}):\n{self.log_tail()}")
            if "is up:" in self.log_path.read_text(errors="replace"):
                self.info = json.loads((self.state / "danlu-up.json").read_text())
                return self
            time.sleep(0.5)
        raise RuntimeError(f"danlu up did not start in {timeout}s:\n{self.log_tail()}")

    def processes(self) -> list:
        """Live processes started by this workbench (they carry its DANLU_INSTANCE marker)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if (
                    proc.environ().get(names.INSTANCE) == self.info["instance"]
                    and proc.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        hub = self.state / "logs" / "jupyterhub.log"
        if hub.exists():
            text += "\n--- jupyterhub.log ---\n" + hub.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 120) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(10)

    # hub API --------------------------------------------------------------------
    def hub(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {token or self.admin_token}"}
        return requests.request(method, f"{self.url}/hub/api{path}", headers=headers, timeout=60, **kwargs)

    def create_user(self, name: str, groups: list[str] = ()) -> str:
        """Create a user (idempotent), add them to groups, return an API token of theirs."""
        r = self.hub("POST", f"/users/{name}")
        assert r.status_code in (201, 409), r.text
        for group in groups:
            r = self.hub("POST", f"/groups/{group}")
            assert r.status_code in (201, 409), r.text
            r = self.hub("POST", f"/groups/{group}/users", json={"users": [name]})
            assert r.status_code == 200, r.text
        r = self.hub("POST", f"/users/{name}/tokens", json={"note": "tests"})
        assert r.status_code == 201, r.text
        return r.json()["token"]

    def start_server(self, name: str, options: dict | None = None, timeout: float = 120) -> requests.Response:
        r = self.hub("POST", f"/users/{name}/server", json=options or {})
        if r.status_code not in (201, 202):
            return r
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.hub("GET", f"/users/{name}").json()
            server = model.get("servers", {}).get("", {})
            if server.get("ready"):
                return r
            time.sleep(0.5)
        raise RuntimeError(f"{name}'s server did not become ready:\n{self.log_tail()}")

    # Danlu API ------------------------------------------------------------------
    def api(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {token or self.admin_token}", **kwargs.pop("headers", {})}
        return requests.request(
            method,
            f"{self.url}/services/danlu/api/v1{path}",
            headers=headers,
            timeout=kwargs.pop("timeout", 120),
            **kwargs,
        )

    def mlflow(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {token or self.admin_token}"}
        return requests.request(method, f"{self.url}/services/mlflow{path}", headers=headers, timeout=60, **kwargs)

    def wait_job(
        self, job_id: str, token: str, timeout: float = 300, states=("succeeded", "failed", "cancelled", "timed_out")
    ):
        deadline = time.monotonic() + timeout
        job = {"state": "unknown"}
        while time.monotonic() < deadline:
            r = self.api("GET", f"/jobs/{job_id}", token=token)
            if r.status_code == 200:  # else the service is restarting
                job = r.json()
                if job["state"] in states:
                    return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {job['state']} after {timeout}s")


class RemoteKernel:
    """A kernel in a user's server, driven over the websocket like JupyterLab does."""

    def __init__(
        self, wb: Workbench, user: str, token: str, path: str = "work/train.ipynb", kernel_name: str | None = None
    ):
        self.wb, self.user, self.token = wb, user, token
        base = f"{wb.url}/user/{user}/api"
        headers = {"Authorization": f"token {token}"}
        folder = str(Path(path).parent)
        if folder not in ("", "."):
            requests.put(f"{base}/contents/{folder}", headers=headers, json={"type": "directory"}, timeout=30)
        nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        r = requests.put(
            f"{base}/contents/{path}", headers=headers, json={"type": "notebook", "content": nb}, timeout=30
        )
        assert r.status_code in (200, 201), r.text
        body = {"path": path, "type": "notebook", "name": Path(path).name, "kernel": {}}
        if kernel_name:
            body["kernel"]["name"] = kernel_name
        r = requests.post(f"{base}/sessions", headers=headers, json=body, timeout=60)
        assert r.status_code == 201, r.text
        self.kernel_id = r.json()["kernel"]["id"]
        self.ws_url = f"ws://127.0.0.1:{wb.port}/user/{user}/api/kernels/{self.kernel_id}/channels"
        self.session = uuid.uuid4().hex

    def execute(self, code: str, timeout: float = 600, cell_id: str | None = None) -> dict:
        """Run code; return {'status', 'stdout', 'stderr', 'error', 'outputs'}."""

        async def run():
            request = HTTPRequest(self.ws_url, headers={"Authorization": f"token {self.token}"})
            ws = await websocket_connect(request)
            msg_id = uuid.uuid4().hex
            msg = {
                "header": {
                    "msg_id": msg_id,
                    "username": self.user,
                    "session": self.session,
                    "msg_type": "execute_request",
                    "version": "5.3",
                    "date": "",
                },
                "parent_header": {},
                "metadata": {"cellId": cell_id or uuid.uuid4().hex[:8]},
                "content": {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
                "channel": "shell",
                "buffers": [],
            }
            await ws.write_message(json.dumps(msg))
            result = {"status": None, "stdout": "", "stderr": "", "error": None, "outputs": []}
            idle = replied = False
            deadline = time.monotonic() + timeout
            while not (idle and replied):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply after {timeout}s; output so far:\n{result['stdout']}")
                raw = await asyncio.wait_for(ws.read_message(), left)
                if raw is None:
                    raise RuntimeError("websocket closed")
                if isinstance(raw, bytes):
                    continue
                reply = json.loads(raw)
                if reply.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = reply["msg_type"]
                content = reply["content"]
                if kind == "stream":
                    result[content["name"]] += content["text"]
                elif kind in ("display_data", "execute_result"):
                    result["outputs"].append(content)
                elif kind == "error":
                    result["error"] = f"{content['ename']}: {content['evalue']}"
                elif kind == "status" and content["execution_state"] == "idle":
                    idle = True
                elif kind == "execute_reply":
                    result["status"] = content["status"]
                    replied = True
            ws.close()
            return result

        return asyncio.run(run())
