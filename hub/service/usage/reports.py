"""Usage reports: GPU-hours allocated per user, team, queue or profile, with costs and utilization.

Allocation is what job attempts and notebook servers' reservations held (their
devices, from start to end), clipped to the asked range; cost is GPU-hours times
the flavor's ``usage.gpu_hour_cost``; measured utilization is the mean of the
NVML samples (:class:`GpuSample`) of the held devices while held, in the range, and
``gpu_hours_busy`` each held device's hours times its mean utilization while held, hour by hour
(``busy_seconds`` of the rollups), counting only what was sampled: ``None`` where nothing was (declared devices,
no NVML), so an unknown is never shown as idle.
``jobs`` counts the jobs with an attempt in the range (CPU-only ones included),
``servers`` the reservations.

A report reads the hourly and daily rollups (:mod:`danlu.hub.service.usage.rollups`)
for the part of the range before their watermark, and the raw rows for the rest
(normally the last hour): a 30-day report sums a few thousand rows, whatever the
number of jobs. Rolled-up time is counted in whole hours, so a range that starts
or ends there is widened to the hour (the answer's ``from`` and ``to`` say so).
Jobs are counted exactly across the two: the jobs active in the range's first
hour, plus the first attempts that began after it, plus the jobs that began
before, paused, and had a retry begin in the range (read from the attempts,
which keep an index on retries). The rolled-up part of a report is kept in a
:class:`Cache` the jobs service holds: it cannot go stale.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import OrderedDict, defaultdict

from sqlalchemy import func, literal_column, select
from sqlalchemy.orm import Session

from danlu.hub.service.store.orm import Attempt, GpuSample, Job, UsageRollup, isoformat, utcnow
from danlu.hub.service.usage import rollups
from danlu.hub.service.usage.rollups import HOUR, ceil_day, ceil_hour, floor_day, floor_hour

_COLUMN = {
    "user": UsageRollup.owner,
    "team": UsageRollup.team,
    "queue": UsageRollup.team,
    "profile": UsageRollup.profile,
}
#: job ids per query when checking retries
_CHUNK = 500


def _pick(by: str, owner: str, team: str, profile: str) -> str:
    return {"user": owner, "team": team, "queue": team, "profile": profile}[by]


class _Totals:
    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # key -> flavor -> s
        self.util: dict[str, list] = defaultdict(lambda: [0.0, 0])
        self.busy: dict[str, float] = defaultdict(float)  # key -> GPU-seconds busy, where sampled
        self.counts: dict[tuple[str, str], int] = defaultdict(int)  # (key, kind) -> jobs or servers

    def merge(self, other: _Totals) -> None:
        for key, flavors in other.seconds.items():
            for flavor, seconds in flavors.items():
                self.seconds[key][flavor] += seconds
        for key, (util_sum, util_n) in other.util.items():
            util = self.util[key]
            util[0] += util_sum
            util[1] += util_n
        for key, count in other.counts.items():
            self.counts[key] += count
        for key, seconds in other.busy.items():
            self.busy[key] += seconds

    def add(
        self,
        key: str,
        kind: str,
        flavor: str,
        seconds: float,
        util_sum: float,
        util_n: int,
        count: int = 0,
        busy: float = 0.0,
    ) -> None:
        if seconds:
            self.seconds[key][flavor] += seconds
        util = self.util[key]
        util[0] += util_sum
        util[1] += util_n
        if util_n:
            self.busy[key] += busy
        self.counts[(key, kind)] += count


class Cache:
    """The rolled-up part of recent reports, by grouping, owner and hours. Rollup rows are never changed
    once written, so an entry is never stale: a report asked again (a dashboard, the same default range
    within the hour) sums only the raw rows after the watermark."""

    def __init__(self, size: int = 32):
        self.size = size
        self._entries: OrderedDict[tuple, _Totals] = OrderedDict()
        self._lock = threading.Lock()  # reports run on several reader threads

    def get(self, key: tuple) -> _Totals | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key: tuple, totals: _Totals) -> None:
        with self._lock:
            self._entries[key] = totals
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


def _rolled(
    session: Session, totals: _Totals, by: str, start: dt.datetime, end: dt.datetime, owner: str | None
) -> None:
    """Add the rollups of ``[start, end)`` (whole hours): sums, the first hour's active holders, and what
    began after it."""
    column = _COLUMN[by]
    first_day, last_day = ceil_day(start), floor_day(end)
    parts = (
        [("hour", start, end)]
        if first_day >= last_day
        else [("hour", start, first_day), ("day", first_day, last_day), ("hour", last_day, end)]
    )
    for span, a, b in parts:
        if a >= b:
            continue
        q = (
            select(
                UsageRollup.kind,
                column,
                UsageRollup.flavor,
                func.sum(UsageRollup.gpu_seconds),
                func.sum(UsageRollup.util_sum),
                func.sum(UsageRollup.util_n),
                func.sum(UsageRollup.started),
                func.sum(UsageRollup.busy_seconds),
            )
            .where(UsageRollup.span == span, UsageRollup.bucket >= a, UsageRollup.bucket < b)
            .group_by(UsageRollup.kind, column, UsageRollup.flavor)
        )
        if owner is not None:
            q = q.where(UsageRollup.owner == owner)
        for kind, key, flavor, seconds, util_sum, util_n, started, busy in session.execute(q):
            totals.add(
                key, kind, flavor, seconds or 0.0, util_sum or 0.0, int(util_n or 0), int(started or 0), busy or 0.0
            )
    # the first hour: who was active in it, instead of who began in it (counted above)
    q = (
        select(UsageRollup.kind, column, func.sum(UsageRollup.active), func.sum(UsageRollup.started))
        .where(UsageRollup.span == "hour", UsageRollup.bucket == start)
        .group_by(UsageRollup.kind, column)
    )
    if owner is not None:
        q = q.where(UsageRollup.owner == owner)
    for kind, key, active, started in session.execute(q):
        totals.counts[(key, kind)] += int(active or 0) - int(started or 0)


def _retried(
    session: Session, totals: _Totals, by: str, start: dt.datetime, end: dt.datetime, owner: str | None
) -> None:
    """Count the jobs that first began before ``start + 1h``, were not active in that first hour, and had a
    retry begin in ``[start + 1h, end)``: neither the first hour's active jobs nor the first attempts after it."""
    after = start + HOUR
    # a job submitted after the first hour began cannot have begun before it: only jobs older than the range's
    # first hour whose retries began in the range are looked at (those the range's start cuts through)
    q = (
        select(Attempt.job_id, Job.owner, Job.queue, Job.profile)
        .join(Job, Job.id == Attempt.job_id)
        .where(
            Attempt.number > literal_column("1"),  # a literal: what the partial index ix_attempts_retries says
            Attempt.started_at >= after,
            Attempt.started_at < end,
            Job.created_at < after,
        )
        .distinct()
    )
    if owner is not None:
        q = q.where(Job.owner == owner)
    candidates = {job_id: _pick(by, who, queue, profile) for job_id, who, queue, profile in session.execute(q)}
    ids = sorted(candidates)
    for i in range(0, len(ids), _CHUNK):
        attempts = session.execute(
            select(Attempt.job_id, Attempt.number, Attempt.started_at, Attempt.finished_at).where(
                Attempt.job_id.in_(ids[i : i + _CHUNK])
            )
        )
        first: dict[str, dt.datetime] = {}
        in_first_hour: set[str] = set()
        for job_id, number, begin, finish in attempts:
            if number == 1:
                first[job_id] = begin
            if begin < after and (finish is None or finish > start or begin >= start):
                in_first_hour.add(job_id)
        for job_id in ids[i : i + _CHUNK]:
            if job_id in first and first[job_id] < after and job_id not in in_first_hour:
                totals.counts[(candidates[job_id], "job")] += 1


