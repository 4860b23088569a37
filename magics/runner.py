"""The job runner: executes one attempt of a job from its directory.

``python -m danlu.runner JOBDIR`` runs an attempt; ``python -m danlu.runner
--warm KERNEL`` imports everything, starts a kernel, prints ``ready`` and waits
for a job directory on stdin (see :mod:`danlu.hub.backends.local`).

:class:`JobRunner` owns the order of a run, as jupyter-scheduler's
``ExecutionManager.process`` does: ``prepare`` (MLflow run, params, tags,
datasets, metric forwarding) -> ``execute`` -> ``on_complete`` or
``on_failure`` -> ``finish`` (kernel shutdown, last metrics, artifacts, run
status, and last of all ``status.json``). Subclasses override only
``execute``: :class:`KernelRunner` runs papermill on one kernel (a warm one
when the backend has it), :class:`TorchrunRunner` runs ``torchrun`` with one
kernel per rank (:mod:`danlu.rank`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from danlu.jobdir import JobDir, write_json_atomic

log = logging.getLogger("danlu.runner")


class Stopped(BaseException):
    """SIGTERM after the service stopped the job: cancelled, preempted or timed_out."""

    def __init__(self, reason: str, grace: float = 0.0):
        super().__init__(reason)
        self.reason = reason
        self.grace = grace


class Interrupted(BaseException):
    """SIGTERM for any other reason (the workbench is stopping)."""


# kernels ---------------------------------------------------------------------------
def start_kernel(kernel_name: str, cwd: str | None = None, env: dict | None = None):
    """Start a kernel and wait until it answers; returns an AsyncKernelManager.

    Async, as nbclient (papermill) expects: with a blocking client it would wait
    on a reply forever when the kernel dies instead of raising DeadKernelError.
    """
    import tempfile

    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.utils import run_sync

    # IPC sockets: no TCP port to allocate or expose, and no unencrypted-TCP warning
    sockets = tempfile.mkdtemp(prefix="danlu-kernel-")
    km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "k"))

    async def start():
        await km.start_kernel(cwd=cwd, env={**os.environ, **(env or {})})
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
        finally:
            kc.stop_channels()

    run_sync(start)()
    return km


def let_kernel_finish(km, seconds: float) -> None:
    """After SIGTERM: give the user's code up to ``seconds`` to finish its cell (save a checkpoint).

    The kernel got SIGTERM too. Without a handler it is gone at once; with one
    (a training loop that saves and stops) it finishes the cell. A kernel_info
    request queues behind the running cell on the shell channel, so its reply
    says the cell is done.
    """
    import asyncio
    import time as _time

    from jupyter_core.utils import run_sync

    async def wait():
        if seconds <= 0 or not await km.is_alive():
            return
        kc = km.client()
        kc.start_channels()
        try:
            msg_id = kc.kernel_info()
            deadline = _time.monotonic() + seconds
            while _time.monotonic() < deadline and await km.is_alive():
                try:
                    reply = await kc.get_shell_msg(timeout=0.5)
                except (asyncio.TimeoutError, TimeoutError, Exception):  # queue.Empty on timeout
                    continue
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    return
        finally:
            kc.stop_channels()

    try:
        run_sync(wait)()
    except Exception as e:
        print(f"danlu: waiting for the kernel: {e}", file=sys.stderr, flush=True)


def stop_reason(jd: JobDir) -> tuple[str, float] | None:
    """Why the service stopped the job and the grace it gives, from the ``stop`` marker (None: not stopped)."""
    marker = jd.path / "stop"
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    try:
        data = json.loads(text)
        return data.get("reason", "cancelled"), float(data.get("grace", 0))
    except (ValueError, AttributeError):
        return text or "cancelled", 0.0


def stop_kernel(km, now: bool = False) -> None:
    """Shut a kernel down (gracefully unless ``now``: atexit handlers flush TensorBoard) and remove its sockets."""
    import shutil

    from jupyter_core.utils import run_sync

    async def stop():
        if await km.is_alive():
            await km.shutdown_kernel(now=now)

    try:
        run_sync(stop)()
    except Exception as e:
        print(f"danlu: kernel shutdown: {e}", file=sys.stderr, flush=True)
    if km.transport == "ipc":
        shutil.rmtree(os.path.dirname(km.ip), ignore_errors=True)


def prime_code(env: dict, cwd: str) -> str:
    """Code run silently in a job's kernel before the notebook: environment, folder, auto-logging."""
    payload = json.dumps({"env": env, "cwd": cwd})
    return (
        "def _danlu_prime():\n"
        "    import json, os, sys\n"
        f"    cfg = json.loads({payload!r})\n"
        "    os.environ.update(cfg['env'])\n"
        "    os.chdir(cfg['cwd'])\n"
        "    if cfg['cwd'] not in sys.path:\n"
        "        sys.path.insert(0, cfg['cwd'])\n"
        "    import danlu.autolog\n"
        "    danlu.autolog.activate()\n"
        "_danlu_prime()\n"
        "del _danlu_prime\n"
    )


