"""The lab extension's server part (``danlu.lab``) and ``%%train --quiet``.

Pure tier: a real Jupyter server (a subprocess, base URL ``/user/alice/``) loads
the extension and talks to :class:`FakeUpstream`, a tornado app on loopback
that plays the jobs service, MLflow's REST API and the hub API; TensorBoard is
:data:`FAKE_TENSORBOARD`, a tiny HTTP server that takes TensorBoard's options.
Service tier (one test): alice's real server in a real workbench, a tiny
``%%train --quiet`` job, its run and metric history, and a real TensorBoard
through the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from IPython.core.error import UsageError as IPythonUsageError
from IPython.core.interactiveshell import InteractiveShell
from tornado import web
from tornado.httpclient import AsyncHTTPClient
from traitlets.config import Config

import danlu
from danlu import submit, train
from danlu.hub.testing import free_port
from danlu.lab import labextension_dir
from danlu.lab.handlers import check_job_id, logdir_name, run_summary
from danlu.lab.tensorboard import logdir_set_id
from danlu.lab.upstream import Upstream

UPSTREAM_TOKEN = "server-token-0123"  # what the spawner gives the server as $JUPYTERHUB_API_TOKEN
BROWSER_TOKEN = "browser-token-4567"  # what the browser logs in to Jupyter with
A, B, C = "aaaaaaaaaaa1", "bbbbbbbbbbb2", "ccccccccccc3"  # alice's ended job, bob's job, alice's running job
RUN_A, RUN_B = "a" * 32, "b" * 32
SWEEP_A, SWEEP_B = "5eeeeeeeeea1", "5eeeeeeeeeb2"  # alice's running sweep, bob's

FAKE_TENSORBOARD = r"""
import argparse, http.server, json
p = argparse.ArgumentParser()
for option in ("--logdir_spec", "--host", "--port", "--path_prefix"):
    p.add_argument(option)
args = p.parse_args()

class Handler(http.server.BaseHTTPRequestHandler):
    def reply(self, body):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        self.reply(f"<title>TensorBoard</title>{self.path} {args.logdir_spec}")

    def do_POST(self):
        size = int(self.headers.get("Content-Length") or 0)
        self.reply("posted " + self.rfile.read(size).decode())

http.server.HTTPServer((args.host, int(args.port)), Handler).serve_forever()
"""


# the fake upstream ----------------------------------------------------------------------
def _job(job_id, owner, state, name):
    return {
        "id": job_id,
        "owner": owner,
        "state": state,
        "name": name,
        "reason": "",
        "tensorboard_dir": f"/jobs/{job_id}/tensorboard",
    }


def _run(run_id, user, job_id, experiment_id="1"):
    return {
        "info": {
            "run_id": run_id,
            "run_name": f"run-{run_id[:4]}",
            "experiment_id": experiment_id,
            "status": "FINISHED",
            "start_time": 1700000000000,
            "end_time": 1700000001000,
        },
        "data": {
            "params": [{"key": "lr", "value": "0.1"}],
            "metrics": [{"key": "loss", "value": 0.25}],
            "tags": [{"key": "danlu.user", "value": user}, {"key": "danlu.job_id", "value": job_id}],
        },
    }


def _sweep(sweep_id, owner):
    """A sweep as GET /sweeps/{id} answers it (trimmed to what the extension forwards)."""
    return {
        "id": sweep_id,
        "name": f"{owner}-sweep",
        "owner": owner,
        "state": "running",
        "counts": {"running": 1, "complete": 1, "pruned": 0, "failed": 0, "stopped": 0},
        "trials": [{"number": 0, "job_id": A, "state": "complete", "params": {"lr": 0.01}, "value": 0.5}],
        "best_curve": [{"trial": 0, "finished_at": "2024-01-01T00:00:00Z", "value": 0.5, "best": 0.5}],
    }


def model_version(name, run_id):
    """The jobs service's answer to POST /models (its API contract)."""
    return {
        "name": name,
        "version": 1,
        "run_id": run_id,
        "job_id": A,
        "source": f"runs:/{run_id}/model",
        "approval": "pending",
        "evaluation": {"state": "queued", "job_id": C, "metrics": {}, "thresholds": {"accuracy": 0.9}, "failures": []},
        "decisions": [],
        "aliases": [],
    }


LINEAGE = {
    "model": {"name": "mnist.v2", "version": 1, "approval": "pending", "aliases": []},
    "nodes": [
        {"id": "mv", "kind": "model_version", "label": "mnist.v2 v1", "detail": {}, "url": None},
        {
            "id": "run",
            "kind": "run",
            "label": "run-aaaa",
            "detail": {"status": "FINISHED"},
            "url": f"/services/mlflow/#/experiments/1/runs/{RUN_A}",
        },
    ],
    "edges": [{"from": "mv", "to": "run", "relation": "logged_by"}],
}


