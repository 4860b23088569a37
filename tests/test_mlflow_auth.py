"""MLflow's permissions driven by hub identities (danlu.hub.mlflow_auth, the gateway, jobs).

Pure tests: the derived passwords, the check MLflow calls on every request (in a
Flask request context), the ini file, the XSRF script, and MlflowUsers against an
HTTP-level fake of MLflow's REST API. Service tests: a bare MLflow basic-auth
server with ``default_permission: NO_PERMISSIONS``, and the whole workbench (the
session's ``workbench``), where alice's experiments, runs, artifacts and jobs are
hers to change, bob only reads them, and the loopback port wants credentials.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import hmac
import os
import re
import signal
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests
import yaml
from flask import Flask, Response
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from traitlets.config import Config

from danlu import env
from danlu.env import MLFLOW_AUTH_SECRET
from danlu.errors import PolicyError
from danlu.hub import mlflow_auth
from danlu.hub.config import load_settings
from danlu.hub.hubconfig import configure
from danlu.hub.mlflow_auth import SERVICE_ACCOUNT, MlflowUsers, password
from danlu.hub.mlflow_gateway import inject_xsrf
from danlu.hub.testing import free_port

SECRET = "ab" * 32


def settings_with(tmp_path, mlflow: dict):
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump({"mlflow": mlflow}))
    return load_settings(path)


# secret and passwords --------------------------------------------------------------------------
def test_passwords_are_hmacs_of_the_name_under_the_secret():
    assert password(SECRET, "alice") == hmac.new(SECRET.encode(), b"alice", hashlib.sha256).hexdigest()
    assert password(SECRET, "alice") != password(SECRET, "bob")
    assert password(SECRET, "alice") != password("cd" * 32, "alice")
    assert mlflow_auth.flask_secret_key(SECRET) not in {password(SECRET, n) for n in ("alice", SERVICE_ACCOUNT)}


def test_the_secret_is_made_once_and_only_the_owner_reads_it(tmp_path):
    secret = mlflow_auth.ensure_secret(tmp_path)
    assert len(secret) == 64
    assert stat.S_IMODE((tmp_path / mlflow_auth.SECRET_FILE).stat().st_mode) == 0o600
    assert mlflow_auth.ensure_secret(tmp_path) == secret


def test_jobs_log_in_as_their_attempt_not_their_owner():
    user = mlflow_auth.job_username("0123456789ab", 2, "r" * 32)
    assert user == "job/0123456789ab/2/" + "r" * 32
    assert mlflow_auth.job_environment(user, SECRET) == {
        "MLFLOW_TRACKING_USERNAME": user,
        "MLFLOW_TRACKING_PASSWORD": password(SECRET, user),
    }
    assert mlflow_auth.job_environment(user, None) == {}
    for owner in ("alice", SERVICE_ACCOUNT):  # never a person's (or the admin's) own credentials
        with pytest.raises(PolicyError):
            mlflow_auth.job_environment(owner, SECRET)


RUN = "a" * 32
JOB_USER = f"job/0123456789ab/1/{RUN}"


@pytest.mark.parametrize(
    "method, path, args, body, refused",
    [
        ("POST", "/api/2.0/mlflow/runs/log-batch", {}, {"run_id": RUN}, False),
        ("GET", "/api/2.0/mlflow/runs/get", {"run_id": RUN}, None, False),
        ("GET", "/api/2.0/mlflow/model-versions/get", {"name": "m", "version": "1"}, None, False),
        ("POST", "/api/2.0/mlflow/runs/set-tag", {}, {"run_id": "b" * 32, "key": "k"}, True),
        ("POST", "/ajax-api/2.0/mlflow/runs/log-metric", {}, {"run_uuid": "b" * 32}, True),
        ("GET", "/api/2.0/mlflow/runs/get", {"run_id": "b" * 32}, None, True),
        ("POST", "/services/mlflow/api/2.0/mlflow/runs/create", {}, {"experiment_id": "1"}, True),
        ("POST", "/api/2.0/mlflow/experiments/create", {}, {"name": "alice/x"}, True),
        ("POST", "/api/2.0/mlflow/runs/delete", {}, {"run_id": RUN}, True),
        ("POST", "/api/2.0/mlflow/logged-models", {}, {"experiment_id": "1", "source_run_id": "b" * 32}, True),
        ("PUT", f"/api/2.0/mlflow-artifacts/artifacts/1/{RUN}/artifacts/model/MLmodel", {}, None, False),
        ("PUT", f"/api/2.0/mlflow-artifacts/artifacts/1/{'b' * 32}/artifacts/model/MLmodel", {}, None, True),
        ("DELETE", f"/api/2.0/mlflow-artifacts/artifacts/1/{'b' * 32}/artifacts/x", {}, None, True),
        ("GET", f"/api/2.0/mlflow-artifacts/artifacts/1/{'b' * 32}/artifacts/x", {}, None, False),
    ],
)
def test_a_jobs_credentials_write_its_run_and_no_other(method, path, args, body, refused):
    """MLflow's permissions stop at the experiment; the check inside the MLflow server confines a job to its run."""
    why = mlflow_auth.run_scope(JOB_USER, method, path, args, body)
    assert (why is not None) == refused, why
    assert mlflow_auth.run_scope("alice", method, path, args, body) is None  # people follow MLflow's permissions


