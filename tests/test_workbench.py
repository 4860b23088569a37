"""Service tier: the whole workbench through its real components.

A real ``danlu up`` (JupyterHub + configurable-http-proxy + the jobs service +
MLflow), a real JupyterLab server for alice, real kernels, papermill and
torchrun (gloo on the CPU). Checked through the REST APIs only.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import requests

from danlu.hub.service.validation import check_schema
from danlu.hub.testing import RemoteKernel

from .conftest import job_processes

pytestmark = pytest.mark.service

SETUP = """%%train_setup
import torch, torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
"""

TRAIN_BODY = """dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=lr)
writer = SummaryWriter()
for step in range(steps):
    x = torch.randn(16, 4)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    writer.add_scalar("loss", loss.item(), step)
writer.close()
print(f"rank {rank} of {dist.get_world_size()} finished, loss {loss.item():.4f}")
dist.destroy_process_group()
"""

STEPS = 25


@pytest.fixture(scope="module")
def alice_job(workbench):
    """alice starts a server with a profile and runs a %%train --nproc 2 --wait cell on its kernel."""
    wb = workbench
    token = wb.tokens["alice"]
    r = wb.start_server("alice", {"profile": "python", "gpus": 0})
    assert r.status_code in (201, 202), r.text
    kernel = RemoteKernel(wb, "alice", token, path="work/mnist.ipynb")
    assert kernel.execute("%load_ext danlu")["status"] == "ok"
    made = kernel.execute(
        "import os; os.makedirs('data', exist_ok=True); open('data/train.csv', 'w').write('x,y\\n1,2\\n3,4\\n')"
    )
    assert made["status"] == "ok", made
    git = kernel.execute(
        "!git init -q . && git add -A && git -c user.name=t -c user.email=t@example.com "
        "commit -qm start && git rev-parse HEAD"
    )
    assert git["status"] == "ok", git
    setup = kernel.execute(SETUP, cell_id="setup-cell")
    assert setup["status"] == "ok", setup
    cell = f"%%train --nproc 2 --param lr=0.05 --param steps={STEPS} --dataset data/train.csv --wait\n" + TRAIN_BODY
    result = kernel.execute(cell, cell_id="train-cell")
    assert result["status"] == "ok", result
    jobs = wb.api("GET", "/jobs", token=token).json()["jobs"]
    job = next(j for j in jobs if j["source"].get("cell_id") == "train-cell")
    return {
        "job": job,
        "output": result["stdout"],
        "token": token,
        "commit": git["stdout"].split()[-1],
        "kernel": kernel,
    }


def test_train_cell_job_succeeds(alice_job):
    job = alice_job["job"]
    check_schema("Job", job)  # the API answers what its OpenAPI document says
    assert job["state"] == "succeeded", job
    assert job["resources"] == {"nproc": 2, "nodes": 1, "gpus": 0, "gpu_type": None, "cpu": 2.0, "memory": 0.0}
    assert job["profile"] == "python"
    assert job["source"]["notebook_path"] == "work/mnist.ipynb"
    assert job["source"]["included_cells"] == ["setup-cell"]
    assert "rank 0 of 2 finished" in alice_job["output"]
    assert "rank 1 of 2 finished" in alice_job["output"]
    assert [a["state"] for a in job["attempts"]] == ["succeeded"]


def test_job_output_notebooks(workbench, alice_job):
    job, token = alice_job["job"], alice_job["token"]
    rank0 = workbench.api("GET", f"/jobs/{job['id']}/output", token=token)
    assert rank0.status_code == 200
    assert rank0.headers["Content-Type"].startswith("application/x-ipynb+json")
    text = json.dumps(rank0.json())
    assert "rank 0 of 2 finished" in text
    rank1 = workbench.api("GET", f"/jobs/{job['id']}/output?rank=1", token=token).json()
    assert "rank 1 of 2 finished" in json.dumps(rank1)
    tags = [c["metadata"].get("tags", []) for c in rank0.json()["cells"]]
    assert ["parameters"] in tags and ["danlu-setup"] in tags and ["danlu-cell"] in tags


def _one_run(wb, token, job_id):
    r = wb.mlflow(
        "POST",
        "/api/2.0/mlflow/runs/search",
        token=token,
        json={
            "experiment_ids": [
                e["experiment_id"]
                for e in wb.mlflow(
                    "POST", "/api/2.0/mlflow/experiments/search", token=token, json={"max_results": 1000}
                ).json()["experiments"]
            ],
            "filter": f"tags.`danlu.job_id` = '{job_id}'",
        },
    )
    assert r.status_code == 200, r.text
    runs = r.json().get("runs", [])
    assert len(runs) == 1, f"expected exactly one MLflow run for job {job_id}, found {len(runs)}"
    return runs[0]


def test_one_mlflow_run_with_params_tags_metrics_dataset(workbench, alice_job):
    wb, job, token = workbench, alice_job["job"], alice_job["token"]
    run = _one_run(wb, token, job["id"])
    assert run["info"]["run_id"] == job["mlflow_run_id"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["lr"] == "0.05" and params["steps"] == str(STEPS)
    assert params["resources.nproc"] == "2" and params["resources.gpus"] == "0"
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["danlu.cell_sha256"] == hashlib.sha256(TRAIN_BODY.encode()).hexdigest()
    assert tags["danlu.user"] == "alice" and tags["danlu.profile"] == "python"
    assert tags["danlu.notebook_path"] == "work/mnist.ipynb" and tags["danlu.cell_id"] == "train-cell"
    assert tags["mlflow.source.git.commit"] == alice_job["commit"]
    history = wb.mlflow(
        "GET", f"/api/2.0/mlflow/metrics/get-history?run_id={job['mlflow_run_id']}&metric_key=loss", token=token
    ).json()["metrics"]
    # rank 0 only: one point per step
    assert sorted(m["step"] for m in history) == list(range(STEPS))
    inputs = run["inputs"]["dataset_inputs"]
    assert len(inputs) == 1
    assert inputs[0]["dataset"]["name"] == "data/train.csv"
    assert json.loads(inputs[0]["dataset"]["profile"])["sha256"].startswith(inputs[0]["dataset"]["digest"])


def test_mlflow_artifacts(workbench, alice_job):
    wb, job, token = workbench, alice_job["job"], alice_job["token"]
    listing = wb.mlflow(
        "GET", f"/api/2.0/mlflow/artifacts/list?run_id={job['mlflow_run_id']}&path=notebooks", token=token
    ).json()
    names = {f["path"] for f in listing.get("files", [])}
    assert {"notebooks/input.ipynb", "notebooks/output.ipynb"} <= names
    logs = wb.mlflow(
        "GET", f"/api/2.0/mlflow/artifacts/list?run_id={job['mlflow_run_id']}&path=logs", token=token
    ).json()
    assert {f["path"] for f in logs.get("files", [])} == {"logs/job.log"}


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/jobs/{id}"),
        ("GET", "/jobs/{id}/logs"),
        ("GET", "/jobs/{id}/logs?follow=true"),
        ("POST", "/jobs/{id}/cancel"),
        ("GET", "/jobs/{id}/output"),
        ("GET", "/jobs/{id}/input"),
    ],
)
def test_bob_cannot_touch_alices_job(workbench, alice_job, method, path):
    r = workbench.api(method, path.format(id=alice_job["job"]["id"]), token=workbench.tokens["bob"])
    assert r.status_code == 404, r.text
    assert r.json()["reason"] == "no_such_job"
    assert "rank 0" not in r.text


def test_bob_lists_only_his_jobs(workbench, alice_job):
    bob = workbench.tokens["bob"]
    ids = [j["id"] for j in workbench.api("GET", "/jobs", token=bob).json()["jobs"]]
    assert alice_job["job"]["id"] not in ids
    r = workbench.api("GET", "/jobs?owner=alice", token=bob)
    assert r.status_code == 403 and r.json()["field"] == "owner"
    # admins see everyone's jobs
    admin = workbench.api("GET", "/jobs?owner=alice", token=workbench.tokens["admin"]).json()["jobs"]
    assert alice_job["job"]["id"] in [j["id"] for j in admin]


def test_profile_outside_groups_is_refused(workbench):
    alice = workbench.tokens["alice"]
    profiles = workbench.api("GET", "/profiles", token=alice).json()
    assert [p["slug"] for p in profiles["profiles"]] == ["python"]
    r = workbench.api(
        "POST",
        "/jobs",
        token=alice,
        json={
            "notebook": {
                "cells": [
                    {
                        "cell_type": "code",
                        "source": "1",
                        "metadata": {},
                        "outputs": [],
                        "execution_count": None,
                        "id": "c1",
                    }
                ],
                "metadata": {},
                "nbformat": 4,
                "nbformat_minor": 5,
            },
            "profile": "gpu-vision",
        },
    )
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["reason"] == "profile_not_allowed" and body["field"] == "profile"
    assert "gpu-vision" in body["message"] and "vision" in body["message"] and "research" in body["message"]


def test_profile_refused_at_spawn(workbench):
    r = workbench.start_server("bob", {"profile": "gpu-vision", "gpus": 1})
    assert r.status_code == 403, r.text
    assert "gpu-vision" in r.json()["message"] and "vision" in r.json()["message"]
    carol_profiles = workbench.api("GET", "/profiles", token=workbench.tokens["carol"]).json()
    assert {p["slug"] for p in carol_profiles["profiles"]} == {"python", "gpu-vision"}


def test_server_gpus_are_exclusive_and_released(workbench):
    wb = workbench
    carol = wb.tokens["carol"]
    r = wb.start_server("carol", {"profile": "gpu-vision", "gpus": 1})
    assert r.status_code in (201, 202), r.text
    kernel = RemoteKernel(wb, "carol", carol, path="gpu.ipynb")
    seen = kernel.execute("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")["stdout"].strip()
    # the server's start asked for a warm runner of its profile's kernel, so carol's first job need not start one
    deadline = time.monotonic() + 120
    while not any("--warm" in p.cmdline() and "danlu-gpu-vision" in p.cmdline() for p in wb.processes()):
        assert time.monotonic() < deadline, "no warm runner for gpu-vision after carol's server started"
        time.sleep(0.5)
    ledger = wb.api("GET", "/allocations").json()["allocations"]
    assert [(a["holder_kind"], a["holder_id"], a["device"]) for a in ledger] == [("server", "carol", int(seen))]
    # a 2-GPU job must wait while carol's server holds one of the two devices
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "source": "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "id": "c1",
            }
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    job = wb.api(
        "POST", "/jobs", token=carol, json={"notebook": nb, "resources": {"gpus": 2}, "profile": "gpu-vision"}
    ).json()
    assert job["state"] == "queued"
    assert job["queue_position"] == 1
    assert "waiting for 2 `sim` GPUs: default uses 1/2, 1 free on the machine" in job["reason"]
    assert wb.hub("DELETE", "/users/carol/server").status_code in (202, 204)
    done = wb.wait_job(job["id"], carol)
    assert done["state"] == "succeeded", done
    assert done["attempts"][0]["devices"] == [0, 1]
    assert wb.api("GET", "/allocations").json()["allocations"] == []


def test_warming_a_runner_is_for_oneself_and_a_profile_one_may_use(workbench):
    wb = workbench
    bob = wb.tokens["bob"]
    r = wb.api("POST", "/runners/warm", token=bob, json={})
    assert r.status_code == 202 and r.json() == {"user": "bob", "profile": "python", "warming": True}, r.text
    r = wb.api("POST", "/runners/warm", token=bob, json={"user": "alice"})
    assert r.status_code == 403 and r.json()["field"] == "user", r.text
    r = wb.api("POST", "/runners/warm", token=bob, json={"profile": "gpu-vision"})
    assert r.status_code == 403 and "vision" in r.json()["message"], r.text
    r = wb.api("POST", "/runners/warm", token=bob, json={"profile": "nope"})
    assert r.status_code == 404 and r.json()["field"] == "profile", r.text
    r = wb.api("POST", "/runners/warm", token=bob, json={"user": "bob", "gpus": 1})
    assert r.status_code == 422 and "gpus" in r.json()["message"], r.text
    r = wb.api("POST", "/runners/warm", json={"user": "carol", "profile": "gpu-vision"})  # the hub's own token
    assert r.status_code == 202 and r.json()["warming"] is True, r.text


def test_mlflow_is_behind_the_hub_login(workbench):
    url = f"{workbench.url}/services/mlflow/api/2.0/mlflow/experiments/search?max_results=5"
    anonymous = requests.get(url, timeout=30)
    assert anonymous.status_code == 401
    assert requests.get(url, headers={"Authorization": "token not-a-token"}, timeout=30).status_code == 403
    assert (
        requests.get(url, headers={"Authorization": f"token {workbench.tokens['bob']}"}, timeout=30).status_code == 200
    )
    browser = requests.get(
        f"{workbench.url}/services/mlflow/", headers={"Accept": "text/html"}, allow_redirects=False, timeout=30
    )
    assert browser.status_code == 302 and "/hub/api/oauth2/authorize" in browser.headers["Location"]


def test_cancel_nproc2_job_ends_every_process(workbench):
    wb = workbench
    alice = wb.tokens["alice"]
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "id": "c1",
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "source": "import subprocess, time\nchild = subprocess.Popen(['sleep', '600'])\n"
                "print('started', flush=True)\ntime.sleep(600)",
            }
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    job = wb.api("POST", "/jobs", token=alice, json={"notebook": nb, "resources": {"nproc": 2}}).json()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log = wb.api("GET", f"/jobs/{job['id']}/logs", token=alice).text
        if log.count("started") >= 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"job never started both ranks:\n{log}")
    before = job_processes(job["id"])
    assert len(before) >= 6  # torchrun, 2 rank workers, 2 kernels, 2 sleeps (+ the runner)
    r = wb.api("POST", f"/jobs/{job['id']}/cancel", token=alice)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    assert job_processes(job["id"]) == []
    assert all(not p.is_running() or p.status() == "zombie" for p in before)
    again = wb.api("POST", f"/jobs/{job['id']}/cancel", token=alice)
    assert again.status_code == 409 and again.json()["reason"] == "already_final"


def test_train_without_wait_shows_a_live_job_card(workbench, alice_job):
    kernel = alice_job["kernel"]
    shown = kernel.execute("%%train --name carded\nprint('from a card job')")
    assert shown["status"] == "ok", shown
    assert any("application/vnd.jupyter.widget-view+json" in o["data"] for o in shown["outputs"])
    token = alice_job["token"]
    job = next(j for j in workbench.api("GET", "/jobs", token=token).json()["jobs"] if j["name"] == "carded")
    assert workbench.wait_job(job["id"], token)["state"] == "succeeded"


def test_magic_mistakes_are_one_line_usage_errors(workbench, alice_job):
    kernel = alice_job["kernel"]
    for line, message in (
        ("%%train --profile gpu-vision", "restricted to groups vision"),
        ("%%train --param 1x=2", "not a usable Python name"),
        ("%%train --nproc 0", "--nproc must be at least 1"),
    ):
        result = kernel.execute(f"{line}\nprint(1)")
        assert result["status"] == "error"
        assert result["stderr"].startswith("UsageError: ") and message in result["stderr"], result
        assert "Traceback" not in result["stderr"] + result["stdout"]
    unreachable = kernel.execute("import os; os.environ['DANLU_URL'] = 'http://127.0.0.1:9'")
    assert unreachable["status"] == "ok"
    result = kernel.execute("%%train\nprint(1)")
    assert "cannot reach the Danlu jobs service" in result["stderr"] and "DANLU_URL" in result["stderr"]
    kernel.execute(f"os.environ['DANLU_URL'] = {workbench.url!r}")


def _submit(wb, token, source: str, **extra) -> dict:
    nb = {
        "cells": [
            {"cell_type": "code", "id": f"c{i}", "metadata": {}, "outputs": [], "execution_count": None, "source": cell}
            for i, cell in enumerate(source.split("\n#%%\n"))
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    r = wb.api("POST", "/jobs", token=token, json={"notebook": nb, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def test_failing_cell_fails_the_job_and_keeps_what_was_logged(workbench):
    alice = workbench.tokens["alice"]
    job = _submit(
        workbench,
        alice,
        "from torch.utils.tensorboard import SummaryWriter\nw = SummaryWriter()\n"
        "for i in range(5):\n    w.add_scalar('before_crash', i, i)\n#%%\n1 / 0",
        name="crash",
    )
    done = workbench.wait_job(job["id"], alice)
    assert done["state"] == "failed"
    assert "ZeroDivisionError" in done["reason"] and "cell" in done["reason"]
    run = workbench.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={done['mlflow_run_id']}", token=alice).json()
    assert run["run"]["info"]["status"] == "FAILED"
    history = workbench.mlflow(
        "GET",
        f"/api/2.0/mlflow/metrics/get-history?run_id={done['mlflow_run_id']}&metric_key=before_crash",
        token=alice,
    ).json()["metrics"]
    assert sorted(m["step"] for m in history) == [0, 1, 2, 3, 4]
    output = workbench.api("GET", f"/jobs/{job['id']}/output", token=alice).json()
    assert "ZeroDivisionError" in json.dumps(output)


def test_framework_autolog_and_log_dataset_land_in_the_jobs_run(workbench):
    alice = workbench.tokens["alice"]
    job = _submit(
        workbench,
        alice,
        "import numpy as np, danlu\n"
        "np.savetxt('tabular.csv', np.arange(20.0).reshape(10, 2), delimiter=',')\n"
        "danlu.log_dataset('tabular.csv', name='tabular')\n"
        "from sklearn.linear_model import LinearRegression\n"
        "data = np.loadtxt('tabular.csv', delimiter=',')\n"
        "LinearRegression(fit_intercept=False).fit(data[:, :1], data[:, 1])",
        name="sk",
    )
    done = workbench.wait_job(job["id"], alice)
    assert done["state"] == "succeeded", workbench.api("GET", f"/jobs/{job['id']}/logs", token=alice).text
    run = _one_run(workbench, alice, job["id"])
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params.get("fit_intercept") == "False"  # from mlflow.autolog() for sklearn
    assert any(m["key"].startswith("training_") for m in run["data"]["metrics"])
    names = [d["dataset"]["name"] for d in run["inputs"]["dataset_inputs"]]
    assert "tabular" in names  # sklearn's autolog adds the training data it saw too


def test_browser_links_go_through_the_hub_login(workbench, alice_job):
    job = alice_job["job"]
    for path in (f"/services/danlu/api/v1/jobs/{job['id']}/output?format=html", "/services/danlu/"):
        r = requests.get(f"{workbench.url}{path}", headers={"Accept": "text/html"}, allow_redirects=False, timeout=30)
        assert r.status_code == 302 and "/hub/api/oauth2/authorize" in r.headers["Location"], (path, r.text)
    html = workbench.api("GET", f"/jobs/{job['id']}/output?format=html", token=alice_job["token"])
    assert html.headers["Content-Type"].startswith("text/html") and "rank 0 of 2 finished" in html.text
    page = requests.get(
        f"{workbench.url}/services/danlu/", headers={"Authorization": f"token {alice_job['token']}"}, timeout=30
    )
    assert page.status_code == 200 and job["id"] in page.text
    assert (
        job["id"]
        not in requests.get(
            f"{workbench.url}/services/danlu/",
            timeout=30,
            headers={"Authorization": f"token {workbench.tokens['bob']}"},
        ).text
    )
