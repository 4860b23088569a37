"""The Kubernetes backend's whole lifecycle against an HTTP-level fake API server (no cluster runs here).

One jobs service for the module (:class:`~.servicekit.RunnerAPIService`: the manager as app.py wires it and
the runner API on loopback) with the Kubernetes backend, talking through ``kubernetes_asyncio`` -- never
patched -- to :class:`~.k8sfake.FakeCluster`, which stores and validates objects against the official CRDs,
admits with a small Kueue (the objects ``danlu kueue render`` writes for these teams), unsuspends TrainJobs
like Trainer, and runs each pod's ``python -m danlu.runner --kubernetes`` as a local process with its home
volume mapped to the owner's folder. The scenarios: a job waits with Kueue's reason and then runs; a
``high`` job evicts a borrowing one, which is requeued and runs again as a new attempt; cancel deletes
(queued or running); a restarted service finds its running job again; a transient API error is retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from pathlib import Path

import pytest
import requests

from danlu import tags as danlu_tags
from danlu.hub import gpus, kueue
from danlu.hub.backends import jobpods
from danlu.hub.backends.kubernetes import KubernetesBackend
from danlu.hub.k8s import manifests, names
from danlu.hub.profiles import ProfileSet, builtin_profiles
from danlu.hub.service.mlflow_client import MlflowAccess

from .fakes import FakeGroups, admin, final, make_settings, notebook, until, user
from .k8sfake import FakeCluster
from .k8sfake.kueue import is_true as kueue_true
from .mlflowkit import running_mlflow
from .servicekit import RunnerAPIService

pytestmark = pytest.mark.service

NS = "danlu"
ALICE = user("alice", "research")
BOB = user("bob", "other")
ADMIN = admin()
PATIENCE = 180.0  # bounds a hang on a busy machine; nothing here measures time
IMAGE = "registry.example/danlu/python@sha256:" + "1" * 64
TEAMS = {
    "research": {"cohort": "shared", "quota": {"gpus": {"sim": 1}}, "borrowing_limit": {"gpus": {"sim": 1}}},
    "other": {"cohort": "shared", "quota": {"gpus": {"sim": 1}}, "borrowing_limit": {"gpus": {"sim": 1}}},
}


def waiting(name: str) -> str:
    """A cell that says it runs, waits (five minutes at most) for ``$HOME/go-<name>``, then says it is done."""
    return f"""import os, pathlib, time
go = pathlib.Path(os.environ["HOME"]) / "go-{name}"
print("{name} is running", flush=True)
for _ in range(3000):
    if go.exists():
        break
    time.sleep(0.1)
print("{name} is done", flush=True)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fake = FakeCluster(namespaces=("default", NS)).start()
    try:
        yield fake
    finally:
        fake.stop()
    assert fake.errors == [], fake.errors


@pytest.fixture(scope="module")
def mlflow(tmp_path_factory):
    """A real MLflow tracking server on loopback (no permissions: those are tested with danlu up)."""
    with running_mlflow(tmp_path_factory.mktemp("mlflow"), PATIENCE) as url:
        yield url


@pytest.fixture(scope="module")
def service(cluster, mlflow, tmp_path_factory):
    state = tmp_path_factory.mktemp("k8s-service")
    settings = make_settings(
        state,
        teams=TEAMS,
        groups={"research": ["alice"], "other": ["bob"]},
        jobs={
            "grace_period_seconds": 2,
            "preemption_grace_seconds": 2,
            "retry_backoff_seconds": 0.2,
            "backend": "kubernetes",
        },
    )
    for obj in kueue.render(settings, gpus.inventory(settings.gpus), namespace=NS):
        cluster.create(obj)
    cluster.create(manifests.make_training_runtime(IMAGE, "1Gi"))
    homes = {}
    for who in ("alice", "bob"):
        homes[who] = state / "homes" / who
        homes[who].mkdir(parents=True)
        cluster.volumes[f"claim-{who}"] = str(homes[who])
    for obj in manifests.make_jobs_rbac(NS):  # the jobs service runs as the hub's account, with rbac.yaml's Role
        cluster.create(obj)
    kubeconfig = cluster.write_kubeconfig(state / "kubeconfig", token=cluster.service_account_token(NS, "hub"))
    builtin = builtin_profiles().default
    profiles = ProfileSet(
        (dataclasses.replace(builtin, environment={"current": True, "image": IMAGE}, gpu_choices=(0, 1, 2)),),
        source="(test)",
    )

    def backend(s):
        return KubernetesBackend(
            settings=s,
            profiles=profiles,
            namespace=NS,
            kubeconfig=str(kubeconfig),
            poll_interval=0.3,
            logs_dir=str(state / "job-logs"),
        )

    svc = RunnerAPIService(
        state,
        backend,
        profiles=profiles,
        settings=settings,
        groups=FakeGroups({"alice": ["research"], "bob": ["other"], "admin": []}),
        mlflow=MlflowAccess(mlflow),
    ).open()
    svc.mlflow_url = mlflow
    svc.homes = homes
    try:
        yield svc
    finally:
        svc.close()


