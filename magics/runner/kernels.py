"""Kernels of a job: start one, prime it with the job's environment, let it finish, stop it.

Used by the runner (one kernel) and by each torchrun rank (one kernel per
rank). :func:`job_env` is the environment every kernel of a job gets: the
in-job ``DANLU_*`` variables, the job's devices, and its MLflow run and
credentials.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time

from danlu import env as names
from danlu.jobdir import JobDir


def start_kernel(kernel_name: str, cwd: str | None = None, env: dict | None = None):
    """Start a kernel and wait until it answers; returns an AsyncKernelManager.

    Async, as nbclient (papermill) expects: with a blocking client it would wait
    on a reply forever when the kernel dies instead of raising DeadKernelError.
    The client that saw it answer stays connected (``km.ready_client``): priming
    the kernel and running the notebook use it (:func:`prime`,
    :func:`execute_notebook`) instead of connecting again, because a new client
    waits for the kernel to answer and then 0.2 s more for IOPub to fall quiet
    (jupyter_client's ``wait_for_ready``), twice per job.
    """
    # deferred: jupyter_client takes ~0.2 s to import; a torchrun job's runner starts no kernel itself
    from jupyter_client.manager import AsyncKernelManager

    # IPC sockets: no TCP port to allocate or expose, and no unencrypted-TCP warning
    sockets = tempfile.mkdtemp(prefix="danlu-kernel-")
    km = AsyncKernelManager(kernel_name=kernel_name, transport="ipc", ip=os.path.join(sockets, "k"))

    async def start():
        await km.start_kernel(cwd=cwd, env={**os.environ, **(env or {})})
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=120)
        except BaseException:
            kc.stop_channels()
            raise
        kc.allow_stdin = False  # as nbclient sets it: a job has nobody to answer input()
        return kc

    km.ready_client = _run_sync(start)
    return km


def _ready_client(km):
    return getattr(km, "ready_client", None)


def _run_sync(async_fn):
    """Run a coroutine function to its end from this synchronous code, as jupyter_client's blocking calls do."""
    from jupyter_core.utils import run_sync  # deferred: asyncio comes with it (~50 ms); only kernels need it

    return run_sync(async_fn)()


def execute_notebook(km, input_path: str, output_path: str, **kwargs):
    """``papermill.execute_notebook`` on ``km``, through its connected client (see :func:`start_kernel`)."""
    import papermill  # deferred: papermill takes ~2 s to import; a torchrun job's runner executes no notebook

    _register_engine()
    _quiet_dead_kernel_tasks()
    return papermill.execute_notebook(
        input_path, output_path, km=km, kc=_ready_client(km), engine_name=READY_ENGINE, **kwargs
    )


READY_ENGINE = "danlu-ready-client"


@functools.cache
def _quiet_dead_kernel_tasks() -> None:
    """Keep asyncio's "Task exception was never retrieved" traceback for nbclient's ``DeadKernelError`` out of
    the job's log: a job stopped (cancel, preemption, pruning, timeout) has its kernel shut down under the cell
    nbclient is executing, the runner has said why in one line already, and the traceback says nothing more."""

    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ != "DeadKernelError"

    logging.getLogger("asyncio").addFilter(keep)


@functools.cache
def _register_engine() -> None:
    """papermill's nbclient engine, on a kernel client that is already connected (its one difference)."""
    from papermill.clientwrap import PapermillNotebookClient  # deferred: papermill takes ~2 s to import
    from papermill.engines import NBClientEngine, papermill_engines  # deferred: papermill takes ~2 s to import
    from papermill.log import logger  # deferred: papermill takes ~2 s to import

    class ReadyNotebookClient(PapermillNotebookClient):
        def __init__(self, nb_man, kc=None, **kwargs):
            super().__init__(nb_man, **kwargs)
            self.kc = kc  # nbclient connects a new client (and waits for it) only where this is None

    class ReadyClientEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(
            cls,
            nb_man,
            kernel_name,
            log_output=False,
            stdout_file=None,
            stderr_file=None,
            start_timeout=60,
            execution_timeout=None,
            kc=None,
            **kwargs,
        ):
            # as NBClientEngine.execute_managed_notebook passes its arguments to the client
            kwargs = {k: v for k, v in kwargs.items() if k not in ("input_path", "timeout", "startup_timeout")}
            return ReadyNotebookClient(
                nb_man,
                kc=kc,
                timeout=execution_timeout,
                startup_timeout=start_timeout,
                kernel_name=kernel_name,
                log=logger,
                log_output=log_output,
                stdout_file=stdout_file,
                stderr_file=stderr_file,
                **kwargs,
            ).execute()

    papermill_engines.register(READY_ENGINE, ReadyClientEngine)


def let_kernel_finish(km, seconds: float) -> None:
    """After SIGTERM: give the user's code up to ``seconds`` to finish its cell (save a checkpoint).

    The kernel got SIGTERM too. Without a handler it is gone at once; with one
    (a training loop that saves and stops) it finishes the cell. A kernel_info
    request queues behind the running cell on the shell channel, so its reply
    says the cell is done.
    """
    import asyncio  # deferred: asyncio takes ~50 ms; it comes with jupyter_client where a kernel runs

    async def wait():
        if seconds <= 0 or not await km.is_alive():
            return
        kc = km.client()
        kc.start_channels()
        try:
            msg_id = kc.kernel_info()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and await km.is_alive():
                try:
                    reply = await kc.get_shell_msg(timeout=0.5)
                except (asyncio.TimeoutError, TimeoutError, Exception):  # queue.Empty on timeout
                    continue
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    return
        finally:
            kc.stop_channels()

    try:
        _run_sync(wait)
    except Exception as e:
        print(f"danlu: waiting for the kernel: {e}", file=sys.stderr, flush=True)


def stop_kernel(km, now: bool = False) -> None:
    """Shut a kernel down (gracefully unless ``now``: atexit handlers flush TensorBoard) and remove its sockets."""
    begin_stop(km, now=now)
    end_stop(km)


def exit_marker(km) -> str | None:
    """The file a primed kernel creates when its last exit handler has run (see :func:`prime_code`)."""
    return os.path.join(os.path.dirname(km.ip), "exit-handlers-done") if km.transport == "ipc" else None


def begin_stop(km, now: bool = False) -> None:
    """Ask the kernel to shut down (or kill it, with ``now``), without waiting for it to be gone."""

    async def begin():
        if not await km.is_alive():
            return
        if now:
            await km.shutdown_kernel(now=True)
        else:  # as KernelManager.shutdown_kernel starts, minus its wait
            await km.interrupt_kernel()
            await km.request_shutdown()

    client = _ready_client(km)
    if client is not None:
        km.ready_client = None
        client.stop_channels()
    try:
        _run_sync(begin)
    except Exception as e:
        print(f"danlu: kernel shutdown: {e}", file=sys.stderr, flush=True)


def wait_exit_handlers(km, timeout: float = 10.0) -> None:
    """After :func:`begin_stop`: until the kernel's exit handlers have all run (its writers flushed, MLflow's
    own exit work done) or it is gone, at most ``timeout`` seconds. What is left of its exit -- freeing the
    interpreter, a few hundred milliseconds -- can go on while the runner finishes the run."""
    marker = exit_marker(km)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (marker and os.path.exists(marker)) or not _running(km):
            return
        time.sleep(0.005)


def _running(km) -> bool:
    process = getattr(km.provisioner, "process", None) if km.provisioner is not None else None
    return process is not None and process.poll() is None


def end_stop(km) -> None:
    """After :func:`begin_stop`: wait until the kernel is gone (killing it after jupyter_client's shutdown wait),
    then remove its connection file and sockets."""

    async def end():
        if km.has_kernel:
            await km.finish_shutdown()
        await km.cleanup_resources()

    try:
        _run_sync(end)
    except Exception as e:
        print(f"danlu: kernel shutdown: {e}", file=sys.stderr, flush=True)
    if km.transport == "ipc":
        shutil.rmtree(os.path.dirname(km.ip), ignore_errors=True)


def prime_code(env: dict, cwd: str, marker: str | None = None) -> str:
    """Code run silently in a job's kernel before the notebook: environment, folder, auto-logging.

    With ``marker``, its first act registers an exit handler that creates that file: registered before
    any other (the user's code, MLflow's and TensorBoard's come later), it runs after all of them, so the
    file says the kernel's exit work is done (:func:`wait_exit_handlers`).
    """
    payload = json.dumps({"env": env, "cwd": cwd, "marker": marker})
    return (
        "def _danlu_prime():\n"
        "    import atexit, json, os, sys\n"
        f"    cfg = json.loads({payload!r})\n"
        "    if cfg['marker']:\n"
        "        atexit.register(lambda: open(cfg['marker'], 'w').close())\n"
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
    async def run():
        kc = _ready_client(km)
        own = kc is None
        if own:
            kc = km.client()
            kc.start_channels()
        try:
            # no wait_for_ready: the kernel answered when it was started, and that call ends by waiting 0.2 s
            # for IOPub to fall quiet, which only matters for output (this code's is dropped); the reply comes
            # on the shell channel, which queues the request until the kernel reads it
            reply = await kc.execute_interactive(
                prime_code(env, cwd, exit_marker(km)),
                silent=True,
                store_history=False,
                timeout=120,
                output_hook=lambda msg: None,
            )
        finally:
            if own:
                kc.stop_channels()
        if reply["content"].get("status") != "ok":
            content = reply["content"]
            raise RuntimeError(f"preparing the kernel failed: {content.get('ename')}: {content.get('evalue')}")

    _run_sync(run)


def job_env(jd: JobDir, spec: dict, run_id: str | None, experiment_id: str | None = None) -> dict:
    """The environment of every kernel of the job (and of what its code starts): with the job's MLflow run
    and experiment, so what the code logs without naming one (a model, a dataset) lands in the job's run and
    experiment, where its owner may write, not in MLflow's default experiment."""
    out = {k: str(v) for k, v in (spec.get("env") or {}).items()}
    out.update({k: str(v) for k, v in (spec.get("mlflow_env") or {}).items()})
    devices = spec.get("devices") or []
    out.update(
        {
            names.JOB_ID: spec["job_id"],
            names.JOB_DIR: str(jd.path),
            names.CHECKPOINT_DIR: str(jd.checkpoint_dir),
            # exclusive devices: a job that asked for no GPU sees none
            "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # the ledger's indices are nvidia-smi's (PCI) order
        }
    )
    if run_id:
        out["MLFLOW_RUN_ID"] = run_id
    if experiment_id:
        out["MLFLOW_EXPERIMENT_ID"] = experiment_id
    return out