def test_hub_identities_map_to_mlflow_users():
    assert mlflow_auth.mlflow_username({"kind": "user", "name": "alice"}) == "alice"
    assert mlflow_auth.mlflow_username({"kind": "service", "name": "danlu-admin"}) == "service/danlu-admin"
    assert mlflow_auth.is_admin({"name": "a", "admin": True, "scopes": []})
    assert mlflow_auth.is_admin({"name": "a", "admin": False, "scopes": ["custom:danlu:admin"]})
    assert not mlflow_auth.is_admin({"name": "a", "admin": False, "scopes": ["custom:danlu:jobs!user=a"]})


# the check inside the MLflow server ------------------------------------------------------------------
def basic(user: str, pw: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()


@pytest.mark.parametrize(
    "header, accepted",
    [
        (basic("alice", password(SECRET, "alice")), True),
        (basic(SERVICE_ACCOUNT, password(SECRET, SERVICE_ACCOUNT)), True),
        (basic("bob", password(SECRET, "alice")), False),  # alice's password is not bob's
        (basic("alice", password("cd" * 32, "alice")), False),  # derived from another secret
        (basic("alice", ""), False),
        ("Bearer " + password(SECRET, "alice"), False),
        (None, False),
    ],
)
def test_mlflow_accepts_only_derived_passwords(monkeypatch, header, accepted):
    monkeypatch.setenv(MLFLOW_AUTH_SECRET, SECRET)
    with Flask(__name__).test_request_context(
        "/api/2.0/mlflow/runs/get", headers={"Authorization": header} if header else {}
    ):
        result = mlflow_auth.authenticate()
        if accepted:
            assert basic(result.username, result.password) == header
        else:
            assert isinstance(result, Response) and result.status_code == 401
            assert result.headers["WWW-Authenticate"].startswith("Basic")


def test_without_the_secret_nobody_gets_in(monkeypatch):
    monkeypatch.delenv(MLFLOW_AUTH_SECRET, raising=False)
    with Flask(__name__).test_request_context("/", headers={"Authorization": basic("alice", password("", "alice"))}):
        assert mlflow_auth.authenticate().status_code == 401


# the ini file ---------------------------------------------------------------------------------------
def read_ini(monkeypatch, path):
    from mlflow.server.auth.config import read_auth_config

    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(path))
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
    return read_auth_config()  # as MLflow reads it


def test_auth_config_defaults(tmp_path, monkeypatch):
    path = mlflow_auth.write_auth_config(tmp_path, settings_with(tmp_path, {}), SECRET)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    config = read_ini(monkeypatch, path)
    assert config.default_permission == "READ"
    assert config.database_uri == f"sqlite:///{tmp_path / 'mlflow-auth.db'}"
    assert config.admin_username == SERVICE_ACCOUNT
    assert config.admin_password == password(SECRET, SERVICE_ACCOUNT)
    assert config.authorization_function == "danlu.hub.mlflow_auth:authenticate"


