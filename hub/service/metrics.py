"""Prometheus metrics of the jobs service (``/services/danlu/metrics``).

Queue depth and running jobs per queue, admissions, preemptions and finished
jobs, the time jobs wait, GPUs allocated and nominal per team and flavor, and
how long an admission pass takes; log followers and the event loop's tasks
(a leak shows as a count that only grows). docs/grafana-dashboard.json charts them.
"""

from __future__ import annotations

import asyncio

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
        self.followers = Gauge("danlu_log_followers", "Clients following a job's log.", registry=r)
        self.tasks = Gauge("danlu_event_loop_tasks", "Tasks on the service's event loop.", registry=r)
        self.tasks.set_function(_loop_tasks)
        self.cycle = Histogram(
            "danlu_admission_cycle_seconds",
            "Time one admission pass takes.",
            registry=r,
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
        )

    def observe_model(self, model, pending_by_queue: dict[str, int]) -> None:
        """Refresh the gauges from the admission model (called after every pass)."""
        for team in model.teams.values():
            self.pending.labels(team.name).set(pending_by_queue.get(team.name, 0))
            self.running.labels(team.name).set(
                sum(1 for w in model.admitted.values() if w.team == team.name and w.kind == "job")
            )
            for flavor in model.devices:
                key = f"gpu/{flavor}"
                self.gpus.labels(team.name, flavor).set(model.used[team.name][key])
                self.quota.labels(team.name, flavor).set(team.nominal.get(key, 0.0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
