"""Pure tests of metric forwarding and of the SummaryWriter patch in jobs.

:class:`danlu.tensorboard.forwarder.MetricForwarder` reads real TensorBoard event files (written
here with ``torch.utils.tensorboard.SummaryWriter``, or record by record where a
test needs a file TensorBoard would not write) and sends their scalars to fakes
of the MLflow client named by what MLflow does (accepts, is down, refuses some
names, lost the run, hangs), and, in two tests, to a real MLflow store on
SQLite. :func:`danlu.tensorboard.names.metric_key` is property-tested against MLflow's own
validator. :mod:`danlu.autolog` is checked for where an unconfigured
``SummaryWriter()`` writes inside a job and which log dirs it registers for the
forwarder.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import struct
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from IPython import get_ipython
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INTERNAL_ERROR,
    INVALID_PARAMETER_VALUE,
    PERMISSION_DENIED,
    TEMPORARILY_UNAVAILABLE,
)
from mlflow.utils import validation
from mlflow.utils.validation import _validate_metric
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard import writer as tensorboard_writer

from danlu import autolog
from danlu.tensorboard.forwarder import MAX_BATCH, MAX_NOTES, NICE, MetricForwarder, RunNotActive
from danlu.tensorboard.names import metric_key

RUN = "run-1"


# fakes of the MLflow client -------------------------------------------------------------------------


class RecordingClient:
    """MLflow accepting every batch. It records them and fails the test on a point MLflow's validator refuses."""

    def __init__(self):
        self.batches: list[list] = []
        self.calls = 0

    def log_batch(self, run_id, metrics, synchronous):
        assert run_id == RUN and synchronous is True
        assert len(metrics) <= MAX_BATCH
        self.calls += 1
        self.accept(metrics)
        for m in metrics:
            try:
                _validate_metric(m.key, m.value, m.timestamp, m.step)
            except MlflowException as e:
                raise AssertionError(f"the forwarder sent a point MLflow refuses: {e}") from None
            assert isinstance(m.step, int) and isinstance(m.timestamp, int) and 0 <= m.timestamp < 2**63
        self.batches.append(list(metrics))

    def accept(self, metrics) -> None:
        """What a fake does before accepting: raise to refuse, fail or hang."""

    def get_run(self, run_id):
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, lifecycle_stage="active"))

    @property
    def points(self) -> list[tuple]:
        return [(m.key, m.step, m.value) for batch in self.batches for m in batch]


class DownClient(RecordingClient):
    """Accepts ``after`` calls, then MLflow is unreachable for ``failures`` calls (raising ``error``), then back."""

    def __init__(self, failures: int = 1, after: int = 0, error=lambda: ConnectionError("MLflow is unreachable")):
        super().__init__()
        self.failures = failures
        self.after = after
        self.error = error

    def accept(self, metrics):
        if self.after < self.calls <= self.after + self.failures:
            raise self.error()


class RejectingClient(RecordingClient):
    """MLflow refusing every batch that holds a point named in ``bad``, as its validator names the first bad one."""

    def __init__(self, bad):
        super().__init__()
        self.bad = set(bad)

    def accept(self, metrics):
        for i, m in enumerate(metrics):
            if m.key in self.bad:
                raise MlflowException(
                    f"Invalid value {m.key!r} for parameter 'metrics[{i}].name' supplied", INVALID_PARAMETER_VALUE
                )


class SizeLimitClient(RecordingClient):
    """MLflow refusing requests over ``limit`` points, as it refuses log_batch bodies over 1 MB."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def accept(self, metrics):
        if len(metrics) > self.limit:
            raise MlflowException("Batched logging API requests must be at most 1000000 bytes", INVALID_PARAMETER_VALUE)


class DeletedRunClient(RecordingClient):
    """The run was deleted in the MLflow UI: MLflow refuses every point (with a 400, as its stores do)."""

    def accept(self, metrics):
        raise MlflowException(
            f"The run {RUN} must be in the 'active' state. Current state is deleted.", INVALID_PARAMETER_VALUE
        )

    def get_run(self, run_id):
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, lifecycle_stage="deleted"))


class HangingClient(RecordingClient):
    """A request that does not return until ``release`` is set (a server that accepted the connection and hangs)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def accept(self, metrics):
        self.entered.set()
        self.release.wait(60)


