"""Backend conformance: one lifecycle suite, run against every backend with real runners and kernels.

Each backend in :data:`BACKENDS` gets one jobs service for the module (:class:`~.servicekit.RunnerAPIService`:
the manager as app.py wires it, and the runner API on a loopback port), and every scenario runs a short
notebook through ``python -m danlu.runner``, papermill and a real kernel: success, an error in the user's
code, an infrastructure failure and its retry, a cancel, a restart of the service, a runner that dies
(its kernel goes with it), and a hostile job that turns its log into a link and its output into a FIFO.
The service only ever sees what the runner reports through the runner API and what the backend serves of
the job's folder. Adding a backend is one line in :data:`BACKENDS`. The Kubernetes backend runs on the fake API
server (tests/k8sfake) and takes the scenarios that are not about local processes or a job folder; its own
(eviction, cancel deletes, a restart finds its TrainJob) are in tests/test_kubernetes_backend.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import stat
from pathlib import Path

import psutil
import pytest
import requests

from danlu import env, proctree
from danlu.errors import DanluError
from danlu.hub.backends.base import Backend
from danlu.hub.backends.local import LocalBackend
from danlu.hub.config import Settings
from danlu.hub.profiles import ProfileSet
from danlu.jobdir import JobDir

from .fakes import admin, final, gpu_profiles, notebook, until, user
from .servicekit import BackendFactory, RunnerAPIService, jupyter_path_of

pytestmark = pytest.mark.service

ALICE = user("alice", "research")
ADMIN = admin()
PATIENCE = 180.0  # bounds a hang on a busy machine; nothing here measures time


def local_backend(settings: Settings) -> Backend:
    """The local backend as the service builds it (runners find the profiles' kernelspecs on JUPYTER_PATH, and
    the code under test on the tests' PYTHONPATH, where one is set)."""
    extra = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    return LocalBackend(settings=settings, runner_env={"JUPYTER_PATH": str(jupyter_path_of(settings)), **extra})


CLUSTERS: dict[Path, object] = {}  # state folder -> the fake cluster of its service (kept across restarts)
IMAGE = "registry.example/danlu/python@sha256:" + "1" * 64


def kubernetes_backend(settings: Settings) -> Backend:
    """The Kubernetes backend on the fake API server (tests/k8sfake): Kueue objects as danlu renders them for
    these settings, the danlu-torch runtime, alice's home claim mapped to her folder."""
    from danlu.hub import gpus, kueue
    from danlu.hub.backends.kubernetes import KubernetesBackend
    from danlu.hub.k8s import manifests

    from .k8sfake import FakeCluster

    cluster = CLUSTERS.get(settings.state_dir)
    if cluster is None:
        cluster = CLUSTERS[settings.state_dir] = FakeCluster(namespaces=("default", "danlu")).start()
        for obj in kueue.render(settings, gpus.inventory(settings.gpus), namespace="danlu"):
            cluster.create(obj)
        cluster.create(manifests.make_training_runtime(IMAGE, "1Gi"))
        home = settings.user_home(ALICE.name)
        home.mkdir(parents=True, exist_ok=True)
        cluster.volumes[f"claim-{ALICE.name}"] = str(home)
    profiles = gpu_profiles()
    profiles = ProfileSet(
        tuple(dataclasses.replace(p, environment={"current": True, "image": IMAGE}) for p in profiles),
        source=profiles.source,
    )
    return KubernetesBackend(
        settings=settings,
        profiles=profiles,
        namespace="danlu",
        poll_interval=0.3,
        kubeconfig=cluster.write_kubeconfig(settings.state_dir / "kubeconfig"),
        logs_dir=str(settings.state_dir / "job-logs"),
    )


#: every backend the suite runs against: name -> factory (settings -> backend)
BACKENDS: dict[str, BackendFactory] = {
    "local": local_backend,
    "kubernetes": kubernetes_backend,
}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def service(request, tmp_path_factory):
    svc = RunnerAPIService(tmp_path_factory.mktemp(f"conformance-{request.param}"), BACKENDS[request.param]).open()
    svc.backend_name = request.param
    try:
        yield svc
    finally:
        svc.close()
        cluster = CLUSTERS.pop(svc.settings.state_dir, None)
        if cluster is not None:
            cluster.stop()
            assert cluster.errors == [], cluster.errors
    left = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in svc.processes()]
    assert left == [], f"processes of the service's runners left after it stopped: {left}"


