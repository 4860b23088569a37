"""Service tier: catalog versions in real jobs, recorded on a real MLflow server, and followed both ways.

One jobs service for the module (:class:`~.servicekit.RunnerAPIService` on the local backend: real runners,
papermill, real kernels, the runner API on a loopback port) and one MLflow server as ``danlu up`` starts it
(basic auth, jobs log as their owner). alice registers ``faces`` (research only), ``holdout`` and ``extra``.
Her job names ``faces`` by its bare name and ``holdout`` as an evaluation dataset, and its cell asks for
``extra@1`` with ``danlu.dataset``: the three are inputs of its MLflow run with their digests and contexts,
the job's ``inputs`` and each version's ``used_by``. bob's job asking for ``faces@1`` gets a 404 in its cell.
A running job's kernel holds the runner API and its token; requests with a wrong token (checked before the
body is read), another job's token or a ref that is not one are refused over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import requests
import yaml

from danlu import env
from danlu.hub.config import load_settings
from danlu.hub.mlflow_auth import password
from danlu.hub.service.mlflow_client import MlflowAccess
from danlu.hub.testing import free_port
from danlu.jobdir import JobDir

from .fakes import admin, final, make_settings, notebook, until, user
from .servicekit import RunnerAPIService
from .test_backend_conformance import local_backend, texts, waiting

pytestmark = pytest.mark.service

ALICE = user("alice", "research")
BOB = user("bob")
PATIENCE = 180.0


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """The MLflow server as danlu up starts it (DanluUp.start_mlflow): basic auth, a secret of its own."""
    from danlu.hub import mlflow_auth
    from danlu.hub.app import DanluUp, wait_http

    folder = tmp_path_factory.mktemp("mlflow")
    (folder / "danlu.yaml").write_text(yaml.safe_dump({}))
    settings = load_settings(folder / "danlu.yaml", {"state_dir": str(folder / "state")})
    (settings.state_dir / "logs").mkdir(parents=True)
    secret = mlflow_auth.ensure_secret(settings.state_dir)
    port = free_port()
    proc = DanluUp().start_mlflow(settings, port, {**os.environ, str(env.MLFLOW_AUTH_SECRET): secret})
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


@pytest.fixture(scope="module")
def svc(tmp_path_factory, mlflow_server):
    url, secret = mlflow_server
    state = tmp_path_factory.mktemp("dataset-uses")
    settings = make_settings(state, jobs={"warm_runners": 0, "grace_period_seconds": 3})
    service = RunnerAPIService(state, local_backend, settings=settings, mlflow=MlflowAccess(url, secret)).open()
    for name in ("alice", "bob"):
        settings.user_home(name).mkdir(parents=True, exist_ok=True)
    service.mlflow_url, service.secret = url, secret
    try:
        yield service
    finally:
        service.close()
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in service.processes()]
    assert left == [], f"processes of the service's runners left after it stopped: {left}"


def write(folder, files: dict[str, str]):
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def submit(svc, who, *sources, **fields) -> str:
    status, body = svc.run(svc.manager.submit(who, {"notebook": notebook(*sources), **fields}))
    assert status == 201, body
    return body["id"]


def done(svc, job_id: str) -> dict:
    return svc.run(final(svc.manager, job_id, patience=PATIENCE, every=0.2))


def output(svc, job_id: str) -> str:
    async def read():
        return await svc.manager.read_output(await svc.manager.get(admin(), job_id), 0, 0, 16 << 20)

    return texts(json.loads(svc.run(read())[0]))


def run_of(svc, run_id: str, who: str = "alice") -> dict:
    r = requests.get(
        f"{svc.mlflow_url}/api/2.0/mlflow/runs/get",
        params={"run_id": run_id},
        auth=(who, password(svc.secret, who)),
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["run"]


@pytest.fixture(scope="module")
def versions(svc):
    home = svc.settings.user_home("alice")
    write(home / "data" / "faces", {"a.csv": "x,y\n1,2\n"})
    write(home / "data" / "holdout", {"h.csv": "x,y\n3,4\n"})
    write(home / "data" / "extra", {"e.txt": "extra"})
    out = {}
    for name, groups in (("faces", ["research"]), ("holdout", []), ("extra", [])):
        status, out[name] = svc.run(
            svc.manager.datasets.register(ALICE, {"name": name, "path": f"data/{name}", "read_groups": groups})
        )
        assert status == 201, out[name]
    return out


@pytest.fixture(scope="module")
def alice_job(svc, versions):
    job_id = submit(
        svc,
        ALICE,
        "import danlu\npath = danlu.dataset('extra@1')\nprint('EXTRA', path, sorted(p.name for p in path.iterdir()))",
        datasets=["faces", {"ref": "holdout@1", "context": "evaluation"}],
    )
    return done(svc, job_id)


def test_the_inputs_are_on_the_mlflow_run_with_digest_and_context(svc, versions, alice_job):
    assert alice_job["state"] == "succeeded", alice_job
    run = run_of(svc, alice_job["mlflow_run_id"])
    found = {}
    for item in run["inputs"]["dataset_inputs"]:
        ds, tags = item["dataset"], {t["key"]: t["value"] for t in item.get("tags", [])}
        found[ds["name"]] = (tags["mlflow.data.context"], json.loads(ds["profile"])["sha256"], ds["digest"])
    assert found == {
        ref: (context, versions[name]["digest"], versions[name]["digest"][:36])
        for ref, name, context in (
            ("faces@1", "faces", "training"),
            ("holdout@1", "holdout", "evaluation"),
            ("extra@1", "extra", "training"),
        )
    }


def test_danlu_dataset_in_a_cell_returns_the_path_and_is_a_use_both_ways(svc, versions, alice_job):
    assert f"EXTRA {versions['extra']['path']} ['e.txt']" in output(svc, alice_job["id"])
    assert [(i["ref"], i["context"]) for i in alice_job["inputs"]] == [
        ("faces@1", "training"),
        ("holdout@1", "evaluation"),
        ("extra@1", "training"),
    ]
    extra = svc.run(svc.manager.datasets.version(ALICE, "extra", 1))["used_by"]
    assert [(u["job_id"], u["attempt"], u["context"], u["mlflow_run_id"]) for u in extra] == [
        (alice_job["id"], 1, "training", alice_job["mlflow_run_id"])
    ]
    holdout = svc.run(svc.manager.datasets.version(ALICE, "holdout", 1))["used_by"]
    assert [(u["job_id"], u["attempt"], u["context"]) for u in holdout] == [(alice_job["id"], None, "evaluation")]
    assert svc.run(svc.manager.datasets.version(BOB, "holdout", 1))["used_by"] == []  # not his job


def test_a_user_outside_the_read_groups_gets_a_404_from_danlu_dataset(svc, versions):
    job = done(svc, submit(svc, BOB, "import danlu\ndanlu.dataset('faces@1')"))
    assert job["state"] == "failed" and job["failure"] == "user", job
    assert "NotFound: ref: dataset faces not found" in job["reason"], job["reason"]
    assert job["inputs"] == []
    assert svc.run(svc.manager.datasets.version(ALICE, "faces", 1))["used_by"][0]["owner"] == "alice"


def test_the_runner_api_refuses_hostile_requests(svc, versions, alice_job):
    job_id = submit(svc, ALICE, waiting("waiting", "went"))

    def kernel_env() -> dict:
        for proc in svc.processes(job_id=job_id):
            environ = proc.environ()
            if environ.get(env.JOB_TOKEN) and "ipykernel" in " ".join(proc.cmdline()):
                return environ
        return {}

    environ = svc.run(until(kernel_env, "the job's kernel to start", PATIENCE, 0.2))
    token = environ[env.JOB_TOKEN]
    assert environ[env.RUNNER_API] == svc.api and environ[env.ATTEMPT] == "1"
    url = f"{svc.api}/runner/jobs/{job_id}/attempts/1/datasets"

    def post(token_: str, body, job: str = job_id) -> requests.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return requests.post(
            url.replace(job_id, job),
            data=data,
            timeout=30,
            headers={"Authorization": f"Bearer {token_}", "Content-Type": "application/json"},
        )

    good = post(token, {"ref": "holdout@latest", "context": "evaluation"})
    statuses = {
        "wrong token, body not JSON": post("x" * 43, b"{not json").status_code,  # the token first
        "not a token": post("not a token", {"ref": "holdout@1"}).status_code,
        "other job's token": post(token, {"ref": "holdout@1"}, job=alice_job["id"]).status_code,
        "not a ref": post(token, {"ref": "../holdout@1"}).status_code,
        "bare name": post(token, {"ref": "holdout"}).status_code,
        "unknown field": post(token, {"ref": "holdout@1", "owner": "admin"}).status_code,
        "unknown dataset": post(token, {"ref": "nothing@1"}).status_code,
    }
    (JobDir(svc.settings.jobs_dir / job_id).checkpoint_dir / "go").touch()
    job = done(svc, job_id)
    assert good.status_code == 200 and good.json()["digest"] == versions["holdout"]["digest"], good.text
    assert statuses == {
        "wrong token, body not JSON": 403,
        "not a token": 401,
        "other job's token": 403,
        "not a ref": 422,
        "bare name": 422,
        "unknown field": 422,
        "unknown dataset": 404,
    }
    assert job["state"] == "succeeded" and [(i["ref"], i["context"]) for i in job["inputs"]] == [
        ("holdout@1", "evaluation")
    ]
