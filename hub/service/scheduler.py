"""Admission: which queued job starts next, and why a job waits.

The policy is best-effort FIFO (Kueue's ``BestEffortFIFO``): queued jobs are
considered oldest first; a job is admitted when everything it asks for is free
(its GPUs as exclusive devices from the ledger, and a CPU-job slot when it asks
for no GPU); a job that does not fit does not block smaller jobs behind it.
:meth:`Scheduler.plan` is pure over a snapshot, so the API's dry run and the
queue positions use the same decision as admission itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Snapshot:
    """What admission looks at: free devices and running CPU-only jobs."""

    free_gpus: int
    total_gpus: int
    running_cpu_jobs: int
    max_cpu_jobs: int


@dataclass
class Candidate:
    id: str
    gpus: int
    nproc: int = 1
    queue: str = "default"


@dataclass
class Plan:
    admit: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> human reason
    positions: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def plan(self, snapshot: Snapshot, queued: list[Candidate]) -> Plan:
        """Decide, for jobs in queue order, which start now and why the others wait."""
        plan = Plan()
        free_gpus = snapshot.free_gpus
        cpu_slots = snapshot.max_cpu_jobs - snapshot.running_cpu_jobs
        position = 0
        for job in queued:
            if job.gpus > snapshot.total_gpus:
                plan.waiting[job.id] = (f"asks for {job.gpus} GPUs but the workbench has {snapshot.total_gpus}; "
                                        "it can never start")
                continue
            if job.gpus > 0 and job.gpus <= free_gpus:
                free_gpus -= job.gpus
                plan.admit.append(job.id)
                continue
            elif job.gpus == 0 and cpu_slots > 0:
                cpu_slots -= 1
                plan.admit.append(job.id)
                continue
            elif job.gpus > 0:
                reason = f"waiting for {job.gpus} GPUs: {free_gpus} of {snapshot.total_gpus} free"
            else:
                reason = (f"waiting for a CPU job slot: {snapshot.max_cpu_jobs} CPU-only jobs may run at once "
                          f"and {snapshot.running_cpu_jobs} are running")
            position += 1
            plan.positions[job.id] = position
            plan.waiting[job.id] = reason
        return plan