def local_only(svc: RunnerAPIService, why: str) -> None:
    """Scenarios about processes and a job folder on this machine; Kubernetes has its own in
    tests/test_kubernetes_backend.py (cancel deletes, a restart finds its TrainJob, eviction requeues)."""
    if svc.backend_name != "local":
        pytest.skip(f"{svc.backend_name}: {why}")


# helpers ------------------------------------------------------------------------------------------------------
def submit(svc: RunnerAPIService, *sources: str, nb: dict | None = None, **fields) -> str:
    status, body = svc.run(svc.manager.submit(ALICE, {"notebook": nb or notebook(*sources), **fields}))
    assert status == 201, body
    return body["id"]


def wait_final(svc: RunnerAPIService, job_id: str) -> dict:
    return svc.run(final(svc.manager, job_id, patience=PATIENCE, every=0.2))


async def log_text(svc: RunnerAPIService, job_id: str) -> str:
    data, _ = await svc.manager.read_log(await svc.manager.get(ADMIN, job_id), 0, 1 << 20)
    return data.decode("utf-8", "replace")


def wait_log(svc: RunnerAPIService, job_id: str, text: str) -> dict:
    """Wait until the job's log says ``text``; return its backend state then."""

    async def seen():
        return text in await log_text(svc, job_id)

    svc.run(until(seen, f"'{text}' in the log of job {job_id}", PATIENCE, 0.2))
    return dict(svc.run(svc.manager.get(ADMIN, job_id)).backend_state)


def output_of(svc: RunnerAPIService, job_id: str) -> dict:
    async def read():
        return await svc.manager.read_output(await svc.manager.get(ADMIN, job_id), 0, 0, 16 << 20)

    data, _ = svc.run(read())
    return json.loads(data)


def texts(nb: dict) -> str:
    """Every stream text and error value in a notebook's outputs, joined."""

    def joined(value) -> str:
        return "".join(value) if isinstance(value, list) else str(value or "")

    return "".join(joined(o.get("text")) + joined(o.get("evalue")) for c in nb["cells"] for o in c.get("outputs", []))


def waiting(said: str, then: str) -> str:
    """A cell that says ``said``, waits (five minutes at most) for the test's :func:`go`, then says ``then``."""
    return f"""import os, pathlib, time
go = pathlib.Path(os.environ["{env.CHECKPOINT_DIR}"]) / "go"
print({said!r}, flush=True)
for _ in range(3000):
    if go.exists():
        break
    time.sleep(0.1)
print({then!r}, flush=True)
"""


def go(svc: RunnerAPIService, job_id: str) -> None:
    (JobDir(svc.settings.jobs_dir / job_id).checkpoint_dir / "go").touch()


# the lifecycle ---------------------------------------------------------------------------------------------
def test_success_with_its_log_and_output(service):
    nb = notebook("greeting = 'hello'", "print(f'{greeting} from the job')")
    nb["cells"][0]["metadata"]["tags"] = ["parameters"]
    job_id = submit(service, nb=nb, parameters={"greeting": "bonjour"})
    done = wait_final(service, job_id)
    log = service.run(log_text(service, job_id))
    output = output_of(service, job_id)

    assert done["state"] == "succeeded" and done["failure"] is None, done["reason"]
    assert [(a["state"], a["exit_code"]) for a in done["attempts"]] == [("succeeded", 0)]
    assert "bonjour from the job" in log and "danlu: job succeeded" in log
    assert "bonjour from the job\n" in texts(output)


def test_an_error_in_the_users_code_fails_without_retry(service):
    job_id = submit(service, "x = 1", "1 / 0", retries=2)
    done = wait_final(service, job_id)
    output = output_of(service, job_id)

    assert (done["state"], done["failure"]) == ("failed", "user")
    assert done["reason"] == "error in your code: cell 2 raised ZeroDivisionError: division by zero"
    assert [(a["state"], a["failure"]) for a in done["attempts"]] == [("failed", "user")]
    assert "division by zero" in texts(output)


KILL_MY_RUNNER_ONCE = f"""import os, pathlib, signal, time
import psutil
mark = pathlib.Path(os.environ["{env.CHECKPOINT_DIR}"]) / "runner-killed"
if not mark.exists():
    mark.write_text("once")
    runner = next(p for p in psutil.Process().parents() if "danlu.runner" in " ".join(p.cmdline()))
    os.kill(runner.pid, signal.SIGKILL)
    time.sleep(120)
print("the second attempt ran")
"""