class FakeUpstream:
    """The jobs service, MLflow and the hub API on one loopback port, in a thread of its own."""

    def __init__(self):
        self.port = free_port()
        self.jobs = {
            A: _job(A, "alice", "succeeded", "mnist"),
            B: _job(B, "bob", "running", "bobs"),
            C: _job(C, "alice", "running", "forever"),
        }
        self.runs = {RUN_A: _run(RUN_A, "alice", A), RUN_B: _run(RUN_B, "bob", B)}
        self.cancelled: list[str] = []
        self.sweeps = {SWEEP_A: _sweep(SWEEP_A, "alice"), SWEEP_B: _sweep(SWEEP_B, "bob")}
        self.stopped: list[str] = []
        self.registrations: list[dict] = []
        self.filters: list[str] = []
        self.experiment_calls = 0
        self.followers_gone = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.server = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.listen()

    def app(self) -> web.Application:
        fake = self

        class Handler(web.RequestHandler):
            def prepare(self):
                if self.request.headers.get("Authorization") != f"token {UPSTREAM_TOKEN}":
                    raise web.HTTPError(403)

            def answer(self, data, status=200):
                self.set_status(status)
                self.finish(json.dumps(data))

            def job_or_404(self, job_id):
                if job_id not in fake.jobs:
                    self.answer({"message": f"job {job_id} not found"}, 404)
                    raise web.Finish()
                return fake.jobs[job_id]

        class Jobs(Handler):
            def get(self):  # like an admin token would: every job, so the extension must filter
                self.answer({"jobs": list(fake.jobs.values())})

        class Job(Handler):
            def get(self, job_id):
                self.answer(self.job_or_404(job_id))

        class Cancel(Handler):
            def post(self, job_id):
                job = self.job_or_404(job_id)
                fake.cancelled.append(job_id)
                self.answer({**job, "state": "cancelled"})

        class Logs(Handler):
            def on_connection_close(self):
                fake.followers_gone.set()

            async def get(self, job_id):
                job = self.job_or_404(job_id)
                assert self.get_argument("follow") == "true"
                self.write("epoch 1\nepoch 2\n")
                await self.flush()
                if job["state"] == "running":  # follows until the client hangs up
                    while True:
                        await asyncio.sleep(0.1)
                self.finish("done")  # a last line without its newline

        class Output(Handler):
            def get(self, job_id):
                self.job_or_404(job_id)
                self.finish(
                    json.dumps(
                        {
                            "cells": [
                                {"cell_type": "markdown", "id": "m1", "metadata": {}, "source": f"output of {job_id}"}
                            ],
                            "metadata": {},
                            "nbformat": 4,
                            "nbformat_minor": 5,
                        }
                    )
                )

        class Listing(Handler):
            def get(self, what):
                self.answer(
                    {"profiles": [{"slug": "python", "display_name": "Python"}]}
                    if what == "profiles"
                    else {"queues": [{"name": "default"}]}
                )

        class JobExperiments(Handler):  # the jobs service's records of the caller's runs
            def get(self):
                fake.experiment_calls += 1
                self.answer(
                    {
                        "experiments": [
                            {"experiment_id": "1", "name": "alice/mnist", "runs": 1, "latest": "2026-11-30T10:00:00Z"},
                            {
                                "experiment_id": None,
                                "name": "alice/starting",
                                "runs": 1,
                                "latest": "2026-11-30T11:00:00Z",
                            },
                        ]
                    }
                )

        class Experiments(Handler):
            def post(self):
                self.answer(
                    {
                        "experiments": [
                            {"experiment_id": "1", "name": "alice/mnist"},
                            {"experiment_id": "2", "name": "bob/other"},
                        ]
                    }
                )

        class SearchRuns(Handler):
            def post(self):
                body = json.loads(self.request.body)
                fake.filters.append(body["filter"])
                user = re.fullmatch(r"tags\.`danlu\.user` = '(\w+)'", body["filter"]).group(1)
                runs = [
                    r
                    for r in fake.runs.values()
                    if r["info"]["experiment_id"] in body["experiment_ids"]
                    and {"key": "danlu.user", "value": user} in r["data"]["tags"]
                ]
                self.answer({"runs": runs})

        class GetRun(Handler):
            def get(self):
                run_id = self.get_argument("run_id")
                if run_id not in fake.runs:
                    self.answer({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no run"}, 404)
                else:
                    self.answer({"run": fake.runs[run_id]})

        class History(Handler):
            def get(self):
                assert self.get_argument("metric_key") == "loss"
                page = self.get_argument("page_token", None)
                if page is None:  # two pages; step 1 logged twice, the later value wins
                    self.answer(
                        {
                            "metrics": [
                                {"key": "loss", "value": 1.0, "step": 0, "timestamp": 1},
                                {"key": "loss", "value": 0.9, "step": 1, "timestamp": 2},
                            ],
                            "next_page_token": "p2",
                        }
                    )
                else:
                    self.answer(
                        {
                            "metrics": [
                                {"key": "loss", "value": 0.5, "step": 1, "timestamp": 3},
                                {"key": "loss", "value": 0.25, "step": 2, "timestamp": 4},
                            ]
                        }
                    )

        class Models(Handler):
            def get(self):
                self.answer({"models": [{"name": "mnist", "latest_version": 1, "aliases": {}}]})

            def post(self):
                body = json.loads(self.request.body)
                fake.registrations.append(body)
                if body["name"] == "taken":
                    self.answer(
                        {
                            "status": 409,
                            "reason": "name_taken",
                            "field": "name",
                            "message": "model taken belongs to bob (choose another name)",
                        },
                        409,
                    )
                elif body["run_id"] not in fake.runs or fake.runs[body["run_id"]] is fake.runs[RUN_B]:
                    self.answer(
                        {
                            "status": 404,
                            "reason": "no_such_run",
                            "field": "run_id",
                            "message": f"run {body['run_id']} not found",
                        },
                        404,
                    )
                else:
                    self.answer(model_version(body["name"], body["run_id"]), 201)

        class Lineage(Handler):
            def get(self, name, version):
                if (name, version) != ("mnist.v2", "1"):
                    self.answer(
                        {
                            "status": 404,
                            "reason": "no_such_model_version",
                            "message": f"model {name} version {version} not found",
                        },
                        404,
                    )
                else:
                    self.answer(LINEAGE)

        class Sweeps(Handler):
            def get(self):  # like an admin token would: every sweep, so the extension must filter
                fake.filters.append(f"sweeps owner={self.get_argument('owner', '')}")
                self.answer({"sweeps": [{k: v for k, v in s.items() if k != "trials"} for s in fake.sweeps.values()]})

        class Sweep(Handler):
            def get(self, sweep_id):
                if sweep_id not in fake.sweeps:
                    self.answer(
                        {"status": 404, "reason": "no_such_sweep", "message": f"sweep {sweep_id} not found"}, 404
                    )
                else:
                    self.answer(fake.sweeps[sweep_id])

        class SweepStop(Handler):
            def post(self, sweep_id):
                sweep = fake.sweeps[sweep_id]
                if sweep["state"] != "running":
                    self.answer({"status": 409, "reason": "ended", "message": f"sweep {sweep_id} has ended"}, 409)
                    return
                fake.stopped.append(sweep_id)
                self.answer({**sweep, "state": "stopped"})

        class CullWarnings(Handler):
            def get(self):  # like an admin token would: every user's, so the extension must filter
                self.answer(
                    {"warnings": [{"user": "alice", "name": "", "seconds_left": 200}, {"user": "bob", "name": ""}]}
                )

        class HubUser(Handler):
            def get(self):
                self.answer({"name": "alice", "admin": False})

        api, mlflow = "/services/danlu/api/v1", "/services/mlflow/api/2.0/mlflow"
        return web.Application(
            [
                (f"{api}/jobs", Jobs),
                (f"{api}/jobs/(\\w+)", Job),
                (f"{api}/jobs/(\\w+)/cancel", Cancel),
                (f"{api}/jobs/(\\w+)/logs", Logs),
                (f"{api}/jobs/(\\w+)/output", Output),
                (f"{api}/(profiles|queues)", Listing),
                (f"{api}/servers/warnings", CullWarnings),
                (f"{api}/experiments", JobExperiments),
                (f"{mlflow}/experiments/search", Experiments),
                (f"{mlflow}/runs/search", SearchRuns),
                (f"{mlflow}/runs/get", GetRun),
                (f"{mlflow}/metrics/get-history", History),
                (f"{api}/models", Models),
                (f"{api}/lineage/models/([^/]+)/([^/]+)", Lineage),
                (f"{api}/sweeps", Sweeps),
                (f"{api}/sweeps/(\\w+)", Sweep),
                (f"{api}/sweeps/(\\w+)/stop", SweepStop),
                ("/hub/api/user", HubUser),
            ]
        )

    def _call(self, fn):
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (fn(), done.set()))
        done.wait(10)

    def listen(self):
        def start():
            self.server = self.app().listen(self.port, "127.0.0.1")

        self._call(start)

    @contextlib.contextmanager
    def down(self):
        self._call(self.server.stop)
        try:
            yield
        finally:
            self.listen()


@pytest.fixture(scope="module")
def upstream():
    return FakeUpstream()


class LabServer:
    """A Jupyter server at /user/alice/ with danlu.lab loaded, as the spawner starts it."""

    def __init__(self, tmp: Path, upstream: FakeUpstream, real_tensorboard: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/user/alice/"
        (tmp / "root").mkdir()
        fake_tb = tmp / "fake_tensorboard.py"
        fake_tb.write_text(FAKE_TENSORBOARD)
        command = (
            "" if real_tensorboard else f"c.DanluLab.tensorboard_command = [{sys.executable!r}, {str(fake_tb)!r}]\n"
        )
        (tmp / "config.py").write_text(command + "c.DanluLab.tensorboard_idle_seconds = 2\n")
        origin = f"http://127.0.0.1:{upstream.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTERHUB_", "DANLU_", "MLFLOW_"))}
        env.update(
            {
                "DANLU_URL": origin,
                "JUPYTERHUB_API_TOKEN": UPSTREAM_TOKEN,
                "JUPYTERHUB_USER": "alice",
                "MLFLOW_TRACKING_URI": f"{origin}/services/mlflow",
                "MLFLOW_TRACKING_TOKEN": UPSTREAM_TOKEN,
                "JUPYTERHUB_API_URL": f"{origin}/hub/api",
                "JUPYTER_CONFIG_DIR": str(tmp / "config"),
                "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
                "JUPYTER_DATA_DIR": str(tmp / "data"),
            }
        )
        self.log = open(tmp / "server.log", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--no-browser",
                "--allow-root",
                f"--port={self.port}",
                "--ServerApp.base_url=/user/alice/",
                f"--ServerApp.root_dir={tmp / 'root'}",
                f"--IdentityProvider.token={BROWSER_TOKEN}",
                f"--config={tmp / 'config.py'}",
                # this harness loads the server extension itself, installed in the venv or not (make install
                # enables it there, test_packaging.py checks that); no spawner passes it by argument
                "--ServerApp.jpserver_extensions=danlu.lab=True",
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.root, self.log_path = tmp / "root", tmp / "server.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if requests.get(f"{self.url}api/status", headers=self.auth, timeout=5).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"the Jupyter server did not start:\n{self.log_path.read_text()}")

    auth = {"Authorization": f"token {BROWSER_TOKEN}"}

    def get(self, path, **kwargs):
        return requests.get(f"{self.url}danlu/{path}", headers=self.auth, timeout=60, **kwargs)

    def post(self, path, **kwargs):
        return requests.post(f"{self.url}danlu/{path}", headers=self.auth, timeout=60, **kwargs)

    def tensorboards(self) -> list[psutil.Process]:
        return [
            p
            for p in psutil.Process(self.proc.pid).children()
            if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE
            and any("fake_tensorboard" in part for part in p.cmdline())
        ]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, upstream):
    server = LabServer(tmp_path_factory.mktemp("lab"), upstream)
    yield server
    children = psutil.Process(server.proc.pid).children(recursive=True)
    server.stop()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after the server stopped: {[p.cmdline() for p in alive]}"


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