def test_auth_config_from_danlu_yaml(tmp_path, monkeypatch):
    uri = "postgresql://mlflow:p%40ss@db/auth"  # a % survives configparser's interpolation
    settings = settings_with(tmp_path, {"default_permission": "NO_PERMISSIONS", "auth_database_uri": uri})
    config = read_ini(monkeypatch, mlflow_auth.write_auth_config(tmp_path, settings, SECRET))
    assert (config.default_permission, config.database_uri) == ("NO_PERMISSIONS", uri)


def test_mlflow_server_environment(tmp_path):
    env = mlflow_auth.server_environment(tmp_path / "mlflow-auth.ini", SECRET)
    assert env == {
        "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "mlflow-auth.ini"),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": mlflow_auth.flask_secret_key(SECRET),
        MLFLOW_AUTH_SECRET: SECRET,
    }


def test_the_secret_reaches_the_jobs_service_and_the_gateway_only(tmp_path):
    (tmp_path / "danlu.yaml").write_text("{}")
    environ = {
        str(k): v
        for k, v in {
            env.CONFIG: str(tmp_path / "danlu.yaml"),
            env.STATE_DIR: str(tmp_path / "state"),
            env.HUB_PORT: "8081",
            env.PROXY_API_PORT: "8001",
            env.ADMIN_TOKEN: "a" * 64,
            env.MLFLOW_URL: "http://127.0.0.1:5000",
            env.SERVICE_PORT: "10101",
            env.GATEWAY_PORT: "10102",
            "PATH": "/usr/bin",
        }.items()
    }
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / mlflow_auth.SECRET_FILE).write_text(SECRET + "\n")  # as danlu up leaves it
    c = Config()
    configure(c, environ=environ)  # the hub's own environment never holds it
    services = {s["name"]: s for s in copy.deepcopy(c.JupyterHub.services)}  # as JupyterHub does
    assert services["danlu"]["environment"][MLFLOW_AUTH_SECRET] == SECRET
    assert services["mlflow"]["environment"][MLFLOW_AUTH_SECRET] == SECRET
    assert MLFLOW_AUTH_SECRET not in c.DanluLocalSpawner.extra_env  # users' servers
    assert MLFLOW_AUTH_SECRET not in c.Spawner.env_keep


# the XSRF script ----------------------------------------------------------------------------------
def test_xsrf_script_goes_first_in_the_head():
    html = b'<!doctype html><html><head lang="en"><script src="static-files/main.js"></script></head></html>'
    out = inject_xsrf(html, "2|abc", "/services/mlflow/").decode()
    assert out.index('var token = "2|abc", prefix = "/services/mlflow/"') < out.index("main.js")
    assert out.startswith('<!doctype html><html><head lang="en"><script>')
    assert inject_xsrf(b"<p>no head</p>", "t", "/p/").endswith(b"<p>no head</p>")


def test_the_ui_opens_on_its_model_training_view_unless_the_user_chose():
    """MLflow 3.17's UI starts on its GenAI view; Danlu's users train models (issue 17). The key and format are
    those of the UI's own useLocalStorage hook, read from the bundle MLflow ships."""
    import mlflow.server  # deferred: only this test reads MLflow's shipped UI

    bundle = Path(mlflow.server.__file__).parent / "js" / "build" / "static" / "js"
    shipped = "".join(p.read_text(errors="replace") for p in bundle.glob("*.js"))
    assert 'key:"mlflow.workflowType",version:1' in shipped and "`${e}_v${t}`" in shipped
    out = inject_xsrf(b"<html><head></head></html>", "t", "/p/").decode()
    assert 'localStorage.setItem("mlflow.workflowType_v1", JSON.stringify("machine_learning"))' in out
    assert out.index('getItem("mlflow.workflowType_v1")') < out.index("setItem")  # a stored choice stays


