"""Run jobs as local processes, detached from the service so they outlive it.

Each attempt is one runner process (see :mod:`danlu.hub.backends.warm`) in
its own session, so killing the jobs service (even with SIGKILL) leaves it
running; the runner reports to the service's runner API and a restarted
service picks the attempt up again from the pid it recorded. In unix-accounts
mode runners start as the job's account (``user=``/``group=`` of the
subprocess, not a ``preexec_fn``), with an environment built from an allow
list: nothing of the service's own environment (its tokens, its secrets)
reaches a job.

Every process an attempt starts ends with it, however it detaches: where
cgroup v2 is writable each attempt runs in a cgroup of its own, which its
processes cannot leave and :meth:`LocalBackend.cleanup` kills whole; the runner
is a subreaper that ends its descendants before it exits; and its marker finds
the rest (:mod:`danlu.proctree`).

The job's folder (``<jobs_root>/<id>``) is the job's: the backend creates it
and hands it to the account, then only reads the log and the output notebooks
from it, through :mod:`danlu.hub.backends.files`, which refuses links, FIFOs,
hard links and other accounts' files. Reads happen on a small thread pool, off
the event loop.
"""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from traitlets import Bool, Dict, Float, Integer, Unicode, default

from danlu import env, proctree
from danlu.hub.backends.base import Backend, Launch, Outcome, Record
from danlu.hub.backends.files import prepare_job_dir, read_job_file
from danlu.hub.backends.warm import RunnerProcess, WarmPool, new_runner_id

#: what a runner keeps of the service's own environment
KEEP_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH", "TMPDIR")


def output_path(rank: int) -> str:
    return "output.ipynb" if rank == 0 else f"ranks/rank-{rank}.ipynb"


