"""Kernels of a job: start one, prime it with the job's environment, let it finish, stop it.

Used by the runner (one kernel) and by each torchrun rank (one kernel per
rank). :func:`job_env` is the environment every kernel of a job gets: the
in-job ``DANLU_*`` variables, the job's devices, and its MLflow run and
credentials.
"""

from __future__ import annotations

import json
import os
import sys

from danlu import env as names
from danlu.jobdir import JobDir


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


def job_env(jd: JobDir, spec: dict, run_id: str | None) -> dict:
    """The environment of every kernel of the job (and of what its code starts)."""
    out = {k: str(v) for k, v in (spec.get("env") or {}).items()}
    out.update({k: str(v) for k, v in (spec.get("mlflow_env") or {}).items()})
    devices = spec.get("devices") or []
    out.update({
        names.JOB_ID: spec["job_id"],
        names.JOB_DIR: str(jd.path),
        names.CHECKPOINT_DIR: str(jd.checkpoint_dir),
        # exclusive devices: a job that asked for no GPU sees none
        "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # the ledger's indices are nvidia-smi's (PCI) order
    })
    if run_id:
        out["MLFLOW_RUN_ID"] = run_id
    return out
