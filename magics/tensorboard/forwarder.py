"""Forward TensorBoard scalars from a job's event files into its MLflow run.

Runs in the job runner, a separate process from the training code, so a
training loop pays nothing for MLflow: it only writes TensorBoard events as it
would anyway. :class:`MetricForwarder` tails every log dir rank 0 registered
(``tensorboard/logdirs``) plus the default dirs, reads new events
incrementally, and sends scalars with ``log_batch`` (at most 1000 per request)
every ``interval`` seconds and once more, completely, when the job ends.

What reaches MLflow, and what is reported instead:

* Names: every tag goes through :func:`~danlu.tensorboard.names.metric_key`; a
  changed name is noted.
* Values: any float, NaN and infinities included (MLflow stores NaN as NaN and
  clamps infinities to the largest double). Steps are int64 in the event
  format, which MLflow accepts as they are, negative ones included.
* Wall times that are not a time (NaN, infinite, negative, past int64
  milliseconds) are replaced by the time the point was read, and noted.
* A batch MLflow refuses (HTTP 400, e.g. ``INVALID_PARAMETER_VALUE``) is split
  until the refused points are found; only those are dropped, counted and
  noted, unless the run itself is gone (then everything waits, as below).
* Anything else (MLflow unreachable, 5xx, 401/403/404/429, a deleted run)
  keeps the points pending, retried with a backoff, in a buffer of at most
  ``max_pending`` points: when it is full the oldest are dropped and counted.
  The forwarder can start before the run exists and :meth:`attach` it later.
* :meth:`stop` sends everything left, however long MLflow takes to accept
  it, as long as it accepts: it gives up once MLflow has accepted nothing for
  ``final_timeout`` seconds, and what is still unsent then (all of it, when no
  run was ever attached) counts as dropped. A heavy job can end with much to
  send (MLflow on SQLite takes some 3,000 to 10,000 points a second; a loop can
  log 50,000), and a deadline would drop points MLflow is busy accepting.

While the job runs, the forwarding thread has a lower CPU priority (nice +10,
Linux) than the training processes beside it: on a busy node it takes the CPU
they leave. The final flush runs in a thread of its own at the runner's
priority: the job is over, there is no training left to yield to.

:meth:`MetricForwarder.health` reports all of this while the job runs. The
files read are written by the user's code, so they are opened without
following links or blocking, and must be regular files; the logdirs file is
read up to 1 MiB and 100 directories (:mod:`danlu.tensorboard.reader`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path

from danlu.errors import Conflict
from danlu.tensorboard import notes
from danlu.tensorboard.names import metric_key
from danlu.tensorboard.reader import READ_CHUNK, EventFile, LogDirs

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch request
MAX_NOTES = 20
MAX_BACKOFF = 60.0  # seconds between retries, at most
JOIN_GRACE = 1.0  # seconds stop() waits beyond final_timeout for the last bookkeeping
NICE = 10  # added to the forwarding thread's niceness
_MS_LIMIT = float(2**63)  # wall times in ms must be below this to fit MLflow's int64

# errors --------------------------------------------------------------------------------------------


class RunNotActive(Conflict):
    """MLflow refused points and the run is deleted or cannot be read: the points wait instead of being dropped."""

    default_reason = "run_not_active"


def _refused(error: BaseException) -> bool:
    """MLflow understood the request and refused its content (HTTP 400): sending it again cannot succeed."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow takes ~2 s; needed once a run is attached

    return isinstance(error, MlflowException) and error.get_http_status_code() == 400