def submit(svc, who, *sources: str, **fields) -> str:
    status, body = svc.run(svc.manager.submit(who, {"notebook": notebook(*sources), **fields}))
    assert status == 201, body
    return body["id"]


def job(svc, job_id: str) -> dict:
    return svc.run(svc.manager.job_dict(job_id))


def wait_for(svc, job_id: str, what: str, check) -> dict:
    async def seen():
        return check(await svc.manager.job_dict(job_id))

    svc.run(until(seen, f"job {job_id}: {what}", PATIENCE, 0.2))
    return job(svc, job_id)


def log(svc, job_id: str) -> str:
    async def read():
        data, _ = await svc.manager.read_log(await svc.manager.get(ADMIN, job_id), 0, 1 << 20)
        return data.decode("utf-8", "replace")

    return svc.run(read())


def output(svc, job_id: str) -> str:
    """The executed notebook the job's runner handed to the service, as text."""

    async def read():
        got = await svc.manager.read_output(await svc.manager.get(ADMIN, job_id), 0, 0, 16 << 20)
        return got[0].decode() if got else ""

    return svc.run(read())


def wait_log(svc, job_id: str, text: str) -> None:
    async def seen():
        data, _ = await svc.manager.read_log(await svc.manager.get(ADMIN, job_id), 0, 1 << 20)
        return text.encode() in data

    svc.run(until(seen, f"'{text}' in the log of job {job_id}", PATIENCE, 0.3))


def go(svc, who: str, name: str) -> None:
    (svc.homes[who] / f"go-{name}").touch()


def wait_final(svc, job_id: str) -> dict:
    return svc.run(final(svc.manager, job_id, patience=PATIENCE, every=0.3))


def trainjobs(cluster, job_id: str) -> list[str]:
    return [o["metadata"]["name"] for o in cluster.objects("TrainJob", NS, f"{names.JOB_ID}={job_id}")]


# the lifecycle ---------------------------------------------------------------------------------------------
def test_a_job_waits_with_kueues_reason_then_runs_and_succeeds(service, cluster):
    first = submit(service, ALICE, waiting("first"), resources={"gpus": 2})  # its own GPU and one borrowed
    wait_log(service, first, "first is running")
    second = submit(service, ALICE, "print('second ran')", resources={"gpus": 1})
    queued = wait_for(
        service,
        second,
        "waits with Kueue's reason",
        lambda j: j["state"] == "queued" and j["reason"].startswith("Kueue:"),
    )
    tj = cluster.get("TrainJob", NS, names.trainjob_name(second, 1))
    go(service, "alice", "first")
    done_first, done_second = wait_final(service, first), wait_final(service, second)

    assert "insufficient unused quota" in queued["reason"], queued["reason"]
    assert tj["spec"]["suspend"] is True and tj["metadata"]["labels"][names.QUEUE_NAME] == "research"
    assert done_first["state"] == "succeeded", done_first["reason"]
    assert done_second["state"] == "succeeded", done_second["reason"]
    assert [a["state"] for a in done_second["attempts"]] == ["succeeded"]
    assert "second ran" in log(service, second) and "first is done" in log(service, first)
    assert "second ran" in output(service, second)  # handed over through the runner API, not a shared folder
    run = requests.get(
        f"{service.mlflow_url}/api/2.0/mlflow/runs/get", params={"run_id": done_second["mlflow_run_id"]}, timeout=30
    ).json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
    assert run["info"]["status"] == "FINISHED" and tags[danlu_tags.JOB_ID] == second
    assert trainjobs(cluster, first) == [] and trainjobs(cluster, second) == []  # deleted once ended


