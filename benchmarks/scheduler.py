"""Admission throughput, decision latency and GPU allocation of the admission model.

What is measured, in one run, in process, with a fixed seed:

* **throughput**: :meth:`danlu.hub.service.admission.Model.cycle` with a
  backlog of ``--jobs`` pending jobs (sizes 1/2/4/8 GPUs and some CPU-only
  jobs, 4 priority classes) from ``--teams`` teams in a few cohorts, whose
  nominal quotas partition ``--gpus`` GPUs of two flavors and the CPUs. A churn
  loop: each iteration completes a quarter of the running jobs (``release``),
  releases and requeues the jobs preempted in the previous iteration, and runs
  one cycle; admissions are counted over the wall time of the whole loop until
  the backlog is drained. Target: 500 admissions/s. For context only, not a
  same-run baseline: Kueue's published end-to-end figure on a Kubernetes
  cluster is about 43 admissions/s.
* **decision latency**: p50 and p99 of the wall time of one ``cycle`` call in
  that loop.
* **GPU allocation**: on a synthetic trace in simulated time (jobs arriving as
  a Poisson process at about 110% of the machine's GPU capacity, sizes
  1/2/4/8 GPUs, lognormal durations), GPU-seconds allocated divided by
  GPU-seconds available from the first arrival until the last job finishes,
  and the mean wait (submission to the start of the run that completed), for
  the Kueue-like model with preemption on (``PREEMPTION``) and off, for FIFO
  under the same quotas (submission order, stop at the first job that does not
  fit its team), and for strict FIFO with no teams at all (one queue; what a
  machine without quotas would allocate). A trace job belongs to a team with
  probability proportional to the team's GPU quota; a preempted job stops after
  ``GRACE`` simulated seconds and restarts from the beginning (its partial run
  counts as allocated).

Run: ``.venv/bin/python benchmarks/scheduler.py [--jobs 10000] [--teams 20] [--gpus 64]``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

from danlu.hub.service.admission import Model, Request, Team, Workload, gpu_key

SEED = 20240601
TARGET = 500.0
KUEUE_PUBLISHED = 43.0
PRIORITIES = (100, 1000, 10000, 100000)
PRIORITY_WEIGHTS = (0.2, 0.5, 0.2, 0.1)
SIZES = (1, 2, 4, 8)
SIZE_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
CPU_PER_GPU = 4  # what a GPU job asks for, per GPU
CPU_QUOTA_PER_GPU = 5  # the machine's CPUs and each team's CPU quota, per GPU
GRACE = 30.0
#: Preemption as configured for every team: (within_team, reclaim), Kueue's defaults when on.
PREEMPTION = {"on": ("lower_priority", "any"), "off": ("never", "never")}


# the machine and its teams ----------------------------------------------------------------------------------


def partition(total: int, parts: int, rng: random.Random) -> list[int]:
    """``total`` units dealt to ``parts`` shares at random (the shares sum to ``total``)."""
    shares = [0] * parts
    for _ in range(total):
        shares[rng.randrange(parts)] += 1
    return shares


def machine(gpus: int) -> dict[str, list[int]]:
    """Two flavors (three quarters `a100`, the rest `h100`), or one when there are few GPUs."""
    if gpus < 8:
        return {"a100": list(range(gpus))}
    first = gpus * 3 // 4
    return {"a100": list(range(first)), "h100": list(range(first, gpus))}


def make_teams(n: int, devices: dict[str, list[int]], rng: random.Random, preemption: str = "on") -> list[Team]:
    """``n`` teams in ceil(n / 5) cohorts; nominal GPU quotas of every flavor partition the machine at random,
    and each team's CPU quota is ``CPU_QUOTA_PER_GPU`` per GPU of quota (so CPU quotas partition it too)."""
    cohorts = max(1, math.ceil(n / 5))
    shares = {gpu_key(f): partition(len(ids), n, rng) for f, ids in devices.items()}
    within_team, reclaim = PREEMPTION[preemption]
    teams = []
    for i in range(n):
        nominal = {r: float(s[i]) for r, s in shares.items()}
        nominal["cpu"] = float(CPU_QUOTA_PER_GPU * sum(nominal.values()))
        flavors = list(devices)
        rng.shuffle(flavors)
        teams.append(Team(f"team{i:02d}", nominal=nominal, cohort=f"cohort{i % cohorts}", flavors=tuple(flavors),
                          within_team=within_team, reclaim=reclaim))
    return teams


