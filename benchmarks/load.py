"""Latency of the jobs API and the MLflow gateway with 200 users doing what the sidebar and %%train do.

One real workbench (``danlu up``, SQLite, on loopback) and an asyncio load generator (httpx,
one client per simulated user, each with its own hub API token, all through the proxy as a
browser's requests are). What each simulated user does, on a 5 s period (``--period``) with a
random phase:

* **queue poll**: ``GET /services/danlu/api/v1/jobs?owner=USER``, as the sidebar's queue does;
* **experiments poll**: ``GET /services/danlu/api/v1/experiments``, what the Experiments view
  lists (the sidebar loads it when the view opens; here it is polled like the queue, as the
  issue asks, which is the heavier load);
* **opening an experiment**, now and then (``--open-chance`` per period): ``POST
  .../api/2.0/mlflow/runs/search`` filtered by the user's ``danlu.user`` tag, through the MLflow
  gateway, as the runs table does (each user has an experiment of their own with one run, made
  before the load starts; every user may read every experiment, MLflow's default here);
* **log follower**, now and then (``--follow-chance`` per period): ``GET /jobs/{id}/logs?
  follow=true`` on one of the user's jobs, held for ``--follow-seconds``; the time measured is
  until the response's headers and first bytes arrive;
* **submission**: across all users, trivial one-cell jobs at ``--submit-rate`` per second
  (``POST /jobs``, the time until the service answers; the jobs then really run);

Each user starts with ``--history`` finished jobs (20) in three experiments, written into the
jobs database before the load, and ``--admins`` admins list everything every period
(``GET /jobs?limit=1000``, ``GET /queues``).

Before the load, the same requests are timed with one user at a time (the **baseline**,
measured in the same run), so the ratio lines say what 200 users add. Printed: p50/p95/p99
per endpoint, request and error counts, and the resident memory of the hub, the proxy, the
jobs service, the gateway and MLflow (peak during the load). Goals (the issue's): p95 < 200 ms
for every read endpoint and for submission at 200 users, 0 errors, the hub < 300 MB.

Bounded: ``--duration`` seconds of load (default 150) after a ramp-up of one period; every
request has a 30 s timeout; the benchmark stops its workbench at the end. The duration is what
gives submissions enough samples: at 0.2 a second, 150 s are 31 of them (each a user's first, the
submitter taking the users in turn), so their p95 is not simply the slowest of a dozen; the load
itself is the same whatever the duration.

Run: ``.venv/bin/python benchmarks/load.py [--users 200] [--duration 150] [--submit-rate 0.2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil

from danlu import tags
from danlu.hub.testing import CURRENT_PYTHON_PROFILES as PROFILES
from danlu.hub.testing import Workbench

SEED = 20261201
GOAL_P95_MS = 200.0
GOAL_HUB_MB = 300.0
MB = 2**20
TRIVIAL = {
    "cells": [
        {"cell_type": "code", "id": "c1", "metadata": {}, "outputs": [], "execution_count": None, "source": "x = 1 + 1"}
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}
JOBS = "/services/danlu/api/v1"
MLFLOW = "/services/mlflow/api/2.0/mlflow"
USER_TAG = tags.USER


class Recorder:
    """Latencies (ms) and errors per endpoint."""

    def __init__(self):
        self.times: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    async def timed(self, name: str, call, ok=(200,)):
        start = time.perf_counter()
        try:
            response = await call()
        except httpx.HTTPError as e:
            self.errors[name][type(e).__name__] += 1
            return None
        self.times[name].append(1000 * (time.perf_counter() - start))
        if response.status_code not in ok:
            self.errors[name][str(response.status_code)] += 1
        return response


class User:
    def __init__(self, base: str, name: str, token: str, admin: bool = False):
        self.name = name
        self.admin = admin
        self.client = httpx.AsyncClient(
            base_url=base,
            headers={"Authorization": f"token {token}"},
            timeout=30,
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=2),
        )
        self.experiment_ids: list[str] = []
        self.own_experiment = "0"
        self.jobs: list[str] = []

    async def queue(self, rec: Recorder) -> None:
        r = await rec.timed(
            "GET /jobs?owner (queue poll)", lambda: self.client.get(f"{JOBS}/jobs", params={"owner": self.name})
        )
        if r is not None and r.status_code == 200:
            self.jobs = [j["id"] for j in r.json()["jobs"]][:5] or self.jobs

    async def experiments(self, rec: Recorder) -> None:
        r = await rec.timed("GET /experiments (experiments poll)", lambda: self.client.get(f"{JOBS}/experiments"))
        if r is not None and r.status_code == 200:
            self.experiment_ids = [e["experiment_id"] for e in r.json()["experiments"] if e["experiment_id"]]

    async def open_experiment(self, rec: Recorder) -> None:
        body = {
            "experiment_ids": self.experiment_ids[:1] or [self.own_experiment],
            "filter": f"tags.`{USER_TAG}` = '{self.name}'",
            "max_results": 1000,
            "order_by": ["attributes.start_time DESC"],
        }
        await rec.timed(
            "POST runs/search (open an experiment)", lambda: self.client.post(f"{MLFLOW}/runs/search", json=body)
        )

    async def follow(self, rec: Recorder, seconds: float) -> None:
        if not self.jobs:
            return
        job_id = random.choice(self.jobs)
        start = time.perf_counter()
        try:
            async with self.client.stream("GET", f"{JOBS}/jobs/{job_id}/logs", params={"follow": "true"}) as response:
                first = True
                if response.status_code != 200:
                    rec.errors["GET /jobs/{id}/logs?follow (first bytes)"][str(response.status_code)] += 1
                    return
                end = time.monotonic() + seconds
                async for _chunk in response.aiter_raw():
                    if first:
                        rec.times["GET /jobs/{id}/logs?follow (first bytes)"].append(
                            1000 * (time.perf_counter() - start)
                        )
                        first = False
                    if time.monotonic() > end:
                        break
                if first:  # the job had ended: the whole (short) log came and the stream closed
                    rec.times["GET /jobs/{id}/logs?follow (first bytes)"].append(1000 * (time.perf_counter() - start))
        except httpx.HTTPError as e:
            rec.errors["GET /jobs/{id}/logs?follow (first bytes)"][type(e).__name__] += 1

    async def admin_round(self, rec: Recorder) -> None:
        await rec.timed(
            "GET /jobs?limit=1000 (admin)", lambda: self.client.get(f"{JOBS}/jobs", params={"limit": "1000"})
        )
        await rec.timed("GET /queues (admin)", lambda: self.client.get(f"{JOBS}/queues"))

    async def submit(self, rec: Recorder) -> None:
        r = await rec.timed(
            "POST /jobs (submit)",
            lambda: self.client.post(f"{JOBS}/jobs", json={"notebook": TRIVIAL, "name": "load"}),
            ok=(200, 201),
        )
        if r is not None and r.status_code in (200, 201):
            self.jobs = [r.json()["id"], *self.jobs][:5]


async def user_loop(
    user: User,
    rec: Recorder,
    period: float,
    until: float,
    follow_chance: float,
    follow_seconds: float,
    open_chance: float,
    rng: random.Random,
) -> None:
    await asyncio.sleep(rng.uniform(0, period))
    followers = set()
    while time.monotonic() < until:
        tick = time.monotonic()
        if user.admin:
            await user.admin_round(rec)
        else:
            await user.queue(rec)
            await user.experiments(rec)
            if rng.random() < open_chance:
                await user.open_experiment(rec)
            if rng.random() < follow_chance:
                task = asyncio.ensure_future(user.follow(rec, follow_seconds))
                followers.add(task)
                task.add_done_callback(followers.discard)
        await asyncio.sleep(max(0.0, period - (time.monotonic() - tick)))
    for task in list(followers):
        task.cancel()


async def submitter(users: list[User], rec: Recorder, rate: float, until: float) -> None:
    if rate <= 0:
        return
    i = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        await users[i % len(users)].submit(rec)
        i += 1
        next_at += 1.0 / rate
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def components(wb: Workbench) -> dict[str, psutil.Process]:
    out = {}
    for proc in wb.processes():
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        for needle, name in (
            ("danlu.hub.hubmain", "hub"),
            ("configurable-http-proxy", "proxy"),
            ("danlu.hub.service", "jobs service"),
            ("mlflow_gateway", "MLflow gateway"),
            ("uvicorn", "MLflow"),
        ):
            if needle in cmd:
                out[name] = proc
    return out


async def sample_memory(procs: dict[str, psutil.Process], peaks: dict[str, float], until: float) -> None:
    while time.monotonic() < until:
        for name, proc in procs.items():
            try:
                peaks[name] = max(peaks.get(name, 0.0), proc.memory_info().rss / MB)
            except psutil.Error:
                pass
        await asyncio.sleep(1.0)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def prepare(wb: Workbench, names: list[str], admins: int) -> list[User]:
    """Users with tokens and an experiment with one MLflow run each (through the gateway, as themselves)."""
    tokens = {}
    for name in names:
        tokens[name] = wb.create_user(name)
    admin_names = [f"admin{i}" for i in range(admins)]
    for name in admin_names:
        tokens[name] = wb.create_user(name)
        r = wb.hub("PATCH", f"/users/{name}", json={"admin": True})
        r.raise_for_status()
    users = [User(wb.url, n, tokens[n]) for n in names] + [User(wb.url, n, tokens[n], admin=True) for n in admin_names]
    sem = asyncio.Semaphore(8)

    async def one_run(user: User):
        async with sem:
            r = await user.client.post(f"{MLFLOW}/experiments/create", json={"name": f"{user.name}-work"})
            r.raise_for_status()
            user.own_experiment = r.json()["experiment_id"]
            r = await user.client.post(
                f"{MLFLOW}/runs/create",
                json={
                    "experiment_id": user.own_experiment,
                    "start_time": int(time.time() * 1000),
                    "tags": [{"key": USER_TAG, "value": user.name}],
                },
            )
            r.raise_for_status()

    await asyncio.gather(*(one_run(u) for u in users if not u.admin))
    return users


def add_history(wb: Workbench, names: list[str], per_user: int) -> None:
    """``per_user`` finished jobs with an MLflow run each, written straight into the jobs database.

    What a team's workbench holds after a while: the queue poll and the experiments list read a
    user's history, so the load runs against one rather than an empty database. Finished jobs only
    (the scheduler never looks at them), in a few experiments per user.
    """
    import datetime as dt

    from danlu.hub.service.store.database import make_sessionmaker
    from danlu.hub.service.store.orm import Job

    sessions = make_sessionmaker(f"sqlite:///{wb.state / 'danlu.sqlite'}")
    now = dt.datetime.utcnow()
    with sessions() as s:
        for u, name in enumerate(names):
            for i in range(per_user):
                n = u * per_user + i
                s.add(
                    Job(
                        id=f"{0xF00000000000 + n:012x}",
                        owner=name,
                        name=f"history-{i}",
                        state="succeeded",
                        profile="python",
                        experiment=f"{name}/exp{i % 3}",
                        mlflow_run_id=f"{n:032x}",
                        tracking={"run_id": f"{n:032x}", "experiment_id": str(1000 + u * 3 + i % 3)},
                        created_at=now - dt.timedelta(minutes=n),
                        finished_at=now - dt.timedelta(minutes=n),
                    )
                )
        s.commit()


async def baseline(users: list[User], rounds: int) -> Recorder:
    """The same requests, one user at a time, on the otherwise idle workbench."""
    rec = Recorder()
    plain = [u for u in users if not u.admin]
    admin = next((u for u in users if u.admin), None)
    for i in range(rounds):
        user = plain[i % len(plain)]
        await user.queue(rec)
        await user.experiments(rec)
        await user.open_experiment(rec)
        if admin is not None:
            await admin.admin_round(rec)
    await plain[0].submit(rec)
    await plain[0].follow(rec, 0.5)
    return rec


async def load(wb: Workbench, args) -> tuple[Recorder, Recorder, dict, dict, float]:
    rng = random.Random(SEED)
    names = [f"load{i:03d}" for i in range(args.users)]
    print(f"creating {args.users} users and {args.admins} admins, one MLflow run each ...", flush=True)
    users = await prepare(wb, names, args.admins)
    add_history(wb, names, args.history)
    procs = components(wb)
    idle = {name: p.memory_info().rss / MB for name, p in procs.items()}
    print("baseline: the same requests one user at a time ...", flush=True)
    base = await baseline(users, rounds=30)
    print(
        f"load: {args.users} users every {args.period:g} s, {args.submit_rate:g} submissions/s, "
        f"{args.admins} admins, for {args.duration:g} s after a {args.period:g} s ramp-up ...",
        flush=True,
    )
    rec = Recorder()
    start = time.monotonic()
    until = start + args.period + args.duration
    peaks: dict[str, float] = {}
    tasks = [
        user_loop(
            u,
            rec,
            args.period,
            until,
            args.follow_chance,
            args.follow_seconds,
            args.open_chance,
            random.Random(rng.random()),
        )
        for u in users
    ]
    tasks.append(submitter([u for u in users if not u.admin], rec, args.submit_rate, until))
    tasks.append(sample_memory(procs, peaks, until))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    await asyncio.gather(*(u.client.aclose() for u in users))
    return base, rec, idle, peaks, elapsed


def report(base: Recorder, rec: Recorder, idle: dict, peaks: dict, elapsed: float, args) -> None:
    print(f"\n{'endpoint':<44}{'n':>7}{'p50':>8}{'p95':>8}{'p99':>8}{'errors':>8}{'base p95':>10}{'ratio':>7}   (ms)")
    worst = 0.0
    for name in sorted(rec.times.keys() | rec.errors.keys()):
        values = rec.times.get(name, [])
        errors = sum(rec.errors.get(name, {}).values())
        p95 = pct(values, 0.95)
        b95 = pct(base.times.get(name, []), 0.95)
        worst = max(worst, p95) if values else worst
        print(
            f"{name:<44}{len(values):>7}{pct(values, 0.5):>8.1f}{p95:>8.1f}{pct(values, 0.99):>8.1f}{errors:>8}"
            f"{b95:>10.1f}{p95 / b95 if b95 == b95 and b95 else float('nan'):>7.2f}"
        )
    total = sum(len(v) for v in rec.times.values())
    errors = sum(sum(e.values()) for e in rec.errors.values())
    print(
        f"\n{total} requests in {elapsed:.0f} s ({total / elapsed:.0f}/s), {errors} errors"
        + (f": {dict((k, dict(v)) for k, v in rec.errors.items())}" if errors else "")
    )
    print("\nresident memory (MB): idle before the load -> peak during it")
    for name in sorted(peaks):
        print(f"  {name:<16}{idle.get(name, float('nan')):>8.0f} ->{peaks[name]:>6.0f}")
    hub = peaks.get("hub", float("nan"))
    print(
        f"\nworst p95 {worst:.0f} ms: goal < {GOAL_P95_MS:.0f}: {'met' if worst < GOAL_P95_MS else 'NOT met'};  "
        f"errors {errors}: goal 0: {'met' if errors == 0 else 'NOT met'};  "
        f"hub peak {hub:.0f} MB: goal < {GOAL_HUB_MB:.0f}: {'met' if hub < GOAL_HUB_MB else 'NOT met'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--admins", type=int, default=3)
    parser.add_argument(
        "--duration",
        type=float,
        default=150.0,
        help="seconds of load after the ramp-up (default 150: 31 submissions at 0.2/s)",
    )
    parser.add_argument("--period", type=float, default=5.0, help="seconds between a user's polls (default 5)")
    parser.add_argument("--submit-rate", type=float, default=0.2, help="trivial jobs submitted per second in all")
    parser.add_argument("--follow-chance", type=float, default=0.02, help="chance per period to follow a log")
    parser.add_argument("--follow-seconds", type=float, default=10.0)
    parser.add_argument("--history", type=int, default=20, help="finished jobs per user before the load")
    parser.add_argument("--open-chance", type=float, default=0.05, help="chance per period to open an experiment")
    args = parser.parse_args(argv)
    if args.users < 1:
        parser.error("--users must be at least 1")
    load1, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load1 > cores / 2:
        print(f"note: this machine is busy (load {load1:.1f} on {cores} cores): expect noisy times", flush=True)
    with tempfile.TemporaryDirectory(prefix="danlu-load-") as tmp:
        config = {"auth": {"type": "dummy"}, "hub": {"idle_timeout_seconds": 0}}
        wb = Workbench(Path(tmp) / "workbench", config=config, profiles=PROFILES)
        print("starting a workbench (danlu up) ...", flush=True)
        wb.start()
        try:
            base, rec, idle, peaks, elapsed = asyncio.run(load(wb, args))
        finally:
            wb.stop()
    report(base, rec, idle, peaks, elapsed, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
