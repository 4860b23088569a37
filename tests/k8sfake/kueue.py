"""The fake Kueue: a Workload per queued TrainJob, quota admission by ClusterQueue, cohorts, preemption.

A TrainJob labelled ``kueue.x-k8s.io/queue-name`` with an existing LocalQueue gets a Workload (one podSet
``node``: ``numNodes`` pods of ``resourcesPerNode``, with the ``nodeSelector`` and tolerations its
``runtimePatches`` give them). A reconcile runs Kueue's scheduling cycles (``pkg/scheduler/scheduler.go``)
until no ClusterQueue has a workload left to try: each cycle takes the head of every ClusterQueue (priority,
then creation; BestEffortFIFO: a head that can neither be admitted nor preempt is set aside for the rest of
the reconcile and the next one takes its place), orders the heads as Kueue's classical iterator does (those
that fit their queue's nominal quota before those that borrow, then priority, then creation), and admits,
preempts or waits for each in turn; a head that no longer fits after an earlier one, or whose victims another
head of the cycle already took, is the head again in the next cycle, and one that must preempt but finds no
one holds what it needs for the rest of the cycle when its queue cannot always reclaim. Flavors, quotas and
victims are :mod:`.quota`'s arithmetic. A cycle that preempts ends the reconcile: the victims are evicted at
once (no pods linger), so the next reconcile admits on what they released. An evicted workload queues again
with its creation time (Kueue's ``GetQueueOrderTimestamp``: eviction time only after a PodsReady timeout or
an admission check). Conditions and messages follow Kueue v0.19's wording. Nothing here runs pods:
:mod:`.trainer` reacts to admission.
"""

from __future__ import annotations

import hashlib
import time
from fractions import Fraction

from ..k8sschemas import parse_quantity as quantity
from . import jobset
from .quota import FIT, NO_FIT, Admitted, View, show
from .store import Store, not_found, now

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
POD_SET = "node"


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == type_), None)


def is_true(obj: dict, type_: str) -> bool:
    return (condition(obj, type_) or {}).get("status") == "True"


def set_condition(obj: dict, type_: str, status: bool, reason: str, message: str) -> None:
    """Set a condition; its lastTransitionTime moves only when its status does (so reconciles converge)."""
    conditions = obj.setdefault("status", {}).setdefault("conditions", [])
    value = "True" if status else "False"
    old = next((c for c in conditions if c["type"] == type_), None)
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == value else now(),
    }
    if old is None:
        conditions.append(new)
    else:
        old.update(new)


def workload_name(trainjob: dict) -> str:
    digest = hashlib.sha256(trainjob["metadata"]["uid"].encode()).hexdigest()[:5]
    return f"trainjob-{trainjob['metadata']['name']}-{digest}"


def pod_requests(trainjob: dict) -> dict[str, str]:
    resources = (trainjob["spec"].get("trainer") or {}).get("resourcesPerNode") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def pod_placement(trainjob: dict) -> dict:
    """The ``nodeSelector`` and ``tolerations`` the TrainJob's ``runtimePatches`` give the pods of replicatedJob
    ``node`` (what Kueue's TrainJob integration copies into the podSet, and matches against flavors)."""
    out: dict = {}
    for patch in trainjob["spec"].get("runtimePatches") or []:
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get(
            "replicatedJobs"
        ) or []
        job = next((j for j in jobs if j.get("name") == POD_SET), {})
        spec = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if "nodeSelector" in spec:
            out["nodeSelector"] = {**out.get("nodeSelector", {}), **spec["nodeSelector"]}
        if "tolerations" in spec:
            out["tolerations"] = out.get("tolerations", []) + list(spec["tolerations"])
    return out


