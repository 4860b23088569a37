"""Job history at scale: listing, a job's page, 30 days of usage and audit verification with 100,000 jobs.

What is measured, in one run, on SQLite and (with ``--postgres-url`` or
``DANLU_BENCH_POSTGRES_URL``) on PostgreSQL, each against a baseline of the
same calls on a small database measured in the same run:

* **fill**: ``--jobs`` finished jobs (default 100,000) over ``--days`` days
  (default 35) from 200 owners (a few heavy ones) in 20 team queues and
  ``default``, in four final states, with their attempts (5% retried after an
  infrastructure failure), a hash-chained ``submit`` audit record each,
  notebook servers' reservations, and NVML samples of ``--gpus`` devices every
  30 seconds for the whole period: bulk inserts through the real models
  (SQLAlchemy Core on their tables), no API. The baseline database has
  ``--baseline-jobs`` jobs (default 1,000) and 10,000 audit records (the
  rest of the same shape as a submit record: the two logs differ only in
  length), and the same samples.
* **rollup**: :func:`danlu.hub.service.usage.rollups.roll_up` pass after pass, as the
  jobs service runs them after an upgrade, until the watermark has caught up;
  then :func:`~danlu.hub.service.usage.rollups.expire_samples` with the default
  retention (14 days).
* **HTTP on loopback, the path users hit**: a real workbench (``danlu up``,
  :class:`danlu.hub.testing.Workbench`) started on the filled database
  (``jobs.database_url``), called through its proxy with the admin token and
  with one user's token, one request at a time on a kept-alive connection.
  Each call is made ``--requests`` times (at most ``--call-seconds`` each)
  after two warm-up requests: the first page of ``GET /jobs`` (50 jobs, and
  the lab sidebar's default of 200), filtered by state (one, and two), owner
  and queue, a user's own jobs, pages deep in the listing (cursors made with
  the service's own encoder at half the matching jobs, 50,000 deep unfiltered),
  every page of one owner's jobs followed by ``next_cursor`` (pages counted,
  checked for duplicates and gaps), ``GET /jobs/{id}`` of random jobs,
  ``GET /usage`` over the default 30 days (by user, by team, a user's own:
  after the first, the service has the rolled-up part cached), and 30 days
  that start an hour earlier each time (nothing cached), and
  ``GET /audit/verify`` (``--verify-runs`` times, with the jobs service's
  resident memory sampled every 10 ms while it runs).
* **audit verification in process**: :func:`danlu.hub.service.store.audit.verify`
  on each database's session, its time and its peak of Python allocations
  (``tracemalloc``): the same at 10,000 and 100,000 records if it streams.

Printed per call: requests, p50 and p95 in ms on the full database, p95 on the
baseline, and the ratio of the two (1.0: the size does not matter), then the
goal (p95 < 100 ms for the paged reads). Timings on a shared machine are noisy:
read the ratios.

Run: ``.venv/bin/python benchmarks/history.py [--jobs 100000] [--postgres-url URL] [--requests 40]``.
Bounded: a fixed number of requests per call, a time limit per call and a
``--budget`` for the whole run (phases left when it is spent are skipped with a
line that says so); the workbenches, their databases (SQLite files in a
temporary folder, one PostgreSQL schema each, dropped) go when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import random
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import psutil
import requests
from sqlalchemy import create_engine, func, insert, make_url, select, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from danlu import env
from danlu.hub.service.store import (
    audit,
    listing,
    schema,
)
from danlu.hub.service.store.database import make_sessionmaker
from danlu.hub.service.store.orm import (
    Attempt,
    AuditRecord,
    GpuSample,
    Job,
    ServerUsage,
    UsageRollup,
    utcnow,
)
from danlu.hub.service.usage import rollups
from danlu.hub.testing import Workbench

SEED = 20261214
OWNERS = 200
TEAMS = 20
GOAL_MS = 100.0
STATES = (("succeeded", 0.72), ("failed", 0.14), ("cancelled", 0.09), ("timed_out", 0.05))
GPUS = ((0, 0.4), (1, 0.3), (2, 0.15), (4, 0.15))
FLAVORS = ("a100", "l4")  # devices 0..n/2-1 and n/2..n-1
PROFILES = {
    "profiles": [{"slug": "python", "display_name": "Python", "default": True, "environment": {"current": True}}]
}
USER = "u000"  # the heaviest owner: the user whose own view is measured
BATCH = 5000


def owner_of(rng: random.Random) -> int:
    return rng.choices(range(OWNERS), weights=[1 / (k + 1) ** 0.8 for k in range(OWNERS)])[0]


# filling ------------------------------------------------------------------------------------------------
def fill(url: str, jobs: int, audit_records: int, days: int, gpus: int, now: dt.datetime) -> dict:
    """Write the history; returns what was written (counts, and the ids of the jobs)."""
    rng = random.Random(SEED + jobs)
    engine = create_engine(url) if not url.startswith("sqlite") else create_engine(url, connect_args={"timeout": 30})
    begin = now - dt.timedelta(days=days)
    weights = [1 / (k + 1) ** 0.8 for k in range(OWNERS)]
    created = sorted(begin + dt.timedelta(seconds=rng.uniform(0, days * 86400 - 7200)) for _ in range(jobs))
    owners = rng.choices(range(OWNERS), weights=weights, k=jobs)
    half = max(1, gpus // 2)
    job_rows, attempt_rows, records, ids = [], [], [], set()
    for i, (when, k) in enumerate(zip(created, owners, strict=True)):
        when = when.replace(microsecond=0)  # whole seconds: some jobs share a created_at, as in life
        job_id = f"{rng.getrandbits(48):012x}"
        while job_id in ids:
            job_id = f"{rng.getrandbits(48):012x}"
        ids.add(job_id)
        state = rng.choices([s for s, _ in STATES], weights=[w for _, w in STATES])[0]
        count = rng.choices([g for g, _ in GPUS], weights=[w for _, w in GPUS])[0] if gpus else 0
        count = min(count, half)
        queue = "default" if rng.random() < 0.1 else f"team{k % TEAMS:02d}"
        profile = "torch" if rng.random() < 0.3 else "python"
        t = when + dt.timedelta(seconds=rng.expovariate(1 / 60))
        tries = 2 if rng.random() < 0.05 else 1
        for number in range(1, tries + 1):
            length = min(86400.0, rng.lognormvariate(math.log(900), 1.2))
            finish = min(t + dt.timedelta(seconds=length), now - dt.timedelta(minutes=10))
            flavor = rng.randrange(2) if count else None
            devices = sorted(rng.sample(range(flavor * half, flavor * half + half), count)) if count else []
            last = number == tries
            attempt_rows.append(
                {
                    "job_id": job_id,
                    "number": number,
                    "state": state if last else "failed",
                    "reason": "" if last else "the node went away",
                    "devices": devices,
                    "flavor": FLAVORS[flavor] if count else None,
                    "failure": "" if last else "infrastructure",
                    "exit_code": 0 if last else -9,
                    "started_at": t,
                    "finished_at": finish,
                }
            )
            t = finish + dt.timedelta(seconds=rng.uniform(10, 600))
        job_rows.append(
            {
                "id": job_id,
                "owner": f"u{k:03d}",
                "name": f"train-{i}",
                "state": state,
                "reason": {
                    "failed": "exit code 1: ZeroDivisionError",
                    "cancelled": f"cancelled by u{k:03d}",
                    "timed_out": "timed out after 3600 s",
                }.get(state, ""),
                "profile": profile,
                "queue": queue,
                "gpus": count,
                "gpu_type": None,
                "nproc": 1,
                "cpu": 1.0,
                "failure": "user" if state == "failed" else "",
                "parameters": {"lr": 0.01, "epochs": 1 + i % 20},
                "experiment": f"exp-{k % 37}",
                "source": {"notebook_path": "work/train.ipynb"},
                "created_at": when,
                "queued_at": when,
                "started_at": attempt_rows[-tries]["started_at"],
                "finished_at": attempt_rows[-1]["finished_at"],
                "max_attempts": tries,
                "cell_sha256": "ab" * 32,
                "tracking": {"run_id": f"{i:032x}", "experiment_id": str(k % 37), "points_sent": 120},
            }
        )
        records.append(
            (
                when,
                f"u{k:03d}",
                "submit",
                job_id,
                {},
                {
                    "queue": queue,
                    "priority": "normal",
                    "profile": profile,
                    "resources": {"nproc": 1, "gpus": count},
                    "name": f"train-{i}",
                },
            )
        )
    for i in range(max(0, audit_records - jobs)):  # the rest of the log: records of the same shape
        when = begin + dt.timedelta(seconds=rng.uniform(0, days * 86400))
        k = owner_of(rng)
        records.append(
            (
                when,
                f"u{k:03d}",
                "submit",
                f"{rng.getrandbits(48):012x}",
                {},
                {
                    "queue": f"team{k % TEAMS:02d}",
                    "priority": "normal",
                    "profile": "python",
                    "resources": {"nproc": 1, "gpus": 1},
                    "name": f"train-x{i}",
                },
            )
        )
    records.sort(key=lambda r: r[0])
    audit_rows, prev = [], audit.GENESIS
    for seq, (when, actor, action, target, before, after) in enumerate(records, 1):
        at = when.replace(microsecond=when.microsecond // 1000 * 1000)
        digest = audit._digest(prev, seq, at, actor, action, target, before, after)
        audit_rows.append(
            {
                "seq": seq,
                "at": at,
                "actor": actor,
                "action": action,
                "target": target,
                "before": before,
                "after": after,
                "prev_hash": prev,
                "hash": digest,
            }
        )
        prev = digest
    servers = []
    for _ in range(max(5, jobs // 200)):
        start = begin + dt.timedelta(seconds=rng.uniform(0, days * 86400 - 36000))
        k = owner_of(rng)
        servers.append(
            {
                "holder": f"u{k:03d}",
                "owner": f"u{k:03d}",
                "team": f"team{k % TEAMS:02d}",
                "profile": "python",
                "flavor": FLAVORS[0],
                "devices": [rng.randrange(half)] if gpus else [],
                "started_at": start,
                "ended_at": start + dt.timedelta(hours=rng.uniform(0.5, 10)),
            }
        )
    written = {
        "jobs": len(job_rows),
        "attempts": len(attempt_rows),
        "audit records": len(audit_rows),
        "servers": len(servers),
        "samples": 0,
    }
    with engine.begin() as c:
        if url.startswith("sqlite"):
            c.exec_driver_sql("PRAGMA synchronous=OFF")
        for table, rows in (
            (Job, job_rows),
            (Attempt, attempt_rows),
            (AuditRecord, audit_rows),
            (ServerUsage, servers),
        ):
            for j in range(0, len(rows), BATCH):
                c.execute(insert(table), rows[j : j + BATCH])
        t, step, chunk = begin, dt.timedelta(seconds=30), []
        while t < now and gpus:
            chunk += [{"device": d, "at": t, "utilization": float(rng.randrange(101))} for d in range(gpus)]
            t += step
            if len(chunk) >= BATCH:
                c.execute(insert(GpuSample), chunk)
                written["samples"] += len(chunk)
                chunk = []
        if chunk:
            c.execute(insert(GpuSample), chunk)
            written["samples"] += len(chunk)
    engine.dispose()
    return written


def roll_up(url: str, now: dt.datetime, keep_days: int) -> str:
    sessions = make_sessionmaker(url)
    started, passes = time.perf_counter(), 0
    while True:
        with sessions() as s, s.begin():
            passes += 1
            if not rollups.roll_up(s, now):
                break
    rolled = time.perf_counter() - started
    with sessions() as s:
        counts = dict(s.execute(select(UsageRollup.span, func.count()).group_by(UsageRollup.span)).all())
    started, gone = time.perf_counter(), 0
    while True:
        with sessions() as s, s.begin():
            n = rollups.expire_samples(s, now, keep_days)
        gone += n
        if n < rollups.EXPIRE_BATCH:
            break
    expired = time.perf_counter() - started
    sessions.kw["bind"].dispose()
    return (
        f"rollup backlog: {counts.get('hour', 0):,} hourly and {counts.get('day', 0):,} daily rows in "
        f"{rolled:.1f} s ({passes} passes); expired {gone:,} samples older than {keep_days} days in "
        f"{expired:.1f} s"
    )


def verify_in_process(url: str) -> tuple[float, float, int]:
    """(seconds, peak MiB of Python allocations, records) of one audit.verify."""
    sessions = make_sessionmaker(url)
    with sessions() as s:
        started = time.perf_counter()
        result = audit.verify(s)
        seconds = time.perf_counter() - started
        tracemalloc.start()  # a second run, slower under tracing, for its allocations only
        audit.verify(s)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    sessions.kw["bind"].dispose()
    assert result.ok, result.problem
    return seconds, peak / 2**20, result.records


def cursors(url: str) -> dict[str, str]:
    """Cursors half-way down each listing, made with the service's encoder from the rows themselves."""
    sessions = make_sessionmaker(url)
    out = {}
    with sessions() as s:
        for name, where in (
            ("all", ()),
            ("state", (Job.state == "failed",)),
            ("owner", (Job.owner == USER,)),
            ("queue", (Job.queue == "team03",)),
        ):
            total = s.scalar(select(func.count()).select_from(Job).where(*where))
            row = s.execute(
                select(Job.created_at, Job.id)
                .where(*where)
                .order_by(Job.created_at.desc(), Job.id.desc())
                .offset(total // 2)
                .limit(1)
            ).first()
            out[name] = listing.encode_cursor(tuple(row))
        out["ids"] = list(s.scalars(select(Job.id).order_by(func.random()).limit(500)))
        out["user_jobs"] = s.scalar(select(func.count()).select_from(Job).where(Job.owner == USER))
    sessions.kw["bind"].dispose()
    return out


# measuring over HTTP -----------------------------------------------------------------------------------
def timed(http: requests.Session, url: str, token: str, params=None) -> tuple[float, dict]:
    started = time.perf_counter()
    r = http.get(url, params=params, headers={"Authorization": f"token {token}"}, timeout=600)
    body = r.content
    elapsed = (time.perf_counter() - started) * 1000
    if r.status_code != 200:
        raise RuntimeError(f"GET {r.url} -> {r.status_code}: {body[:300]!r}")
    return elapsed, r.json()


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18] if len(values) > 1 else values[0]


