"""The order of one attempt: :class:`JobRunner` (prepare -> execute -> on_complete / on_failure -> finish).

As jupyter-scheduler's ``ExecutionManager.process``, the base class owns the
order and subclasses override only :meth:`JobRunner.execute`
(:mod:`danlu.runner.execute`). What only the job knows of its provenance -- the
digests of its plain dataset paths and git's dirty state after :meth:`prepare`,
the seed its code set at the end -- goes to the service in ``provenance``
reports (bounded: the service keeps nothing else of them). Every way an attempt can end -- success, an
error in the user's code, a dead kernel, SIGTERM -- ends in :meth:`finish`,
whose last act is the ``finished`` report to the service. On SIGTERM the
runner asks the service why (cancelled, preempted or timed out, and the grace
it gives); if the service does not say, the signal is an interruption, such
as a stopping workbench.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import traceback

from danlu import digests
from danlu.jobdir import JobDir, read_json
from danlu.runner.kernels import begin_stop, end_stop, job_env, let_kernel_finish, wait_exit_handlers
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
#: how long a runner that got SIGTERM asks the service why, when the service does not know yet (a Kueue
#: eviction is seen by the cluster's kubelet before the service's next poll)
STOP_PATIENCE = 5.0
#: the largest seed reported (what every JSON client reads exactly), and the manifests' share of a report
MAX_SEED = 2**53 - 1
MAX_MANIFESTS_BYTES = 512 * 1024
MAX_MANIFEST_FILES = 1000


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
        self.metrics_limit: float | None = None  # seconds the last metrics may take (a stop's grace)
        self.env: dict = {}
        self._kernel_stopping = False

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
        print(
            f"danlu: job {spec['job_id']} attempt {spec['attempt']}: profile {spec['profile']}, "
            f"{spec['nproc']} process(es), GPUs {','.join(map(str, devices)) or 'none'}",
            file=sys.stderr,
            flush=True,
        )
        self.jd.tensorboard_dir.mkdir(parents=True, exist_ok=True)
        self.jd.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.jd.stop_file.unlink(missing_ok=True)  # an earlier attempt's: this one is not stopping
        inputs = self._digest_datasets()  # a missing dataset fails the job, with its name
        self._report_provenance(inputs)
        self.tracking = Tracking(spec, self.jd, spec["attempt"], inputs)
        self.tracking.start(on_run=self._report_tracking)
        # the kernels get the runner API too: danlu.dataset() asks it for catalog versions
        self.env = {
            **job_env(self.jd, spec, self.tracking.run_id, self.tracking.experiment_id),
            **self.link.kernel_env(),
        }

    def _report_tracking(self) -> None:
        self.link.report({"event": "tracking", **self.tracking.health()}, patience=30)

    def execute(self) -> None:
        raise NotImplementedError

    def on_complete(self) -> None:
        self.state, self.reason, self.exit_code = "succeeded", "", 0

    def on_signal(self) -> None:
        stop = self.link.stop()
        deadline = time.monotonic() + STOP_PATIENCE
        while stop is None and time.monotonic() < deadline:
            # a queue of the cluster's (Kueue) may stop the attempt before the service has seen it do so
            time.sleep(0.5)
            stop = self.link.stop()
        if stop is None:
            self.state, self.reason, self.infrastructure = "failed", "interrupted (SIGTERM)", True
            return
        reason, grace = stop
        self.state = self.reason = reason
        self.jd.write_stop(reason, grace)  # for the ranks of a torchrun job
        # the user's code may be saving a checkpoint; keep time to finish this run before SIGKILL
        self.let_finish(max(0.0, grace * 0.8 - 1.0))
        self.metrics_limit = max(1.0, grace * 0.1)  # of the rest: what is not sent stays in the job's files

    def on_failure(self, error: BaseException) -> None:
        self.reason, self.infrastructure = describe_error(error)
        self.state = "failed"
        self.exit_code = 1
        print(f"danlu: job failed: {self.reason}", file=sys.stderr, flush=True)
        if self.infrastructure:
            traceback.print_exception(error, file=sys.stderr)

    def finish(self) -> None:
        # the kernel's exit handlers (TensorBoard's flush, MLflow's, the seed) must be done before the run is
        # closed; the rest of its exit (a few hundred milliseconds) goes on while the run is, and it is gone
        # before the finished report
        self.begin_stop_kernel()
        tracking = {}
        seed = self._seed()
        if seed is not None:
            print(f"danlu: the job's code set the seed {seed}", file=sys.stderr, flush=True)
            self.link.report({"event": "provenance", "seed": seed}, patience=30)
        if self.tracking is not None:
            if seed is not None:
                self.tracking.tag_seed(seed)
            self.tracking.finish(self.state, self.metrics_limit)
            tracking = self.tracking.health()
        print(f"danlu: job {self.state}" + (f": {self.reason}" if self.reason else ""), file=sys.stderr, flush=True)
        self.stop_kernel()
        if self.upload_outputs:
            self._upload_outputs()
        self.link.report(
            {
                "event": "finished",
                "state": self.state,
                "reason": self.reason[:2000],
                "exit_code": self.exit_code,
                "infrastructure": self.infrastructure,
                "tracking": tracking,
            }
        )

    def _upload_outputs(self) -> None:
        outputs = [(0, self.jd.output_notebook)]
        ranks = self.jd.path / "ranks"
        if ranks.is_dir():
            outputs += [
                (int(p.stem.rpartition("-")[2]), p)
                for p in sorted(ranks.glob("rank-*.ipynb"))
                if p.stem.rpartition("-")[2].isdigit()
            ]
        for rank, path in outputs:
            if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_OUTPUT:
                self.link.upload_output(rank, path.read_bytes())

    def _digest_datasets(self) -> list:
        """``(digest, context)`` of each of the job's datasets, in order; catalog versions verified."""
        found = []
        for ds in self.spec.get("datasets", []):
            try:
                if ds.get("pinned_from"):  # a reproduction: the path must hold what the job it re-runs read
                    digest = self._verify_pinned(ds)
                elif ds.get("digest"):  # a catalog version: the files must still be what was registered
                    digest = digests.verify(
                        ds["path"],
                        ds["name"],
                        ds["digest"],
                        ds.get("manifest") or [],
                        cache_file=digests.default_cache(),
                    )
                else:
                    digest = digests.digest(ds["path"], name=ds["name"], cache_file=digests.default_cache())
            except FileNotFoundError:
                raise FileNotFoundError(f"dataset {ds['name']} is gone (it was at {ds['path']})") from None
            print(
                f"danlu: dataset {ds['name']} sha256 {digest.digest[:16]}… ({digest.files} files)",
                file=sys.stderr,
                flush=True,
            )
            found.append((digest, ds.get("context") or digests.TRAINING))
        return found

    def _verify_pinned(self, ds: dict):
        """The digest of a plain path pinned by a reproduction, or DatasetChanged naming what changed."""
        found, manifest = digests.scan(ds["path"], ds["name"], cache_file=digests.default_cache())
        if found.digest != ds["digest"]:
            what = digests.changes(ds.get("manifest") or [], manifest) if ds.get("manifest") else []
            raise digests.DatasetChanged(
                f"dataset {ds['name']} changed since job {ds['pinned_from']} read it: "
                f"{', '.join(what) or 'its digest differs'}; restore it, or submit the notebook with the data as "
                "it is now"
            )
        return found

    # provenance: what only the job knows ----------------------------------------------------------
    def _report_provenance(self, inputs: list) -> None:
        """The digests of the job's plain dataset paths, with small manifests, and git's dirty state if unknown.

        ``inputs``: ``(digest, context)`` of each of the job's datasets (:meth:`_digest_datasets`)."""
        event: dict = {"event": "provenance"}
        plain, budget = [], MAX_MANIFESTS_BYTES
        for ds, (found, _context) in zip(self.spec.get("datasets", []), inputs, strict=True):
            if ds.get("dataset") or ds.get("pinned_from"):
                continue  # a catalog version, or a pin: the service has its digest
            item = {"name": str(ds["name"])[:4096], "digest": found.digest}
            try:
                manifest = (
                    digests.scan(ds["path"], ds["name"], cache_file=digests.default_cache())[1]
                    if found.files <= MAX_MANIFEST_FILES
                    else []
                )
            except OSError:
                manifest = []
            size = len(json.dumps(manifest))
            if manifest and size <= budget and all(len(row[0]) <= 1024 for row in manifest):
                item["manifest"], budget = manifest, budget - size
            plain.append(item)
        if plain:
            event["datasets"] = plain[:100]
        dirty = self._git_dirty()
        if dirty is not None:
            event["git_dirty"] = dirty
        if len(event) > 1:
            self.link.report(event, patience=30)

    def _git_dirty(self) -> bool | None:
        """Whether the job's folder has uncommitted changes to tracked files, if submission did not say."""
        source = self.spec.get("source") or {}
        if source.get("git_dirty") is not None or not source.get("git_commit") or not self.spec.get("cwd"):
            return None
        try:
            out = subprocess.run(
                ["git", "-C", str(self.spec["cwd"]), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return bool(out.stdout.strip()) if out.returncode == 0 else None

    def _seed(self) -> int | None:
        """The seed rank 0's code set (the kernel wrote it; the job's own file, so checked like a report)."""
        data = read_json(self.jd.seed_file)
        seed = data.get("seed") if isinstance(data, dict) else None
        if isinstance(seed, int) and not isinstance(seed, bool) and -MAX_SEED <= seed <= MAX_SEED:
            return seed
        return None

    def let_finish(self, seconds: float) -> None:
        if self.km is not None:
            let_kernel_finish(self.km, seconds)

    def begin_stop_kernel(self) -> None:
        """Ask the kernel to stop (killed when the attempt was stopped) and wait for its exit handlers."""
        if self.km is not None and not self._kernel_stopping:
            self._kernel_stopping = True
            begin_stop(self.km, now=self.state in ("cancelled", "preempted", "timed_out"))
            wait_exit_handlers(self.km)

    def stop_kernel(self) -> None:
        """The kernel is gone (stopped as :meth:`begin_stop_kernel` began, if it did), its sockets removed."""
        if self.km is not None:
            self.begin_stop_kernel()
            end_stop(self.km)
            self.km = None