# authentication and errors -----------------------------------------------------------------
@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "api/jobs"),
        ("GET", "api/whoami"),
        ("POST", f"api/jobs/{A}/cancel"),
        ("GET", f"api/jobs/{A}/logs/stream"),
        ("POST", "api/tensorboard"),
        ("GET", "api/runs?experiment_id=1"),
        ("GET", "api/models"),
        ("POST", "api/models"),
        ("GET", "api/lineage/models/mnist.v2/1"),
        ("GET", "api/sweeps"),
        ("GET", f"api/sweeps/{SWEEP_A}"),
        ("POST", f"api/sweeps/{SWEEP_A}/stop"),
    ],
)
def test_every_endpoint_needs_a_login(lab, upstream, method, path):
    r = requests.request(method, f"{lab.url}danlu/{path}", timeout=30, allow_redirects=False)
    assert r.status_code == 403
    assert "traceback" not in r.text.lower()
    assert upstream.cancelled == [] and upstream.registrations == [] and upstream.stopped == []


def test_a_browser_without_login_is_sent_to_log_in_for_tensorboard(lab):
    r = requests.get(f"{lab.url}danlu/tensorboard/{'0' * 12}/", timeout=30, allow_redirects=False)
    assert r.status_code == 302 and "login" in r.headers["Location"]