def prime(km, env: dict, cwd: str) -> None:
    from jupyter_core.utils import run_sync

    async def run():
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
            reply = await kc.execute_interactive(prime_code(env, cwd), silent=True, store_history=False,
                                                 timeout=120, output_hook=lambda msg: None)
        finally:
            kc.stop_channels()
        if reply["content"].get("status") != "ok":
            content = reply["content"]
            raise RuntimeError(f"preparing the kernel failed: {content.get('ename')}: {content.get('evalue')}")

    run_sync(run)()


def job_env(jd: JobDir, spec: dict, devices: list[int], run_id: str | None) -> dict:
    env = {k: str(v) for k, v in spec.get("env", {}).items()}
    for key in ("MLFLOW_TRACKING_URI", "DANLU_URL", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # the owner's MLflow login
        if os.environ.get(key):
            env[key] = os.environ[key]
    env.update({
        "DANLU_JOB_ID": spec["id"],
        "DANLU_JOB_DIR": str(jd.path),
        "DANLU_CHECKPOINT_DIR": str(jd.checkpoint_dir),
        # exclusive devices: a job that asked for no GPU sees none
        "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # the ledger's indices are nvidia-smi's (PCI) order
    })
    if run_id:
        env["MLFLOW_RUN_ID"] = run_id
    return env


class RankError(Exception):
    """A rank of a torchrun job failed; says whether in the user's code or the infrastructure."""

    def __init__(self, message: str, infrastructure: bool):
        super().__init__(message)
        self.infrastructure = infrastructure


def describe_error(error: BaseException) -> tuple[str, bool]:
    """(reason, infrastructure?) for an exception that ended an attempt."""
    if isinstance(error, RankError):
        return str(error), error.infrastructure
    name = type(error).__name__
    if name == "PapermillExecutionError":
        where = f"cell {error.exec_count}" if getattr(error, "exec_count", None) else "a cell"
        evalue = str(getattr(error, "evalue", "")).strip().splitlines()
        return f"{where} raised {error.ename}: {evalue[0] if evalue else ''}"[:500], False
    if name == "DeadKernelError":
        return "the kernel died (killed, or out of memory)", True
    if name == "CellTimeoutError":
        return "a cell timed out", False
    if isinstance(error, FileNotFoundError):
        return str(error), False  # a dataset that vanished: retrying will not bring it back
    if isinstance(error, subprocess.CalledProcessError):
        return f"{error.cmd[0]} exited with {error.returncode}", True
    return f"{name}: {error}"[:500], True


class JobRunner:
    """Runs one attempt. Subclasses implement :meth:`execute` only."""

    def __init__(self, jd: JobDir, km=None):
        self.jd = jd
        self.spec = jd.spec()
        self.attempt = json.loads((jd.path / "attempt.json").read_text()) if (jd.path / "attempt.json").exists() \
            else {"number": 1, "devices": []}
        self.km = km
        self.client = None
        self.run_id: str | None = None
        self.forwarder = None
        self.state = "failed"
        self.reason = ""
        self.infrastructure = False
        self.exit_code: int | None = None
        self.notes: list[str] = []
        self.digests: list = []

    # signals --------------------------------------------------------------------
    def _on_sigterm(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop = stop_reason(self.jd)
        if stop is not None:
            raise Stopped(*stop)
        raise Interrupted()

    # order of a run -----------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        write_json_atomic(self.jd.runner_file, {"pid": os.getpid(), "started_at": time.time()})
        try:
            self.prepare()
            self.execute()
            self.on_complete()
        except Stopped as stop:
            self.state, self.reason = stop.reason, stop.reason
            # the user's code may be saving a checkpoint; keep time to finish this run before SIGKILL
            self.let_finish(max(0.0, stop.grace * 0.8 - 1.0))
        except Interrupted:
            self.state, self.reason, self.infrastructure = "failed", "interrupted (SIGTERM)", True
        except BaseException as error:  # noqa: BLE001 - every failure must end in status.json
            self.on_failure(error)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.finish()
        return 0

    def prepare(self) -> None:
        spec = self.spec
        devices = self.attempt.get("devices", [])
        print(f"danlu: job {spec['id']} attempt {self.attempt.get('number', 1)}: profile {spec['profile']}, "
              f"{spec['nproc']} process(es), GPUs {','.join(map(str, devices)) or 'none'}", file=sys.stderr,
              flush=True)
        self.jd.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        self.jd.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.digests = self._digest_datasets()  # a missing dataset fails the job, with its name
        try:
            self._start_mlflow()
        except Exception as e:  # the job still runs; its events stay on disk
            self.notes.append(f"MLflow unavailable: {e}")
            print(f"danlu: warning: MLflow unavailable, metrics stay in {self.jd.tensorboard_dir}: {e}",
                  file=sys.stderr, flush=True)
            self.client = None
        self.env = job_env(self.jd, spec, devices, self.run_id)

    def execute(self) -> None:
        raise NotImplementedError

    def on_complete(self) -> None:
        self.state, self.reason, self.exit_code = "succeeded", "", 0

    def on_failure(self, error: BaseException) -> None:
        self.reason, self.infrastructure = describe_error(error)
        self.state = "failed"
        self.exit_code = 1
        print(f"danlu: job failed: {self.reason}", file=sys.stderr, flush=True)
        if self.infrastructure:
            traceback.print_exception(error, file=sys.stderr)

    def finish(self) -> None:
        self.stop_kernel()
        if self.forwarder is not None:
            try:
                sent = self.forwarder.stop()
                print(f"danlu: {sent} metric points recorded in MLflow", file=sys.stderr, flush=True)
            except Exception as e:
                self.notes.append(f"metrics not forwarded: {e}")
        if self.client is not None and self.run_id:
            self._log_artifacts()
            status = {"succeeded": "FINISHED", "cancelled": "KILLED", "preempted": "KILLED",
                      "timed_out": "KILLED"}.get(self.state, "FAILED")
            try:
                self.client.set_terminated(self.run_id, status=status)
            except Exception as e:
                self.notes.append(f"MLflow run status not set: {e}")
        print(f"danlu: job {self.state}" + (f": {self.reason}" if self.reason else ""), file=sys.stderr, flush=True)
        self.jd.write_status(self.state, self.reason, exit_code=self.exit_code, mlflow_run_id=self.run_id,
                             infrastructure=self.infrastructure, finished_at=time.time(), notes=self.notes)

    # MLflow -------------------------------------------------------------------------
    def _start_mlflow(self) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        from danlu import datasets
        from danlu.events import MetricForwarder

        spec = self.spec
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            raise RuntimeError("MLFLOW_TRACKING_URI is not set for the runner")
        self.client = client = MlflowClient(tracking_uri=tracking_uri)
        name = spec["experiment"]
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                experiment_id = client.create_experiment(name, tags={"danlu.owner": spec["owner"]})
            except MlflowException:  # created meanwhile by another job
                experiment_id = client.get_experiment_by_name(name).experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self.jd.run_id()
        if self.run_id:
            client.update_run(self.run_id, status="RUNNING")
        else:
            source = spec.get("source", {})
            tags = {
                "mlflow.runName": spec["name"],
                "mlflow.user": spec["owner"],
                "mlflow.source.type": "NOTEBOOK",
                "mlflow.source.name": source.get("notebook_path") or "",
                "danlu.job_id": spec["id"],
                "danlu.user": spec["owner"],
                "danlu.profile": spec["profile"],
                "danlu.queue": spec.get("queue", "default"),
                "danlu.notebook_path": source.get("notebook_path") or "",
                "danlu.cell_id": source.get("cell_id") or "",
                "danlu.cell_sha256": spec.get("cell_sha256", ""),
                "danlu.included_cells": ",".join(source.get("included_cells", [])),
            }
            if source.get("git_commit"):
                tags["mlflow.source.git.commit"] = source["git_commit"]
                tags["danlu.git_commit"] = source["git_commit"]
            run = client.create_run(experiment_id, run_name=spec["name"], tags={k: v for k, v in tags.items() if v})
            self.run_id = run.info.run_id
            write_json_atomic(self.jd.run_file, {"run_id": self.run_id, "experiment_id": experiment_id})
            params = {str(k): json.dumps(v) if not isinstance(v, str) else v for k, v in spec["parameters"].items()}
            params.update({"resources.nproc": str(spec["nproc"]), "resources.gpus": str(spec["gpus"]),
                           "profile": spec["profile"]})
            client.log_batch(self.run_id, params=[Param(k, v[:6000]) for k, v in params.items()],
                             synchronous=True)
            for digest in self.digests:
                datasets.log_to_mlflow(client, self.run_id, digest)
        client.set_tag(self.run_id, "danlu.attempt", str(self.attempt.get("number", 1)))
        self.forwarder = MetricForwarder(client, self.run_id, self.jd.logdirs_file,
                                         [self.jd.tensorboard_dir / "rank-0"]).start()

    def _digest_datasets(self) -> list:
        from danlu import datasets

        digests = []
        for ds in self.spec.get("datasets", []):
            try:
                digest = datasets.digest(ds["path"], name=ds["name"], cache_file=datasets.default_cache())
            except FileNotFoundError:
                raise FileNotFoundError(f"dataset {ds['name']} is gone (it was at {ds['path']})") from None
            print(f"danlu: dataset {ds['name']} sha256 {digest.digest[:16]}… ({digest.files} files)",
                  file=sys.stderr, flush=True)
            digests.append(digest)
        return digests

    def _log_artifacts(self) -> None:
        uploads = [(self.jd.input_notebook, "notebooks"), (self.jd.output_notebook, "notebooks"),
                   (self.jd.log_file, "logs")]
        ranks = self.jd.path / "ranks"
        if ranks.is_dir():
            uploads += [(p, "notebooks/ranks") for p in sorted(ranks.glob("*.ipynb"))]
        for path, where in uploads:
            if path.exists():
                try:
                    self.client.log_artifact(self.run_id, str(path), where)
                except Exception as e:
                    self.notes.append(f"artifact {path.name} not uploaded: {e}")

    def let_finish(self, seconds: float) -> None:
        if self.km is not None:
            let_kernel_finish(self.km, seconds)

    def stop_kernel(self) -> None:
        if self.km is not None:
            stop_kernel(self.km, now=self.state in ("cancelled", "preempted", "timed_out"))
            self.km = None


class KernelRunner(JobRunner):
    """One process: papermill on the profile's kernel (pre-started when warm)."""

    def execute(self) -> None:
        import papermill

        spec = self.spec
        if self.km is None:
            self.km = start_kernel(spec["kernel_name"], cwd=spec["cwd"], env=self.env)
        prime(self.km, self.env, spec["cwd"])
        papermill.execute_notebook(
            str(self.jd.input_notebook), str(self.jd.output_notebook),
            parameters=spec["parameters"], kernel_name=spec["kernel_name"], km=self.km,
            log_output=True, progress_bar=False, request_save_on_cell_execute=True,
            execution_timeout=spec.get("cell_timeout_seconds"),
        )


class TorchrunRunner(JobRunner):
    """``nproc`` ranks with torchrun (gloo on the CPU); rank 0's notebook is the output."""

    def execute(self) -> None:
        spec = self.spec
        try:
            import torch.distributed.run  # noqa: F401
        except ImportError:
            raise RuntimeError(f"--nproc {spec['nproc']} needs PyTorch (torchrun) in the workbench environment") \
                from None
        (self.jd.path / "ranks").mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['nproc']}",
               "--max-restarts=0", "--module", "danlu.rank", str(self.jd.path)]
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, cwd=spec["cwd"], env=env, stdin=subprocess.DEVNULL)
        try:
            code = self.proc.wait()
        except BaseException:
            self._stop_ranks()
            raise
        if code != 0:
            errors = []
            for rank in range(spec["nproc"]):
                status = self.jd.path / "ranks" / f"rank-{rank}.status.json"
                if status.exists():
                    data = json.loads(status.read_text())
                    if data.get("reason"):
                        errors.append((rank, data))
            user = [(r, d) for r, d in errors if not d.get("infrastructure")]
            if user:
                rank, data = user[0]
                raise RankError(f"rank {rank}: {data['reason']}", infrastructure=False)
            if errors:
                rank, data = errors[0]
                raise RankError(f"rank {rank}: {data['reason']}", infrastructure=True)
            raise RankError(f"torchrun exited with {code}", infrastructure=True)

    def _stop_ranks(self) -> None:
        from danlu import proctree

        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            stop = stop_reason(self.jd)
            proctree.kill_matching(proc.pid, grace=max(5.0, stop[1] * 0.8) if stop else 5.0)

    def let_finish(self, seconds: float) -> None:
        # the rank workers got SIGTERM as well and give their kernels the same time
        proc = getattr(self, "proc", None)
        if proc is not None:
            try:
                proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass


