"""How an attempt executes: papermill on one kernel, or one kernel per torchrun rank.

:class:`KernelRunner` runs the notebook with papermill on the profile's
kernel (pre-started when the runner was warm). :class:`TorchrunRunner` runs
``torchrun --standalone --nproc-per-node=N --module danlu.runner.rank``: each
rank (:mod:`danlu.runner.rank`) starts its own kernel, and rank 0's notebook
is the job's output. Each rank writes its outcome beside its notebook, so an
error in the user's code is told apart from a crash.
"""

from __future__ import annotations

import os
import subprocess
import sys

from danlu import proctree
from danlu.jobdir import read_json, write_json_atomic
from danlu.runner.base import JobRunner, RankError, Signalled
from danlu.runner.kernels import execute_notebook, job_env, prime, start_kernel


class KernelRunner(JobRunner):
    """One process: papermill on the profile's kernel (pre-started when warm)."""

    def execute(self) -> None:
        spec = self.spec
        if self.km is None:
            self.km = start_kernel(spec["kernel_name"], cwd=spec["cwd"], env=self.env)
        prime(self.km, self.env, spec["cwd"])
        execute_notebook(
            self.km,
            str(self.jd.input_notebook),
            str(self.jd.output_notebook),
            parameters=spec["parameters"],
            kernel_name=spec["kernel_name"],
            log_output=True,
            progress_bar=False,
            request_save_on_cell_execute=True,
            execution_timeout=spec.get("cell_timeout_seconds"),
        )


class TorchrunRunner(JobRunner):
    """``nproc`` ranks with torchrun (gloo on the CPU); rank 0's notebook is the output."""

    proc: subprocess.Popen | None = None

    def execute(self) -> None:
        spec = self.spec
        try:
            import torch.distributed.run  # deferred: optional, and torch takes ~2 s to import  # noqa: F401
        except ImportError:
            raise RuntimeError(
                f"--nproc {spec['nproc']} needs PyTorch (torchrun) in the workbench environment"
            ) from None
        (self.jd.path / "ranks").mkdir(exist_ok=True)
        # the ranks read the spec here (the job's own file: the service never reads it)
        write_json_atomic(
            self.jd.spec_file,
            {
                **{k: v for k, v in spec.items() if k != "notebook"},
                "tracking": {"run_id": self.tracking.run_id if self.tracking else None},
            },
        )
        nodes = int(spec.get("nnodes") or 1)
        # one node: a rendezvous of its own; more (a TrainJob's pods): torchrun reads the node's rank and its
        # master from the PET_* variables the Trainer sets in each pod
        where = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *where,
            f"--nproc-per-node={spec['nproc']}",
            "--max-restarts=0",
            "--module",
            "danlu.runner.rank",
            str(self.jd.path),
        ]
        env = {**os.environ, **self.env, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.proc = subprocess.Popen(cmd, cwd=spec["cwd"], env=env, stdin=subprocess.DEVNULL)
        try:
            code = self.proc.wait()
        except Signalled:
            raise  # the ranks got SIGTERM too; on_signal gives them their grace
        except BaseException:
            self._stop_ranks()
            raise
        if code != 0:
            self._raise_rank_error(code)

    def _raise_rank_error(self, code: int) -> None:
        errors = []
        first = node_rank() * self.spec["nproc"]
        for rank in range(first, first + self.spec["nproc"]):
            data = read_json(self.jd.rank_status(rank))
            if isinstance(data, dict) and isinstance(data.get("reason"), str) and data["reason"]:
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
        if self.proc is not None and self.proc.poll() is None:
            proctree.kill_matching(self.proc.pid, grace=5.0)

    def let_finish(self, seconds: float) -> None:
        # the rank workers got SIGTERM as well and give their kernels the same time
        if self.proc is not None:
            try:
                self.proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass


class NodeRunner(TorchrunRunner):
    """The ranks of one more node of a multi-node job (a TrainJob's pod other than the first).

    The first node's runner owns the attempt: its MLflow run, its reports. This one runs its node's
    ranks, hands their notebooks to the service, and ends with their exit code (the pod's outcome).
    """

    def prepare(self) -> None:
        print(
            f"danlu: job {self.spec['job_id']} attempt {self.spec['attempt']}: node {node_rank()} of "
            f"{self.spec['nnodes']}, {self.spec['nproc']} process(es)",
            file=sys.stderr,
            flush=True,
        )
        self.jd.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.env = job_env(self.jd, self.spec, None)

    def finish(self) -> None:
        self.stop_kernel()
        print(
            f"danlu: node {node_rank()} {self.state}" + (f": {self.reason}" if self.reason else ""),
            file=sys.stderr,
            flush=True,
        )
        if self.upload_outputs:
            self._upload_outputs()

    def run(self) -> int:
        super().run()
        return 0 if self.state == "succeeded" else 1


def node_rank() -> int:
    """This node's rank in a multi-node job (the Trainer's PET_NODE_RANK), 0 elsewhere."""
    try:
        return int(os.environ.get("PET_NODE_RANK", "0"))
    except ValueError:
        return 0


def runner_for(spec: dict) -> type[JobRunner]:
    if int(spec.get("nnodes") or 1) > 1:
        return TorchrunRunner if node_rank() == 0 else NodeRunner
    return TorchrunRunner if int(spec.get("nproc", 1)) > 1 else KernelRunner