def make_workload(trainjob: dict, priority: int, priority_class: str | None) -> dict:
    meta = trainjob["metadata"]
    count = (trainjob["spec"].get("trainer") or {}).get("numNodes", 1)
    container = {"name": POD_SET, "resources": {"requests": pod_requests(trainjob)}}
    spec = {
        "queueName": meta["labels"][QUEUE_LABEL],
        "priority": priority,
        "podSets": [
            {
                "name": POD_SET,
                "count": count,
                "template": {"spec": {**pod_placement(trainjob), "containers": [container]}},
            }
        ],
    }
    if priority_class:
        spec["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": priority_class}
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(trainjob),
            "namespace": meta["namespace"],
            "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
            "ownerReferences": [
                {
                    "apiVersion": TRAINJOB_API,
                    "kind": "TrainJob",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": spec,
    }


def owner_uid(obj: dict) -> str | None:
    return next((r["uid"] for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def needs(workload: dict) -> dict[str, Fraction]:
    """Total requests of the workload per resource (zero requests dropped)."""
    out: dict[str, Fraction] = {}
    for pod_set in workload["spec"]["podSets"]:
        for container in pod_set["template"]["spec"]["containers"]:
            for resource, value in ((container.get("resources") or {}).get("requests") or {}).items():
                out[resource] = out.get(resource, Fraction(0)) + quantity(value) * pod_set.get("count", 1)
    return {r: v for r, v in out.items() if v}


def node_selector(workload: dict) -> dict[str, str]:
    return workload["spec"]["podSets"][0]["template"]["spec"].get("nodeSelector") or {}


def queue_order(store: Store):
    """BestEffortFIFO: higher priority first, then older. A preempted workload keeps its creation time
    (``GetQueueOrderTimestamp`` uses the eviction time only after a PodsReady timeout or an admission check)."""
    return lambda w: (-w["spec"].get("priority", 0), store.created.get(w["metadata"]["uid"], 0), w["metadata"]["uid"])


class Kueue:
    def __init__(self, store: Store):
        self.store = store
        self.admitted_at: dict[str, int] = {}  # workload uid -> admission order
        self.seq = 0
        #: waitForPodsReady's timeout (seconds; None: not configured, as in Kueue's default configuration)
        self.pods_ready_timeout: float | None = None
        self.requeue_backoff = 60.0  # requeuingStrategy.backoffBaseSeconds
        self._since: dict[str, float] = {}  # workload uid -> monotonic time of its admission
        self._requeue_at: dict[str, float] = {}  # workload uid -> when a pods-ready eviction may be admitted again

    def reconcile(self) -> None:
        self._create_workloads()
        self._pods_ready()
        self._admit()

    def _pods_ready(self) -> None:
        """``PodsReady`` of admitted workloads (all ``count`` pods running and ready, or succeeded) and, with a
        timeout, the eviction of one whose pods are not ready in time (``workload_controller.go``:
        ``reconcileNotReadyTimeout``): reason ``PodsReadyTimeout``, requeued after a backoff."""
        for wl in self.store.list("Workload"):
            uid, meta = wl["metadata"]["uid"], wl["metadata"]
            if is_true(wl, "Finished") or not (wl.get("status") or {}).get("admission"):
                continue
            owner = next(
                (j for j in self.store.list("TrainJob", meta["namespace"]) if j["metadata"]["uid"] == owner_uid(wl)),
                None,
            )
            pods = jobset.pods_of(self.store, owner) if owner else []
            ready = sum(
                1
                for p in pods
                if (p.get("status") or {}).get("phase") == "Succeeded"
                or any(c.get("ready") for c in (p.get("status") or {}).get("containerStatuses") or [])
            )
            if ready >= wl["spec"]["podSets"][0].get("count", 1):
                if not is_true(wl, "PodsReady"):
                    self.store.mutate(
                        "Workload",
                        meta["namespace"],
                        meta["name"],
                        lambda w: set_condition(w, "PodsReady", True, "Started", "All pods reached readiness"),
                    )
                continue
            if condition(wl, "PodsReady") is None or is_true(wl, "PodsReady"):
                self.store.mutate(
                    "Workload",
                    meta["namespace"],
                    meta["name"],
                    lambda w: set_condition(
                        w, "PodsReady", False, "WaitForStart", "Not all pods are ready or succeeded"
                    ),
                )
            since = self._since.setdefault(uid, time.monotonic())
            if self.pods_ready_timeout is not None and time.monotonic() - since > self.pods_ready_timeout:
                self._requeue_at[uid] = time.monotonic() + self.requeue_backoff
                self._since.pop(uid, None)
                message = f"Exceeded the PodsReady timeout {meta['namespace']}/{meta['name']}"

                def evict(w, message=message):
                    w["status"].pop("admission", None)
                    set_condition(w, "Evicted", True, "PodsReadyTimeout", message)
                    set_condition(w, "QuotaReserved", False, "Pending", message)
                    set_condition(w, "Admitted", False, "NoReservation", "The workload has no reservation")
                    set_condition(w, "Requeued", False, "PodsReadyTimeout", message)

                self.store.mutate("Workload", meta["namespace"], meta["name"], evict)

    def _create_workloads(self) -> None:
        store = self.store
        local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"]) for q in store.list("LocalQueue")}
        owners = {owner_uid(w) for w in store.list("Workload")}
        for job in store.list("TrainJob"):
            meta = job["metadata"]
            queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
            if (
                not queue
                or (meta["namespace"], queue) not in local_queues
                or meta["uid"] in owners
                or "deletionTimestamp" in meta
                or is_true(job, "Complete")
                or is_true(job, "Failed")
            ):
                continue
            class_name = meta["labels"].get(PRIORITY_LABEL)
            wpc = store.find("WorkloadPriorityClass", None, class_name) if class_name else None
            store.create(make_workload(job, wpc["value"] if wpc else 0, class_name if wpc else None))

    def _info(self, workload: dict) -> Admitted:
        admission = workload["status"]["admission"]
        usage: dict[tuple[str, str], Fraction] = {}
        for assignment in admission["podSetAssignments"]:
            for resource, amount in (assignment.get("resourceUsage") or {}).items():
                key = (assignment["flavors"][resource], resource)
                usage[key] = usage.get(key, Fraction(0)) + quantity(amount)
        uid = workload["metadata"]["uid"]
        return Admitted(
            uid,
            admission["clusterQueue"],
            workload["spec"].get("priority", 0),
            self.admitted_at.get(uid, 0),
            usage,
            workload,
        )

    def _admit(self) -> None:
        """Scheduling cycles until one preempts or no ClusterQueue has a head left to try."""
        store = self.store
        live = [w for w in store.list("Workload") if not is_true(w, "Finished")]
        view = View(
            store.list("ClusterQueue"),
            store.list("ResourceFlavor"),
            [self._info(w) for w in live if w.get("status", {}).get("admission")],
        )
        local = {
            (q["metadata"]["namespace"], q["metadata"]["name"]): q["spec"]["clusterQueue"]
            for q in store.list("LocalQueue")
        }
        queues: dict[str, list[dict]] = {}  # ClusterQueue -> its pending workloads, in queue order
        order = queue_order(store)
        for wl in sorted((w for w in live if not w.get("status", {}).get("admission")), key=order):
            if self._requeue_at.get(wl["metadata"]["uid"], 0) > time.monotonic():
                continue  # backing off after a pods-ready timeout
            ns, lq = wl["metadata"]["namespace"], wl["spec"].get("queueName")
            cq = local.get((ns, lq))
            if cq is None:
                self._pend(wl, f"LocalQueue {lq} doesn't exist")
            elif cq not in view.queues:
                self._pend(wl, f"ClusterQueue {cq} doesn't exist")
            elif view.queues[cq]["spec"].get("stopPolicy", "None") != "None":
                self._pend(wl, f"ClusterQueue {cq} is inactive")
            else:
                queues.setdefault(cq, []).append(wl)
        while any(queues.values()):
            if self._cycle(view, queues, order):
                return

    def _cycle(self, view: View, queues: dict[str, list[dict]], order) -> bool:
        """One scheduling cycle over the heads of the queues; True if it preempted."""
        entries = []
        for cq, waiting in queues.items():
            if waiting:
                wl = waiting.pop(0)
                choice = view.assign(cq, needs(wl), node_selector(wl), wl["spec"].get("priority", 0))
                entries.append((choice.borrows, *order(wl), cq, wl, choice))
        entries.sort(key=lambda e: e[:4])  # within nominal quota first, then priority, then creation
        preempted: set[str] = set()
        admitted: list[Admitted] = []
        reserved: list[tuple[str, dict]] = []  # (queue, usage) held until the cycle ends
        for *_, cq, wl, choice in entries:
            need = needs(wl)
            requests = choice.requests(need)
            if choice.mode == FIT:
                if view.fits(cq, requests):
                    admitted.append(self._info(self._admit_one(wl, cq, choice.flavors, need)))
                    view.add(cq, requests, 1)
                else:  # no longer fits after another head of this cycle: it is the head again next cycle
                    queues[cq].insert(0, wl)
                continue
            if choice.mode == NO_FIT or not choice.targets:
                if choice.mode != NO_FIT and view.reclaim(cq) != "Any":
                    # reserveCapacityForUnreclaimablePreempt: it holds what it needs for the rest of the cycle
                    reserved.append((cq, view.to_reserve(cq, requests, choice.borrows)))
                    view.add(*reserved[-1], 1)
                self._pend(wl, f"couldn't assign flavors to pod set {POD_SET}: {', '.join(choice.reasons)}")
                continue
            if preempted & {t.uid for t in choice.targets} or not view.fits_without(
                cq, requests, [*choice.targets, *(w for w in view.workloads if w.uid in preempted)]
            ):
                queues[cq].insert(0, wl)  # overlapping targets, or no longer fits after another head: skipped
                continue
            for target in choice.targets:
                reason = "InClusterQueue" if target.cq == cq else "InCohortReclamation"
                self._evict(target.obj, wl, reason, (view.path(cq), view.path(target.cq)))
                preempted.add(target.uid)
                view.evicted.add(target.uid)
            view.add(cq, requests, 1)  # what it needs is taken for the rest of the cycle
            self._pend(wl, f"couldn't assign flavors to pod set {POD_SET}: {', '.join(choice.reasons)}")
        for cq, usage in reserved:
            view.add(cq, usage, -1)
        view.workloads += admitted  # candidates from the next cycle on
        return bool(preempted)

    def _pend(self, wl: dict, message: str) -> None:
        def update(w):
            set_condition(w, "QuotaReserved", False, "Pending", message)

        self.store.mutate("Workload", wl["metadata"]["namespace"], wl["metadata"]["name"], update)

    def _admit_one(self, wl, cq, assignment, need) -> dict:
        count = wl["spec"]["podSets"][0].get("count", 1)
        self.seq += 1
        self.admitted_at[wl["metadata"]["uid"]] = self.seq
        self._since[wl["metadata"]["uid"]] = time.monotonic()

        def update(w):
            w.setdefault("status", {})["admission"] = {
                "clusterQueue": cq,
                "podSetAssignments": [
                    {
                        "name": POD_SET,
                        "flavors": assignment,
                        "count": count,
                        "resourceUsage": {r: show(v) for r, v in need.items()},
                    }
                ],
            }
            set_condition(w, "QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {cq}")
            set_condition(w, "Admitted", True, "Admitted", "The workload is admitted")
            if condition(w, "Evicted"):
                set_condition(w, "Evicted", False, "QuotaReserved", "Previously: " + condition(w, "Evicted")["message"])
            if condition(w, "Preempted"):
                set_condition(w, "Preempted", False, "QuotaReserved", "")

        return self.store.mutate("Workload", wl["metadata"]["namespace"], wl["metadata"]["name"], update)

    def _evict(self, victim: dict, by: dict, reason: str, paths: tuple[str, str]) -> None:
        why = {
            "InClusterQueue": "prioritization in the ClusterQueue",
            "InCohortReclamation": "reclamation within the cohort",
        }[reason]
        message = (
            f"Preempted to accommodate a workload (UID: {by['metadata']['uid']}, "
            f"JobUID: {owner_uid(by)}) due to {why}; preemptor path: {paths[0]}; preemptee path: {paths[1]}"
        )

        def update(w):
            w["status"].pop("admission", None)
            set_condition(w, "Evicted", True, "Preempted", message)
            set_condition(w, "Preempted", True, reason, message)
            set_condition(w, "QuotaReserved", False, "Pending", message)
            set_condition(w, "Admitted", False, "NoReservation", "The workload has no reservation")

        self.store.mutate("Workload", victim["metadata"]["namespace"], victim["metadata"]["name"], update)

    def pending_summary(self, namespace: str, local_queue: str) -> dict:
        return pending_summary(self.store, namespace, local_queue)


def pending_summary(store: Store, namespace: str, local_queue: str) -> dict:
    """Kueue's visibility API (v1beta1) answer for one LocalQueue: its pending workloads, 0-based positions."""
    lq = store.find("LocalQueue", namespace, local_queue)
    if lq is None:
        raise not_found("LocalQueue", local_queue)
    queues = {
        (q["metadata"]["namespace"], q["metadata"]["name"]): q["spec"]["clusterQueue"] for q in store.list("LocalQueue")
    }
    cq = lq["spec"]["clusterQueue"]
    in_cq = sorted(
        (
            w
            for w in store.list("Workload")
            if not w.get("status", {}).get("admission")
            and not is_true(w, "Finished")
            and queues.get((w["metadata"]["namespace"], w["spec"].get("queueName"))) == cq
        ),
        key=queue_order(store),
    )
    items, position = [], 0
    for index, wl in enumerate(in_cq):
        meta = wl["metadata"]
        if (meta["namespace"], wl["spec"].get("queueName")) != (namespace, local_queue):
            continue
        items.append(
            {
                "metadata": {
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "creationTimestamp": meta["creationTimestamp"],
                    "ownerReferences": meta.get("ownerReferences", []),
                },
                "priority": wl["spec"].get("priority", 0),
                "localQueueName": local_queue,
                "positionInClusterQueue": index,
                "positionInLocalQueue": position,
            }
        )
        position += 1
    return {
        "kind": "PendingWorkloadsSummary",
        "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
        "metadata": {"creationTimestamp": None},
        "items": items,
    }
