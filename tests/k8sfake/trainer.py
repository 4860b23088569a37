"""The fake Kubeflow Trainer: a TrainJob's pods from its ClusterTrainingRuntime, and the TrainJob's status.

A TrainJob queued on Kueue (its ``kueue.x-k8s.io/queue-name`` names a LocalQueue) runs while its Workload
is admitted: ``spec.suspend`` is set to match, and an evicted one is suspended again, its pods deleted
with their grace period. An unqueued TrainJob runs unless ``spec.suspend``. Running means a JobSet and
its Job (:mod:`.jobset`) and ``numNodes`` pods made as the Job controller makes them
(``<trainjob>-node-0-<i>-xxxxx``, owned by the Job, labelled with the JobSet's name and the completion
index; no ``trainer.kubeflow.org/trainjob-name`` label), built from the runtime's replicatedJob ``node``,
overridden by ``spec.trainer`` and the ``runtimePatches``, with the torch plugin's ``PET_*`` environment.
The TrainJob gets ``Complete``/``Failed`` (``TrainJobFailed``, ``DeadlineExceeded``) and its
Workload ``Finished``. The pods themselves are run by :mod:`.kubelet`.
"""

from __future__ import annotations

import copy
import socket
import time

from . import jobset, validation
from .kueue import QUEUE_LABEL, is_true, owner_uid, set_condition
from .store import Store

JOB = "node"
CONTAINER = "node"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _named(items: list[dict], name: str) -> dict | None:
    return next((i for i in items or [] if i.get("name") == name), None)