class SlowClient(RecordingClient):
    """MLflow accepting every batch, each after ``delay`` seconds (a busy server, taking a heavy job's points)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay = delay

    def accept(self, metrics):
        time.sleep(self.delay)


# event files ----------------------------------------------------------------------------------------


def write_scalars(log_dir, tag: str, steps) -> None:
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        for step in steps:
            writer.add_scalar(tag, step / 2, step)


def record(event: event_pb2.Event | bytes) -> bytes:
    """One TFRecord, framed with TensorBoard's own CRC."""
    payload = event if isinstance(event, bytes) else event.SerializeToString()
    header = struct.pack("<Q", len(payload))
    return header + struct.pack("<I", masked_crc32c(header)) + payload + struct.pack("<I", masked_crc32c(payload))


def scalar(tag: str, value: float, step: int, wall_time: float = 1.7e9) -> event_pb2.Event:
    return event_pb2.Event(
        wall_time=wall_time,
        step=step,
        summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)]),
    )


def event_file(log_dir, *records: bytes, name: str = "events.out.tfevents.1.host") -> str:
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, name)
    with open(path, "ab") as f:
        f.write(b"".join(records))
    return path


def forwarder(client, tmp_path, *dirs, **options) -> MetricForwarder:
    return MetricForwarder(client, None if client is None else RUN, tmp_path / "logdirs", list(dirs), **options)


def wait_for_thread(name: str) -> None:
    """Wait for the forwarder's thread called ``name`` to end (after its hanging request was released)."""
    threads = [thread for thread in threading.enumerate() if thread.name == name]
    assert threads
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


# MetricForwarder: reading and sending -----------------------------------------------------------------


def test_every_point_is_forwarded_once(tmp_path):
    log_dir = tmp_path / "tb"
    write_scalars(log_dir, "loss", range(5))
    write_scalars(log_dir / "eval", "accuracy", range(3))
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir, log_dir / "eval")

    assert fwd.flush() == 8
    assert fwd.flush() == 0

    assert sorted(client.points) == sorted(
        [("loss", s, s / 2) for s in range(5)] + [("accuracy", s, s / 2) for s in range(3)]
    )
    assert fwd.sent == 8


def test_points_written_later_are_sent_by_the_next_flush(tmp_path):
    log_dir = tmp_path / "tb"
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir)
    writer = SummaryWriter(log_dir=str(log_dir))
    writer.add_scalar("loss", 1.0, 0)
    writer.flush()
    fwd.flush()

    writer.add_scalar("loss", 0.5, 1)
    writer.add_scalar("loss", 0.25, 2)
    writer.close()
    fwd.flush()

    assert [[(m.step, m.value) for m in batch] for batch in client.batches] == [[(0, 1.0)], [(1, 0.5), (2, 0.25)]]


def test_only_scalars_are_forwarded(tmp_path):
    import numpy as np

    with SummaryWriter(log_dir=str(tmp_path / "tb")) as writer:
        writer.add_scalar("loss", 0.5, 0)
        writer.add_scalar("lr", 0.25, 0, new_style=True)
        writer.add_scalar("momentum", 0.75, 0, new_style=True, double_precision=True)
        writer.add_pr_curve("pr", np.array([0, 1, 1]), np.array([0.1, 0.8, 0.6]), 0)
        writer.add_histogram("weights", np.array([0.1, 0.2, 0.3]), 0)
        writer.add_text("note", "hello", 0)
    client = RecordingClient()

    assert forwarder(client, tmp_path, tmp_path / "tb").flush() == 3
    assert sorted(client.points) == [("loss", 0, 0.5), ("lr", 0, 0.25), ("momentum", 0, 0.75)]


def test_a_record_still_being_written_is_read_once_complete(tmp_path):
    first, second = record(scalar("loss", 1.0, 0)), record(scalar("loss", 2.0, 1))
    path = event_file(tmp_path / "tb", first, second[:7])
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == 1
    with open(path, "ab") as f:
        f.write(second[7:-2])
    assert fwd.flush() == 0
    with open(path, "ab") as f:
        f.write(second[-2:])
    assert fwd.flush() == 1

    assert client.points == [("loss", 0, 1.0), ("loss", 1, 2.0)]


