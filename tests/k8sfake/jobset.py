"""The fake JobSet and Job controllers: the objects between a TrainJob and its pods, as the real ones make them.

Kubeflow Trainer v2.3 turns a TrainJob into a JobSet of the same name (owner: the TrainJob); JobSet v0.12
makes one batch Job per replica of each replicatedJob, named ``<jobset>-<replicatedJob>-<jobIndex>``
(``placement.GenJobName``), labelled and annotated by ``labelAndAnnotateObject``
(``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``, ``job-index``, ``job-key``, ...; owner: the
JobSet); an Indexed Job makes ``completions`` pods named ``<job>-<completionIndex>-<random>`` with
``batch.kubernetes.io/job-completion-index`` as label and annotation, ``batch.kubernetes.io/job-name`` and
``controller-uid`` (owner: the Job). No pod carries ``trainer.kubeflow.org/trainjob-name``. So the way from
a TrainJob to its pods is the JobSet name label, and rank 0 is completion index 0 of job 0 of ``node``.
"""

from __future__ import annotations

import copy
import hashlib
import secrets
import string

from .store import Store

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"


def _suffix() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))


def owner_ref(obj: dict) -> dict:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _controller(obj: dict) -> str | None:
    return next((r["uid"] for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def ensure_jobset(store: Store, trainjob: dict, replicated_job: str, completions: int) -> dict:
    """The TrainJob's JobSet and its one Job of ``replicated_job`` (one replica), created if missing."""
    meta = trainjob["metadata"]
    ns, name = meta["namespace"], meta["name"]
    jobset = store.find("JobSet", ns, name)
    if jobset is None:
        jobset = store.create(
            {
                "apiVersion": JOBSET_API,
                "kind": "JobSet",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "labels": dict(meta.get("labels") or {}),
                    "ownerReferences": [owner_ref(trainjob)],
                },
                "spec": {"replicatedJobs": [{"name": replicated_job, "replicas": 1}]},
            }
        )
    job_name = f"{name}-{replicated_job}-0"
    job = store.find("Job", ns, job_name)
    if job is None:
        labels = {
            JOBSET_NAME: name,
            REPLICATED_JOB: replicated_job,
            REPLICAS: "1",
            JOB_INDEX: "0",
            JOB_KEY: hashlib.sha1(f"{ns}/{job_name}".encode()).hexdigest(),
        }
        job = store.create(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {
                    "name": job_name,
                    "namespace": ns,
                    "labels": labels,
                    "annotations": dict(labels),
                    "ownerReferences": [owner_ref(jobset)],
                },
                "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions},
            }
        )
    return job


def pod_of_job(job: dict, pod: dict, index: int) -> dict:
    """``pod`` (a pod built from the runtime's template) as the Job controller creates it for ``index``."""
    pod = copy.deepcopy(pod)
    meta = pod["metadata"]
    job_labels = job["metadata"]["labels"]
    meta["name"] = f"{job['metadata']['name']}-{index}-{_suffix()}"
    meta["labels"] = {
        **(meta.get("labels") or {}),
        **job_labels,
        COMPLETION_INDEX: str(index),
        JOB_NAME: job["metadata"]["name"],
        "job-name": job["metadata"]["name"],
        CONTROLLER_UID: job["metadata"]["uid"],
        "controller-uid": job["metadata"]["uid"],
    }
    meta["annotations"] = {**(meta.get("annotations") or {}), **job_labels, COMPLETION_INDEX: str(index)}
    meta["ownerReferences"] = [owner_ref(job)]
    pod["spec"]["hostname"] = f"{job['metadata']['name']}-{index}"
    pod["spec"]["subdomain"] = job_labels[JOBSET_NAME]
    return pod


def pods_of(store: Store, trainjob: dict) -> list[dict]:
    """The pods of a TrainJob: labelled with its JobSet's name and owned, through Job and JobSet, by it."""
    meta = trainjob["metadata"]
    jobsets = {j["metadata"]["uid"] for j in store.list("JobSet", meta["namespace"]) if _controller(j) == meta["uid"]}
    jobs = {j["metadata"]["uid"] for j in store.list("Job", meta["namespace"]) if _controller(j) in jobsets}
    return [p for p in store.list("Pod", meta["namespace"], f"{JOBSET_NAME}={meta['name']}") if _controller(p) in jobs]