def measure(wb: Workbench, tokens: dict, marks: dict, args) -> dict[str, list[float]]:
    api = f"{wb.url}/services/danlu/api/v1"
    http = requests.Session()
    admin = wb.admin_token
    rng = random.Random(SEED)
    shifts = iter(range(1, 10_000))

    def uncached() -> str:  # 30 days that start an hour earlier each time: the service has no sum of them yet
        start = utcnow() - dt.timedelta(days=30, hours=next(shifts))
        return start.isoformat(timespec="seconds") + "Z"

    calls = [
        ("GET /jobs?limit=50", admin, "/jobs", lambda: {"limit": 50}),
        ("GET /jobs (200, the lab's call)", admin, "/jobs", lambda: {}),
        ("GET /jobs?state=failed", admin, "/jobs", lambda: {"limit": 50, "state": "failed"}),
        ("GET /jobs?state=failed,timed_out", admin, "/jobs", lambda: {"limit": 50, "state": "failed,timed_out"}),
        ("GET /jobs?owner=u007", admin, "/jobs", lambda: {"limit": 50, "owner": "u007"}),
        ("GET /jobs?queue=team03", admin, "/jobs", lambda: {"limit": 50, "queue": "team03"}),
        ("GET /jobs (a user's own)", tokens[USER], "/jobs", lambda: {"limit": 50}),
        ("GET /jobs deep (half-way)", admin, "/jobs", lambda: {"limit": 50, "cursor": marks["all"]}),
        (
            "GET /jobs?state=failed deep",
            admin,
            "/jobs",
            lambda: {"limit": 50, "state": "failed", "cursor": marks["state"]},
        ),
        (
            "GET /jobs?queue=team03 deep",
            admin,
            "/jobs",
            lambda: {"limit": 50, "queue": "team03", "cursor": marks["queue"]},
        ),
        ("GET /jobs (user's own) deep", tokens[USER], "/jobs", lambda: {"limit": 50, "cursor": marks["owner"]}),
        ("GET /jobs/{id}", admin, None, lambda: None),
        ("GET /usage (30 days, by user)", admin, "/usage", lambda: {}),
        ("GET /usage?by=team", admin, "/usage", lambda: {"by": "team"}),
        ("GET /usage (a user's own)", tokens[USER], "/usage", lambda: {}),
        ("GET /usage 30 days, uncached", admin, "/usage", lambda: {"from": uncached()}),
    ]
    results: dict[str, list[float]] = {}
    for name, token, path, params in calls:
        times = []
        deadline = time.monotonic() + args.call_seconds
        for i in range(args.requests + 2):
            where = f"{api}{path}" if path else f"{api}/jobs/{rng.choice(marks['ids'])}"
            elapsed, body = timed(http, where, token, params())
            if i >= 2:
                times.append(elapsed)
            if path == "/jobs" and not body["jobs"]:
                raise RuntimeError(f"{name}: no jobs listed")
            if time.monotonic() > deadline and len(times) >= 5:
                break
        results[name] = times
    # every page of the user's own jobs, by next_cursor: each page timed, duplicates and gaps counted
    times, seen, cursor = [], [], None
    deadline = time.monotonic() + args.call_seconds * 3
    while time.monotonic() < deadline:
        params = {"limit": 100, **({"cursor": cursor} if cursor else {})}
        elapsed, body = timed(http, f"{api}/jobs", tokens[USER], params)
        times.append(elapsed)
        seen += [j["id"] for j in body["jobs"]]
        cursor = body["next_cursor"]
        if not cursor:
            break
    complete = cursor is None
    results[f"walk {USER}'s jobs (100 a page)"] = times
    results["_walk"] = [len(seen), len(set(seen)), marks["user_jobs"], complete]
    # audit verification: its time, and the jobs service's memory while it runs
    service = next(p for p in wb.processes() if "danlu.hub.service" in " ".join(p.cmdline()))
    times, peaks = [], []
    for _ in range(args.verify_runs):
        base, peak, stop = service.memory_info().rss, [0], threading.Event()

        def watch(base=base, peak=peak, stop=stop):
            while not stop.is_set():
                with contextlib.suppress(psutil.Error):
                    peak[0] = max(peak[0], service.memory_info().rss - base)
                time.sleep(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        elapsed, body = timed(http, f"{api}/audit/verify", admin)
        stop.set()
        watcher.join()
        assert body["ok"], body
        times.append(elapsed)
        peaks.append(peak[0] / 2**20)
    results["GET /audit/verify"] = times
    results["_verify_rss"] = peaks
    results["_verify_records"] = [body["records"]]
    return results


def serve(url: str, folder: Path, marks: dict, args) -> dict:
    config = {
        "admin_users": ["admin"],
        "users": {"unix_accounts": "off"},
        "gpus": {
            "declared": [
                {"count": max(1, args.gpus // 2), "flavor": FLAVORS[0]},
                {"count": max(1, args.gpus // 2), "flavor": FLAVORS[1]},
            ]
        },
        "usage": {"gpu_hour_cost": {"a100": 2.5, "l4": 0.8}, "currency": "USD"},
        "jobs": {"database_url": url, "warm_runners": 0},
    }
    wb = Workbench(folder, config=config, profiles=PROFILES)
    started = time.perf_counter()
    wb.start()
    try:
        print(f"  workbench up in {time.perf_counter() - started:.0f} s; measuring over HTTP ...", flush=True)
        tokens = {USER: wb.create_user(USER)}
        return measure(wb, tokens, marks, args)
    finally:
        wb.stop()


# one database kind ----------------------------------------------------------------------------------------
class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


@contextlib.contextmanager
def database(kind: str, base: str | None, folder: Path, size: int):
    """An empty database for one size: a SQLite file, or a PostgreSQL schema dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'history-{size}.sqlite'}"
        return
    schema = f"danlu_history_bench_{size}"
    engine = create_engine(base)
    with engine.begin() as c:
        c.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        c.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield (
            make_url(base)
            .update_query_dict({"options": f"-csearch_path={schema}"})
            .render_as_string(hide_password=False)
        )
    finally:
        with engine.begin() as c:
            c.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()


def run_kind(kind: str, base: str | None, args, budget: Budget) -> None:
    now = utcnow().replace(second=0, microsecond=0)
    sizes = [(args.baseline_jobs, max(args.baseline_jobs, 10_000)), (args.jobs, args.jobs)]
    found: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix=f"danlu-history-{kind}-") as tmp:
        for jobs, records in sizes:
            if budget.left() < 120:
                print(f"  skipped {jobs:,} jobs: the budget is spent")
                continue
            with database(kind, base, Path(tmp), jobs) as url:
                schema.upgrade(url, backup_dir=None)
                started = time.perf_counter()
                written = fill(url, jobs, records, args.days, args.gpus, now)
                print(
                    f"  {jobs:,} jobs: wrote "
                    + ", ".join(f"{n:,} {what}" for what, n in written.items())
                    + f" in {time.perf_counter() - started:.1f} s",
                    flush=True,
                )
                print("  " + roll_up(url, now, args.keep_days), flush=True)
                seconds, peak, count = verify_in_process(url)
                marks = cursors(url)
                entry = {"verify_process": (seconds, peak, count)}
                if args.no_http:
                    found[jobs] = entry
                    continue
                entry.update(serve(url, Path(tmp) / f"wb-{jobs}", marks, args))
                found[jobs] = entry
    report(kind, found, args)


def report(kind: str, found: dict[int, dict], args) -> None:
    if not found:
        return
    small, big = found.get(args.baseline_jobs), found.get(args.jobs)
    print(f"\n{kind}: {args.jobs:,} jobs against a baseline of {args.baseline_jobs:,} jobs, same run")
    if big and small and "GET /jobs?limit=50" in big:
        print(f"{'call':<38} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'base p95':>9} {'ratio':>6}  goal")
        for name, times in big.items():
            if name.startswith("_") or name == "verify_process":
                continue
            base = small.get(name)
            goal = (
                ""
                if name == "GET /audit/verify"
                else (f"p95<{GOAL_MS:.0f} " + ("met" if p95(times) < GOAL_MS else "MISSED"))
            )
            ratio = p95(times) / p95(base) if base else float("nan")
            print(
                f"{name:<38} {len(times):>4} {statistics.median(times):>8.1f} {p95(times):>8.1f} "
                f"{p95(base) if base else float('nan'):>9.1f} {ratio:>6.2f}  {goal}"
            )
        for size, entry in ((args.baseline_jobs, small), (args.jobs, big)):
            listed, distinct, expected, complete = entry["_walk"]
            print(
                f"walk at {size:,} jobs: {listed:,} jobs listed, {distinct:,} distinct, {expected:,} expected, "
                f"{'every page read' if complete else 'stopped at the time limit'}"
            )
        for entry in (small, big):
            print(
                f"GET /audit/verify at {entry['_verify_records'][0]:,} records: service memory grew "
                f"{max(entry['_verify_rss']):.1f} MiB at most while it ran"
            )
    for _, entry in sorted(found.items()):
        seconds, peak, count = entry["verify_process"]
        print(f"audit.verify in process at {count:,} records: {seconds:.2f} s, peak {peak:.2f} MiB of allocations")
    if small and big:
        (s1, m1, c1), (s2, m2, c2) = small["verify_process"], big["verify_process"]
        print(
            f"ratio audit.verify {c2:,}/{c1:,} records: time {s2 / s1:.1f}x (linear), peak memory {m2 / m1:.2f}x "
            "(constant if about 1)"
        )
    print(flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000, help="jobs in the full database (default 100,000)")
    parser.add_argument("--baseline-jobs", type=int, default=1000, help="jobs in the baseline (default 1,000)")
    parser.add_argument("--days", type=int, default=35, help="days of history (default 35)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs sampled every 30 s (default 8)")
    parser.add_argument("--keep-days", type=int, default=14, help="raw sample retention (default 14)")
    parser.add_argument("--requests", type=int, default=40, help="timed requests per call (default 40)")
    parser.add_argument("--call-seconds", type=float, default=20.0, help="time limit per call (default 20 s)")
    parser.add_argument("--verify-runs", type=int, default=3, help="GET /audit/verify runs (default 3)")
    parser.add_argument("--budget", type=float, default=2400.0, help="seconds for the whole run (default 2400)")
    parser.add_argument(
        "--postgres-url",
        default=env.BENCH_POSTGRES_URL.get(),
        help=f"a PostgreSQL database to use (default ${env.BENCH_POSTGRES_URL}); schemas "
        "danlu_history_bench_* are created in it and dropped",
    )
    parser.add_argument("--no-http", action="store_true", help="fill, roll up and verify only")
    args = parser.parse_args(argv)
    budget = Budget(args.budget)
    for kind, base in (("sqlite", None), ("postgresql", args.postgres_url)):
        if kind == "postgresql" and not base:
            print(f"postgresql: skipped (no --postgres-url and no {env.BENCH_POSTGRES_URL})")
            continue
        print(f"{kind}: ...", flush=True)
        run_kind(kind, base, args, budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