# MlflowUsers against a fake MLflow ------------------------------------------------------------------
class FakeMlflow:
    """MLflow's REST API for users, experiments and permissions, as far as MlflowUsers uses it."""

    def __init__(self, users=None, experiments=None, permissions=None, default="READ"):
        self.users = dict(users or {})  # name -> is_admin
        self.experiments = dict(experiments or {})  # name -> id
        self.permissions = dict(permissions or {})  # (user, experiment id) -> permission
        self.default = default
        self.calls: list[str] = []
        self.passwords: dict[str, str] = {}

    def lookup(self, name: str) -> dict | None:
        return {"username": name, "is_admin": self.users[name]} if name in self.users else None

    def app(self) -> web.Application:
        fake = self

        class Handler(web.RequestHandler):
            def check(self):
                fake.calls.append(f"{self.request.method} {self.request.path}")
                assert self.request.headers["Authorization"] == mlflow_auth.basic_authorization(SERVICE_ACCOUNT, SECRET)

            def error(self, status, code):
                self.set_status(status)
                self.finish({"error_code": code, "message": code})

            def get(self, what):
                self.check()
                arg = self.get_argument
                if what == "users/get":
                    user = fake.lookup(arg("username"))
                    return self.finish({"user": user}) if user else self.error(404, "RESOURCE_DOES_NOT_EXIST")
                if what == "experiments/get-by-name":
                    if arg("experiment_name") not in fake.experiments:
                        return self.error(404, "RESOURCE_DOES_NOT_EXIST")
                    return self.finish({"experiment": {"experiment_id": fake.experiments[arg("experiment_name")]}})
                if what == "users/permissions/get":
                    if arg("username") not in fake.users:
                        return self.error(404, "RESOURCE_DOES_NOT_EXIST")
                    perm = fake.permissions.get((arg("username"), arg("resource_id")), fake.default)
                    return self.finish({"allowed": perm != "READ", "permission": perm})
                self.error(404, "ENDPOINT_NOT_FOUND")

            def post(self, what):
                self.check()
                body = web.escape.json_decode(self.request.body)
                assert what == "users/create"
                if body["username"] in fake.users:
                    return self.error(400, "RESOURCE_ALREADY_EXISTS")
                fake.users[body["username"]] = False
                fake.passwords[body["username"]] = body["password"]
                self.finish({"user": {"username": body["username"], "is_admin": False}})

            def patch(self, what):
                self.check()
                body = web.escape.json_decode(self.request.body)
                assert what == "users/update-admin"
                fake.users[body["username"]] = body["is_admin"]
                self.finish({})

        return web.Application([(r"/mlflow/api/[0-9.]+/mlflow/(.*)", Handler)])

    def run(self, check) -> None:
        """Serve on a free port while ``await check(MlflowUsers)`` runs."""

        async def main():
            sock, port = bind_unused_port()
            server = HTTPServer(self.app())
            server.add_sockets([sock])
            try:
                await check(MlflowUsers(f"http://127.0.0.1:{port}/mlflow", SECRET))
            finally:
                server.stop()

        asyncio.run(main())


def test_ensure_user_creates_once_with_the_derived_password():
    fake = FakeMlflow()

    async def check(users):
        await users.ensure_user("alice")
        await users.ensure_user("alice")
        await users.ensure_user("alice", admin=False)

    fake.run(check)
    assert fake.users == {"alice": False} and fake.passwords == {"alice": password(SECRET, "alice")}
    assert fake.calls == ["GET /mlflow/api/2.0/mlflow/users/get", "POST /mlflow/api/2.0/mlflow/users/create"]


def test_ensure_user_follows_the_hubs_admin_flag():
    fake = FakeMlflow(users={"carol": True})

    async def check(users):
        await users.ensure_user("admin", admin=True)  # new: created, then made an admin
        await users.ensure_user("admin", admin=True)
        await users.ensure_user("carol", admin=False)  # no longer a hub admin
        await users.ensure_user("carol")  # the jobs service leaves the flag alone

    fake.run(check)
    assert fake.users == {"admin": True, "carol": False}
    assert fake.calls.count("PATCH /mlflow/api/2.0/mlflow/users/update-admin") == 2
    assert len(fake.calls) == 5


class RacedMlflow(FakeMlflow):
    """Every look-up misses: another process creates the user between our look-up and our create."""

    def lookup(self, name):
        return None


