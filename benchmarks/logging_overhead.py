"""What Danlu's auto-logging costs a training loop: against no logging at all, and against plain TensorBoard.

Two cases (``--case light|heavy|all``, default ``light``):

* **light**: 20,000 steps of a tiny model (a 16->1 linear layer on a batch of
  64: forward, backward, SGD step; about 0.1 ms a step on an idle core), one
  scalar a step (the loss). Target: danlu / plain <= 1.10.
* **heavy**: 10,000 steps of a small classifier (an MLP 128->384->384->100
  classes on a batch of 64 from a fixed synthetic set of 4,096 samples, AdamW;
  about 2.5 ms a step on one core; the figure printed is this machine's).
  Each step also keeps a running loss per class (an exponential average, on
  the tensor) and logs all 100 of them, ``loss/class_00`` .. ``loss/class_99``,
  plus a histogram of the first layer's weights every 100 steps: 1,000,000
  points and 100 histograms. Target (the product's goal: auto-logging costs
  under 5% of a training loop): danlu / none <= 1.05.

Each case runs three variants of the same loop:

* **none**: no writer. The loop computes the same values (the per-class
  averages are part of its step); it only does not log them. This is the
  baseline of the goal: the loop with no logging, so the logging code a user
  writes is on the logging side of the ratio too: in the heavy case the
  ``.tolist()`` of the averages, the loop over the 100 tags and the call to
  ``add_scalar`` itself (with a writer that does nothing, about 30 us of a
  3 ms step, 1.2%), and torch's ``add_histogram`` (about 1.3 ms each 100
  steps, 0.4%), which plain TensorBoard pays as well.
* **plain**: ``SummaryWriter(log_dir=...)`` outside Danlu: what TensorBoard's
  own writer costs (``.tolist()``/``.item()`` and ``add_scalar``/
  ``add_histogram`` calls included).
* **danlu**: auto-logging as a job's kernel has it: ``danlu.autolog.activate()``
  with ``DANLU_JOB_DIR`` and ``RANK=0`` before TensorBoard is imported (so
  ``SummaryWriter()`` writes into the job dir through :mod:`danlu.tensorboard.writer`
  with a 2 s flush interval), while a :class:`danlu.tensorboard.forwarder.MetricForwarder`
  (the job runner's part, here in this parent process) tails that dir and sends
  the scalars to a real MLflow run on a local ``mlflow server`` (SQLite), as it
  does for a job.

Each run is a fresh subprocess, started after a sync and a pause (:func:`settle`);
the variants rotate in order across ``--reps`` repetitions and the ratios are
of medians. The time measured is the
loop's, from creating the writer to closing it (interpreter start and imports
excluded). In a deployment MLflow is a service on another machine; here it
shares the 2 cores, so while a loop runs its server is reniced to +19, its
autogroup too (back to 0 for the drain, where permitted). The CPU time of the loop's own process is
printed too: it leaves out everything outside that process (the forwarder,
MLflow, other work on the machine).

After each danlu loop the forwarder's final flush is timed (the drain: what
was left to send when the loop ended), with the rate MLflow itself takes
batches at (measured once, before the runs), and MLflow's store is checked to
hold every point: each tag with every step, once. For the last repetition the
event files are read with TensorBoard's own reader (which checks every CRC):
danlu's must hold the same scalars and histograms as plain TensorBoard's, and
MLflow exactly the same scalars. Histograms are not sent to MLflow (the
forwarder sends scalars only); they stay in the job's TensorBoard files.

Run: ``.venv/bin/python benchmarks/logging_overhead.py [--case light|heavy|all] [--reps N]``.
The light case takes about 3 minutes on 2 busy cores; the heavy one much
longer (10,000 steps three ways, and MLflow taking 1,000,000 points per
danlu run: about 20 minutes with 3 repetitions). Every child process and every
drain has a time limit, so it ends by itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from danlu import env

VARIANTS = ("none", "plain", "danlu")
CHILD_TIMEOUT = 1800  # seconds a loop may take
DRAIN_TIMEOUT = 60.0  # the forwarder's final_timeout: seconds with nothing accepted before it gives up
SERVER_NICE = 19  # while a loop runs: MLflow is on another machine in a deployment
SETTLE_SECONDS = 3.0  # the pause before each loop, after a sync


@dataclass(frozen=True)
class Case:
    name: str
    steps: int
    tags: tuple[str, ...]
    histogram_every: int  # 0: none
    baseline: str  # the variant the target compares danlu with
    target: float
    reps: int


CASES = {
    "light": Case("light", 20_000, ("loss",), 0, "plain", 1.10, 5),
    "heavy": Case("heavy", 10_000, tuple(f"loss/class_{c:02d}" for c in range(100)), 100, "none", 1.05, 3),
}


# the measured loops (run in a child process) ----------------------------------------------
def child(variant: str, case: Case, steps: int, logdir: str | None) -> None:
    import torch

    if variant == "danlu":
        import danlu.autolog

        danlu.autolog.activate()  # before TensorBoard is imported, as in a job's kernel
    writer = None
    if variant != "none":
        from torch.utils.tensorboard import SummaryWriter

        assert getattr(SummaryWriter, "_danlu_patched", False) == (variant == "danlu"), "wrong SummaryWriter"
    torch.manual_seed(0)
    loop = light_loop if case.name == "light" else heavy_loop
    step_fn, log_fn = loop(torch, case)

    start, cpu_start = time.perf_counter(), time.process_time()
    if variant != "none":
        writer = SummaryWriter() if variant == "danlu" else SummaryWriter(log_dir=logdir)
    for step in range(steps):
        values = step_fn(step)
        if writer is not None:
            log_fn(writer, values, step)
    if writer is not None:
        writer.close()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"seconds": elapsed, "cpu_seconds": cpu}))


def light_loop(torch, case: Case):
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 16)
    y = x.sum(1, keepdim=True)
    (tag,) = case.tags

    def step_fn(step):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def log_fn(writer, loss, step):
        writer.add_scalar(tag, loss.item(), step)

    return step_fn, log_fn


def heavy_loop(torch, case: Case):
    classes, batch = len(case.tags), 64
    nn = torch.nn
    model = nn.Sequential(nn.Linear(128, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, classes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = torch.randn(4096, 128)
    labels = (data[:, :8].sum(1) * 20).long() % classes  # learnable labels
    state = {"ema": torch.zeros(classes)}
    first_layer = model[0].weight
    tags, every = case.tags, case.histogram_every

    def step_fn(step):
        i = (step * batch) % len(data)
        x, y = data[i : i + batch], labels[i : i + batch]
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = per_sample.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():  # a running loss per class, kept on the tensor
            sums = torch.zeros(classes).index_add_(0, y, per_sample)
            counts = torch.bincount(y, minlength=classes)
            ema = state["ema"]
            state["ema"] = torch.where(counts > 0, 0.9 * ema + 0.1 * sums / counts.clamp(min=1), ema)
        return state["ema"]

    def log_fn(writer, ema, step):
        for tag, value in zip(tags, ema.tolist(), strict=True):
            writer.add_scalar(tag, value, step)
        if every and step % every == 0:
            writer.add_histogram("weights/layer0", first_layer, step)

    return step_fn, log_fn


# MLflow ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # MLflow as danlu up runs it: one process, without its job-execution workers (danlu.hub.mlflowserver)
    cmd = [
        sys.executable,
        "-m",
        "danlu.hub.mlflowserver",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--allowed-hosts",
        f"127.0.0.1:{port},localhost:{port}",
    ]
    log = open(folder / "mlflow.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
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


def renice_group(proc: subprocess.Popen, niceness: int) -> bool:
    """Set the niceness of the server's processes; False where not permitted (lowering it needs privilege).

    With the kernel's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``)
    the CPU is shared between sessions first: the server, in a session of its
    own, would take its session's full share whatever its processes' niceness,
    so the niceness of its autogroup is set too.
    """
    try:
        pids = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in pids or [str(proc.pid)]:
            os.setpriority(os.PRIO_PROCESS, int(pid), niceness)
        autogroup = Path(f"/proc/{proc.pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(niceness))
        return True
    except (OSError, ValueError):
        return False


def mlflow_rate(client, experiment_id: str, batches: int = 8) -> float:
    """Points a second MLflow takes, from a client doing nothing else (full log_batch requests, back to back)."""
    from mlflow.entities import Metric

    run_id = client.create_run(experiment_id, run_name="mlflow-alone").info.run_id
    now = int(time.time() * 1000)
    metrics = [[Metric(f"m{i % 100:02d}", 0.5, now, b * 10 + i // 100) for i in range(1000)] for b in range(batches)]
    client.log_batch(run_id, metrics=metrics[0], synchronous=True)  # warm
    start = time.perf_counter()
    for batch in metrics[1:]:
        client.log_batch(run_id, metrics=batch, synchronous=True)
    return 1000 * (batches - 1) / (time.perf_counter() - start)


def stored_points(db: Path, run_id: str) -> dict[str, tuple[int, int, int, int]]:
    """Per key in MLflow's store: (rows, distinct steps, first step, last step)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute(
            "SELECT key, COUNT(*), COUNT(DISTINCT step), MIN(step), MAX(step) FROM metrics "
            "WHERE run_uuid = ? GROUP BY key",
            (run_id,),
        ).fetchall()
    return {key: (n, distinct, first, last) for key, n, distinct, first, last in rows}


