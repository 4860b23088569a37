"""A job's attempt as Kubernetes objects: a Kueue-queued TrainJob and the Secret holding its token.

Pure builders (dicts in, dicts out) for :mod:`danlu.hub.backends.kubernetes`. One attempt is one
``TrainJob`` (Kubeflow Trainer v2 ``trainer.kubeflow.org/v1alpha1``) on the ``danlu-torch``
ClusterTrainingRuntime that ``danlu render k8s`` writes: created suspended and labelled for its team's
LocalQueue and priority class, so Kueue admits it (and injects the chosen flavor's node labels and
tolerations); ``numNodes`` x ``numProcPerNode`` ranks, each running ``python -m danlu.runner
--kubernetes``. The runner reads its launch from the environment; the token comes from the attempt's
Secret, never from the TrainJob's spec. The owner's home volume is mounted where the notebook server
has it, so the job sees the notebook's folder, and ``$DANLU_CHECKPOINT_DIR`` is a folder in it named by the
job (:func:`~danlu.hub.k8s.names.checkpoint_dir`), so every attempt finds the checkpoints of the one before.
"""

from __future__ import annotations

import base64

from danlu import env
from danlu.hub.k8s import names

API_VERSION = "trainer.kubeflow.org/v1alpha1"
GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
PATCH_MANAGER = "danlu.io/jobs-service"
TOKEN_KEY = "token"


def labels(job_id: str, attempt: int, owner: str, queue: str) -> dict:
    return {
        names.MANAGED_BY: names.MANAGER,
        names.COMPONENT: names.JOB,
        names.JOB_ID: job_id,
        names.ATTEMPT: str(attempt),
        names.OWNER: names.owner_label(owner),
        names.TEAM: queue,
    }


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def resources(gpus: int, cpu: float, memory: float, resource: str = "nvidia.com/gpu") -> dict:
    """Per-node resources: GPUs as limits (the API server refuses a GPU request without one), CPU and memory
    requested and limited alike (quantities as strings)."""
    limits: dict = {}
    if gpus:
        limits[resource] = str(gpus)
    if cpu:
        limits["cpu"] = _quantity(cpu)
    if memory:
        limits["memory"] = str(int(memory))
    requests = {k: v for k, v in limits.items() if k in ("cpu", "memory")}
    return {"limits": limits, **({"requests": requests} if requests else {})}


def trainjob(
    *,
    job_id: str,
    attempt: int,
    owner: str,
    queue: str,
    priority_class: str,
    namespace: str,
    image: str,
    nproc: int,
    api_url: str,
    gpus: int = 0,
    cpu: float = 0.0,
    memory: float = 0.0,
    timeout_seconds: float | None = None,
    runtime: str = names.RUNTIME,
    home_claim: str | None = None,
    gpu_resource: str = "nvidia.com/gpu",
    node_labels: dict | None = None,
    tolerations: list | None = None,
    nnodes: int = 1,
    allow_outbound: bool = False,
) -> dict:
    """The TrainJob of one attempt (suspended: Kueue unsuspends it when it admits it). Unless
    ``allow_outbound`` (``privacy``), its pods run with telemetry off."""
    name = names.trainjob_name(job_id, attempt)
    meta_labels = labels(job_id, attempt, owner, queue)
    meta_labels[names.QUEUE_NAME] = queue
    if priority_class:
        meta_labels[names.PRIORITY_CLASS] = priority_class
    secret = secret_name(job_id, attempt)
    container_env = [
        {"name": env.JOB_ID, "value": job_id},
        {"name": env.ATTEMPT, "value": str(attempt)},
        {"name": env.RUNNER_API, "value": api_url},
        {"name": env.JOB_TOKEN, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}},
        {"name": env.JOB_DIR, "value": names.JOB_DIR},
        {"name": "HOME", "value": names.HOME},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *({"name": k, "value": v} for k, v in sorted(env.private_environment(allow_outbound, {}).items())),
    ]
    pod_spec: dict = {}
    if home_claim:  # checkpoints in the home claim, kept across attempts; without one, in the pod's scratch
        container_env.insert(5, {"name": env.CHECKPOINT_DIR, "value": names.checkpoint_dir(job_id)})
        pod_spec["volumes"] = [{"name": "home", "persistentVolumeClaim": {"claimName": home_claim}}]
        pod_spec["containers"] = [
            {"name": names.TRAINER_CONTAINER, "volumeMounts": [{"name": "home", "mountPath": names.HOME}]}
        ]
    if node_labels:  # a flavor asked by name: only its nodes (Kueue then picks only that flavor)
        pod_spec["nodeSelector"] = dict(node_labels)
    if tolerations:
        pod_spec["tolerations"] = [dict(t) for t in tolerations]
    pod_template = {
        "metadata": {"labels": labels(job_id, attempt, owner, queue)},
        **({"spec": pod_spec} if pod_spec else {}),
    }
    spec: dict = {
        "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": runtime},
        "suspend": True,
        "trainer": {
            "image": image,
            "command": ["python", "-m", "danlu.runner", "--kubernetes"],
            "numNodes": nnodes,
            "numProcPerNode": nproc,
            "resourcesPerNode": resources(gpus, cpu, memory, gpu_resource),
            "env": container_env,
        },
        "runtimePatches": [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {"name": names.TRAINER_CONTAINER, "template": {"spec": {"template": pod_template}}}
                            ]
                        }
                    }
                },
            }
        ],
    }
    if timeout_seconds:
        spec["activeDeadlineSeconds"] = int(timeout_seconds)
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": meta_labels,
            "annotations": {names.OWNER_ANNOTATION: owner},
        },
        "spec": spec,
    }


def secret_name(job_id: str, attempt: int) -> str:
    return f"{names.trainjob_name(job_id, attempt)}-token"


def secret(
    *, job_id: str, attempt: int, owner: str, queue: str, namespace: str, token: str, owner_uid: str | None = None
) -> dict:
    """The attempt's token, owned by its TrainJob (deleted with it)."""
    meta: dict = {
        "name": secret_name(job_id, attempt),
        "namespace": namespace,
        "labels": labels(job_id, attempt, owner, queue),
    }
    if owner_uid:
        meta["ownerReferences"] = [
            {
                "apiVersion": API_VERSION,
                "kind": "TrainJob",
                "name": names.trainjob_name(job_id, attempt),
                "uid": owner_uid,
                "controller": False,
                "blockOwnerDeletion": False,
            }
        ]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta,
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