def test_an_infrastructure_failure_is_retried(service):
    local_only(service, "kills its runner's local process; a pod's checkpoint folder does not outlive it")
    job_id = submit(service, KILL_MY_RUNNER_ONCE, retries=1)
    done = wait_final(service, job_id)

    assert done["state"] == "succeeded", done["reason"]
    first, second = done["attempts"]
    assert (first["state"], first["failure"]) == ("failed", "infrastructure")
    assert first["reason"] == "the job runner ended without reporting (killed by signal 9): killed or lost"
    assert second["state"] == "succeeded"
    assert "the second attempt ran" in texts(output_of(service, job_id))


def test_cancel_ends_every_process_of_the_job(service):
    local_only(service, "looks for local processes by marker")
    job_id = submit(service, waiting(said="sleeping", then="woke up"))
    state = wait_log(service, job_id, "sleeping")
    assert service.processes(job_id, state["runner_id"]), "the job's processes carry its markers"
    cancelled = service.run(service.manager.cancel(ALICE, job_id))
    left = service.processes(job_id, state["runner_id"])
    log = service.run(log_text(service, job_id))

    assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by alice")
    assert left == []
    assert "danlu: job cancelled" in log and "woke up" not in log


def test_a_restarted_service_picks_up_a_running_job(service):
    local_only(service, "compares the runner's local pid")
    job_id = submit(service, waiting(said="before the restart", then="after the restart"))
    before = wait_log(service, job_id, "before the restart")
    service.restart()  # as a SIGKILLed service leaves things: the runner goes on
    after = service.run(service.manager.get(ADMIN, job_id))
    go(service, job_id)
    done = wait_final(service, job_id)

    assert after.state == "running"
    assert after.backend_state["pid"] == before["pid"] and after.backend_state["runner_id"] == before["runner_id"]
    assert done["state"] == "succeeded", done["reason"]
    assert len(done["attempts"]) == 1
    assert "after the restart" in texts(output_of(service, job_id))


def test_a_runner_that_dies_takes_its_kernel_with_it(service):
    local_only(service, "kills a local runner process")
    job_id = submit(service, waiting(said="running", then="woke up"))
    state = wait_log(service, job_id, "running")
    kernels = [p for p in service.processes(job_id, state["runner_id"]) if p.pid != state["pid"]]
    assert kernels, "the runner's kernel carries its marker"
    os.kill(state["pid"], signal.SIGKILL)
    done = wait_final(service, job_id)
    left = service.processes(job_id, state["runner_id"])

    assert (done["state"], done["failure"]) == ("failed", "infrastructure")
    assert done["reason"] == (
        "infrastructure failure: the job runner ended without reporting (killed by signal 9): killed or lost"
    )
    assert left == []


DETACH = f"""import os, pathlib, subprocess
mine = pathlib.Path(os.environ["{env.CHECKPOINT_DIR}"]) / "detached"
pids = [subprocess.Popen(["setsid", "sleep", "600"]).pid]
pids.append(subprocess.Popen(["setsid", "sleep", "601"], env={{"PATH": os.environ["PATH"]}}).pid)  # no marker
r, w = os.pipe()
child = os.fork()
if child == 0:  # the classic daemon: fork, setsid, fork again, and an empty environment
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.execve("/bin/sleep", ["sleep", "602"], {{}})
    os.write(w, str(daemon).encode())
    os._exit(0)
os.waitpid(child, 0)
os.close(w)
pids.append(int(os.read(r, 32)))
mine.write_text(" ".join(map(str, pids)))
print("detached", flush=True)
"""


def detached_pids(svc: RunnerAPIService, job_id: str) -> list[int]:
    text = (JobDir(svc.settings.jobs_dir / job_id).checkpoint_dir / "detached").read_text()
    return [int(pid) for pid in text.split()]


def still_alive(pids: list[int]) -> list[str]:
    return [f"{pid} {' '.join(psutil.Process(pid).cmdline())}" for pid in pids if proctree.alive(pid)]


