"""What Danlu's auto-logging costs a training loop, against plain TensorBoard logging.

The loop: ``--steps`` (20,000) steps of a tiny model (a 16->1 linear layer on a
batch of 64: forward, backward, SGD step), each logging its loss with
``torch.utils.tensorboard.SummaryWriter.add_scalar``. It runs in two variants:

* **plain**: ``SummaryWriter(log_dir=...)``, nothing else: what the same code
  costs outside Danlu.
* **danlu**: auto-logging active the way a job's kernel has it:
  ``danlu.autolog.activate()`` with ``DANLU_JOB_DIR`` and ``RANK=0`` set before
  TensorBoard is imported (so ``SummaryWriter()`` writes into the job dir with
  a 2 s flush interval), while a :class:`danlu.events.MetricForwarder` (the job
  runner's part, here in this parent process) tails that job dir and sends the
  scalars to a real MLflow run on a local ``mlflow server`` (SQLite), as it
  does for a job.

Each run is a fresh subprocess (so the SummaryWriter patch of one variant
cannot leak into the other), the variants alternate in order across
``--reps`` repetitions, and the time measured is the loop's, from creating the
writer to closing it (interpreter start and imports excluded, the same in
both). The target is median(danlu) / median(plain) <= 1.10. At the end every
danlu run's MLflow metric history is counted: it must hold one point per step.

Run: ``.venv/bin/python benchmarks/logging_overhead.py [--reps 5] [--steps 20000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from danlu import env

TARGET = 1.10
METRIC = "loss"


# the measured loop (runs in a child process) ------------------------------------------
def child(variant: str, steps: int, logdir: str | None) -> None:
    import torch

    if variant == "danlu":
        import danlu.autolog

        danlu.autolog.activate()  # before TensorBoard is imported, as in a job's kernel
    from torch.utils.tensorboard import SummaryWriter

    assert getattr(SummaryWriter, "_danlu_patched", False) == (variant == "danlu"), "wrong SummaryWriter"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 16)
    y = x.sum(1, keepdim=True)

    start, cpu_start = time.perf_counter(), time.process_time()
    writer = SummaryWriter() if variant == "danlu" else SummaryWriter(log_dir=logdir)
    for step in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        writer.add_scalar(METRIC, loss.item(), step)
    writer.close()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu}))


# the harness -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
           "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}"]
    log = open(folder / "mlflow.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited ({proc.returncode}); see {folder / 'mlflow.log'}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    stop_process_group(proc)
    raise RuntimeError("mlflow server did not answer within 180 s")


def stop_process_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def run_child(variant: str, steps: int, env: dict, logdir: Path | None = None) -> dict:
    """Run the loop in a fresh interpreter; returns {'seconds', 'cpu_seconds'} of the loop."""
    cmd = [sys.executable, __file__, "--child", variant, "--steps", str(steps)]
    if logdir is not None:
        cmd += ["--logdir", str(logdir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_plain(steps: int, folder: Path, base_env: dict) -> dict:
    return run_child("plain", steps, base_env, logdir=folder)


def run_danlu(steps: int, folder: Path, base_env: dict, client, experiment_id: str) -> tuple[dict, str, float]:
    """(the loop's times, MLflow run id, seconds the forwarder needed after the loop to send the rest)."""
    from danlu.events import MetricForwarder
    from danlu.jobdir import JobDir

    jd = JobDir(folder)
    jd.tensorboard_dir.mkdir(parents=True, exist_ok=True)
    run_id = client.create_run(experiment_id, run_name=folder.name).info.run_id
    forwarder = MetricForwarder(client, run_id, jd.logdirs_file, [jd.tensorboard_dir / "rank-0"]).start()
    try:
        result = run_child("danlu", steps, {**base_env, env.JOB_DIR: str(jd.path), "RANK": "0"})
    finally:
        drain_start = time.perf_counter()
        forwarder.stop()
        drain = time.perf_counter() - drain_start
    client.set_terminated(run_id)
    return result, run_id, drain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each variant (default 5)")
    parser.add_argument("--steps", type=int, default=20_000, help="training steps, one scalar each (default 20000)")
    parser.add_argument("--child", choices=["plain", "danlu"], help=argparse.SUPPRESS)
    parser.add_argument("--logdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.steps, args.logdir)
        return 0
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be at least 1")

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    from mlflow import MlflowClient

    # one thread for torch, as torchrun gives each rank; the same for both variants
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in (env.JOB_DIR, "RANK", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
        base_env.pop(key, None)
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"note: this machine is busy (load {load:.1f} on {cores} cores): expect noisy times", flush=True)
    with tempfile.TemporaryDirectory(prefix="danlu-logging-") as tmp:
        tmp = Path(tmp)
        print("starting an MLflow tracking server ...", flush=True)
        mlflow, url = start_mlflow(tmp)
        try:
            client = MlflowClient(tracking_uri=url)
            experiment_id = client.create_experiment("logging-overhead")
            times: dict[str, list[float]] = {"plain": [], "danlu": []}
            cpu: dict[str, list[float]] = {"plain": [], "danlu": []}
            runs, drains = [], []
            for rep in range(1, args.reps + 1):
                order = ["plain", "danlu"] if rep % 2 else ["danlu", "plain"]
                line = []
                for variant in order:
                    folder = tmp / f"{variant}-{rep}"
                    if variant == "plain":
                        result = run_plain(args.steps, folder, base_env)
                    else:
                        result, run_id, drain = run_danlu(args.steps, folder, base_env, client, experiment_id)
                        runs.append(run_id)
                        drains.append(drain)
                    times[variant].append(result["seconds"])
                    cpu[variant].append(result["cpu_seconds"])
                    line.append(f"{variant} {result['seconds']:6.2f} s")
                print(f"rep {rep}/{args.reps}   " + "   ".join(line), flush=True)
            counts = [len(client.get_metric_history(run_id, METRIC)) for run_id in runs]
        finally:
            stop_process_group(mlflow)

    print()
    print(f"{'':<8}{'median':>9}{'min':>9}{'max':>9}   (seconds for {args.steps} steps, {args.reps} runs each)")
    for variant, values in times.items():
        print(f"{variant:<8}{statistics.median(values):>9.2f}{min(values):>9.2f}{max(values):>9.2f}")
    ratio = statistics.median(times["danlu"]) / statistics.median(times["plain"])
    print(f"\nslowdown median(danlu) / median(plain) = {ratio:.3f}   target <= {TARGET}: "
          f"{'met' if ratio <= TARGET else 'NOT met'}")
    cpu_ratio = statistics.median(cpu["danlu"]) / statistics.median(cpu["plain"])
    print(f"(CPU time of the loop's own process, less sensitive to other load: ratio {cpu_ratio:.3f}; "
          "the forwarder's CPU is in another process and shows only in the wall time)")
    print(f"after each danlu loop the forwarder sent the rest in {statistics.median(drains):.2f} s (median)")
    complete = all(count == args.steps for count in counts)
    print(f"MLflow '{METRIC}' points per danlu run: {counts} (expected {args.steps} each): "
          f"{'complete' if complete else 'MISSING POINTS'}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
