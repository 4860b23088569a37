"""The job's MLflow run, as the runner keeps it: created or resumed, tagged, fed, and ended.

One run per job, created by the jobs service in the job's experiment before
the runner starts (the spec's ``tracking.run_id``), with credentials that write
that run and no other and stop working when the attempt ends; the runner
resumes it, gives it the job's parameters, the tags only the job knows and its
dataset inputs (on the first attempt), and creates no run or experiment. Metrics reach it through
the :class:`~danlu.tensorboard.forwarder.MetricForwarder`, which buffers while MLflow is
away. If MLflow does not answer at the start, the job runs anyway: the run is
resumed in the background as soon as MLflow answers, and the forwarder sends
what it buffered. Whatever could not be done is a note in :meth:`health`,
which the runner reports to the service, so the job's record says how its
tracking went (run, points sent and dropped, notes).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable

from danlu import datasets, tags
from danlu.jobdir import JobDir

RETRY_SECONDS = 5.0
MAX_NOTES = 20


class Tracking:
    def __init__(self, spec: dict, jd: JobDir, attempt: int, digests: list, final_timeout: float = 60.0):
        """``digests``: ``(DatasetDigest, context)`` of the job's datasets, logged as the run's inputs."""
        # deferred: numpy (~0.1 s) comes with it; a node runner forwards nothing, a warm one imported it already
        from danlu.tensorboard.forwarder import MetricForwarder

        self.spec = spec
        self.jd = jd
        self.attempt = attempt
        self.digests = digests
        self.final_timeout = final_timeout
        known = spec.get("tracking") or {}
        self.run_id: str | None = known.get("run_id")
        self.experiment_id: str | None = known.get("experiment_id")
        self.client = None
        self.notes: list[str] = []
        self.on_run: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.forwarder = MetricForwarder(
            None, None, jd.logdirs_file, [jd.tensorboard_dir / "rank-0"], final_timeout=final_timeout
        )

    def note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text[:500])
        print(f"danlu: {text}", file=sys.stderr, flush=True)

    @property
    def configured(self) -> bool:
        return bool((self.spec.get("mlflow_env") or {}).get("MLFLOW_TRACKING_URI"))

    # start --------------------------------------------------------------------------------
    def start(self, on_run: Callable[[], None] = lambda: None) -> None:
        """Resume the service's run now if MLflow answers, else keep trying in the background."""
        self.on_run = on_run
        if not self.configured:
            self.note("MLflow is not configured for this workbench: nothing is tracked")
            return
        self.forwarder.start()
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001 - MLflow away or refusing: the job runs on
            if _refused(e):
                self.note(str(e) if isinstance(e, NoRun) else f"MLflow refused the run: {_short(e)}")
                return
            self.note(
                f"MLflow did not answer at the start ({_short(e)}); the run is resumed when it does, "
                f"metrics wait in {self.jd.tensorboard_dir}"
            )
            self._thread = threading.Thread(target=self._keep_trying, name="danlu-mlflow-connect", daemon=True)
            self._thread.start()

    def _keep_trying(self) -> None:
        while not self._stop.wait(RETRY_SECONDS):
            try:
                self._connect()
            except Exception as e:  # noqa: BLE001
                if _refused(e):
                    self.note(f"MLflow refused the run: {_short(e)}")
                    return
                continue
            self.note("MLflow answered: the run was resumed late")
            return

    def _connect(self) -> None:
        from mlflow import MlflowClient  # deferred: mlflow takes ~2 s to import; a job runs on without it

        if not self.run_id:
            raise NoRun("the service made no MLflow run for this job (MLflow did not answer it): nothing is tracked")
        client = MlflowClient(tracking_uri=self.spec["mlflow_env"]["MLFLOW_TRACKING_URI"])
        client.update_run(self.run_id, status="RUNNING")
        if self.attempt == 1 and not client.get_run(self.run_id).data.params:
            self._describe(client)
        client.set_tag(self.run_id, tags.ATTEMPT, str(self.attempt))
        self.client = client
        self.forwarder.attach(client, self.run_id)
        self.on_run()

    def _describe(self, client) -> None:
        """The run's parameters and dataset inputs (its first attempt). The service made the run, in the job's
        experiment, with the job's tags; this job's credentials write this run and no other, so the runner
        creates no run or experiment."""
        from mlflow.entities import Param  # deferred: mlflow takes ~2 s to import

        spec = self.spec
        params = {str(k): json.dumps(v) if not isinstance(v, str) else v for k, v in spec["parameters"].items()}
        params.update(
            {
                "resources.nproc": str(spec["nproc"]),
                "resources.gpus": str(spec.get("gpus", 0)),
                "profile": spec["profile"],
            }
        )
        client.log_batch(self.run_id, params=[Param(k[:250], v[:6000]) for k, v in params.items()], synchronous=True)
        run_id = self.run_id
        assert run_id is not None  # (start refused to go on without one)
        for digest, context in self.digests:
            datasets.log_to_mlflow(client, run_id, digest, context=context)

    # end ------------------------------------------------------------------------------------
    def finish(self, state: str, limit: float | None = None) -> None:
        """Forward the last metrics, upload the notebooks and the log, set the run's status (bounded).

        ``limit``: seconds the metrics may take, for a job stopped with a grace
        period; without it they take as long as MLflow keeps accepting them.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RETRY_SECONDS + 35)
        if not self.configured:
            return
        try:
            sent = self.forwarder.stop(limit)
            print(f"danlu: {sent} metric points recorded in MLflow", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001
            self.note(f"metrics not forwarded: {_short(e)}")
        if self.client is None or not self.run_id:
            if self.run_id is not None:
                self.note(f"MLflow did not answer while the job ran: its run {self.run_id} has no metrics from it")
            return
        self._log_artifacts()
        status = {"succeeded": "FINISHED", "cancelled": "KILLED", "preempted": "KILLED", "timed_out": "KILLED"}.get(
            state, "FAILED"
        )
        deadline = time.monotonic() + self.final_timeout
        while True:
            try:
                self.client.set_terminated(self.run_id, status=status)
                return
            except Exception as e:  # noqa: BLE001
                if _refused(e) or time.monotonic() > deadline:
                    self.note(f"MLflow run status not set: {_short(e)}")
                    return
                time.sleep(2)

    def tag_seed(self, seed: int) -> None:
        """Tag the run with the seed the job's code set (best effort: a note if MLflow refuses)."""
        if self.client is None or not self.run_id:
            return
        try:
            self.client.set_tag(self.run_id, tags.SEED, str(seed))
        except Exception as e:  # noqa: BLE001
            self.note(f"the seed was not tagged: {_short(e)}")

    def _log_artifacts(self) -> None:
        jd = self.jd
        uploads = [(jd.input_notebook, "notebooks"), (jd.output_notebook, "notebooks"), (jd.log_file, "logs")]
        ranks = jd.path / "ranks"
        if ranks.is_dir():
            uploads += [(p, "notebooks/ranks") for p in sorted(ranks.glob("*.ipynb"))]
        for path, where in uploads:
            if path.is_file() and not path.is_symlink():
                try:
                    self.client.log_artifact(self.run_id, str(path), where)
                except Exception as e:  # noqa: BLE001
                    self.note(f"artifact {path.name} not uploaded: {_short(e)}")

    def health(self) -> dict:
        """What the service records about this job's tracking."""
        out = {
            "run_id": self.run_id,
            "experiment_id": self.experiment_id,
            "points_sent": 0,
            "points_dropped": 0,
            "notes": list(self.notes),
        }
        if self.configured:
            fwd = self.forwarder.health()
            out["points_sent"] = int(fwd.get("points_sent", 0))
            out["points_dropped"] = int(fwd.get("points_dropped", 0))
            out["notes"] = (out["notes"] + list(fwd.get("notes") or []))[:MAX_NOTES]
        return out


def _short(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class NoRun(Exception):
    """The spec names no run: there is nothing this job may log to."""

    error_code = "RESOURCE_DOES_NOT_EXIST"


def _refused(e: BaseException) -> bool:
    """MLflow answered no (a permission or a bad request), as opposed to not answering."""
    code = getattr(e, "error_code", "") or ""
    return code in ("PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST")


def mlflow_environ(spec: dict) -> None:
    """Point this process's MLflow client at the job's server, as the job's owner."""
    os.environ.update({k: str(v) for k, v in (spec.get("mlflow_env") or {}).items()})
    # a job must not hang on an unreachable MLflow: it runs on and keeps its events
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