def test_log_dirs_registered_in_the_logdirs_file_are_read(tmp_path):
    log_dir = tmp_path / "elsewhere"
    write_scalars(log_dir, "loss", range(2))
    (tmp_path / "logdirs").write_text(f"{log_dir}\n\n{log_dir}\n")
    client = RecordingClient()

    assert forwarder(client, tmp_path).flush() == 2


def test_batches_hold_at_most_1000_metrics(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(2 * MAX_BATCH + 500))
    client = RecordingClient()

    forwarder(client, tmp_path, tmp_path / "tb").flush()

    assert [len(batch) for batch in client.batches] == [MAX_BATCH, MAX_BATCH, 500]
    assert [m.step for batch in client.batches for m in batch] == list(range(2 * MAX_BATCH + 500))


def test_values_mlflow_accepts_are_sent_as_they_are(tmp_path):
    """MLflow stores NaN and clamps infinities itself; steps are int64 in events, negative ones included."""
    event_file(
        tmp_path / "tb",
        record(scalar("loss", math.nan, -3)),
        record(scalar("loss", math.inf, 0)),
        record(scalar("loss", -math.inf, 2**63 - 1)),
    )
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == 3

    sent = [(m.step, m.value) for m in client.batches[0]]
    assert sent[0][0] == -3 and math.isnan(sent[0][1])
    assert sent[1:] == [(0, math.inf), (2**63 - 1, -math.inf)]
    assert fwd.health()["points_dropped"] == 0


@pytest.mark.parametrize("wall_time", [math.nan, math.inf, -1.0, 1e300])
def test_an_unusable_wall_time_is_replaced_by_the_time_of_reading(tmp_path, wall_time):
    event_file(
        tmp_path / "tb",
        record(scalar("loss", 1.0, 0, wall_time=wall_time)),
        record(scalar("loss", 2.0, 1, wall_time=1.7e9)),
    )
    client = RecordingClient()  # checks every timestamp with MLflow's validator
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == 2

    assert [m.timestamp for m in client.batches[0]][1] == 1_700_000_000_000
    assert client.batches[0][0].timestamp > 1_700_000_000_000  # now
    assert any("1 point of 'loss' had no usable wall time" in note for note in fwd.health()["notes"])


# MLflow refusing points --------------------------------------------------------------------------------


def test_points_mlflow_refuses_are_dropped_and_the_rest_sent(tmp_path):
    event_file(
        tmp_path / "tb",
        *[record(scalar("loss", float(s), s)) for s in range(10)],
        record(scalar("bad", 1.0, 5)),
        record(scalar("bad", 1.0, 6)),
    )
    client = RejectingClient(bad={"bad"})
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == 10

    assert sorted(step for key, step, _ in client.points if key == "loss") == list(range(10))
    health = fwd.health()
    assert (health["points_sent"], health["points_dropped"], health["points_pending"]) == (10, 2, 0)
    assert health["notes"] == [
        "2 points of 'bad' dropped: MLflow refused them (Invalid value 'bad' for parameter 'metrics[0].name' supplied)"
    ]
    assert health["last_error"] is None


def test_a_refused_point_does_not_block_later_ones(tmp_path):
    log_dir = tmp_path / "tb"
    event_file(log_dir, record(scalar("bad", 1.0, 0)))
    client = RejectingClient(bad={"bad"})
    fwd = forwarder(client, tmp_path, log_dir)
    fwd.flush()

    write_scalars(log_dir, "loss", range(3))
    assert fwd.flush() == 3

    assert client.points == [("loss", s, s / 2) for s in range(3)]
    assert fwd.health()["points_dropped"] == 1


def test_a_batch_refused_as_too_large_is_split_and_all_sent(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH))
    client = SizeLimitClient(limit=300)
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == MAX_BATCH

    assert sorted(step for _, step, _ in client.points) == list(range(MAX_BATCH))
    assert fwd.health()["points_dropped"] == 0


def test_points_wait_while_the_run_is_deleted(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(4))
    fwd = forwarder(DeletedRunClient(), tmp_path, tmp_path / "tb")

    with pytest.raises(RunNotActive):
        fwd.flush()

    health = fwd.health()
    assert (health["points_dropped"], health["points_pending"]) == (0, 4)
    assert "is deleted" in health["last_error"]