def _raw(
    session: Session,
    totals: _Totals,
    by: str,
    start: dt.datetime,
    end: dt.datetime,
    now: dt.datetime,
    owner: str | None,
    *,
    count: str,
) -> None:
    """Add ``[start, end)`` from the raw rows; ``count``: ``"active"`` (every holder in the window, once)
    or ``"started"`` (only those that began in it)."""
    holders: dict[tuple[str, str], set] = defaultdict(set)
    for (_bucket, kind, who, team, profile, flavor), cell in rollups.collect(session, start, end, now, owner).items():
        key = _pick(by, who, team, profile)
        totals.add(key, kind, flavor, cell.gpu_seconds, cell.util_sum, cell.util_n, busy=cell.busy_seconds)
        holders[(key, kind)] |= cell.active if count == "active" else cell.started
    for (key, kind), found in holders.items():
        totals.counts[(key, kind)] += len(found)


def report(
    session: Session,
    settings,
    start: dt.datetime,
    end: dt.datetime,
    by: str = "user",
    owner: str | None = None,
    now: dt.datetime | None = None,
    cache: Cache | None = None,
) -> dict:
    now = now or utcnow()
    rates = settings.usage.gpu_hour_cost
    totals = _Totals()
    through = rollups.watermark(session)
    if through is not None and start < through:  # from the rollups, then the raw rows after them
        start = floor_hour(start)
        end = ceil_hour(end) if end < through else end
        rolled_end = min(end, through)
        key = (by, owner, start, rolled_end)
        rolled = cache.get(key) if cache is not None else None
        if rolled is None:
            rolled = _Totals()
            _rolled(session, rolled, by, start, rolled_end, owner)
            if cache is not None:
                cache.put(key, rolled)
        totals.merge(rolled)
        _retried(session, totals, by, start, end, owner)
        if rolled_end < end:
            _raw(session, totals, by, rolled_end, end, now, owner, count="started")
    else:
        _raw(session, totals, by, start, end, now, owner, count="active")
    rows = []
    for key in set(totals.seconds) | set(totals.util) | {k for k, _ in totals.counts}:
        flavors = totals.seconds.get(key, {})
        util_sum, util_n = totals.util.get(key, (0.0, 0))
        busy_seconds = totals.busy.get(key)
        busy = round(busy_seconds / 3600, 4) if busy_seconds is not None else None
        rows.append(
            {
                by: key,
                "gpu_hours": round(sum(flavors.values()) / 3600, 4),
                "cost": round(sum(s / 3600 * rates.get(f, 0.0) for f, s in flavors.items()), 4),
                "jobs": totals.counts.get((key, "job"), 0),
                "servers": totals.counts.get((key, "server"), 0),
                "measured_utilization": round(util_sum / util_n, 1) if util_n else None,
                "gpu_hours_busy": busy,
            }
        )
    rows.sort(key=lambda r: (-r["gpu_hours"], r[by]))
    return {
        "from": isoformat(start),
        "to": isoformat(end),
        "by": by,
        "currency": settings.usage.currency,
        "rows": rows,
        "total": {
            "gpu_hours": round(sum(r["gpu_hours"] for r in rows), 4),
            "cost": round(sum(r["cost"] for r in rows), 4),
            "gpu_hours_busy": (
                round(sum(r["gpu_hours_busy"] for r in rows if r["gpu_hours_busy"] is not None), 4)
                if any(r["gpu_hours_busy"] is not None for r in rows)
                else None
            ),
        },
    }


def sample_gpus(session: Session, inventory) -> dict[int, float | None]:
    """Record NVML utilization of every detected device (declared ones have none): each one's utilization in
    percent, or None where NVML did not answer for it (a device fallen off the bus, a lost GPU)."""
    if not inventory or all(g.declared for g in inventory):
        return {}
    try:
        import pynvml  # deferred: optional (nvidia-ml-py), absent where no GPU is

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        taken: dict[int, float | None] = {}
        for gpu in inventory:
            if gpu.declared:
                continue
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
                util = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except pynvml.NVMLError:
                taken[gpu.index] = None
                continue
            session.add(GpuSample(device=gpu.index, utilization=util))
            taken[gpu.index] = util
        return taken
    finally:
        pynvml.nvmlShutdown()