def test_whoami_names_the_servers_user_and_no_token(lab):
    r = lab.get("api/whoami")
    assert r.status_code == 200
    assert r.json() == {"user": "alice", "admin": False, "hub_url": "/hub/", "mlflow_url": "/services/mlflow/"}
    assert UPSTREAM_TOKEN not in r.text


@pytest.mark.parametrize(
    "method, path, field",
    [
        ("GET", "api/jobs/..%2F..%2Fetc%2Fpasswd", "job_id"),
        ("POST", "api/jobs/ABC/cancel", "job_id"),
        ("GET", "api/jobs/12345/logs/stream", "job_id"),
        ("GET", "api/runs?experiment_id=..%2F1", "experiment_id"),
        ("GET", "api/runs", "experiment_id"),
        ("GET", "api/metric-history?run_id=x&run_id=..%2Fy&key=loss", "run_id"),
        ("GET", f"api/metric-history?run_id={RUN_A}", "key"),
        ("GET", "api/sweeps/..%2Fjobs", "id"),
        ("POST", "api/sweeps/ABC/stop", "id"),
    ],
)
def test_bad_ids_are_refused_naming_the_field(lab, upstream, method, path, field):
    r = requests.request(method, f"{lab.url}danlu/{path}", headers=lab.auth, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field
    assert upstream.cancelled == []


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "job_ids"),
        ({"job_ids": []}, "job_ids"),
        ({"job_ids": ["../../etc"]}, "job_ids"),
        ({"run_ids": "abc"}, "run_ids"),
        ({"job_ids": [A], "run_ids": [RUN_A]}, "job_ids"),
    ],
)
def test_bad_tensorboard_requests_name_the_field(lab, body, field):
    r = lab.post("api/tensorboard", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field
    assert lab.tensorboards() == []


def test_unknown_endpoint_is_a_json_404(lab):
    r = lab.get("api/nothing-here")
    assert r.status_code == 404 and r.json()["reason"] == "no_endpoint"


def test_jobs_service_down_is_a_clear_503(lab, upstream):
    with upstream.down():
        r = lab.get("api/jobs")
        stream = lab.get(f"api/jobs/{A}/logs/stream")
    assert r.status_code == 503
    assert r.json()["message"].startswith("the Danlu jobs service is not reachable at http://127.0.0.1:")
    assert stream.status_code == 503
    assert lab.get("api/jobs").status_code == 200  # and back when it is


# jobs ----------------------------------------------------------------------------------------
def test_jobs_are_only_the_users(lab):
    r = lab.get("api/jobs")
    assert r.status_code == 200
    assert [j["id"] for j in r.json()["jobs"]] == [A, C]


def test_one_job_and_someone_elses(lab):
    assert lab.get(f"api/jobs/{A}").json()["name"] == "mnist"
    missing = lab.get("api/jobs/0123456789ab")
    assert missing.status_code == 404 and missing.json()["message"] == "job 0123456789ab not found"


def test_cancel_goes_to_the_jobs_service(lab, upstream):
    r = lab.post(f"api/jobs/{C}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert upstream.cancelled == [C]


def test_profiles_and_queues_pass_through(lab):
    assert lab.get("api/profiles").json()["profiles"][0]["slug"] == "python"
    assert lab.get("api/queues").json() == {"queues": [{"name": "default"}]}


def test_cull_warnings_are_this_users_only(lab):
    assert lab.get("api/servers/warnings").json() == {"warnings": [{"user": "alice", "name": "", "seconds_left": 200}]}


def test_output_is_saved_under_the_servers_root(lab):
    r = lab.get(f"api/jobs/{A}/output")
    assert r.status_code == 200
    assert r.json() == {"path": f"danlu-outputs/{A}.ipynb"}
    saved = json.loads((lab.root / "danlu-outputs" / f"{A}.ipynb").read_text())
    assert "".join(saved["cells"][0]["source"]) == f"output of {A}"


def _events(response) -> list[tuple[str, dict]]:
    events, kind = [], "message"
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[6:])))
            kind = "message"
    return events