class LocalBackend(Backend):
    """Jobs as detached local processes (papermill, torchrun for --nproc > 1)."""

    name = "local"

    jobs_root = Unicode(
        help="Folder holding one folder per job (the service's; jobs own only their own). "
        "Default: the jobs folder of the state folder."
    ).tag(config=True)
    warm_runners = Integer(
        help="Warm runners kept per kernel (and, with Unix accounts, per user) while it is in "
        "use (0 disables). Default: danlu.yaml's jobs.warm_runners."
    ).tag(config=True)
    warm_idle_seconds = Float(
        help="A kernel's warm runners unused for this long are stopped (with their kernels) "
        "and started again on the next demand. Default: jobs.warm_idle_seconds."
    ).tag(config=True)
    warm_runners_max = Integer(
        help="At most this many warm runners wait in all, every kernel and user together. "
        "Default: jobs.warm_runners_max."
    ).tag(config=True)
    warm_runners_per_user = Integer(
        help="With Unix accounts, at most this many warm runners wait for one user. "
        "Default: jobs.warm_runners_per_user."
    ).tag(config=True)
    python = Unicode(sys.executable, help="Python that runs job runners (must have danlu installed).").tag(config=True)
    process_cgroups = Bool(
        True,
        help="Run each attempt in a cgroup v2 of its own, beside the service's, and kill that cgroup when the "
        "attempt ends, so no process of a job survives it, however it detaches (setsid, double fork, a cleared "
        "environment). Needs a writable cgroup v2 (a root service, or a delegated subtree); without one, the "
        "runner (a subreaper) and the attempt's marker end them.",
    ).tag(config=True)
    runner_env = Dict(
        help="Extra environment for every runner. Default: the workbench's JUPYTER_PATH (its "
        "kernels), its instance marker, and the privacy switches and proxy variables every process "
        "carries (danlu.env.private_environment)."
    ).tag(config=True)

    @default("jobs_root")
    def _jobs_root(self):
        return str(self.settings.jobs_dir)

    @default("warm_runners")
    def _warm_runners(self):
        return self.settings.jobs.warm_runners

    @default("warm_idle_seconds")
    def _warm_idle_seconds(self):
        return self.settings.jobs.warm_idle_seconds

    @default("warm_runners_max")
    def _warm_runners_max(self):
        return self.settings.jobs.warm_runners_max

    @default("warm_runners_per_user")
    def _warm_runners_per_user(self):
        return self.settings.jobs.warm_runners_per_user

    @default("runner_env")
    def _runner_env(self):
        out = {
            "JUPYTER_PATH": str(self.settings.state_dir / "share" / "jupyter"),
            **env.private_environment(self.settings.privacy.allow_outbound),
        }
        if env.INSTANCE.get():
            out[env.INSTANCE] = env.INSTANCE.get()
        return out

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pool = WarmPool(
            self._spawn_runner,
            self.warm_runners,
            idle_seconds=self.warm_idle_seconds,
            max_total=self.warm_runners_max,
            max_per_account=self.warm_runners_per_user,
        )
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Task] = set()
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="danlu-files")
        self._jobs_root_abs: str | None = None

    # processes -----------------------------------------------------------------------
    def _env(self, account, runner_id: str, job_id: str | None) -> dict:
        out = {k: os.environ[k] for k in KEEP_ENV if k in os.environ}
        out.update(self.runner_env)
        if account is not None:
            out.update({"HOME": account.home, "USER": account.name, "LOGNAME": account.name})
        elif "HOME" in os.environ:
            out["HOME"] = os.environ["HOME"]
        out.update(
            {"PYTHONUNBUFFERED": "1", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true", env.RUNNER_ID: runner_id}
        )
        if job_id:
            out[env.JOB_ID] = job_id
        return out

    async def _spawn_runner(self, kernel_name: str | None, account, job_id: str | None = None) -> RunnerProcess:
        """A runner waiting for its launch message: warm (with a kernel) when ``kernel_name`` is given."""
        runner_id = new_runner_id()
        args = [self.python, "-m", "danlu.runner"] + (["--warm", kernel_name] if kernel_name else [])
        ids = {}
        if account is not None:
            ids = {
                "user": account.uid,
                "group": account.gid,
                "extra_groups": os.getgrouplist(account.name, account.gid),
            }
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE if kernel_name else asyncio.subprocess.DEVNULL,
            start_new_session=True,
            env=self._env(account, runner_id, job_id),
            cwd=self.jobs_root,
            umask=0o077,
            **ids,
        )
        runner = RunnerProcess(proc, runner_id, kernel_name, account.uid if account is not None else os.geteuid())
        if kernel_name:
            self._spawn(runner.watch())
        return runner

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def warm(self, kernel_name: str, account=None) -> None:
        """Demand for a kernel (and, with Unix accounts, a user): top up its pool of warm runners."""
        await self.pool.top_up(kernel_name, account)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # the contract --------------------------------------------------------------------------
    async def start(self, launch: Launch, record: Record) -> dict:
        account = launch.run_as
        job_dir = await self._run(prepare_job_dir, Path(self.jobs_root), launch.job_id, account)
        runner = self.pool.take(launch.kernel_name, account) if launch.nproc == 1 else None
        if runner is None:
            runner = await self._spawn_runner(None, account, launch.job_id)
        try:
            create_time = psutil.Process(runner.proc.pid).create_time()
        except psutil.Error:
            create_time = None
        state = {
            "pid": runner.proc.pid,
            "create_time": create_time,
            "runner_id": runner.runner_id,
            "warm": runner.warm,
            "uid": runner.uid,
        }
        if self.process_cgroups:  # before the launch message: no code of the job has run yet
            state["cgroup"] = await self._run(self._enter_cgroup, runner)
        await record(state)  # from here on a restarted service finds this runner; before, it never ran
        await runner.launch({**launch.message(), "job_dir": str(job_dir)})
        self._procs[launch.job_id] = runner.proc
        self._spawn(self.pool.top_up(launch.kernel_name, account))
        self.log.info(
            "job %s attempt %s started (pid %s, %s runner)",
            launch.job_id,
            launch.attempt,
            runner.proc.pid,
            "warm" if runner.warm else "cold",
        )
        return state

    @staticmethod
    def _enter_cgroup(runner: RunnerProcess) -> str | None:
        path = proctree.new_cgroup(runner.runner_id)
        if path is not None and not proctree.enter_cgroup(path, runner.proc.pid):
            proctree.kill_cgroup(path)
            return None
        return path

    def _running(self, job_id: str, state: dict) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            return proc.returncode is None
        return proctree.alive(state.get("pid"), state.get("create_time"))

    async def poll(self, job_id: str, state: dict) -> Outcome | None:
        if self._running(job_id, state):
            return None
        proc = self._procs.pop(job_id, None)
        code = proc.returncode if proc is not None else None
        how = (
            f"exit code {code}"
            if code is not None and code >= 0
            else (f"killed by signal {-code}" if code is not None else "gone")
        )
        return Outcome(
            "failed",
            f"the job runner ended without reporting ({how}): killed or lost",
            exit_code=code,
            infrastructure=True,
        )

    async def wait(self, job_id: str, state: dict) -> None:
        proc = self._procs.get(job_id)
        if proc is not None:
            await proc.wait()
            return
        while self._running(job_id, state):
            await asyncio.sleep(0.5)

    @staticmethod
    def _markers(job_id: str, state: dict) -> list[dict]:
        """The processes of this attempt: its runner's marker (never the job's id: a later attempt has that too)."""
        runner_id = state.get("runner_id")
        return [{env.RUNNER_ID: runner_id}] if isinstance(runner_id, str) and runner_id else [{env.JOB_ID: job_id}]

    @staticmethod
    def _uid(state: dict) -> int:
        uid = state.get("uid")
        return uid if isinstance(uid, int) and not isinstance(uid, bool) else os.geteuid()

    async def cancel(self, job_id: str, state: dict, grace: float, reason: str = "cancelled") -> None:
        # the runner asks the service why it got SIGTERM (the attempt's stop reason is recorded first)
        pid, created = state.get("pid"), state.get("create_time")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else None
        created = created if isinstance(created, (int, float)) and not isinstance(created, bool) else None
        await self._run(
            lambda: proctree.kill_matching(
                pid, created, self._markers(job_id, state), grace=grace, uid=self._uid(state)
            )
        )
        await self._run(proctree.kill_cgroup, state.get("cgroup"))  # what left the runner's tree and its marker
        proc = self._procs.get(job_id)
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                pass

    async def cleanup(self, job_id: str, state: dict) -> None:
        """A runner that died leaves its kernels and ranks, and a job may have detached processes (setsid, a
        double fork): they go now, before its GPUs are given back, and the attempt's cgroup with them."""

        def end() -> int:
            marked = proctree.kill_matching(None, None, self._markers(job_id, state), grace=2, uid=self._uid(state))
            return marked + proctree.kill_cgroup(state.get("cgroup"))

        left = await self._run(end)
        if left:
            self.log.info("job %s: ended %d process(es) its runner left", job_id, left)

    async def read_log(self, job_id: str, state: dict, offset: int, limit: int) -> tuple[bytes, int]:
        got = await self._run(
            lambda: read_job_file(
                Path(self.jobs_root), job_id, "job.log", uid=self._uid(state), offset=offset, limit=limit
            )
        )
        return got if got is not None else (b"", 0)

    async def read_output(
        self, job_id: str, state: dict, rank: int, offset: int, limit: int
    ) -> tuple[bytes, int] | None:
        return await self._run(
            lambda: read_job_file(
                Path(self.jobs_root), job_id, output_path(rank), uid=self._uid(state), offset=offset, limit=limit
            )
        )

    def tensorboard_dir(self, job_id: str) -> str | None:
        if self._jobs_root_abs is None:  # every job's view asks: the folder is resolved once
            self._jobs_root_abs = str(Path(self.jobs_root).absolute())
        return os.path.join(self._jobs_root_abs, job_id, "tensorboard")

    async def shutdown(self) -> None:
        await self.pool.stop_all()
        for task in list(self._tasks):
            task.cancel()
        self._io.shutdown(wait=False, cancel_futures=True)
