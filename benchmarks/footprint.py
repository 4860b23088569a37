"""Resident memory of the one-machine workbench, per component: idle, with users, and idle again.

What is measured, in one run, on loopback, with the baselines started in the same run:

* **baselines**: a bare JupyterHub with its proxy (``python -m jupyterhub``, dummy
  authenticator, nothing else) and ``mlflow server --workers 1`` as MLflow ships it (its
  launcher, its one uvicorn worker and whatever job-execution workers it starts), each
  started, left to settle and stopped before the workbench starts;
* **idle**: ``danlu up`` with the default configuration (the idle culler on), ``--settle``
  seconds after it says it is up, before anyone has logged in;
* **users**: ``--users`` users each start a server (the default profile) and run one trivial
  job through the jobs API; measured when the last job has succeeded;
* **idle users**: the same users' servers still running, after the warm runners had
  ``jobs.warm_idle_seconds`` (``--warm-idle``, short here) without a job: what an idle user
  costs beyond the idle stack.

For every phase the table lists each component's processes with their resident set (RSS,
what ``ps`` shows) and their proportional set (PSS: shared pages split between the processes
that share them, so the PSS column adds up to what the stack costs the machine). Components
are told apart by command line: ``danlu up`` itself, MLflow (and any of its children), the
hub, the proxy, the jobs service (which also runs the idle culler), the MLflow gateway, warm
runners and their kernels, job runners, and users' servers with their kernels.

Goals (the issue's): the whole stack idle <= 700 MB; each idle user costs only their own
server; warm runners are reaped after an idle time and capped (``jobs.warm_runners_max``,
``jobs.warm_runners_per_user``). Ratio lines compare the idle stack with the two baselines.

Run: ``.venv/bin/python benchmarks/footprint.py [--users 3] [--settle 15] [--warm-idle 20]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import psutil

from danlu.hub.testing import CURRENT_PYTHON_PROFILES as PROFILES
from danlu.hub.testing import Workbench, free_port

GOAL_IDLE_MB = 700.0
MB = 2**20
TRIVIAL = {
    "cells": [
        {"cell_type": "code", "id": "c1", "metadata": {}, "outputs": [], "execution_count": None, "source": "x = 1 + 1"}
    ],
    "metadata": {},
    "nbformat": 4,
    "nbformat_minor": 5,
}


# measuring ---------------------------------------------------------------------------------------------
def component(proc: psutil.Process, cmd: str) -> str:
    """The component a workbench process belongs to, by its command line (and its parent's for kernels)."""
    if "ipykernel" in cmd:
        try:
            parent = " ".join(proc.parent().cmdline())
        except (psutil.Error, AttributeError):
            parent = ""
        if "danlu.runner --warm" in parent:
            return "warm kernels"
        if "jupyterhub-singleuser" in parent:
            return "user servers' kernels"
        return "job kernels"
    for needle, name in (
        ("danlu.runner --warm", "warm runners"),
        ("danlu.runner", "job runners"),
        ("jupyterhub-singleuser", "user servers"),
        ("mlflow_gateway", "MLflow gateway"),
        ("danlu.hub.service", "jobs service (+ idle culler)"),
        ("idle_culler", "idle culler"),
        ("configurable-http-proxy", "proxy"),
        ("danlu.hub.hubmain", "JupyterHub"),
        ("-m jupyterhub", "JupyterHub"),
        ("mlflow", "MLflow"),
        ("uvicorn", "MLflow"),
        ("huey", "MLflow"),
        ("danlu.hub up", "danlu up (supervisor)"),
    ):
        if needle in cmd:
            return name
    return "other: " + cmd[:40]


def measure(procs: list[psutil.Process]) -> dict[str, dict]:
    """component -> {"n": processes, "rss": MB, "pss": MB}."""
    out: dict[str, dict] = defaultdict(lambda: {"n": 0, "rss": 0.0, "pss": 0.0})
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline())
            mem = proc.memory_full_info()
        except psutil.Error:
            continue
        row = out[component(proc, cmd)]
        row["n"] += 1
        row["rss"] += mem.rss / MB
        row["pss"] += mem.pss / MB
    return dict(out)


