"""Run jobs as local processes, detached from the service so they outlive it.

Each attempt is one runner process (``python -m danlu.runner JOBDIR``) in its
own session, so killing the jobs service (even with SIGKILL) leaves it running;
the runner records the outcome in the job directory and a restarted service
picks it up from there. For speed the backend keeps *warm runners*: runner
processes that have already imported papermill and MLflow and started a kernel
of a profile, waiting on their stdin for a job directory. A single-process job
is handed to a warm runner when one is ready (no interpreter start, no imports,
no kernel start), else it starts cold. A warm runner whose service goes away
sees end-of-file on stdin and exits with its kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import psutil
from traitlets import Dict, Integer, Unicode

from danlu import proctree
from danlu.env import MLFLOW_AUTH_SECRET
from danlu.hub import mlflow_auth
from danlu.hub.accounts import Account, demote, give
from danlu.hub.backends.base import Backend, Outcome
from danlu.jobdir import JobDir, write_json_atomic


class WarmRunner:
    """A started runner with a kernel, waiting for a job directory on stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, kernel_name: str):
        self.proc = proc
        self.kernel_name = kernel_name
        self.ready = asyncio.get_running_loop().create_future()
        self.started = time.monotonic()

    async def watch(self) -> None:
        try:
            line = await self.proc.stdout.readline()
        except Exception:  # pragma: no cover - pipe torn down
            line = b""
        if not self.ready.done():
            self.ready.set_result(line.strip() == b"ready")

    @property
    def usable(self) -> bool:
        return self.ready.done() and self.ready.result() and self.proc.returncode is None

    async def assign(self, jobdir: Path, env: dict) -> None:
        """Hand over a job: its directory, then the environment it adds (its owner's MLflow login)."""
        self.proc.stdin.write(f"{jobdir}\n{json.dumps(env)}\n".encode())
        await self.proc.stdin.drain()
        self.proc.stdin.close()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                proctree.kill_matching(self.proc.pid, grace=1)