class MetricForwarder:
    """Sends the scalars of a job's TensorBoard event files to its MLflow run, from a background thread.

    ``client`` and ``run_id`` may both be None: the forwarder then reads and
    buffers until :meth:`attach` gives it the run. ``logdirs_file`` lists more
    log dirs, one a line (rank 0 appends to it). ``max_pending`` bounds the
    points waiting for MLflow; ``final_timeout`` bounds how long :meth:`stop`
    retries. See the module docstring for what is sent, changed or dropped.
    """

    def __init__(
        self,
        client=None,
        run_id: str | None = None,
        logdirs_file: Path | None = None,
        default_dirs=(),
        interval: float = 2.0,
        *,
        max_pending: int = 1_000_000,
        final_timeout: float = 60.0,
    ):
        if (client is None) != (run_id is None):
            raise ValueError("client and run_id are given together, or both left None until attach()")
        if max_pending < 1 or interval <= 0 or final_timeout < 0:
            raise ValueError("max_pending and interval must be positive, final_timeout not negative")
        self.client = client
        self.run_id = run_id
        self.logdirs = LogDirs(logdirs_file, default_dirs)
        self.interval = interval
        self.max_pending = max_pending
        self.final_timeout = final_timeout
        # read and written by the thread that holds _work
        self._files: dict[str, EventFile] = {}
        self._keys: dict[str, str] = {}
        # shared with health(), attach() and stop(): under _lock
        self._lock = threading.Lock()
        self._work = threading.Lock()  # one reader and sender at a time
        self._pending: collections.deque[tuple] = collections.deque()  # (key, value, timestamp ms, step)
        self._in_flight = 0
        self._sent = 0
        self._dropped = 0
        self._notes: dict[tuple, list] = {}  # key -> [count or None, unit counted, text after the count]
        self._notes_left_out = False
        self._last_error: str | None = None
        self._retry_now = False
        self._abandoned = False  # stop() gave up on a thread stuck in a request
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline = 0.0
        self._limit_at = math.inf
        self._stop_at = 0.0
        self._stopped = False

    # the public surface -------------------------------------------------------------------------
    @property
    def sent(self) -> int:
        """Points MLflow accepted so far."""
        with self._lock:
            return self._sent

    def health(self) -> dict:
        """The run, the points sent, dropped and pending, short notes, and the error that keeps points pending."""
        with self._lock:
            said = [notes.render(*note) for note in self._notes.values()]
            if self._notes_left_out:
                said.append("more notes left out (see the runner log)")
            return {
                "run_id": self.run_id,
                "points_sent": self._sent,
                "points_dropped": self._dropped,
                "points_pending": len(self._pending) + self._in_flight,
                "notes": said,
                "last_error": self._last_error,
            }

    def attach(self, client, run_id: str) -> None:
        """Start sending to ``run_id`` (for a forwarder created before the run existed)."""
        if client is None or run_id is None:
            raise ValueError("attach() needs a client and a run id")
        with self._lock:
            if self.run_id is not None and self.run_id != run_id:
                raise ValueError(f"already attached to run {self.run_id}")
            self.client, self.run_id = client, run_id
            self._retry_now = True
        self._wake.set()

    def flush(self) -> int:
        """Read everything written since the last call and send all pending points; returns the points sent.

        Points MLflow refuses are dropped and noted. Any other failure leaves
        the rest pending and is raised. Before :meth:`attach` it only reads.
        """
        return self._attempt(send=True)

    def start(self) -> MetricForwarder:
        """Forward in a background thread every ``interval`` seconds, backing off while MLflow fails."""
        if self._thread is not None:
            raise RuntimeError("the forwarder was already started")
        self._thread = threading.Thread(target=self._loop, name="danlu-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self, limit: float | None = None) -> int:
        """Send what is left while MLflow accepts it, for at most ``limit`` seconds if given; returns the points sent.

        It gives up once MLflow has accepted nothing for ``final_timeout``
        seconds (down, refusing, or a request that does not return): the
        points unsent then count as dropped. Without a run (never attached)
        nothing can be sent: it reads to the end, counts the points as dropped
        and returns at once. Returns within ``final_timeout`` + 1 s of MLflow's
        last accepted batch, and within ``limit`` + 1 s (a job stopped with a
        grace period has only that long: what is left stays in its files).
        """
        with self._lock:
            if self._stopped:
                return self._sent
            self._stopped = True
        now = self._stop_at = time.monotonic()
        self._limit_at = now + limit if limit is not None else math.inf
        self._deadline = min(now + self.final_timeout, self._limit_at)
        self._stop.set()
        self._wake.set()
        # the forwarding thread hands over after its current request; the final flush is not niced
        self._thread = threading.Thread(target=self._final, name="danlu-metrics-final", daemon=True)
        self._thread.start()
        while True:  # the deadline moves on with every batch MLflow accepts
            self._thread.join(timeout=max(0.0, self._deadline - time.monotonic()) + JOIN_GRACE)
            if not self._thread.is_alive() or time.monotonic() >= self._deadline + JOIN_GRACE:
                break
        with self._lock:
            if self._thread.is_alive() and not self._abandoned:
                self._abandoned = True
                self._give_up(
                    f"the job's stop left {limit:g} s"
                    if self._deadline >= self._limit_at
                    else f"MLflow did not answer within the final {self.final_timeout:g} s"
                )
            return self._sent

    # the thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        _lower_priority()
        failures, retry_at = 0, 0.0
        while not self._stop.is_set():
            send = self.client is not None and time.monotonic() >= retry_at
            try:
                self._attempt(send)
                if send:
                    failures = 0
            except Exception as e:  # MLflow unreachable, or a bug reading files: keep the points, retry later
                failures += 1
                delay = min(self.interval * 2 ** min(failures, 16), MAX_BACKOFF)
                retry_at = time.monotonic() + delay
                log.warning("metrics not sent (attempt %d), retrying in %.0f s: %s", failures, delay, notes.describe(e))
            if self._wake.wait(self.interval):
                self._wake.clear()
            with self._lock:
                if self._retry_now:
                    self._retry_now, failures, retry_at = False, 0, 0.0

    def _final(self) -> None:
        """The last flush: retry until everything is sent or the deadline passes, then count the rest as dropped."""
        failures = 0
        while True:
            try:
                self._attempt(send=self.client is not None, final=True)
                with self._lock:
                    if not self._pending or self._abandoned:
                        break
            except Exception as e:
                failures += 1
                log.warning("final metric flush failed (attempt %d): %s", failures, notes.describe(e))
            remaining = self._deadline - time.monotonic()
            if remaining <= 0 or self._abandoned or self.client is None:  # no run to wait for
                break
            self._wake.wait(min(self.interval * 2 ** min(failures, 16), MAX_BACKOFF, remaining))
            self._wake.clear()
        if self._abandoned:
            return
        with self._work:
            try:
                self._drain(send=False)  # count what was never read, too
            except Exception as e:
                log.warning("reading the last events failed: %s", notes.describe(e))
        with self._lock:
            if not self._abandoned:
                if self.client is None:
                    self._give_up("the job had no MLflow run")
                else:
                    self._give_up(
                        (
                            f"the job's stop left {self._limit_at - self._stop_at:g} s"
                            if self._deadline >= self._limit_at
                            else f"MLflow accepted none for the final {self.final_timeout:g} s"
                        )
                        + (f" ({notes.clip(self._last_error, 100)})" if self._last_error else "")
                    )

    def _give_up(self, why: str) -> None:
        """Count every unsent point as dropped (with _lock held)."""
        unsent = len(self._pending) + self._in_flight
        self._pending.clear()
        self._in_flight = 0
        if unsent:
            self._dropped += unsent
            self._note(("unsent",), f" not sent: {why}", unsent)

    def _attempt(self, send: bool, final: bool = False) -> int:
        try:
            with self._work:
                sent = self._drain(send, final)
        except Exception as e:
            with self._lock:
                self._last_error = notes.describe(e)
            raise
        return sent

    def _drain(self, send: bool, final: bool = False) -> int:
        """Read every file to its end, a chunk at a time, sending after each chunk (with _work held)."""
        sent = 0
        while True:
            more = self._collect()
            if send:
                sent += self._send_pending(final)
            if not more or self._abandoned or (self._stop.is_set() and not final):  # the final flush goes on
                return sent

    # reading ------------------------------------------------------------------------------------
    def _collect(self) -> bool:
        """Read one chunk of every event file into the buffer; True when a file has more."""
        more = False
        paths = self.logdirs.event_files()
        if self.logdirs.problems:
            with self._lock:
                for key, text in self.logdirs.problems.items():
                    self._note(key, text)
            self.logdirs.problems.clear()
        for path in paths:
            file = self._files.get(path)
            if file is None:
                file = self._files[path] = EventFile(path)
            if file.skipped:
                continue
            events, file_more = file.read(READ_CHUNK)
            more = more or file_more
            if file.skipped or file.problems:
                name = notes.quoted(os.path.basename(path))
                with self._lock:
                    if file.skipped:
                        self._note(("file", path), f"event file {name} skipped: {file.skipped}")
                    for problem, n in file.problems.items():
                        self._note(("record", path, problem), f" in {name} skipped: {problem}", n, "record")
                file.problems.clear()
            if events:
                self._buffer(self._to_points(events))
        return more

    def _to_points(self, events: list) -> list[tuple]:
        keys, points = self._keys, []
        for wall_time, step, values in events:
            ms = wall_time * 1000.0
            usable = 0.0 <= ms < _MS_LIMIT  # false for NaN too
            timestamp = int(ms) if usable else int(time.time() * 1000)
            for tag, value in values:
                key = keys.get(tag)
                if key is None:
                    key = self._key(tag)
                if not usable:
                    with self._lock:
                        self._note(
                            ("time", key),
                            f" of {notes.quoted(key)} had no usable wall time "
                            f"({wall_time!r}): recorded with the time they were read",
                            1,
                        )
                points.append((key, value, timestamp, step))
        return points

    def _key(self, tag: str) -> str:
        if len(self._keys) >= 10_000:  # a tag per step: keep the cache bounded
            self._keys.clear()
        key = self._keys[tag] = metric_key(tag)
        if key != tag:
            with self._lock:
                self._note(("renamed", tag), f"metric name {notes.quoted(tag)} recorded as {notes.quoted(key)}")
        return key

    def _buffer(self, points: list[tuple]) -> None:
        with self._lock:
            if self._abandoned:
                return
            self._pending.extend(points)
            excess = min(len(self._pending) + self._in_flight - self.max_pending, len(self._pending))
            if excess > 0:
                for _ in range(excess):
                    self._pending.popleft()
                self._dropped += excess
                self._note(
                    ("full",), f" dropped, the oldest: more than {self.max_pending} points waited for MLflow", excess
                )

    # sending ------------------------------------------------------------------------------------
    def _send_pending(self, final: bool = False) -> int:
        """Send the buffer in batches; refused points are dropped, any other error puts the rest back and raises.

        In the final flush each accepted batch moves the deadline to ``final_timeout`` from now.
        """
        from mlflow.entities import Metric  # deferred: mlflow takes ~2 s; needed once a run is attached

        sent, run_checked, batches = 0, False, 0
        while True:
            with self._lock:
                if self._abandoned or self.client is None or not self._pending:
                    return sent
                if batches and final and time.monotonic() >= self._deadline:
                    return sent  # past the deadline after at least one try
                if self._stop.is_set() and not final:
                    return sent  # the final flush takes over
                batches += 1
                client, run_id = self.client, self.run_id
                batch = [self._pending.popleft() for _ in range(min(MAX_BATCH, len(self._pending)))]
                self._in_flight = len(batch)
            work = [batch]  # parts still to send, the next one last
            part: list = []
            try:
                while work:
                    part = work.pop()
                    try:
                        client.log_batch(run_id, metrics=[Metric(*p) for p in part], synchronous=True)
                    except Exception as error:
                        if not _refused(error):
                            raise
                        if not run_checked:
                            self._check_run(client, run_id, error)
                            run_checked = True
                        if len(part) > 1:
                            middle = len(part) // 2
                            work += [part[middle:], part[:middle]]
                        else:
                            self._refuse(part[0], error)
                        continue
                    with self._lock:
                        if self._abandoned:
                            return sent
                        self._sent += len(part)
                        self._in_flight -= len(part)
                        self._last_error = None
                        if self._stop.is_set():
                            self._deadline = max(
                                self._deadline, min(time.monotonic() + self.final_timeout, self._limit_at)
                            )
                    sent += len(part)
            except BaseException:
                with self._lock:
                    if not self._abandoned:
                        unsent = part + [p for rest in reversed(work) for p in rest]
                        self._pending.extendleft(reversed(unsent))
                        self._in_flight = 0
                raise

    def _check_run(self, client, run_id: str, error: BaseException) -> None:
        """Raise unless the run takes points: a refusal from a deleted run is no reason to drop them."""
        try:
            stage = client.get_run(run_id).info.lifecycle_stage
        except Exception as e:
            raise RunNotActive(f"run {run_id} refused metrics and could not be read: {notes.describe(e)}") from error
        if stage != "active":
            raise RunNotActive(f"run {run_id} is {stage}: {notes.describe(error)}") from error

    def _refuse(self, point: tuple, error: BaseException) -> None:
        reason = notes.describe(error, 120)
        with self._lock:
            if self._abandoned:
                return
            self._in_flight -= 1
            self._dropped += 1
            self._note(
                ("refused", point[0], getattr(error, "error_code", "")),
                f" of {notes.quoted(point[0])} dropped: MLflow refused them ({reason})",
                1,
            )

    # notes --------------------------------------------------------------------------------------
    def _note(self, key: tuple, text: str, count: int | None = None, unit: str = "point") -> None:
        """Add to a note, or add a note (with _lock held); at most MAX_NOTES are kept.

        With a count the note reads "<count> <unit>s<text>" and later counts add up.
        """
        note = self._notes.get(key)
        if note is not None:
            if count is not None:
                note[0] += count
            return
        if len(self._notes) >= MAX_NOTES - 1:
            self._notes_left_out = True
            log.info("metric forwarding: %s", notes.render(count, unit, text))
            return
        self._notes[key] = [count, unit, text]
        log.warning("metric forwarding: %s", notes.render(count, unit, text))


def _lower_priority() -> None:
    """Make the calling thread yield the CPU to the training processes (Linux: niceness is per thread)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICE))
    except OSError:  # not permitted here: forwarding works the same
        pass
