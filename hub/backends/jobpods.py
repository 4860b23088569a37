"""A TrainJob's pods as JobSet makes them, their logs as the service keeps them, and Kueue's evictions.

Pure helpers of :mod:`danlu.hub.backends.kubernetes`. Kubeflow Trainer v2.3 makes a JobSet named as the
TrainJob; JobSet v0.12 labels each Job and its pods (``labelAndAnnotateObject``) with the JobSet's name, the
replicated job's name and the job index, and the Job controller adds the completion index: these are the
labels that find an attempt's pods and its rank 0 (Trainer sets no ``trainer.kubeflow.org/trainjob-name``
label on pods). Kept logs are bounded by age and total size (:func:`prune_logs`). :func:`eviction_outcome`
reads the reason of Kueue v0.19's ``Evicted`` condition (``pkg/workload``, the ``WorkloadEvictedBy*`` and
``WorkloadDeactivated`` constants of ``apis/kueue/v1beta2``), so that only a preemption counts as one.
"""

from __future__ import annotations

import time
from pathlib import Path

from danlu.hub.backends.base import Outcome

#: the labels JobSet v0.12 (``labelAndAnnotateObject``) and the Job controller put on a TrainJob's pods
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
NODE_JOB = "node"  # Trainer's replicated job of the training nodes (constants.Node)
LOG_LINES = 200_000  # tailLines of a kept log: the API has no byte tail, and lines bound what one read returns


def eviction_outcome(evicted: dict, why: str, pods_ready_timeout: int) -> Outcome:
    """How an attempt ends when its Workload is ``Evicted`` (``why``: what its pods waited for):

    * ``Preempted``: a preemption (priority in the queue, reclaim in the cohort): it runs again as a new
      attempt, not counted against its retries;
    * ``PodsReadyTimeout``: its pods did not all start within waitForPodsReady; an infrastructure failure
      (retried while its retries last) named with what the pods waited for;
    * ``Deactivated``: someone set the Workload's ``spec.active`` to false (or Kueue did after too many
      requeues): cancelled;
    * anything else (``ClusterQueueStopped``, ``LocalQueueStopped``, ``NodeFailures``, ``FlavorMigration``,
      ``AdmissionCheck``, ...): interrupted, so it runs again without counting as a failure or a preemption.
    """
    reason, message = evicted.get("reason") or "", evicted.get("message") or ""
    if reason == "Preempted":
        return Outcome("preempted", f"preempted by Kueue: {message or reason}", interrupted=True, authoritative=True)
    if reason == "PodsReadyTimeout":
        return Outcome(
            "failed",
            f"its pods were not ready in {f'{pods_ready_timeout} s' if pods_ready_timeout else 'time'} (Kueue's "
            f"waitForPodsReady), so Kueue gave back its quota: {why or 'they were not scheduled or did not start'}",
            infrastructure=True,
            authoritative=True,
        )
    if reason == "Deactivated":
        return Outcome("cancelled", f"Kueue deactivated its workload: {message or reason}", authoritative=True)
    return Outcome(
        "failed",
        f"evicted by Kueue ({reason or 'no reason'}): {message}",
        infrastructure=True,
        interrupted=True,
        authoritative=True,
    )


def rank_order(pod: dict) -> tuple:
    """Rank 0 first: replicated job ``node`` before others, then job index, completion index, live before
    terminating, name."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}

    def number(key):
        value = labels.get(key, "")
        return int(value) if value.isdigit() else 1 << 30

    return (
        labels.get(REPLICATED_JOB) != NODE_JOB,
        number(JOB_INDEX),
        number(COMPLETION_INDEX),
        meta.get("deletion_timestamp", meta.get("deletionTimestamp")) is not None,
        meta.get("name", ""),
    )


def waiting_for(pods: list[dict]) -> str:
    """What the pods that are not running wait for, in the words of the kubelet and the scheduler: an image
    that does not pull, a claim or Secret that is missing, no node that fits."""
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        for c in status.get("container_statuses") or status.get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") and waiting["reason"] not in ("ContainerCreating", "PodInitializing"):
                found.append(f"{waiting['reason']}: {waiting.get('message') or ''}".rstrip(": "))
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                found.append(f"not scheduled: {cond.get('message') or cond.get('reason') or ''}")
    unique = list(dict.fromkeys(found))
    return "; ".join(unique)[:500]


def keep_log(folder: Path, path: Path, text: bytes, size: int, max_bytes: int, max_age_seconds: float) -> list[Path]:
    """Write the end of an attempt's log (``size``: the length of what the API returned, ``text`` its last
    bytes) to ``path`` under ``folder``, then prune the kept logs (:func:`prune_logs`)."""
    if size > len(text):
        text = f"[danlu: only the last {len(text)} bytes of this log are kept]\n".encode() + text
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return prune_logs(folder, max_bytes, max_age_seconds, keep=path)


def prune_logs(folder: Path, max_bytes: int, max_age_seconds: float, keep: Path | None = None) -> list[Path]:
    """Remove kept logs older than ``max_age_seconds`` (0: no age limit), then the oldest until all together
    take at most ``max_bytes``; ``keep`` (the log just written) stays. Returns what was removed."""
    logs = []
    for path in folder.glob("*/*.log"):
        try:
            st = path.stat()
        except OSError:
            continue
        logs.append((st.st_mtime, st.st_size, path))
    logs.sort()
    now, total, removed = time.time(), sum(size for _, size, _ in logs), []
    for mtime, size, path in logs:
        too_old = max_age_seconds > 0 and now - mtime > max_age_seconds
        if path == keep or not (too_old or total > max_bytes):
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        removed.append(path)
        try:
            path.parent.rmdir()  # the job's folder, once its last log is gone
        except OSError:
            pass
    return removed