# MLflow unreachable ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        lambda: ConnectionError("MLflow is unreachable"),
        lambda: MlflowException(
            "API request to http://mlflow/api/2.0/mlflow/runs/log-batch failed with exception Max retries exceeded"
        ),  # how MLflow's REST client reports a connection error
        lambda: MlflowException("upstream connect error", INTERNAL_ERROR),
        lambda: MlflowException("try again later", TEMPORARILY_UNAVAILABLE),
        lambda: MlflowException("token expired", PERMISSION_DENIED),
    ],
    ids=["connection", "rest-connection", "500", "503", "403"],
)
def test_metrics_stay_pending_when_log_batch_fails(tmp_path, error):
    write_scalars(tmp_path / "tb", "loss", range(4))
    client = DownClient(error=error)
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    with pytest.raises(Exception):  # noqa: B017 - whatever the client raised
        fwd.flush()
    assert client.points == []
    health = fwd.health()
    assert (health["points_pending"], health["points_dropped"]) == (4, 0)
    assert health["last_error"]

    assert fwd.flush() == 4
    assert client.points == [("loss", s, s / 2) for s in range(4)]
    assert fwd.health()["last_error"] is None


def test_partly_sent_flush_resumes_where_it_stopped(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH + 200))
    client = DownClient(after=1)  # first batch goes through, the second fails
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    with pytest.raises(ConnectionError):
        fwd.flush()
    fwd.flush()

    assert [m.step for batch in client.batches for m in batch] == list(range(MAX_BATCH + 200))


def test_sent_counts_batches_sent_before_a_failure(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH + 200))
    fwd = forwarder(DownClient(after=1), tmp_path, tmp_path / "tb")

    with pytest.raises(ConnectionError):
        fwd.flush()
    assert fwd.sent == MAX_BATCH
    fwd.flush()

    assert fwd.sent == MAX_BATCH + 200


def test_the_buffer_keeps_the_newest_points_before_the_run_exists(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(8))
    fwd = forwarder(None, tmp_path, tmp_path / "tb", max_pending=5)

    assert fwd.flush() == 0
    health = fwd.health()
    assert (health["run_id"], health["points_pending"], health["points_dropped"]) == (None, 5, 3)
    assert health["notes"] == ["3 points dropped, the oldest: more than 5 points waited for MLflow"]

    client = RecordingClient()
    fwd.attach(client, RUN)
    assert fwd.flush() == 5
    assert [step for _, step, _ in client.points] == [3, 4, 5, 6, 7]
    assert fwd.health()["run_id"] == RUN


def test_a_forwarder_started_before_the_run_sends_once_attached(tmp_path):
    log_dir = tmp_path / "tb"
    fwd = forwarder(None, tmp_path, log_dir, interval=0.01).start()
    write_scalars(log_dir, "loss", range(3))
    client = RecordingClient()

    fwd.attach(client, RUN)
    write_scalars(log_dir, "accuracy", range(2))

    assert fwd.stop() == 5
    assert sorted(client.points) == sorted(
        [("loss", s, s / 2) for s in range(3)] + [("accuracy", s, s / 2) for s in range(2)]
    )


def test_a_forwarder_sends_to_one_run(tmp_path):
    with pytest.raises(ValueError):
        MetricForwarder(RecordingClient(), None, tmp_path / "logdirs", [])
    fwd = forwarder(RecordingClient(), tmp_path)
    fwd.attach(fwd.client, RUN)  # the same run again: nothing changes

    with pytest.raises(ValueError, match="already attached to run run-1"):
        fwd.attach(RecordingClient(), "run-2")


def test_stop_retries_through_an_outage(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(3))
    client = DownClient(failures=3)
    fwd = forwarder(client, tmp_path, tmp_path / "tb", interval=0.01).start()

    assert fwd.stop() == 3
    assert client.points == [("loss", s, s / 2) for s in range(3)]
    assert fwd.health()["points_dropped"] == 0


def test_stop_gives_up_after_the_final_timeout(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(3))
    fwd = forwarder(DownClient(failures=10**9), tmp_path, tmp_path / "tb", interval=0.01, final_timeout=0.2)

    assert fwd.stop() == 0

    health = fwd.health()
    assert (health["points_sent"], health["points_dropped"], health["points_pending"]) == (0, 3, 0)
    assert health["notes"] == ["3 points not sent: MLflow accepted none for the final 0.2 s (MLflow is unreachable)"]