@pytest.fixture(params=["cgroup", "runner"])
def tracking(request, service):
    """Each way an attempt's processes are held: its cgroup (where cgroup v2 is writable), or its runner alone."""
    local_only(service, "starts local processes that detach from the job")
    backend = service.manager.backend
    if request.param == "cgroup" and proctree.own_cgroup() is None:
        pytest.skip("cgroup v2 is not writable here")
    backend.process_cgroups = request.param == "cgroup"
    try:
        yield request.param
    finally:
        backend.process_cgroups = True


def test_processes_a_job_detaches_end_with_it(service, tracking):
    job_id = submit(service, DETACH)
    done = wait_final(service, job_id)
    pids = detached_pids(service, job_id)

    assert done["state"] == "succeeded", done["reason"]
    assert len(pids) == 3
    assert still_alive(pids) == []


def test_processes_a_job_detaches_end_when_it_is_cancelled(service, tracking):
    job_id = submit(service, DETACH, waiting(said="sleeping", then="woke up"))
    state = wait_log(service, job_id, "sleeping")
    pids = detached_pids(service, job_id)
    cancelled = service.run(service.manager.cancel(ALICE, job_id))

    assert cancelled["state"] == "cancelled"
    assert bool(state.get("cgroup")) == (tracking == "cgroup")
    assert still_alive(pids) == []


def test_a_job_that_kills_its_runner_leaves_nothing_in_its_cgroup(service, tracking):
    if tracking != "cgroup":
        pytest.skip("without a cgroup, processes with no marker that outlive their runner are not found")
    job_id = submit(service, DETACH, KILL_MY_RUNNER_ONCE, retries=0)
    done = wait_final(service, job_id)
    pids = detached_pids(service, job_id)

    assert (done["state"], done["failure"]) == ("failed", "infrastructure")
    assert still_alive(pids) == []


HOSTILE = f"""import os
folder = os.environ["{env.JOB_DIR}"]
os.remove(os.path.join(folder, "job.log"))
os.symlink("/etc/passwd", os.path.join(folder, "job.log"))
output = os.path.join(folder, "output.ipynb")
if os.path.lexists(output):
    os.remove(output)
os.mkfifo(output)
print("planted", flush=True)
"""


def test_a_hostile_job_cannot_make_the_service_read_a_link_or_block_on_a_fifo(service):
    local_only(service, "plants files in a job folder the service reads; a pod has none")
    job_id = submit(service, HOSTILE)
    folder = Path(service.settings.jobs_dir) / job_id

    def planted():
        try:
            return os.path.islink(folder / "job.log") and stat.S_ISFIFO(os.lstat(folder / "output.ipynb").st_mode)
        except FileNotFoundError:
            return False

    service.run(until(planted, "the job to plant its link and its FIFO", PATIENCE, 0.2))

    async def reads():
        job = await service.manager.get(ADMIN, job_id)
        refused = []
        for read in (service.manager.read_log(job, 0, 1 << 20), service.manager.read_output(job, 0, 0, 1 << 20)):
            try:
                got = await asyncio.wait_for(read, 10)  # bounds a hang; a FIFO must not block the service
            except DanluError as e:  # the manager's 409 for a file the backend refuses
                refused.append(f"{e.status} {e.reason}: {e.message}")
            else:
                refused.append(f"served: {got!r:.200}")
        others = (
            len(await service.manager.list(ALICE)),
            await service.manager.queues.list(),
            await service.manager.counts(),
        )
        return refused, others

    refused, (listed, queues, counts) = service.run(reads())
    runner_api = requests.get(
        f"{service.api}/runner/jobs/{job_id}/attempts/1/stop",
        headers={"Authorization": "Bearer " + "x" * 43},
        timeout=30,
    )
    state = dict(service.run(service.manager.get(ADMIN, job_id)).backend_state)
    job = service.run(service.manager.get(ADMIN, job_id))
    if job.state == "running":  # papermill's last save opens the FIFO and waits for a reader: only its own loss
        service.run(service.manager.cancel(ALICE, job_id))
    done = wait_final(service, job_id)

    assert refused == [
        f"409 unsafe_file: job {job_id}'s log cannot be served: job.log is a link",
        f"409 unsafe_file: job {job_id}'s output cannot be served: output.ipynb is not a plain file",
    ], refused
    assert not any("root:" in r for r in refused)
    assert listed >= 1 and queues[0]["name"] == "default" and counts
    assert runner_api.status_code == 403
    assert done["state"] in ("cancelled", "succeeded", "failed")
    assert service.processes(job_id, state["runner_id"]) == []
