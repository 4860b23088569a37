"""The fake Kubernetes cluster (tests/k8sfake) as the real clients see it: over HTTP, never patched.

The Kueue objects are the ones :func:`danlu.hub.kueue.render` writes for a two-team cohort
(vision and nlp, 2 a100 GPUs each, each may borrow 2), POSTed like ``kubectl create`` would, so the
fake admits exactly what Danlu renders. The ClusterTrainingRuntime is a minimal ``danlu-torch``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import urllib.request

import psutil
import pytest
import yaml
from kubernetes import client, config

from danlu.hub import gpus, kueue
from danlu.hub.config import load_settings
from danlu.hub.k8s import manifests

from .k8sfake import FakeCluster
from .k8sschemas import errors

NS = "danlu"
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
KUEUE, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
CONFIG = {
    "gpus": {"declared": [{"count": 4, "flavor": "a100"}]},
    "resources": {"cpu": 16, "memory": "64G"},
    "groups": {"vision": ["alice"], "nlp": ["bob"]},
    "teams": {
        "vision": {"cohort": "lab", "quota": {"gpus": {"a100": 2}}, "borrowing_limit": {"gpus": {"a100": 2}}},
        "nlp": {"cohort": "lab", "quota": {"gpus": {"a100": 2}}, "borrowing_limit": {"gpus": {"a100": 2}}},
    },
    "priority_classes": {"low": {"value": 100}, "normal": {"value": 1000, "default": True}, "high": {"value": 10000}},
}
RUNTIME = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1",
    "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "danlu-torch"},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "node",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "template": {
                                    "spec": {
                                        "terminationGracePeriodSeconds": 2,
                                        "containers": [
                                            {
                                                "name": "node",
                                                "image": "danlu/runner:latest",
                                                "command": ["python", "-m", "danlu.runner", "--kubernetes"],
                                                "volumeMounts": [
                                                    {"name": "dshm", "mountPath": "/dev/shm"},
                                                    {"name": "job", "mountPath": "/danlu/job"},
                                                ],
                                            }
                                        ],
                                        "volumes": [
                                            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                                            {"name": "job", "emptyDir": {}},
                                        ],
                                    }
                                }
                            }
                        },
                    }
                ]
            }
        },
    },
}
SLEEP = ["python", "-c", "import time; time.sleep(60)"]


def kueue_objects(tmp_path, overrides=None) -> list[dict]:
    path = tmp_path / "danlu.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    settings = load_settings(path, environ={})
    return kueue.render(settings, gpus.inventory(settings.gpus), namespace=NS, overrides=overrides)


def trainjob(name, *, queue="vision", gpus=1, nodes=1, command=SLEEP, priority=None, **spec) -> dict:
    labels = {"kueue.x-k8s.io/queue-name": queue} if queue else {}
    if priority:
        labels["kueue.x-k8s.io/priority-class"] = priority
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "spec": {
            "runtimeRef": {"name": "danlu-torch", "apiGroup": GROUP, "kind": "ClusterTrainingRuntime"},
            "suspend": bool(queue),
            **spec,
            "trainer": {
                "numNodes": nodes,
                "command": command,
                "resourcesPerNode": {"limits": {"nvidia.com/gpu": gpus}, "requests": {"cpu": "1", "memory": "1Gi"}},
            },
        },
    }


def runtime_patch(*, volumes=(), container=None, labels=None) -> list[dict]:
    """``spec.runtimePatches`` for the pods of replicatedJob ``node`` (what Danlu's backend patches)."""
    template = {"spec": {"volumes": list(volumes), "containers": [{"name": "node", **(container or {})}]}}
    if labels:
        template["metadata"] = {"labels": labels}
    return [
        {
            "manager": "danlu.io/jobs",
            "trainingRuntimeSpec": {
                "template": {
                    "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": template}}}]}
                }
            },
        }
    ]


HOME_CLAIM = {"name": "home", "persistentVolumeClaim": {"claimName": "home"}}
HOME_MOUNT = {"volumeMounts": [{"name": "home", "mountPath": "/home/jovyan"}]}