def test_stop_sends_everything_while_mlflow_accepts_however_long_it_takes(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(4 * MAX_BATCH))
    client = SlowClient(delay=0.2)
    fwd = forwarder(client, tmp_path, tmp_path / "tb", final_timeout=0.1)  # each batch takes longer than that

    assert fwd.stop() == 4 * MAX_BATCH
    assert fwd.health()["points_dropped"] == 0 and len(client.batches) == 4


def test_a_limit_bounds_the_final_flush_and_says_so(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(4 * MAX_BATCH))
    fwd = forwarder(SlowClient(delay=0.2), tmp_path, tmp_path / "tb", final_timeout=60)

    sent = fwd.stop(limit=0.3)  # a stopped job's grace

    health = fwd.health()
    assert sent < 4 * MAX_BATCH and health["points_dropped"] == 4 * MAX_BATCH - sent
    assert health["notes"] == [f"{4 * MAX_BATCH - sent} points not sent: the job's stop left 0.3 s"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="niceness is per thread on Linux")
def test_the_forwarding_thread_yields_the_cpu_to_training(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(3))
    niceness = []

    class Client(RecordingClient):
        def accept(self, metrics):
            niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    own = os.getpriority(os.PRIO_PROCESS, 0)
    fwd = forwarder(Client(), tmp_path, tmp_path / "tb", interval=60).start()  # one attempt, then waits
    deadline = time.monotonic() + 30
    while fwd.sent < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    write_scalars(tmp_path / "tb", "loss", range(3, 6))  # left for the final flush
    fwd.stop()

    assert niceness == [min(19, own + NICE), own]  # while the job runs; after it, at the runner's priority


def test_stop_without_a_run_counts_everything_as_dropped(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(3))
    fwd = forwarder(None, tmp_path, tmp_path / "tb")

    assert fwd.stop() == 0

    health = fwd.health()
    assert (health["points_dropped"], health["points_pending"]) == (3, 0)
    assert health["notes"] == ["3 points not sent: the job had no MLflow run"]


def test_stop_returns_while_a_request_hangs(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(3))
    client = HangingClient()
    fwd = forwarder(client, tmp_path, tmp_path / "tb", final_timeout=0.1)

    try:
        assert fwd.stop() == 0
        assert client.entered.is_set()
        health = fwd.health()
        assert (health["points_sent"], health["points_dropped"], health["points_pending"]) == (0, 3, 0)
    finally:
        client.release.set()
    wait_for_thread("danlu-metrics-final")
    assert fwd.health()["points_sent"] == 0  # counted as dropped once: a late answer changes nothing


# health -------------------------------------------------------------------------------------------------


def test_notes_are_bounded(tmp_path):
    event_file(tmp_path / "tb", *[record(scalar(f"bad name {i}!", 1.0, 0)) for i in range(3 * MAX_NOTES)])
    fwd = forwarder(RecordingClient(), tmp_path, tmp_path / "tb")
    fwd.flush()

    notes = fwd.health()["notes"]
    assert len(notes) == MAX_NOTES
    assert notes[0] == f"metric name 'bad name 0!' recorded as '{metric_key('bad name 0!')}'"
    assert notes[-1] == "more notes left out (see the runner log)"


@pytest.mark.timeout(60)
def test_health_can_be_read_while_the_forwarder_runs(tmp_path):
    write_scalars(tmp_path / "tb", "loss", range(MAX_BATCH + 10))
    fwd = forwarder(RecordingClient(), tmp_path, tmp_path / "tb", interval=0.01).start()
    health = fwd.health()
    while health["points_sent"] < MAX_BATCH + 10:
        assert health["points_sent"] + health["points_pending"] <= MAX_BATCH + 10
        health = fwd.health()
    fwd.stop()

    assert health == {
        "run_id": RUN,
        "points_sent": MAX_BATCH + 10,
        "points_dropped": 0,
        "points_pending": 0,
        "notes": [],
        "last_error": None,
    }


# files written by the user's code --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_as_logdirs_file_is_ignored_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "logdirs")
    write_scalars(tmp_path / "tb", "loss", range(2))
    fwd = forwarder(RecordingClient(), tmp_path, tmp_path / "tb")

    assert fwd.flush() == 2
    assert fwd.health()["notes"] == ["logdirs ignored: not a regular file"]