def test_a_high_priority_job_evicts_a_borrowing_one_which_is_requeued(service, cluster):
    borrower = submit(service, ALICE, waiting("borrower"), resources={"gpus": 2})
    wait_log(service, borrower, "borrower is running")
    urgent = submit(service, BOB, waiting("urgent"), resources={"gpus": 1}, priority="urgent")
    evicted = wait_for(
        service,
        borrower,
        "evicted and back in the queue",
        lambda j: j["state"] == "queued" and len(j["attempts"]) >= 1 and j["attempts"][0]["state"] == "preempted",
    )
    wait_log(service, urgent, "urgent is running")
    go(service, "bob", "urgent")
    assert wait_final(service, urgent)["state"] == "succeeded"
    go(service, "alice", "borrower")
    done = wait_final(service, borrower)

    assert "preempted by Kueue" in evicted["attempts"][0]["reason"], evicted["attempts"][0]
    assert done["state"] == "succeeded", done["reason"]
    assert [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"]
    assert trainjobs(cluster, borrower) == []


CHECKPOINTING = """import json, os, pathlib, urllib.request
folder = pathlib.Path(os.environ["DANLU_CHECKPOINT_DIR"])
folder.mkdir(parents=True, exist_ok=True)
print("found", sorted(p.name for p in folder.iterdir()), flush=True)
(folder / ("attempt-" + os.environ["DANLU_ATTEMPT"])).write_text("saved")
api, job, attempt = os.environ["DANLU_RUNNER_API"], os.environ["DANLU_JOB_ID"], os.environ["DANLU_ATTEMPT"]
urllib.request.urlopen(urllib.request.Request(
    f"{api}/runner/jobs/{job}/attempts/{attempt}/events",
    data=json.dumps({"event": "checkpoint", "step": 10 * int(attempt)}).encode(),
    headers={"Authorization": "Bearer " + os.environ["DANLU_JOB_TOKEN"], "Content-Type": "application/json"},
), timeout=30).read()
print("checkpointed", flush=True)
"""


def test_an_evicted_jobs_next_pod_finds_its_checkpoint_in_the_owners_home_claim(service, cluster):
    """Kueue evicts a job that saved a checkpoint: its second attempt's pod mounts the same claim and finds it
    at the same path, and the job's record says where it resumes."""
    borrower = submit(service, ALICE, CHECKPOINTING + waiting("saver"), resources={"gpus": 2})
    wait_log(service, borrower, "checkpointed")
    first = cluster.get("TrainJob", NS, names.trainjob_name(borrower, 1))
    urgent = submit(service, BOB, waiting("urgent2"), resources={"gpus": 1}, priority="urgent")
    evicted = wait_for(
        service,
        borrower,
        "evicted and back in the queue",
        lambda j: len(j["attempts"]) >= 1 and j["attempts"][0]["state"] == "preempted",
    )
    wait_log(service, urgent, "urgent2 is running")
    go(service, "bob", "urgent2")
    assert wait_final(service, urgent)["state"] == "succeeded"
    wait_for(service, borrower, "its second attempt to save", lambda j: (j["checkpoint"] or {}).get("step") == 20)
    second = cluster.get("TrainJob", NS, names.trainjob_name(borrower, 2))
    go(service, "alice", "saver")
    done = wait_final(service, borrower)

    def claim_and_folder(tj):
        patch = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod = patch["template"]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in tj["spec"]["trainer"]["env"]}
        return pod["volumes"], pod["containers"][0]["volumeMounts"], env["DANLU_CHECKPOINT_DIR"]

    assert claim_and_folder(first) == claim_and_folder(second)
    assert claim_and_folder(second)[2] == names.checkpoint_dir(borrower)
    assert "resumes from its checkpoint at step 10" in evicted["attempts"][0]["reason"], evicted["attempts"][0]
    assert done["state"] == "succeeded" and [a["state"] for a in done["attempts"]] == ["preempted", "succeeded"]
    assert "found ['attempt-1']" in log(service, borrower)  # the second pod's log: the first one's checkpoint
    kept = service.homes["alice"] / ".danlu" / "checkpoints" / borrower
    assert sorted(p.name for p in kept.iterdir()) == ["attempt-1", "attempt-2"]
    assert done["checkpoint"]["step"] == 20 and done["checkpoint"]["attempt"] == 2