def wait_for(check, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def condition(obj, type_):
    return next((c for c in (obj or {}).get("status", {}).get("conditions") or [] if c["type"] == type_), None)


def is_true(obj, type_):
    return (condition(obj, type_) or {}).get("status") == "True"


@pytest.fixture
def cluster(tmp_path):
    fake = FakeCluster().start()
    yield fake
    fake.stop()
    assert fake.errors == []


@pytest.fixture
def api(cluster, tmp_path) -> client.ApiClient:
    api_client = config.new_client_from_config(config_file=cluster.write_kubeconfig(tmp_path / "kubeconfig"))
    yield api_client
    api_client.close()


def load(api: client.ApiClient, objects: list[dict]) -> client.CustomObjectsApi:
    """POST the Kueue objects and the runtime, as ``kubectl create -f`` would."""
    custom = client.CustomObjectsApi(api)
    for obj in objects:
        plural = {
            "ResourceFlavor": "resourceflavors",
            "ClusterQueue": "clusterqueues",
            "LocalQueue": "localqueues",
            "WorkloadPriorityClass": "workloadpriorityclasses",
        }[obj["kind"]]
        if obj["kind"] == "LocalQueue":
            custom.create_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, plural, obj)
        else:
            custom.create_cluster_custom_object(KUEUE, KUEUE_VERSION, plural, obj)
    custom.create_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", RUNTIME)
    return custom


@pytest.fixture
def kueue_loaded(api, tmp_path):
    return load(api, kueue_objects(tmp_path))


def submit(custom: client.CustomObjectsApi, obj: dict) -> dict:
    return custom.create_namespaced_custom_object(GROUP, VERSION, NS, "trainjobs", obj)


def workload_of(cluster, name):
    return next(
        (w for w in cluster.objects("Workload", NS) if w["metadata"]["ownerReferences"][0]["name"] == name), None
    )


def pods_of(cluster, name):
    """As on a real cluster: JobSet's label (Trainer v2.3 sets no trainjob-name label on pods)."""
    return cluster.objects("Pod", NS, f"jobset.sigs.k8s.io/jobset-name={name}")


# --- the API server ---------------------------------------------------------------------------------


def test_fixtures_are_valid():
    assert errors(RUNTIME) == []
    assert errors(trainjob("a")) == []