def test_a_link_as_logdirs_file_is_ignored(tmp_path):
    write_scalars(tmp_path / "elsewhere", "loss", range(2))
    (tmp_path / "real").write_text(f"{tmp_path / 'elsewhere'}\n")
    (tmp_path / "logdirs").symlink_to(tmp_path / "real")

    fwd = forwarder(RecordingClient(), tmp_path)
    assert fwd.flush() == 0
    assert fwd.health()["notes"] == ["logdirs ignored: not a regular file"]


def test_only_the_first_mib_of_the_logdirs_file_is_read(tmp_path):
    write_scalars(tmp_path / "late", "loss", range(2))
    filler = "".join(f"{tmp_path}/missing-{i:06d}/{'x' * 60}\n" for i in range(20_000))  # > 1 MiB
    (tmp_path / "logdirs").write_text(filler + f"{tmp_path / 'late'}\n")

    fwd = forwarder(RecordingClient(), tmp_path)
    assert fwd.flush() == 0
    assert "logdirs: only its first 1 MiB is read" in fwd.health()["notes"]


def test_only_100_directories_of_the_logdirs_file_are_read(tmp_path):
    dirs = [tmp_path / f"d{i:03d}" for i in range(101)]
    for i, d in enumerate(dirs):
        event_file(d, record(scalar("loss", 1.0, i)))
    (tmp_path / "logdirs").write_text("".join(f"{d}\n" for d in dirs))
    client = RecordingClient()
    fwd = forwarder(client, tmp_path)

    assert fwd.flush() == 100
    assert sorted(step for _, step, _ in client.points) == list(range(100))
    assert fwd.health()["notes"] == ["logdirs: only its first 100 directories are read"]


@pytest.mark.timeout(60)
def test_event_files_that_are_not_regular_files_are_skipped(tmp_path):
    log_dir = tmp_path / "tb"
    event_file(log_dir, record(scalar("loss", 1.0, 0)))
    os.mkfifo(log_dir / "events.out.tfevents.2.fifo")
    other = event_file(tmp_path / "other", record(scalar("secret", 1.0, 0)))
    os.symlink(other, log_dir / "events.out.tfevents.3.link")
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir)

    assert fwd.flush() == 1
    assert client.points == [("loss", 0, 1.0)]
    assert fwd.health()["notes"] == [
        "event file 'events.out.tfevents.2.fifo' skipped: not a regular file",
        "event file 'events.out.tfevents.3.link' skipped: not a regular file",
    ]


def test_corrupt_and_huge_records_are_skipped(tmp_path):
    log_dir = tmp_path / "tb"
    bad_crc = bytearray(record(scalar("loss", 9.0, 1)))
    bad_crc[-1] ^= 0xFF
    huge = 65 << 20
    header = struct.pack("<Q", huge)
    path = event_file(
        log_dir, record(scalar("loss", 1.0, 0)), bytes(bad_crc), header + struct.pack("<I", masked_crc32c(header))
    )
    with open(path, "r+b") as f:  # a sparse 65 MiB record (an image, say), then a scalar
        f.truncate(os.path.getsize(path) + huge + 4)
        f.seek(0, os.SEEK_END)
        f.write(record(scalar("loss", 3.0, 3)))
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, log_dir)

    assert fwd.flush() == 2
    assert client.points == [("loss", 0, 1.0), ("loss", 3, 3.0)]
    assert fwd.health()["notes"] == [
        "1 record in 'events.out.tfevents.1.host' skipped: corrupt",
        "1 record in 'events.out.tfevents.1.host' skipped: larger than 64 MiB",
    ]


def test_a_file_with_a_corrupt_length_is_read_up_to_it(tmp_path):
    good = record(scalar("loss", 1.0, 0))
    broken = bytearray(record(scalar("loss", 2.0, 1)))
    broken[0] ^= 0xFF
    event_file(tmp_path / "tb", good, bytes(broken), record(scalar("loss", 3.0, 2)))
    client = RecordingClient()
    fwd = forwarder(client, tmp_path, tmp_path / "tb")

    assert fwd.flush() == 1
    assert fwd.flush() == 0
    assert client.points == [("loss", 0, 1.0)]
    assert fwd.health()["notes"] == [
        f"event file 'events.out.tfevents.1.host' skipped: corrupt record at byte {len(good)}"
    ]


