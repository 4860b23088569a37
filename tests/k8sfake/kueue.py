"""The fake Kueue: a Workload per queued TrainJob, quota admission by ClusterQueue, cohorts, preemption.

A TrainJob labelled ``kueue.x-k8s.io/queue-name`` with an existing LocalQueue gets a Workload (one podSet
``node``: ``numNodes`` pods of ``resourcesPerNode``). Pending workloads are taken by priority, then age
(BestEffortFIFO: one that does not fit lets the next try). A podSet's resources take the first flavor of
their resource group that fits: within nominal quota, or borrowing the unused lendable quota of the
cohort up to ``borrowingLimit`` (``lendingLimit`` caps what a queue lends). A workload that does not fit
may preempt: borrowers in the cohort when it would fit its own nominal quota (``reclaimWithinCohort``),
or lower-priority workloads of its own ClusterQueue (``withinClusterQueue: LowerPriority``). Conditions
and messages follow Kueue v0.19's wording. Nothing here runs pods: :mod:`.trainer` reacts to admission.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

from ..k8sschemas import parse_quantity as quantity
from .store import Store, not_found, now

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
TRAINJOB_API = "trainer.kubeflow.org/v1alpha1"
POD_SET = "node"

def show(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{round(value * 1000)}m"


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == type_), None)


def is_true(obj: dict, type_: str) -> bool:
    return (condition(obj, type_) or {}).get("status") == "True"


def set_condition(obj: dict, type_: str, status: bool, reason: str, message: str) -> None:
    """Set a condition; its lastTransitionTime moves only when its status does (so reconciles converge)."""
    conditions = obj.setdefault("status", {}).setdefault("conditions", [])
    value = "True" if status else "False"
    old = next((c for c in conditions if c["type"] == type_), None)
    new = {"type": type_, "status": value, "reason": reason, "message": message,
           "lastTransitionTime": old["lastTransitionTime"] if old and old["status"] == value else now()}
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


def make_workload(trainjob: dict, priority: int, priority_class: str | None) -> dict:
    meta = trainjob["metadata"]
    count = (trainjob["spec"].get("trainer") or {}).get("numNodes", 1)
    container = {"name": POD_SET, "resources": {"requests": pod_requests(trainjob)}}
    spec = {"queueName": meta["labels"][QUEUE_LABEL], "priority": priority,
            "podSets": [{"name": POD_SET, "count": count, "template": {"spec": {"containers": [container]}}}]}
    if priority_class:
        spec["priorityClassRef"] = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                    "name": priority_class}
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload", "metadata": {
        "name": workload_name(trainjob), "namespace": meta["namespace"],
        "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
        "ownerReferences": [{"apiVersion": TRAINJOB_API, "kind": "TrainJob", "name": meta["name"],
                             "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "spec": spec}


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


def queue_order(store: Store, requeued: dict[str, int]):
    """BestEffortFIFO: higher priority first, then older; an evicted workload's age counts from its eviction
    (Kueue's default ``requeuingTimestamp: Eviction``)."""
    return lambda w: (-w["spec"].get("priority", 0),
                      requeued.get(w["metadata"]["uid"]) or store.created.get(w["metadata"]["uid"], 0))


class Cluster:
    """One reconcile's view of the queues: quotas, usage, and the fit arithmetic."""

    def __init__(self, queues: list[dict], admitted: list[dict]):
        self.queues = {q["metadata"]["name"]: q for q in queues}
        self.quota: dict[str, dict[tuple[str, str], tuple]] = {}
        self.groups: dict[str, list[tuple[list[str], list[str]]]] = {}
        for name, cq in self.queues.items():
            self.quota[name], self.groups[name] = {}, []
            for group in cq["spec"].get("resourceGroups") or []:
                self.groups[name].append((group["coveredResources"], [f["name"] for f in group["flavors"]]))
                for flavor in group["flavors"]:
                    for r in flavor["resources"]:
                        nominal = quantity(r["nominalQuota"])
                        self.quota[name][(flavor["name"], r["name"])] = (
                            nominal, quantity(r["borrowingLimit"]) if "borrowingLimit" in r else None,
                            quantity(r["lendingLimit"]) if "lendingLimit" in r else nominal)
        self.usage: dict[str, dict[tuple[str, str], Fraction]] = {name: {} for name in self.queues}
        for wl in admitted:
            self.add(wl, 1)

    def add(self, workload: dict, sign: int) -> None:
        admission = workload["status"]["admission"]
        usage = self.usage.setdefault(admission["clusterQueue"], {})
        for assignment in admission["podSetAssignments"]:
            for resource, amount in (assignment.get("resourceUsage") or {}).items():
                key = (assignment["flavors"][resource], resource)
                usage[key] = usage.get(key, Fraction(0)) + sign * quantity(amount)

    def cohort(self, name: str) -> list[str]:
        cohort = self.queues[name]["spec"].get("cohortName")
        return [q for q, cq in self.queues.items() if cq["spec"].get("cohortName") == cohort] if cohort else [name]

    def used(self, name, key) -> Fraction:
        return self.usage.get(name, {}).get(key, Fraction(0))

    def check(self, name: str, key: tuple[str, str], amount: Fraction, nominal_only=False) -> str | None:
        """None when ``amount`` more of ``key`` (flavor, resource) fits in ClusterQueue ``name``, else why not."""
        flavor, resource = key
        nominal, borrow_limit, lendable = self.quota[name].get(key, (Fraction(0), Fraction(0), Fraction(0)))
        used, members = self.used(name, key), self.cohort(name)
        new = used + amount
        if nominal_only or len(members) == 1 and not self.queues[name]["spec"].get("cohortName"):
            missing, capacity = new - nominal, nominal
        else:
            guaranteed = {m: self.quota[m].get(key, (0, 0, 0))[0] - self.quota[m].get(key, (0, 0, 0))[2]
                          for m in members}
            pool = sum((self.quota[m].get(key, (0, 0, 0))[2] for m in members), Fraction(0))
            pool_used = sum((max(Fraction(0), self.used(m, key) - guaranteed[m]) for m in members), Fraction(0))
            extra = max(Fraction(0), new - guaranteed[name]) - max(Fraction(0), used - guaranteed[name])
            missing = pool_used + extra - pool
            capacity = guaranteed[name] + pool
            if borrow_limit is not None:
                missing = max(missing, new - nominal - borrow_limit)
                capacity = min(capacity, nominal + borrow_limit)
        if missing <= 0:
            return None
        if amount > capacity:
            return (f"insufficient quota for {resource} in flavor {flavor}, request > maximum capacity "
                    f"({show(amount)} > {show(capacity)})")
        return f"insufficient unused quota for {resource} in flavor {flavor}, {show(missing)} more needed"

    def assign(self, name: str, need: dict[str, Fraction], nominal_only=False) -> tuple[dict | None, list[str]]:
        """({resource: flavor}, []) when the workload fits, else (None, the reasons)."""
        assignment, reasons = {}, []
        for resource in need:
            if not any(resource in covered for covered, _ in self.groups[name]):
                reasons.append(f"resource {resource} unavailable in ClusterQueue")
        for covered, flavors in self.groups[name]:
            wanted = [r for r in covered if r in need]
            if not wanted:
                continue
            for flavor in flavors:
                why = [w for r in wanted if (w := self.check(name, (flavor, r), need[r], nominal_only))]
                if not why:
                    assignment.update({r: flavor for r in wanted})
                    break
                reasons += why
            else:
                return None, reasons
        return (assignment, []) if not reasons else (None, reasons)

    def borrowing(self, name: str, keys) -> bool:
        return any(self.used(name, k) > self.quota[name].get(k, (0,))[0] for k in keys)


class Kueue:
    def __init__(self, store: Store):
        self.store = store
        self.admitted_at: dict[str, int] = {}  # workload uid -> admission order
        self.requeued: dict[str, int] = {}  # evicted workload uid -> the resourceVersion of its eviction
        self.seq = 0

    def reconcile(self) -> None:
        self._create_workloads()
        self._admit()

    def _create_workloads(self) -> None:
        store = self.store
        local_queues = {(q["metadata"]["namespace"], q["metadata"]["name"]) for q in store.list("LocalQueue")}
        owners = {owner_uid(w) for w in store.list("Workload")}
        for job in store.list("TrainJob"):
            meta = job["metadata"]
            queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
            if (not queue or (meta["namespace"], queue) not in local_queues or meta["uid"] in owners
                    or "deletionTimestamp" in meta or is_true(job, "Complete") or is_true(job, "Failed")):
                continue
            class_name = meta["labels"].get(PRIORITY_LABEL)
            wpc = store.find("WorkloadPriorityClass", None, class_name) if class_name else None
            store.create(make_workload(job, wpc["value"] if wpc else 0, class_name if wpc else None))

    def _admit(self) -> None:
        store = self.store
        workloads = store.list("Workload")
        live = [w for w in workloads if not is_true(w, "Finished")]
        admitted = [w for w in live if w.get("status", {}).get("admission")]
        pending = sorted((w for w in live if not w.get("status", {}).get("admission")),
                         key=queue_order(store, self.requeued))
        queues = store.list("ClusterQueue")
        view = Cluster(queues, admitted)
        local = {(q["metadata"]["namespace"], q["metadata"]["name"]): q["spec"]["clusterQueue"]
                 for q in store.list("LocalQueue")}
        for wl in pending:
            ns, lq = wl["metadata"]["namespace"], wl["spec"].get("queueName")
            cq = local.get((ns, lq))
            if cq is None:
                self._pend(wl, f"LocalQueue {lq} doesn't exist")
                continue
            if cq not in view.queues:
                self._pend(wl, f"ClusterQueue {cq} doesn't exist")
                continue
            if view.queues[cq]["spec"].get("stopPolicy", "None") != "None":
                self._pend(wl, f"ClusterQueue {cq} is inactive")
                continue
            need = needs(wl)
            assignment, reasons = view.assign(cq, need)
            if assignment is not None:
                view.add(self._admit_one(wl, cq, assignment, need), 1)
                continue
            victims, why = self._preemption(wl, cq, need, view, admitted)
            if victims:
                for victim in victims:
                    self._evict(victim, wl, why)
                return  # the next reconcile admits on the released quota
            self._pend(wl, f"couldn't assign flavors to pod set {POD_SET}: {', '.join(reasons)}")

    def _preemption(self, wl, cq, need, view: Cluster, admitted) -> tuple[list[dict], str]:
        policy = view.queues[cq]["spec"].get("preemption") or {}
        priority = wl["spec"].get("priority", 0)
        keys = {(f, r) for covered, flavors in view.groups[cq] for f in flavors for r in covered if r in need}
        by_recent = sorted(admitted, key=lambda w: -self.admitted_at.get(w["metadata"]["uid"], 0))
        reclaim = policy.get("reclaimWithinCohort", "Never")
        if reclaim != "Never" and view.queues[cq]["spec"].get("cohortName") \
                and view.assign(cq, need, nominal_only=True)[0] is not None:
            candidates = [w for w in by_recent if w["status"]["admission"]["clusterQueue"] in view.cohort(cq)
                          and w["status"]["admission"]["clusterQueue"] != cq
                          and (reclaim == "Any" or w["spec"].get("priority", 0) < priority)]
            victims = self._try(view, cq, need, candidates, keys)
            if victims:
                return victims, "reclamation within the cohort"
        if policy.get("withinClusterQueue", "Never") == "LowerPriority":
            candidates = sorted((w for w in by_recent if w["status"]["admission"]["clusterQueue"] == cq
                                 and w["spec"].get("priority", 0) < priority),
                                key=lambda w: w["spec"].get("priority", 0))
            victims = self._try(view, cq, need, candidates, keys, borrowers_only=False)
            if victims:
                return victims, "prioritization in the ClusterQueue"
        return [], ""

    @staticmethod
    def _try(view: Cluster, cq, need, candidates, keys, borrowers_only=True) -> list[dict]:
        """Remove candidates one by one (on a scratch copy of the usage) until ``need`` fits; [] if never."""
        saved = {q: dict(u) for q, u in view.usage.items()}
        victims = []
        try:
            for candidate in candidates:
                owner = candidate["status"]["admission"]["clusterQueue"]
                if borrowers_only and not view.borrowing(owner, keys):
                    continue
                view.add(candidate, -1)
                victims.append(candidate)
                if view.assign(cq, need)[0] is not None:
                    return victims
            return []
        finally:
            view.usage = saved

    def _pend(self, wl: dict, message: str) -> None:
        def update(w):
            set_condition(w, "QuotaReserved", False, "Pending", message)
        self.store.mutate("Workload", wl["metadata"]["namespace"], wl["metadata"]["name"], update)

    def _admit_one(self, wl, cq, assignment, need) -> dict:
        count = wl["spec"]["podSets"][0].get("count", 1)
        self.seq += 1
        self.admitted_at[wl["metadata"]["uid"]] = self.seq

        def update(w):
            w.setdefault("status", {})["admission"] = {"clusterQueue": cq, "podSetAssignments": [{
                "name": POD_SET, "flavors": assignment, "count": count,
                "resourceUsage": {r: show(v) for r, v in need.items()}}]}
            set_condition(w, "QuotaReserved", True, "QuotaReserved", f"Quota reserved in ClusterQueue {cq}")
            set_condition(w, "Admitted", True, "Admitted", "The workload is admitted")
            if condition(w, "Evicted"):
                set_condition(w, "Evicted", False, "QuotaReserved", "Previously: " + condition(w, "Evicted")["message"])
            if condition(w, "Preempted"):
                set_condition(w, "Preempted", False, "QuotaReserved", "")
        return self.store.mutate("Workload", wl["metadata"]["namespace"], wl["metadata"]["name"], update)

    def _evict(self, victim: dict, by: dict, why: str) -> None:
        message = (f"Preempted to accommodate a workload (UID: {by['metadata']['uid']}, "
                   f"JobUID: {owner_uid(by)}) due to {why}")
        reason = "InCohortReclamation" if "cohort" in why else "InClusterQueue"

        def update(w):
            w["status"].pop("admission", None)
            set_condition(w, "Evicted", True, "Preempted", message)
            set_condition(w, "Preempted", True, reason, message)
            set_condition(w, "QuotaReserved", False, "Pending", message)
            set_condition(w, "Admitted", False, "NoReservation", "The workload has no reservation")
        self.store.mutate("Workload", victim["metadata"]["namespace"], victim["metadata"]["name"], update)
        self.requeued[victim["metadata"]["uid"]] = self.store.rv


    def pending_summary(self, namespace: str, local_queue: str) -> dict:
        return pending_summary(self.store, namespace, local_queue, self.requeued)


def pending_summary(store: Store, namespace: str, local_queue: str, requeued: dict[str, int]) -> dict:
    """Kueue's visibility API (v1beta1) answer for one LocalQueue: its pending workloads, 0-based positions."""
    lq = store.find("LocalQueue", namespace, local_queue)
    if lq is None:
        raise not_found("LocalQueue", local_queue)
    queues = {(q["metadata"]["namespace"], q["metadata"]["name"]): q["spec"]["clusterQueue"]
              for q in store.list("LocalQueue")}
    cq = lq["spec"]["clusterQueue"]
    in_cq = sorted((w for w in store.list("Workload") if not w.get("status", {}).get("admission")
                    and not is_true(w, "Finished")
                    and queues.get((w["metadata"]["namespace"], w["spec"].get("queueName"))) == cq),
                   key=queue_order(store, requeued))
    items, position = [], 0
    for index, wl in enumerate(in_cq):
        meta = wl["metadata"]
        if (meta["namespace"], wl["spec"].get("queueName")) != (namespace, local_queue):
            continue
        items.append({"metadata": {"name": meta["name"], "namespace": meta["namespace"],
                                   "creationTimestamp": meta["creationTimestamp"],
                                   "ownerReferences": meta.get("ownerReferences", [])},
                      "priority": wl["spec"].get("priority", 0), "localQueueName": local_queue,
                      "positionInClusterQueue": index, "positionInLocalQueue": position})
        position += 1
    return {"kind": "PendingWorkloadsSummary", "apiVersion": "visibility.kueue.x-k8s.io/v1beta1",
            "metadata": {"creationTimestamp": None}, "items": items}