def test_crud_and_status_errors(cluster, api):
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    secret = core.create_namespaced_secret(
        NS, client.V1Secret(metadata=client.V1ObjectMeta(name="s", labels={"a": "1"}), string_data={"token": "t0p"})
    )
    assert secret.metadata.uid and secret.metadata.resource_version and secret.data == {"token": "dDBw"}
    with pytest.raises(client.ApiException) as e:
        core.create_namespaced_secret(NS, {"metadata": {"name": "s"}})
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as e:
        core.read_namespaced_secret("missing", NS)
    assert e.value.status == 404 and json.loads(e.value.body)["kind"] == "Status"

    bad = kueue.make_local_queue("Vision", NS)  # not a DNS name
    with pytest.raises(client.ApiException) as e:
        custom.create_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", bad)
    body = json.loads(e.value.body)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert "does not match" in body["message"] and body["details"]["causes"]

    lq = custom.create_namespaced_custom_object(
        KUEUE, KUEUE_VERSION, NS, "localqueues", kueue.make_local_queue("vision", NS)
    )
    assert lq["metadata"]["generation"] == 1
    merged = custom.patch_namespaced_custom_object(
        KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", {"metadata": {"labels": {"x": "y"}}}
    )
    assert merged["metadata"]["labels"]["x"] == "y"
    assert int(merged["metadata"]["resourceVersion"]) > int(lq["metadata"]["resourceVersion"])
    ops = [{"op": "replace", "path": "/spec/clusterQueue", "value": "nlp"}]
    with pytest.raises(client.ApiException) as e:  # the client sends merge-patch unless told otherwise
        custom.patch_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", ops)
    assert e.value.status == 400
    patched = custom.patch_namespaced_custom_object(
        KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", ops, _content_type="application/json-patch+json"
    )
    assert patched["spec"]["clusterQueue"] == "nlp" and patched["metadata"]["generation"] == 2
    status = custom.patch_namespaced_custom_object_status(
        KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", {"status": {"pendingWorkloads": 3}, "spec": {"x": 1}}
    )
    assert status["status"]["pendingWorkloads"] == 3 and "x" not in status["spec"]
    with pytest.raises(client.ApiException) as e:  # the resourceVersion it was read at is stale now
        custom.replace_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", patched)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"
    fresh = custom.get_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "vision")
    fresh["spec"]["clusterQueue"] = "vision"
    replaced = custom.replace_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "vision", fresh)
    assert replaced["spec"]["clusterQueue"] == "vision" and replaced["status"]["pendingWorkloads"] == 3
    with pytest.raises(client.ApiException) as e:
        custom.get_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "nope")
    assert e.value.status == 404
    custom.delete_namespaced_custom_object(KUEUE, KUEUE_VERSION, NS, "localqueues", "vision")
    assert cluster.get("LocalQueue", NS, "vision") is None
    assert ("DELETE", f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{NS}/localqueues/vision") in cluster.requests

    stranger = client.ApiClient(client.Configuration(host=cluster.url))
    with pytest.raises(client.ApiException) as e:
        client.CoreV1Api(stranger).list_namespaced_secret(NS)
    assert e.value.status == 401
    assert client.CoreV1Api(api).read_namespace(NS).metadata.name == NS


def test_label_and_field_selectors(cluster, api):
    core = client.CoreV1Api(api)
    for name, labels in [("a", {"team": "vision", "tier": "gpu"}), ("b", {"team": "nlp"}), ("c", {})]:
        core.create_namespaced_secret(NS, {"metadata": {"name": name, "labels": labels}})

    def names(**kw):
        result = core.list_namespaced_secret(NS, **kw)
        assert result.metadata.resource_version
        return sorted(s.metadata.name for s in result.items)

    assert names() == ["a", "b", "c"]
    assert names(label_selector="team=vision") == ["a"]
    assert names(label_selector="team!=vision") == ["b", "c"]
    assert names(label_selector="team in (vision,nlp)") == ["a", "b"]
    assert names(label_selector="team notin (vision)") == ["b", "c"]
    assert names(label_selector="team") == ["a", "b"]
    assert names(label_selector="!team") == ["c"]
    assert names(label_selector="team in (vision, nlp),tier") == ["a"]
    assert names(field_selector="metadata.name=b") == ["b"]


def test_a_watch_sees_added_modified_deleted(cluster, tmp_path):
    from kubernetes_asyncio import client as aclient
    from kubernetes_asyncio import config as aconfig
    from kubernetes_asyncio import watch

    async def main():
        await aconfig.load_kube_config(config_file=cluster.write_kubeconfig(tmp_path / "kc"))
        async with aclient.ApiClient() as api:
            core = aclient.CoreV1Api(api)
            await core.create_namespaced_secret(NS, {"metadata": {"name": "before", "labels": {"w": "1"}}})
            listed = await core.list_namespaced_secret(NS, label_selector="w=1")
            seen = []

            async def changes():
                await asyncio.sleep(0.2)
                await core.create_namespaced_secret(NS, {"metadata": {"name": "s", "labels": {"w": "1"}}})
                await core.create_namespaced_secret(NS, {"metadata": {"name": "other"}})  # filtered out
                await core.patch_namespaced_secret("s", NS, {"metadata": {"annotations": {"k": "v"}}})
                await core.delete_namespaced_secret("s", NS)

            task = asyncio.create_task(changes())
            async with watch.Watch().stream(
                core.list_namespaced_secret,
                NS,
                label_selector="w=1",
                resource_version=listed.metadata.resource_version,
                timeout_seconds=5,
            ) as stream:
                async for event in stream:
                    seen.append((event["type"], event["object"].metadata.name))
                    if event["type"] == "DELETED":
                        break
            await task
            return seen

    assert asyncio.run(main()) == [("ADDED", "s"), ("MODIFIED", "s"), ("DELETED", "s")]


def test_fail_next_injects_transient_errors(cluster, api, kueue_loaded):
    cluster.fail_next("list", "TrainJob", status=503, times=2)
    cluster.fail_next("create", "trainjobs", status=429)
    for code in (503, 503):
        with pytest.raises(client.ApiException) as e:
            kueue_loaded.list_namespaced_custom_object(GROUP, VERSION, NS, "trainjobs")
        assert e.value.status == code
    assert kueue_loaded.list_namespaced_custom_object(GROUP, VERSION, NS, "trainjobs")["items"] == []
    with pytest.raises(client.ApiException) as e:
        submit(kueue_loaded, trainjob("a"))
    assert e.value.status == 429 and json.loads(e.value.body)["reason"] == "TooManyRequests"
    assert submit(kueue_loaded, trainjob("a"))["metadata"]["name"] == "a"


# --- the simulators ----------------------------------------------------------------------------------


def test_a_trainjob_runs_its_pods_to_complete_with_logs(cluster, api, kueue_loaded, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    cluster.volumes["home"] = str(home)
    client.CoreV1Api(api).create_namespaced_secret(
        NS, {"metadata": {"name": "mlflow"}, "string_data": {"token": "s3cret"}}
    )
    script = (
        "import os, sys; open('/home/jovyan/rank-' + os.environ['PET_NODE_RANK'], 'w').write(os.getcwd()); "
        "print('hi', os.environ['PET_NNODES'], os.environ['TOKEN'], os.environ['POD']); "
        "print(os.environ['JOB_DIR']); print('done', file=sys.stderr)"
    )
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "JOB_DIR", "value": "/danlu/job"},
    ]
    job = trainjob(
        "run",
        gpus=1,
        nodes=2,
        command=["python", "-c", script],
        runtimePatches=runtime_patch(
            volumes=[HOME_CLAIM], container={**HOME_MOUNT, "env": env}, labels={"danlu.io/job-id": "j1"}
        ),
    )
    job["spec"]["trainer"]["numProcPerNode"] = 1
    submit(kueue_loaded, job)
    done = wait_for(lambda: is_true(j := cluster.get("TrainJob", NS, "run"), "Complete") and j, what="Complete")
    assert done["spec"]["suspend"] is False
    pods = pods_of(cluster, "run")
    assert len(pods) == 2 and all(p["status"]["phase"] == "Succeeded" for p in pods)
    assert all(re.fullmatch(r"run-node-0-[01]-[a-z0-9]{5}", p["metadata"]["name"]) for p in pods)
    assert cluster.objects("Pod", NS, "trainer.kubeflow.org/trainjob-name=run") == []
    by_index = {p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]: p for p in pods}
    assert sorted(by_index) == ["0", "1"]
    pod = by_index["0"]
    labels = pod["metadata"]["labels"]
    assert labels["jobset.sigs.k8s.io/replicatedjob-name"] == "node" and labels["jobset.sigs.k8s.io/job-index"] == "0"
    job = cluster.get("Job", NS, "run-node-0")
    jobset = cluster.get("JobSet", NS, "run")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert job["metadata"]["ownerReferences"][0]["uid"] == jobset["metadata"]["uid"]
    assert jobset["metadata"]["ownerReferences"][0]["uid"] == done["metadata"]["uid"]
    assert pod["metadata"]["labels"]["danlu.io/job-id"] == "j1"
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision"
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert errors({k: v for k, v in pod.items() if k != "status"}) == []
    log = client.CoreV1Api(api).read_namespaced_pod_log(pod["metadata"]["name"], NS, container="node")
    hi, job_dir, done = log.splitlines()
    assert hi == f"hi 2 s3cret {pod['metadata']['name']}" and done == "done"
    assert job_dir.startswith(cluster.workdir)  # /danlu/job, an emptyDir, is a fresh local folder
    tail = client.CoreV1Api(api).read_namespaced_pod_log(pod["metadata"]["name"], NS, tail_lines=1)
    assert tail == "done\n"
    assert sorted(os.listdir(home)) == ["rank-0", "rank-1"]
    workload = workload_of(cluster, "run")
    assert is_true(workload, "Finished") and errors(workload) == []
    assert workload["spec"]["podSets"][0]["count"] == 2