RESUMABLE_STEPS = 24
RESUMABLE_LOOP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

def train_step(step):
    x = torch.randn(8, 4)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    return loss.item()
"""
RESUMABLE_JOB = (
    RESUMABLE_LOOP
    + f"""
import time, danlu
from torch.utils.tensorboard import SummaryWriter
state = danlu.resumable(model=model, optimizer=opt, every=4)
writer = SummaryWriter()
for step in state.steps({RESUMABLE_STEPS}):
    writer.add_scalar("loss", train_step(step), step)
    writer.flush()
    print("step", step, flush=True)
    time.sleep(0.2)
writer.close()
print("final", repr([round(v, 6) for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()]))
"""
)


def test_a_resumable_job_evicted_by_kueue_twice_ends_like_an_uninterrupted_run(service, cluster):
    """Issue 18's first acceptance item on Kubernetes: a job written with ``danlu.resumable`` is evicted by
    Kueue twice (bob's urgent jobs reclaim the GPU it borrowed); each next pod resumes from the checkpoint in
    alice's home claim; it ends with the weights of the same loop run without interruption, both evictions
    left its one retry unused, and its one MLflow run holds the loss of every step exactly once."""
    torch = pytest.importorskip("torch")
    scope: dict = {}
    exec(RESUMABLE_LOOP, scope)  # noqa: S102 - the test's own loop, the same text the job runs
    losses = [scope["train_step"](step) for step in range(RESUMABLE_STEPS)]
    weights = torch.cat([p.detach().flatten() for p in scope["model"].parameters()]).tolist()
    expected = repr([round(v, 6) for v in weights])

    borrower = submit(service, ALICE, RESUMABLE_JOB, resources={"gpus": 2}, retries=1)

    def resumed(attempt: int) -> str:
        """The line the job's ``attempt`` printed on resuming (the log on Kubernetes is the latest pod's)."""

        async def seen():
            data, _ = await service.manager.read_log(await service.manager.get(ADMIN, borrower), 0, 1 << 20)
            _, header, rest = data.decode("utf-8", "replace").partition(f" attempt {attempt}: ")
            return header and re.search(r"danlu: resumed from step \d+", rest)

        try:
            return service.run(until(seen, f"attempt {attempt} to resume", PATIENCE, 0.3)).group()
        except TimeoutError:
            raise AssertionError(f"{job(service, borrower)}\n{log(service, borrower)[-4000:]}") from None

    resumes = []
    for n, at in enumerate((5, 13), start=1):  # evicted twice, each time after some more steps
        wait_log(service, borrower, f"step {at}\n")
        urgent = submit(service, BOB, f"print('urgent{n} ran')", resources={"gpus": 1}, priority="urgent")
        assert wait_final(service, urgent)["state"] == "succeeded"
        resumes.append(resumed(n + 1))
    done = wait_final(service, borrower)
    text = log(service, borrower)

    assert done["state"] == "succeeded", text[-3000:]
    assert [a["state"] for a in done["attempts"]] == ["preempted", "preempted", "succeeded"], done["attempts"]
    assert all("preempted by Kueue" in a["reason"] for a in done["attempts"][:2]), done["attempts"]
    first, second = (int(line.rsplit(" ", 1)[1]) for line in resumes)
    # each resume from the save the evicted pod made in its grace period (the service told its runner it was
    # preempted), at or past the step it had reached, not from the periodic save before it (steps 4 and 12)
    assert 5 <= first < second < RESUMABLE_STEPS and second >= 13, resumes
    assert f"final {expected}" in text, text[-3000:]  # the uninterrupted loop's weights
    assert any((service.homes["alice"] / ".danlu" / "checkpoints" / borrower).iterdir())  # in alice's claim
    history = requests.get(
        f"{service.mlflow_url}/api/2.0/mlflow/metrics/get-history",
        params={"run_id": done["mlflow_run_id"], "metric_key": "loss"},
        timeout=30,
    ).json()["metrics"]
    steps = sorted(m["step"] for m in history)
    assert steps == list(range(RESUMABLE_STEPS)), steps  # one point per step: none twice, none missing
    by_step = {m["step"]: m["value"] for m in history}
    assert all(abs(by_step[s] - losses[s]) <= 1e-5 * max(1.0, abs(losses[s])) for s in range(RESUMABLE_STEPS))
    assert trainjobs(cluster, borrower) == []


def test_cancel_deletes_a_running_and_a_queued_job(service, cluster):
    running = submit(service, ALICE, waiting("cancelled-running"), resources={"gpus": 2})
    wait_log(service, running, "cancelled-running is running")
    queued = submit(service, ALICE, "print('never')", resources={"gpus": 2})
    wait_for(service, queued, "handed to Kueue", lambda j: j["state"] == "queued" and j["reason"].startswith("Kueue"))
    c1 = service.run(service.manager.cancel(ALICE, queued))
    c2 = service.run(service.manager.cancel(ALICE, running))

    gone = service.run(
        until(
            lambda: (
                not trainjobs(cluster, running)
                and not trainjobs(cluster, queued)
                and not cluster.objects("Pod", NS, f"{names.JOB_ID}={running}")
            ),
            "a foreground delete to take the TrainJobs and their pods",
            PATIENCE,
            0.2,
        )
    )

    assert (c1["state"], c2["state"]) == ("cancelled", "cancelled")
    assert gone


def test_a_restarted_service_finds_its_running_job(service, cluster):
    job_id = submit(service, ALICE, waiting("restart"), resources={"gpus": 1})
    wait_log(service, job_id, "restart is running")
    before = job(service, job_id)
    service.restart()
    after = job(service, job_id)
    go(service, "alice", "restart")
    done = wait_final(service, job_id)

    assert before["state"] == after["state"] == "running"
    assert done["state"] == "succeeded", done["reason"]
    assert len(done["attempts"]) == 1


def test_a_transient_api_error_is_retried(service, cluster):
    cluster.fail_next("create", "TrainJob", status=503)
    job_id = submit(service, ALICE, "print('despite a 503')")
    done = wait_final(service, job_id)

    assert done["state"] == "succeeded", done["reason"]
    assert "despite a 503" in log(service, job_id)


def test_the_users_folder_is_where_the_job_runs(service):
    (service.homes["alice"] / "data.txt").write_text("from alice's home")
    job_id = submit(service, ALICE, "print(open('data.txt').read())")
    done = wait_final(service, job_id)
    assert done["state"] == "succeeded", done["reason"]
    assert "from alice's home" in log(service, job_id)


def test_home_is_named_in_the_pod_not_the_services_folder(service, cluster):
    assert Path(service.manager.backend.user_home("alice")) == Path(names.HOME)


def test_a_job_can_hand_over_only_a_notebook_of_its_own_ranks(service, cluster):
    import base64

    job_id = submit(service, ALICE, waiting("handover"))
    wait_log(service, job_id, "handover is running")
    secret = cluster.get("Secret", NS, f"{names.trainjob_name(job_id, 1)}-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    url = f"{service.api}/runner/jobs/{job_id}/attempts/1/outputs"

    def put(rank, body, who=token):
        return requests.put(f"{url}/{rank}", data=body, headers={"Authorization": f"Bearer {who}"}, timeout=30)

    not_a_notebook, no_such_rank, bad_rank = put(0, b"[1, 2]"), put(3, b'{"cells": []}'), put("x", b"{}")
    nested = put(0, b"[" * 100_000)
    stranger = put(0, b'{"cells": []}', who="y" * 43)
    go(service, "alice", "handover")
    done = wait_final(service, job_id)

    assert not_a_notebook.status_code == 422 and "not a notebook" in not_a_notebook.json()["message"]
    assert no_such_rank.status_code == 422 and no_such_rank.json()["reason"] == "no_such_rank"
    assert bad_rank.status_code == 400 and nested.status_code in (400, 422)
    assert stranger.status_code == 403
    assert done["state"] == "succeeded" and "handover is done" in output(service, job_id)


def test_queue_changes_say_that_kueue_holds_the_queues(service):
    from danlu.errors import Conflict

    with pytest.raises(Conflict) as held:
        service.run(service.manager.queues.hold(ADMIN, "research", True))
    assert held.value.reason == "kueue_owns_queues" and "kubectl apply -f kueue.yaml" in held.value.fix


ALL_REDUCE = """import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(os.environ["RANK"]) + 1])
dist.all_reduce(total)
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: sum {total.item():g}", flush=True)
print("checkpoints in", os.environ["DANLU_CHECKPOINT_DIR"], flush=True)
dist.destroy_process_group()
"""


def test_a_job_on_two_nodes_is_one_trainjob_of_two_pods_whose_ranks_meet(service, cluster):
    job_id = submit(service, ALICE, ALL_REDUCE, resources={"nproc": 1, "nodes": 2, "gpus": 2})
    wait_for(service, job_id, "admitted", lambda j: j["state"] != "queued")
    tj = cluster.get("TrainJob", NS, names.trainjob_name(job_id, 1))
    done = wait_final(service, job_id)
    rank1 = service.run(service.manager.read_output(service.run(service.manager.get(ADMIN, job_id)), 1, 0, 1 << 20))

    assert done["state"] == "succeeded", done["reason"]
    assert done["resources"]["nodes"] == 2
    assert (tj["spec"]["trainer"]["numNodes"], tj["spec"]["trainer"]["numProcPerNode"]) == (2, 1)
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "1"
    assert "rank 0 of 2: sum 3" in output(service, job_id)
    assert rank1 is not None and "rank 1 of 2: sum 3" in rank1[0].decode()
    # every rank of every node keeps its checkpoints in the owner's home claim (the fake kubelet maps the
    # claim's mount to the owner's folder here), not in its pod
    where = f"checkpoints in {service.homes['alice'] / '.danlu' / 'checkpoints' / job_id}\\n"
    assert where in output(service, job_id) and where in rank1[0].decode()
    # policies.py: the pods may meet through their own NetworkPolicy, deleted with the TrainJob
    assert ("POST", f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies") in cluster.requests
    if cluster.get("TrainJob", NS, tj["metadata"]["name"]) is None:
        assert cluster.get("NetworkPolicy", NS, f"{tj['metadata']['name']}-peers") is None


def test_more_nodes_than_one_machine_or_uneven_gpus_are_refused_with_the_fix(service):
    from danlu.errors import ValidationError

    with pytest.raises(ValidationError) as uneven:
        service.run(service.manager.submit(ALICE, {"notebook": notebook("1"), "resources": {"nodes": 2, "gpus": 3}}))
    assert uneven.value.field == "resources.gpus" and "multiple of 2" in uneven.value.fix


KILL_MY_RUNNER_ONCE = """import os, pathlib, signal, time
import psutil
mark = pathlib.Path(os.environ["HOME"]) / "runner-killed"
if not mark.exists():
    mark.write_text("once")
    runner = next(p for p in psutil.Process().parents() if "danlu.runner" in " ".join(p.cmdline()))
    os.kill(runner.pid, signal.SIGKILL)
    time.sleep(120)