def new_model(teams: list[Team], devices: dict[str, list[int]], cpu: int) -> Model:
    return Model(teams, devices, cpu=cpu, starvation_seconds=600.0)


def random_request(devices: dict[str, list[int]], rng: random.Random) -> Request:
    if rng.random() < 0.1:
        return Request(gpus=0, cpu=float(rng.choice([1, 2, 4])))
    gpus = rng.choices(SIZES, SIZE_WEIGHTS)[0]
    flavor = rng.choice(sorted(devices)) if rng.random() < 0.2 else None
    return Request(gpus=gpus, gpu_flavor=flavor, cpu=float(gpus * CPU_PER_GPU))


def feasible_job(wid: str, created: float, teams: list[Team], weights: list[float], idle: Model,
                 devices: dict[str, list[int]], rng: random.Random) -> Workload:
    """A job that fits its team on the idle machine (drawn again until it does)."""
    while True:
        team = rng.choices(teams, weights)[0]
        wl = Workload(wid, team.name, rng.choices(PRIORITIES, PRIORITY_WEIGHTS)[0], created,
                      random_request(devices, rng))
        if idle.fit(wl)[0] is not False:
            return wl


def requeued(victim: Workload) -> Workload:
    return Workload(victim.id, victim.team, victim.priority, victim.created, victim.request)


# (i) and (ii): throughput and latency ------------------------------------------------------------------------