def test_a_failing_pod_fails_the_trainjob(cluster, api, kueue_loaded):
    submit(kueue_loaded, trainjob("bad", queue=None, command=["python", "-c", "raise SystemExit(3)"]))
    failed = wait_for(lambda: condition(cluster.get("TrainJob", NS, "bad"), "Failed"), what="Failed")
    assert failed["reason"] == "TrainJobFailed" and "exit code 3" in failed["message"]


def test_an_unknown_claim_keeps_the_pod_pending_with_an_event(cluster, api, kueue_loaded):
    job = trainjob("nopvc", queue=None)
    job["spec"]["runtimePatches"] = runtime_patch(
        volumes=[{"name": "h", "persistentVolumeClaim": {"claimName": "nope"}}]
    )
    submit(kueue_loaded, job)
    event = wait_for(lambda: cluster.objects("Event", NS), what="an event")[0]
    assert event["reason"] == "FailedMount" and "nope" in event["message"]
    assert pods_of(cluster, "nopvc")[0]["status"].get("phase", "Pending") == "Pending"


def test_quota_admission_and_the_pending_message(cluster, api, kueue_loaded):
    submit(kueue_loaded, trainjob("first", gpus=2))
    wait_for(lambda: pods_of(cluster, "first"), what="pods")
    admitted = workload_of(cluster, "first")
    assert admitted["status"]["admission"] == {
        "clusterQueue": "vision",
        "podSetAssignments": [
            {
                "name": "node",
                "flavors": {"nvidia.com/gpu": "a100", "cpu": "default-flavor", "memory": "default-flavor"},
                "count": 1,
                "resourceUsage": {"nvidia.com/gpu": "2", "cpu": "1", "memory": str(2**30)},
            }
        ],
    }
    assert is_true(admitted, "QuotaReserved") and is_true(admitted, "Admitted") and errors(admitted) == []
    assert admitted["metadata"]["ownerReferences"][0]["controller"] is True
    assert re.fullmatch(r"trainjob-first-[0-9a-f]{5}", admitted["metadata"]["name"])

    submit(kueue_loaded, trainjob("second", gpus=3))  # 2 used of 4 in the cohort; same priority: no preemption
    pending = wait_for(lambda: condition(workload_of(cluster, "second"), "QuotaReserved"), what="pending")
    assert pending["status"] == "False" and pending["reason"] == "Pending"
    assert pending["message"] == (
        "couldn't assign flavors to pod set node: insufficient unused quota for "
        "nvidia.com/gpu in flavor a100, 1 more needed"
    )
    assert workload_of(cluster, "second")["spec"]["priority"] == 0
    assert cluster.get("TrainJob", NS, "second")["spec"]["suspend"] is True