print("the second attempt ran")
"""


def created_trainjobs(cluster) -> int:
    return sum(1 for method, path in cluster.requests if method == "POST" and path.endswith("/trainjobs"))


def test_an_infrastructure_failure_is_retried_as_a_new_trainjob(service, cluster):
    before = created_trainjobs(cluster)
    job_id = submit(service, ALICE, KILL_MY_RUNNER_ONCE, retries=1)
    done = wait_final(service, job_id)

    assert done["state"] == "succeeded", done["reason"]
    first, second = done["attempts"]
    assert (first["state"], first["failure"]) == ("failed", "infrastructure")
    assert second["state"] == "succeeded" and "the second attempt ran" in output(service, job_id)
    assert created_trainjobs(cluster) - before == 2  # one TrainJob per attempt (danlu-<id>-1, danlu-<id>-2)


def test_timeout_is_the_trainjobs_active_deadline(service, cluster):
    job_id = submit(service, ALICE, "import time; time.sleep(120)", timeout_seconds=3)
    wait_for(service, job_id, "running", lambda j: j["state"] == "running")
    deadline = cluster.get("TrainJob", NS, names.trainjob_name(job_id, 1))["spec"]["activeDeadlineSeconds"]
    done = wait_final(service, job_id)

    assert deadline == 3
    assert done["state"] == "timed_out", done["reason"]


# pods as JobSet makes them, kept logs, Kueue's evictions (issue 16) --------------------------------------------


def bare_trainjob(name: str, *, command: list[str], nodes: int = 1, image: str = IMAGE, queue: str | None = None):
    """A TrainJob on the rendered runtime, made here rather than by a service (no runner)."""
    labels = {names.MANAGED_BY: names.MANAGER, names.COMPONENT: names.JOB}
    if queue:
        labels["kueue.x-k8s.io/queue-name"] = queue
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": names.RUNTIME},
            "suspend": bool(queue),
            "trainer": {"numNodes": nodes, "image": image, "command": command},
        },
    }


def direct(service, tmp_path, call, **traits):
    """``call(backend)`` on a backend of its own, in one event loop (the client belongs to that loop)."""
    kubeconfig = service.state_dir / "kubeconfig"

    async def run():
        backend = KubernetesBackend(namespace=NS, kubeconfig=str(kubeconfig), logs_dir=str(tmp_path / "logs"), **traits)
        try:
            return await call(backend)
        finally:
            await backend.shutdown()

    return asyncio.run(run())


def test_logs_and_cancel_find_the_pods_jobset_made_and_keep_the_end_of_rank_0s_log(service, cluster, tmp_path):
    """Fault 7: pods were selected by trainer.kubeflow.org/trainjob-name, which no real pod carries (no log,
    no graceful cancel), and the kept log was its head, where the error never is."""
    script = (
        "import os; rank = os.environ['PET_NODE_RANK']; print('rank', rank, 'starts'); "
        "[print(f'line {i:05d} of rank {rank}') for i in range(2000)]; print('the end of rank', rank)"
    )
    cluster.create(bare_trainjob("logtail", command=["python", "-c", script], nodes=2))
    asyncio.run(
        until(lambda: kueue_true(cluster.get("TrainJob", NS, "logtail"), "Complete"), "Complete", PATIENCE, 0.2)
    )
    state = {"name": "logtail"}

    async def keep(backend):
        pods = await backend._pods(state)
        await backend.cleanup("j-tail", state)
        return pods, await backend.read_log("j-tail", state, 0, 1 << 20)

    pods, (data, size) = direct(service, tmp_path, keep, log_limit=4096)
    assert len(pods) == 2
    assert pods[0]["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert data.startswith(b"[danlu: only the last 4096 bytes of this log are kept]\n"), data[:100]
    assert data.endswith(b"the end of rank 0\n") and b"rank 0 starts" not in data and size == len(data)


def test_kept_logs_are_pruned_by_age_and_total_size(tmp_path):
    """The hub's 1 GiB volume must not fill with kept logs: the oldest go first, the newest always stays."""
    folder = tmp_path / "job-logs"
    old = [folder / f"j{i}" / "a.log" for i in range(3)]
    for i, path in enumerate(old):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
    newest = folder / "j9" / "a.log"
    removed = jobpods.keep_log(folder, newest, b"y" * 150, 150, 300, 0)
    assert removed == old[:2] and newest.read_bytes() == b"y" * 150 and not old[0].parent.exists()
    assert jobpods.prune_logs(folder, 1 << 30, 3600) == [old[2]]  # older than an hour
    assert newest.exists()