def churn(jobs: int, n_teams: int, gpus: int, rng: random.Random) -> dict:
    devices = machine(gpus)
    cpu = gpus * CPU_QUOTA_PER_GPU
    teams = make_teams(n_teams, devices, rng)
    idle = new_model(teams, devices, cpu)
    pending = {}
    for i in range(jobs):
        wl = feasible_job(f"j{i:05d}", i * 0.01, teams, [1.0] * len(teams), idle, devices, rng)
        pending[wl.id] = wl
    model = new_model(teams, devices, cpu)
    latencies: list[float] = []
    admissions = preemptions = completed = cycles = 0
    stopped: list[str] = []
    now = jobs * 0.01
    start = time.perf_counter()
    while (pending or model.admitted) and cycles < 20 * jobs:  # more passes than that: preemption churn
        running = [wid for wid, wl in model.admitted.items() if not wl.stopping]
        for wid in rng.sample(running, max(1, len(running) // 4)) if running else []:
            model.release(wid)
            completed += 1
        for wid in stopped:
            pending[wid] = requeued(model.release(wid))
        t0 = time.perf_counter()
        decision = model.cycle(list(pending.values()), now)
        latencies.append(time.perf_counter() - t0)
        cycles += 1
        for wl in decision.admitted:
            del pending[wl.id]
        admissions += len(decision.admitted)
        preemptions += len(decision.preempted)
        stopped = [victim.id for victim, _ in decision.preempted]
        now += 1.0
    wall = time.perf_counter() - start
    latencies.sort()
    return {"jobs": jobs, "drained": not pending and not model.admitted, "admissions": admissions,
            "preemptions": preemptions, "completed": completed, "cycles": cycles, "wall": wall,
            "cycle_wall": sum(latencies), "p50": percentile(latencies, 0.5), "p99": percentile(latencies, 0.99),
            "max": latencies[-1]}


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# (iii): GPU allocation on a trace, in simulated time --------------------------------------------------------


@dataclass
class TraceJob:
    id: str
    team: str
    priority: int
    arrival: float
    duration: float
    request: Request


@dataclass
class Outcome:
    allocated: float = 0.0  # GPU-seconds held by running jobs (partial runs of preempted jobs included)
    makespan: float = 0.0
    waits: list[float] = field(default_factory=list)
    preemptions: int = 0
    cycles: int = 0
    finished: bool = True


def make_trace(n: int, n_teams: int, gpus: int, rng: random.Random) -> tuple[list[TraceJob], list[Team], dict]:
    devices = machine(gpus)
    teams = make_teams(n_teams, devices, rng)
    idle = new_model(teams, devices, gpus * CPU_QUOTA_PER_GPU)
    weights = [sum(v for r, v in t.nominal.items() if r.startswith("gpu/")) + 0.01 for t in teams]
    mean_gpus = sum(s * w for s, w in zip(SIZES, SIZE_WEIGHTS, strict=True)) * 0.9
    mu, sigma = math.log(600.0), 1.0
    mean_duration = math.exp(mu + sigma**2 / 2)
    rate = 1.1 * gpus / (mean_gpus * mean_duration)  # arrivals per second at 110% load
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        wl = feasible_job(f"t{i:05d}", t, teams, weights, idle, devices, rng)
        duration = min(8 * 3600.0, max(30.0, rng.lognormvariate(mu, sigma)))
        jobs.append(TraceJob(wl.id, wl.team, wl.priority, t, duration, wl.request))
    return jobs, teams, devices


def simulate(jobs: list[TraceJob], policy) -> Outcome:
    """Discrete events: arrivals, ends and stopped victims; one scheduling pass per distinct event time."""
    out = Outcome()
    events: list[tuple[float, int, str, str]] = []  # (time, order, kind, id)
    for job in jobs:
        heapq.heappush(events, (job.arrival, 0, "arrive", job.id))
    by_id = {job.id: job for job in jobs}
    started: dict[str, float] = {}
    run_token: dict[str, int] = defaultdict(int)  # invalidates the end event of a preempted run
    serial = 0
    while events:
        if out.cycles > 40 * len(jobs):  # jobs keep being preempted and restarted: preemption churn
            out.finished = False
            break
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, wid = heapq.heappop(events)
            if kind == "arrive":
                policy.submit(by_id[wid])
            elif kind.startswith("end") and int(kind[3:]) == run_token[wid]:
                policy.release(wid)
                out.allocated += by_id[wid].request.gpus * (now - started.pop(wid))
                out.waits.append(now - by_id[wid].duration - by_id[wid].arrival)
                out.makespan = now
            elif kind == "stopped":
                policy.release(wid)
                out.allocated += by_id[wid].request.gpus * (now - started.pop(wid))
                policy.submit(by_id[wid])
        admitted, preempted = policy.schedule(now)
        out.cycles += 1
        for wid in admitted:
            started[wid] = now
            run_token[wid] += 1
            serial += 1
            heapq.heappush(events, (now + by_id[wid].duration, serial, f"end{run_token[wid]}", wid))
        for wid in preempted:
            run_token[wid] += 1  # its end event no longer counts
            out.preemptions += 1
            serial += 1
            heapq.heappush(events, (now + GRACE, serial, "stopped", wid))
    return out


class KueueLike:
    """The admission model, driven the way the jobs service drives it."""

    def __init__(self, teams: list[Team], devices: dict[str, list[int]], cpu: int, preemption: str):
        within_team, reclaim = PREEMPTION[preemption]
        teams = [Team(t.name, nominal=t.nominal, cohort=t.cohort, flavors=t.flavors, within_team=within_team,
                      reclaim=reclaim) for t in teams]
        self.name = f"model, preemption {preemption}"
        self.model = new_model(teams, devices, cpu)
        self.pending: dict[str, Workload] = {}

    def submit(self, job: TraceJob) -> None:
        self.pending[job.id] = Workload(job.id, job.team, job.priority, job.arrival, job.request)

    def release(self, wid: str) -> None:
        self.model.release(wid)

    def schedule(self, now: float) -> tuple[list[str], list[str]]:
        decision = self.model.cycle(list(self.pending.values()), now)
        for wl in decision.admitted:
            del self.pending[wl.id]
        return [wl.id for wl in decision.admitted], [victim.id for victim, _ in decision.preempted]


class QuotaFIFO(KueueLike):
    """The same teams and quotas, but strict FIFO: the first job that does not fit stops the pass."""

    def __init__(self, teams: list[Team], devices: dict[str, list[int]], cpu: int):
        super().__init__(teams, devices, cpu, "off")
        self.name = "FIFO, same quotas"

    def schedule(self, now: float) -> tuple[list[str], list[str]]:
        admitted = []
        for wl in sorted(self.pending.values(), key=lambda w: (w.created, w.id)):
            flavor, _ = self.model.fit(wl)
            if flavor is False:
                break
            self.model._admit(wl, flavor, now)
            admitted.append(wl.id)
            del self.pending[wl.id]
        return admitted, []


class StrictFIFO:
    """One queue in submission order; the first job that does not fit stops the pass. No teams, no preemption."""

    name = "strict FIFO"

    def __init__(self, devices: dict[str, list[int]], cpu: int):
        self.free = {f: len(ids) for f, ids in devices.items()}
        self.cpu = float(cpu)
        self.queue: list[TraceJob] = []
        self.running: dict[str, tuple[str | None, TraceJob]] = {}

    def submit(self, job: TraceJob) -> None:
        self.queue.append(job)

    def release(self, wid: str) -> None:
        flavor, job = self.running.pop(wid)
        if flavor:
            self.free[flavor] += job.request.gpus
        self.cpu += job.request.cpu

    def schedule(self, now: float) -> tuple[list[str], list[str]]:
        admitted = []
        while self.queue:
            job = self.queue[0]
            request = job.request
            flavors = [request.gpu_flavor] if request.gpu_flavor else sorted(self.free)
            flavor = next((f for f in flavors if self.free[f] >= request.gpus), None) if request.gpus else ""
            if flavor is None or request.cpu > self.cpu + 1e-9:
                break
            self.queue.pop(0)
            if flavor:
                self.free[flavor] -= request.gpus
            self.cpu -= request.cpu
            self.running[job.id] = (flavor, job)
            admitted.append(job.id)
        return admitted, []


def allocation(trace_jobs: int, n_teams: int, gpus: int, rng: random.Random) -> list[tuple[str, Outcome]]:
    jobs, teams, devices = make_trace(trace_jobs, n_teams, gpus, rng)
    cpu = gpus * CPU_QUOTA_PER_GPU
    results = []
    for policy in (KueueLike(teams, devices, cpu, "on"), KueueLike(teams, devices, cpu, "off"),
                   QuotaFIFO(teams, devices, cpu), StrictFIFO(devices, cpu)):
        results.append((policy.name, simulate(jobs, policy)))
    return results


# report -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="pending jobs in the throughput backlog")
    parser.add_argument("--teams", type=int, default=20, help="teams (5 to a cohort)")
    parser.add_argument("--gpus", type=int, default=64, help="simulated GPUs (two flavors from 8 up)")
    parser.add_argument("--trace-jobs", type=int, default=3000, help="jobs in the allocation trace")
    args = parser.parse_args(argv)

    rng = random.Random(SEED)
    flavors = ", ".join(f"{len(ids)} {flavor}" for flavor, ids in machine(args.gpus).items())
    print(f"machine: {args.gpus} GPUs ({flavors}), "
          f"{args.gpus * CPU_QUOTA_PER_GPU} CPUs; {args.teams} teams in {max(1, math.ceil(args.teams / 5))} cohorts; "
          f"{len(PRIORITIES)} priority classes; seed {SEED}")
    print("preemption on: within_team=%s, reclaim=%s" % PREEMPTION["on"])

    c = churn(args.jobs, args.teams, args.gpus, rng)
    rate = c["admissions"] / c["wall"]
    drained = "drained" if c["drained"] else "NOT drained (preemption churn)"
    print(f"\nthroughput: {c['jobs']} pending jobs {drained} in {c['cycles']} cycles, {c['wall']:.2f} s wall "
          f"({c['cycle_wall']:.2f} s inside cycle); {c['admissions']} admissions "
          f"({c['admissions'] - c['jobs']} re-admissions after {c['preemptions']} preemptions)")
    print(f"{'metric':<34}{'value':>12}")
    print(f"{'admissions/s (whole loop)':<34}{rate:>12.0f}   target >= {TARGET:.0f}: "
          f"{'met' if rate >= TARGET else 'NOT met'}")
    print(f"{'admissions/s (cycle time only)':<34}{c['admissions'] / c['cycle_wall']:>12.0f}")
    print(f"{'Kueue, published, end to end':<34}{KUEUE_PUBLISHED:>12.0f}   (context only: a cluster, not this run)")
    print(f"{'decision latency p50 (ms)':<34}{c['p50'] * 1e3:>12.2f}")
    print(f"{'decision latency p99 (ms)':<34}{c['p99'] * 1e3:>12.2f}")
    print(f"{'decision latency max (ms)':<34}{c['max'] * 1e3:>12.2f}")

    results = allocation(args.trace_jobs, args.teams, args.gpus, rng)
    print(f"\nGPU allocation: {args.trace_jobs}-job trace at ~110% load, simulated time")
    print(f"{'policy':<24}{'allocation':>11}{'mean wait (s)':>15}{'p95 wait (s)':>14}{'makespan (h)':>14}"
          f"{'preemptions':>13}")
    for name, out in results:
        if not out.finished:
            print(f"{name:<24}  did not finish: {len(out.waits)} of {args.trace_jobs} jobs done after "
                  f"{out.cycles} passes, {out.preemptions} preemptions (jobs preempted and restarted in turn)")
            continue
        ratio = out.allocated / (args.gpus * out.makespan)
        p95 = percentile(sorted(out.waits), 0.95)
        print(f"{name:<24}{ratio:>10.1%}{statistics.fmean(out.waits):>15.0f}{p95:>14.0f}{out.makespan / 3600:>14.2f}"
              f"{out.preemptions:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
