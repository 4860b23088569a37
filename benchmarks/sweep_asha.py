"""A 64-configuration ASHA sweep on a toy problem, against running all 64 to the end, under a fixed quota.

What is measured, in one run, in process, through the jobs service's own manager (submission, admission,
the sweeps' loop, Optuna, cancellation of pruned trials) on a fake backend whose jobs are synthetic
training runs (``tests/sweepkit.py``: ``val_loss`` after each step is a deterministic learning curve of the
configuration, one step every ``--pace`` seconds, read by the loop in place of MLflow):

* **trial-steps**: the steps the sweep's jobs executed, all trials together, over ``64 x --steps``, the
  steps of running the same 64 configurations to the end (the baseline, computed in the same run from the
  configurations the sweep tried). Target: at most 30%.
* **objective**: the best final ``val_loss`` the sweep found over the best final ``val_loss`` of the 64
  configurations run to the end (the same configurations). Target: within 5% (a ratio at most 1.05).
* **quota**: the team's quota is ``--quota`` GPUs and each trial takes one; the GPU ledger is sampled every
  10 ms and the backend's start/end log is replayed: the most GPUs held at once by jobs, both ways.
  Target: never over the quota.

Run: ``python benchmarks/sweep_asha.py`` (about 40 s). A step every 0.1 s is fast training next to the loop's
read-and-decide latency; the steps trials run past the step their pruning was decided at are printed.
Exit status 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fakes import FakeGroups, admin, make_manager, make_settings, notebook, serving, user  # noqa: E402
from tests.sweepkit import CurveBackend, PointsObjective, curve, most_at_once  # noqa: E402


async def run(args) -> dict:
    state = Path(tempfile.mkdtemp(prefix="danlu-sweep-bench-")) / "state"
    (state / "users" / "alice").mkdir(parents=True)
    settings = make_settings(
        state,
        teams={"research": {"quota": {"gpus": {"sim": args.quota}}}},
        gpus={"declared": [{"count": args.quota + 2, "flavor": "sim"}]},
    )
    backend = CurveBackend(pace=args.pace)
    manager = make_manager(backend, state, settings=settings, groups=FakeGroups())
    manager.sweeps.interval = args.pace / 2
    manager.sweeps.source = PointsObjective(backend)
    alice, boss = user("alice", "research"), admin()
    held: list[int] = []
    async with serving(manager):

        async def sample():
            while True:
                found = await manager.allocations(boss)
                held.append(sum(1 for a in found["allocations"] if a["holder_kind"] == "job"))
                await asyncio.sleep(0.01)

        sampler = asyncio.ensure_future(sample())
        started = time.monotonic()
        _status, sweep = await manager.sweeps.create(
            alice,
            {
                "job": {"notebook": notebook("train()"), "resources": {"gpus": 1}, "parameters": {"steps": args.steps}},
                "sweep": ["lr=loguniform(1e-4,1e-1)", "batch=choice(32,64)"],
                "objective": "val_loss:min",
                "trials": args.trials,
                "parallel": args.parallel,
                "scheduler": "asha",
                "sampler": "random",
                "seed": args.seed,
                "min_resource": 1,
                "reduction_factor": args.eta,
            },
        )
        while (view := await manager.sweeps.view(boss, sweep["id"]))["state"] == "running":
            await asyncio.sleep(0.1)
        seconds = time.monotonic() - started
        sampler.cancel()
    full = [curve(t["params"], args.steps) for t in view["trials"]]
    return {
        "view": view,
        "seconds": seconds,
        "steps_run": backend.steps_run,
        "steps_full": len(full) * args.steps,
        "best_full": min(full),
        "held_ledger": max(held or [0]),
        "held_log": most_at_once(backend.events),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--steps", type=int, default=27, help="steps of a trial run to the end")
    parser.add_argument("--eta", type=int, default=3, help="ASHA's reduction factor")
    parser.add_argument("--quota", type=int, default=2, help="the team's GPUs (one per trial)")
    parser.add_argument("--parallel", type=int, default=4, help="trials under way at once (queued beyond quota)")
    parser.add_argument("--pace", type=float, default=0.1, help="seconds per trial-step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = asyncio.run(run(args))
    view = out["view"]
    counts = view["counts"]
    steps = out["steps_run"] / out["steps_full"]
    found = view["best"]["value"] if view["best"] else float("inf")
    ratio = found / out["best_full"]
    quota_ok = max(out["held_ledger"], out["held_log"]) <= args.quota
    print(
        f"sweep {view['state']}: {len(view['trials'])} trials in {out['seconds']:.1f} s: "
        f"{counts['complete']} complete, {counts['pruned']} pruned, {counts['failed']} failed"
    )
    print(f"trial-steps      {out['steps_run']:>6} of {out['steps_full']} run to the end = {steps:.1%} (target <= 30%)")
    judged = sum(t["step"] or 0 for t in view["trials"])
    print(f"                 of which {out['steps_run'] - judged} were run after the step their pruning was decided at")
    print(
        f"best val_loss    {found:.4f} vs {out['best_full']:.4f} of the best run to the end = x{ratio:.3f} "
        "(target <= x1.05)"
    )
    print(f"GPUs held at once  ledger {out['held_ledger']}, runner log {out['held_log']} (quota {args.quota})")
    return 0 if steps <= 0.30 and ratio <= 1.05 and quota_ok and view["state"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