def test_borrowing_then_reclaim_preempts_the_borrower(cluster, api, kueue_loaded, tmp_path):
    cluster.volumes["home"] = str(tmp_path)
    job = trainjob(
        "borrower",
        gpus=4,
        command=[
            "python",
            "-c",
            "import os, time; open('/home/jovyan/pid', 'w').write(str(os.getpid())); time.sleep(60)",
        ],
    )
    job["spec"]["runtimePatches"] = runtime_patch(volumes=[HOME_CLAIM], container=HOME_MOUNT)
    submit(kueue_loaded, job)
    pid = int(wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(), what="the pid"))
    assert psutil.pid_exists(pid)
    borrower = workload_of(cluster, "borrower")
    assert borrower["status"]["admission"]["podSetAssignments"][0]["resourceUsage"]["nvidia.com/gpu"] == "4"

    owner = submit(kueue_loaded, trainjob("owner", queue="nlp", gpus=2))
    evicted = wait_for(lambda: condition(workload_of(cluster, "borrower"), "Evicted"), what="eviction")
    reclaimer = workload_of(cluster, "owner")
    assert evicted["status"] == "True" and evicted["reason"] == "Preempted"
    assert evicted["message"] == (
        f"Preempted to accommodate a workload (UID: {reclaimer['metadata']['uid']}, "
        f"JobUID: {owner['metadata']['uid']}) due to reclamation within the cohort; "
        "preemptor path: /lab/nlp; preemptee path: /lab/vision"
    )
    borrower = workload_of(cluster, "borrower")
    assert not is_true(borrower, "QuotaReserved") and not is_true(borrower, "Admitted")
    assert "admission" not in borrower["status"]
    assert cluster.get("TrainJob", NS, "borrower")["spec"]["suspend"] is True
    wait_for(lambda: not pods_of(cluster, "borrower"), what="the borrower's pods to go")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    wait_for(lambda: is_true(workload_of(cluster, "owner"), "Admitted"), what="the owner's admission")
    assert wait_for(lambda: pods_of(cluster, "owner"), what="the owner's pods")
    # the borrower waits: 2 GPUs are free, it wants 4
    pending = wait_for(
        lambda: (
            (c := condition(workload_of(cluster, "borrower"), "QuotaReserved"))
            and "couldn't assign" in c["message"]
            and c
        ),
        what="requeued",
    )
    assert "2 more needed" in pending["message"]