def test_log_stream_sends_each_line_then_the_end(lab):
    r = lab.get(f"api/jobs/{A}/logs/stream", stream=True)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert _events(r) == [
        ("message", {"line": "epoch 1"}),
        ("message", {"line": "epoch 2"}),
        ("message", {"line": "done"}),
        ("end", {"state": "succeeded"}),
    ]


def test_closing_the_log_stream_hangs_up_on_the_jobs_service(lab, upstream):
    upstream.followers_gone.clear()
    r = lab.get(f"api/jobs/{C}/logs/stream", stream=True)
    lines = r.iter_lines(decode_unicode=True)
    assert next(lines) == 'data: {"line": "epoch 1"}'
    r.close()
    assert upstream.followers_gone.wait(20), "the extension kept following a log nobody reads"


# experiments and runs ---------------------------------------------------------------------------
def test_experiments_come_from_the_jobs_service_not_an_mlflow_search(lab, upstream):
    searches, calls = len(upstream.filters), upstream.experiment_calls
    r = lab.get("api/experiments")
    assert r.status_code == 200
    # an experiment whose first run has not reported its MLflow id yet cannot be opened: it is left out
    assert r.json() == {"experiments": [{"experiment_id": "1", "name": "alice/mnist", "runs": 1}]}
    assert upstream.experiment_calls == calls + 1 and len(upstream.filters) == searches


def test_runs_of_an_experiment(lab):
    r = lab.get("api/runs", params={"experiment_id": "1"})
    assert r.json() == {
        "runs": [
            {
                "run_id": RUN_A,
                "run_name": "run-aaaa",
                "experiment_id": "1",
                "status": "FINISHED",
                "start_time": 1700000000000,
                "end_time": 1700000001000,
                "params": {"lr": "0.1"},
                "metrics": {"loss": 0.25},
                "job_id": A,
                "mlflow_url": f"/services/mlflow/#/experiments/1/runs/{RUN_A}",
            }
        ]
    }


def test_metric_history_is_one_series_per_run(lab):
    r = lab.get("api/metric-history", params={"run_id": [RUN_A], "key": "loss"})
    assert r.status_code == 200
    assert r.json() == {
        "key": "loss",
        "series": [{"run_id": RUN_A, "run_name": "run-aaaa", "points": [[0, 1.0], [1, 0.5], [2, 0.25]]}],
    }


@pytest.mark.parametrize("run_id", [RUN_B, "c" * 32])
def test_someone_elses_or_a_missing_run_is_not_found(lab, run_id):
    r = lab.get("api/metric-history", params={"run_id": [RUN_A, run_id], "key": "loss"})
    assert r.status_code == 404
    assert r.json()["field"] == "run_id" and run_id in r.json()["message"]


# TensorBoard ---------------------------------------------------------------------------------------
def test_tensorboard_is_reused_for_the_same_set_then_stopped_when_idle(lab):
    first = lab.post("api/tensorboard", json={"job_ids": [A]})
    assert first.status_code == 200, first.text
    board = first.json()
    assert board["url"] == f"/user/alice/danlu/tensorboard/{board['id']}/"
    assert board["logdirs"] == {f"mnist-{A[:6]}": f"/jobs/{A}/tensorboard"}
    [proc] = lab.tensorboards()

    again = lab.post("api/tensorboard", json={"run_ids": [RUN_A]})  # the same job, asked by its run
    assert again.json()["id"] == board["id"]
    assert lab.tensorboards() == [proc]

    page = requests.get(f"http://127.0.0.1:{lab.port}{board['url']}", headers=lab.auth, timeout=30)
    assert page.status_code == 200
    assert page.text.startswith(f"<title>TensorBoard</title>{board['url']} mnist-{A[:6]}:/jobs/{A}/tensorboard")
    posted = requests.post(
        f"http://127.0.0.1:{lab.port}{board['url']}data/query", data="x=1", headers=lab.auth, timeout=30
    )
    assert posted.text == "posted x=1"

    wait_for(lambda: lab.tensorboards() == [], what="the idle TensorBoard to stop")
    reopened = requests.get(f"http://127.0.0.1:{lab.port}{board['url']}", headers=lab.auth, timeout=30)
    assert reopened.status_code == 200  # an open tab starts it again under the same URL
    assert len(lab.tensorboards()) == 1


