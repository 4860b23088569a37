"""Service tier: nothing is lost when the jobs service dies or the workbench stops."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from danlu.hub.testing import Workbench

from .conftest import CONFIG, PROFILES

pytestmark = pytest.mark.service


def notebook(source: str) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "id": "c1", "metadata": {}, "outputs": [], "execution_count": None, "source": source}
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


SLOW_JOB = """import time
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter()
for step in range(12):
    writer.add_scalar("progress", step, step)
    time.sleep(1)
writer.close()
print("finished all steps")
"""


def wait_running(wb: Workbench, job_id: str, token: str, marker: str | None = None, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = wb.api("GET", f"/jobs/{job_id}", token=token).json()
        if job["state"] == "running" and (
            marker is None or marker in wb.api("GET", f"/jobs/{job_id}/logs", token=token).text
        ):
            return job
        assert job["state"] in ("queued", "running"), job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not start")


def service_process(wb: Workbench):
    found = [p for p in wb.processes() if "danlu.hub.service" in " ".join(p.cmdline())]
    assert len(found) == 1, found
    return found[0]


def test_sigkill_of_the_jobs_service_loses_nothing(workbench):
    wb = workbench
    alice = wb.tokens["alice"]
    job = wb.api("POST", "/jobs", token=alice, json={"notebook": notebook(SLOW_JOB), "name": "survivor"}).json()
    wait_running(wb, job["id"], alice, marker="Executing Cell 1")
    service = service_process(wb)
    service.send_signal(signal.SIGKILL)
    # it stays a zombie until JupyterHub, its parent, reaps it
    while service.is_running() and service.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    # JupyterHub restarts its managed service; the job ran on without it
    done = wb.wait_job(job["id"], alice, timeout=240)
    assert done["state"] == "succeeded", done
    assert service_process(wb).pid != service.pid
    output = wb.api("GET", f"/jobs/{job['id']}/output", token=alice)
    assert "finished all steps" in output.text
    assert "finished all steps" in wb.api("GET", f"/jobs/{job['id']}/logs", token=alice).text
    run_id = done["mlflow_run_id"]
    history = wb.mlflow(
        "GET", f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=progress", token=alice
    ).json()["metrics"]
    assert sorted(m["step"] for m in history) == list(range(12))
    run = wb.mlflow("GET", f"/api/2.0/mlflow/runs/get?run_id={run_id}", token=alice).json()["run"]
    assert run["info"]["status"] == "FINISHED"


def test_stopping_the_workbench_requeues_running_jobs_and_leaves_no_process(tmp_path):
    wb = Workbench(tmp_path, config=CONFIG, profiles=PROFILES).start()
    try:
        alice = wb.create_user("alice", ["research"])
        job = wb.api("POST", "/jobs", token=alice, json={"notebook": notebook(SLOW_JOB)}).json()
        wait_running(wb, job["id"], alice, marker="Executing Cell 1")
        assert wb.processes()
    finally:
        code = wb.stop()
    assert code == 0, wb.log_tail()
    assert wb.processes() == []
    assert "interrupted and requeued 1 running job" in wb.log_path.read_text()

    again = Workbench(tmp_path, config=CONFIG, profiles=PROFILES).start()
    try:
        done = again.wait_job(job["id"], alice, timeout=240)
        assert done["state"] == "succeeded", done
        assert [a["state"] for a in done["attempts"]] == ["failed", "succeeded"]
        assert "interrupted" in done["attempts"][0]["reason"]
        assert again.api("GET", "/allocations").json()["allocations"] == []
    finally:
        assert again.stop() == 0
    assert again.processes() == []


def test_a_second_danlu_up_on_the_same_state_folder_refuses_and_starts_nothing(workbench):
    import subprocess
    import sys

    from danlu.hub.testing import free_port

    wb = workbench
    before = {p.pid for p in wb.processes()}
    port = free_port()
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "danlu.hub",
            "up",
            "--config",
            str(wb.config_file),
            "--state-dir",
            str(wb.state),
            "--port",
            str(port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stdout + second.stderr
    assert "another danlu up" in second.stderr and str(wb.state) in second.stderr
    assert "starting MLflow" not in second.stdout
    after = wb.processes()
    # nothing of the first stopped; whatever is new is the first workbench's own (a warm runner refilled),
    # never a hub, proxy or service of the second
    assert before <= {p.pid for p in after}
    assert not [p.cmdline() for p in after if p.pid not in before and str(port) in " ".join(p.cmdline())]
    assert wb.api("GET", "/health").status_code == 200
