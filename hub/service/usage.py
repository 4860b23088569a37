"""Usage reports: GPU-hours allocated per user, team, queue or profile, with costs and utilization.

Allocation comes from the attempts of jobs (the devices each held, from start
to end) and from notebook servers' GPU reservations (:class:`ServerUsage`),
clipped to the asked time range. Cost is GPU-hours times the flavor's
``usage.gpu_hour_cost``. Where NVML samples exist (:class:`GpuSample`), the
measured mean utilization of the allocated devices is reported beside the
allocation, so a reservation that sits idle shows.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from danlu.hub.service.models import Attempt, GpuSample, Job, ServerUsage, isoformat, utcnow

GROUPINGS = ("user", "team", "queue", "profile")


def _overlap(start: dt.datetime, end: dt.datetime, begin: dt.datetime, finish: dt.datetime | None) -> float:
    finish = finish or utcnow()
    return max(0.0, (min(end, finish) - max(start, begin)).total_seconds())


def _utilization(session: Session, devices, begin, finish) -> tuple[float, int]:
    if not devices:
        return 0.0, 0
    rows = session.execute(select(GpuSample.utilization).where(
        GpuSample.device.in_(list(devices)), GpuSample.at >= begin, GpuSample.at <= (finish or utcnow())))
    values = [r[0] for r in rows]
    return (sum(values), len(values))


def report(session: Session, settings, start: dt.datetime, end: dt.datetime, by: str = "user",
           owner: str | None = None) -> dict:
    rates = settings.usage["gpu_hour_cost"]
    rows: dict[str, dict] = defaultdict(lambda: {"gpu_hours": 0.0, "cost": 0.0, "jobs": set(), "servers": 0,
                                                 "util_sum": 0.0, "util_n": 0})
    attempts = session.execute(
        select(Attempt, Job).join(Job, Attempt.job_id == Job.id)
        .where(Attempt.started_at < end, or_(Attempt.finished_at.is_(None), Attempt.finished_at > start))
        .where(Job.owner == owner if owner else True))
    for attempt, job in attempts:
        seconds = _overlap(start, end, attempt.started_at, attempt.finished_at)
        key = {"user": job.owner, "team": job.queue, "queue": job.queue, "profile": job.profile}[by]
        row = rows[key]
        row["jobs"].add(job.id)
        if attempt.devices:
            hours = len(attempt.devices) * seconds / 3600
            row["gpu_hours"] += hours
            row["cost"] += hours * rates.get(attempt.flavor or "", 0.0)
            total, n = _utilization(session, attempt.devices, attempt.started_at, attempt.finished_at)
            row["util_sum"] += total
            row["util_n"] += n
    servers = session.scalars(select(ServerUsage).where(
        ServerUsage.started_at < end, or_(ServerUsage.ended_at.is_(None), ServerUsage.ended_at > start),
        ServerUsage.owner == owner if owner else True))
    for server in servers:
        seconds = _overlap(start, end, server.started_at, server.ended_at)
        key = {"user": server.owner, "team": server.team, "queue": server.team, "profile": server.profile}[by]
        row = rows[key]
        row["servers"] += 1
        hours = len(server.devices) * seconds / 3600
        row["gpu_hours"] += hours
        row["cost"] += hours * rates.get(server.flavor or "", 0.0)
        total, n = _utilization(session, server.devices, server.started_at, server.ended_at)
        row["util_sum"] += total
        row["util_n"] += n
    out = []
    for key, row in sorted(rows.items(), key=lambda kv: -kv[1]["gpu_hours"]):
        out.append({by: key, "gpu_hours": round(row["gpu_hours"], 4), "cost": round(row["cost"], 4),
                    "jobs": len(row["jobs"]), "servers": row["servers"],
                    "measured_utilization": round(row["util_sum"] / row["util_n"], 1) if row["util_n"] else None})
    return {
        "from": isoformat(start), "to": isoformat(end), "by": by, "currency": settings.usage["currency"],
        "rows": out,
        "total": {"gpu_hours": round(sum(r["gpu_hours"] for r in out), 4),
                  "cost": round(sum(r["cost"] for r in out), 4)},
    }


def sample_gpus(session: Session, inventory) -> int:
    """Record NVML utilization of every detected device (declared ones have none); returns samples taken."""
    if not inventory or all(g.declared for g in inventory):
        return 0
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        taken = 0
        for gpu in inventory:
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            session.add(GpuSample(device=gpu.index, utilization=float(util)))
            taken += 1
        return taken
    finally:
        pynvml.nvmlShutdown()