def stored_values(db: Path, run_id: str) -> list[tuple[str, int, float]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute(
            "SELECT key, step, CASE WHEN is_nan THEN 'nan' ELSE value END FROM metrics "
            "WHERE run_uuid = ? ORDER BY key, step",
            (run_id,),
        ).fetchall()


# the files, read by TensorBoard ------------------------------------------------------------
def tensorboard_contents(folder: Path) -> tuple[list[tuple[str, int, float]], list[tuple[int, bytes]]]:
    """(scalars as (tag, step, value), histograms as (step, bytes)) of every event file under folder."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto import event_pb2

    scalars, histograms = [], []
    for path in sorted(folder.rglob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():  # raises on a bad CRC
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.append((value.tag, event.step, value.simple_value))
                elif value.HasField("histo"):
                    histograms.append((event.step, value.histo.SerializeToString()))
    return scalars, histograms


def same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


# the harness -------------------------------------------------------------------------------
def settle(seconds: float = SETTLE_SECONDS) -> None:
    """Start each loop on a settled machine: the previous run's files written back, then a pause.

    The variants rotate in a fixed cycle, so each follows the same one: danlu follows plain, whose heavy
    loop leaves its event files' dirty pages to be written back while the next loop runs. Without this,
    one run on 2 cores took danlu's heavy loop 30.9 s in both repetitions where it followed plain, and
    27.5 s in the one where it ran first (none: 25.9 to 27.3 s).
    """
    os.sync()
    time.sleep(seconds)


def run_child(variant: str, case: Case, steps: int, child_env: dict, logdir: Path | None = None) -> dict:
    """Run the loop in a fresh interpreter; returns {'seconds', 'cpu_seconds'} of the loop."""
    cmd = [sys.executable, __file__, "--child", variant, "--case", case.name, "--steps", str(steps)]
    if logdir is not None:
        cmd += ["--logdir", str(logdir)]
    done = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Harness:
    def __init__(self, tmp: Path, steps_override: int | None):
        self.tmp = tmp
        self.steps_override = steps_override
        # one thread for torch, as torchrun gives each rank; the same for every variant
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for key in (env.JOB_DIR, "RANK", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"):
            self.env.pop(key, None)
        print("starting an MLflow tracking server ...", flush=True)
        self.server, url = start_mlflow(tmp)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=url)
        self.experiment_id = self.client.create_experiment("logging-overhead")
        self.rate = mlflow_rate(self.client, self.experiment_id)
        self.reniced = renice_group(self.server, SERVER_NICE)
        print(
            f"MLflow alone takes {self.rate:,.0f} points/s here (1000-point batches, back to back)"
            + ("" if self.reniced else "; its niceness cannot be changed here"),
            flush=True,
        )

    def close(self) -> None:
        stop_process_group(self.server)

    def run_danlu(self, case: Case, steps: int, folder: Path) -> tuple[dict, dict]:
        """The loop's times, and what forwarding it took: run id, points sent during the loop, drain seconds."""
        from danlu.jobdir import JobDir
        from danlu.tensorboard.forwarder import MetricForwarder

        jd = JobDir(folder)
        jd.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        run_id = self.client.create_run(self.experiment_id, run_name=folder.name).info.run_id
        forwarder = MetricForwarder(
            self.client, run_id, jd.logdirs_file, [jd.tensorboard_dir / "rank-0"], final_timeout=DRAIN_TIMEOUT
        ).start()
        try:
            result = run_child("danlu", case, steps, {**self.env, env.JOB_DIR: str(jd.path), "RANK": "0"})
        finally:
            during = forwarder.sent
            if self.reniced:
                renice_group(self.server, 0)  # the drain: MLflow at its own priority
            drain_start = time.perf_counter()
            total = forwarder.stop()
            drain = time.perf_counter() - drain_start
            if self.reniced:
                renice_group(self.server, SERVER_NICE)
        self.client.set_terminated(run_id)
        health = forwarder.health()
        return result, {
            "run_id": run_id,
            "during": during,
            "after": total - during,
            "drain": drain,
            "dropped": health["points_dropped"],
            "notes": health["notes"],
        }

    def run_case(self, case: Case, reps: int) -> bool:
        steps = self.steps_override or case.steps
        expected = {tag: (steps, steps, 0, steps - 1) for tag in case.tags}
        times = {v: [] for v in VARIANTS}
        cpu = {v: [] for v in VARIANTS}
        forwarding, complete = [], True
        print(
            f"\n== {case.name}: {steps} steps, {len(case.tags)} scalar(s) a step"
            + (f", a histogram every {case.histogram_every} steps" if case.histogram_every else "")
            + f", {reps} repetitions ==",
            flush=True,
        )
        for rep in range(1, reps + 1):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            line, folders = [], {}
            for variant in order:
                settle()
                folder = folders[variant] = self.tmp / f"{case.name}-{variant}-{rep}"
                if variant == "danlu":
                    result, fwd = self.run_danlu(case, steps, folder)
                    stored = stored_points(self.tmp / "mlflow.db", fwd["run_id"])
                    fwd["complete"] = stored == expected and fwd["dropped"] == 0
                    complete = complete and fwd["complete"]
                    forwarding.append(fwd)
                else:
                    result = run_child(variant, case, steps, self.env, folder if variant == "plain" else None)
                times[variant].append(result["seconds"])
                cpu[variant].append(result["cpu_seconds"])
                line.append(f"{variant} {result['seconds']:7.2f} s")
            fwd = forwarding[-1]
            print(
                f"rep {rep}/{reps}   "
                + "   ".join(line)
                + f"   | drain {fwd['drain']:6.1f} s, MLflow "
                + ("complete" if fwd["complete"] else "MISSING POINTS"),
                flush=True,
            )
            if rep == reps:
                complete = self.compare_files(folders, fwd["run_id"]) and complete
        report(case, steps, times, cpu, forwarding, self.rate)
        return complete

    def compare_files(self, folders: dict[str, Path], run_id: str) -> bool:
        """TensorBoard reads the same scalars and histograms from danlu's files as from plain TensorBoard's; MLflow
        holds the same scalars."""
        start = time.perf_counter()
        danlu_scalars, danlu_histograms = tensorboard_contents(folders["danlu"] / "tensorboard")
        plain_scalars, plain_histograms = tensorboard_contents(folders["plain"])
        same_files = len(danlu_scalars) == len(plain_scalars) and all(
            a[:2] == b[:2] and same_value(a[2], b[2]) for a, b in zip(danlu_scalars, plain_scalars, strict=True)
        )
        same_files = same_files and danlu_histograms == plain_histograms
        stored = stored_values(self.tmp / "mlflow.db", run_id)
        in_files = sorted((tag, step, value) for tag, step, value in danlu_scalars)
        same_mlflow = len(stored) == len(in_files) and all(
            (k, s) == (tag, step) and (v == "nan" and math.isnan(value) or v == value)
            for (k, s, v), (tag, step, value) in zip(stored, in_files, strict=True)
        )
        print(
            f"last repetition, read back with TensorBoard's reader ({time.perf_counter() - start:.0f} s): "
            f"danlu's event files vs plain TensorBoard's: {len(danlu_scalars):,} scalars, "
            f"{len(danlu_histograms)} histograms, {'identical' if same_files else 'DIFFERENT'}; "
            f"MLflow vs the files: {len(stored):,} points, {'identical' if same_mlflow else 'DIFFERENT'}",
            flush=True,
        )
        return same_files and same_mlflow


def report(case: Case, steps: int, times: dict, cpu: dict, forwarding: list[dict], rate: float) -> None:
    reps = len(times["none"])
    print(f"\n{'':<8}{'median':>9}{'min':>9}{'max':>9}   (seconds for {steps} steps, {reps} runs each)")
    for variant in VARIANTS:
        values = times[variant]
        print(f"{variant:<8}{statistics.median(values):>9.2f}{min(values):>9.2f}{max(values):>9.2f}")
    med = {v: statistics.median(times[v]) for v in VARIANTS}
    cpu_med = {v: statistics.median(cpu[v]) for v in VARIANTS}
    print(
        f"a step with no logging: {1000 * med['none'] / steps:.3f} ms (wall), "
        f"{1000 * cpu_med['none'] / steps:.3f} ms (CPU)"
    )
    for variant in ("plain", "danlu"):
        added, added_cpu = (1e6 * (m[variant] - m["none"]) / steps for m in (med, cpu_med))
        print(
            f"{variant} logging adds {added:.1f} us a step (wall; {added_cpu:.1f} us CPU of the loop's process): "
            f"under 5% of steps of {20 * max(added, added_cpu) / 1000:.2f} ms or more"
        )
    for variant, base in (("danlu", "none"), ("danlu", "plain"), ("plain", "none")):
        ratio, cpu_ratio = med[variant] / med[base], cpu_med[variant] / cpu_med[base]
        verdict = ""
        if (variant, base) == ("danlu", case.baseline):  # a busy machine can flatter one figure: both must pass
            met = ratio <= case.target and cpu_ratio <= case.target
            verdict = f"   target <= {case.target} (wall and CPU): {'met' if met else 'NOT met'}"
        print(
            f"median({variant}) / median({base}) = {ratio:.3f}   (CPU of the loop's process: {cpu_ratio:.3f}){verdict}"
        )
    if med["danlu"] < med["none"] or med["plain"] < med["none"]:
        print(
            "note: logging came out faster than no logging: the machine's load changed between runs, so the wall "
            "times say little here; the CPU figures are steadier"
        )
    drains = [f["drain"] for f in forwarding]
    after = statistics.median([f["after"] for f in forwarding])
    during = statistics.median([f["during"] for f in forwarding])
    print(
        f"forwarding: {during:,.0f} points sent while the loop ran, {after:,.0f} after it (medians); "
        f"the drain after the loop took {statistics.median(drains):.1f} s (median; max {max(drains):.1f}), "
        f"{after / max(statistics.median(drains), 1e-9):,.0f} points/s, MLflow alone {rate:,.0f} points/s"
    )
    counts = [
        f"{'complete' if f['complete'] else 'MISSING'} ({f['during'] + f['after']:,} sent, {f['dropped']} dropped)"
        for f in forwarding
    ]
    print(
        f"MLflow, per danlu run: every one of the {len(case.tags)} tags with all {steps} steps once: "
        + ", ".join(counts)
    )
    for f in forwarding:
        for note in f["notes"]:
            print(f"  forwarder note: {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case",
        choices=["light", "heavy", "all"],
        default="light",
        help="which loop to measure (default light; heavy takes much longer, see above)",
    )
    parser.add_argument("--reps", type=int, help="repetitions of each variant (default 5 light, 3 heavy)")
    parser.add_argument("--steps", type=int, help="training steps (default: the case's, 20000 light, 10000 heavy)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--logdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = [CASES["light"], CASES["heavy"]] if args.case == "all" else [CASES[args.case]]
    if args.child:
        child(args.child, cases[0], args.steps or cases[0].steps, args.logdir)
        return 0
    if (args.reps is not None and args.reps < 1) or (args.steps is not None and args.steps < 1):
        parser.error("--reps and --steps must be at least 1")

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"note: this machine is busy (load {load:.1f} on {cores} cores): expect noisy times", flush=True)
    ok = True
    with tempfile.TemporaryDirectory(prefix="danlu-logging-") as tmp:
        harness = Harness(Path(tmp), args.steps)
        try:
            for case in cases:
                ok = harness.run_case(case, args.reps or case.reps) and ok
        finally:
            harness.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