def test_ensure_user_when_another_process_created_it_first():
    fake = RacedMlflow(users={"bob": False})

    async def check(users):
        await users.ensure_user("bob", admin=True)

    fake.run(check)
    assert fake.users == {"bob": True}
    assert fake.passwords == {}


def test_the_service_account_is_never_provisioned():
    async def check(users):
        with pytest.raises(PolicyError):
            await users.ensure_user(SERVICE_ACCOUNT, admin=False)

    FakeMlflow().run(check)


def hub_users(*names):
    async def exists(name: str) -> bool:
        return name in names

    return exists


@pytest.mark.parametrize(
    "name, owner, admin, refused",
    [
        ("alice/mnist", "alice", False, False),  # her own name space, a new experiment
        ("bob/mnist", "alice", False, True),  # squatting another user's name space
        ("bob/mnist", "admin", True, False),  # admins may use any name
        ("project/mnist", "alice", False, False),  # not a user: a shared name, new
        ("shared", "alice", False, True),  # exists; alice may only read it (the default)
        ("shared", "bob", False, False),  # bob was granted EDIT
        ("alice/old", "alice", False, False),  # exists; hers (MANAGE)
    ],
)
def test_check_experiment(name, owner, admin, refused):
    fake = FakeMlflow(
        users={"alice": False, "bob": False, "admin": True},
        experiments={"shared": "7", "alice/old": "9"},
        permissions={("bob", "7"): "EDIT", ("alice", "9"): "MANAGE"},
    )

    async def check(users):
        if refused:
            with pytest.raises(PolicyError) as e:
                await users.check_experiment(name, owner, admin, hub_users("alice", "bob", "admin"))
            assert e.value.reason == "experiment_not_yours" and e.value.field == "experiment"
        else:
            await users.check_experiment(name, owner, admin, hub_users("alice", "bob", "admin"))

    fake.run(check)


def test_check_experiment_lets_jobs_through_when_mlflow_is_down():
    users = MlflowUsers(f"http://127.0.0.1:{free_port()}/mlflow", SECRET, timeout=5)
    asyncio.run(users.check_experiment("shared", "alice", False, hub_users("alice")))
    with pytest.raises(PolicyError):  # the name space check needs only the hub
        asyncio.run(users.check_experiment("bob/x", "alice", False, hub_users("alice", "bob")))


# service: a bare MLflow basic-auth server where nobody reads what is not theirs -----------------------
@pytest.fixture(scope="module")
def private_mlflow(tmp_path_factory):
    """The MLflow server as danlu up starts it (DanluUp.start_mlflow), with default_permission NO_PERMISSIONS."""
    from danlu.hub.app import DanluUp, wait_http

    folder = tmp_path_factory.mktemp("mlflow-private")
    (folder / "danlu.yaml").write_text(yaml.safe_dump({"mlflow": {"default_permission": "NO_PERMISSIONS"}}))
    settings = load_settings(folder / "danlu.yaml", {"state_dir": str(folder / "state")})
    (settings.state_dir / "logs").mkdir(parents=True)
    secret = mlflow_auth.ensure_secret(settings.state_dir)
    port = free_port()
    proc = DanluUp().start_mlflow(settings, port, {**os.environ, str(MLFLOW_AUTH_SECRET): secret})
    url = f"http://127.0.0.1:{port}/services/mlflow"
    try:
        wait_http(f"{url}/health", 300, proc, "MLflow")
        yield url, secret
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.service
def test_no_permissions_hides_other_users_experiments(private_mlflow):
    url, secret = private_mlflow
    users = MlflowUsers(url, secret)

    async def provision():
        for name in ("alice", "bob"):
            await users.ensure_user(name)
        await users.ensure_user("carol", admin=True)

    asyncio.run(provision())
    alice, bob, carol = ((n, password(secret, n)) for n in ("alice", "bob", "carol"))
    r = requests.post(f"{url}/api/2.0/mlflow/experiments/create", auth=alice, json={"name": "team-x"}, timeout=30)
    assert r.status_code == 200, r.text
    experiment = {"experiment_id": r.json()["experiment_id"]}
    get = f"{url}/api/2.0/mlflow/experiments/get"
    assert requests.get(get, params=experiment, auth=alice, timeout=30).status_code == 200
    assert requests.get(get, params=experiment, auth=bob, timeout=30).status_code == 403
    assert requests.get(get, params=experiment, auth=carol, timeout=30).status_code == 200  # an admin
    found = (
        requests.post(f"{url}/api/2.0/mlflow/experiments/search", auth=bob, json={"max_results": 100}, timeout=30)
        .json()
        .get("experiments", [])
    )
    assert "team-x" not in [e["name"] for e in found]
    # what the jobs service asks before it takes a job for an experiment
    asyncio.run(users.check_experiment("team-x", "alice", False, hub_users("alice", "bob")))
    with pytest.raises(PolicyError, match="NO_PERMISSIONS"):
        asyncio.run(users.check_experiment("team-x", "bob", False, hub_users("alice", "bob")))


