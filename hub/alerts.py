"""Prometheus alerting rules for Danlu, for one machine and for Kubernetes (pure: data in, rule files out).

:func:`rules` gives the rule groups as Prometheus's rule files hold them (``groups: [...]``);
``docs/prometheus-alerts.yaml`` (one machine) and ``docs/prometheus-alerts-kubernetes.yaml`` are its
output with the defaults, and a test keeps them so. The alerts, one machine / Kubernetes:

* **DanluGpuHeldIdle**: a GPU held by a job or a server, with no activity for ``idle_minutes``. One machine:
  the service's NVML samples (``danlu_gpu_utilization_ratio``) beside what holds the device
  (``danlu_gpu_held``). Kubernetes: DCGM exporter's ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` of the GPUs it
  attributes to a pod of Danlu's namespace (``GPU_UTIL`` reads 0 under MIG; the engine-active profile
  field does not).
* **DanluQueueWaitTooLong**: a queue whose oldest waiting job has waited beyond ``wait_minutes``
  (``danlu_queue_oldest_wait_seconds``, the jobs service's figure in both).
* **DanluTeamBorrowing** (info) and **DanluTeamOverBorrowingLimit**: a team using more GPUs than its
  nominal quota for ``borrowing_minutes``, and beyond its borrowing limit. One machine: the service's
  gauges; Kubernetes: Kueue's ClusterQueue resource metrics (Kueue's
  ``metrics.enableClusterQueueResources`` must be on).
* **DanluGpuGone** and **DanluServiceDown** / **DanluNodeNotReady**: a device NVML no longer answers for
  (``danlu_gpu_up``) and the service no longer scraped; on Kubernetes, a node's allocatable GPUs fewer than
  it had in the last day (kube-state-metrics), and a node not Ready.
* **DanluInfrastructureFailures**: at least ``failures`` attempts of a queue failed for infrastructure
  reasons in ``failures_minutes`` (``danlu_attempts_failed_total{failure="infrastructure"}``; such attempts are
  retried, so the jobs may still succeed: the machine or the cluster is what is wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_RESOURCE = "nvidia_com_gpu"  # kube-state-metrics' name of nvidia.com/gpu


@dataclass(frozen=True)
class Thresholds:
    idle_minutes: int = 30
    idle_ratio: float = 0.05
    wait_minutes: int = 60
    borrowing_minutes: int = 60
    failures: int = 3
    failures_minutes: int = 15


def _rule(name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
    rule: dict = {"alert": name, "expr": expr}
    if for_:
        rule["for"] = for_
    rule["labels"] = {"severity": severity}
    rule["annotations"] = {"summary": summary, "description": description}
    return rule


def rules(
    kubernetes: bool = False, namespace: str = "danlu", job: str = "danlu", thresholds: Thresholds = Thresholds()
) -> dict:
    """The rule groups: for one machine, or (``kubernetes``) for Danlu in ``namespace``; ``job`` is the scrape
    job of the jobs service's ``/services/danlu/metrics``."""
    t = thresholds
    idle = f"{t.idle_minutes}m"
    out = []
    if kubernetes:
        out.append(
            _rule(
                "DanluGpuHeldIdle",
                f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{namespace="{namespace}", pod!=""}} < {t.idle_ratio}',
                idle,
                "warning",
                "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} held by {{ $labels.pod }} but idle",
                f"Its graphics engine was active less than {t.idle_ratio:.0%} of the time for {t.idle_minutes} "
                "minutes. A notebook server idle on a GPU is culled by Danlu's GPU-aware culler; a job is not.",
            )
        )
    else:
        out.append(
            _rule(
                "DanluGpuHeldIdle",
                f"danlu_gpu_utilization_ratio < {t.idle_ratio} "
                "and on (device, flavor) sum by (device, flavor) (danlu_gpu_held) >= 1",
                idle,
                "warning",
                "GPU {{ $labels.device }} ({{ $labels.flavor }}) held but idle",
                f"It was busy less than {t.idle_ratio:.0%} of the time for {t.idle_minutes} minutes while a job or a "
                "server held it: see `danlu usage` and the admin listing for who holds it.",
            )
        )
    out.append(
        _rule(
            "DanluQueueWaitTooLong",
            f"danlu_queue_oldest_wait_seconds > {t.wait_minutes * 60}",
            "5m",
            "warning",
            "Queue {{ $labels.queue }}: its oldest job has waited {{ $value | humanizeDuration }}",
            "Its jobs do not fit the team's quota and what it may borrow, or the machine is full: "
            "`danlu queues` says why the first job waits.",
        )
    )
    borrowing = f"{t.borrowing_minutes}m"
    if kubernetes:
        usage = 'kueue_cluster_queue_resource_usage{resource="nvidia.com/gpu"}'
        nominal = 'kueue_cluster_queue_nominal_quota{resource="nvidia.com/gpu"}'
        limit = 'kueue_cluster_queue_borrowing_limit{resource="nvidia.com/gpu"}'
        on = "on (cluster_queue, flavor, resource)"
        who = "ClusterQueue {{ $labels.cluster_queue }} ({{ $labels.flavor }})"
    else:
        usage, nominal, limit = "danlu_gpus_allocated", "danlu_gpu_quota", "danlu_gpu_borrowing_limit"
        on = "on (team, flavor)"
        who = "Team {{ $labels.team }} ({{ $labels.flavor }})"
    out.append(
        _rule(
            "DanluTeamBorrowing",
            f"{usage} > {on} {nominal}",
            borrowing,
            "info",
            f"{who} uses more GPUs than its nominal quota",
            f"It has borrowed its cohort's unused quota for {t.borrowing_minutes} minutes; its borrowed jobs are "
            "the first preempted when a lender reclaims.",
        )
    )
    out.append(
        _rule(
            "DanluTeamOverBorrowingLimit",
            f"{usage} - {on} {nominal} > {on} {limit}",
            "10m",
            "critical",
            f"{who} is beyond its borrowing limit",
            "Admission never goes beyond it: a quota or a limit was lowered under running jobs, which go on "
            "until they end or are preempted.",
        )
    )
    if kubernetes:
        out.append(
            _rule(
                "DanluGpuGone",
                f'kube_node_status_allocatable{{resource="{GPU_RESOURCE}"}} '
                f'< max_over_time(kube_node_status_allocatable{{resource="{GPU_RESOURCE}"}}[1d])',
                "5m",
                "critical",
                "Node {{ $labels.node }} has fewer allocatable GPUs than it had in the last day",
                "The device plugin no longer offers a GPU it did (a GPU fallen off the bus, an XID error, a "
                "plugin restart): check `kubectl describe node` and the device plugin's log.",
            )
        )
        out.append(
            _rule(
                "DanluNodeNotReady",
                'kube_node_status_condition{condition="Ready", status="true"} == 0 '
                f'and on (node) kube_node_status_capacity{{resource="{GPU_RESOURCE}"}} > 0',
                "5m",
                "critical",
                "GPU node {{ $labels.node }} is not Ready",
                "Its jobs are evicted and requeued by Kueue; its servers are gone until it returns.",
            )
        )
    else:
        out.append(
            _rule(
                "DanluGpuGone",
                "danlu_gpu_up == 0",
                "2m",
                "critical",
                "GPU {{ $labels.device }} ({{ $labels.flavor }}) no longer answers NVML",
                "Jobs on it fail for infrastructure reasons and are retried elsewhere: check `nvidia-smi` and "
                "the kernel log for XID errors.",
            )
        )
        out.append(
            _rule(
                "DanluServiceDown",
                f'up{{job="{job}"}} == 0',
                "2m",
                "critical",
                "The Danlu jobs service is not answering its metrics",
                "Jobs already running go on; nothing is admitted, and submissions fail until it is back: "
                "check `danlu up`'s log.",
            )
        )
    out.append(
        _rule(
            "DanluInfrastructureFailures",
            'sum by (queue) (increase(danlu_attempts_failed_total{failure="infrastructure"}'
            f"[{t.failures_minutes}m])) >= {t.failures}",
            "",
            "warning",
            "Queue {{ $labels.queue }}: {{ $value }} attempts failed for infrastructure reasons",
            f"At least {t.failures} in {t.failures_minutes} minutes (a node, a GPU, the runner, not the user's "
            "code): the jobs are retried, but the machine or the cluster needs a look.",
        )
    )
    name = "danlu-kubernetes" if kubernetes else "danlu"
    return {"groups": [{"name": name, "rules": out}]}


def text(kubernetes: bool = False, **kwargs) -> str:
    """The rule file, as ``docs/prometheus-alerts*.yaml`` holds it."""
    import yaml  # deferred: only rendering needs it

    where = "Kubernetes (DCGM exporter, kube-state-metrics, Kueue)" if kubernetes else "one machine"
    header = (
        f"# Prometheus alerting rules for Danlu on {where}: rendered by danlu.hub.alerts (do not edit here;\n"
        "# a test keeps this file equal to its output). Load it with Prometheus's rule_files"
        + (", or as kube-prometheus-stack's additionalPrometheusRulesMap.\n" if kubernetes else ".\n")
    )
    return header + yaml.safe_dump(rules(kubernetes, **kwargs), sort_keys=False, width=120)
