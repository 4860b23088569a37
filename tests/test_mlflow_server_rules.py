"""The MLflow server holds every caller but the jobs service to the gateway's rules, as a hostile job would test it.

Jobs (their runner and kernels) reach MLflow directly, around the gateway, with their owner's MLflow
credentials (``MlflowAccess.env_for``). In process: :class:`danlu.hub.mlflowserver.Rules` before a
stand-in app (who passes, what is refused, the body an experiment create passes on unchanged). On a real
MLflow started as ``danlu up`` starts it: a job's process, with exactly the environment ``env_for`` gives
it, logs its run as before, and is refused the AI gateway's secrets, webhooks, a registry write and an
experiment in alice's name space, with the gateway's JSON; the jobs service's own account still
registers models and manages users; an MLflow admin may still create in any name space.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import requests
import yaml

from danlu.env import MLFLOW_AUTH_SECRET
from danlu.hub import mlflow_auth, mlflow_routes
from danlu.hub.config import load_settings
from danlu.hub.mlflow_auth import SERVICE_ACCOUNT, MlflowUsers, basic_authorization, password
from danlu.hub.mlflowserver import Rules, claimed_user
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.testing import free_port

PREFIX = "/services/mlflow"
SECRET = "s" * 64


# in process: the middleware before a stand-in for MLflow's app ----------------------------------------------
def basic(user: str, pw: str = "any") -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{pw}".encode())


def call(method: str, path: str, user: str | None = None, body: bytes = b"", admins=(), headers=()):
    """(status, JSON answer or None, what the app behind saw: (path, body) or None) of one request through Rules."""
    seen = []

    async def app(scope, receive, send):
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append((scope["path"], got))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    answer = {}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            answer["body"] = answer.get("body", b"") + message.get("body", b"")

    chunks = [body[i : i + 5] for i in range(0, len(body), 5)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    hdrs = [*([(b"authorization", basic(user))] if user else []), *headers]
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
    asyncio.run(Rules(app, PREFIX, is_admin=lambda name: name in admins)(scope, receive, send))
    data = json.loads(answer["body"]) if answer["status"] != 200 else None
    return answer["status"], data, (seen[0] if seen else None)


@pytest.mark.parametrize(
    "method, path, status, reason",
    [
        ("POST", PREFIX + "/ajax-api/3.0/mlflow/gateway/secrets/create", 403, "ai_gateway"),
        ("POST", "/gateway/e/mlflow/invocations", 403, "ai_gateway"),  # FastAPI's routes, outside the prefix
        ("POST", PREFIX + "/api/2.0/mlflow/webhooks", 403, "webhooks"),
        ("POST", PREFIX + "/api/2.0/mlflow/registered-models/create", 403, "registry_writes"),
        ("PATCH", PREFIX + "/api/2.0/mlflow/users/update-admin", 403, "users_and_roles"),
        ("GET", "/signup", 403, "users_and_roles"),  # the routes MLflow mounts outside the prefix: these, and
        ("GET", "/build/x.js", 403, "flask_static"),
        ("GET", PREFIX + "/no/such/route", 404, "route_not_forwarded"),
        ("POST", PREFIX + "/api/2.0/mlflow/runs/log-batch", 200, None),
        ("PUT", "/api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a.txt", 200, None),  # the artifact router
        ("GET", "/ajax-api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a.txt", 200, None),
        ("GET", PREFIX + "/api/2.0/mlflow/registered-models/get", 200, None),
        ("GET", PREFIX + "/health", 200, None),
    ],
)
def test_a_user_is_held_to_the_gateways_routes(method, path, status, reason):
    got, data, seen = call(method, path, "bob")
    assert got == status, data
    if reason:
        route = mlflow_routes.server_route(path, PREFIX)
        assert data == mlflow_routes.refusal(status, reason, mlflow_routes.decide(method, route).message, route)
        assert seen is None  # MLflow never saw it
    else:
        assert seen == (path, b"")


def test_the_service_passes_and_a_claim_is_read_as_mlflow_reads_it():
    for path in ("/ajax-api/3.0/mlflow/gateway/secrets/create", "/api/2.0/mlflow/users/create"):
        assert call("POST", PREFIX + path, SERVICE_ACCOUNT)[0] == 200
    assert call("POST", PREFIX + "/api/2.0/mlflow/users/create")[0] == 403  # no credentials: a user like any
    two = [(b"authorization", basic("bob"))]  # two headers could be read two ways: no exemption
    assert call("POST", PREFIX + "/api/2.0/mlflow/users/create", SERVICE_ACCOUNT, headers=two)[0] == 403
    assert claimed_user([(b"Authorization", basic(SERVICE_ACCOUNT, "a:b"))]) == SERVICE_ACCOUNT
    assert claimed_user([(b"authorization", b"Bearer " + basic(SERVICE_ACCOUNT)[6:])]) is None
    assert claimed_user([(b"authorization", b"Basic not-base64!")]) is None


def test_name_spaces_are_kept_and_the_body_passes_on_unchanged():
    create = PREFIX + "/api/2.0/mlflow/experiments/create"
    mine = json.dumps({"name": "bob/x", "tags": [{"key": "k", "value": "v" * 40}]}).encode()
    assert call("POST", create, "bob", mine)[2] == (create, mine)  # read in 5-byte chunks, passed on whole
    status, data, seen = call("POST", create, "bob", b'{"name": "alice/x"}')
    assert (status, data["reason"], data["route"], seen) == (403, "experiment_not_yours", create[len(PREFIX) :], None)
    rename = PREFIX + "/ajax-api/2.0/mlflow/experiments/update"
    assert call("POST", rename, "bob", b'{"experiment_id": "1", "newName": "alice/x"}')[0] == 403
    assert call("POST", create, "root", b'{"name": "alice/x"}', admins={"root"})[0] == 200
    assert call("POST", create, None, b'{"name": "alice/x"}')[0] == 403
    big = b'{"name": "bob/x", "pad": "' + b" " * mlflow_routes.MAX_NAMING_BODY + b'"}'
    assert call("POST", create, "bob", big)[:2][0] == 413


# on a real MLflow, as danlu up starts it ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """MLflow as ``danlu up`` starts it (basic-auth, the rules); alice and bob its users, root an admin."""
    from danlu.hub.app import DanluUp, wait_http  # deferred: the hub's app, as test_models starts MLflow

    folder = tmp_path_factory.mktemp("mlflow-rules")
    (folder / "danlu.yaml").write_text(yaml.safe_dump({}))
    settings = load_settings(folder / "danlu.yaml", {"state_dir": str(folder / "state")})
    (settings.state_dir / "logs").mkdir(parents=True)
    secret = mlflow_auth.ensure_secret(settings.state_dir)
    port = free_port()
    proc = DanluUp().start_mlflow(settings, port, {**os.environ, str(MLFLOW_AUTH_SECRET): secret})
    url = f"http://127.0.0.1:{port}{PREFIX}"
    try:
        wait_http(f"{url}/health", 300, proc, "MLflow")
        users = MlflowUsers(url, secret)

        async def provision():
            for name in ("alice", "bob"):
                await users.ensure_user(name)
            await users.ensure_user("root", admin=True)

        asyncio.run(provision())
        yield url, secret
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# A job's code: what every job does, then what a hostile one tries, with the environment its runner gives it
HOSTILE_JOB = r"""
import json, os, uuid, requests, mlflow
from mlflow import MlflowClient
out = {}
with mlflow.start_run(run_id=os.environ["HOSTILE_RUN_ID"]) as run:  # the run the service made for the job
    mlflow.log_param("lr", 0.1)
    mlflow.log_metric("loss", 0.5, step=1)
    mlflow.log_text("hello", "notes.txt")