def test_priority_preempts_within_the_cluster_queue(cluster, api, kueue_loaded):
    submit(kueue_loaded, trainjob("low", queue="nlp", gpus=4, priority="low"))  # 2 of them borrowed
    wait_for(lambda: is_true(workload_of(cluster, "low"), "Admitted"), what="admission")
    # within nlp's nominal quota (2): asking more, it could preempt only with borrowWithinCohort, which Danlu never sets
    submit(kueue_loaded, trainjob("high", queue="nlp", gpus=2, priority="high"))
    evicted = wait_for(lambda: condition(workload_of(cluster, "low"), "Evicted"), what="eviction")
    assert evicted["message"].endswith(
        "due to prioritization in the ClusterQueue; preemptor path: /lab/nlp; preemptee path: /lab/nlp"
    )
    wait_for(lambda: is_true(workload_of(cluster, "high"), "Admitted"), what="the high one's admission")


def test_a_held_queue_admits_nothing_and_visibility_shows_positions(cluster, api, tmp_path):
    custom = load(api, kueue_objects(tmp_path, overrides={"vision": {"held": True}}))
    for name, priority in [("a", "low"), ("b", "high"), ("c", "low")]:
        submit(custom, trainjob(name, priority=priority))
    wait_for(
        lambda: all(workload_of(cluster, n) and condition(workload_of(cluster, n), "QuotaReserved") for n in "abc"),
        what="three pending workloads",
    )
    assert condition(workload_of(cluster, "a"), "QuotaReserved")["message"] == "ClusterQueue vision is inactive"
    request = urllib.request.Request(
        f"{cluster.url}/apis/visibility.kueue.x-k8s.io/v1beta1/namespaces/{NS}/localqueues/vision/pendingworkloads",
        headers={"Authorization": f"Bearer {cluster.token}"},
    )
    with urllib.request.urlopen(request) as response:
        summary = json.load(response)
    assert summary["kind"] == "PendingWorkloadsSummary"
    assert [
        (
            i["metadata"]["ownerReferences"][0]["name"],
            i["priority"],
            i["localQueueName"],
            i["positionInClusterQueue"],
            i["positionInLocalQueue"],
        )
        for i in summary["items"]
    ] == [("b", 10000, "vision", 0, 0), ("a", 100, "vision", 1, 1), ("c", 100, "vision", 2, 2)]
    assert not pods_of(cluster, "b")


def test_active_deadline_fails_the_trainjob(cluster, api, kueue_loaded):
    submit(kueue_loaded, trainjob("slow", gpus=1, activeDeadlineSeconds=1))
    wait_for(lambda: pods_of(cluster, "slow"), what="pods")
    failed = wait_for(lambda: condition(cluster.get("TrainJob", NS, "slow"), "Failed"), what="Failed")
    assert failed["reason"] == "DeadlineExceeded"
    wait_for(lambda: not pods_of(cluster, "slow"), what="the pods to go")
    assert is_true(workload_of(cluster, "slow"), "Finished")


def test_delete_cascades_to_workload_and_pods(cluster, api, kueue_loaded):
    submit(kueue_loaded, trainjob("gone", gpus=1))
    pod = wait_for(
        lambda: [p for p in pods_of(cluster, "gone") if p.get("status", {}).get("phase") == "Running"],
        what="a running pod",
    )[0]
    pid = cluster.kubelet.procs[pod["metadata"]["uid"]].popen.pid
    kueue_loaded.delete_namespaced_custom_object(
        GROUP, VERSION, NS, "trainjobs", "gone", propagation_policy="Foreground"
    )
    wait_for(lambda: cluster.get("TrainJob", NS, "gone") is None, what="the TrainJob to go")
    assert workload_of(cluster, "gone") is None and pods_of(cluster, "gone") == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# --- where the fake used to pass what a real cluster refuses (issue 16, deliverable 3) ---------------------