def test_a_tensorboard_answers_only_its_owner_through_the_server(tmp_path, upstream):
    """Bob, another account of the machine, finds alice's TensorBoard's loopback port and asks it directly."""
    lab = LabServer(tmp_path, upstream, real_tensorboard=True)  # the real TensorBoard, as the lab starts it
    try:
        started = lab.post("api/tensorboard", json={"job_ids": [A]})
        assert started.status_code == 200, started.text
        board = started.json()
        page = requests.get(f"http://127.0.0.1:{lab.port}{board['url']}", headers=lab.auth, timeout=120)
        assert page.status_code == 200, page.text[:300]

        def listening():  # the TensorBoard the server started, once it listens (slow on a busy machine)
            for p in psutil.Process(lab.proc.pid).children():
                if "tensorboard" in " ".join(p.cmdline()):
                    ports = [c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
                    if ports:
                        return p, ports[0]
            return None

        wait_for(lambda: listening() is not None, what="alice's TensorBoard to listen")
        proc, port = listening()
        cmdline = " ".join(proc.cmdline())

        direct = requests.get(f"http://127.0.0.1:{port}{board['url']}", timeout=30)
        data = requests.get(f"http://127.0.0.1:{port}{board['url']}data/runs", timeout=30)
        anonymous = requests.get(f"http://127.0.0.1:{lab.port}{board['url']}", timeout=30, allow_redirects=False)
    finally:
        lab.stop()

    assert page.status_code == 200 and "TensorBoard" in page.text, page.text[:300]
    assert (direct.status_code, data.status_code) == (403, 403), direct.text[:300]
    assert anonymous.status_code in (302, 403)
    assert "--logdir_spec" in cmdline and "TOKEN" not in cmdline  # the token is not on its command line


def test_another_set_is_another_tensorboard(lab):
    one = lab.post("api/tensorboard", json={"job_ids": [A, C]}).json()
    other = lab.post("api/tensorboard", json={"job_ids": [C, A]}).json()
    assert one["id"] == other["id"] and len(one["logdirs"]) == 2
    assert one["id"] != lab.post("api/tensorboard", json={"job_ids": [A]}).json()["id"]


def test_someone_elses_run_gets_no_tensorboard(lab):
    r = lab.post("api/tensorboard", json={"run_ids": [RUN_B]})
    assert r.status_code == 404 and r.json()["field"] == "run_ids"


def test_an_unknown_tensorboard_is_a_json_404(lab):
    r = requests.get(f"{lab.url}danlu/tensorboard/{'f' * 12}/", headers=lab.auth, timeout=30)
    assert r.status_code == 404 and "open it again" in r.json()["message"]


# models and lineage ------------------------------------------------------------------------------
def test_registering_a_model_forwards_the_run_and_name(lab, upstream):
    r = lab.post("api/models", json={"run_id": RUN_A, "name": "mnist.v2"})
    assert r.status_code == 201, r.text
    assert r.json() == model_version("mnist.v2", RUN_A)
    assert upstream.registrations[-1] == {"run_id": RUN_A, "name": "mnist.v2"}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"name": "mnist"}, "run_id"),
        ({"run_id": RUN_A}, "name"),
        ({"run_id": RUN_A, "name": ""}, "name"),
        ({"run_id": "../runs", "name": "mnist"}, "run_id"),
        ({"run_id": RUN_A, "name": "-starts-with-a-dash"}, "name"),
        ({"run_id": RUN_A, "name": "has space"}, "name"),
        ({"run_id": RUN_A, "name": "a" * 64}, "name"),
        ({"run_id": RUN_A, "name": ["mnist"]}, "name"),
        ({"run_id": RUN_A, "name": "mnist", "stage": "Production"}, "stage"),
    ],
)
def test_a_bad_registration_never_reaches_the_jobs_service(lab, upstream, body, field):
    before = len(upstream.registrations)
    r = lab.post("api/models", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field and "traceback" not in r.text.lower()
    assert len(upstream.registrations) == before


@pytest.mark.parametrize("data", [b"[1]", b"not json", b'{"run_id": "' + b"a" * 5000 + b'", "name": "x"}'])
def test_a_malformed_or_oversized_body_is_a_400_naming_the_body(lab, upstream, data):
    before = len(upstream.registrations)
    r = requests.post(
        f"{lab.url}danlu/api/models", data=data, timeout=30, headers={**lab.auth, "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["field"] == "body"
    assert len(upstream.registrations) == before


@pytest.mark.parametrize(
    "body, status, field, message",
    [
        ({"run_id": RUN_A, "name": "taken"}, 409, "name", "model taken belongs to bob (choose another name)"),
        ({"run_id": RUN_B, "name": "mnist"}, 404, "run_id", f"run {RUN_B} not found"),
    ],
)
def test_the_jobs_services_refusal_passes_through_with_its_message(lab, body, status, field, message):
    r = lab.post("api/models", json=body)
    assert r.status_code == status
    assert r.json()["field"] == field and r.json()["message"] == message


def test_models_pass_through(lab):
    assert lab.get("api/models").json() == {"models": [{"name": "mnist", "latest_version": 1, "aliases": {}}]}


def test_lineage_of_a_model_version(lab):
    r = lab.get("api/lineage/models/mnist.v2/1")
    assert r.status_code == 200 and r.json() == LINEAGE


@pytest.mark.parametrize(
    "path, field",
    [
        ("mnist/0", "version"),
        ("mnist/v1", "version"),
        ("mnist/1234567890", "version"),
        ("..%2Fjobs/1", "name"),
        ("-x/1", "name"),
        ("a%20b/1", "name"),
    ],
)
def test_lineage_refuses_a_bad_name_or_version(lab, path, field):
    r = lab.get(f"api/lineage/models/{path}")
    assert r.status_code == 400, r.text
    assert r.json()["field"] == field


def test_lineage_of_an_unknown_version_is_the_services_404(lab):
    r = lab.get("api/lineage/models/mnist.v2/7")
    assert r.status_code == 404
    assert r.json()["reason"] == "no_such_model_version" and r.json()["message"] == "model mnist.v2 version 7 not found"


# sweeps ----------------------------------------------------------------------------------------
def test_sweeps_are_only_the_users(lab, upstream):
    r = lab.get("api/sweeps")
    assert r.status_code == 200
    assert [s["id"] for s in r.json()["sweeps"]] == [SWEEP_A]
    assert "sweeps owner=alice" in upstream.filters


def test_one_sweep_with_its_trials_and_curve(lab):
    r = lab.get(f"api/sweeps/{SWEEP_A}")
    assert r.status_code == 200
    assert r.json()["trials"][0]["params"] == {"lr": 0.01} and r.json()["best_curve"][0]["best"] == 0.5
    missing = lab.get("api/sweeps/0123456789ab")
    assert missing.status_code == 404 and missing.json()["reason"] == "no_such_sweep"


def test_stopping_a_sweep_goes_to_the_jobs_service_and_its_refusal_comes_back(lab, upstream):
    r = lab.post(f"api/sweeps/{SWEEP_A}/stop")
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    assert upstream.stopped == [SWEEP_A]
    upstream.sweeps[SWEEP_A]["state"] = "stopped"
    try:
        again = lab.post(f"api/sweeps/{SWEEP_A}/stop")
        assert again.status_code == 409 and again.json()["message"] == f"sweep {SWEEP_A} has ended"
    finally:
        upstream.sweeps[SWEEP_A]["state"] = "running"
        upstream.stopped.clear()


def _ts_union(name: str) -> set[str]:
    source = (Path(__file__).resolve().parents[1] / "extensions" / "lab" / "src" / "tokens.ts").read_text()
    match = re.search(rf"export type {name} =([^;]+);", source)
    assert match, f"type {name} not found in tokens.ts"
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def _enums(node, found: list[set[str]]) -> list[set[str]]:
    if isinstance(node, dict):
        if isinstance(node.get("enum"), list):
            found.append({v for v in node["enum"] if isinstance(v, str)})
        for value in node.values():
            _enums(value, found)
    elif isinstance(node, list):
        for value in node:
            _enums(value, found)
    return found


@pytest.mark.parametrize(
    "name, member",
    [
        ("ApprovalState", "rejected"),
        ("LineageNodeKind", "dataset_version"),
        ("SweepTrialState", "pruned"),
        ("SweepState", "succeeded"),
    ],
)
def test_the_lab_extensions_model_words_are_the_services(name, member):
    from danlu.hub.service.validation import openapi

    words = _ts_union(name)
    assert member in words
    enums = [e for e in _enums(openapi(), []) if member in e]
    if not enums:
        pytest.skip(f"the jobs service's openapi.yaml has no enum with {member!r} yet (the models API, issue 9)")
    assert words in enums, f"tokens.ts {name} = {sorted(words)}; openapi.yaml has {[sorted(e) for e in enums]}"


# pure pieces -------------------------------------------------------------------------------------------
def test_logdir_set_ids_ignore_order():
    assert logdir_set_id({"a": "/x", "b": "/y"}) == logdir_set_id({"b": "/y", "a": "/x"})
    assert logdir_set_id({"a": "/x"}) != logdir_set_id({"a": "/y"})


def test_logdir_names_have_no_spec_separators():
    assert logdir_name({"id": A, "name": "my job:v1,2"}) == f"my_job_v1_2-{A[:6]}"


def test_job_ids_are_checked():
    assert check_job_id(A) == A
    for bad in ("../../etc", A.upper(), A + "0", None):
        with pytest.raises(danlu.errors.UsageError) as info:
            check_job_id(bad)
        assert info.value.field == "job_id"


def test_run_summary_reads_string_times():
    run = _run(RUN_A, "alice", A)
    run["info"]["start_time"] = "1700000000000"
    assert run_summary(run, "/m/")["start_time"] == 1700000000000


def test_unreachable_upstream_is_503():
    async def call():
        await Upstream("Danlu jobs service", f"http://127.0.0.1:{free_port()}", "t").fetch("GET", "/jobs")

    with pytest.raises(danlu.errors.Unreachable) as info:
        asyncio.run(call())
    assert info.value.status == 503
    assert str(info.value).startswith("the Danlu jobs service is not reachable")
    AsyncHTTPClient.configure(None)


# %%train --quiet -------------------------------------------------------------------------------------------
class AcceptingClient:
    def __init__(self):
        self.count = 0

    def submit(self, body):
        self.count += 1
        return {"id": f"{self.count:012x}", "state": "queued"}


@pytest.fixture
def shell(tmp_path, monkeypatch):
    config = Config()
    config.HistoryManager.enabled = False
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(submit, "_git_commit", lambda folder: None)
    monkeypatch.setattr(danlu, "_last_job_id", None)
    shell = InteractiveShell.instance(config=config)
    danlu.load_ipython_extension(shell)
    shell.magics_manager.registry["TrainMagics"].client_factory = AcceptingClient
    yield shell
    InteractiveShell.clear_instance()


def test_quiet_prints_only_the_job_id_and_last_job_id_remembers_it(shell, capsys):
    assert danlu.last_job_id() is None
    shell.run_cell_magic("train", "--quiet --param lr=0.1", "print(lr)")
    assert capsys.readouterr().out == "000000000001\n"
    assert danlu.last_job_id() == "000000000001"


def test_quiet_does_not_go_with_wait(shell):
    with pytest.raises(IPythonUsageError) as info:
        shell.run_cell_magic("train", "--quiet --wait", "pass")
    assert "--quiet" in str(info.value) and danlu.last_job_id() is None


def test_quiet_is_in_the_help():
    assert "--quiet" in train.TrainMagics.train.__doc__


# service tier -------------------------------------------------------------------------------------------------
TB_CELL = """%%train --quiet --name tb-demo
from torch.utils.tensorboard import SummaryWriter
writer = SummaryWriter()
for step in range(3):
    writer.add_scalar("loss", 1.0 / (step + 1), step)
writer.close()
"""


@pytest.mark.service
def test_alices_server_lists_her_job_runs_history_and_tensorboard(workbench):

    wb = workbench
    started = not wb.hub("GET", "/users/alice").json().get("servers", {}).get("", {}).get("ready")
    if started:
        r = wb.start_server("alice", {"profile": "python", "gpus": 0})
        assert r.status_code in (201, 202), r.text
    try:
        check_alices_server(wb, wb.tokens["alice"])
    finally:
        if started:  # the session's workbench is shared: later tests start alice's server themselves
            wb.hub("DELETE", "/users/alice/server")
            wait_for(
                lambda: not wb.hub("GET", "/users/alice").json().get("servers"),
                timeout=120,
                what="alice's server to stop",
            )


def check_alices_server(wb, token: str) -> None:
    from danlu.hub.testing import RemoteKernel

    auth = {"Authorization": f"token {token}"}
    api = f"{wb.url}/user/alice/danlu/api"
    extensions = requests.get(f"{wb.url}/user/alice/lab/api/extensions", headers=auth, timeout=60)
    assert extensions.status_code == 200
    if (labextension_dir() / "package.json").exists():  # built by `make install` (extensions/lab)
        assert "danlu-lab" in [e["name"] for e in extensions.json()]

    kernel = RemoteKernel(wb, "alice", token, path="lab/tensorboard.ipynb")
    assert kernel.execute("%load_ext danlu")["status"] == "ok"
    submitted = kernel.execute(TB_CELL)
    assert submitted["status"] == "ok", submitted
    job_id = submitted["stdout"].strip()
    assert re.fullmatch(r"[0-9a-f]{12}", job_id), submitted
    echo = kernel.execute('print(__import__("danlu").last_job_id())')
    assert echo["stdout"].strip() == job_id
    job = wb.wait_job(job_id, token)
    assert job["state"] == "succeeded", job

    jobs = requests.get(f"{api}/jobs", headers=auth, timeout=60).json()["jobs"]
    assert job_id in [j["id"] for j in jobs] and {j["owner"] for j in jobs} == {"alice"}
    experiments = requests.get(f"{api}/experiments", headers=auth, timeout=60).json()["experiments"]
    [experiment] = [e for e in experiments if e["name"] == job["experiment"]]
    runs = requests.get(
        f"{api}/runs", params={"experiment_id": experiment["experiment_id"]}, headers=auth, timeout=60
    ).json()["runs"]
    [run] = [r for r in runs if r["job_id"] == job_id]
    assert run["run_id"] == job["mlflow_run_id"] and run["metrics"]["loss"] == pytest.approx(1 / 3)
    history = requests.get(
        f"{api}/metric-history", params={"run_id": run["run_id"], "key": "loss"}, headers=auth, timeout=60
    ).json()
    assert [p[0] for p in history["series"][0]["points"]] == [0, 1, 2]

    board = requests.post(f"{api}/tensorboard", json={"job_ids": [job_id]}, headers=auth, timeout=180)
    assert board.status_code == 200, board.text
    url = f"{wb.url}{board.json()['url']}"
    page = requests.get(url, headers=auth, timeout=60)
    assert page.status_code == 200 and "<tb-webapp>" in page.text  # TensorBoard's own page
    runs_seen = wait_for(
        lambda: requests.get(f"{url}data/runs", headers=auth, timeout=60).json(),
        timeout=60,
        what="TensorBoard to read the job's event files",
    )
    assert any(name.startswith("tb-demo-") for name in runs_seen), runs_seen


def test_a_tensorboard_still_starting_is_not_stopped_as_idle():
    """A cold TensorBoard on a busy machine may take longer to answer than a short idle time: the reaper
    stopped it while it started, and the user got "exited while starting: no output"."""
    import logging

    from danlu.lab.tensorboard import TensorBoard, TensorBoardManager

    manager = TensorBoardManager(
        base_url="/", command=[], idle_seconds=2, start_timeout=90, log=logging.getLogger("test")
    )
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        board = TensorBoard(id="b", logdirs={}, prefix="/b")
        board.proc, board.ready = proc, asyncio.Event()
        board.last_used = time.monotonic() - 10  # started 10 s ago, not answering yet
        manager.boards["b"] = board
        asyncio.run(manager.reap())
        assert board.running  # still starting: left alone
        board.ready.set()
        asyncio.run(manager.reap())
        assert not board.running  # answering and idle for 10 s: stopped
    finally:
        proc.kill()
        proc.wait()


def test_a_busy_kernel_counts_as_the_servers_activity_for_jupyter_server():
    """A cell computing without output is activity: the hub's last activity (and so the idle and the GPU
    cullers) sees it, through Jupyter Server's own ``*_last_activity`` settings."""
    import datetime as dt
    from types import SimpleNamespace

    from jupyter_server.serverapp import ServerWebApplication

    from danlu.lab.app import DanluLab

    started = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    kernels = [{"id": "k1", "execution_state": "idle"}]
    settings = {
        "started": started,
        "last_activity_times": {},
        "kernel_manager": SimpleNamespace(last_kernel_activity=started),
    }
    app = DanluLab()
    app.serverapp = SimpleNamespace(
        kernel_manager=SimpleNamespace(list_kernels=lambda: kernels), web_app=SimpleNamespace(settings=settings)
    )
    app.note_busy_kernels()
    assert ServerWebApplication.last_activity(SimpleNamespace(settings=settings)) == started  # idle: nothing new
    kernels.append({"id": "k2", "execution_state": "busy"})
    app.note_busy_kernels()
    seen = ServerWebApplication.last_activity(SimpleNamespace(settings=settings))
    assert (dt.datetime.now(dt.timezone.utc) - seen).total_seconds() < 5