out["logged"] = MlflowClient().get_run(run.info.run_id).data.metrics
base = os.environ["MLFLOW_TRACKING_URI"]
auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
for key, path, body in (
    ("secret", "/ajax-api/3.0/mlflow/gateway/secrets/create", {"secret_name": "k", "secret_value": "v"}),
    ("webhook", "/api/2.0/mlflow/webhooks", {"name": "w", "url": "http://127.0.0.1:1/x", "events": []}),
    ("register", "/api/2.0/mlflow/registered-models/create", {"name": "bobs-" + uuid.uuid4().hex[:6]}),
    ("squat", "/api/2.0/mlflow/experiments/create", {"name": "alice/" + uuid.uuid4().hex[:6]}),
):
    r = requests.post(base + path, json=body, auth=auth, timeout=30)
    out[key] = [r.status_code, r.json() if r.headers.get("content-type") == "application/json" else r.text[:200]]
try:
    MlflowClient().create_registered_model("bobs-client-" + uuid.uuid4().hex[:6])
    out["client_register"] = "created"
except Exception as e:
    out["client_register"] = str(e)[:300]
print(json.dumps(out))
"""


@pytest.mark.service
def test_a_job_logs_as_before_and_is_refused_what_the_gateway_refuses(mlflow_server, tmp_path):
    url, secret = mlflow_server
    # what the jobs service gives an attempt of bob's job: its run, and credentials for that run alone
    opened = asyncio.run(
        MlflowAccess(url, secret).open_run(uuid.uuid4().hex[:12], 1, "bob", f"bob/job-{uuid.uuid4().hex[:6]}", None, {})
    )
    job_env = {**opened["env"], "HOSTILE_RUN_ID": opened["run_id"]}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_JOB],
        env={**environ, **job_env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["logged"] == {"loss": 0.5}
    for key, reason in (
        ("secret", "ai_gateway"),
        ("webhook", "webhooks"),
        ("register", "registry_writes"),
        ("squat", "experiment_not_yours"),
    ):
        status, body = out[key]
        assert status == 403 and isinstance(body, dict) and body["reason"] == reason, (key, out[key])
    # MLflow's client says what Danlu said, as one of its own errors
    assert out["client_register"].startswith("PERMISSION_DENIED: POST /api/2.0/mlflow/registered-models/create")
    assert "danlu models" in out["client_register"], out["client_register"]


@pytest.mark.service
def test_the_service_and_admins_keep_their_calls(mlflow_server):
    url, secret = mlflow_server
    service = {"Authorization": basic_authorization(SERVICE_ACCOUNT, secret)}
    name = f"danlus-{uuid.uuid4().hex[:6]}"
    r = requests.post(
        f"{url}/api/2.0/mlflow/registered-models/create", json={"name": name}, headers=service, timeout=30
    )
    assert r.status_code == 200, r.text
    r = requests.get(f"{url}/api/2.0/mlflow/users/get", params={"username": "bob"}, headers=service, timeout=30)
    assert r.status_code == 200, r.text
    # a false claim to be the service is MLflow's 401, on a route the rules would refuse anyone else
    r = requests.post(
        f"{url}/api/2.0/mlflow/registered-models/create", json={"name": name + "x"}, auth=(SERVICE_ACCOUNT, "no")
    )
    assert r.status_code == 401, r.text
    root = ("root", password(secret, "root"))
    r = requests.post(
        f"{url}/api/2.0/mlflow/experiments/create", json={"name": f"alice/by-root-{name}"}, auth=root, timeout=30
    )
    assert r.status_code == 200, r.text  # an admin may create in anyone's name space, as through the gateway
    r = requests.post(f"{url}/api/2.0/mlflow/experiments/create", json={"name": f"alice/{name}"}, timeout=30)
    assert r.status_code == 403 and r.json()["reason"] == "experiment_not_yours", r.text
