"""Prometheus metrics of the jobs service (``/services/danlu/metrics``).

Queue depth and running jobs per queue, admissions, preemptions and finished
jobs, the time jobs wait (and the oldest waiting now), attempts that failed by
whose failure it was, GPUs allocated, nominal and borrowable per team and flavor,
which device is held and how busy it is (NVML, sampled), and how long an
admission pass takes; log followers and the event loop's tasks (a leak shows as
a count that only grows). docs/grafana-dashboard.json charts them and
docs/prometheus-alerts.yaml alerts on them (:mod:`danlu.hub.alerts`).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)


def _loop_tasks() -> float:

    try:
        return float(len(asyncio.all_tasks()))
    except RuntimeError:  # scraped outside the loop
        return 0.0


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.pending = Gauge("danlu_queue_pending", "Jobs waiting in a queue.", ["queue"], registry=r)
        self.running = Gauge("danlu_jobs_running", "Jobs running, per queue.", ["queue"], registry=r)
        self.admitted = Counter("danlu_jobs_admitted", "Jobs admitted.", ["queue"], registry=r)
        self.preempted = Counter("danlu_jobs_preempted", "Jobs preempted.", ["queue"], registry=r)
        self.finished = Counter("danlu_jobs_finished", "Jobs that ended, by state.", ["queue", "state"], registry=r)
        self.wait = Histogram(
            "danlu_queue_wait_seconds",
            "Time from entering the queue to admission.",
            ["queue"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.gpus = Gauge("danlu_gpus_allocated", "GPUs held by jobs and servers.", ["team", "flavor"], registry=r)
        self.quota = Gauge("danlu_gpu_quota", "Nominal GPU quota.", ["team", "flavor"], registry=r)
        self.borrowing = Gauge(
            "danlu_gpu_borrowing_limit",
            "GPUs a team may borrow beyond its nominal quota (absent: unlimited).",
            ["team", "flavor"],
            registry=r,
        )
        self.oldest = Gauge(
            "danlu_queue_oldest_wait_seconds",
            "Seconds the oldest waiting job of a queue has waited.",
            ["queue"],
            registry=r,
        )
        self.attempts_failed = Counter(
            "danlu_attempts_failed",
            "Attempts that ended failed, by whose failure (infrastructure or user).",
            ["queue", "failure"],
            registry=r,
        )
        self.held = Gauge(
            "danlu_gpu_held", "1 while a job or a server holds the device.", ["device", "flavor", "kind"], registry=r
        )
        self.device_up = Gauge(
            "danlu_gpu_up",
            "1 while the device answers NVML (declared devices: always).",
            ["device", "flavor"],
            registry=r,
        )
        self.utilization = Gauge(
            "danlu_gpu_utilization_ratio",
            "The device's busy fraction at the last NVML sample (detected devices only).",
            ["device", "flavor"],
            registry=r,
        )
        self.followers = Gauge("danlu_log_followers", "Clients following a job's log.", registry=r)
        self.tasks = Gauge("danlu_event_loop_tasks", "Tasks on the service's event loop.", registry=r)
        self.tasks.set_function(_loop_tasks)
        self.cycle = Histogram(
            "danlu_admission_cycle_seconds",
            "Time one admission pass takes.",
            registry=r,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )

    def observe_model(self, model, pending_by_queue: dict[str, int], oldest: dict[str, float] | None = None) -> None:
        """Refresh the gauges from the admission model (called after every pass); ``oldest``: per queue, when its
        oldest waiting job entered it (seconds since the epoch)."""
        now = time.time()
        oldest = oldest or {}
        for team in model.teams.values():
            self.pending.labels(team.name).set(pending_by_queue.get(team.name, 0))
            since = oldest.get(team.name)
            self.oldest.labels(team.name).set(max(0.0, now - since) if since else 0.0)
            self.running.labels(team.name).set(
                sum(1 for w in model.admitted.values() if w.team == team.name and w.kind == "job")
            )
            for flavor in model.devices:
                key = f"gpu/{flavor}"
                self.gpus.labels(team.name, flavor).set(model.used[team.name][key])
                self.quota.labels(team.name, flavor).set(team.nominal.get(key, 0.0))
                if key in team.borrowing_limit:
                    self.borrowing.labels(team.name, flavor).set(team.borrowing_limit[key])
        held = {(flavor, device): "" for flavor, devices in model.devices.items() for device in devices}
        for workload in model.admitted.values():
            for device in workload.devices:
                if workload.flavor is not None:
                    held[(workload.flavor, device)] = workload.kind
        for (flavor, device), kind in held.items():
            for each in ("job", "server"):
                self.held.labels(str(device), flavor, each).set(1.0 if kind == each else 0.0)

    def observe_devices(self, inventory, samples: dict[int, float | None]) -> None:
        """Refresh the devices' gauges from an NVML sample: ``samples`` maps a detected device's index to its
        utilization in percent, or None when NVML did not answer for it (a device gone)."""
        for gpu in inventory or ():
            labels = (str(gpu.index), gpu.flavor)
            if gpu.declared:
                self.device_up.labels(*labels).set(1.0)
                continue
            if gpu.index not in samples:
                continue  # not sampled (no NVML here)
            value = samples[gpu.index]
            self.device_up.labels(*labels).set(0.0 if value is None else 1.0)
            if value is not None:
                self.utilization.labels(*labels).set(value / 100.0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
