"""The pure builders of a job's Kubernetes objects: whole dicts, and the official schemas."""

from __future__ import annotations

import pytest

from danlu.hub.k8s import jobs, names

from .k8sschemas import errors

DIGEST = "registry.example/danlu/pytorch@sha256:" + "0" * 64
BASE = dict(
    job_id="0a1b2c3d4e5f",
    attempt=2,
    owner="alice",
    queue="vision",
    priority_class="high",
    namespace="danlu",
    image=DIGEST,
    nproc=2,
    api_url="http://hub:8081/services/danlu/api/v1",
)
LABELS = {
    "app.kubernetes.io/managed-by": "danlu",
    "app.kubernetes.io/component": "job",
    "danlu.io/job-id": "0a1b2c3d4e5f",
    "danlu.io/attempt": "2",
    "danlu.io/owner": "alice",
    "danlu.io/team": "vision",
}


def test_a_trainjob_is_queued_suspended_for_its_team_with_its_token_kept_out_of_its_spec():
    tj = jobs.trainjob(
        **BASE,
        gpus=2,
        cpu=8,
        memory=32 * 2**30,
        timeout_seconds=3600,
        home_claim="claim-alice",
        node_labels={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    )
    assert tj == {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {
            "name": "danlu-0a1b2c3d4e5f-2",
            "namespace": "danlu",
            "labels": {**LABELS, "kueue.x-k8s.io/queue-name": "vision", "kueue.x-k8s.io/priority-class": "high"},
            "annotations": {"danlu.io/owner": "alice"},
        },
        "spec": {
            "runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": "danlu-torch"},
            "suspend": True,
            "activeDeadlineSeconds": 3600,
            "trainer": {
                "image": DIGEST,
                "command": ["python", "-m", "danlu.runner", "--kubernetes"],
                "numNodes": 1,
                "numProcPerNode": 2,
                "resourcesPerNode": {
                    "limits": {"nvidia.com/gpu": "2", "cpu": "8", "memory": str(32 * 2**30)},
                    "requests": {"cpu": "8", "memory": str(32 * 2**30)},
                },
                "env": [
                    {"name": "DANLU_JOB_ID", "value": "0a1b2c3d4e5f"},
                    {"name": "DANLU_ATTEMPT", "value": "2"},
                    {"name": "DANLU_RUNNER_API", "value": "http://hub:8081/services/danlu/api/v1"},
                    {
                        "name": "DANLU_JOB_TOKEN",
                        "valueFrom": {"secretKeyRef": {"name": "danlu-0a1b2c3d4e5f-2-token", "key": "token"}},
                    },
                    {"name": "DANLU_JOB_DIR", "value": "/danlu/job"},
                    # in the home claim, by job: every attempt finds the last one's checkpoints
                    {"name": "DANLU_CHECKPOINT_DIR", "value": "/home/jovyan/.danlu/checkpoints/0a1b2c3d4e5f"},
                    {"name": "HOME", "value": "/home/jovyan"},
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                    # privacy.allow_outbound is off: no telemetry from the job's libraries
                    {"name": "DO_NOT_TRACK", "value": "1"},
                    {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
                    {"name": "MLFLOW_DISABLE_TELEMETRY", "value": "true"},
                ],
            },
            "runtimePatches": [
                {
                    "manager": "danlu.io/jobs-service",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": "node",
                                        "template": {
                                            "spec": {
                                                "template": {
                                                    "metadata": {"labels": LABELS},
                                                    "spec": {
                                                        "volumes": [
                                                            {
                                                                "name": "home",
                                                                "persistentVolumeClaim": {"claimName": "claim-alice"},
                                                            }
                                                        ],
                                                        "containers": [
                                                            {
                                                                "name": "node",
                                                                "volumeMounts": [
                                                                    {"name": "home", "mountPath": "/home/jovyan"}
                                                                ],
                                                            }
                                                        ],
                                                        "nodeSelector": {
                                                            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
                                                        },
                                                        "tolerations": [
                                                            {
                                                                "key": "nvidia.com/gpu",
                                                                "operator": "Exists",
                                                                "effect": "NoSchedule",
                                                            }
                                                        ],
                                                    },
                                                }
                                            }
                                        },
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }
    assert errors(tj) == []


def test_a_cpu_job_without_limits_or_home_asks_for_nothing_it_did_not_ask_for():
    tj = jobs.trainjob(**{**BASE, "priority_class": "", "nproc": 1})
    assert names.PRIORITY_CLASS not in tj["metadata"]["labels"]
    assert tj["spec"]["trainer"]["resourcesPerNode"] == {"limits": {}}
    assert "activeDeadlineSeconds" not in tj["spec"]
    pod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert pod["template"]["spec"]["template"] == {"metadata": {"labels": LABELS}}
    # no home claim: checkpoints stay in the runner's folder in the pod's scratch space (the admin guide says so)
    assert "DANLU_CHECKPOINT_DIR" not in {e["name"] for e in tj["spec"]["trainer"]["env"]}
    assert errors(tj) == []


def test_every_attempt_of_a_job_keeps_its_checkpoints_in_the_same_folder_of_the_same_claim():
    def where(attempt):
        tj = jobs.trainjob(**{**BASE, "attempt": attempt}, home_claim="claim-alice")
        pod = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        spec = pod["template"]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in tj["spec"]["trainer"]["env"]}
        assert errors(tj) == []
        return spec["volumes"], spec["containers"][0]["volumeMounts"], env["DANLU_CHECKPOINT_DIR"]

    assert where(1) == where(2)
    volumes, mounts, folder = where(3)
    assert volumes == [{"name": "home", "persistentVolumeClaim": {"claimName": "claim-alice"}}]
    assert folder.startswith(mounts[0]["mountPath"] + "/") and folder.endswith("/" + BASE["job_id"])


@pytest.mark.parametrize("job_id", ["0a1b2c3d4e5f", "9fffffffffff"])
def test_a_job_id_that_starts_with_a_digit_still_names_a_valid_trainjob(job_id):
    tj = jobs.trainjob(**{**BASE, "job_id": job_id})
    assert tj["metadata"]["name"] == f"danlu-{job_id}-2" and errors(tj) == []


def test_the_schemas_catch_a_trainjob_name_that_starts_with_a_digit():
    tj = jobs.trainjob(**BASE)
    tj["metadata"]["name"] = "0a1b2c3d4e5f-2"
    assert errors(tj) == [": metadata.name must match RFC 1035 DNS label format"]


def test_the_token_secret_is_owned_by_its_trainjob():
    secret = jobs.secret(
        job_id="0a1b2c3d4e5f",
        attempt=2,
        owner="alice",
        queue="vision",
        namespace="danlu",
        token="t" * 43,
        owner_uid="1234",
    )
    assert secret == {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "danlu-0a1b2c3d4e5f-2-token",
            "namespace": "danlu",
            "labels": LABELS,
            "ownerReferences": [
                {
                    "apiVersion": "trainer.kubeflow.org/v1alpha1",
                    "kind": "TrainJob",
                    "name": "danlu-0a1b2c3d4e5f-2",
                    "uid": "1234",
                    "controller": False,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "data": {"token": "dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dHR0dA=="},
    }
    assert errors(secret) == []


@pytest.mark.parametrize(("user", "label"), [("alice", "alice"), ("a@b.c", None), ("x" * 80, None)])
def test_any_hub_user_name_becomes_a_valid_label_value(user, label):
    value = names.owner_label(user)
    assert (value == label) if label else (len(value) <= 63 and value != user)
    assert (
        errors(jobs.secret(job_id="0a1b2c3d4e5f", attempt=1, owner=user, queue="q", namespace="danlu", token="t" * 43))
        == []
    )
