"""Submit-to-end latency of a trivial job: Danlu's jobs API against papermill, jupyter-scheduler and plain Python.

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
* **jupyter-scheduler**: the peer a JupyterLab user would pick instead, 2.x,
  installed in a virtual environment of its own (``--peer-venv``, created on first
  use from PyPI, so its dependencies never touch the workbench's), as a Jupyter
  server extension: ``POST /scheduler/jobs`` on a running ``jupyter server``, the
  clock stopping when ``GET /scheduler/jobs/{id}`` reads ``COMPLETED``. ``--no-peer``
  leaves it out.
* **python**: ``python -c "x = 1 + 1"``, the floor: what the cell costs with
  nothing around it.

The goal is median(danlu) / median(papermill) <= 0.3. The workbench keeps a
warm runner (a runner process with a started kernel) and refills it after each
job, so every round starts with a pause long enough for that (``--settle``);
every tool gets the same pause. One warm-up round of each is run and not
counted (the first Danlu job of a kernel starts cold and fills the pool).

Run: ``.venv/bin/python benchmarks/submit_latency.py [--rounds 7] [--no-peer]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import requests

from danlu.hub.testing import CURRENT_PYTHON_PROFILES as PROFILES
from danlu.hub.testing import Workbench, free_port

TARGET = 0.3
PEER_REQUIREMENT = "jupyter-scheduler>=2,<3"
ROOT = Path(__file__).resolve().parents[1]
USER = "bench"
#: one profile on the workbench's own Python: no virtual environment to build at start-up


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
    with wb.api(
        "GET", f"/jobs/{job_id}/logs", token=token, params={"follow": "true"}, stream=True, timeout=600
    ) as logs:
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
    done = subprocess.run([str(papermill), str(notebook), str(output), "-k", "python3"], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"papermill exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed


def time_python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


class JupyterScheduler:
    """jupyter-scheduler 2.x in its own virtual environment: a ``jupyter server`` with its extension."""

    def __init__(self, venv: Path, root: Path):
        self.venv = venv
        self.root = root
        self.port = free_port()
        self.token = os.urandom(16).hex()
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def ensure(venv: Path) -> None:
        if (venv / "bin" / "jupyter-server").exists() and (venv / ".danlu-bench-ready").exists():
            return
        print(f"installing {PEER_REQUIREMENT} and ipykernel into {venv} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", PEER_REQUIREMENT, "ipykernel"], check=True
        )
        (venv / ".danlu-bench-ready").touch()

    def start(self) -> None:
        cmd = [
            str(self.venv / "bin" / "jupyter-server"),
            "--no-browser",
            f"--port={self.port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
        ]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "JUPYTER_PATH")}
        env["JUPYTER_DATA_DIR"] = str(self.root / ".jupyter-data")  # its database and staging area
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.root / "jupyter-server.log", "wb"),
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited with {self.proc.returncode}: see {self.root}")
            try:
                if requests.get(f"{self.url}/api/status", headers=self.headers, timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError("jupyter server (jupyter-scheduler) did not start in 180 s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"token {self.token}"}

    def time_job(self, notebook: str, name: str) -> float:
        start = time.perf_counter()
        r = requests.post(
            f"{self.url}/scheduler/jobs",
            headers=self.headers,
            timeout=60,
            json={
                "input_uri": notebook,
                "runtime_environment_name": "python3",
                "name": name,
                "output_formats": ["ipynb"],
            },
        )
        r.raise_for_status()
        job_id = r.json()["job_id"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            job = requests.get(f"{self.url}/scheduler/jobs/{job_id}", headers=self.headers, timeout=60).json()
            if job["status"] == "COMPLETED":
                return time.perf_counter() - start
            if job["status"] == "FAILED":
                raise RuntimeError(f"jupyter-scheduler job failed: {job.get('status_message')}")
            time.sleep(0.05)  # its status starts as STOPPED until the job's process says IN_PROGRESS
        raise RuntimeError(f"jupyter-scheduler job {job_id} did not complete in 300 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def report(samples: dict[str, list[float]], settle: float) -> bool:
    print()
    rounds = len(samples["danlu"])
    print(f"{'':<18}{'median':>9}{'min':>9}{'max':>9}   (seconds, {rounds} rounds)")
    for name, values in samples.items():
        print(f"{name:<18}{statistics.median(values):>9.2f}{min(values):>9.2f}{max(values):>9.2f}")
    medians = {name: statistics.median(values) for name, values in samples.items()}
    ratio = medians["danlu"] / medians["papermill"]
    ok = ratio <= TARGET
    print(f"\nmedian(danlu) / median(papermill) = {ratio:.2f}   goal <= {TARGET}: {'met' if ok else 'NOT met'}")
    if "jupyter-scheduler" in medians:
        print(f"median(danlu) / median(jupyter-scheduler) = {medians['danlu'] / medians['jupyter-scheduler']:.2f}")
    print(
        f"median(danlu) - median(python) = {medians['danlu'] - medians['python']:.2f} s (what Danlu adds to the "
        "cell itself)"
    )
    print(
        f"Each round began after a {settle:g} s pause (every tool) so the workbench's warm runner "
        "was refilled; one warm-up round of each was not counted."
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds of each (default 7)")
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="pause before each tool's turn, for the warm runner to refill (default 10 s)",
    )
    parser.add_argument(
        "--peer-venv",
        type=Path,
        default=ROOT / ".venv-bench" / "jupyter-scheduler",
        help="the virtual environment of jupyter-scheduler (created if missing)",
    )
    parser.add_argument("--no-peer", action="store_true", help="leave jupyter-scheduler out")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    papermill = Path(sys.executable).parent / "papermill"
    if not args.no_peer:
        JupyterScheduler.ensure(args.peer_venv)

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:
        print(f"note: this machine is busy (load {load:.1f} on {cores} cores): expect noisy times", flush=True)
    with tempfile.TemporaryDirectory(prefix="danlu-bench-") as tmp:
        tmp = Path(tmp)
        notebook = tmp / "trivial.ipynb"
        nbformat.write(trivial_notebook(), str(notebook))
        nb = trivial_notebook()
        wb = Workbench(tmp / "workbench", profiles=PROFILES)
        peer = None if args.no_peer else JupyterScheduler(args.peer_venv, tmp)
        try:
            print(
                "starting a workbench (danlu up)" + ("" if peer is None else " and jupyter-scheduler") + " ...",
                flush=True,
            )
            wb.start()
            if peer is not None:
                peer.start()
            token = wb.create_user(USER)
            samples: dict[str, list[float]] = {"danlu": [], "papermill": [], "python": []}
            if peer is not None:
                samples["jupyter-scheduler"] = []
            for round_ in range(args.rounds + 1):
                label = "warm-up" if round_ == 0 else f"round {round_}/{args.rounds}"
                time.sleep(args.settle)
                danlu, job_id = time_danlu(wb, token, nb)
                got = {"danlu": danlu}
                time.sleep(args.settle)
                got["papermill"] = time_papermill(papermill, notebook, tmp / f"out-{round_}.ipynb")
                if peer is not None:
                    time.sleep(args.settle)
                    got["jupyter-scheduler"] = peer.time_job(notebook.name, f"round-{round_}")
                got["python"] = time_python("x = 1 + 1")
                print(
                    f"{label:<12} danlu {danlu:6.2f} s ({runner_kind(wb, token, job_id)} runner)   "
                    + "   ".join(f"{name} {value:6.2f} s" for name, value in got.items() if name != "danlu"),
                    flush=True,
                )
                if round_ > 0:
                    for name, value in got.items():
                        samples[name].append(value)
        except Exception:
            print(wb.log_tail(40), file=sys.stderr)
            raise
        finally:
            if peer is not None:
                peer.stop()
            wb.stop()
    report(samples, args.settle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
