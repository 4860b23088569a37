"""Submit-to-end latency of a trivial job: Danlu's jobs API against plain papermill.

What is measured, in one run, interleaved round by round on the same machine:

* **danlu**: a one-cell notebook (``x = 1 + 1``) submitted to a real workbench
  (``danlu up`` started by :class:`danlu.hub.testing.Workbench`) with
  ``POST /jobs``; the clock stops when the job reads ``succeeded``. The job is
  followed with ``GET /jobs/{id}/logs?follow=true`` (the stream ends when the
  job ends), then read once with ``GET /jobs/{id}``. This is what
  ``%%train --wait`` does, and it includes everything a job costs: admission,
  the runner, the MLflow run, artifacts and the final status.
* **papermill**: the same notebook run by the ``papermill`` CLI as a
  subprocess, on the ``python3`` kernel: the baseline a notebook user would
  otherwise reach for.

The target is median(danlu) / median(papermill) <= 1.5. The workbench keeps
warm runners (a runner process with a started kernel) and refills its pool
after each job, so every round starts with a pause long enough for the pool to
be refilled (``--settle``); both tools get the same pause. One warm-up round of
each is run and not counted (the first Danlu job of a kernel starts cold and
fills the pool).

Run: ``.venv/bin/python benchmarks/submit_latency.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

from danlu.hub.testing import Workbench

TARGET = 1.5
USER = "bench"
#: one profile on the workbench's own Python: no virtual environment to build at start-up
PROFILES = {"profiles": [{"slug": "python", "display_name": "Python (workbench environment)", "default": True,
                          "environment": {"current": True}}]}


def trivial_notebook() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells.append(nbformat.v4.new_code_cell("x = 1 + 1"))
    return nb


def time_danlu(wb: Workbench, token: str, nb: nbformat.NotebookNode) -> tuple[float, str]:
    """(seconds from POST /jobs until GET /jobs/{id} reads succeeded, job id)."""
    body = {"notebook": json.loads(nbformat.writes(nb)), "parameters": {}, "resources": {"nproc": 1, "gpus": 0}}
    start = time.perf_counter()
    r = wb.api("POST", "/jobs", token=token, json=body)
    r.raise_for_status()
    job_id = r.json()["id"]
    with wb.api("GET", f"/jobs/{job_id}/logs", token=token, params={"follow": "true"}, stream=True,
                timeout=600) as logs:
        logs.raise_for_status()
        for _chunk in logs.iter_content(chunk_size=None):
            pass  # the stream ends when the job ends
    job = wb.api("GET", f"/jobs/{job_id}", token=token).json()
    elapsed = time.perf_counter() - start
    if job["state"] != "succeeded":
        log = wb.api("GET", f"/jobs/{job_id}/logs", token=token).text
        raise RuntimeError(f"job {job_id} {job['state']}: {job.get('reason')}\n{log[-3000:]}")
    return elapsed, job_id


def runner_kind(wb: Workbench, token: str, job_id: str) -> str:
    """'warm' or 'cold': which runner the job got."""
    return wb.api("GET", f"/jobs/{job_id}", token=token).json()["runner"]


def time_papermill(papermill: Path, notebook: Path, output: Path) -> float:
    """Seconds for ``papermill IN OUT -k python3`` as a subprocess."""
    start = time.perf_counter()
    done = subprocess.run([str(papermill), str(notebook), str(output), "-k", "python3"], capture_output=True,
                          text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"papermill exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed


def report(samples: dict[str, list[float]], settle: float) -> bool:
    print()
    print(f"{'':<10}{'median':>9}{'min':>9}{'max':>9}   (seconds, {len(samples['danlu'])} rounds)")
    for name, values in samples.items():
        print(f"{name:<10}{statistics.median(values):>9.2f}{min(values):>9.2f}{max(values):>9.2f}")
    ratio = statistics.median(samples["danlu"]) / statistics.median(samples["papermill"])
    ok = ratio <= TARGET
    print(f"\nmedian(danlu) / median(papermill) = {ratio:.2f}   target <= {TARGET}: {'met' if ok else 'NOT met'}")
    print(f"Each round began after a {settle:g} s pause (both tools) so the workbench's warm-runner pool "
          "was refilled; one warm-up round of each was not counted.")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds of each (default 5)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="pause before each round, for the warm-runner pool to refill (default 10 s)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    papermill = Path(sys.executable).parent / "papermill"

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"note: this machine is busy (load {load:.1f} on {cores} cores): expect noisy times", flush=True)
    with tempfile.TemporaryDirectory(prefix="danlu-bench-") as tmp:
        tmp = Path(tmp)
        notebook = tmp / "trivial.ipynb"
        nbformat.write(trivial_notebook(), str(notebook))
        nb = trivial_notebook()
        wb = Workbench(tmp / "workbench", profiles=PROFILES)
        try:
            print("starting a workbench (danlu up) ...", flush=True)
            wb.start()
            token = wb.create_user(USER)
            samples: dict[str, list[float]] = {"danlu": [], "papermill": []}
            for round_ in range(args.rounds + 1):
                label = "warm-up" if round_ == 0 else f"round {round_}/{args.rounds}"
                time.sleep(args.settle)
                danlu, job_id = time_danlu(wb, token, nb)
                time.sleep(args.settle)
                pm = time_papermill(papermill, notebook, tmp / f"out-{round_}.ipynb")
                print(f"{label:<12} danlu {danlu:6.2f} s ({runner_kind(wb, token, job_id)} runner)   "
                      f"papermill {pm:6.2f} s", flush=True)
                if round_ > 0:
                    samples["danlu"].append(danlu)
                    samples["papermill"].append(pm)
        except Exception:
            print(wb.log_tail(40), file=sys.stderr)
            raise
        finally:
            wb.stop()
    report(samples, args.settle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