# service: the whole workbench --------------------------------------------------------------------------
def notebook(source: str) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "id": "c1", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def artifact(run: dict, name: str) -> str:
    """The gateway path of one of the run's artifacts (MLflow's artifact proxy)."""
    where = run["info"]["artifact_uri"].split("mlflow-artifacts:", 1)[1].strip("/")
    return f"/api/2.0/mlflow-artifacts/artifacts/{where}/{name}"


@pytest.fixture(scope="module")
def alice_run(workbench):
    """alice's experiment (in her name space), a run with an artifact, and a second experiment of hers."""
    wb, alice = workbench, workbench.tokens["alice"]
    suffix = uuid.uuid4().hex[:8]
    experiments = {}
    for name in (f"alice/permissions-{suffix}", f"permissions-shared-{suffix}"):
        r = wb.mlflow("POST", "/api/2.0/mlflow/experiments/create", token=alice, json={"name": name})
        assert r.status_code == 200, r.text
        experiments[name] = r.json()["experiment_id"]
    name = f"alice/permissions-{suffix}"
    r = wb.mlflow("POST", "/api/2.0/mlflow/runs/create", token=alice, json={"experiment_id": experiments[name]})
    assert r.status_code == 200, r.text
    run = r.json()["run"]
    r = wb.mlflow("PUT", artifact(run, "notes.txt"), token=alice, data=b"alice's notes")
    assert r.status_code == 200, r.text
    return {
        "run": run,
        "run_id": run["info"]["run_id"],
        "experiment_id": experiments[name],
        "shared": f"permissions-shared-{suffix}",
    }


def writes(alice_run: dict) -> list[tuple[str, str, dict]]:
    run_id, experiment_id = alice_run["run_id"], alice_run["experiment_id"]
    return [
        ("POST", "/api/2.0/mlflow/runs/set-tag", {"json": {"run_id": run_id, "key": "k", "value": "v"}}),
        ("POST", "/ajax-api/2.0/mlflow/runs/set-tag", {"json": {"run_id": run_id, "key": "k", "value": "v"}}),
        (
            "POST",
            "/api/2.0/mlflow/runs/log-metric",
            {"json": {"run_id": run_id, "key": "loss", "value": 1.0, "timestamp": int(time.time() * 1000), "step": 0}},
        ),
        ("PUT", artifact(alice_run["run"], "notes.txt"), {"data": b"overwritten"}),
        ("PUT", artifact(alice_run["run"], "more.txt"), {"data": b"added"}),
        ("DELETE", artifact(alice_run["run"], "notes.txt"), {}),
        ("POST", "/api/2.0/mlflow/runs/delete", {"json": {"run_id": run_id}}),
        ("POST", "/api/2.0/mlflow/experiments/delete", {"json": {"experiment_id": experiment_id}}),
    ]


