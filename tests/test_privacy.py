"""Private by default: no process of the workbench reaches outside unless the admin allows it.

Service tier (one workbench for the module): a real ``danlu up`` started with every proxy variable
(``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, lower case too) pointing at :class:`RecordingProxy`,
a listener on loopback that records each request it gets (method and host) and refuses it, and
``NO_PROXY`` for loopback. Nothing of pytest's or a CI's environment reaches the workbench, since
MLflow switches its telemetry off by itself where it sees one. Alice's server, a kernel, a
``%%train`` job, a TensorBoard, the pages and APIs JupyterLab and MLflow's UI ask for: the
proxy must have heard nothing. Pure tier: what ``privacy.allow_outbound`` changes in the
configuration danlu up and the hub build.
"""

from __future__ import annotations

import os
import socketserver
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import requests
import yaml

from danlu import env
from danlu.hub import hubconfig
from danlu.hub.config import Settings
from danlu.hub.testing import RemoteKernel, Workbench, free_port
from danlu.lab.app import ANNOUNCEMENTS, without_news

#: the variables by which MLflow (3.17: mlflow.telemetry.utils) decides it runs in a test or a CI and keeps quiet
QUIETING = (
    "PYTEST_CURRENT_TEST",
    "CI",
    "GITHUB_ACTIONS",
    "CIRCLECI",
    "GITLAB_CI",
    "JENKINS_URL",
    "TRAVIS",
    "TF_BUILD",
    "BITBUCKET_BUILD_NUMBER",
    "CODEBUILD_BUILD_ARN",
    "BUILDKITE",
    "TEAMCITY_VERSION",
    "CLOUD_RUN_EXECUTION",
    "RUNBOT_HOST_URL",
    "RUNBOT_BUILD_NAME",
    "RUNBOT_WORKER_ID",
    "MLFLOW_DISABLE_TELEMETRY",
    "DO_NOT_TRACK",
    "HF_HUB_DISABLE_TELEMETRY",
)


