"""The order of one attempt: :class:`JobRunner` (prepare -> execute -> on_complete / on_failure -> finish).

As jupyter-scheduler's ``ExecutionManager.process``, the base class owns the
order and subclasses override only :meth:`JobRunner.execute`
(:mod:`danlu.runner.execute`). Every way an attempt can end -- success, an
error in the user's code, a dead kernel, SIGTERM -- ends in :meth:`finish`,
whose last act is the ``finished`` report to the service. On SIGTERM the
runner asks the service why (cancelled, preempted or timed out, and the grace
it gives); if the service does not say, the signal is an interruption, such
as a stopping workbench.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import traceback

from danlu.jobdir import JobDir
from danlu.runner.kernels import job_env, let_kernel_finish, stop_kernel
from danlu.runner.link import ServiceLink
from danlu.runner.tracking import Tracking


class Signalled(BaseException):
    """SIGTERM arrived; :meth:`JobRunner.run` asks the service what it means."""


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
    if isinstance(error, FileNotFoundError) or name == "DatasetChanged":
        return str(error), False  # a dataset that vanished or changed: retrying will not bring it back
    if isinstance(error, subprocess.CalledProcessError):
        return f"{error.cmd[0]} exited with {error.returncode}", True
    return f"{name}: {error}"[:500], True


#: the largest executed notebook a runner hands to the service (the service's body limit)
MAX_OUTPUT = 64 * 2**20


class JobRunner:
    """Runs one attempt. Subclasses implement :meth:`execute` only."""

    #: hand the executed notebooks to the service at the end (a pod: nobody reads its folder)
    upload_outputs = False

    def __init__(self, link: ServiceLink, spec: dict, jd: JobDir, km=None):
        self.link = link
        self.spec = spec
        self.jd = jd
        self.km = km
        self.state = "failed"
        self.reason = ""
        self.infrastructure = False
        self.exit_code: int | None = None
        self.tracking: Tracking | None = None
        self.env: dict = {}

    # signals --------------------------------------------------------------------
    def _on_sigterm(self, signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Signalled()

    # order of a run -----------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self.prepare()
            self.execute()
            self.on_complete()
        except Signalled:
            self.on_signal()
        except BaseException as error:  # noqa: BLE001 - every failure must end in a report
            self.on_failure(error)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.finish()
        return 0

    def prepare(self) -> None:
        spec = self.spec
        devices = spec.get("devices") or []
        print(f"danlu: job {spec['job_id']} attempt {spec['attempt']}: profile {spec['profile']}, "
              f"{spec['nproc']} process(es), GPUs {','.join(map(str, devices)) or 'none'}", file=sys.stderr,
              flush=True)
        self.jd.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        self.jd.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        digests = self._digest_datasets()  # a missing dataset fails the job, with its name
        self.tracking = Tracking(spec, self.jd, spec["attempt"], digests)
        self.tracking.start(on_run=self._report_tracking)
        self.env = job_env(self.jd, spec, self.tracking.run_id)

    def _report_tracking(self) -> None:
        self.link.report({"event": "tracking", **self.tracking.health()}, patience=30)

    def execute(self) -> None:
        raise NotImplementedError

    def on_complete(self) -> None:
        self.state, self.reason, self.exit_code = "succeeded", "", 0

    def on_signal(self) -> None:
        stop = self.link.stop()
        if stop is None:
            self.state, self.reason, self.infrastructure = "failed", "interrupted (SIGTERM)", True
            return
        reason, grace = stop
        self.state = self.reason = reason
        self.jd.write_stop(reason, grace)  # for the ranks of a torchrun job
        # the user's code may be saving a checkpoint; keep time to finish this run before SIGKILL
        self.let_finish(max(0.0, grace * 0.8 - 1.0))

    def on_failure(self, error: BaseException) -> None:
        self.reason, self.infrastructure = describe_error(error)
        self.state = "failed"
        self.exit_code = 1
        print(f"danlu: job failed: {self.reason}", file=sys.stderr, flush=True)
        if self.infrastructure:
            traceback.print_exception(error, file=sys.stderr)

    def finish(self) -> None:
        self.stop_kernel()
        tracking = {}
        if self.tracking is not None:
            self.tracking.finish(self.state)
            tracking = self.tracking.health()
        print(f"danlu: job {self.state}" + (f": {self.reason}" if self.reason else ""), file=sys.stderr, flush=True)
        if self.upload_outputs:
            self._upload_outputs()
        self.link.report({"event": "finished", "state": self.state, "reason": self.reason[:2000],
                          "exit_code": self.exit_code, "infrastructure": self.infrastructure, "tracking": tracking})

    def _upload_outputs(self) -> None:
        outputs = [(0, self.jd.output_notebook)]
        ranks = self.jd.path / "ranks"
        if ranks.is_dir():
            outputs += [(int(p.stem.rpartition("-")[2]), p) for p in sorted(ranks.glob("rank-*.ipynb"))
                        if p.stem.rpartition("-")[2].isdigit()]
        for rank, path in outputs:
            if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_OUTPUT:
                self.link.upload_output(rank, path.read_bytes())

    def _digest_datasets(self) -> list:
        from danlu import datasets

        digests = []
        for ds in self.spec.get("datasets", []):
            try:
                if ds.get("digest"):  # a catalog version: the files must still be what was registered
                    digest = datasets.verify(ds["path"], ds["name"], ds["digest"], ds.get("manifest") or [],
                                             cache_file=datasets.default_cache())
                else:
                    digest = datasets.digest(ds["path"], name=ds["name"], cache_file=datasets.default_cache())
            except FileNotFoundError:
                raise FileNotFoundError(f"dataset {ds['name']} is gone (it was at {ds['path']})") from None
            print(f"danlu: dataset {ds['name']} sha256 {digest.digest[:16]}… ({digest.files} files)",
                  file=sys.stderr, flush=True)
            digests.append(digest)
        return digests

    def let_finish(self, seconds: float) -> None:
        if self.km is not None:
            let_kernel_finish(self.km, seconds)

    def stop_kernel(self) -> None:
        if self.km is not None:
            stop_kernel(self.km, now=self.state in ("cancelled", "preempted", "timed_out"))
            self.km = None