def total(rows: dict[str, dict], only=None) -> tuple[float, float]:
    picked = [r for name, r in rows.items() if only is None or name in only]
    return sum(r["rss"] for r in picked), sum(r["pss"] for r in picked)


def print_phase(title: str, rows: dict[str, dict]) -> None:
    print(f"\n{title}")
    print(f"  {'component':<32}{'procs':>6}{'RSS MB':>10}{'PSS MB':>10}")
    for name in sorted(rows, key=lambda n: -rows[n]["pss"]):
        r = rows[name]
        print(f"  {name:<32}{r['n']:>6}{r['rss']:>10.1f}{r['pss']:>10.1f}")
    rss, pss = total(rows)
    print(f"  {'total':<32}{sum(r['n'] for r in rows.values()):>6}{rss:>10.1f}{pss:>10.1f}")


def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def workbench_processes(wb: Workbench) -> list[psutil.Process]:
    return [psutil.Process(wb.proc.pid)] + wb.processes()


def wait_http(url: str, deadline: float, proc: subprocess.Popen, what: str) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer in {deadline:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    procs = tree(psutil.Process(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    gone, alive = psutil.wait_procs(procs, timeout=20)
    for p in alive:
        p.kill()


# baselines ---------------------------------------------------------------------------------------------
def bare_jupyterhub(tmp: Path, settle: float) -> dict[str, dict]:
    """A JupyterHub with only the dummy authenticator, and its proxy, as ``jupyterhub`` starts them."""
    folder = tmp / "bare-hub"
    folder.mkdir()
    port, hub_port, api_port = free_port(), free_port(), free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "CONFIGPROXY_AUTH_TOKEN": os.urandom(16).hex(),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyterhub",
        "--ip",
        "127.0.0.1",
        "--port",
        str(port),
        f"--JupyterHub.hub_port={hub_port}",
        "--JupyterHub.authenticator_class=dummy",
        f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{api_port}",
    ]
    proc = subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/hub/api/", 180, proc, "bare JupyterHub")
        time.sleep(settle)
        return measure(tree(psutil.Process(proc.pid)))
    finally:
        stop(proc)


def shipped_mlflow(tmp: Path, settle: float) -> dict[str, dict]:
    """``mlflow server --workers 1`` with SQLite, as MLflow's CLI starts it (launcher, worker, job execution)."""
    folder = tmp / "bare-mlflow"
    folder.mkdir()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        str(folder / "artifacts"),
    ]
    proc = subprocess.Popen(
        cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 180, proc, "mlflow server")
        time.sleep(settle)
        rows: dict[str, dict] = defaultdict(lambda: {"n": 0, "rss": 0.0, "pss": 0.0})
        for p in tree(psutil.Process(proc.pid)):
            cmd_line = " ".join(p.cmdline())
            name = (
                "worker (uvicorn)"
                if "uvicorn" in cmd_line
                else "job execution (huey, job runner)"
                if "huey" in cmd_line or "_job_runner" in cmd_line
                else "launcher (mlflow server)"
            )
            mem = p.memory_full_info()
            rows[name]["n"] += 1
            rows[name]["rss"] += mem.rss / MB
            rows[name]["pss"] += mem.pss / MB
        return dict(rows)
    finally:
        stop(proc)


# the workbench -----------------------------------------------------------------------------------------
def run_users(wb: Workbench, users: int) -> None:
    tokens = {f"user{i}": wb.create_user(f"user{i}") for i in range(users)}
    for name in tokens:
        r = wb.start_server(name, {"profile": "python"})
        if r.status_code not in (201, 202):
            raise RuntimeError(f"{name}'s server: {r.status_code} {r.text}")
    jobs = {}
    for name, token in tokens.items():
        r = wb.api("POST", "/jobs", token=token, json={"notebook": TRIVIAL, "name": "footprint"})
        r.raise_for_status()
        jobs[name] = r.json()["id"]
    for name, job_id in jobs.items():
        done = wb.wait_job(job_id, tokens[name], timeout=600)
        if done["state"] != "succeeded":
            raise RuntimeError(f"{name}'s job {job_id}: {done['state']} {done.get('reason')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=3, help="users who start a server and run a job (default 3)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds to let each phase settle (default 15)")
    parser.add_argument(
        "--warm-idle",
        type=float,
        default=20.0,
        help="jobs.warm_idle_seconds of the measured workbench (default 20; 600 by default)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    if not shutil.which(
        "configurable-http-proxy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    ):
        print("configurable-http-proxy is not installed: run make install", file=sys.stderr)
        return 2
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="danlu-footprint-") as tmp:
        tmp = Path(tmp)
        print("baselines: a bare JupyterHub with its proxy, and mlflow server as shipped ...", flush=True)
        figures["bare JupyterHub + proxy"] = hub = bare_jupyterhub(tmp, args.settle)
        print_phase("bare JupyterHub + proxy (baseline)", hub)
        figures["mlflow server as shipped"] = shipped = shipped_mlflow(tmp, args.settle)
        print_phase("mlflow server --workers 1 as shipped (baseline)", shipped)

        config = {
            "auth": {"type": "dummy"},
            "hub": {"idle_timeout_seconds": 3600},
            "jobs": {"warm_idle_seconds": args.warm_idle},
        }
        wb = Workbench(tmp / "workbench", config=config, profiles=PROFILES)
        print("\nstarting the workbench (danlu up, the default configuration) ...", flush=True)
        wb.start()
        try:
            time.sleep(args.settle)
            figures["idle"] = idle = measure(workbench_processes(wb))
            print_phase(f"danlu up, idle ({args.settle:g} s after start, nobody logged in)", idle)
            run_users(wb, args.users)
            time.sleep(2)
            figures["users"] = busy = measure(workbench_processes(wb))
            print_phase(f"{args.users} users, each with a server and one finished job", busy)
            time.sleep(args.warm_idle + args.settle)
            figures["idle users"] = after = measure(workbench_processes(wb))
            print_phase(
                f"the same {args.users} users' servers, {args.warm_idle + args.settle:g} s without a job", after
            )
        finally:
            wb.stop()

    idle_rss, idle_pss = total(idle)
    hub_rss, hub_pss = total(hub)
    worker_rss, worker_pss = total(shipped, {"worker (uvicorn)"})
    shipped_rss, shipped_pss = total(shipped)
    mlflow_rss, mlflow_pss = total(idle, {"MLflow"})
    servers = {"user servers", "user servers' kernels"}
    per_user_rss = (total(after)[0] - idle_rss) / max(1, args.users)
    server_rss = total(after, servers)[0] / max(1, args.users)
    warm_left = total(after, {"warm runners", "warm kernels"})[0]
    print("\nsummary (RSS MB; PSS in brackets)")
    print(
        f"  idle stack: {idle_rss:.0f} [{idle_pss:.0f}]   goal <= {GOAL_IDLE_MB:.0f}: "
        f"{'met' if idle_rss <= GOAL_IDLE_MB else 'NOT met'} (RSS), "
        f"{'met' if idle_pss <= GOAL_IDLE_MB else 'NOT met'} (PSS)"
    )
    print(
        f"  idle stack / (bare JupyterHub + proxy + one MLflow worker) = "
        f"{idle_rss / (hub_rss + worker_rss):.2f} [{idle_pss / (hub_pss + worker_pss):.2f}]"
    )
    print(
        f"  MLflow as Danlu runs it / mlflow server as shipped = {mlflow_rss / shipped_rss:.2f} "
        f"[{mlflow_pss / shipped_pss:.2f}]   ({mlflow_rss:.0f} vs {shipped_rss:.0f} MB)"
    )
    print(
        f"  each idle user: {per_user_rss:.0f} MB more than the idle stack; their own server: {server_rss:.0f} MB; "
        f"warm runners left after {args.warm_idle:g} s idle: {warm_left:.0f} MB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