def test_pods_that_never_start_give_back_quota_and_the_user_sees_why(service, cluster, tmp_path):
    """Fault 8: an admitted job whose image never pulls held its team's quota; with waitForPodsReady Kueue
    evicts it (PodsReadyTimeout), which is not a preemption: the attempt fails, naming the image."""
    bad = "registry.example/danlu/missing@sha256:" + "2" * 64
    cluster.kubelet.unpullable.add(bad)
    cluster.kueue.pods_ready_timeout = 1.0
    try:
        cluster.create(bare_trainjob("nopull", command=["python", "-c", "pass"], image=bad, queue="research"))

        async def watch(backend):
            async def ended():
                return await backend.poll("j-nopull", {"name": "nopull"})

            return await until(ended, "the attempt to end", PATIENCE, 0.3)

        outcome = direct(service, tmp_path, watch)
    finally:
        cluster.kueue.pods_ready_timeout = None
        cluster.kubelet.unpullable.discard(bad)
    assert outcome.state == "failed" and outcome.infrastructure and not outcome.interrupted, outcome
    assert "waitForPodsReady" in outcome.reason and "ErrImagePull" in outcome.reason and bad in outcome.reason
    workload = next(
        w for w in cluster.objects("Workload", NS) if w["metadata"]["ownerReferences"][0]["name"] == "nopull"
    )
    assert "admission" not in workload["status"]  # its quota is free again
    cluster.delete("TrainJob", NS, "nopull", "Foreground", 0)
