"""One rank of a multi-process job: ``torchrun ... --module danlu.runner.rank JOBDIR``.

torchrun starts one of these per rank with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; each starts its own kernel (which
inherits that environment, so ``torch.distributed.init_process_group("gloo")``
in the cell just works), primes it like a single-process job and runs the
notebook with papermill. Rank 0 writes ``output.ipynb``, rank N
``ranks/rank-N.ipynb``; each writes ``ranks/rank-N.status.json`` so the runner
can tell an error in the user's code from a crash. Log lines carry a
``[rank N]`` prefix. The spec comes from ``job.json``, which the job's runner
wrote.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from danlu import env as names
from danlu.jobdir import JobDir, read_json, write_json_atomic
from danlu.runner.base import describe_error
from danlu.runner.kernels import execute_notebook, job_env, let_kernel_finish, prime, start_kernel, stop_kernel


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    kept = names.CHECKPOINT_DIR.get()  # the runner's (torchrun passes on its job_env): a pod's is in the home claim
    jd = JobDir(Path(argv[0]), Path(kept) if kept else None)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=f"[rank {rank}] %(message)s")
    for noisy in ("urllib3", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    spec = read_json(jd.spec_file)
    if not isinstance(spec, dict):
        logging.getLogger("danlu.rank").error("the job's spec (job.json) is missing or unreadable")
        return 1
    tracking = spec.get("tracking") or {}
    env = job_env(jd, spec, tracking.get("run_id"), tracking.get("experiment_id"))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key in os.environ:
            env[key] = os.environ[key]
    status_file = jd.rank_status(rank)
    km = None

    def stop(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if km is not None:
            reason = jd.stop_reason(wait=2.0)  # the runner asks the service and says it there
            if reason is not None:  # preempted or stopped: let the cell save its checkpoint first
                let_kernel_finish(km, max(0.0, reason[1] * 0.8 - 1.0))
            stop_kernel(km, now=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    try:
        km = start_kernel(spec["kernel_name"], cwd=spec["cwd"], env=env)
        prime(km, env, spec["cwd"])
        execute_notebook(
            km,
            str(jd.input_notebook),
            str(jd.rank_notebook(rank)),
            parameters=spec["parameters"],
            kernel_name=spec["kernel_name"],
            log_output=True,
            progress_bar=False,
            request_save_on_cell_execute=True,
            execution_timeout=spec.get("cell_timeout_seconds"),
        )
        write_json_atomic(status_file, {"state": "succeeded", "reason": ""})
        return 0
    except Exception as error:
        reason, infrastructure = describe_error(error)
        write_json_atomic(status_file, {"state": "failed", "reason": reason, "infrastructure": infrastructure})
        logging.getLogger("danlu.rank").error("failed: %s", reason)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if km is not None:
            stop_kernel(km)


if __name__ == "__main__":
    sys.exit(main())