def run_job(jd: JobDir, km=None) -> int:
    spec = jd.spec()
    runner_cls = TorchrunRunner if spec.get("nproc", 1) > 1 else KernelRunner
    return runner_cls(jd, km=km).run()


def _redirect_output(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def warm_main(kernel_name: str) -> int:
    """Import, start a kernel, say ``ready``, then wait for a job directory on stdin."""
    import mlflow  # noqa: F401 - imported now so a job does not wait for it
    import papermill  # noqa: F401

    from danlu import events  # noqa: F401
    from danlu.proctree import set_child_subreaper

    set_child_subreaper()
    try:
        km = start_kernel(kernel_name, cwd=os.getcwd())
    except Exception as e:
        print(f"failed {e}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(SystemExit(0)))
    try:
        print("ready", flush=True)
        line = sys.stdin.readline().strip()
        extra = sys.stdin.readline().strip()  # the environment the job adds (its owner's MLflow login)
    except SystemExit:
        line = ""
    if not line:
        stop_kernel(km, now=True)
        return 0
    os.environ.update(json.loads(extra) if extra else {})
    jd = JobDir(Path(line))
    _redirect_output(jd.log_file)
    os.environ["DANLU_JOB_ID"] = jd.path.name
    return run_job(jd, km=km)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m danlu.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", metavar="KERNEL", help="start a kernel and wait for a job directory on stdin")
    parser.add_argument("jobdir", nargs="?", help="the job's directory")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    for noisy in ("urllib3", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    if args.warm:
        return warm_main(args.warm)
    if not args.jobdir:
        parser.error("give a job directory or --warm KERNEL")
    from danlu.proctree import set_child_subreaper

    set_child_subreaper()
    return run_job(JobDir(Path(args.jobdir)))


if __name__ == "__main__":
    sys.exit(main())
