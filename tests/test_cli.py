"""The ``danlu`` CLI against a real workbench: one API call per command, one clear line per mistake."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest

pytestmark = pytest.mark.service


def danlu(wb, *args, token=None, url=None):
    env = {**os.environ, "DANLU_URL": url or wb.url, "DANLU_TOKEN": token or wb.tokens["alice"]}
    env.pop("JUPYTERHUB_API_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "danlu", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def notebook_file(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("greeting = 'hello'", metadata={"tags": ["parameters"]}))
    nb.cells.append(nbformat.v4.new_code_cell("print(greeting, 'from the CLI')"))
    path = tmp_path / "cli.ipynb"
    nbformat.write(nb, path)
    return path


def test_submit_wait_list_show_logs(workbench, notebook_file):
    done = danlu(
        workbench, "jobs", "submit", str(notebook_file), "-p", "greeting", "bonjour", "--name", "cli-job", "--wait"
    )
    assert done.returncode == 0, done.stderr
    assert "bonjour from the CLI" in done.stdout
    job_id = done.stdout.split()[1]
    listed = danlu(workbench, "jobs", "list")
    assert job_id in listed.stdout and "cli-job" in listed.stdout
    shown = json.loads(danlu(workbench, "jobs", "show", job_id, "--json").stdout)
    assert shown["state"] == "succeeded" and shown["parameters"] == {"greeting": "bonjour"}
    logs = danlu(workbench, "jobs", "logs", job_id, "--tail", "50")
    assert "bonjour from the CLI" in logs.stdout
    # bob sees none of it
    assert job_id not in danlu(workbench, "jobs", "list", token=workbench.tokens["bob"]).stdout
    hidden = danlu(workbench, "jobs", "show", job_id, token=workbench.tokens["bob"])
    assert hidden.returncode == 2 and hidden.stderr.startswith(f"danlu: job {job_id} not found")
    assert "danlu jobs list" in hidden.stderr and "Traceback" not in hidden.stderr


def test_mistakes_are_one_line_and_exit_2(workbench, notebook_file, tmp_path):
    cases = [
        (("jobs", "submit", str(tmp_path / "missing.ipynb")), "no such notebook"),
        (("jobs", "submit", str(notebook_file), "--profile", "gpu-vision"), "restricted to groups vision"),
        (("jobs", "submit", str(notebook_file), "--nproc", "0"), "resources.nproc must be at least 1"),
        (("jobs", "show", "not-an-id"), "is not a job id"),
    ]
    for args, message in cases:
        done = danlu(workbench, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert message in done.stderr, done.stderr
    finished = danlu(workbench, "jobs", "submit", str(notebook_file), "--wait")
    job_id = finished.stdout.split()[1]
    again = danlu(workbench, "jobs", "cancel", job_id)
    assert again.returncode == 2 and "already ended" in again.stderr
    unreachable = danlu(workbench, "jobs", "list", url="http://127.0.0.1:9")
    assert unreachable.returncode == 2 and "DANLU_URL" in unreachable.stderr
    assert len(unreachable.stderr.strip().splitlines()) == 1


def test_profiles_command(workbench):
    done = danlu(workbench, "profiles", token=workbench.tokens["carol"])
    assert done.returncode == 0
    assert "* python" in done.stdout and "gpu-vision" in done.stdout


def test_list_follows_pages_and_json_has_the_apis_fields(workbench, notebook_file):
    mine = [
        danlu(workbench, "jobs", "submit", str(notebook_file), "--name", f"page-{i}").stdout.split()[1]
        for i in range(3)
    ]
    api = workbench.api("GET", "/jobs", token=workbench.tokens["alice"], params={"limit": 1000}).json()
    assert api["next_cursor"] is None and [j["id"] for j in api["jobs"]][:3] == mine[::-1]
    two = danlu(workbench, "jobs", "list", "--limit", "2")
    assert two.returncode == 0 and [line.split()[0] for line in two.stdout.splitlines()] == mine[:0:-1]
    assert two.stderr.startswith("more jobs: add --all, or --cursor ")
    rest = danlu(workbench, "jobs", "list", "--json", "--all", "--cursor", two.stderr.split()[-5])
    assert [j["id"] for j in json.loads(rest.stdout)] == [j["id"] for j in api["jobs"]][2:] and not rest.stderr
    everything = json.loads(danlu(workbench, "jobs", "list", "--all", "--json").stdout)
    assert [j["id"] for j in everything] == [j["id"] for j in api["jobs"]]
    assert set(everything[0]) == set(workbench.api("GET", f"/jobs/{mine[-1]}", token=workbench.tokens["alice"]).json())
    bad = danlu(workbench, "jobs", "list", "--cursor", "nope")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "cursor 'nope' is not a cursor of GET /jobs" in bad.stderr
    none = danlu(workbench, "jobs", "list", "--json", token=workbench.create_user("dora"))
    assert none.returncode == 0 and json.loads(none.stdout) == [] and not none.stderr


SAVES_WHEN_ASKED = """import json, os, time, urllib.request
api, job, attempt = os.environ["DANLU_RUNNER_API"], os.environ["DANLU_JOB_ID"], os.environ["DANLU_ATTEMPT"]
auth = {"Authorization": "Bearer " + os.environ["DANLU_JOB_TOKEN"], "Content-Type": "application/json"}
base = f"{api}/runner/jobs/{job}/attempts/{attempt}"
save = 0
for _ in range(1500):  # as danlu.resumable polls GET .../stop, until a save is asked for
    save = json.load(urllib.request.urlopen(urllib.request.Request(base + "/stop", headers=auth), timeout=30))["save"]
    if save:
        break
    time.sleep(0.2)
body = json.dumps({"event": "checkpoint", "step": 1500}).encode()
urllib.request.urlopen(urllib.request.Request(base + "/events", data=body, headers=auth), timeout=30).read()
print("saved for request", save, flush=True)
"""


def test_jobs_checkpoint_asks_a_running_job_to_save_and_show_says_the_step(workbench, tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(SAVES_WHEN_ASKED))
    path = tmp_path / "saver.ipynb"
    nbformat.write(nb, path)
    submitted = danlu(workbench, "jobs", "submit", str(path), "--name", "saver")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[1]
    for _ in range(600):  # 409 not_running (exit 2) while it is queued or starting
        asked = danlu(workbench, "jobs", "checkpoint", job_id, "--json")
        if asked.returncode == 0:
            break
        assert "only a running job can save" in asked.stderr, asked.stderr
    assert json.loads(asked.stdout) == {"id": job_id, "save": 1}
    done = danlu(workbench, "jobs", "logs", job_id, "--follow")
    assert "saved for request 1" in done.stdout
    shown = danlu(workbench, "jobs", "show", job_id)
    assert shown.returncode == 0 and "checkpoint: step 1500, " in shown.stdout and "(attempt 1)" in shown.stdout
    again = danlu(workbench, "jobs", "checkpoint", job_id)
    assert again.returncode == 2 and "is succeeded: only a running job can save" in again.stderr
    hidden = danlu(workbench, "jobs", "checkpoint", job_id, token=workbench.tokens["bob"])
    assert hidden.returncode == 2 and f"job {job_id} not found" in hidden.stderr
