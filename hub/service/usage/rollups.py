"""Usage rollups: hourly and daily sums of what jobs and servers held, and how long raw samples are kept.

What was held comes from *holdings*: each job attempt (its devices from its
start to its end) and each notebook server's reservation (``server_usage``).
:func:`collect` turns the holdings and NVML samples of a time window into one
:class:`Cell` per hour, holder kind, owner, team, profile and flavor:
device-seconds, the samples of the held devices, who held something then and
who began. :func:`roll_up`, run by the jobs service every minute on its
database writer thread, writes the cells of the hours that are over (five
minutes' grace) as ``usage_rollups`` rows, and each finished day's sum of them,
then moves a watermark (the ``usage_rollup`` flag): every hour before it is
rolled up, none after. A pass does at most six hours; behind, the service
runs passes back to back until it has caught up (after the upgrade that added
rollups, from the first row the database holds).

Rows are never changed once written. That is safe because nothing is written
into the past: an attempt or a reservation starts and ends at the time the
writer thread records it, and the samples are taken as they are stored.

:func:`expire_samples` deletes ``gpu_samples`` older than
``usage.sample_retention_days``, but never one that is not rolled up yet:
reports over that time read the rollups, which keep every sum the samples
gave. Holdings are the jobs' history and are never deleted.

A holding is *active* in a window ``[u, v)`` when it began before ``v`` and ended
after ``u`` (or has not ended), or began inside it: a job that ran for no time
at all still ran at some moment, in exactly one hour.
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from danlu.hub.service.store.orm import Attempt, Flag, GpuSample, Job, ServerUsage, UsageRollup, isoformat

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
#: how long after an hour ends it is rolled up
GRACE = dt.timedelta(minutes=5)
#: hours one pass rolls up at most
PASS_HOURS = 6
#: samples one pass deletes at most
EXPIRE_BATCH = 20_000
WATERMARK = "usage_rollup"
#: the key of a cell: (bucket, kind, owner, team, profile, flavor)
Key = tuple[dt.datetime, str, str, str, str, str]


def floor_hour(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def ceil_hour(t: dt.datetime) -> dt.datetime:
    down = floor_hour(t)
    return down if down == t else down + HOUR


def floor_day(t: dt.datetime) -> dt.datetime:
    return t.replace(hour=0, minute=0, second=0, microsecond=0)


def ceil_day(t: dt.datetime) -> dt.datetime:
    down = floor_day(t)
    return down if down == t else down + DAY


@dataclass(frozen=True)
class Holding:
    """A job attempt (``holder``: the job's id; ``first``: attempt 1) or a server reservation (its row id)."""

    kind: str  # "job" | "server"
    holder: str
    owner: str
    team: str
    profile: str
    flavor: str
    devices: tuple[int, ...]
    begin: dt.datetime
    finish: dt.datetime | None
    first: bool

    def active(self, u: dt.datetime, v: dt.datetime) -> bool:
        return self.begin < v and (self.finish is None or self.finish > u or self.begin >= u)


@dataclass
class Cell:
    gpu_seconds: float = 0.0
    util_sum: float = 0.0
    util_n: int = 0
    busy_seconds: float = 0.0  # each sampled device's seconds held times its mean utilization then
    active: set = field(default_factory=set)  # holders counted here (one flavor's cell per holder and hour)
    started: set = field(default_factory=set)  # first attempts / reservations that began here


def _window(column_begin, column_end, a: dt.datetime, b: dt.datetime):
    """The three index ranges whose union is every row active in ``[a, b)``."""
    return (
        (column_begin >= a, column_begin < b),
        (column_begin < a, column_end > a),
        (column_begin < a, column_end.is_(None)),
    )


def holdings(session: Session, a: dt.datetime, b: dt.datetime, owner: str | None = None) -> list[Holding]:
    """Every attempt and server reservation active in ``[a, b)`` (of ``owner`` only, if given).

    Read by time and filtered by owner here: given the owner, a planner may walk all of a heavy user's jobs
    instead of the window's few rows."""
    found = []
    for where in _window(Attempt.started_at, Attempt.finished_at, a, b):
        q = (
            select(
                Attempt.job_id,
                Attempt.number,
                Attempt.flavor,
                Attempt.devices,
                Attempt.started_at,
                Attempt.finished_at,
                Job.owner,
                Job.queue,
                Job.profile,
            )
            .join(Job, Job.id == Attempt.job_id)
            .where(*where)
        )
        found += [
            Holding("job", job_id, who, queue, profile, flavor or "", tuple(devices or ()), begin, finish, number == 1)
            for job_id, number, flavor, devices, begin, finish, who, queue, profile in session.execute(q)
            if owner is None or who == owner
        ]
    for where in _window(ServerUsage.started_at, ServerUsage.ended_at, a, b):
        q = select(
            ServerUsage.id,
            ServerUsage.owner,
            ServerUsage.team,
            ServerUsage.profile,
            ServerUsage.flavor,
            ServerUsage.devices,
            ServerUsage.started_at,
            ServerUsage.ended_at,
        ).where(*where)
        found += [
            Holding(
                "server", str(row_id), who, team, profile or "", flavor or "", tuple(devices or ()), begin, end, True
            )
            for row_id, who, team, profile, flavor, devices, begin, end in session.execute(q)
            if owner is None or who == owner
        ]
    return found


class _Samples:
    """NVML samples of a window, per device: sorted times and prefix sums, so a range's sum is two bisects."""

    def __init__(self, session: Session, a: dt.datetime, b: dt.datetime, devices: set[int]):
        per: dict[int, list] = defaultdict(list)
        if devices:  # by time only: filtering devices in SQL lets SQLite read each device's samples whole
            q = select(GpuSample.device, GpuSample.at, GpuSample.utilization).where(GpuSample.at >= a, GpuSample.at < b)
            for device, at, value in session.execute(q):
                if device in devices:
                    per[device].append((at, value))
        self.times, self.sums = {}, {}
        for device, samples in per.items():
            samples.sort()
            self.times[device] = [t for t, _ in samples]
            sums = [0.0]
            for _, value in samples:
                sums.append(sums[-1] + value)
            self.sums[device] = sums

    def between(self, device: int, u: dt.datetime, v: dt.datetime) -> tuple[float, int]:
        times = self.times.get(device)
        if not times or v <= u:
            return 0.0, 0
        i, j = bisect.bisect_left(times, u), bisect.bisect_left(times, v)
        return self.sums[device][j] - self.sums[device][i], j - i


def collect(
    session: Session, a: dt.datetime, b: dt.datetime, now: dt.datetime, owner: str | None = None
) -> dict[Key, Cell]:
    """The cells of ``[a, b)``, per hour (a cell's bucket is its hour; a window that starts or ends inside
    an hour counts only its part of it). A holding that has not ended holds until ``now``."""
    found = sorted(holdings(session, a, b, owner), key=lambda h: (h.begin, h.kind, h.holder))
    samples = _Samples(session, a, min(b, now), {d for h in found for d in h.devices})
    cells: dict[Key, Cell] = defaultdict(Cell)
    counted: set[tuple[str, str, dt.datetime]] = set()
    for h in found:
        end = h.finish if h.finish is not None else max(now, h.begin)  # where its seconds stop
        last = end if h.finish is not None else max(end, a)  # not ended: active in any window after its start
        hour = floor_hour(max(a, h.begin))
        while hour < b and hour <= last:
            u, v = max(hour, a), min(hour + HOUR, b)
            if h.active(u, v):
                cell = cells[(hour, h.kind, h.owner, h.team, h.profile, h.flavor)]
                if (h.kind, h.holder, hour) not in counted:
                    counted.add((h.kind, h.holder, hour))
                    cell.active.add(h.holder)
                if h.first and u <= h.begin < v:
                    cell.started.add(h.holder)
                held_from, held_to = max(u, h.begin), min(v, end)
                if h.devices and held_to > held_from:
                    held = (held_to - held_from).total_seconds()
                    cell.gpu_seconds += len(h.devices) * held
                    for device in h.devices:
                        total, n = samples.between(device, held_from, held_to)
                        cell.util_sum += total
                        cell.util_n += n
                        if n:  # whole seconds: sums are then exact, whatever their order (SQL, Python)
                            cell.busy_seconds += round(held * total / n / 100.0)
            hour += HOUR
    return dict(cells)


# the watermark and the pass ----------------------------------------------------------------------
def watermark(session: Session) -> dt.datetime | None:
    """The end of what is rolled up (an hour's start): before it, read rollups; None: nothing yet."""
    flag = session.get(Flag, WATERMARK)
    through = flag.value.get("through") if flag is not None and isinstance(flag.value, dict) else None
    return dt.datetime.fromisoformat(through.removesuffix("Z")) if isinstance(through, str) else None


def _earliest(session: Session) -> dt.datetime | None:
    times = [
        session.scalar(select(func.min(column)))
        for column in (Attempt.started_at, ServerUsage.started_at, GpuSample.at)
    ]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def roll_up(session: Session, now: dt.datetime, hours: int = PASS_HOURS) -> bool:
    """Roll up the next hours that are over (at most ``hours``), and the days they complete.

    Returns whether the watermark moved (run it again: there may be more to catch up on).
    """
    known = through = watermark(session)
    target = floor_hour(now - GRACE)
    if through is None:  # the first pass: from the first hour anything was held or sampled
        first = _earliest(session)
        through = floor_hour(first) if first is not None and first < target else target
    end = max(through, min(target, through + hours * HOUR))
    moved = end > through
    if moved:
        rows = [
            {
                "span": "hour",
                "bucket": bucket,
                "kind": kind,
                "owner": who,
                "team": team,
                "profile": profile,
                "flavor": flavor,
                "gpu_seconds": cell.gpu_seconds,
                "util_sum": cell.util_sum,
                "util_n": cell.util_n,
                "busy_seconds": cell.busy_seconds,
                "active": len(cell.active),
                "started": len(cell.started),
            }
            for (bucket, kind, who, team, profile, flavor), cell in collect(session, through, end, now).items()
        ]
        if rows:
            session.execute(insert(UsageRollup), rows)
        day = floor_day(through) + DAY
        while day <= end:  # days this pass completed: the sums of their hours
            _roll_up_day(session, day - DAY)
            day += DAY
    if end != known:
        session.merge(Flag(key=WATERMARK, value={"through": isoformat(end)}))
    return moved


def _roll_up_day(session: Session, day: dt.datetime) -> None:
    keys = (UsageRollup.kind, UsageRollup.owner, UsageRollup.team, UsageRollup.profile, UsageRollup.flavor)
    q = (
        select(
            *keys,
            func.sum(UsageRollup.gpu_seconds),
            func.sum(UsageRollup.util_sum),
            func.sum(UsageRollup.util_n),
            func.sum(UsageRollup.started),
            func.sum(UsageRollup.busy_seconds),
        )
        .where(UsageRollup.span == "hour", UsageRollup.bucket >= day, UsageRollup.bucket < day + DAY)
        .group_by(*keys)
    )
    rows = [
        {
            "span": "day",
            "bucket": day,
            "kind": kind,
            "owner": who,
            "team": team,
            "profile": profile,
            "flavor": flavor,
            "gpu_seconds": seconds,
            "util_sum": util_sum,
            "util_n": util_n,
            "active": None,
            "started": started,
            "busy_seconds": busy,
        }
        for kind, who, team, profile, flavor, seconds, util_sum, util_n, started, busy in session.execute(q)
    ]
    if rows:
        session.execute(insert(UsageRollup), rows)


def expire_samples(session: Session, now: dt.datetime, keep_days: int, batch: int = EXPIRE_BATCH) -> int:
    """Delete up to ``batch`` NVML samples older than ``keep_days`` and already rolled up; how many went."""
    through = watermark(session)
    if through is None:
        return 0
    cutoff = min(through, now - dt.timedelta(days=keep_days))
    oldest = select(GpuSample.id).where(GpuSample.at < cutoff).order_by(GpuSample.at).limit(batch)
    return session.execute(delete(GpuSample).where(GpuSample.id.in_(oldest.scalar_subquery()))).rowcount or 0