def build_pods(trainjob: dict, runtime: dict, node_selector: dict, tolerations: list, port: int) -> list[dict]:
    """The pods of a running TrainJob by completion index, before the Job controller names and owns them
    (:func:`.jobset.pod_of_job`); pure."""
    meta, spec = trainjob["metadata"], trainjob["spec"]
    trainer = spec.get("trainer") or {}
    policy = runtime["spec"].get("mlPolicy") or {}
    replicated = _named(runtime["spec"]["template"]["spec"]["replicatedJobs"], JOB)
    template = copy.deepcopy(replicated["template"]["spec"]["template"])
    pod_meta, pod_spec = template.get("metadata") or {}, template["spec"]
    container = _named(pod_spec["containers"], CONTAINER)
    for key in ("image", "command", "args"):
        if key in trainer:
            container[key] = copy.deepcopy(trainer[key])
    container["env"] = (container.get("env") or []) + copy.deepcopy(trainer.get("env") or [])
    if "resourcesPerNode" in trainer:
        container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    for patch in spec.get("runtimePatches") or []:
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get(
            "replicatedJobs"
        ) or []
        job = _named(jobs, JOB)
        pod = ((((job or {}).get("template") or {}).get("spec") or {}).get("template")) or {}
        for key in ("labels", "annotations"):
            pod_meta.setdefault(key, {}).update((pod.get("metadata") or {}).get(key) or {})
        patch_spec = pod.get("spec") or {}
        pod_spec["volumes"] = (pod_spec.get("volumes") or []) + copy.deepcopy(patch_spec.get("volumes") or [])
        for key in ("nodeSelector", "securityContext", "serviceAccountName"):
            if key in patch_spec:
                pod_spec[key] = copy.deepcopy(patch_spec[key])
        if "tolerations" in patch_spec:
            pod_spec["tolerations"] = (pod_spec.get("tolerations") or []) + copy.deepcopy(patch_spec["tolerations"])
        patched = _named(patch_spec.get("containers") or [], CONTAINER) or {}
        for key in ("env", "volumeMounts"):
            container[key] = (container.get(key) or []) + copy.deepcopy(patched.get(key) or [])
        if "securityContext" in patched:
            container["securityContext"] = copy.deepcopy(patched["securityContext"])
    if node_selector:
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), **node_selector}
    if tolerations:
        pod_spec["tolerations"] = (pod_spec.get("tolerations") or []) + tolerations
    pod_spec.setdefault("restartPolicy", "Never")
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    nproc = trainer.get("numProcPerNode", (policy.get("torch") or {}).get("numProcPerNode", "auto"))
    pods = []
    for index in range(nodes):
        pod_container = copy.deepcopy(container)
        pod_container["env"] = [e for e in pod_container["env"] if not e["name"].startswith("PET_")] + [
            {"name": "PET_NNODES", "value": str(nodes)},
            {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
            {"name": "PET_NODE_RANK", "value": str(index)},
            {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"},
            {"name": "PET_MASTER_PORT", "value": str(port)},
        ]
        if not pod_container["env"]:
            del pod_container["env"]
        labels = {**(meta.get("labels") or {}), **(pod_meta.get("labels") or {})}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": meta["namespace"], "labels": labels},
            "spec": {
                **copy.deepcopy(pod_spec),
                "containers": [
                    pod_container if c.get("name") == CONTAINER else copy.deepcopy(c) for c in pod_spec["containers"]
                ],
            },
        }
        if pod_meta.get("annotations"):
            pod["metadata"]["annotations"] = dict(pod_meta["annotations"])
        pods.append(pod)
    return pods


class Trainer:
    def __init__(self, store: Store, kubelet):
        self.store, self.kubelet = store, kubelet
        self.started: dict[str, float] = {}  # trainjob uid -> monotonic time it was admitted (or resumed)

    def reconcile(self) -> None:
        store = self.store
        local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"]) for q in store.list("LocalQueue")}
        workloads = {owner_uid(w): w for w in store.list("Workload")}
        for job in store.list("TrainJob"):
            meta = job["metadata"]
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            if "deletionTimestamp" in meta:
                continue
            pods = jobset.pods_of(store, job)
            if is_true(job, "Complete") or is_true(job, "Failed"):
                self._finish_workload(workloads.get(uid), job)
                continue
            queued = (ns, (meta.get("labels") or {}).get(QUEUE_LABEL)) in local_queues
            workload = workloads.get(uid)
            if queued:
                runnable = bool(workload and (workload.get("status") or {}).get("admission"))
                if bool(job["spec"].get("suspend")) == runnable:
                    job = store.mutate("TrainJob", ns, name, lambda j, r=runnable: j["spec"].update(suspend=not r))
            else:
                runnable = not job["spec"].get("suspend")
            if not runnable:
                self.started.pop(uid, None)
                self._stop(pods)
                if condition_status(job, "Suspended") != "True":
                    store.mutate(
                        "TrainJob",
                        ns,
                        name,
                        lambda j: set_condition(j, "Suspended", True, "Suspended", "TrainJob is suspended"),
                    )
                continue
            if condition_status(job, "Suspended") == "True":
                store.mutate(
                    "TrainJob",
                    ns,
                    name,
                    lambda j: set_condition(j, "Suspended", False, "Resumed", "TrainJob is resumed"),
                )
            self.started.setdefault(uid, time.monotonic())
            deadline = job["spec"].get("activeDeadlineSeconds")
            if deadline is not None and time.monotonic() - self.started[uid] > deadline:
                self._stop(pods)
                self._end(
                    job, "Failed", "DeadlineExceeded", "TrainJob exceeded its active deadline", workloads.get(uid)
                )
                continue
            if not pods:
                self._launch(job, workload)
                continue
            failed = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
            if failed:
                pod = failed[0]
                code = pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]
                self._stop(pods)
                self._end(
                    job,
                    "Failed",
                    "TrainJobFailed",
                    f"pod {pod['metadata']['name']} failed with exit code {code}",
                    workload,
                )
            elif all((p.get("status") or {}).get("phase") == "Succeeded" for p in pods):
                self._end(job, "Complete", "TrainJobComplete", "TrainJob is completed", workload)

    def _launch(self, job: dict, workload: dict | None) -> None:
        runtime = self.store.find("ClusterTrainingRuntime", None, job["spec"]["runtimeRef"]["name"])
        if runtime is None:
            return  # the real Trainer waits too (and reports it in its logs)
        node_selector, tolerations = {}, []
        for flavor in sorted(
            set(
                ((workload or {}).get("status", {}).get("admission") or {})
                .get("podSetAssignments", [{}])[0]
                .get("flavors", {})
                .values()
            )
        ):
            rf = self.store.find("ResourceFlavor", None, flavor) or {}
            node_selector.update((rf.get("spec") or {}).get("nodeLabels") or {})
            tolerations += (rf.get("spec") or {}).get("tolerations") or []
        pods = build_pods(job, runtime, node_selector, tolerations, free_port())
        owner = jobset.ensure_jobset(self.store, job, JOB, len(pods))
        for index, pod in enumerate(pods):
            pod = jobset.pod_of_job(owner, pod, index)
            if problems := validation.errors_of(pod):  # the Job controller's create is refused: an event, no pod
                self._failed_create(owner, validation.invalid(pod, problems).message)
                continue
            self.store.create(pod)

    def _failed_create(self, job: dict, message: str) -> None:
        meta = job["metadata"]
        if any(e["involvedObject"]["uid"] == meta["uid"] for e in self.store.list("Event", meta["namespace"])):
            return
        self.store.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{meta['name']}.failedcreate", "namespace": meta["namespace"]},
                "involvedObject": {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]},
                "reason": "FailedCreate",
                "message": f"Error creating: {message}",
                "type": "Warning",
                "source": {"component": "job-controller"},
            }
        )

    def _stop(self, pods: list[dict]) -> None:
        for pod in pods:
            if "deletionTimestamp" not in pod["metadata"] and (pod.get("status") or {}).get("phase") not in (
                "Succeeded",
                "Failed",
            ):
                self.kubelet.delete(pod, None)

    def _end(self, job: dict, type_: str, reason: str, message: str, workload: dict | None) -> None:
        meta = job["metadata"]
        self.store.mutate(
            "TrainJob", meta["namespace"], meta["name"], lambda j: set_condition(j, type_, True, reason, message)
        )
        self._finish_workload(workload, self.store.find("TrainJob", meta["namespace"], meta["name"]))
        self.started.pop(meta["uid"], None)

    def _finish_workload(self, workload: dict | None, job: dict) -> None:
        if workload is None or is_true(workload, "Finished"):
            return
        succeeded = is_true(job, "Complete")
        self.store.mutate(
            "Workload",
            workload["metadata"]["namespace"],
            workload["metadata"]["name"],
            lambda w: set_condition(
                w,
                "Finished",
                True,
                "Succeeded" if succeeded else "Failed",
                "Job finished successfully" if succeeded else "Job failed",
            ),
        )


def condition_status(obj: dict, type_: str) -> str | None:
    return next((c["status"] for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)