@pytest.mark.service
def test_everyone_reads_only_the_owner_changes(workbench, alice_run):
    wb, bob = workbench, workbench.tokens["bob"]
    run_id = alice_run["run_id"]
    assert wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={run_id}", token=bob).status_code == 200
    assert (
        wb.mlflow(
            "GET", f"/api/2.0/mlflow/experiments/get?experiment_id={alice_run['experiment_id']}", token=bob
        ).status_code
        == 200
    )
    assert wb.mlflow("GET", artifact(alice_run["run"], "notes.txt"), token=bob).content == b"alice's notes"
    for method, path, kwargs in writes(alice_run):
        r = wb.mlflow(method, path, token=bob, **kwargs)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
    # nothing changed
    assert wb.mlflow("GET", artifact(alice_run["run"], "notes.txt"), token=bob).content == b"alice's notes"
    run = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={run_id}", token=bob).json()["run"]
    assert run["info"]["lifecycle_stage"] == "active" and "k" not in {t["key"] for t in run["data"].get("tags", [])}
    # while alice may
    r = wb.mlflow(
        "POST",
        "/api/2.0/mlflow/runs/set-tag",
        token=wb.tokens["alice"],
        json={"run_id": run_id, "key": "k", "value": "alice"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.service
def test_the_loopback_mlflow_wants_credentials(workbench, alice_run):
    wb = workbench
    url = wb.info["mlflow_url"]
    secret = (wb.state / mlflow_auth.SECRET_FILE).read_text().strip()
    wb.mlflow("GET", "/api/2.0/mlflow/experiments/search?max_results=1", token=wb.tokens["bob"])  # bob exists
    get = f"{url}/api/2.0/mlflow/runs/get?run_id={alice_run['run_id']}"
    tag = {"run_id": alice_run["run_id"], "key": "loopback", "value": "1"}
    assert requests.get(get, timeout=30).status_code == 401
    assert requests.get(get, auth=("bob", "not-the-password"), timeout=30).status_code == 401
    bob, alice = ("bob", password(secret, "bob")), ("alice", password(secret, "alice"))
    assert requests.get(get, auth=bob, timeout=30).status_code == 200
    assert requests.post(f"{url}/api/2.0/mlflow/runs/set-tag", json=tag, auth=bob, timeout=30).status_code == 403
    assert requests.post(f"{url}/api/2.0/mlflow/runs/set-tag", json=tag, auth=alice, timeout=30).status_code == 200


def log_in(wb, user: str) -> requests.Session:
    """A browser's session: the hub's login form (the dummy authenticator takes any password)."""
    session = requests.Session()
    page = session.get(f"{wb.url}/hub/login", timeout=30)
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    r = session.post(
        f"{wb.url}/hub/login",
        data={"username": user, "password": "any", "_xsrf": xsrf},
        allow_redirects=False,
        timeout=30,
    )
    assert r.status_code == 302, r.text
    return session


@pytest.mark.service
def test_cookie_requests_need_the_xsrf_token(workbench, alice_run):
    wb = workbench
    browser = log_in(wb, "alice")
    page = browser.get(f"{wb.url}/services/mlflow/", headers={"Accept": "text/html"}, timeout=60)
    assert page.status_code == 200 and page.url == f"{wb.url}/services/mlflow/", page.url
    assert page.headers["Cache-Control"] == "no-store"
    token = re.search(r'var token = "([^"]+)"', page.text).group(1)
    assert page.text.index("X-XSRFToken") < page.text.index("static-files")  # before MLflow's own scripts
    set_tag = f"{wb.url}/services/mlflow/ajax-api/2.0/mlflow/runs/set-tag"
    body = {"run_id": alice_run["run_id"], "key": "by-cookie", "value": "1"}
    assert browser.post(set_tag, json=body, timeout=30).status_code == 401  # a cookie without the token: no login
    assert browser.post(set_tag, json=body, headers={"X-XSRFToken": "forged"}, timeout=30).status_code == 401
    r = browser.post(set_tag, json=body, headers={"X-XSRFToken": token}, timeout=30)
    assert r.status_code == 200, r.text
    # the UI's fetch() GETs are cross-check requests too (Sec-Fetch-Mode: cors), hence the script adds it to all
    get = f"{wb.url}/services/mlflow/ajax-api/2.0/mlflow/runs/get?run_id={alice_run['run_id']}"
    fetch = {"Sec-Fetch-Mode": "cors", "Sec-Fetch-Site": "same-origin"}
    assert browser.get(get, headers=fetch, timeout=30).status_code == 401
    r = browser.get(get, headers={**fetch, "X-XSRFToken": token}, timeout=30)
    assert r.status_code == 200, r.text


JOB = f"""import os, mlflow, requests
mlflow.log_metric("from_kernel", 1.0)
user, secret = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]
print("logged as", user)
print("secret seen" if os.environ.get({str(MLFLOW_AUTH_SECRET)!r}) else "no secret")
def status(method, path, **kwargs):
    url = os.environ["MLFLOW_TRACKING_URI"] + path
    return requests.request(method, url, auth=(user, secret), timeout=30, **kwargs).status_code
print("other run", status("POST", "/api/2.0/mlflow/runs/set-tag", json=dict(run_id=other, key="k", value="v")))
experiment = os.environ["MLFLOW_EXPERIMENT_ID"]
print("new run", status("POST", "/api/2.0/mlflow/runs/create", json=dict(experiment_id=experiment)))
print("password", secret)
"""


@pytest.mark.service
@pytest.mark.parametrize("owner", ["alice", "admin"])
def test_a_job_logs_to_its_run_alone_with_credentials_that_end_with_it(workbench, alice_run, owner):
    """A job's MLflow credentials write the run the service made for it and nothing else -- not another run
    of its owner's, not a new run, and not as an MLflow admin when an admin submits it -- and stop working
    when the job ends."""
    wb, token, bob = workbench, workbench.tokens[owner], workbench.tokens["bob"]
    body = {"notebook": notebook(JOB), "name": "logs-to-its-run", "parameters": {"other": alice_run["run_id"]}}
    job = wb.api("POST", "/jobs", token=token, json=body).json()
    done = wb.wait_job(job["id"], token)
    assert done["state"] == "succeeded", done
    output = wb.api("GET", f"/jobs/{job['id']}/output", token=token).text
    user = f"job/{job['id']}/1/{done['mlflow_run_id']}"
    assert f"logged as {user}" in output and "no secret" in output
    assert "other run 403" in output and "new run 403" in output
    run = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={done['mlflow_run_id']}", token=token).json()["run"]
    assert {m["key"] for m in run["data"]["metrics"]} >= {"from_kernel"}
    assert run["info"]["experiment_id"] == done["tracking"]["experiment_id"]
    permission = wb.mlflow(
        "GET",
        "/api/3.0/mlflow/users/permissions/get",
        token=wb.tokens["admin"],
        params={"username": owner, "resource_type": "experiment", "resource_id": run["info"]["experiment_id"]},
    ).json()
    assert permission["permission"] == "MANAGE"  # the service made the experiment as the job's owner
    tag = {"run_id": done["mlflow_run_id"], "key": "reviewed", "value": "yes"}
    assert wb.mlflow("POST", "/api/2.0/mlflow/runs/set-tag", token=bob, json=tag).status_code == 403
    assert wb.mlflow("POST", "/api/2.0/mlflow/runs/set-tag", token=token, json=tag).status_code == 200
    # the attempt ended: its password no longer logs in
    secret = re.search(r"password ([0-9a-f]{64})", output).group(1)
    get = f"{wb.info['mlflow_url']}/api/2.0/mlflow/runs/get?run_id={done['mlflow_run_id']}"
    assert requests.get(get, auth=(user, secret), timeout=30).status_code == 401


@pytest.mark.service
def test_jobs_go_only_into_experiments_their_owner_may_write(workbench, alice_run):
    wb = workbench
    for owner, experiment, status in (
        ("bob", "alice/squatted", 403),
        ("bob", alice_run["shared"], 403),
        ("alice", alice_run["shared"], 200),
        ("admin", "alice/anything", 200),
    ):
        r = wb.api(
            "POST",
            "/jobs",
            token=wb.tokens[owner],
            json={"notebook": notebook("1"), "experiment": experiment, "dry_run": True},
        )
        assert r.status_code == status, (owner, experiment, r.text)
        if status == 403:
            assert r.json()["reason"] == "experiment_not_yours"


@pytest.mark.service
def test_an_admin_may_delete_anything(workbench, alice_run):
    wb, admin = workbench, workbench.tokens["admin"]
    for method, path, kwargs in writes(alice_run):
        r = wb.mlflow(method, path, token=admin, **kwargs)
        assert r.status_code == 200, (method, path, r.status_code, r.text)
