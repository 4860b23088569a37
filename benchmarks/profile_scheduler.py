"""Where the slowest admission passes spend their time: the scheduler benchmark's churn at 10,000 pending
jobs, each pass profiled with cProfile on its own, the 25 slowest kept and summed.

Prints what the slowest 1% of passes admit, preempt and hold pending against the fastest half, then the
summed profile of the slowest. Not part of ``make benchmarks`` (cProfile slows every pass); docs/performance.md
quotes it. Run: ``.venv/bin/python benchmarks/profile_scheduler.py [--jobs 10000]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scheduler as S  # the benchmark's own machine, teams and jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--keep", type=int, default=25, help="slowest passes whose profiles are summed")
    args = parser.parse_args(argv)
    rng = random.Random(S.SEED)
    devices = S.machine(64)
    teams = S.make_teams(20, devices, rng)
    idle = S.new_model(teams, devices, 64 * S.CPU_QUOTA_PER_GPU)
    pending = {}
    for i in range(args.jobs):
        wl = S.feasible_job(f"j{i:05d}", i * 0.01, teams, [1.0] * len(teams), idle, devices, rng)
        pending[wl.id] = wl
    model = S.new_model(teams, devices, 64 * S.CPU_QUOTA_PER_GPU)
    rows, slow, stopped, now = [], [], [], args.jobs * 0.01
    while (pending or model.admitted) and len(rows) < 20 * args.jobs:
        running = [wid for wid, wl in model.admitted.items() if not wl.stopping]
        for wid in rng.sample(running, max(1, len(running) // 4)) if running else []:
            model.release(wid)
        for wid in stopped:
            pending[wid] = S.requeued(model.release(wid))
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        decision = model.cycle(list(pending.values()), now)
        prof.disable()
        took = time.perf_counter() - t0
        rows.append((took, len(decision.admitted), len(decision.preempted), len(pending)))
        if len(rows) > 5:  # the first passes fill the backlog: not what a running service sees
            slow.append((took, prof))
            slow.sort(key=lambda x: -x[0])
            del slow[args.keep :]
        for wl in decision.admitted:
            del pending[wl.id]
        stopped = [victim.id for victim, _ in decision.preempted]
        now += 1.0
    rows.sort()
    n = len(rows)
    print(
        f"{n} passes (profiled: times include cProfile's cost): p50 {rows[n // 2][0] * 1e3:.2f} ms, "
        f"p99 {rows[int(n * 0.99)][0] * 1e3:.2f} ms"
    )
    for name, group in (("slowest 1%", rows[int(n * 0.99) :]), ("fastest half", rows[: n // 2])):
        print(
            f"{name:<13} mean {statistics.mean(r[0] for r in group) * 1e3:6.2f} ms, admitted "
            f"{statistics.mean(r[1] for r in group):5.1f}, preempted {statistics.mean(r[2] for r in group):5.1f}, "
            f"pending {statistics.mean(r[3] for r in group):6.0f}"
        )
    print(
        f"passes that preempt: {sum(1 for r in rows if r[2])} of {n}; "
        f"among the slowest 1%: {sum(1 for r in rows[int(n * 0.99) :] if r[2])}"
    )
    stats = pstats.Stats(slow[0][1])
    for _, prof in slow[1:]:
        stats.add(prof)
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("cumulative").print_stats(r"hub/service", 20)
    print(f"\nthe {len(slow)} slowest passes, summed:\n" + out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