# a real MLflow store --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_client(tmp_path_factory):
    """A real MLflow tracking store on SQLite (created once: its migrations take seconds)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}")
    client.create_experiment("events")
    return client


@pytest.fixture
def mlflow_store(mlflow_client):
    """The real store and a new run in it."""
    experiment_id = mlflow_client.get_experiment_by_name("events").experiment_id
    return mlflow_client, mlflow_client.create_run(experiment_id).info.run_id


def history(client, run_id, key) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_names_mlflow_refused_no_longer_block_later_metrics(tmp_path, mlflow_store):
    client, run_id = mlflow_store
    log_dir = tmp_path / "tb"
    odd_tags = ["a//b", "/x", "x/", "..", "", "acc@top-1 (val)", "x" * 300]
    event_file(
        log_dir,
        *[record(scalar(tag, 1.0, 0)) for tag in odd_tags],
        *[record(scalar("loss", s / 2, s)) for s in range(5)],
    )
    fwd = MetricForwarder(client, run_id, tmp_path / "logdirs", [log_dir])

    assert fwd.flush() == len(odd_tags) + 5
    event_file(log_dir, *[record(scalar("loss", s / 2, s)) for s in range(5, 8)])
    assert fwd.flush() == 3

    assert history(client, run_id, "loss") == [(s, s / 2) for s in range(8)]
    for tag in odd_tags:
        assert history(client, run_id, metric_key(tag)) == [(0, 1.0)]
    health = fwd.health()
    assert (health["points_dropped"], health["points_pending"]) == (0, 0)


def test_points_a_real_store_refuses_are_dropped_and_the_rest_recorded(tmp_path, mlflow_store, monkeypatch):
    client, run_id = mlflow_store
    # a tracking server on Windows refuses ':' in names, which the rules of Linux (and metric_key) allow
    monkeypatch.setattr(validation, "is_windows", lambda: True)
    log_dir = tmp_path / "tb"
    event_file(
        log_dir,
        *[record(scalar("loss", s / 2, s)) for s in range(3)],
        record(scalar("top:1", 0.5, 0)),
        *[record(scalar("loss", s / 2, s)) for s in range(3, 6)],
    )
    fwd = MetricForwarder(client, run_id, tmp_path / "logdirs", [log_dir])

    assert fwd.flush() == 6

    assert history(client, run_id, "loss") == [(s, s / 2) for s in range(6)]
    health = fwd.health()
    assert health["points_dropped"] == 1
    assert health["notes"][0].startswith("1 point of 'top:1' dropped: MLflow refused them (Invalid value")


# metric_key ----------------------------------------------------------------------------------------


def suffix(tag: str) -> str:
    return "_" + hashlib.sha256(tag.encode()).hexdigest()[:8]


@pytest.mark.parametrize(
    ("tag", "key"),
    [
        ("loss/train", "loss/train"),
        ("eval/top-1 acc.", "eval/top-1 acc."),
        ("time:epoch", "time:epoch"),
        ("损失/训练", "损失/训练"),
        ("acc@top-1 (val)", "acc_top-1 _val_" + suffix("acc@top-1 (val)")),
        ("a//b", "a/b" + suffix("a//b")),
        ("/x", "x" + suffix("/x")),
        ("x/", "x" + suffix("x/")),
        ("a/./b/../c", "a/b/c" + suffix("a/./b/../c")),
        ("..", "metric" + suffix("..")),
        ("..a/b", "_..a/b" + suffix("..a/b")),
        ("", "metric" + suffix("")),
        ("loss\n", "loss_" + suffix("loss\n")),
        ("x" * 300, "x" * 241 + suffix("x" * 300)),
    ],
)
def test_tags_become_legal_metric_names(tag, key):
    assert metric_key(tag) == key


def test_a_very_long_tag_is_cut_to_mlflows_limit():
    tag = "é" * 10_000
    assert metric_key(tag) == "é" * 241 + suffix(tag)
    assert len(metric_key(tag)) == 250


PATHISH = st.text(alphabet=st.sampled_from(list("/./.._- :a\n\té损@")), max_size=40)
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=300)
LONG = st.builds(lambda text, n: (text * n)[:n], st.text(min_size=1, max_size=5), st.integers(240, 10_000))
TAGS = st.one_of(PATHISH, ANY_TEXT, LONG)
PROPERTIES = settings(max_examples=300, deadline=None, derandomize=True, database=None)


def mlflow_accepts(name: str) -> bool:
    try:
        _validate_metric(name, 0.0, 0, 0)
    except MlflowException:
        return False
    return True


@PROPERTIES
@given(TAGS)
@example("\ud800")
@example("a" * 241 + "/..")
@example("/" * 300 + "x")
def test_every_tag_becomes_a_name_mlflow_accepts(tag):
    assert mlflow_accepts(metric_key(tag))


@PROPERTIES
@given(TAGS)
@example("0\n")
def test_a_name_mlflow_accepts_is_kept(tag):
    # MLflow's pattern ends in $, which lets one trailing newline through; metric_key changes that name
    assert (metric_key(tag) == tag) == (mlflow_accepts(tag) and not tag.endswith("\n"))


@PROPERTIES
@given(TAGS, TAGS)
@example("a//b", "a/b")
@example("a b", "a@b")
def test_distinct_tags_get_distinct_names(one, other):
    if one != other:
        assert metric_key(one) != metric_key(other)


# autolog: SummaryWriter() inside a job ----------------------------------------------


@pytest.fixture
def job(tmp_path, monkeypatch):
    """A job's folder and environment, with autolog state reset before and undone after."""
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    monkeypatch.setenv("DANLU_JOB_DIR", str(jobdir))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(autolog, "_state", {"active": False, "mlflow": False})
    cls = tensorboard_writer.SummaryWriter
    original_init, original_add_scalar = cls.__init__, cls.add_scalar
    monkeypatch.setattr(tensorboard_writer, "EventFileWriter", tensorboard_writer.EventFileWriter)
    yield jobdir
    cls.__init__, cls.add_scalar = original_init, original_add_scalar
    if "_danlu_patched" in cls.__dict__:
        del cls._danlu_patched
    atexit.unregister(autolog.flush_writers)
    shell = get_ipython()
    if shell is not None and autolog.flush_writers in shell.events.callbacks["post_run_cell"]:
        shell.events.unregister("post_run_cell", autolog.flush_writers)
    for writer in list(autolog._writers):
        writer.close()