class RecordingProxy(socketserver.ThreadingTCPServer):
    """An HTTP proxy on loopback that forwards nothing: it records ``METHOD host`` of every request and refuses it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        self.seen: list[str] = []

        class Handler(socketserver.StreamRequestHandler):
            timeout = 10

            def handle(handler):
                try:
                    line = handler.rfile.readline(4096).decode("latin-1").strip()
                    host = ""
                    while True:
                        header = handler.rfile.readline(4096).decode("latin-1").strip()
                        if not header:
                            break
                        if header.lower().startswith("host:"):
                            host = header.split(":", 1)[1].strip()
                except OSError:
                    line, host = line if "line" in locals() else "", ""
                method, _, rest = line.partition(" ")
                target = rest.split(" ")[0]
                self.seen.append(f"{method or '?'} {host or target or repr(line[:40])} ({target[:120]})")
                try:
                    handler.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

        super().__init__(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def workbench_environment(proxy_url: str) -> dict:
    """Every proxy variable at the recorder, loopback exempted; the variables that quiet MLflow removed (None)."""
    proxies = {name: proxy_url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    proxies.update({name.lower(): url for name, url in proxies.items()})
    return {**proxies, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost", **dict.fromkeys(QUIETING)}


@pytest.fixture(scope="module")
def recorder():
    proxy = RecordingProxy()
    yield proxy
    proxy.shutdown()
    proxy.server_close()


@pytest.fixture(scope="module")
def private_workbench(tmp_path_factory, recorder):
    tmp = tmp_path_factory.mktemp("private")
    extra = tmp / "jupyterhub_extra.py"
    # users' servers run the Danlu under test (a checkout's import path) as the hub and the services do, with
    # its server extension on, as an installed Danlu has it (etc/jupyter/jupyter_server_config.d/danlu.json)
    extra.write_text(
        "import os\nif os.environ.get('PYTHONPATH'):\n"
        "    c.Spawner.environment = {'PYTHONPATH': os.environ['PYTHONPATH']}\n"
        "c.Spawner.args.append('--ServerApp.jpserver_extensions=danlu.lab=True')\n"
    )
    wb = Workbench(
        tmp,
        config={"hub": {"idle_timeout_seconds": 0, "extra_config_file": str(extra)}, "jobs": {"warm_runners": 0}},
        extra_env=workbench_environment(recorder.url),
    )
    environment = {k: v for k, v in {**os.environ, **wb.extra_env}.items() if v is not None}
    from mlflow.telemetry import utils  # deferred: MLflow (~2 s) only for this guard

    with mock.patch.dict(os.environ, environment, clear=True):
        assert not utils._is_ci_env_or_testing(), "MLflow would keep quiet by itself: the test would prove nothing"
    wb.start()
    wb.token = wb.create_user("alice")
    yield wb
    code = wb.stop()
    assert code == 0, wb.log_tail()


@pytest.mark.service
def test_no_process_of_the_workbench_reaches_outside(private_workbench, recorder):
    wb, token = private_workbench, private_workbench.token
    auth = {"Authorization": f"token {token}"}
    r = wb.start_server("alice")
    assert r.status_code in (201, 202), r.text
    lab = f"{wb.url}/user/alice"

    # what JupyterLab's page asks its server for: the page, news, the update check, the extension manager
    page = requests.get(f"{lab}/lab", headers=auth, timeout=60)
    assert page.status_code == 200, page.text[:500]
    news = requests.get(f"{lab}/lab/api/news", headers=auth, timeout=60)
    assert news.status_code == 200 and news.json()["news"] == [], news.text
    update = requests.get(f"{lab}/lab/api/update", headers=auth, timeout=60)
    assert update.status_code == 200 and update.json()["notification"] is None, update.text
    extensions = requests.get(f"{lab}/lab/api/extensions?refresh=1", headers=auth, timeout=60)
    assert extensions.status_code == 200, extensions.text
    # what MLflow's UI asks its server for on every page
    wb.mlflow("GET", "/ajax-api/3.0/mlflow/ui-telemetry", token=token)

    # a kernel of alice's server, using MLflow, and a job it submits, logging to MLflow
    kernel = RemoteKernel(wb, "alice", token, path="work/private.ipynb")
    used = kernel.execute("%load_ext danlu\nimport mlflow\nmlflow.search_experiments(max_results=1)")
    assert used["status"] == "ok", used
    cell = (
        "%%train --wait\nimport os, mlflow\nmlflow.log_metric('private', 1.0)\n"
        "print('job:', os.environ.get('MLFLOW_DISABLE_TELEMETRY'), os.environ.get('HTTPS_PROXY'))\n"
    )
    ran = kernel.execute(cell, cell_id="private-cell")
    assert ran["status"] == "ok", ran
    assert f"job: true {recorder.url}" in ran["stdout"], ran["stdout"]
    job = next(j for j in wb.api("GET", "/jobs", token=token).json()["jobs"] if j["source"].get("cell_id"))
    assert job["state"] == "succeeded", job

    # a TensorBoard of that job, through alice's server
    board = requests.post(f"{lab}/danlu/api/tensorboard", headers=auth, json={"job_ids": [job["id"]]}, timeout=120)
    assert board.status_code in (200, 201), board.text
    assert requests.get(f"{wb.url}{board.json()['url']}", headers=auth, timeout=120).status_code == 200

    # every process there is (hub, proxy, services, MLflow, the server, its kernel, TensorBoard) would ask the
    # recorder before going out, and has MLflow's telemetry off
    for proc in wb.processes():
        environ = proc.environ()
        assert environ.get("HTTPS_PROXY") == recorder.url, proc.cmdline()
        assert environ.get("MLFLOW_DISABLE_TELEMETRY") == "true", proc.cmdline()
    time.sleep(3)  # telemetry is sent from background threads
    assert recorder.seen == [], f"the workbench tried to reach outside: {recorder.seen}"
    assert ANNOUNCEMENTS in page.text, "JupyterLab would ask alice whether to fetch Jupyter news"
    assert '"hubUser": "alice"' in page.text  # JupyterHub's own page_config_hook still runs


# pure: what the switch changes ---------------------------------------------------------------------------------


def test_every_process_gets_the_switches_and_the_sites_proxy_with_loopback_exempted():
    site = {"HTTPS_PROXY": "http://proxy.corp:3128", "no_proxy": ".corp", "PATH": "/bin"}
    private = env.private_environment(False, site)
    assert private["MLFLOW_DISABLE_TELEMETRY"] == "true" and private["DO_NOT_TRACK"] == "1"
    assert private["HTTPS_PROXY"] == "http://proxy.corp:3128" and "PATH" not in private
    assert private["no_proxy"] == ".corp,127.0.0.1,localhost,::1"
    allowed = env.private_environment(True, site)
    assert not set(env.TELEMETRY_OFF) & set(allowed)
    assert env.private_environment(True, {}) == {}  # nothing to pass on: no NO_PROXY of Danlu's own


def hub_config(tmp_path, allow: bool):
    """The JupyterHub configuration danlu up writes, built as the hub builds it."""
    from traitlets.config import Config

    (tmp_path / "danlu.yaml").write_text(f"auth: {{type: dummy}}\nprivacy: {{allow_outbound: {str(allow).lower()}}}\n")
    environ = {
        env.CONFIG: str(tmp_path / "danlu.yaml"),
        env.STATE_DIR: str(tmp_path / "state"),
        env.HUB_PORT: "1",
        env.PROXY_API_PORT: "2",
        env.SERVICE_PORT: "3",
        env.GATEWAY_PORT: "4",
        env.ADMIN_TOKEN: "t",
        env.MLFLOW_URL: "http://127.0.0.1:5/services/mlflow",
        "HTTPS_PROXY": "http://proxy.corp:3128",
        "PATH": "/bin",
    }
    c = Config()
    hubconfig.configure(c, environ)
    return c


@pytest.mark.parametrize("allow", [False, True])
def test_the_hub_gives_services_and_servers_the_switches_unless_allowed(tmp_path, allow):
    c = hub_config(tmp_path, allow)
    environments = [s["environment"] for s in c.JupyterHub.services if "environment" in s]
    environments.append(c.DanluLocalSpawner.extra_env)
    assert len(environments) == 3
    for environment in environments:
        assert environment["HTTPS_PROXY"] == "http://proxy.corp:3128"
        assert ("MLFLOW_DISABLE_TELEMETRY" in environment) is not allow
        assert ("DO_NOT_TRACK" in environment) is not allow
    args = list(c.Spawner.args)
    assert args == ([] if allow else list(hubconfig.LAB_PRIVATE_ARGS))


def test_the_switch_is_documented_and_off_by_default():
    settings = Settings()
    assert settings.privacy.allow_outbound is False
    assert "telemetry" in type(settings.privacy).class_traits()["allow_outbound"].help


def test_without_news_the_page_turns_off_the_announcements_plugin():
    chained = []
    hook = without_news(lambda handler, config: chained.append(1) or config)
    quiet = hook(None, {"news": {"disabled": True}, "disabledExtensions": ["x"]})
    assert quiet["disabledExtensions"] == ["x", ANNOUNCEMENTS] and chained == [1]
    assert hook(None, {"news": {"disabled": False}, "disabledExtensions": []})["disabledExtensions"] == []


# Kubernetes: the same switches in every rendered pod ------------------------------------------------------------


def _container_env(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _k8s(tmp_path, allow: bool):
    from danlu.hub.config import load_settings  # deferred: only the Kubernetes tests
    from danlu.hub.profiles import load_profiles  # deferred: as above

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "examples" / "config" / "two-flavors.yaml").read_text())
    data["privacy"] = {"allow_outbound": allow}
    (tmp_path / "danlu.yaml").write_text(yaml.safe_dump(data))
    settings = load_settings(tmp_path / "danlu.yaml", environ={env.BASE_DIR: str(root)})
    return settings, load_profiles(settings.profiles_file)


@pytest.mark.parametrize("allow", [False, True])
def test_rendered_hub_mlflow_and_job_pods_carry_the_switches_unless_allowed(tmp_path, allow):
    from danlu.hub.k8s import jobs, render  # deferred: only the Kubernetes tests

    settings, profiles = _k8s(tmp_path, allow)
    off = dict(env.TELEMETRY_OFF)
    hub = render.chart_values(settings, profiles)["hub"]["extraEnv"]
    [mlflow] = [o for o in render.objects(settings, profiles)["mlflow.yaml"] if o["kind"] == "Deployment"]
    [container] = mlflow["spec"]["template"]["spec"]["containers"]
    job = jobs.trainjob(
        job_id="abcdefabcdef",
        attempt=1,
        owner="ana",
        queue="vision",
        priority_class="",
        namespace="research",
        image="img",
        nproc=1,
        api_url="http://hub:10101/services/danlu/api/v1",
        allow_outbound=settings.privacy.allow_outbound,
    )
    for environment in (hub, _container_env(container), _container_env(job["spec"]["trainer"])):
        carried = {k: environment.get(k) for k in off}
        assert carried == (dict.fromkeys(off) if allow else off)


@pytest.mark.parametrize("allow", [False, True])
def test_on_the_cluster_services_and_notebook_pods_carry_the_switches_unless_allowed(tmp_path, allow):
    from traitlets.config import Config

    from danlu.hub.k8s.hubconfig import configure  # deferred: only the Kubernetes tests

    profile = {
        "slug": "python",
        "display_name": "Python",
        "default": True,
        "environment": {"image": "img@sha256:" + "a" * 64},
    }
    (tmp_path / "profiles.yaml").write_text(yaml.safe_dump({"profiles": [profile]}))
    cluster = {"namespace": "research", "trial": True}  # a throwaway trial: its dummy login needs no secret
    config = {"kubernetes": cluster, "jobs": {"backend": "kubernetes"}, "privacy": {"allow_outbound": allow}}
    (tmp_path / "danlu.yaml").write_text(yaml.safe_dump(config))
    c = Config()
    configure(c, tmp_path, environ={})
    environments = [s["environment"] for s in c.JupyterHub.services] + [c.DanluKubeSpawner.extra_env]
    for environment in environments:
        assert ("MLFLOW_DISABLE_TELEMETRY" in environment) is not allow
    assert list(c.DanluKubeSpawner.args) == ([] if allow else list(hubconfig.LAB_PRIVATE_ARGS))