class LocalBackend(Backend):
    """Jobs as detached local processes (papermill, torchrun for --nproc > 1)."""

    name = "local"

    jobs_root = Unicode(help="Folder holding one directory per job.").tag(config=True)
    warm_runners = Integer(1, help="Warm runners kept per kernel that jobs have used (0 disables).").tag(config=True)
    python = Unicode(sys.executable, help="Python that runs job runners (must have danlu installed).").tag(config=True)
    runner_env = Dict(help="Extra environment for every runner (MLflow URI, JUPYTER_PATH, markers).").tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._pool: dict[str, list[WarmRunner]] = {}
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    # warm pool ---------------------------------------------------------------
    def _env(self, extra: dict | None = None) -> dict:
        env = {**os.environ, **self.runner_env, **(extra or {})}
        env.pop("JUPYTERHUB_API_TOKEN", None)  # the service's token never reaches user code
        env.pop(MLFLOW_AUTH_SECRET, None)  # nor the secret every MLflow password comes from
        env.pop("JPY_API_TOKEN", None)
        env["PYTHONUNBUFFERED"] = "1"
        env["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        return env

    async def _start_warm(self, kernel_name: str, account: Account | None) -> WarmRunner:
        env = self._env({"HOME": account.home, "USER": account.name} if account else None)
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "danlu.runner", "--warm", kernel_name,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True, env=env, cwd=account.home if account else self.jobs_root,
            preexec_fn=demote(account) if account else None,
        )
        runner = WarmRunner(proc, kernel_name)
        self._spawn(runner.watch())
        return runner

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm(self, kernel_name: str, account: Account | None = None) -> None:
        """Top up the pool of warm runners for a kernel (and, with Unix accounts, a user)."""
        if self._closing or self.warm_runners <= 0:
            return
        key = (kernel_name, account.uid if account else None)
        pool = [r for r in self._pool.get(key, []) if r.proc.returncode is None]
        while len(pool) < self.warm_runners:
            pool.append(await self._start_warm(kernel_name, account))
        self._pool[key] = pool

    def _take_warm(self, kernel_name: str, account: Account | None) -> WarmRunner | None:
        pool = self._pool.get((kernel_name, account.uid if account else None), [])
        for runner in pool:
            if runner.usable:
                pool.remove(runner)
                return runner
        return None

    # contract ----------------------------------------------------------------
    def jobdir(self, job_id: str) -> JobDir:
        return JobDir(Path(self.jobs_root) / job_id)

    def log_path(self, job_id: str) -> Path:
        return self.jobdir(job_id).log_file

    async def start(self, job: dict) -> dict:
        jd = self.jobdir(job["id"])
        spec = jd.spec()
        run_as = spec.get("run_as")
        # MLflow integration (danlu.hub.mlflow_auth): the runner logs to MLflow as the job's owner
        mlflow_env = mlflow_auth.job_environment(spec["owner"], MLFLOW_AUTH_SECRET.get())
        account = Account(**run_as) if run_as else None
        for stale in (jd.status_file, jd.path / "stop"):  # left by an earlier attempt of a requeued job
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        write_json_atomic(jd.path / "attempt.json", {
            "number": job["attempt"], "devices": job["devices"], "started_at": time.time()})
        give(jd.path / "attempt.json", account)
        jd.log_file.touch()
        give(jd.log_file, account, 0o600)
        kernel = job["kernel_name"]
        runner = self._take_warm(kernel, account) if job["nproc"] == 1 else None
        if runner is not None:
            await runner.assign(jd.path, mlflow_env)
            proc = runner.proc
            warm = True
        else:
            log = open(jd.log_file, "ab")
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.python, "-m", "danlu.runner", str(jd.path),
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True, env=self._env({"DANLU_JOB_ID": job["id"], **mlflow_env}), cwd=str(jd.path),
                    preexec_fn=demote(account) if account else None,
                )
            finally:
                log.close()
            warm = False
        self._procs[job["id"]] = proc
        self._spawn(self.warm(kernel, account))
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = None
        self.log.info("job %s attempt %s started (pid %s, %s runner)", job["id"], job["attempt"], proc.pid,
                      "warm" if warm else "cold")
        return {"pid": proc.pid, "create_time": create_time, "warm": warm}

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        jd = self.jobdir(job_id)
        status = jd.status()
        if status is None:
            proc = self._procs.get(job_id)
            running = (proc.returncode is None) if proc is not None else proctree.alive(
                state.get("pid"), state.get("create_time"))
            if running:
                return None
            status = jd.status()  # it may have written its status just before exiting
        if status is None:
            proc = self._procs.get(job_id)
            code = proc.returncode if proc is not None else None
            how = f"exit code {code}" if code is not None and code >= 0 else (
                f"killed by signal {-code}" if code is not None else "gone")
            return Outcome("failed", f"the job runner ended without reporting ({how}): killed or lost",
                           exit_code=code, infrastructure=True)
        self._procs.pop(job_id, None)
        return Outcome(status["state"], status.get("reason", ""), status.get("exit_code"),
                       mlflow_run_id=status.get("mlflow_run_id") or jd.run_id(),
                       infrastructure=bool(status.get("infrastructure")))

    async def wait(self, job_id: str, state: dict) -> None:
        proc = self._procs.get(job_id)
        if proc is not None:
            await proc.wait()
            return
        while await self.poll(job_id, state) is None:
            await asyncio.sleep(0.5)

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        jd = self.jobdir(job_id)
        # the runner reports why it got SIGTERM, and lets the user's code use the grace period
        (jd.path / "stop").write_text(json.dumps({"reason": reason, "grace": grace}))
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: proctree.kill_matching(state.get("pid"), state.get("create_time"),
                                                 {"DANLU_JOB_ID": job_id}, grace=grace))
        proc = self._procs.pop(job_id, None)
        if proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
        if jd.status() is None:
            jd.write_status(reason, reason, exit_code=None)

    async def shutdown(self) -> None:
        self._closing = True
        runners = [r for pool in self._pool.values() for r in pool]
        self._pool.clear()
        await asyncio.gather(*(r.stop() for r in runners), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