def test_default_writer_goes_to_the_job_folder_and_is_registered(job):
    autolog.activate()

    with SummaryWriter() as writer:
        writer.add_scalar("loss", 1.0, 0)

    rank_dir = job / "tensorboard" / "rank-0"
    assert writer.log_dir == str(rank_dir)
    assert list(rank_dir.glob("events.out.tfevents.*"))
    assert (job / "tensorboard" / "logdirs").read_text() == f"{rank_dir.resolve()}\n"


def test_explicit_log_dirs_are_registered_once(job, tmp_path):
    autolog.activate()
    autolog.activate()  # idempotent: the class is patched once

    for _ in range(2):
        SummaryWriter(log_dir=str(tmp_path / "mine")).close()

    assert (job / "tensorboard" / "logdirs").read_text().splitlines() == [str((tmp_path / "mine").resolve())]


def test_other_ranks_write_their_own_folder_without_registering(job, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    autolog.activate()

    SummaryWriter().close()

    assert list((job / "tensorboard" / "rank-1").glob("events.out.tfevents.*"))
    assert not (job / "tensorboard" / "logdirs").exists()


def test_a_job_writes_through_danlus_event_writer_and_tensorboard_reads_every_point(job):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    from danlu.tensorboard.writer import EventFileWriter

    autolog.activate()
    with SummaryWriter() as writer:
        assert isinstance(writer._get_file_writer().event_writer, EventFileWriter)
        for step in range(300):
            writer.add_scalar("loss", step / 7, step)
            writer.add_scalar("acc", 1 - step / 300, step)

    (path,) = (job / "tensorboard" / "rank-0").glob("events.out.tfevents.*")
    events = [event_pb2.Event.FromString(record) for record in RawEventFileLoader(str(path)).Load()]  # CRC-checked
    points = [(v.tag, e.step, v.simple_value) for e in events for v in e.summary.value]
    assert points == [
        (tag, step, pytest.approx(value, rel=1e-6))
        for step in range(300)
        for tag, value in (("loss", step / 7), ("acc", 1 - step / 300))
    ]


def test_forwarder_finds_what_an_unconfigured_writer_wrote(job):
    autolog.activate()
    with SummaryWriter() as writer:
        for step in range(3):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
    client = RecordingClient()

    MetricForwarder(client, "run-1", job / "tensorboard" / "logdirs", []).flush()

    assert [(key, step) for key, step, _ in client.points] == [("loss", 0), ("loss", 1), ("loss", 2)]