def plain_pod(name, **spec):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "i", "command": ["sleep", "1"]}], **spec},
    }


@pytest.mark.parametrize(
    "spec, field, detail",
    [
        (
            {
                "volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}],
                "containers": [
                    {
                        "name": "c",
                        "image": "i",
                        "volumeMounts": [
                            {"name": "a", "mountPath": "/dev/shm"},
                            {"name": "b", "mountPath": "/dev/shm"},
                        ],
                    }
                ],
            },
            "spec.containers[0].volumeMounts[1].mountPath",
            'Invalid value: "/dev/shm": must be unique',
        ),
        (
            {"volumes": [{"name": "shm", "emptyDir": {}}, {"name": "shm", "emptyDir": {"medium": "Memory"}}]},
            "spec.volumes[1].name",
            'Duplicate value: "shm"',
        ),
        (
            {
                "containers": [
                    {"name": "c", "image": "i", "resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}
                ]
            },
            "spec.containers[0].resources.requests",
            'Invalid value: "2": must be less than or equal to cpu limit of 1',
        ),
        (
            {"containers": [{"name": "c", "image": "i", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}]},
            "spec.containers[0].volumeMounts[0].name",
            'Not found: "nope"',
        ),
    ],
)
def test_the_api_server_refuses_pods_no_schema_refuses(cluster, api, spec, field, detail):
    """Issue 16's fault 3 (two volumes at /dev/shm) passed the schemas and the fake; a real API server says 422."""
    pod = plain_pod("p", **spec)
    assert errors(pod) == []  # the official schema has nothing against it
    with pytest.raises(client.ApiException) as e:
        client.CoreV1Api(api).create_namespaced_pod(NS, pod)
    body = json.loads(e.value.body)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == f'Pod "p" is invalid: {field}: {detail}'
    assert body["details"]["causes"][0]["field"] == field


def test_rbac_from_the_rendered_role_binds_the_jobs_services_account(cluster, api, tmp_path):
    """The jobs service runs as the hub's service account: it may do what rbac.yaml grants and nothing else."""
    token = cluster.service_account_token(NS, "hub")
    hub = config.new_client_from_config(config_file=cluster.write_kubeconfig(tmp_path / "hub", token=token))
    try:
        with pytest.raises(client.ApiException) as e:
            client.CoreV1Api(hub).list_namespaced_pod(NS)
        assert e.value.status == 403 and json.loads(e.value.body)["message"] == (
            f'pods is forbidden: User "system:serviceaccount:{NS}:hub" cannot list resource "pods" in API group "" '
            f'in the namespace "{NS}"'
        )
        rbac = client.RbacAuthorizationV1Api(api)
        role, binding = manifests.make_jobs_rbac(NS)
        rbac.create_namespaced_role(NS, role)
        rbac.create_namespaced_role_binding(NS, binding)
        assert client.CoreV1Api(hub).list_namespaced_pod(NS).items == []
        with pytest.raises(client.ApiException) as e:  # not in the Role
            client.CoreV1Api(hub).delete_namespace(NS)
        assert e.value.status == 403

        def can_i(verb, resource, subresource=""):
            review = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(
                        namespace=NS, verb=verb, resource=resource, subresource=subresource or None
                    )
                )
            )
            return client.AuthorizationV1Api(hub).create_self_subject_access_review(review).status.allowed

        assert can_i("get", "pods", "log") and can_i("delete", "pods") and not can_i("create", "pods")
    finally:
        hub.close()


def test_a_strategic_merge_patch_merges_lists_by_their_key(cluster, api):
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        NS, plain_pod("smp", containers=[{"name": "a", "image": "i", "env": [{"name": "X", "value": "1"}]}])
    )
    patched = core.patch_namespaced_pod(  # the Python client sends strategic merge patches for built-in kinds
        "smp", NS, {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}]}}
    )
    assert [(e.name, e.value) for e in patched.spec.containers[0].env] == [("X", "1"), ("Y", "2")]
    assert patched.spec.containers[0].image == "i"
