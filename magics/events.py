"""Forward TensorBoard scalars from a job's event files into its MLflow run.

Runs in the job runner, a separate process from the training code, so a
training loop pays nothing for MLflow: it only writes TensorBoard events as it
would anyway. :class:`MetricForwarder` tails every log dir rank 0 registered
(``tensorboard/logdirs``), reads new events incrementally, and sends scalars
to MLflow with ``log_batch`` (at most 1000 per request) every ``interval``
seconds and once more, completely, when the job ends.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

MAX_BATCH = 1000
_KEY_OK = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_key(tag: str) -> str:
    """An MLflow-legal metric name for a TensorBoard tag."""
    return _KEY_OK.sub("_", tag)[:250] or "metric"


class MetricForwarder:
    def __init__(self, client, run_id: str, logdirs_file: Path, default_dirs: list[Path], interval: float = 2.0):
        self.client = client
        self.run_id = run_id
        self.logdirs_file = logdirs_file
        self.default_dirs = default_dirs
        self.interval = interval
        self._loaders: dict[Path, object] = {}
        self._pending: list = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0

    def _dirs(self) -> list[Path]:
        dirs = list(self.default_dirs)
        try:
            dirs += [Path(line) for line in self.logdirs_file.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            pass
        seen, out = set(), []
        for d in dirs:
            d = d.resolve()
            if d not in seen:
                seen.add(d)
                out.append(d)
        return out

    def _new_files(self) -> None:
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

        for d in self._dirs():
            if not d.is_dir():
                continue
            for path in sorted(d.glob("events.out.tfevents.*")):
                if path not in self._loaders:
                    self._loaders[path] = LegacyEventFileLoader(str(path))

    def collect(self) -> list:
        """Scalars written since the last call, as mlflow Metric objects."""
        from mlflow.entities import Metric

        self._new_files()
        metrics = []
        for loader in self._loaders.values():
            try:
                events = list(loader.Load())
            except Exception as e:  # a truncated record at the end of a file being written
                log.debug("reading events: %s", e)
                continue
            for event in events:
                if not event.HasField("summary"):
                    continue
                ts = int(event.wall_time * 1000)
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        number = float(value.simple_value)
                    elif value.HasField("tensor") and value.tensor.float_val:
                        number = float(value.tensor.float_val[0])
                    elif value.HasField("tensor") and value.tensor.double_val:
                        number = float(value.tensor.double_val[0])
                    else:
                        continue
                    metrics.append(Metric(metric_key(value.tag), number, ts, int(event.step)))
        return metrics

    def flush(self) -> int:
        """Send what was written since the last flush; unsent metrics stay pending on error."""
        self._pending.extend(self.collect())
        sent = 0
        while self._pending:
            batch = self._pending[:MAX_BATCH]
            self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
            del self._pending[:len(batch)]
            sent += len(batch)
            self.sent += len(batch)
        return sent

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception as e:  # MLflow briefly unreachable: keep the events, retry next round
                log.warning("could not forward metrics yet: %s", e)

    def start(self) -> "MetricForwarder":
        self._thread = threading.Thread(target=self._loop, name="danlu-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop the background loop and forward everything left; returns the total sent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for attempt in range(3):
            try:
                self.flush()
                break
            except Exception as e:
                log.warning("final metric flush failed (%s), retrying", e)
                time.sleep(1 + attempt)
        return self.sent
