"""Pure tests of the runner's MLflow side: the run, its tags, and what happens when MLflow is away."""

from __future__ import annotations

import socket
import time

import pytest

from danlu import tags
from danlu.jobdir import JobDir
from danlu.runner import tracking
from danlu.runner.tracking import Tracking


def spec(uri: str, **extra) -> dict:
    return {
        "job_id": "0123456789ab",
        "attempt": 1,
        "name": "train",
        "owner": "alice",
        "profile": "python",
        "queue": "default",
        "nproc": 1,
        "gpus": 0,
        "parameters": {"lr": 0.1, "name": "x"},
        "experiment": "alice/train",
        "source": {"notebook_path": "work/train.ipynb", "cell_id": "c1"},
        "cell_sha256": "ab" * 32,
        "mlflow_env": {"MLFLOW_TRACKING_URI": uri},
        **extra,
    }


def service_run(uri: str, job: dict | None = None) -> dict:
    """What the jobs service does before a runner starts: the job's run, made in its experiment."""
    from mlflow import MlflowClient

    from danlu.hub.service.mlflow_client import run_tags

    job = job or spec(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(job["experiment"])
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(job["experiment"])
    run = client.create_run(experiment_id, tags=run_tags(job))
    return {"run_id": run.info.run_id, "experiment_id": experiment_id}


@pytest.fixture
def jd(tmp_path):
    folder = JobDir(tmp_path / "job")
    folder.tensorboard_dir.mkdir(parents=True)
    return folder


def closed_port_uri() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_run_carries_the_jobs_tags_params_and_ends_finished(jd, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    made = service_run(uri)
    t = Tracking(spec(uri, tracking=made), jd, 1, [], final_timeout=5)
    reported = []
    t.start(on_run=lambda: reported.append(t.run_id))
    assert reported == [made["run_id"]] == [t.run_id]
    t.finish("succeeded")
    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[tags.JOB_ID] == "0123456789ab" and run.data.tags[tags.USER] == "alice"
    assert run.data.tags[tags.CELL_SHA256] == "ab" * 32 and run.data.tags[tags.ATTEMPT] == "1"
    assert run.data.params["lr"] == "0.1" and run.data.params["name"] == "x"
    health = t.health()
    assert health["run_id"] == t.run_id and health["experiment_id"] and health["points_dropped"] == 0


def test_a_later_attempt_resumes_the_same_run(jd, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Tracking(spec(uri, tracking=service_run(uri)), jd, 1, [], final_timeout=5)
    first.start()
    first.finish("preempted")
    second = Tracking(spec(uri, attempt=2, tracking={"run_id": first.run_id}), jd, 2, [], final_timeout=5)
    second.start()
    second.finish("succeeded")
    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(first.run_id)
    assert second.run_id == first.run_id and run.info.status == "FINISHED" and run.data.tags[tags.ATTEMPT] == "2"


def test_mlflow_away_the_job_runs_on_and_says_so(jd, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    t = Tracking(spec(closed_port_uri(), tracking={"run_id": "r" * 32}), jd, 1, [], final_timeout=1)
    t.start()
    assert any("did not answer at the start" in n for n in t.health()["notes"])
    t.finish("succeeded")
    notes = t.health()["notes"]
    assert any("did not answer while the job ran" in n for n in notes)


def test_the_runner_creates_no_run_or_experiment_of_its_own(jd, tmp_path):
    """Without the service's run the job is untracked: a run the runner made would be one no record backs."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracking(spec(uri), jd, 1, [], final_timeout=5)
    t.start()
    t.finish("succeeded")
    assert t.run_id is None and any("the service made no MLflow run" in n for n in t.health()["notes"])
    assert MlflowClient(uri).get_experiment_by_name("alice/train") is None


def test_the_run_is_resumed_late_when_mlflow_comes_back(jd, tmp_path, monkeypatch):
    monkeypatch.setattr(tracking, "RETRY_SECONDS", 0.05)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    t = Tracking(spec(uri, tracking=service_run(uri)), jd, 1, [], final_timeout=5)
    real, calls = t._connect, []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("MLflow is restarting")
        real()

    monkeypatch.setattr(t, "_connect", flaky)
    reported = []
    t.start(on_run=lambda: reported.append(t.run_id))
    deadline = time.monotonic() + 30
    while not reported and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reported and reported[0] == t.run_id
    t.finish("succeeded")
    assert any("resumed late" in n for n in t.health()["notes"])


def test_no_mlflow_configured_is_a_note_not_an_error(jd):
    t = Tracking({**spec(""), "mlflow_env": {}}, jd, 1, [])
    t.start()
    t.finish("succeeded")
    assert t.run_id is None and any("not configured" in n for n in t.health()["notes"])


def test_the_job_card_says_when_tracking_lost_something():
    from danlu.card import summary_html

    job = {
        "id": "0123456789ab",
        "name": "train",
        "state": "succeeded",
        "profile": "python",
        "resources": {"nproc": 1, "gpus": 0},
    }
    degraded = summary_html(
        {
            **job,
            "tracking": {
                "state": "degraded",
                "points_dropped": 3,
                "notes": ["metric name 'a//b' recorded as 'a/b_7a9acf33'"],
            },
        }
    )
    assert "3 metric point(s) not recorded" in degraded and "a/b_7a9acf33" in degraded
    assert "no MLflow run" in summary_html({**job, "tracking": {"state": "none"}})
    assert "MLflow:" not in summary_html({**job, "tracking": {"state": "ok", "points_dropped": 0, "notes": []}})


def test_kernels_get_the_jobs_run_and_experiment_so_unnamed_mlflow_calls_land_there(tmp_path):
    from danlu.runner.kernels import job_env

    jd = JobDir(tmp_path / "job")
    spec = {"job_id": "a" * 12, "mlflow_env": {"MLFLOW_TRACKING_URI": "http://127.0.0.1:1"}}
    env = job_env(jd, spec, "r" * 32, "7")
    assert env["MLFLOW_RUN_ID"] == "r" * 32 and env["MLFLOW_EXPERIMENT_ID"] == "7"
    assert "MLFLOW_RUN_ID" not in job_env(jd, spec, None) and "MLFLOW_EXPERIMENT_ID" not in job_env(jd, spec, None)
